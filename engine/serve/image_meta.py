"""What made an image, carried in the PNG itself: the record the page and `/v1` write into every PNG they
return, and read back from a PNG dropped on the page (which restores its settings: the same seed then gives
the same pixels).

Two text chunks, as image tools conventionally write them: `parameters` (the prompt, then one line of
`Name: value` pairs, the form Stable Diffusion tools write and image viewers show) and `hunyuan-studio` (the
whole record as JSON, what the page reads). Both are iTXt (UTF-8: a prompt or reasoning in any script), put
before the pixels (IDAT), where readers that stop at the image data (PIL's `open`) still see them; the
image's own chunks are the engine's, byte for byte.
"""
from __future__ import annotations

import json
import struct
import zlib
from dataclasses import asdict
from typing import Any

from engine.runtime.events import Image, Started, Timings
from engine.runtime.request import Request
from engine.runtime.step_cache import BlockCacheParams, TaylorCacheParams, named_setting
from engine.checkpoint.config import GenerationConfig

RECORD_KEY = "hunyuan-studio"
PARAMETERS_KEY = "parameters"
FORMAT = 1                      # the record's version
SIGNATURE = b"\x89PNG\r\n\x1a\n"
MAX_RECORD_BYTES = 1 << 20      # a record read back: the prompt and the reasoning fit many times over


class NotARecord(ValueError):
    """The bytes are not a PNG, or a PNG without the studio's record (the message says which)."""


def reasoning_text(sections: dict[str, str]) -> str:
    """The thinking and the recaption, as the model wrote them, one after the other (what `/v1` reports as
    `reasoning`, and what a record keeps)."""
    return "\n\n".join(sections[s].strip() for s in ("think", "recaption") if sections.get(s))


def step_cache_name(taylor: TaylorCacheParams | None, block: BlockCacheParams | None) -> str:
    """The named setting (engine.runtime.step_cache.named_setting) of a request's step caches, or "custom"
    for settings no name gives (the record keeps their fields too)."""
    for name in ("none", "taylor", "taylor-enhance", "block"):
        if named_setting(name) == (taylor, block):
            return name
    return "custom"


def image_record(req: Request, started: Started | None, image: Image, model: str, gen: GenerationConfig,
                 reasoning: str, timings: Timings | None = None) -> dict[str, Any]:
    """Every setting that made `image`, as the engine ran it: the request's, with the defaults it resolved
    (the Started event's task, steps, guidance; the checkpoint's generation config for the others)."""
    return {
        "format": FORMAT, "model": model, "prompt": req.prompt,
        "mode": started.bot_task if started else (req.bot_task or gen.bot_task),
        "reasoning": reasoning, "seed": image.seed,
        "steps": started.steps if started else (req.steps or gen.diff_infer_steps),
        "guidance": started.guidance if started else (req.guidance if req.guidance is not None
                                                      else gen.diff_guidance_scale),
        "size": f"{image.width}x{image.height}", "size_asked": req.size or "auto",
        "step_cache": step_cache_name(req.taylor_cache, req.block_cache),
        "taylor_cache": asdict(req.taylor_cache) if req.taylor_cache else None,
        "block_cache": asdict(req.block_cache) if req.block_cache else None,
        "lora": req.lora, "lora_scale": req.lora_scale,
        "system_prompt": req.system_prompt or gen.use_system_prompt,
        "custom_system_prompt": req.custom_system_prompt,
        "max_new_tokens": req.max_new_tokens if req.max_new_tokens is not None else gen.max_new_tokens,
        "references": len(req.images) + sum(len(t.images) for t in req.history),
        "infer_align_image_size": req.stretch,      # references stretched, the output at the first one's aspect
        "image_index": image.index,
        "kernels": started.kernels if started else "",      # "": ours (triton / the reference ops)
        "timings": asdict(timings) if timings is not None else None,
    }


def parameters_text(record: dict[str, Any]) -> str:
    """The record as tools that read a `parameters` chunk show it: the prompt, then the settings."""
    pairs = [("Steps", record.get("steps")), ("Guidance", record.get("guidance")), ("Seed", record.get("seed")),
             ("Size", record.get("size")), ("Model", record.get("model")), ("Reasoning", record.get("mode")),
             ("Step cache", record.get("step_cache")),
             ("Adapter", f"{record['lora']} x{record.get('lora_scale')}" if record.get("lora") else "none"),
             ("System prompt", record.get("system_prompt"))] \
        + ([("Kernels", record["kernels"])] if record.get("kernels") else [])
    return f"{record.get('prompt', '')}\n" + ", ".join(f"{k}: {v}" for k, v in pairs)


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _itxt(keyword: str, text: str) -> bytes:
    # keyword, null, compression flag 0, method 0, language tag "", null, translated keyword "", null, text
    return _chunk(b"iTXt", keyword.encode("latin-1") + b"\0\0\0\0\0" + text.encode("utf-8"))


def with_record(png: bytes, record: dict[str, Any]) -> bytes:
    """`png` with the record's text chunks (any it carried already are replaced)."""
    chunks = [(kind, data) for kind, data in _chunks(png) if not _is_record_chunk(kind, data)]
    out, placed = [SIGNATURE], False
    for kind, data in chunks:
        if kind in (b"IDAT", b"IEND") and not placed:     # before the pixels: readers that stop there see them
            out += [_itxt(PARAMETERS_KEY, parameters_text(record)),
                    _itxt(RECORD_KEY, json.dumps(record, ensure_ascii=False, separators=(",", ":")))]
            placed = True
        out.append(_chunk(kind, data))
    return b"".join(out)


def read_record(png: bytes) -> dict[str, Any]:
    """The record a PNG carries; NotARecord when it is not a PNG or carries none."""
    for kind, data in _chunks(png):
        if kind == b"iTXt" and data.startswith(RECORD_KEY.encode() + b"\0"):
            keyword, rest = data.split(b"\0", 1)
            flag, _method, rest = rest[0], rest[1], rest[2:]
            _lang, _translated, text = rest.split(b"\0", 2)
            if flag:
                text = zlib.decompress(text, bufsize=MAX_RECORD_BYTES)
            try:
                record = json.loads(text.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise NotARecord(f"its {RECORD_KEY} text is not a record ({e})") from None
            if not isinstance(record, dict) or record.get("format") != FORMAT:
                raise NotARecord(f"its {RECORD_KEY} record is of another version ({record.get('format')!r})"
                                 if isinstance(record, dict) else f"its {RECORD_KEY} text is not a record")
            return record
    raise NotARecord("it carries no settings of this studio (a PNG the studio or /v1 saved does)")


def _is_record_chunk(kind: bytes, data: bytes) -> bool:
    return kind in (b"iTXt", b"tEXt", b"zTXt") and data.split(b"\0", 1)[0].decode("latin-1") in (RECORD_KEY,
                                                                                                PARAMETERS_KEY)


def _chunks(png: bytes) -> list[tuple[bytes, bytes]]:
    """(type, data) of every chunk, up to IEND; NotARecord for bytes that are not a whole PNG."""
    if not png.startswith(SIGNATURE):
        raise NotARecord("it is not a PNG file")
    out, pos = [], len(SIGNATURE)
    while pos + 8 <= len(png):
        (length,), kind = struct.unpack(">I", png[pos:pos + 4]), png[pos + 4:pos + 8]
        if pos + 12 + length > len(png):
            break
        out.append((kind, png[pos + 8:pos + 8 + length]))
        pos += 12 + length
        if kind == b"IEND":
            return out
    raise NotARecord("it is not a whole PNG file (it ends before its IEND chunk)")
