"""Soak (issue 44): minutes of mixed /v1 load against `python app.py` on the embedded model (the CPU is
enough), loopback only, with faults injected; checks that no request is lost, none hangs and nothing leaks.

    python -m bench soak [--minutes 30] [--clients 6] [--fault-every 40] [--stop-s 8] [--patience 300]
                         [--leave 0.25] [--model DIR] [--app-args="..."]

Load: --clients threads send requests back to back, each of a random kind: `generate`, `stream` (SSE),
`edit` (a 512x512 reference, multipart), `chat`, `chat_history` (an earlier turn with a reference and the
image it made, as data URLs): 256x256, 2-3 steps, a short reasoning in a third of them. A share --leave of
them disconnects at a random point (a client timeout, or a stream closed mid-way).
Faults, one every --fault-every seconds, in turn: SIGKILL the engine worker; SIGSTOP it for --stop-s
seconds, then SIGCONT, with an edit (a 512x512 reference) sent to it half a second into the stop (`stop_edit`: the
freeze of issue 44, item 1); a burst of 6 streams that all disconnect after 0.3 s; an 80 MB chat body of 40 M
zeros in an unknown field; an 80 MB chat body of 20 000 numbers of 4000 digits in `metadata`; a 2.4 MB chat
body of 8 earlier turns x 4 PNGs of 4096x4096 (bench/suites/history_memory.py: a legal request, answered).
Probes: /health every 0.5 s (its latency; a probe waits up to 10 s); every 10 s the RSS of the server and
of each engine worker, the server's open files and threads, and the processes below it.

Each request ends as: `image`; `left` (the client disconnected on purpose); `refused` (429 queue full or
503 loading, with Retry-After); `4xx` (a valid request refused: a defect); `error` (an OpenAI-shaped error
that says what happened: the worker was killed or restarted, a step stalled); `lost` (an answer without an
image or an error, a stream that ended without either, a connection closed without an answer); `hung` (no
answer within --patience s).
The checks: none lost, none hung; after the load the engine idle and ready; the server's RSS at the end
within 10% of its level after the warm-up, its open files within 16, its threads within 8 (the routes'
pool grows to min(32, cores + 4) threads as it needs them), as many processes below it as after the
warm-up (every killed worker replaced, none left behind); the 80 MB bodies refused with a 4xx.
/health's latency is reported (a worker stopped while a request is sent to it froze every route up to
issue 44's fix; the probes during each stop say whether it still does).
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import os
import random
import shlex
import signal
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from ..report import Col, Output
from ..served import ServedApp
from .history_memory import history_body

DRY = False
CUDA = False                   # runs on the CPU as it is
KINDS = ("generate", "stream", "edit", "chat", "chat_history")
FAULTS = ("kill", "stop", "disconnects", "zeros", "metadata", "history")
READY_TIMEOUT_S = 300
RSS_GROWTH = 0.10              # the server's RSS at the end over its level after the warm-up
FD_GROWTH = 16
THREAD_GROWTH = 8


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--minutes", type=float, default=30.0, help="how long the load runs (default 30)")
    ap.add_argument("--clients", type=int, default=6, help="concurrent clients")
    ap.add_argument("--fault-every", type=float, default=40.0, help="seconds between injected faults")
    ap.add_argument("--stop-s", type=float, default=8.0, help="how long a SIGSTOP lasts")
    ap.add_argument("--patience", type=float, default=300.0, help="seconds a client waits before it calls a "
                                                                  "request hung")
    ap.add_argument("--leave", type=float, default=0.25, help="share of requests whose client disconnects")
    ap.add_argument("--seed", type=int, default=44)
    ap.add_argument("--model", default="", help="checkpoint folder (default: the embedded model)")
    ap.add_argument("--app-args", default="", help="more options for app.py, as one string")


# ------------------------------------------------------------------------------------------ requests
def png(size: tuple[int, int], seed: int) -> bytes:
    from PIL import Image
    rng = random.Random(seed)
    img = Image.new("RGB", size, tuple(rng.randrange(256) for _ in range(3)))
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@dataclass
class Outcome:
    kind: str
    start: float                 # seconds since the load began
    seconds: float
    result: str                  # image, left, refused, error, lost, hung
    detail: str = ""


def _settings(rng: random.Random, i: int) -> dict:
    think = rng.random() < 1 / 3
    return {"num_inference_steps": rng.choice((2, 3)), "seed": i, "bot_task": "think" if think else "image",
            **({"max_new_tokens": 8} if think else {})}


def _answer(r: httpx.Response, has_image) -> tuple[str, str]:
    """(result, detail) of a whole (not streamed) answer."""
    try:
        body = r.json()
    except ValueError:
        return "lost", f"{r.status_code}: not JSON: {r.text[:120]}"
    if r.status_code == 200:
        return ("image", "") if has_image(body) else ("lost", f"200 without an image: {str(body)[:120]}")
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or not err.get("message"):
        return "lost", f"{r.status_code} without an error message: {r.text[:120]}"
    if r.status_code == 429 or err.get("code") == "engine_loading":
        return "refused", f"{r.status_code} {err.get('code')}, retry after {r.headers.get('retry-after') or 1}"
    if 400 <= r.status_code < 500:          # a valid request refused: a defect (of the server or this bench)
        return "4xx", f"{r.status_code} {err['message'][:120]}"
    return "error", f"{r.status_code} {err['message'][:120]}"


def send(kind: str, url: str, rng: random.Random, i: int, leave_after: float | None, patience: float,
         images: dict[str, bytes]) -> tuple[str, str]:
    """One request of `kind`; (result, detail). `leave_after`: disconnect after that many seconds."""
    timeout = httpx.Timeout(leave_after if leave_after is not None else patience, connect=10)
    extra = _settings(rng, i)
    try:
        with httpx.Client(timeout=timeout) as c:
            if kind == "generate":
                r = c.post(url + "/v1/images/generations", json={"prompt": f"soak {i}", "size": "256x256", **extra})
                return _answer(r, lambda b: bool(b["data"][0].get("b64_json")))
            if kind == "stream":
                return _stream(c, url, {"prompt": f"soak {i}", "size": "256x256", "stream": True,
                                        "partial_images": 1, **extra}, leave_after)
            if kind == "edit":
                form = {"prompt": f"soak edit {i}", "size": "256x256", **{k: str(v) for k, v in extra.items()}}
                r = c.post(url + "/v1/images/edits", files=[("image", ("ref.png", images["ref"], "image/png"))],
                           data=form)
                return _answer(r, lambda b: bool(b["data"][0].get("b64_json")))
            messages = [{"role": "user", "content": f"soak chat {i}"}]
            if kind == "chat_history":
                ref, made = ({"type": "image_url", "image_url": {"url": data_url(images[k])}} for k in ("ref", "made"))
                messages = [{"role": "user", "content": [ref, {"type": "text", "text": "a red circle"}]},
                            {"role": "assistant", "content": [made]},
                            {"role": "user", "content": f"make it blue {i}"}]
            r = c.post(url + "/v1/chat/completions", json={"messages": messages, "modalities": ["image"],
                                                           "extra_body": {"height": 256, "width": 256, **extra}})
            return _answer(r, _chat_image)
    except httpx.TimeoutException:
        return ("left", "") if leave_after is not None else ("hung", f"no answer in {patience:.0f} s")
    except httpx.HTTPError as e:
        return "lost", f"{type(e).__name__}: {e}"


def post_chat(url: str, body: bytes, patience: float) -> tuple[str, str]:
    """A chat request sent as the bytes `body`; (result, detail), as `send` gives them."""
    try:
        r = httpx.post(url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"},
                       timeout=httpx.Timeout(patience, connect=10))
        return _answer(r, _chat_image)
    except httpx.TimeoutException:
        return "hung", f"no answer in {patience:.0f} s"
    except httpx.HTTPError as e:
        return "lost", f"{type(e).__name__}: {e}"


def _chat_image(body: dict) -> bool:
    return body["choices"][0]["message"]["content"][0]["image_url"]["url"].startswith("data:image/")


def _stream(c: httpx.Client, url: str, body: dict, leave_after: float | None) -> tuple[str, str]:
    t0 = time.monotonic()
    with c.stream("POST", url + "/v1/images/generations", json=body) as r:
        if r.status_code != 200:
            r.read()
            return _answer(r, lambda b: False)
        for line in r.iter_lines():
            if leave_after is not None and time.monotonic() - t0 > leave_after:
                return "left", ""
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return "error", f"stream: {str(event['error'].get('message'))[:120]}"
            if event.get("type", "").endswith(".completed"):
                return ("image", "") if event.get("b64_json") else ("lost", "completed without an image")
    return "lost", "the stream ended without an image or an error"


# ------------------------------------------------------------------------------------------ the run
@dataclass
class Soak:
    app: ServedApp
    args: argparse.Namespace
    t0: float = field(default_factory=time.monotonic)
    outcomes: list[Outcome] = field(default_factory=list)
    probes: list[tuple[float, float, int]] = field(default_factory=list)     # (t, latency s, status)
    samples: list[dict] = field(default_factory=list)                       # RSS, fds, threads over time
    faults: list[dict] = field(default_factory=list)
    stops: list[tuple[float, float]] = field(default_factory=list)          # SIGSTOP windows
    restarts: list[tuple[float, str]] = field(default_factory=list)         # (t, why), as /health said
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)

    def now(self) -> float:
        return time.monotonic() - self.t0

    def record(self, kind: str, start: float, result: tuple[str, str]) -> None:
        with self.lock:
            self.outcomes.append(Outcome(kind, start, self.now() - start, *result))

    def client(self, n: int, images: dict[str, bytes]) -> None:
        rng = random.Random(self.args.seed * 1000 + n)
        i = 0
        while not self.done.is_set():
            i += 1
            kind = rng.choice(KINDS)
            leave = rng.uniform(0.2, 3.0) if rng.random() < self.args.leave else None
            start = self.now()
            result = send(kind, self.app.url, rng, n * 100_000 + i, leave, self.args.patience, images)
            self.record(kind, start, result)
            if result[0] == "refused":          # as clients do: wait as long as Retry-After says
                time.sleep(float(result[1].rsplit(" ", 1)[-1]))

    def monitor(self) -> None:
        last_sample = -1e9
        with httpx.Client(timeout=10) as c:
            while not self.done.is_set():
                t = self.now()
                try:
                    r = c.get(self.app.url + "/health")
                    status = r.status_code
                    self._restarted(r.json())
                except (httpx.HTTPError, ValueError):
                    status = 0
                self.probes.append((t, self.now() - t, status))
                if t - last_sample >= 10:
                    last_sample = t
                    self.sample()
                time.sleep(0.5)

    def _restarted(self, health: dict) -> None:
        """Note each engine restart /health reports, with its reason."""
        count = health.get("restarts") or 0
        while len(self.restarts) < count:
            self.restarts.append((self.now(), str(health.get("last_error"))[:100]))

    def sample(self) -> None:
        try:
            rss = self.app.rss_by_process()
            self.samples.append(dict(t=self.now(), server=rss.get("server", 0),
                                     workers={k: v for k, v in rss.items() if k.startswith("worker")},
                                     fds=self.app.open_files(), threads=self.app.threads(),
                                     children=self.app.children()))
        except OSError:
            pass

    # ---------------------------------------------------------------- faults
    def fault(self, kind: str, bodies: dict[str, bytes], images: dict[str, bytes], rng: random.Random) -> dict:
        at = self.now()
        row = dict(t=at, fault=kind)
        if kind in ("kill", "stop"):
            pids = self.app.worker_pids()
            if not pids:
                return {**row, "detail": "no worker to signal (restarting)"}
            pid = pids[0]
            if kind == "kill":
                os.kill(pid, signal.SIGKILL)
                row["detail"] = f"worker {pid} killed; ready again after {self._until_ready():.1f} s"
            else:
                # issue 44's freeze: an edit with a 512x512 reference sent to the stopped worker
                os.kill(pid, signal.SIGSTOP)
                edit = threading.Thread(daemon=True, target=lambda: self.record("stop_edit", self.now(), send(
                    "edit", self.app.url, rng, 800_000 + len(self.faults), None, self.args.patience, images)))
                try:
                    time.sleep(0.5)
                    edit.start()
                    time.sleep(self.args.stop_s)
                finally:
                    os.kill(pid, signal.SIGCONT)
                until = self.now()
                self.stops.append((at, until))
                ready = self._until_ready()         # by now a probe the stop held has answered, or timed out
                during = [p for p in self.probes if at <= p[0] <= until]
                slowest = max((p[1] for p in during), default=float("nan"))
                row["detail"] = (f"worker {pid} stopped {self.args.stop_s:.0f} s; /health probes begun during it: "
                                 f"{len(during)}, slowest {slowest:.2f} s, {sum(p[2] != 200 for p in during)} not 200; "
                                 f"ready {ready:.1f} s after SIGCONT")
        elif kind == "disconnects":
            threads = [threading.Thread(target=lambda k=k: self.record(
                "burst", self.now(), send("stream", self.app.url, rng, 900_000 + k, 0.3, self.args.patience, {})))
                for k in range(6)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            row["detail"] = "6 streams left after 0.3 s"
        elif kind == "history":
            before = self.app.rss_by_process().get("server", 0)
            start = self.now()
            result = post_chat(self.app.url, bodies[kind], self.args.patience)
            self.record("history_body", start, result)
            after = self.app.rss_by_process().get("server", 0)
            row["detail"] = (f"{len(bodies[kind]) / 1e6:.1f} MB body, 32 history images of 4096x4096: {result[0]} "
                             f"{result[1][:60]} in {self.now() - start:.1f} s; server RSS {before / 2**20:.0f} -> "
                             f"{after / 2**20:.0f} MiB")
        else:
            t = time.monotonic()
            try:
                r = httpx.post(self.app.url + "/v1/chat/completions", content=bodies[kind],
                               headers={"Content-Type": "application/json"}, timeout=120)
                err = r.json().get("error", {})
                row["status"] = r.status_code
                row["detail"] = (f"{len(bodies[kind]) / 1e6:.0f} MB body: {r.status_code} {err.get('code')} "
                                 f"(param {err.get('param')!r}) in {time.monotonic() - t:.2f} s")
            except httpx.HTTPError as e:
                row["status"] = 0
                row["detail"] = f"{len(bodies[kind]) / 1e6:.0f} MB body: no answer ({type(e).__name__})"
        return row

    def _until_ready(self, timeout: float = 180) -> float:
        t = time.monotonic()
        time.sleep(0.5)                  # the supervisor notices the fault first
        while time.monotonic() - t < timeout:
            try:
                if self.app.health(timeout=10).get("state") in ("ready", "busy"):
                    return time.monotonic() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        return float("inf")


def large_bodies(model_name: str) -> dict[str, bytes]:
    head = b'{"messages": [{"role": "user", "content": "a red circle"}], '
    return {"zeros": head + b'"junk": [' + b"0," * (40_000_000 - 1) + b"0]}",
            "metadata": head + b'"metadata": [' + b",".join([b"9" * 4000] * 20_000) + b"]}",
            "history": history_body(model_name)}


def warm_up(soak: Soak, images: dict[str, bytes]) -> None:
    rng = random.Random(0)
    for k, kind in enumerate(KINDS):
        result = send(kind, soak.app.url, rng, k, None, soak.args.patience, images)
        if result[0] != "image":
            raise SystemExit(f"warm-up {kind}: {result}")


def run(args: argparse.Namespace, out: Output) -> bool:
    from engine import EMBEDDED_MODEL
    model = Path(args.model) if args.model else EMBEDDED_MODEL
    log = Path(tempfile.mkdtemp(prefix="soak-")) / "app.log"
    app = ServedApp("--model", str(model), "--api-only", "--max-queue", "8", *shlex.split(args.app_args), log=log)
    images = {"ref": png((512, 512), 1), "made": png((256, 256), 2)}
    from engine.serve.info import ModelInfo
    bodies = large_bodies(ModelInfo.from_folder(model).name)
    try:
        ready_s = app.wait_ready(READY_TIMEOUT_S)
        out.say(f"app.py ready in {ready_s:.1f} s ({model}); its log: {log}")
        soak = Soak(app, args)
        warm_up(soak, images)
        app.wait_idle(60)
        soak.sample()
        baseline = soak.samples.pop()
        out.say(f"warm: server RSS {baseline['server'] / 2**20:.0f} MiB, {baseline['fds']} open files, "
                f"{baseline['threads']} threads, {baseline['children']} processes below it")
        soak.t0 = time.monotonic()
        threads = [threading.Thread(target=soak.monitor, daemon=True)] + \
            [threading.Thread(target=soak.client, args=(n, images), daemon=True) for n in range(args.clients)]
        for t in threads:
            t.start()
        rng, end, k = random.Random(args.seed), args.minutes * 60, 0
        next_fault = args.fault_every
        while soak.now() < end:
            time.sleep(min(1.0, max(0.0, end - soak.now())))
            if soak.now() >= next_fault and soak.now() < end - 10:
                row = soak.fault(FAULTS[k % len(FAULTS)], bodies, images, rng)
                soak.faults.append(row)
                out.say(f"{row['t']:7.1f} s  {row['fault']}: {row['detail']}")
                k += 1
                next_fault = soak.now() + args.fault_every
        soak.done.set()
        for t in threads[1:]:
            t.join(args.patience + 30)
        idle_s = app.wait_idle(READY_TIMEOUT_S)
        threads[0].join(15)
        soak.sample()
        final = soak.samples[-1]
        health = app.health()
    finally:
        app.stop()
    return report(out, args, soak, baseline, final, health, idle_s)


def report(out: Output, args: argparse.Namespace, soak: Soak, baseline: dict, final: dict, health: dict,
           idle_s: float) -> bool:
    rows = []
    for kind in KINDS + ("burst", "stop_edit", "history_body"):
        got = [o for o in soak.outcomes if o.kind == kind]
        if not got:
            continue
        secs = sorted(o.seconds for o in got if o.result == "image")
        rows.append(dict(kind=kind, sent=len(got), **{r: sum(o.result == r for o in got) for r in
                                                       ("image", "left", "refused", "4xx", "error", "lost", "hung")},
                         p50=statistics.median(secs) if secs else None, max=secs[-1] if secs else None))
    out.table(rows, [Col("kind", "kind"), Col("sent", "sent"), Col("image", "image"), Col("left", "left"),
                     Col("refused", "refused"), Col("4xx", "4xx"), Col("error", "error"), Col("lost", "lost"),
                     Col("hung", "hung"),
                     Col("image p50 s", "p50", ".2f"), Col("max s", "max", ".2f")],
              f"requests over {args.minutes:g} min, {args.clients} clients")
    bad = [o for o in soak.outcomes if o.result in ("lost", "hung", "4xx")]
    for o in bad[:20]:
        out.say(f"  {o.result}: {o.kind} at {o.start:.1f} s after {o.seconds:.1f} s: {o.detail}")
    errors: dict[str, int] = {}
    for o in soak.outcomes:
        if o.result in ("error", "refused"):
            errors[o.detail[:80]] = errors.get(o.detail[:80], 0) + 1
    if errors:
        out.say("errors and refusals, by what they said:")
        for what, n in sorted(errors.items(), key=lambda kv: -kv[1]):
            out.say(f"  {n:4d}  {what}")

    def in_stop(t: float) -> bool:
        return any(a - 1 <= t <= b + 1 for a, b in soak.stops)
    out.say("engine restarts, as /health reported them:")
    for t, why in soak.restarts:
        out.say(f"  {t:7.1f} s  {why}")
    lat = sorted(p[1] for p in soak.probes)
    stalls_stop = [p for p in soak.probes if p[1] > 1.0 and in_stop(p[0])]
    stalls_else = [p for p in soak.probes if p[1] > 1.0 and not in_stop(p[0])]
    out.say(f"/health: {len(lat)} probes, p50 {1000 * lat[len(lat) // 2]:.0f} ms, p99 "
            f"{1000 * lat[int(len(lat) * 0.99)]:.0f} ms, max {lat[-1]:.2f} s; over 1 s: {len(stalls_stop)} during "
            f"a SIGSTOP, {len(stalls_else)} elsewhere" if lat else "/health: no probes")
    for t, seconds, status in stalls_stop + stalls_else:
        out.say(f"  /health asked at {t:.1f} s took {seconds:.2f} s ({status or 'no answer'})"
                f"{' (during a SIGSTOP)' if in_stop(t) else ''}")
    minutes = soak.samples[::6]                 # a sample every 10 s
    if soak.samples[-1] is not minutes[-1]:
        minutes.append(soak.samples[-1])
    mem = [dict(t=s["t"], server=s["server"] / 2**20, workers=" ".join(f"{k.split()[1]}:{v / 2**20:.0f}"
                                                                      for k, v in s["workers"].items()),
                fds=s["fds"], threads=s["threads"], children=s["children"]) for s in minutes]
    out.table(mem, [Col("t s", "t", ".0f"), Col("server MiB", "server", ".0f"), Col("workers (pid:MiB)", "workers"),
                    Col("server fds", "fds"), Col("server threads", "threads"), Col("processes below", "children")],
              "memory, files, threads, processes (every minute, and at the end after idle)")
    growth = (final["server"] - baseline["server"]) / baseline["server"]
    large = [f for f in soak.faults if f["fault"] in ("zeros", "metadata")]
    checks = {"none lost": not any(o.result == "lost" for o in soak.outcomes),
              "none hung": not any(o.result == "hung" for o in soak.outcomes),
              "no valid request refused with a 4xx": not any(o.result == "4xx" for o in soak.outcomes),
              "ready and idle at the end": health.get("state") == "ready" and not health.get("running"),
              f"server RSS within {RSS_GROWTH:.0%} of the warm level": growth <= RSS_GROWTH,
              f"server open files within {FD_GROWTH}": final["fds"] <= baseline["fds"] + FD_GROWTH,
              f"server threads within {THREAD_GROWTH}": final["threads"] <= baseline["threads"] + THREAD_GROWTH,
              "no process left behind": final["children"] == baseline["children"],
              "80 MB bodies refused with a 4xx": all(400 <= f.get("status", 0) < 500 for f in large)}
    out.say(f"server RSS {baseline['server'] / 2**20:.0f} MiB after the warm-up, {final['server'] / 2**20:.0f} MiB "
            f"at the end ({growth:+.1%}); open files {baseline['fds']} -> {final['fds']}; threads "
            f"{baseline['threads']} -> {final['threads']}; processes below it {baseline['children']} -> "
            f"{final['children']}; idle {idle_s:.1f} s after the load stopped; restarts {health.get('restarts')}")
    for name, ok in checks.items():
        out.say(f"check: {name}: {'ok' if ok else 'FAILED'}")
    out.data.update(minutes=args.minutes, clients=args.clients, fault_every=args.fault_every, stop_s=args.stop_s,
                    requests=rows, faults=soak.faults, restarts=soak.restarts, checks=checks, rss_growth=growth,
                    health=dict(probes=len(lat), max_s=lat[-1] if lat else None, over_1s_in_stop=stalls_stop,
                                over_1s_elsewhere=stalls_else),
                    memory=soak.samples)
    return all(checks.values())
