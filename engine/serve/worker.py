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
from engine.runtime.events import Done as DoneEvent
from engine.runtime.events import Error as ErrorEvent
from engine.runtime.events import Image as ImageEvent
from engine.runtime.events import Step as StepEvent
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
            except Exception as e:  # noqa: BLE001 - one message that does not unpickle: reported, read on
                print(f"engine worker: a message from the server could not be read: {type(e).__name__}: {e}",
                      file=sys.stderr, flush=True)
                continue
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


class Sender:
    """Rank 0's end of its event pipe, written by a thread of its own: the engine's loop hands a step's
    messages over and goes on with the next step while this thread writes them, in order, encoding each
    image's PNG first (an `Image` event leaves the engine as pixels: a 1024 px PNG is ~0.1-0.2 s of a CPU
    core, which PIL spends with the GIL released, so the GPU's next steps are launched meanwhile).
    `broken`: the server is gone (nothing more can be written)."""

    def __init__(self, conn: Connection):
        self._conn, self._q = conn, queue.SimpleQueue()
        self.broken = False
        self._thread = threading.Thread(target=self._write, name="engine-sender", daemon=True)
        self._thread.start()

    def put(self, msg: FromWorker) -> None:
        self._q.put(msg)

    def close(self, timeout: float) -> None:
        """Write what was handed over (the last step's events, a `RankFailed`), then let the thread end."""
        self._q.put(None)
        self._thread.join(timeout)

    def _write(self) -> None:
        while (msg := self._q.get()) is not None:
            if self.broken:
                continue
            try:
                self._send(msg)
            except (EOFError, OSError):                  # the server is gone
                self.broken = True

    def _send(self, msg: FromWorker) -> None:
        """Write one message. One that cannot be written (it does not pickle: nothing reached the pipe, which
        pickles before it writes) fails its request, or is reported and skipped, and the thread goes on: a
        dead sender would leave every request waiting on an engine that still runs."""
        try:
            self._conn.send(_encoded(msg))
        except (EOFError, OSError):
            raise
        except Exception as e:  # noqa: BLE001 - one message's fault, reported where it belongs
            why = f"the engine could not send it: {type(e).__name__}: {e}"
            if isinstance(msg, EventOut):
                self._conn.send(EventOut(msg.seq, ErrorEvent("engine", why)))
            else:
                print(f"engine worker: a {type(msg).__name__} message was dropped: {why}", file=sys.stderr, flush=True)


