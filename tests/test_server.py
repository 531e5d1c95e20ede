"""engine.server: the resident engine process and its client API, on a real tiny checkpoint."""
from __future__ import annotations

import asyncio
import io
import os
import shutil
import signal
from pathlib import Path

import pytest
from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Image, Ratio, Started, Step, Text
from engine.serve.info import ModelInfo
from engine.serve.engine_config import EngineConfig
from engine.serve.server import EngineServer
from engine.serve.workers import describe_exit

from studio_fixtures import READY_TIMEOUT_S, engine_server, fast_request, final, start_server, wait_for  # noqa: F401


def kinds(events):
    return [type(e).__name__ for e in events]


def test_model_info_reads_the_folder_without_weights(tiny_dir):
    info = ModelInfo.from_folder(tiny_dir)
    assert info.gen.diff_infer_steps == 50 and len(info.buckets) == 37
    assert "en_unified" in info.presets and "custom" in info.presets


def test_stream_order_and_png_of_the_chosen_size(engine_server):
    events = list(engine_server.stream(fast_request(size="256:192")))
    names = kinds(events)
    assert names[0] == "Started" and names[-2:] == ["Image", "Done"], names
    first_step = names.index("Step")
    assert "Text" in names[:first_step] and names.index("Ratio") < first_step
    img = next(e for e in events if isinstance(e, Image))
    assert isinstance(img.data, bytes)          # encoded by the worker's sender thread, not the server
    pil = PILImage.open(io.BytesIO(img.png))
    assert pil.format == "PNG" and pil.size == (256, 192) == (img.width, img.height)
    assert isinstance(events[-1], Done) and events[-1].timings.dit_steps == 2
    wait_for(lambda: engine_server.health()["state"] == "ready", 10)   # the worker's "end" follows Done


def test_async_submit_streams_the_same_events(engine_server):
    async def collect():
        return [ev async for ev in engine_server.submit(fast_request(seed=7))]
    events = asyncio.run(collect())
    assert isinstance(events[0], Started) and isinstance(events[-1], Done)
    assert any(isinstance(e, Text) for e in events) and any(isinstance(e, Step) for e in events)


def test_a_cancel_of_an_async_consumer_is_never_lost_to_an_event_arriving_with_it():
    """A replica's generator waits in `aget`; a closed client cancels its task. When an event is pushed in
    the same tick (reasoning streams fast), the cancel must still end the consumer: Python 3.11's wait_for
    returned the event instead, and the replica streamed the cancelled request to its end."""
    from engine.serve.client import Submission
    from engine.runtime.request import Request

    async def race(ticks: int) -> tuple[bool, int]:
        sub = Submission(Request(prompt="x"), lambda rid: True)
        got = []

        async def consume():
            while True:
                ev = await sub.aget(timeout=5)
                got.append(ev)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        sub.push(Text("a", "think"))
        for _ in range(ticks):              # every interleaving of the wake-up and the cancel
            await asyncio.sleep(0)
        task.cancel()
        await asyncio.sleep(0.05)
        cancelled = task.cancelled()
        task.cancel()
        return cancelled, len(got)

    for ticks in range(4):
        cancelled, n = asyncio.run(race(ticks))
        assert cancelled, f"the cancel was lost ({ticks} ticks between the event and the cancel)"
        assert n <= 1

    async def timeout_keeps_events() -> list:
        sub = Submission(Request(prompt="x"), lambda rid: True)
        first = await sub.aget(timeout=0.01)            # nothing yet: None, and nothing lost
        sub.push(Text("b", "think"))
        return [first, await sub.aget(timeout=1)]
    assert asyncio.run(timeout_keeps_events()) == [None, Text("b", "think")]


def test_invalid_requests_end_at_once_and_are_never_queued(engine_server, tmp_path):
    for req, words in ((fast_request(prompt="   "), "prompt is empty"),
                       (fast_request(images=[b"x"] * 4), "at most 3"),
                       (fast_request(size="banana"), "not understood"),
                       (fast_request(steps=0), "steps")):
        sub = engine_server.submit(req)
        assert sub.ended
        ev = final(list(sub))
        assert isinstance(ev, Error) and ev.kind == "invalid" and words in ev.message, ev
    assert engine_server.health()["queue"] == 0


