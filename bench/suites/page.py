"""One request through the page in a real browser against the same request through `/v1`, on the same server
and machine: what the page's streaming (the reasoning as it is written, the step previews, the browser
drawing them) costs the model, which shares the CPU with the browser on a small machine.

    python -m bench page [--model DIR] [--pairs 3] [--steps N] [--seed S] [--app-args="..."]

Starts `python app.py` on a free port (the embedded model unless --model), opens the page in Debian's
chromium (Playwright, headless, 1440x900), then runs --pairs pairs, each the page's Generate (prompt typed,
seed fixed, the page's default reasoning, size auto) and the same request through
`/v1/images/generations` (bot_task, seed, steps, guidance, size auto, max_new_tokens: the page's values),
in alternating order. Per run: the wall time (the page: Generate to Done; /v1: the HTTP call) and the
engine's own ms/token, ms/step and total (the page's from the PNG it saved, /v1's from its response),
and the CPU seconds each part used during it: the engine worker, the studio process (the page's server and
/v1 are served there) and the browser (Chromium and Playwright's driver), which say where a page run's
extra time goes on a machine whose cores they share. A warm-up pair comes first and is reported apart. Also the studio process's CPU while idle (10 s, no
page open, then the page open).
"""
from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import shutil
import statistics
import time
from pathlib import Path

from ..report import Col, Output

DRY = False
CUDA = False                   # runs on the CPU as it is
PROMPT = "two red circles and a blue star on a black background"
# the canvas's finished image (a file of the results, hunyuan-<id>-seed<n>.png; previews are other files)
RESULT = "() => { const i = document.querySelector('#result img'); return i && /hunyuan-/.test(i.src) ? i.src : null; }"
FIGURES = ("wall_s", "ms_token", "ms_step", "engine_s", "cpu_engine", "cpu_studio", "cpu_browser")
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
        "--disable-component-update", "--disable-sync"]


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="", help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--pairs", type=int, default=3, help="page + /v1 pairs after the warm-up pair")
    ap.add_argument("--steps", type=int, default=0, help="denoise steps (0: the checkpoint's default)")
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--timeout", type=float, default=300, help="seconds to wait for the page")
    ap.add_argument("--app-args", default="", help="more options for app.py, as one string")
    ap.add_argument("--threads", type=int, default=0,
                    help="OMP_NUM_THREADS of app.py (0: as this process has it; on a machine shared with other "
                         "jobs, 1 avoids OpenMP's spinning threads waiting on each other)")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_of(pids) -> float:
    """CPU seconds of these processes so far (one that has ended counts 0)."""
    total = 0.0
    for pid in pids:
        try:
            total += cpu_seconds(pid)
        except (OSError, IndexError):
            pass
    return total


def cpu_by_part(app) -> dict[str, float]:
    """CPU seconds so far of the engine workers, the studio process and the browser (this process's
    descendants outside the app: Playwright's driver and Chromium's processes)."""
    from ..served import process_tree
    served = set(process_tree(app.proc.pid))
    browser = [pid for pid in process_tree(os.getpid())[1:] if pid not in served]
    return dict(cpu_engine=cpu_of(app.worker_pids()), cpu_studio=cpu_of([app.proc.pid]), cpu_browser=cpu_of(browser))


def idle_share(pid: int, seconds: float) -> float:
    """The share of one core the process used over `seconds`."""
    before = cpu_seconds(pid)
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / seconds


def engine_figures(timings: dict | None) -> dict:
    t = timings or {}
    return dict(ms_token=t.get("ar_ms_per_token"), ms_step=t.get("dit_ms_per_step"), engine_s=t.get("total_s"))


# Done as the user sees it: a new finished image on the canvas and the status saying so. The page checks it
# itself every 20 ms and notes the time (performance.now()); the bench only waits for that note. Playwright's
# own polling of the same check cost the page ~0.6 ms of its main thread a poll (a call through its injected
# script, with some twenty structured clones, and V8's collector after them): CPU taken from the engine on a
# small machine, which the /v1 run did not pay.
WATCH_DONE = f"""(before) => {{
  window.__benchDone = undefined;
  const t0 = performance.now();
  const id = setInterval(() => {{
    const s = ({RESULT})();
    if (s && s !== before && document.querySelector('#status textarea').value.startsWith('Done')) {{
      clearInterval(id);
      window.__benchDone = performance.now();
    }}
  }}, 20);
  return t0;
}}"""


def page_run(page, prompt: str, seed: int, steps: int) -> dict:
    """Generate on the page with these values; wall time to Done and the engine's figures (from the PNG)."""
    from engine.serve.image_meta import read_record
    page.locator("#prompt textarea").fill(prompt)
    page.locator("#random-seed input").uncheck()
    page.locator("#seed input").fill(str(seed))
    page.locator("#seed input").press("Enter")
    page.locator("#steps input[type=number]").fill(str(steps))
    page.locator("#steps input[type=number]").press("Enter")
    t0 = page.evaluate(WATCH_DONE, page.evaluate(RESULT))      # the page's clock, just before the click
    page.locator("#run").click()
    page.wait_for_function("() => window.__benchDone !== undefined", timeout=600_000, polling=250)
    wall = (page.evaluate("() => window.__benchDone") - t0) / 1e3
    src = page.evaluate(RESULT)
    record = read_record(page.request.get(src).body())
    return dict(wall_s=wall, **engine_figures(record.get("timings")), mode=record["mode"],
                max_new_tokens=record["max_new_tokens"], guidance=record["guidance"], seed=record["seed"])


