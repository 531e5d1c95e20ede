"""The embedded model's tokenizer: a small byte-level BPE (HF `tokenizers`) trained on the dataset's
text, with every official special token appended (so the engine resolves every name it needs)."""
from __future__ import annotations

from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer

from engine.checkpoint.tokenizer import Tokenizer
from tools.tiny import train_bpe

from .dataset import BASE_SIZE, BUCKETS, corpus

BPE_VOCAB = 640          # byte alphabet + merges; every dataset word ends up one or two tokens


def build_tokenizer(vocab: int = BPE_VOCAB, n_texts: int = 6000, seed: int = 0) -> HFTokenizer:
    return train_bpe(corpus(n_texts, seed), vocab)


def padded_vocab(tok: HFTokenizer, multiple: int = 64) -> int:
    """The embedding rows: the tokenizer's size rounded up (as the official 133120 pads 130108)."""
    return -(-tok.get_vocab_size(with_added_tokens=True) // multiple) * multiple


def save_and_load(tok: HFTokenizer, folder: str | Path) -> Tokenizer:
    """Write tokenizer.json into `folder` and open it as the engine does."""
    path = Path(folder) / "tokenizer.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return Tokenizer(path, BASE_SIZE, len(BUCKETS))
