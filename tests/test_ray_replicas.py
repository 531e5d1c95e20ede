"""Engine replicas on Ray Serve (engine/serve/replicas.py), end to end on the CPU: `python app.py --replicas 2`
as a real process on the embedded model, a local Ray under it, driven by the official `openai` client and
by gradio_client. (tests/test_replicas.py is another thing: training's data parallel.)

The module leaves no process behind: its fixture stops the app and checks that every process of its tree
(Ray's GCS, raylet, the replica actors, the engine workers) is gone."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

openai = pytest.importorskip("openai")

from engine.parallel.groups import free_port

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 420         # a loaded 2-core machine: Ray's start alone took 30-60 s
# a request of about a second on the tiny model: reasoning, then a few steps (long enough to be seen running)
REQ = dict(bot_task="think", max_new_tokens=8, num_inference_steps=4, seed=5)
pytestmark = pytest.mark.slow


def _alive(pid: int, started: str) -> bool:
    """The process `pid` still runs and is the one we saw (its start time in /proc/PID/stat, field 22)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    fields = stat.rsplit(")", 1)[1].split()
    return fields[19] == started and fields[0] != "Z"


def _tree(root: int) -> dict[int, str]:
    """The process `root` and its descendants, each with its start time."""
    out, todo = {}, [root]
    while todo:
        pid = todo.pop()
        try:
            out[pid] = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
            for task in Path(f"/proc/{pid}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


class ReplicaApp:
    """`python app.py --replicas 2` and what the tests need of it. Ray keeps its files (and so names its
    processes' session folder) under a fresh short temporary folder of its own."""

    def __init__(self, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ray_tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")      # short: Ray's socket paths are limited
        env = {**os.environ, "GRADIO_ANALYTICS_ENABLED": "False", "STUDIO_API_KEY": "", "RAY_TMPDIR": self.ray_tmp,
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
               "RAY_USAGE_STATS_ENABLED": "0"}
        self.log = log
        self.seen: dict[int, str] = {}
        self.proc = subprocess.Popen([sys.executable, "app.py", "--port", str(self.port), "--replicas", "2",
                                      "--device", "cpu", "--max-batch", "2", "--max-queue", "3"],
                                     cwd=ROOT, env=env, stdout=log.open("w"), stderr=subprocess.STDOUT)

    def health(self) -> dict:
        return httpx.get(self.url + "/health", timeout=5).json()

    def wait(self, cond, what: str, timeout: float = READY_TIMEOUT_S) -> dict:
        deadline = time.monotonic() + timeout
        h: dict = {}
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"app.py exited ({self.proc.returncode}):\n{self.log.read_text()[-4000:]}")
            try:
                h = self.health()
                if cond(h):
                    return h
            except httpx.HTTPError:
                pass
            self.seen.update(_tree(self.proc.pid))
            time.sleep(0.2)
        pytest.fail(f"{what} not reached in {timeout} s: {h}\n{self.log.read_text()[-4000:]}")

    def client(self, **kw) -> "openai.OpenAI":
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=300, **kw)

    def stop(self) -> list[str]:
        """Stop the app as Ctrl-C / SIGTERM does; the processes of its tree still alive after 60 s."""
        self.seen.update(_tree(self.proc.pid))
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(90)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        deadline = time.monotonic() + 60
        while (left := [p for p, t in self.seen.items() if _alive(p, t)]) and time.monotonic() < deadline:
            time.sleep(0.5)
        described = []
        for pid in left:                           # ours, by pid: never leave them running
            try:
                described.append(f"{pid}: {Path(f'/proc/{pid}/cmdline').read_bytes()[:200]!r}")
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.ray_tmp, ignore_errors=True)
        return described


def both_up(h: dict) -> bool:
    """Two replicas ready (a killed one is reported "lost" until it is forgotten)."""
    return h.get("replicas_up") == 2 and sum(r["state"] == "ready" for r in h.get("replicas", [])) == 2


