"""One engine worker process: load this rank's shard, then run the engine's steps over the requests the
server hands over.

Rank 0 owns the pipes to the server and reports; the other ranks follow it through a gloo control
group. At every step boundary rank 0 takes what the server sent (requests to run, requests to cancel)
and broadcasts it, so every rank runs the same step on the same set of requests
(engine/runtime/scheduler.py).
"""
from __future__ import annotations

import queue
import signal
import sys
import threading
from multiprocessing.connection import Connection
from typing import Any, assert_never

from engine.parallel.plan import get_plan
from engine.serve.engine_config import EngineConfig
from engine.serve.messages import (AdapterChange, Cancel, End, EventOut, Failed, FromWorker, Loading, RankFailed,
                                   Ready, Run, Stats, Stop, ToWorker)
from engine.runtime.scheduler import StepNews


class Inbox:
    """Rank 0's end of the request pipe (engine/serve/messages.py: `ToWorker`). A thread of its own reads it
    as messages come, so the server never waits on a busy engine; the engine takes what has arrived at each
    step boundary."""

    def __init__(self, conn: Connection):
        self._conn, self._q = conn, queue.SimpleQueue()
        self.dropped: list[int] = []      # runs cancelled in the batch they arrived in: ended by the worker loop
        threading.Thread(target=self._read, name="engine-inbox", daemon=True).start()

    def _read(self) -> None:
        while True:
            try:
                msg: ToWorker = self._conn.recv()
            except (EOFError, OSError):              # the server is gone
                msg = Stop()
            self._q.put(msg)
            if isinstance(msg, Stop):
                return

    def news(self, wait: bool) -> StepNews | None:
        """What arrived since the last step (waiting for something when `wait`); None: stop. A request
        cancelled in the same batch it arrived in never joins: it goes to `dropped`, which the worker loop
        reports as cancelled and ended (the scheduler never sees it, and the server waits for its end)."""
        msgs = [self._q.get()] if wait else []
        while True:
            try:
                msgs.append(self._q.get_nowait())
            except queue.Empty:
                break
        runs: list[Run] = []
        cancel: set[int] = set()
        adapters: list[tuple[str, str, str | None]] = []
        for msg in msgs:
            match msg:
                case Run():
                    runs.append(msg)
                case Cancel(seq):
                    cancel.add(seq)
                case AdapterChange(op, name, folder):
                    adapters.append((op, name, folder))
                case Stop():
                    return None
                case _:
                    assert_never(msg)
        join = tuple((r.seq, r.prepared) for r in runs if r.seq not in cancel)
        self.dropped += [r.seq for r in runs if r.seq in cancel]
        return StepNews(join, frozenset(cancel), tuple(adapters))