def _encoded(msg: FromWorker) -> FromWorker:
    """`msg` with its image's (or step preview's) PNG encoded, or its Done's device timings settled (both wait
    for the device work they come from, here and not on the engine's loop): what the server reads. An image
    that cannot be encoded, or timings that cannot be read, fail their request, not the engine."""
    if isinstance(msg, EventOut) and isinstance(msg.event, (ImageEvent, StepEvent, DoneEvent)):
        try:
            if isinstance(msg.event, ImageEvent):
                msg.event.png
            elif isinstance(msg.event, StepEvent):
                msg.event.preview
            else:
                msg.event.timings
        except Exception as e:  # noqa: BLE001 - reported on the request's stream
            what = "its timings could not be read" if isinstance(msg.event, DoneEvent) else \
                "the image could not be encoded as PNG"
            return EventOut(msg.seq, ErrorEvent("engine", f"{what}: {e}"))
    return msg


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
    exits: the server ends the request with that message and restarts the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C belongs to the UI process, which closes us
    worker = WorkerRank(rank, config, events)
    try:
        worker.load(init_method)
    except Exception as e:  # noqa: BLE001 - any load failure is reported, the server decides
        if rank == 0:
            worker.send(Failed(f"{type(e).__name__}: {e}"))
            return
        print(f"engine rank {rank} failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    worker.ready()
    worker.serve(Inbox(requests) if rank == 0 else None)


class WorkerRank:
    """One rank's engine inside its worker process: loaded (and warmed up) once, then stepped over the news
    rank 0 receives and broadcasts on the control group."""

    def __init__(self, rank: int, config: EngineConfig, events: Connection | None):
        self.rank, self.config, self.events = rank, config, events
        self.sender: Sender | None = None        # rank 0's event writer while it serves
        self.control: Any = None                 # the ranks' gloo group for the news (None: one rank)
        self.moved: list[str] = []               # phases at whose start a resident weight had moved (never)

    def send(self, msg: FromWorker) -> None:
        """One of rank 0's messages to the server (the other ranks' are `RankFailed` only: `write`)."""
        if self.rank == 0:
            self.write(msg)

    def write(self, msg: FromWorker) -> None:
        if self.sender is not None:
            self.sender.put(msg)
        elif self.events is not None:
            self.events.send(msg)

    def progress(self, done: int, total: int, what: str, label: str = "loading weights") -> None:
        from engine.model.loader import print_progress
        if self.config.verbose:
            print_progress(done, total, what, label)
        self.send(Loading(done, total, what if label == "loading weights" else f"{label}: {what}"))

    def load(self, init_method: str) -> None:
        """Join the ranks, build the engine on this rank's shard, warm it up; every rank holds its shard
        when this returns."""
        import torch
        import torch.distributed as dist

        from engine.parallel.groups import RankGroups, rank_device, resident_pointers, set_threads_for_world
        from engine.runtime.engine import Engine
        from engine.runtime.warmup import warm_up
        config, rank = self.config, self.rank
        self.plan = p = get_plan(config.plan, config.world_size, config.sp_kind)
        set_threads_for_world(p.world)
        self.dev = dev = rank_device(config.device, rank, p.world)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        rt = RankGroups.init(p, rank, dev, init_method)
        if p.world > 1:
            self.control = dist.new_group(list(range(p.world)), backend="gloo")
            self.flag = torch.zeros(1, dtype=torch.long)     # the news flag, broadcast at every step
        self.engine = Engine.from_config(config, rt, progress=self.progress if rank == 0 else None)
        model = self.engine.loaded.model
        self.pointers = resident_pointers(model)

        def check(phase: str) -> None:
            if resident_pointers(model) != self.pointers:
                self.moved.append(phase)

        self.engine.ctx.on_phase = check
        self.warmed = warm_up(self.engine, config.warmup,
                              progress=(lambda d, n, what: self.progress(d, n, what, "warm-up"))
                              if rank == 0 else (lambda *a: None)) if config.warmup else None
        if self.control is not None:
            dist.barrier(group=self.control)     # "ready" means every rank holds its shard

    def ready(self) -> None:
        lm, warmed = self.engine.loaded, self.warmed
        if self.config.verbose and self.rank == 0:
            kernels, steps = self.engine.ctx.kernels, self.engine.scheduler
            print(f"\nengine: model loaded in {lm.load_s:.1f} s on {self.dev} (plan {self.plan.name}"
                  + (f"; {kernels}" if kernels else "") + f"; step policy {steps.policy}:{steps.k}, decode lookahead "
                  + ("on" if steps.lookahead else "off") + ")", file=sys.stderr, flush=True)
            if self.engine.kernels_hint:
                print(f"engine: {self.engine.kernels_hint}", file=sys.stderr, flush=True)
            if warmed is not None:
                print(f"engine: warmed up in {warmed.seconds:.1f} s ({warmed.graphs} CUDA graphs captured)",
                      file=sys.stderr, flush=True)
        self.send(Ready({"load_s": round(lm.load_s, 2), "device": str(self.dev), "dtype": str(lm.model.dtype),
                         "plan": self.plan.name, "moe_kernels": self.engine.moe_kernels,
                         "mxfp8_kernels": self.engine.mxfp8_kernels,
                         "kernels_text": self.engine.ctx.kernels,
                         # how its steps share the device (the default depends on the GPUs: plan.default_step_policy)
                         "scheduler": {"policy": self.engine.scheduler.policy,
                                       "decode_steps_per_denoise": self.engine.scheduler.k,
                                       "lookahead": self.engine.scheduler.lookahead},
                         "ranks": self.rank_stats(),
                         "warmup": None if warmed is None else warmed.summary()}))

    def rank_stats(self) -> list[dict]:
        """Every rank's weights read, resident pointers unchanged and memory (gathered on the control group)."""
        import torch
        import torch.distributed as dist

        from engine.parallel.groups import resident_pointers
        lm, dev = self.engine.loaded, self.dev
        mine = {"rank": self.rank, "device": str(dev),
                "backend": dist.get_backend() if dist.is_initialized() else "none", "bytes_read": lm.bytes_read,
                "pointers_unchanged": not self.moved and resident_pointers(lm.model) == self.pointers,
                "resident_bytes": sum(t.numel() * t.element_size() for t in lm.model.parameters()),
                "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0}
        everyone: list[Any] = [mine]
        if self.control is not None:
            everyone = [None] * self.plan.world
            dist.all_gather_object(everyone, mine, group=self.control)
        return everyone

    def agreed_news(self, inbox: Inbox | None, wait: bool) -> StepNews | None:
        """Rank 0's news at this step boundary, on every rank (a small broadcast when nothing changed)."""
        import torch.distributed as dist
        news = inbox.news(wait) if inbox is not None else None
        if self.control is None:
            return news
        flag = self.flag                         # 0: nothing new, 1: news follows, 2: stop
        flag[0] = 2 if news is None else int(bool(news.join or news.cancel or news.adapters))
        dist.broadcast(flag, 0, group=self.control)
        if flag[0] == 2:
            return None
        if flag[0] == 0:
            return StepNews()
        box: list[Any] = [news]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]

    def serve(self, inbox: Inbox | None) -> None:
        """Step the engine over the news until rank 0 says stop (or its pipes are gone)."""
        from engine.parallel.groups import shutdown
        scheduler = self.engine.scheduler
        if self.rank == 0 and self.events is not None:
            self.sender = Sender(self.events)
        try:
            while (news := self.agreed_news(inbox, wait=not scheduler.busy)) is not None:
                self.engine.step(news)
                done, ended = scheduler.drain()
                if inbox is not None and inbox.dropped:
                    done += [(seq, ErrorEvent("cancelled", "stopped by the user")) for seq in inbox.dropped]
                    ended += inbox.dropped
                    inbox.dropped = []
                try:
                    if not self.report(done, ended):
                        return             # out of step with the other ranks: the server restarts the engine
                except (BrokenPipeError, EOFError, OSError):
                    return
                if self.sender is not None and self.sender.broken:
                    return
        finally:
            if self.sender is not None:
                self.sender.close(timeout=30)      # the last step's events (a RankFailed) reach the server
        shutdown()

    def report(self, done: list[tuple[int, Any]], ended: list[int]) -> bool:
        """Send the step's events, then `Stats` and `End` for the requests that ended. False: a request failed
        on this rank of a multi-rank plan (reported as `RankFailed`), so this rank must leave."""
        failed = None
        for seq, ev in done:
            self.send(EventOut(seq, ev))
            if isinstance(ev, ErrorEvent) and ev.kind == "engine":
                failed = (seq, ev.message)
        if failed is not None and self.plan.world > 1:
            self.write(RankFailed(failed[0], self.rank, failed[1]))
            return False
        if ended:
            self.send(Stats(self.rank_stats()))
            for seq in ended:
                self.send(End(seq))
        return True