@pytest.fixture(scope="module")
def app(tmp_path_factory):
    pytest.importorskip("ray")                    # the test extra installs it
    a = ReplicaApp(tmp_path_factory.mktemp("replicas") / "app.log")
    try:
        a.wait(both_up, "two replicas ready")
        yield a
    finally:
        left = a.stop()
        assert not left, f"processes left behind after the app stopped (killed now): {left}"


def generate(client, prompt: str):
    return client.images.generate(prompt=prompt, size="256x256", extra_body=REQ)


def test_health_reports_each_replica_and_the_total(app):
    h = app.health()
    assert h["status"] == "ok" and h["replicas_target"] == 2 and len(h["replicas"]) == 2
    assert len({r["id"] for r in h["replicas"]}) == 2 and len({r["pid"] for r in h["replicas"]}) == 2
    for r in h["replicas"]:
        assert r["plan"] == "tp1" and r["world_size"] == 1 and r["device"] == "cpu" and r["max_batch"] == 2
    assert h["max_batch"] == 4 and h["max_queue"] == 6           # the total: both replicas'
    assert h["running"] == 0 and h["waiting"] == 0


def test_eight_concurrent_requests_spread_over_both_replicas(app):
    before = {r["id"]: r["served"] for r in app.health()["replicas"]}
    with app.client() as client, ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda i: generate(client, f"a red circle number {i}"), range(8)))
    assert all(r.data[0].b64_json and r.size == "256x256" for r in results)
    h = app.wait(lambda h: sum(r["served"] for r in h["replicas"]) - sum(before.values()) == 8,
                 "8 requests counted", timeout=10)
    served = {r["id"]: r["served"] - before.get(r["id"], 0) for r in h["replicas"]}
    print("served per replica:", served)
    # both took a share: a replica takes at most --max-batch + --max-queue (5) at once, the rest go elsewhere
    assert len(served) == 2 and all(n >= 1 for n in served.values()), served


def test_the_page_works_through_the_ingress(app):
    from gradio_client import Client
    page = httpx.get(app.url + "/", timeout=10)
    assert page.status_code == 200 and "<html" in page.text.lower()
    c = Client(app.url, verbose=False)
    status, image, timings, reasoning = c.predict(
        "a blue square on a white background", "think", "256:256", 3, False, 4, 5.0, "en_unified", "", 8,
        api_name="/t2i")
    assert status.startswith("Done") and image and Path(image).stat().st_size > 0 and reasoning
    c.close()


def test_a_disconnect_cancels_the_request_on_its_replica(app):
    with app.client() as client:
        stream = client.images.generate(prompt="a long one", size="256x256", stream=True,
                                        extra_body=dict(REQ, num_inference_steps=200, stream_reasoning=True))
        for _ in stream:
            break                                   # it runs (its reasoning streams); 200 steps would follow
        h = app.wait(lambda h: h["running"] == 1, "the request running on a replica", 30)
        holder = next(r["id"] for r in h["replicas"] if r["running"])
        stream.close()
        t0 = time.monotonic()
        h = app.wait(lambda h: h["running"] == 0 and h["waiting"] == 0, "the replica idle", 15)
        print(f"replica {holder} idle {time.monotonic() - t0:.1f} s after the disconnect (health is posted every 1 s)")