def worker_main(rank: int, config: EngineConfig, init_method: str, requests: Connection | None,
                events: Connection | None) -> None:
    """Entry point of one engine worker process: rank `rank` of the engine `config` describes (its
    ranks meet at `init_method`). Rank 0 owns the request pipe and reports events; the other ranks
    follow it through a gloo control group and use their own `events` pipe only to say that a request
    failed on them (engine/serve/messages.py). Load failures are reported by rank 0 as `Failed`; a follower
    that fails to start prints why and exits, which the server sees. After each step in which requests
    ended, rank 0 reports every rank's `rank_stats` (weights read, resident pointers unchanged, memory) as
    `Stats`, then `End` for each.

    A request that fails on a rank of a multi-rank plan leaves the collectives of the ranks out of step
    (the others wait in one the failed rank will never enter), so that rank reports `RankFailed` and
    exits: the server ends the request with that message and
    restarts the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C belongs to the UI process, which closes us
    import torch
    import torch.distributed as dist

    from engine.model.loader import print_progress
    from engine.parallel.groups import RankGroups, rank_device, resident_pointers, set_threads_for_world, shutdown
    from engine.runtime.engine import Engine
    from engine.runtime.events import Error as ErrorEvent
    from engine.runtime.warmup import warm_up

    def send(msg: FromWorker) -> None:
        if events is not None and rank == 0:
            events.send(msg)

    def progress(done: int, total: int, what: str, label: str = "loading weights") -> None:
        if config.verbose:
            print_progress(done, total, what, label)
        send(Loading(done, total, what if label == "loading weights" else f"{label}: {what}"))

    control = None
    try:
        p = get_plan(config.plan, config.world_size, config.sp_kind)
        set_threads_for_world(p.world)
        dev = rank_device(config.device, rank, p.world)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        rt = RankGroups.init(p, rank, dev, init_method)
        if p.world > 1:
            control = dist.new_group(list(range(p.world)), backend="gloo")
        engine = Engine.from_config(config, rt, progress=progress if rank == 0 else None)
        lm, moe_kernels = engine.loaded, engine.moe_kernels
        pointers = resident_pointers(lm.model)
        moved: list[str] = []          # phases at whose start a resident weight had moved (never, by design)

        def check(phase: str) -> None:
            if resident_pointers(lm.model) != pointers:
                moved.append(phase)

        engine.ctx.on_phase = check
        warmed = warm_up(engine, config.warmup, progress=(lambda d, n, what: progress(d, n, what, "warm-up"))
                         if rank == 0 else (lambda *a: None)) if config.warmup else None
        if control is not None:
            dist.barrier(group=control)              # "ready" means every rank holds its shard
    except Exception as e:  # noqa: BLE001 - any load failure is reported, the server decides
        if rank == 0:
            send(Failed(f"{type(e).__name__}: {e}"))
            return
        print(f"engine rank {rank} failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if config.verbose and rank == 0:
        print(f"\nengine: model loaded in {lm.load_s:.1f} s on {dev} (plan {p.name})", file=sys.stderr, flush=True)
        if warmed is not None:
            print(f"engine: warmed up in {warmed.seconds:.1f} s ({warmed.graphs} CUDA graphs captured)",
                  file=sys.stderr, flush=True)
    def rank_stats() -> list[dict]:
        mine = {"rank": rank, "device": str(dev), "backend": dist.get_backend() if dist.is_initialized() else "none",
                "bytes_read": lm.bytes_read,
                "pointers_unchanged": not moved and resident_pointers(lm.model) == pointers,
                "resident_bytes": sum(t.numel() * t.element_size() for t in lm.model.parameters()),
                "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0}
        everyone: list[Any] = [mine]
        if control is not None:
            everyone = [None] * p.world
            dist.all_gather_object(everyone, mine, group=control)
        return everyone

    stats = rank_stats()
    send(Ready({"load_s": round(lm.load_s, 2), "device": str(dev), "dtype": str(lm.model.dtype), "plan": p.name,
                "moe_kernels": moe_kernels, "ranks": stats, "warmup": None if warmed is None else warmed.summary()}))

    inbox = Inbox(requests) if rank == 0 else None
    flag = torch.zeros(1, dtype=torch.long)        # 0: nothing new, 1: news follows, 2: stop

    def agreed_news(wait: bool) -> StepNews | None:
        """Rank 0's news at this step boundary, on every rank (a small broadcast when nothing changed)."""
        news = inbox.news(wait) if rank == 0 else None
        if control is None:
            return news
        flag[0] = 2 if news is None else int(bool(news.join or news.cancel or news.adapters))
        dist.broadcast(flag, 0, group=control)
        if flag[0] == 2:
            return None
        if flag[0] == 0:
            return StepNews()
        box: list[Any] = [news]
        dist.broadcast_object_list(box, src=0, group=control)
        return box[0]

    scheduler = engine.scheduler
    while (news := agreed_news(wait=not scheduler.busy)) is not None:
        engine.step(news)
        done, ended = scheduler.drain()
        if inbox is not None and inbox.dropped:
            done += [(seq, ErrorEvent("cancelled", "stopped by the user")) for seq in inbox.dropped]
            ended += inbox.dropped
            inbox.dropped = []
        failed = None
        try:
            for seq, ev in done:
                send(EventOut(seq, ev))
                if isinstance(ev, ErrorEvent) and ev.kind == "engine":
                    failed = (seq, ev.message)
            if failed is not None and p.world > 1:
                if events is not None:
                    events.send(RankFailed(failed[0], rank, failed[1]))
                return                 # out of step with the other ranks: the server restarts the engine
            if ended:
                send(Stats(rank_stats()))
                for seq in ended:
                    send(End(seq))
        except (BrokenPipeError, EOFError, OSError):
            return
    shutdown()