def test_an_admitted_request_runs_as_admitted_and_an_unloaded_adapter_is_refused(engine_server):
    """What a replica pool's ingress admits (engine/serve/admission.py) its replica runs without a second
    check, with the seed drawn at admission; an adapter the engine does not hold (unloaded since) is
    refused when the request starts, naming it."""
    from engine.serve.admission import admit
    request, prepared = admit(engine_server.info, fast_request(seed=None), engine_server.adapters())
    assert request.seed is not None and prepared.seed == request.seed
    events = list(engine_server.submit_admitted(request, prepared))
    assert isinstance(events[-1], Done), events[-1]
    assert [e.seed for e in events if isinstance(e, Started)] == [request.seed]
    request, prepared = admit(engine_server.info, fast_request(lora="gone"), ["gone"])     # loaded at the ingress
    ev = final(list(engine_server.submit_admitted(request, prepared)))
    assert isinstance(ev, Error) and ev.kind == "invalid" and ev.param == "lora" and "'gone'" in ev.message, ev
    assert isinstance(admit(engine_server.info, fast_request(lora="gone"), []), Error)      # the ingress's own check


# A request that cannot end before the test has read its first step and cancelled it, even on a loaded machine:
# the most steps a request may ask (STEPS_RANGE), at a large size (60 small steps ended first now and then).
LONG = dict(steps=200, size="1024:1024")


def test_cancel_running_request_frees_the_engine(engine_server):
    sub = engine_server.submit(fast_request(**LONG))
    cancelled = []
    for ev in sub:
        if isinstance(ev, Step) and not cancelled:      # (a step already queued may still follow: no second cancel)
            cancelled.append(engine_server.cancel(sub.request_id))
    assert cancelled == [True]
    assert isinstance(ev, Error) and ev.kind == "cancelled"
    assert not engine_server.cancel(sub.request_id)         # already finished
    wait_for(lambda: engine_server.health()["state"] == "ready", 30)
    assert isinstance(final(list(engine_server.stream(fast_request()))), Done)


def test_cancel_a_queued_request(engine_server):
    running = engine_server.submit(fast_request(**LONG))
    queued = engine_server.submit(fast_request(prompt="second"))
    assert engine_server.health()["queue"] >= 1
    assert queued.cancel()
    events = list(queued)
    assert len(events) == 1, events                 # it never started
    assert events[0].kind == "cancelled" and "before it started" in events[0].message
    running.cancel()
    assert isinstance(final(list(engine_server.stream(fast_request()))), Done)


