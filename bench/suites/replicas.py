"""Throughput of engine replicas (app.py --replicas) against one engine, at K concurrent /v1 clients.

    python -m bench replicas [--model DIR] [--layouts "1,2"] [--clients 8] [--requests 24] [--steps N]
                             [--gpus-per-replica 0.5] [--app-args="--device cuda"]

For each layout (1: `python app.py` alone, no Ray; N > 1: `--replicas N`), starts app.py on a free port,
waits until every engine is ready, sends a warm-up request per engine, then --requests image requests
(think + recaption, size auto, the checkpoint's steps unless --steps) from --clients threads with the
official `openai` client, and reports requests per second, the speed-up over the first layout, and the
median and 90th percentile wall time of a request. On one GPU, `--gpus-per-replica 0.5` puts two one-rank
replicas on it (a model that fits twice); on the CPU the replicas share the cores.
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ..report import Col, Output

DRY = False
CUDA = False                   # runs on the CPU as it is (the embedded model)
ROOT = Path(__file__).resolve().parents[2]
PROMPTS = ["two red circles and a blue star on a black background", "a large green square, wide image",
           "three small yellow triangles along the bottom", "a purple diamond at the top left"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="", help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--layouts", default="1,2", help="engine counts to compare, 1 = app.py without --replicas")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=24, help="timed requests per layout")
    ap.add_argument("--steps", type=int, default=0, help="denoise steps (0: the checkpoint's default)")
    ap.add_argument("--gpus-per-replica", default="", help="passed to app.py with --replicas (0.5: two per GPU)")
    ap.add_argument("--timeout", type=float, default=400, help="seconds to wait for the engines")
    ap.add_argument("--app-args", default="", help="more options for app.py, as one string")


def wait_ready(url: str, proc: subprocess.Popen, engines: int, timeout: float) -> float:
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise SystemExit(f"app.py exited with {proc.returncode} before serving")
        try:
            h = httpx.get(url + "/health", timeout=5).json()
            if h.get("state") in ("ready", "busy") and h.get("replicas_up", 1) >= engines:
                return time.monotonic() - t0
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"{engines} engine(s) not ready at {url} after {timeout:.0f} s")


def measure(args: argparse.Namespace, model: Path, engines: int, out: Output) -> dict:
    import openai
    from engine.parallel.groups import free_port
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    flags = ["--replicas", str(engines)] if engines > 1 else []
    if engines > 1 and args.gpus_per_replica:
        flags += ["--gpus-per-replica", args.gpus_per_replica]
    cmd = [sys.executable, "app.py", "--api-only", "--port", str(port), "--model", str(model), *flags,
           *shlex.split(args.app_args)]
    out.out_dir.mkdir(parents=True, exist_ok=True)
    log = (out.out_dir / f"replicas-app-{engines}.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    extra = {"bot_task": "think_recaption"} | ({"num_inference_steps": args.steps} if args.steps else {})
    try:
        up_s = wait_ready(url, proc, engines, args.timeout)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)

        def one(i: int) -> float:
            t = time.monotonic()
            client.images.generate(prompt=PROMPTS[i % len(PROMPTS)], extra_body={**extra, "seed": i})
            return time.monotonic() - t

        with ThreadPoolExecutor(args.clients) as pool:
            list(pool.map(one, range(engines)))                      # warm-up: one per engine
            t0 = time.monotonic()
            walls = sorted(pool.map(one, range(args.requests)))
            total = time.monotonic() - t0
    finally:
        proc.terminate()
        proc.wait(120)
        log.close()
    row = dict(engines=engines, command=" ".join(cmd[1:]), up_s=up_s, total_s=total, rps=args.requests / total,
               p50_s=statistics.median(walls), p90_s=walls[int(0.9 * (len(walls) - 1))])
    out.say(f"{engines} engine(s): {row['rps']:.2f} requests/s, median {row['p50_s']:.2f} s (up in {up_s:.0f} s)")
    return row


def run(args: argparse.Namespace, out: Output) -> bool:
    from engine import EMBEDDED_MODEL
    model = Path(args.model) if args.model else EMBEDDED_MODEL
    rows = [measure(args, model, int(n), out) for n in args.layouts.split(",")]
    for r in rows:
        r["speedup"] = r["rps"] / rows[0]["rps"]
    out.data.update(model=str(model), clients=args.clients, requests=args.requests, rows=rows)
    out.table(rows, [Col("engines", "engines"), Col("requests/s", "rps", ".2f"), Col("x first", "speedup", ".2f"),
                     Col("median s", "p50_s", ".2f"), Col("p90 s", "p90_s", ".2f"), Col("up s", "up_s", ".0f")],
              title=f"{args.requests} requests from {args.clients} clients, {model.name}")
    return True