def api_run(url: str, prompt: str, seed: int, steps: int, mode: str, guidance: float, max_new_tokens: int) -> dict:
    """The same request through /v1: wall time of the call and the engine's figures from the response."""
    import httpx
    body = dict(prompt=prompt, seed=seed, num_inference_steps=steps, guidance_scale=guidance, size="auto",
                bot_task=mode, max_new_tokens=max_new_tokens)
    t0 = time.monotonic()
    r = httpx.post(url.rstrip("/") + "/v1/images/generations", json=body, timeout=600)
    wall = time.monotonic() - t0
    r.raise_for_status()
    j = r.json()
    base64.b64decode(j["data"][0]["b64_json"])          # what a client does with it
    return dict(wall_s=wall, **engine_figures(j.get("timings")))


def run(args: argparse.Namespace, out: Output) -> bool:
    from playwright import sync_api
    from engine import EMBEDDED_MODEL
    from ..served import ServedApp

    chromium = shutil.which("chromium") or "/usr/bin/chromium"
    model = Path(args.model) if args.model else EMBEDDED_MODEL
    gen = json.loads((model / "generation_config.json").read_text())
    steps = args.steps or gen["diff_infer_steps"]
    same = (gen["bot_task"], gen["diff_guidance_scale"], gen["max_new_tokens"])    # the page's defaults
    args.out.mkdir(parents=True, exist_ok=True)
    app = ServedApp("--model", str(model), *shlex.split(args.app_args), log=args.out / "page-app.log",
                    env={"OMP_NUM_THREADS": str(args.threads)} if args.threads else None)
    url = app.url + "/"
    rows: list[dict] = []
    try:
        app.wait_ready(args.timeout)
        out.say(f"{model}: {steps} steps, seed {args.seed}, page vs /v1 on {os.cpu_count()} CPUs")
        idle = idle_share(app.proc.pid, 10)
        with sync_api.sync_playwright() as p:
            browser = p.chromium.launch(executable_path=chromium, args=ARGS)
            page = browser.new_page(viewport={"width": 1440, "height": 900})
            page.goto(url, wait_until="load")
            page.locator("#engine-health .engine-line[data-polled]").wait_for(timeout=60_000)
            idle_open = idle_share(app.proc.pid, 10)
            out.say(f"studio process CPU while idle: {100 * idle:.1f}% of a core, {100 * idle_open:.1f}% with a page open")
            for i in range(args.pairs + 1):
                label = "warm-up" if i == 0 else f"pair {i}"
                order = ("page", "api") if i % 2 else ("api", "page")
                done: dict[str, dict] = {}
                for kind in order:
                    before = cpu_by_part(app)
                    if kind == "page":
                        done["page"] = page_run(page, PROMPT, args.seed, steps)
                    else:
                        done["api"] = api_run(url, PROMPT, args.seed, steps, *same)
                    after = cpu_by_part(app)
                    done[kind].update({k: after[k] - before[k] for k in after})
                ran = done["page"]
                if (ran["mode"], ran["guidance"], ran["max_new_tokens"], ran["seed"]) != (*same, args.seed):
                    raise SystemExit(f"the page ran another request than /v1: {ran} vs {same}")
                for kind in ("page", "api"):
                    rows.append(dict(pair=label, via=kind, **{k: done[kind][k] for k in FIGURES}))
                    out.say(f"{label} {kind}: {rows[-1]}")
            browser.close()
    finally:
        app.stop()
    measured = [r for r in rows if r["pair"] != "warm-up"]
    summary = []
    for key in FIGURES:
        pages = [r[key] for r in measured if r["via"] == "page"]
        apis = [r[key] for r in measured if r["via"] == "api"]
        # each pair's own ratio (its two runs a few seconds apart): robust to the machine's load drifting
        ratios = [b / a for a, b in zip(apis, pages) if a]
        summary.append(dict(figure=key, page=statistics.median(pages), api=statistics.median(apis),
                            ratio=statistics.median(ratios) if ratios else None,
                            ratio_range=f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else ""))
    out.data.update(model=str(model), steps=steps, seed=args.seed, rows=rows, summary=summary,
                    idle_cpu=idle, idle_cpu_page_open=idle_open)
    out.table(rows, [Col("run", "pair"), Col("via", "via"), Col("wall s", "wall_s", ".2f"),
                     Col("ms/token", "ms_token", ".1f"), Col("ms/step", "ms_step", ".1f"),
                     Col("engine s", "engine_s", ".2f"), Col("CPU s engine", "cpu_engine", ".2f"),
                     Col("CPU s studio", "cpu_studio", ".2f"), Col("CPU s browser", "cpu_browser", ".2f")])
    out.table(summary, [Col("median of the pairs", "figure"), Col("page", "page", ".2f"), Col("/v1", "api", ".2f"),
                        Col("page / v1, median of each pair's", "ratio", ".2f"), Col("range", "ratio_range")])
    return True

