"""Wall time of studio requests, end to end through the web server (what a user waits for).

    python -m bench studio [--model DIR] [--requests 3] [--steps N] [--app-args="--device cuda ..."]

Starts `python app.py` on a free port (the embedded model unless --model; on any machine: the CPU is
enough), waits for the page, sends --requests /t2i requests through gradio_client (think + recaption,
size auto, the checkpoint's default steps unless --steps), and reports each request's wall time and the
timings the studio reports. The first request is a warm-up and is reported apart.
"""
from __future__ import annotations

import argparse
import json
import shlex
import subprocess
import sys
import time
from pathlib import Path

from ..report import Col, Output
from ..timing import Stages

DRY = False
CUDA = False                   # runs on the CPU as it is
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["two red circles and a blue star on a black background", "a large green square, wide image",
           "three small yellow triangles along the bottom", "a purple diamond at the top left"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="", help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="denoise steps (0: the checkpoint's default)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the page")
    ap.add_argument("--app-args", default="", help="more options for app.py, as one string")


def wait_for_page(url: str, proc: subprocess.Popen, timeout: float):
    from gradio_client import Client
    t0 = time.monotonic()
    while True:
        if proc.poll() is not None:
            raise SystemExit(f"app.py exited with {proc.returncode} before serving")
        if time.monotonic() - t0 > timeout:
            raise SystemExit(f"no page at {url} after {timeout:.0f}s")
        try:
            return Client(url, verbose=False)
        except Exception:  # noqa: BLE001 - not up yet
            time.sleep(1)


def run(args: argparse.Namespace, out: Output) -> bool:
    from engine import EMBEDDED_MODEL
    from engine.parallel.groups import free_port

    model = Path(args.model) if args.model else EMBEDDED_MODEL
    port = free_port()
    app = [sys.executable, "app.py", "--port", str(port), "--model", str(model), *shlex.split(args.app_args)]
    proc = subprocess.Popen(app, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = []
    try:
        clock = Stages()
        with clock("page"):
            client = wait_for_page(f"http://127.0.0.1:{port}/", proc, args.timeout)
        out.say(f"page up in {clock.seconds['page']:.1f} s")
        gen = json.loads((model / "generation_config.json").read_text())
        steps = args.steps or gen["diff_infer_steps"]
        out.say(f"{model}: {steps} steps, guidance {gen['diff_guidance_scale']}")
        for i in range(args.requests + 1):
            label = "warm-up" if i == 0 else f"request {i}"
            with clock(label):
                status, _, timings, _ = client.predict(        # (status, image, timings, reasoning)
                    PROMPTS[i % len(PROMPTS)], "think_recaption", "auto", i, False, steps, gen["diff_guidance_scale"],
                    "en_unified", "", gen["max_new_tokens"], api_name="/t2i")
            rows.append(dict(request=label, wall_s=clock.seconds[label], status=status, timings=timings))
    finally:
        proc.terminate()
        proc.wait(30)
    out.data.update(model=str(model), steps=steps, rows=rows)
    out.table(rows, [Col("request", "request"), Col("wall s", "wall_s", ".2f"), Col("status", "status"),
                     Col("timings the studio reports", "timings")])
    return True
