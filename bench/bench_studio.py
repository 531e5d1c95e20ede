"""Wall time of studio requests, end to end through the web server (what a user waits for).

    python bench/bench_studio.py [--model DIR] [--requests 3] [--steps N] [app.py options...]

Starts `python app.py` on a free port, waits for the page, sends `--requests` /t2i requests through
gradio_client (think + recaption, size auto, the checkpoint's default steps unless --steps), and prints
each request's wall time and the timings the studio reports. The first request is a warm-up and is
reported apart.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=3)
    ap.add_argument("--steps", type=int, default=0, help="denoise steps (0: the checkpoint's default)")
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the page")
    args, app_args = ap.parse_known_args(argv)
    from gradio_client import Client

    from engine import EMBEDDED_MODEL
    from engine.parallel.groups import free_port

    port = free_port()
    proc = subprocess.Popen([sys.executable, "app.py", "--port", str(port), *app_args], cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url, t0, client = f"http://127.0.0.1:{port}/", time.monotonic(), None
        while client is None:
            if proc.poll() is not None:
                raise SystemExit(f"app.py exited with {proc.returncode} before serving")
            if time.monotonic() - t0 > args.timeout:
                raise SystemExit(f"no page at {url} after {args.timeout:.0f}s")
            try:
                client = Client(url, verbose=False)
            except Exception:
                time.sleep(1)
        print(f"page up in {time.monotonic() - t0:.1f}s")
        prompts = ["two red circles and a blue star on a black background", "a large green square, wide image",
                   "three small yellow triangles along the bottom", "a purple diamond at the top left"]
        model = Path(app_args[app_args.index("--model") + 1]) if "--model" in app_args else EMBEDDED_MODEL
        gen = json.loads((model / "generation_config.json").read_text())
        steps = args.steps or gen["diff_infer_steps"]
        print(f"{model}: {steps} steps, guidance {gen['diff_guidance_scale']}")
        for i in range(args.requests + 1):
            t = time.monotonic()
            status, _, timings, _ = client.predict(
                prompts[i % len(prompts)], "think_recaption", "auto", i, False, steps, gen["diff_guidance_scale"],
                "en_unified", "", gen["max_new_tokens"], api_name="/t2i")      # (status, image, timings, reasoning)
            wall = time.monotonic() - t
            label = "warm-up" if i == 0 else f"request {i}"
            print(f"{label}: {wall:.2f}s wall | status {status!r} | timings {timings!r}")
    finally:
        proc.terminate()
        proc.wait(30)
    return 0


if __name__ == "__main__":
    sys.exit(main())
