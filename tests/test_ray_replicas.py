"""Engine replicas on Ray Serve (engine/serve/replicas.py), end to end on the CPU: `python app.py --replicas 2`
as a real process on the embedded model, a local Ray under it, driven by the official `openai` client and
by gradio_client: requests spread and fail alone, a conversation continues on another replica than its
last turn's, a LoRA adapter loaded through the ingress serves on every replica (a replacement too).
(tests/test_replicas.py is another thing: training's data parallel.)

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
from PIL import Image as PILImage

openai = pytest.importorskip("openai")

from engine.parallel.groups import free_port

ROOT = Path(__file__).resolve().parents[1]
READY_TIMEOUT_S = 420         # a loaded 2-core machine: Ray's start alone took 30-60 s
# a request of about a second on the tiny model: reasoning, then a few steps (long enough to be seen running)
REQ = dict(bot_task="think", max_new_tokens=8, num_inference_steps=4, seed=5)
KEY = "sk-replicas"           # the load / unload routes need one; the page then logs in with it
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
                                      "--device", "cpu", "--max-batch", "2", "--max-queue", "3",
                                      "--api-key", KEY, "--max-loras", "1"],
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
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, timeout=300, **kw)

    def post(self, path: str, body: dict) -> httpx.Response:
        return httpx.post(self.url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=300)

    def served(self) -> dict[str, int]:
        """Requests finished by each replica up, by its id."""
        return {r["id"]: r["served"] for r in self.health()["replicas"] if r["state"] in ("ready", "busy")}

    def ran_on(self, before: dict[str, int]) -> str:
        """The replica that finished the one request since `before` (health is posted once a second)."""
        h = self.wait(lambda h: sum(r["served"] for r in h["replicas"]) == sum(before.values()) + 1,
                      "the request counted", timeout=10)
        return next(r["id"] for r in h["replicas"] if r["served"] > before.get(r["id"], 0))

    def long_stream(self, client, prompt: str):
        """A streamed request that runs until it is closed (200 steps): it keeps one replica busy."""
        stream = client.images.generate(prompt=prompt, size="256x256", stream=True,
                                        extra_body=dict(REQ, num_inference_steps=200, stream_reasoning=True))
        next(iter(stream))                            # it runs: its reasoning streams
        return stream

    def running_on(self) -> dict[str, int]:
        return {r["id"]: r["running"] for r in self.health()["replicas"] if r["state"] in ("ready", "busy")}

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


def pixels(b64: str) -> bytes:
    """A returned image's pixels (its PNG's text chunks aside)."""
    import base64
    import io
    from PIL import Image as PILImage
    return PILImage.open(io.BytesIO(base64.b64decode(b64))).convert("RGB").tobytes()


def test_health_reports_each_replica_and_the_total(app):
    h = app.health()
    assert h["status"] == "ok" and h["replicas_target"] == 2 and len(h["replicas"]) == 2
    assert h["replicas_min"] is None and h["replicas_max"] is None             # a fixed count: no autoscaling
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
    c = Client(app.url, auth=("anyone", KEY), verbose=False)
    status, image, timings, reasoning = c.predict(
        "a blue square on a white background", "think", "256:256", 3, False, 4, 5.0, "en_unified", "", 8,
        api_name="/t2i")
    assert status.startswith("Done") and image and Path(image).stat().st_size > 0 and reasoning
    c.close()


@pytest.fixture(scope="module")
def adapter(app, tmp_path_factory) -> str:
    """A LoRA adapter of the embedded model (written by peft), loaded through the ingress."""
    pytest.importorskip("peft")
    from engine import EMBEDDED_MODEL
    from engine.serve.info import ModelInfo
    from tools.tiny_lora import make_adapter
    folder = make_adapter(tmp_path_factory.mktemp("lora") / "style", ModelInfo.from_folder(EMBEDDED_MODEL).cfg, seed=1)
    t0 = time.monotonic()
    r = app.post("/v1/load_lora_adapter", {"lora_name": "style", "lora_path": str(folder)})
    assert r.status_code == 200, r.text
    print(f"adapter loaded on every replica {time.monotonic() - t0:.1f} s after the request")
    return "style"


def test_an_adapter_loaded_through_the_ingress_serves_on_both_replicas(app, adapter):
    h = app.health()
    assert [r["adapters"] for r in h["replicas"]] == [[adapter], [adapter]], h["replicas"]
    # 100 steps: the first request must still be running when the second is routed (health is posted once a
    # second; 12 steps took 0.65 s on the CPU, and CI once saw both land on one replica)
    lora = dict(bot_task="image", num_inference_steps=100, seed=7)
    with app.client() as client:
        assert [m.id for m in client.models.list()][1:] == [adapter]
        before = app.served()
        base = client.images.generate(prompt="a red circle", size="256x256", extra_body=lora)
        app.ran_on(before)                        # counted (health is posted once a second): a fresh start
        before = app.served()
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(client.images.generate, model=adapter, prompt="a red circle", size="256x256",
                                extra_body=lora)
            app.wait(lambda h: h["running"] == 1, "the first adapter request running", 60)
            second = pool.submit(client.images.generate, model=adapter, prompt="a red circle", size="256x256",
                                 extra_body=lora)
            # the pixels (each PNG's record also carries its own timings)
            styled = [pixels(first.result().data[0].b64_json), pixels(second.result().data[0].b64_json)]
    h = app.wait(lambda h: sum(r["served"] for r in h["replicas"]) == sum(before.values()) + 2, "both counted", 10)
    assert {r["id"]: r["served"] - before[r["id"]] for r in h["replicas"]} == {rid: 1 for rid in before}
    # each replica applied it, the same way: one seed, one image; the base model's differs
    assert styled[0] == styled[1] and styled[0] != pixels(base.data[0].b64_json)


def test_a_conversation_continues_on_another_replica(app, tmp_path):
    """Conversations are held at the ingress: turn 2 runs on the other replica (the one of turn 1 is kept
    busy) and its sequence holds turn 1 (the input tokens count turn 1's image and reasoning)."""
    ref = tmp_path / "ref.png"
    PILImage.new("RGB", (64, 48), (200, 30, 30)).save(ref)
    with app.client() as client:
        busy_a = app.long_stream(client, "keeps a replica busy")
        app.wait(lambda h: h["running"] == 1, "a long request running", 30)
        before = app.served()
        r1 = client.images.edit(image=[("ref.png", ref.read_bytes(), "image/png")], prompt="a red square",
                                size="256x256", extra_body=REQ)
        turn1 = app.ran_on(before)
        conv = r1.model_extra["conversation_id"]
        for attempt in range(3):
            if attempt:                           # both replicas idle: the first long request lands on either
                first = app.long_stream(client, "keeps a replica busy")
                app.wait(lambda h: h["running"] == 1, "a long request running", 30)
                if app.running_on().get(turn1) == 1:
                    busy_b, busy_a = first, app.long_stream(client, "keeps the other replica busy")
                else:
                    busy_a, busy_b = first, app.long_stream(client, "keeps turn 1's replica busy")
            else:                                 # least-loaded: busy_b goes to turn 1's replica
                busy_b = app.long_stream(client, "keeps turn 1's replica busy")
            app.wait(lambda h: app.running_on().get(turn1) == 1 and h["running"] == 2, "turn 1's replica busy", 30)
            busy_a.close()                                                   # the other one is free again
            app.wait(lambda h: h["running"] == 1, "the other replica idle", 30)
            before = app.served()
            r2 = client.images.edit(image=[], prompt="make it blue", size="256x256",
                                    extra_body={**REQ, "conversation_id": conv, "history_policy": "full"})
            app.wait(lambda h: sum(r["served"] for r in h["replicas"]) > sum(before.values()), "turn 2 counted", 10)
            time.sleep(2.5)                       # two health reports: a Done of busy_b around now is counted too
            after = app.served()
            busy_b.close()
            gained = {rid: after.get(rid, 0) - n for rid, n in before.items()}
            if gained.get(turn1, 0) < 2:          # busy_b still ran when turn 2 ended: the premise held
                break
            # busy_b's 200 steps ended about when turn 2 was routed (a slow, shared machine): both replicas
            # were idle then and either was right; the scenario again, with fresh long requests
            app.wait(lambda h: h["running"] == 0, "the replicas idle", 30)
        turn2 = next((rid for rid, g in gained.items() if rid != turn1 and g >= 1), turn1)
    assert turn2 != turn1, "turn 2 should have run on the replica that did not hold turn 1"
    assert r2.model_extra["conversation_id"] == conv and r2.data[0].b64_json
    # turn 2 sent no image of its own: what its sequence holds beyond its text is turn 1 (reference, image)
    assert r2.usage.input_tokens > r1.usage.input_tokens, (r1.usage, r2.usage)
    app.wait(lambda h: h["running"] == 0 and h["waiting"] == 0, "the replicas idle", 30)


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


def test_a_killed_replica_fails_only_its_request_and_the_pool_recovers(app, adapter):
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
        # the replacement serves the adapters loaded so far (the ingress's set, loaded at its start)
        assert all(r["adapters"] == [adapter] for r in h["replicas"] if r["state"] == "ready"), h["replicas"]
        # the dead replica's engine workers noticed it (their pipe closed) and exited
        app.wait(lambda h: not any(Path(f"/proc/{p}").exists() for p in victim["worker_pids"]),
                 "the dead replica's workers gone", 30)
        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(lambda i: generate(client, f"after {i}"), range(2)))
        assert all(r.data[0].b64_json for r in results)
    finally:
        client.close()