def test_a_full_queue_refuses_simultaneous_arrivals_exactly(engine_server):
    """max_queue holds when many clients submit at the same instant: exactly that many wait, every
    other one ends at once with Error('busy') and is never queued."""
    import threading
    running = engine_server.submit(fast_request(steps=200))
    wait_for(lambda: running.request_id in engine_server.health()["running_ids"], 60)
    engine_server.max_queue = 3
    subs: list = [None] * 12
    go = threading.Barrier(len(subs))

    def arrive(i: int) -> None:
        go.wait()
        subs[i] = engine_server.submit(fast_request(prompt=f"arrival {i}"))

    threads = [threading.Thread(target=arrive, args=(i,)) for i in range(len(subs))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        busy = [s for s in subs if s.ended]
        assert len(busy) == len(subs) - 3 and engine_server.health()["queue"] == 3
        for s in busy:
            ev = final(list(s))
            assert isinstance(ev, Error) and ev.kind == "busy" and "queue is full" in ev.message, ev
    finally:
        engine_server.max_queue = None
        for s in subs + [running]:
            if s is not None:
                s.cancel()
    wait_for(lambda: engine_server.health()["state"] == "ready", 30)


def test_leaving_the_iteration_early_cancels(engine_server):
    sub = engine_server.submit(fast_request(steps=60))
    for ev in sub:
        if isinstance(ev, Step):
            break                      # a consumer that goes away (closed tab) must not hold the engine
    assert sub.ended
    assert isinstance(final(list(engine_server.stream(fast_request()))), Done)


def test_killed_worker_fails_the_request_and_restarts(engine_server):
    before = engine_server.health()
    sub = engine_server.submit(fast_request(**LONG))
    for ev in sub:
        if isinstance(ev, Ratio):
            os.kill(engine_server.health()["worker_pids"][0], signal.SIGKILL)
    assert isinstance(ev, Error) and ev.kind == "engine", ev
    assert "restarting" in ev.message and "SIGKILL" in ev.message
    ev = final(list(engine_server.stream(fast_request())))       # queued until the reload, then runs
    assert isinstance(ev, Done), ev
    wait_for(lambda: engine_server.health()["state"] == "ready", 10)
    after = engine_server.health()
    assert after["restarts"] == before["restarts"] + 1
    assert after["worker_pids"] != before["worker_pids"]


def test_broken_checkpoint_fails_loading_with_a_message(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in Path(tiny_dir).iterdir():        # the small files only: the weights are missing
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy(f, broken / f.name)
    with EngineServer(EngineConfig(broken)) as server:
        assert not server.wait_ready(120)
        h = server.health()
        assert h["state"] == "failed" and "could not load" in h["last_error"]
        ev = final(list(server.stream(fast_request())))
        assert isinstance(ev, Error) and ev.kind == "engine" and "could not load" in ev.message


def test_close_leaves_no_process(tiny_dir):
    server = start_server(tiny_dir)
    pids = server.health()["worker_pids"]
    sub = server.submit(fast_request(steps=60))
    server.close()
    assert server.health()["state"] == "closed"
    ev = final(list(sub))
    assert isinstance(ev, Error)
    for pid in pids:                     # reaped: not even a zombie is left
        assert not Path(f"/proc/{pid}").exists() or _is_other_process(pid)


def _is_other_process(pid: int) -> bool:
    """A recycled pid belongs to someone else: it is not our child."""
    try:
        return os.waitpid(pid, os.WNOHANG) is None
    except ChildProcessError:
        return True


def test_describe_exit():
    assert "SIGKILL" in describe_exit(-9) and "memory" in describe_exit(-9)
    assert describe_exit(3) == "exit code 3"


def test_unknown_or_unfit_plans_are_refused_before_spawning(tiny_dir):
    from engine.parallel.plan import PlanError
    with pytest.raises(PlanError, match="unknown plan"):
        EngineServer(EngineConfig(tiny_dir, plan="nope"))
    with pytest.raises(PlanError, match="needs 4 ranks"):
        EngineServer(EngineConfig(tiny_dir, plan="hybrid4", world_size=2))


def test_a_ranks_failure_names_a_killed_peer_as_its_cause():
    """Rank 0's broken collective is the echo of a peer's death: the killed peer (a signal) is named; a peer
    that exited by itself (0 after its own report, 1 when its collective broke because rank 0 left) is not,
    nor is the reporting rank's own exit, nor anything on one rank."""
    from types import SimpleNamespace

    def server(*exits):
        procs = [SimpleNamespace(is_alive=lambda c=c: c is None, exitcode=c) for c in exits]
        return SimpleNamespace(_workers=SimpleNamespace(procs=procs))
    killed = EngineServer._killed_peer
    s = server(0, -9)
    assert killed(s, 0) is s._workers.procs[1]
    s = server(None, None, -11, None)
    assert killed(s, 0) is s._workers.procs[2] and killed(s, 2) is None
    assert killed(server(0, 1), 0) is None and killed(server(0, None), 0) is None
    assert killed(server(-9, None), 0) is None          # the reporting rank's own death names itself elsewhere
    assert killed(server(-9), 0) is None and killed(SimpleNamespace(_workers=None), 0) is None


@pytest.mark.slow
def test_two_ranks_on_cpu_serve_cancel_and_survive_a_dead_follower(tiny_dir):
    with EngineServer(EngineConfig(tiny_dir, world_size=2)) as server:      # gloo ranks, default plan tp2
        assert server.wait_ready(READY_TIMEOUT_S), server.health()
        h = server.health()
        assert h["plan"] == "tp2" and len(h["worker_pids"]) == 2
        assert isinstance(final(list(server.stream(fast_request()))), Done)
        sub = server.submit(fast_request(steps=60))
        for ev in sub:
            if isinstance(ev, Step):
                sub.cancel()
        assert ev.kind == "cancelled"
        sub = server.submit(fast_request(**LONG))      # large steps: the kill lands inside a collective
        for ev in sub:
            if isinstance(ev, Step):
                os.kill(server.health()["worker_pids"][1], signal.SIGKILL)     # a follower dies
        # rank 0's broken collective (its gloo error) is the echo: the client hears of rank 1's death
        assert isinstance(ev, Error) and ev.kind == "engine" and "rank 1" in ev.message, ev.message
        assert isinstance(final(list(server.stream(fast_request()))), Done)


def test_requests_run_together_up_to_max_batch(tiny_dir):
    """max_batch 4: four submissions at once run together (all four start before the first ends) and each
    finishes with its image; past the batch, requests wait and know their place; a cancel ends one running
    request while its neighbours run on."""
    import threading
    import time
    with EngineServer(EngineConfig(tiny_dir, max_batch=4, preview_every=0)) as server:
        assert server.wait_ready(READY_TIMEOUT_S), server.health()
        seen: dict[int, list] = {i: [] for i in range(4)}
        subs = [server.submit(fast_request(prompt=f"shape number {i}", seed=i)) for i in range(4)]

        def consume(i: int) -> None:
            for ev in subs[i]:
                seen[i].append((time.monotonic(), ev))
        threads = [threading.Thread(target=consume, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(240)
        first_done = min(t for i in seen for t, ev in seen[i] if isinstance(ev, Done))
        for i in range(4):
            assert isinstance(seen[i][-1][1], Done) and any(isinstance(ev, Image) for _, ev in seen[i]), seen[i][-1]
            assert next(t for t, ev in seen[i] if isinstance(ev, Started)) < first_done, i

        got: dict[str, list] = {}

        def steps_of(sub) -> int:           # the Step events of `sub` so far (read without blocking)
            events = got.setdefault(sub.request_id, [])
            while (ev := sub.get(timeout=0)) is not None:
                events.append(ev)
            return sum(isinstance(e, Step) for e in events)

        long = [server.submit(fast_request(prompt=f"long {i}", seed=i, steps=200)) for i in range(6)]
        # the server's counts settle together: a health read while the fourth is being taken in can see it both
        # running and still waiting (a fresh-clone CI run read waiting 3), so wait for the whole state
        wait_for(lambda: (lambda h: h["running"] == 4 and h["waiting"] == h["queue"] == 2)(server.health()), 60)
        h = server.health()
        assert h["waiting"] == h["queue"] == 2 and h["max_batch"] == 4
        assert set(h["running_ids"]) == {s.request_id for s in long[:4]}
        assert [server.position(s.request_id) for s in long] == [None] * 4 + [0, 1]
        steps_before = steps_of(long[1])
        assert long[0].cancel()
        assert isinstance(final(list(long[0])), Error)
        wait_for(lambda: long[4].request_id in server.health()["running_ids"], 60)   # its place goes to the next
        wait_for(lambda: steps_of(long[1]) > steps_before + 1, 120)
        for s in long[1:]:
            s.cancel()
        wait_for(lambda: server.health()["state"] == "ready", 60)
        assert isinstance(final(list(server.stream(fast_request()))), Done)




def test_the_servers_inbox_reads_on_past_a_message_that_does_not_unpickle(capsys):
    """A worker's message whose bytes do not unpickle is reported and skipped; the inbox thread reads the
    next one (it died before: every later event would have waited forever)."""
    import multiprocessing as mp

    from engine.serve.messages import End
    from engine.serve.workers import Inbox
    server_end, worker_end = mp.Pipe(duplex=False)
    inbox = Inbox([server_end], lambda: None)
    worker_end.send_bytes(b"not a pickle")
    worker_end.send(End(7))
    got: list = []
    wait_for(lambda: bool(got.extend(inbox.take()) or got), 5)
    assert got == [End(7)]
    assert "could not be read" in capsys.readouterr().err


def test_a_run_cancelled_in_the_batch_it_reaches_the_worker_is_reported_dropped():
    """A run and its cancel that reach the worker in one batch (it was busy with a step): the run never
    joins the scheduler, and the inbox hands its seq to the worker loop, which reports it cancelled and
    ended. Before, it was dropped silently: the server waited the cancel's 60 s grace for its end, then
    restarted the engine, failing every running request (the soak bench saw it)."""
    import multiprocessing as mp

    from engine.serve.messages import Cancel, Run
    from engine.serve.worker import Inbox
    server_end, worker_end = mp.Pipe()
    inbox = Inbox(worker_end)
    for msg in (Run(1, "prepared 1"), Run(2, "prepared 2"), Cancel(2)):
        server_end.send(msg)
    wait_for(lambda: inbox._q.qsize() == 3, 5)
    news = inbox.news(wait=False)
    assert news.join == ((1, "prepared 1"),) and news.cancel == {2}
    assert inbox.dropped == [2]
