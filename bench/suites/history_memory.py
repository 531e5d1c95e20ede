"""History images: the memory a chat request with a long history takes where the server prepares it.

    python -m bench history-memory                  # python app.py on the embedded model, 20 requests (CPU)
    python -m bench history-memory --in-process --requests 3 --dry --model DIR

A /v1/chat/completions body of 8 earlier turns, each with 3 reference images and the image the model made
(32 PNGs of 4096x4096, each about 50 KB compressed: about 2.5 MB of JSON), asking for a 256x256 image in 2
steps, is sent --requests times, one after the other.

Served (the default): to `python app.py --api-only`, loopback only. The start is the server process's
resident memory (RSS) once it is up and has served one ordinary chat request (no images; the same size and
steps) and the engine is idle again: what the server holds before any history request. Its RSS is sampled
every few milliseconds throughout (the peak above the start during each request) and read after each once
the engine is idle again (what stays); the engine worker's RSS beside it. The check: the server's RSS after
the last request within 10% of the start.

--in-process: the body parsed and admitted in this process, as the server does it (engine/serve/
openai_params.py `parse_chat`, then engine/serve/admission.py `admit`: the request prepared, the images the
history policy shows read once into what the model consumes, the others checked by their headers), with no
engine; the start is this process's RSS with the body built. The prepared request's pickled size is what
would cross the pipe to the engine's worker. The CI test (tests/test_history_memory.py) runs this form.
Figures in docs/benchmarks.md."""
from __future__ import annotations

import argparse
import base64
import gc
import io
import json
import os
import pickle
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

from ..report import Col, Output
from ..served import ServedApp

DRY = True
CUDA = False
TURNS, REFS, SIDE = 8, 3, 4096
OUTPUT = {"height": 256, "width": 256, "num_inference_steps": 2}     # what each request asks the engine for
RSS_GROWTH = 0.10              # the served check: the server's RSS after the last request over the start
READY_TIMEOUT_S = 300


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", help="checkpoint folder (its small files only; default: the embedded model)")
    ap.add_argument("--requests", type=int, default=20, help="requests sent one after the other")
    ap.add_argument("--in-process", action="store_true",
                    help="parse and admit the body in this process (no app.py, no engine)")


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
    return json.dumps({"model": model, "messages": messages, "modalities": ["image"], "extra_body": OUTPUT}).encode()


class RssSampler:
    """The resident memory of process `pid` (this one by default), sampled by a thread every `every`
    seconds: `peak` since `reset`."""

    def __init__(self, pid: "int | str" = "self", every: float = 0.002):
        self.pid, self.every, self.peak, self._stop = pid, every, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open(f"/proc/{self.pid}/statm") as f:
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


def in_process(folder: Path, requests: int, body: bytes) -> dict:
    """`requests` chat requests of `body` parsed and admitted one after the other, each in a thread of a
    pool as the server's routes do it (asyncio.to_thread: a thread's allocations come from its own glibc
    arena): RSS in MiB at the start (the body built), its peak during each request and what stays after it,
    the prepared form's size."""
    from engine.serve.admission import admit
    from engine.serve.info import ModelInfo
    from engine.serve.openai_params import UploadLimits, parse_chat
    from engine.runtime.events import Error
    info, mib = ModelInfo.from_folder(folder), 1 << 20
    limits = UploadLimits()

    def prepare(k: int) -> int:
        """The pickled size of request k's prepared form."""
        params = parse_chat(json.loads(body), limits, info.name)
        admitted = admit(info, params.request, [], None)
        if isinstance(admitted, Error):
            raise RuntimeError(f"request {k} refused: {admitted.message}")
        return len(pickle.dumps(admitted[1]))

    sampler, pool = RssSampler(), ThreadPoolExecutor(2)
    gc.collect()
    start = sampler.reset()
    rows = []
    try:
        for k in range(requests):
            t0 = time.perf_counter()
            pipe = pool.submit(prepare, k).result()
            seconds = time.perf_counter() - t0
            gc.collect()
            time.sleep(0.02)                  # a sample after the request's memory went back
            rows.append({"request": k + 1, "seconds": seconds, "peak_mib": (sampler.peak - start) / mib,
                         "after_mib": (sampler.rss() - start) / mib, "prepared_kib": pipe / 1024})
            sampler.reset()
    finally:
        sampler.close()
        pool.shutdown()
    return {"start_mib": start / mib, "rows": rows}


