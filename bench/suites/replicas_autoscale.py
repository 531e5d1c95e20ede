"""Ray Serve's autoscaler on the engine replicas, live: from --min-replicas to more under queue depth, and
back once the load stops, as `/health` reports it.

    python -m bench replicas-autoscale [--model DIR] [--clients 6] [--upscale-delay 2] [--downscale-delay 15]
                                       [--app-args="--device cuda --gpus-per-replica 0.5"]

Starts `app.py --api-only --replicas 1 --min-replicas 1 --max-replicas 2 --max-batch 1` (Ray Serve's metric
push interval set to 1 s for the run, through its own environment variables, so the delays are what counts),
keeps --clients /v1 clients sending image requests until `/health` shows two replicas up, then stops them
and waits for the autoscaler to go back to one. Reports the timeline (replicas_target, replicas_up, queue)
and the seconds each step took: target 2, second replica up, back to 1. A check: it fails if either move
does not happen within --timeout. On the CPU (the embedded model) it needs no GPU; it is a bench, not a
test, because it starts its own Ray and loads a second replica: minutes on a 2-core CI machine.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import threading
import time
from pathlib import Path

from ..report import Col, Output
from .replicas import PROMPTS, ROOT, wait_ready

DRY = False
CUDA = False                   # runs on the CPU as it is (the embedded model)
RAY_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",      # Ray Serve's defaults: 10 s
           "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="", help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients while loading the pool")
    ap.add_argument("--steps", type=int, default=8, help="denoise steps of each request")
    ap.add_argument("--upscale-delay", type=float, default=2.0)
    ap.add_argument("--downscale-delay", type=float, default=15.0)
    ap.add_argument("--timeout", type=float, default=400, help="seconds allowed for each move")
    ap.add_argument("--app-args", default="", help="more options for app.py, as one string")


def run(args: argparse.Namespace, out: Output) -> bool:
    import httpx
    import openai
    from engine import EMBEDDED_MODEL
    from engine.parallel.groups import free_port
    model = Path(args.model) if args.model else EMBEDDED_MODEL
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "app.py", "--api-only", "--port", str(port), "--model", str(model), "--replicas", "1",
           "--min-replicas", "1", "--max-replicas", "2", "--max-batch", "1", "--max-queue", str(args.clients),
           "--upscale-delay", str(args.upscale_delay), "--downscale-delay", str(args.downscale_delay),
           *shlex.split(args.app_args)]
    out.out_dir.mkdir(parents=True, exist_ok=True)
    log = (out.out_dir / "replicas-autoscale-app.log").open("w")
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **RAY_ENV})
    timeline: list[dict] = []
    marks: dict[str, float] = {}
    stop = threading.Event()
    t0 = time.monotonic()

    def sample() -> dict:
        h = httpx.get(url + "/health", timeout=5).json()
        row = dict(t_s=round(time.monotonic() - t0, 1), target=h.get("replicas_target"), up=h.get("replicas_up"),
                   running=h.get("running"), waiting=h.get("waiting"))
        if not timeline or any(row[k] != timeline[-1][k] for k in ("target", "up", "running", "waiting")):
            timeline.append(row)
        return row

    def until(cond, what: str) -> bool:
        deadline = time.monotonic() + args.timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                out.say(f"app.py exited ({proc.returncode}) while waiting for {what}")
                return False
            if cond(sample()):
                marks[what] = time.monotonic() - t0
                out.say(f"{what}: {marks[what]:.1f} s")
                return True
            time.sleep(0.5)
        out.say(f"{what}: not reached within {args.timeout:.0f} s")
        return False

    def client_loop(i: int) -> None:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)
        n = 0
        while not stop.is_set():
            try:
                client.images.generate(prompt=PROMPTS[(i + n) % len(PROMPTS)], size="256x256",
                                       extra_body={"bot_task": "image", "num_inference_steps": args.steps, "seed": n})
            except openai.APIError as e:                      # a 429 while the queue is full: keep pressing
                if getattr(e, "status_code", None) != 429:
                    out.say(f"client {i}: {e}")
                time.sleep(0.2)
            n += 1

    ok = False
    clients = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(args.clients)]
    try:
        marks["one replica ready"] = wait_ready(url, proc, 1, args.timeout)
        t0 = time.monotonic()                                  # the timeline starts with the load
        for c in clients:
            c.start()
        ok = until(lambda r: (r["target"] or 0) >= 2, "autoscaler target 2") and \
            until(lambda r: (r["up"] or 0) >= 2, "second replica up")
        stop.set()
        for c in clients:
            c.join(600)
        marks["load stopped"] = time.monotonic() - t0
        ok = ok and until(lambda r: r["target"] == 1 and r["up"] == 1, "back to one replica")
    finally:
        stop.set()
        proc.terminate()
        proc.wait(120)
        log.close()
    out.data.update(model=str(model), command=" ".join(cmd[1:]), ray_env=RAY_ENV, marks=marks, timeline=timeline)
    out.table(timeline, [Col("t s", "t_s", ".1f"), Col("target", "target"), Col("up", "up"), Col("running", "running"),
                         Col("waiting", "waiting")], title=f"{args.clients} clients from t = 0 until two replicas are up")
    return ok