def test_a_killed_replica_fails_only_its_request_and_the_pool_recovers(app):
    long = dict(REQ, num_inference_steps=100)         # seconds on the CPU: both run when the kill comes
    client = app.client()
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.images.generate, prompt="a green star", size="256x256", extra_body=long)
            h = app.wait(lambda h: h["running"] == 1, "the first request running", 60)
            victim = next(r for r in h["replicas"] if r["running"])
            second = pool.submit(client.images.generate, prompt="a blue star", size="256x256", extra_body=long)
            # least-loaded: the second goes to the other replica
            app.wait(lambda h: [r["running"] for r in h["replicas"] if r["state"] in ("ready", "busy")] == [1, 1],
                     "one request on each replica", 60)
            os.kill(victim["pid"], signal.SIGKILL)
            with pytest.raises(openai.APIError) as failed:
                first.result()
            assert "engine replica running this request stopped" in str(failed.value), failed.value
            assert second.result().data[0].b64_json                      # the other replica's finished
        # Ray Serve replaces the replica; the new one loads the model and serves
        h = app.wait(lambda h: both_up(h) and victim["id"] not in {r["id"] for r in h["replicas"]
                                                                   if r["state"] == "ready"},
                     "a replacement replica", 300)
        assert [r["state"] for r in h["replicas"] if r["id"] == victim["id"]] in ([], ["lost"])
        # the dead replica's engine workers noticed it (their pipe closed) and exited
        app.wait(lambda h: not any(Path(f"/proc/{p}").exists() for p in victim["worker_pids"]),
                 "the dead replica's workers gone", 30)
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda i: generate(client, f"after {i}"), range(2)))
        assert all(r.data[0].b64_json for r in results)
    finally:
        client.close()


def test_without_replicas_ray_is_never_imported(tmp_path):
    """Building the app the normal way (engine server, page, /v1) imports no Ray."""
    code = """
import sys
import app
args = app.parse_args(["--max-batch", "1"])
model, notice = app.default_model()
server = app.engine_server(model, "cpu", args)
try:
    from engine.serve.openai_api import OpenAIApi
    from webui.studio import build_studio
    demo = build_studio(server, server.info, notice=notice)
    api = OpenAIApi(server, app.api_config(args))
    print("RAY", "ray" in sys.modules, type(server).__name__)
finally:
    server.close()
"""
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"})
    assert "RAY False EngineServer" in out.stdout, out.stdout[-2000:] + out.stderr[-2000:]


def test_replica_flags_are_checked(capsys):
    import app as studio_app
    for argv, msg in ((["--gpus-per-replica", "2"], "need --replicas"),
                      (["--replicas", "0"], "replicas must be at least 1"),
                      (["--replicas", "2", "--min-replicas", "1"], "go together"),
                      (["--replicas", "4", "--min-replicas", "1", "--max-replicas", "3"], "min_replicas <= replicas"),
                      (["--replicas", "2", "--gpus", "2", "--gpus-per-replica", "4"], "differ"),
                      (["--replicas", "2", "--gpus-per-replica", "1.5"], "whole number")):
        with pytest.raises(SystemExit):
            studio_app.parse_args(argv)
        assert msg in capsys.readouterr().err, argv
    a = studio_app.parse_args(["--replicas", "2", "--gpus", "4", "--min-replicas", "1", "--max-replicas", "4"])
    assert a.replica_options.gpus_per_replica == 4 and a.replica_options.autoscaling


def test_deployment_options_place_and_scale_the_replicas():
    from engine.serve.replicas import ReplicaOptions, deployment_options
    fixed = deployment_options(ReplicaOptions(replicas=2, gpus_per_replica=4), 4, 8, 8, cuda=True)
    assert fixed["num_replicas"] == 2 and "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_gpus": 4, "num_cpus": 1} and fixed["max_ongoing_requests"] == 16
    shared = deployment_options(ReplicaOptions(replicas=2, gpus_per_replica=0.5), 1, 8, 8, cuda=True)
    assert shared["ray_actor_options"]["num_gpus"] == 0.5                  # two replicas on one GPU
    auto = deployment_options(ReplicaOptions(replicas=2, min_replicas=1, max_replicas=4), 1, 2, 8, cuda=False)
    assert auto["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "initial_replicas": 2,
                                          "target_ongoing_requests": 2} and "num_replicas" not in auto
    assert auto["ray_actor_options"] == {"num_cpus": 1}