def test_unloading_through_the_ingress_unloads_on_every_replica(app, adapter):
    assert app.post("/v1/unload_lora_adapter", {"lora_name": adapter}).status_code == 200
    with app.client() as client:
        assert [m.id for m in client.models.list()][1:] == []
        with pytest.raises(openai.NotFoundError):
            client.images.generate(model=adapter, prompt="a cat", size="256x256", extra_body=REQ)
    app.wait(lambda h: all(r["adapters"] == [] for r in h["replicas"] if r["state"] == "ready"),
             "every replica unloaded it", 10)


def test_without_replicas_ray_is_never_imported(tmp_path):
    """Building the app the normal way (engine server, page, /v1) imports no Ray."""
    code = """
import sys
import app
args = app.parse_args(["--max-batch", "1", "--device", "cpu"])
model, notice = app.default_model()
server = app.engine_server(args)
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
                      (["--replicas", "2", "--gpus-per-replica", "1.5"], "whole number"),
                      (["--replicas", "2", "--upscale-delay", "1"], "need --min-replicas"),
                      (["--upscale-delay", "1"], "need --replicas"),
                      (["--replicas", "2", "--lora", "a=/nowhere", "--lora-merged"], "not supported with --replicas"),
                      (["--replicas", "2", "--min-replicas", "1", "--max-replicas", "3", "--downscale-delay", "-1"],
                       "delays are seconds")):
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
                                          "target_ongoing_requests": 2, "upscale_delay_s": 30.0,
                                          "downscale_delay_s": 600.0} and "num_replicas" not in auto
    quick = deployment_options(ReplicaOptions(replicas=1, min_replicas=1, max_replicas=2, upscale_delay_s=2,
                                              downscale_delay_s=20), 1, 1, 2, cuda=False)
    assert quick["autoscaling_config"]["upscale_delay_s"] == 2 and quick["autoscaling_config"]["downscale_delay_s"] == 20
    assert auto["ray_actor_options"] == {"num_cpus": 1}
