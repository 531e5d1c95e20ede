"""History images: the memory a chat request with a long history takes where the server prepares it.

    python -m bench history-memory                  # the embedded model's checkpoint, 20 requests (CPU)
    python -m bench history-memory --requests 3 --dry

A /v1/chat/completions body of 8 earlier turns, each with 3 reference images and the image the model made
(32 PNGs of 4096x4096, each about 50 KB compressed: about 2.5 MB of JSON), is parsed and admitted --requests
times in one process, as the server does it (engine/serve/openai_params.py `parse_chat`, then
engine/serve/admission.py `admit`: the request prepared, the images the history policy shows read once into
what the model consumes, the others checked by their headers). The process's resident memory (RSS) is
sampled every few milliseconds throughout: its peak above the start, and what it holds after each request
(the request and its prepared form dropped). The prepared request's pickled size is what would cross the
pipe to the engine's worker. Figures in docs/benchmarks.md."""
from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import os
import pickle
import threading
import time
from pathlib import Path

from ..report import Col, Output

DRY = True
CUDA = False
TURNS, REFS, SIDE = 8, 3, 4096


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="checkpoint folder (its small files only; default: the embedded model)")
    ap.add_argument("--requests", type=int, default=20, help="requests prepared one after the other")


def _png(color: tuple[int, int, int], side: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, "PNG")
    return buf.getvalue()


def history_body(model: str, turns: int = TURNS, side: int = SIDE) -> bytes:
    """The chat body for the served `model`: `turns` earlier turns (a user message with REFS images, the assistant's answer with
    its reasoning and its image), then the new instruction. Four distinct PNGs (one a position in a turn)."""
    urls = ["data:image/png;base64," + base64.b64encode(_png((40 * k, 200 - 40 * k, 90), side)).decode()
            for k in range(REFS + 1)]
    messages = []
    for t in range(turns):
        parts = [{"type": "image_url", "image_url": {"url": u}} for u in urls[:REFS]]
        messages.append({"role": "user", "content": [{"type": "text", "text": f"edit number {t}"}] + parts})
        messages.append({"role": "assistant", "reasoning_content": f"<think>turn {t}</think>",
                         "content": [{"type": "image_url", "image_url": {"url": urls[REFS]}}]})
    messages.append({"role": "user", "content": "make it blue"})
    return json.dumps({"model": model, "messages": messages}).encode()


class RssSampler:
    """The process's resident memory, sampled by a thread every `every` seconds: `peak` since `reset`."""

    def __init__(self, every: float = 0.002):
        self.every, self.peak, self._stop = every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    @staticmethod
    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.rss())
            time.sleep(self.every)

    def reset(self) -> int:
        self.peak = self.rss()
        return self.peak

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def soak(folder: Path, requests: int, body: bytes) -> dict:
    """`requests` chat requests of `body` parsed and admitted one after the other: RSS in MiB at the start
    (the body built), its peak during each request and what stays after it, the prepared form's size."""
    from engine.serve.admission import admit
    from engine.serve.info import ModelInfo
    from engine.serve.openai_params import UploadLimits, parse_chat
    from engine.runtime.events import Error
    info, mib = ModelInfo.from_folder(folder), 1 << 20
    limits = UploadLimits()
    sampler = RssSampler()
    gc.collect()
    start = sampler.reset()
    rows = []
    try:
        for k in range(requests):
            t0 = time.perf_counter()
            params = parse_chat(json.loads(body), limits, info.name)
            admitted = admit(info, params.request, [], None)
            if isinstance(admitted, Error):
                raise RuntimeError(f"request {k} refused: {admitted.message}")
            pipe = len(pickle.dumps(admitted[1]))
            seconds = time.perf_counter() - t0
            del params, admitted
            gc.collect()
            time.sleep(0.02)                  # a sample after the request's memory went back
            rows.append({"request": k + 1, "seconds": seconds, "peak_mib": (sampler.peak - start) / mib,
                         "after_mib": (sampler.rss() - start) / mib, "prepared_kib": pipe / 1024})
            sampler.reset()
    finally:
        sampler.close()
    return {"start_mib": start / mib, "rows": rows}


def run(args: argparse.Namespace, out: Output) -> bool:
    from engine import EMBEDDED_MODEL
    folder = Path(args.model or EMBEDDED_MODEL)
    if args.dry and args.model is None and not (folder / "config.json").exists():
        raise SystemExit("--dry needs --model (no embedded model in assets/)")
    from engine.serve.info import ModelInfo
    body = history_body(ModelInfo.from_folder(folder).name)
    out.say(f"chat body: {len(body) / (1 << 20):.2f} MiB, {TURNS} turns x {REFS + 1} PNGs of {SIDE}x{SIDE}")
    got = soak(folder, args.requests, body)
    rows = got["rows"]
    out.data.update(body_mib=len(body) / (1 << 20), start_mib=got["start_mib"], rows=rows, checkpoint=str(folder))
    out.table(rows, [Col("request", "request"), Col("s", "seconds", ".2f"),
                     Col("peak MiB above start", "peak_mib", ".1f"), Col("held after MiB", "after_mib", ".1f"),
                     Col("prepared KiB", "prepared_kib", ".1f")],
              f"A {len(body) / (1 << 20):.2f} MiB chat body with {TURNS} x {REFS + 1} history images of {SIDE}x{SIDE}, "
              f"parsed and admitted {len(rows)} times (RSS at start {got['start_mib']:.0f} MiB)")
    return bool(rows)
