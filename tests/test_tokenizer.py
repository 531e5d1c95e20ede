"""Special tokens by name, section-wise encoding, streaming decode, system prompts read as data."""
from __future__ import annotations

import json

import pytest

from engine.checkpoint.prompts import PromptError, SystemPrompts
from engine.checkpoint.tokenizer import OFFICIAL_SPECIAL_TOKENS, TextStream, Tokenizer, TokenizerError


def test_every_official_special_token_resolves(tiny):
    tok = tiny.tok
    ids = [tok.token_id(t) for t in OFFICIAL_SPECIAL_TOKENS]
    assert len(set(ids)) == len(OFFICIAL_SPECIAL_TOKENS)
    sp = tok.special
    assert tok.decode([sp.think]) == "<think>" and tok.decode([sp.ratio[34]]) == "<img_ratio_34>"
    assert len(sp.ratio) == 37


def test_sections_encode_separately(tiny):
    tok = tiny.tok
    ids = tok.encode("Assistant: <think>")
    assert ids[-1] == tok.special.think and tok.encode("Assistant: ") == ids[:-1]
    assert tok.decode(tok.encode("a red circle")) == "a red circle"


def test_missing_special_token_is_named(tiny_dir, tmp_path):
    data = json.loads((tiny_dir / "tokenizer.json").read_text())
    data["added_tokens"] = [t for t in data["added_tokens"] if t["content"] != "<timestep_r>"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    with pytest.raises(TokenizerError, match="<timestep_r>"):
        Tokenizer(tmp_path / "tokenizer.json", 256, 37)


def test_stream_never_splits_a_character(tiny):
    tok = tiny.tok
    text = "red ☀ circle é"
    ids = tok.encode(text)
    stream = TextStream(tok)
    pieces = [stream.push(i) for i in ids]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


def test_system_prompts_are_read_not_executed(tmp_path):
    marker = tmp_path / "executed"
    (tmp_path / "system_prompt.py").write_text(
        f"open({str(marker)!r}, 'w').write('x')\n"
        "unified_system_prompt_en = '''\\n  unified text\\n'''\n"
        "t2i_system_prompt_en_vanilla = 'vanilla'\n")
    sp = SystemPrompts.load(tmp_path)
    assert not marker.exists()
    assert sp.resolve("en_unified", "think_recaption") == "unified text"
    assert sp.resolve("dynamic", "image") == "vanilla"
    assert sp.resolve("None", "image") == ""
    assert sp.resolve("custom", "image", "  mine ") == "mine"
    with pytest.raises(PromptError, match="en_recaption"):
        sp.resolve("en_recaption", "image")
    with pytest.raises(PromptError, match="unknown"):
        sp.resolve("nope", "image")


def test_absent_system_prompt_file_falls_back(tmp_path):
    sp = SystemPrompts.load(tmp_path)
    assert sp.source is None and sp.resolve("None", "think") == ""
    with pytest.raises(PromptError, match="no system_prompt.py"):
        sp.resolve("en_unified", "think")
