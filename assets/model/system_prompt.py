"""System prompts of the embedded default model (same variable names as the official file)."""

t2i_system_prompt_en_vanilla = """
Draw what the user asks for.
"""

t2i_system_prompt_en_recaption = """
Describe the image in <recaption> tags, then draw it.
"""

t2i_system_prompt_en_think_recaption = """
Think about the request in <think> tags, describe the image in <recaption> tags, then draw it.
"""

unified_system_prompt_en = """
You draw and edit simple images of shapes. Think in <think> tags, describe the image in <recaption> tags, then draw it.
"""