def served(folder: Path, requests: int, body: bytes, out: Output) -> dict:
    """`requests` chat requests of `body` sent to `python app.py` one after the other: the server's RSS in
    MiB at the start (up, one ordinary request served, idle), its peak during each request and what stays
    after it (the engine idle again), the worker's RSS after it."""
    log = Path(tempfile.mkdtemp(prefix="history-memory-")) / "app.log"
    app = ServedApp("--model", str(folder), "--api-only", log=log)
    mib, rows = 1 << 20, []
    try:
        out.say(f"app.py ready in {app.wait_ready(READY_TIMEOUT_S):.1f} s; its log: {log}")
        with httpx.Client(base_url=app.url, timeout=READY_TIMEOUT_S) as c:
            first = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "a red circle"}],
                                                          "modalities": ["image"], "extra_body": OUTPUT})
            if first.status_code != 200:
                raise RuntimeError(f"the ordinary request: {first.status_code} {first.text[:300]}")
            app.wait_idle(60)
            sampler = RssSampler(app.proc.pid)
            try:
                time.sleep(0.2)
                start = sampler.reset()
                for k in range(requests):
                    t0 = time.perf_counter()
                    r = c.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
                    seconds = time.perf_counter() - t0
                    if r.status_code != 200:
                        raise RuntimeError(f"request {k + 1}: {r.status_code} {r.text[:300]}")
                    app.wait_idle(60)
                    time.sleep(0.2)          # a sample after the request's memory went back
                    worker = sum(v for name, v in app.rss_by_process().items() if name.startswith("worker"))
                    rows.append({"request": k + 1, "seconds": seconds, "peak_mib": (sampler.peak - start) / mib,
                                 "after_mib": (sampler.rss() - start) / mib, "worker_mib": worker / mib})
                    sampler.reset()
            finally:
                sampler.close()
    finally:
        app.stop()
    return {"start_mib": start / mib, "rows": rows}


def run(args: argparse.Namespace, out: Output) -> bool:
    from engine import EMBEDDED_MODEL
    folder = Path(args.model or EMBEDDED_MODEL)
    if args.dry and args.model is None and not (folder / "config.json").exists():
        raise SystemExit("--dry needs --model (no embedded model in assets/)")
    from engine.serve.info import ModelInfo
    body = history_body(ModelInfo.from_folder(folder).name)
    out.say(f"chat body: {len(body) / (1 << 20):.2f} MiB, {TURNS} turns x {REFS + 1} PNGs of {SIDE}x{SIDE}")
    where = "parsed and admitted in one process" if args.in_process else "sent to python app.py"
    got = in_process(folder, args.requests, body) if args.in_process else served(folder, args.requests, body, out)
    rows, start = got["rows"], got["start_mib"]
    out.data.update(body_mib=len(body) / (1 << 20), start_mib=start, rows=rows, checkpoint=str(folder),
                    served=not args.in_process)
    last = (rows[-1]["after_mib"] if rows else 0.0) / start
    cols = [Col("request", "request"), Col("s", "seconds", ".2f"), Col("peak MiB above start", "peak_mib", ".1f"),
            Col("held after MiB", "after_mib", ".1f")]
    cols += [Col("prepared KiB", "prepared_kib", ".1f")] if args.in_process else [Col("worker MiB", "worker_mib", ".0f")]
    whose = "this process's" if args.in_process else "the server's"
    out.table(rows, cols, f"A {len(body) / (1 << 20):.2f} MiB chat body with {TURNS} x {REFS + 1} history images of "
                          f"{SIDE}x{SIDE}, {where} {len(rows)} times ({whose} RSS at the start {start:.0f} MiB; "
                          f"after the last {last:+.1%})")
    if args.in_process:
        return bool(rows)
    ok = bool(rows) and last <= RSS_GROWTH
    out.say(f"check: the server's RSS after {len(rows)} requests within {RSS_GROWTH:.0%} of the start: "
            f"{'ok' if ok else 'FAILED'} ({last:+.1%})")
    out.data.update(rss_growth=last, checks={f"server RSS within {RSS_GROWTH:.0%} of the start": ok})
    return ok
