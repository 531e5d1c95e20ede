"""What the checkpoint says: config, tokenizer and special tokens, system prompts and bot tasks,
resolution buckets, the safetensors reader (and, with quantized checkpoints, the weight formats).

Reads files only; imports nothing else of `engine` (it is the bottom layer).
"""
