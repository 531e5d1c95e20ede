"""The persistent engine server: worker processes that keep the model resident, and the client API that
the studio, the CLI and the benchmarks use (engine/serve/client.py `EngineClient`).

    with EngineServer(EngineConfig("path/to/model")) as server:
        sub = server.submit(Request(prompt="a red fox"))     # validated here, then queued
        async for ev in sub: ...                              # or `for ev in sub:` from sync code
        server.cancel(sub.request_id); server.health()

Requests are validated and prepared here, once, queued here, and handed to the engine's worker 0
(engine/serve/workers.py) as soon as fewer than `max_batch` run (the engine batches them); `max_queue`
counts the ones waiting beyond that. A cancel is a message to the engine (engine/serve/messages.py
`Cancel`), which it takes at its next step boundary (its next token or denoise step); it ends that
request only. Sequence numbers are never reused, so a stale cancel hits nothing.

One pump thread owns the workers: it reads their messages, dispatches queued requests, notices a
dead worker (its pipe closes and its process sentinel fires) or a stalled one (no token or step within
the limit of `engine.serve.supervisor.StallWatch`), fails the in-flight request with a clear
`Error("engine", ...)` and starts the workers again, which reload the weights; when, how often and when
to give up is `engine.serve.supervisor.Restarts`' call (backoff, an attempt count, "failed" only when
the model cannot load; `reload()` starts over). Killing the old workers and spawning new ones happens
outside the server's lock, so `health()` and `submit()` answer while the engine restarts. Nothing a
worker does can raise into the caller.
"""
from __future__ import annotations

import collections
import dataclasses
import multiprocessing as mp
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, Callable, Iterator, assert_never

from engine.serve.conversation import ConversationStore, TurnRecorder
from engine.runtime.events import Done, Error, Event
from engine.runtime.request import Prepared, Request
from engine.serve.adapters import check_load, check_unload
from engine.serve.admission import admit
from engine.serve.client import EngineClient, Submission
from engine.serve.engine_config import EngineConfig
from engine.serve.info import ModelInfo
from engine.serve.messages import (AdapterChange, Cancel, End, EventOut, Failed, FromWorker, Loading, RankFailed,
                                   Ready, Run, Stats, ToWorker)
from engine.serve.supervisor import Restarts, StallWatch
from engine.serve.turns import submit_turn
from engine.serve.workers import Workers

CANCEL_GRACE_S = 60.0       # a worker that ignores a cancel this long is considered hung and restarted
DEATH_GRACE_S = 2.0         # an engine error of a multi-rank request waits this long for a rank's death to show


@dataclass
class _Job:
    seq: int
    sub: Submission
    prepared: Prepared
    cancelled_at: float | None = None
    recorder: TurnRecorder | None = None     # a conversation's turn: recorded once it has its image


def _engine_failure(m: FromWorker) -> bool:
    """A rank's report of a failed request, or an engine error event of one."""
    return isinstance(m, RankFailed) or (isinstance(m, EventOut) and isinstance(m.event, Error)
                                         and m.event.kind == "engine")


class EngineServer(EngineClient):
    """The engine's workers, started once and restarted when they die or stall, the model resident in them;
    the queue of requests in front of them and the client API."""

    def __init__(self, config: EngineConfig, *, max_queue: int | None = None, step_timeout: float | None = None,
                 cancel_grace_s: float = CANCEL_GRACE_S):
        """Start the engine `config` describes (engine/serve/engine_config.py), fixed for this machine and its
        checkpoint first: a plan the checkpoint cannot be split by, a folder that is not a checkpoint or an
        adapter it cannot serve is refused here, before anything is spawned (ValueError: PlanError,
        ConfigError). `self.config` is what every worker starts from. `max_queue`: how many requests may
        wait beyond the running ones (None: no limit); one more is refused at submit with Error('busy'),
        checked under the queue's lock so simultaneous arrivals cannot overshoot it. `step_timeout`: seconds
        the running requests may go without a token or step before the engine is restarted (None: automatic,
        from the engine's own figures; 0: never; engine.serve.supervisor). `cancel_grace_s`: how long a
        running request may ignore a cancel before the engine counts as hung."""
        if max_queue is not None and max_queue < 0:
            raise ValueError(f"max_queue must be >= 0 (got {max_queue})")
        self.info = ModelInfo.from_folder(config.model)
        self.config = config.on_this_machine().for_checkpoint(self.info)
        self.cancel_grace_s = cancel_grace_s
        self.max_queue = max_queue

        self._restarts = Restarts()
        self._watch = StallWatch(step_timeout)
        self._ctx = mp.get_context("spawn")
        self._lock = threading.RLock()        # the queue and the state: held for bookkeeping only, never while waiting
        self._adapter_lock = threading.Lock()  # one adapter load or unload at a time
        self._waiting: collections.deque[_Job] = collections.deque()
        self._running: dict[int, _Job] = {}               # seq -> job handed to the engine, not yet ended
        self._jobs: dict[str, _Job] = {}
        self._seq = 0
        self._state = "loading"
        self._last_error: str | None = None
        self._loading: str | None = None
        self._worker_info: dict[str, Any] = {}
        self._closing = False
        self._workers: Workers | None = None               # the running start of the engine
        self._doomed: list[Workers] = []                   # detached under the lock, killed outside it
        self._wake_r, self._wake_w = self._ctx.Pipe(duplex=False)
        self.conversations = ConversationStore()           # multi-turn editing (engine/serve/conversation.py)
        self._install(self._spawn())
        self._pump = threading.Thread(target=self._pump_loop, name="engine-server-pump", daemon=True)
        self._pump.start()

    # the configuration's figures under the names the server's users read
    model = property(lambda self: self.config.model)
    device = property(lambda self: self.config.device)
    dtype = property(lambda self: self.config.dtype)
    plan = property(lambda self: self.config.plan)
    world_size = property(lambda self: self.config.world_size)
    max_batch = property(lambda self: self.config.max_batch)

    # ------------------------------------------------------------------ client API
    def submit(self, request: Request, recorder: Callable[[Request, Prepared], TurnRecorder] | None = None
               ) -> Submission:
        """Validate and queue a request. Bad input ends the stream at once with Error('invalid') and is
        never queued, a full queue ends it with Error('busy'); otherwise the events follow as the engine
        runs it. `recorder` (submit_turn's): makes what sees its events before the client does."""
        admitted = admit(self.info, request, self.adapters(), self._merged())   # once: the engine runs it as prepared
        if isinstance(admitted, Error):
            return Submission.refused(request, admitted, self.cancel)
        return self.submit_admitted(*admitted, recorder=recorder)

    def submit_admitted(self, request: Request, prepared: Prepared,
                        recorder: Callable[[Request, Prepared], TurnRecorder] | None = None) -> Submission:
        """Queue a request admitted where it entered (engine.serve.admission: `submit`'s, or a replica pool's
        ingress, whose replicas run what it admitted), unchecked: what may change after admission, an
        adapter unloaded meanwhile, the engine refuses when the request starts (Error('invalid'), as for
        a queued request)."""
        with self._lock:
            refusal = self._refusal(request)
            if refusal is not None:
                return Submission.refused(request, refusal, self.cancel)
            sub = Submission(request, self.cancel)
            self._seq += 1
            job = _Job(self._seq, sub, prepared, recorder=recorder and recorder(request, prepared))
            self._jobs[request.request_id] = job
            self._waiting.append(job)
        self._kick()
        return sub

    def _refusal(self, request: Request) -> Error | None:
        """Why a request cannot be queued now (lock held), or None."""
        if self._closing:
            return Error("engine", "the engine is shut down")
        if self._state == "failed":
            return Error("engine", f"the engine is not running: {self._last_error}")
        if request.request_id in self._jobs:
            return Error("invalid", f"request id {request.request_id!r} is already in use", "request_id")
        if self.max_queue is not None and len(self._waiting) >= self.max_queue:
            n = len(self._waiting)
            return Error("busy", f"the queue is full ({n} request{'' if n == 1 else 's'} waiting); try again in a moment")
        return None

    def submit_turn(self, request: Request, conversation: str | None = None,
                    branch_from_turn: int | None = None) -> Submission:
        """A conversation's next turn (engine.serve.turns.submit_turn, on this server's store)."""
        return submit_turn(self, self.conversations, request, conversation, branch_from_turn)

    def stream(self, request: Request) -> Iterator[Event]:
        """Sync convenience: submit and iterate the events."""
        return iter(self.submit(request))

    def cancel(self, request_id: str) -> bool:
        """Stop a queued or running request. It ends at once with Error('cancelled'); a running one stops
        the engine at its next token or step. False when the id is unknown or already finished."""
        with self._lock:
            job = self._jobs.get(request_id)
            if job is None or job.sub.ended:
                return False
            if job in self._waiting:
                self._waiting.remove(job)
                del self._jobs[request_id]
                job.sub.push(Error("cancelled", "stopped before it started"))
                return True
            # running: tell the engine, answer the client now, free its place when the worker says so
            job.cancelled_at = time.monotonic()
            self._send(Cancel(job.seq))
            job.sub.push(Error("cancelled", "stopped by the user"))
        self._kick()
        return True

    def position(self, request_id: str) -> int | None:
        """How many requests wait ahead of this one (0: it starts next); None when it is not waiting."""
        with self._lock:
            for i, job in enumerate(self._waiting):
                if job.sub.request_id == request_id:
                    return i
            return None

    def health(self) -> dict[str, Any]:
        """The engine's state (loading, ready, busy, restarting; stalled: restarting because its work made no
        progress within the stall limit; failed, closed), the queue, the last error (for failed: why the
        model cannot load), `attempt` (the start attempt while restarting or loading after a crash),
        `restart_in_s` (the wait before the next start) and `stall_limit_s` (how long the running request
        may go without a token or step). From the server's own state: it never waits on a worker."""
        with self._lock:
            now = time.monotonic()
            spawn_at = self._restarts.spawn_at
            return {
                "state": self._state,
                "model": self.model,
                "model_name": self.info.name,
                "device": self.device,
                "dtype": self._worker_info.get("dtype", self.dtype or "auto"),
                "world_size": self.world_size,
                "plan": self.plan,
                **self._counts(),
                "max_queue": self.max_queue,
                "loading": self._loading,
                "last_error": self._last_error,
                "restarts": self._restarts.total,
                "attempt": self._restarts.attempt if self._state in ("loading", "restarting", "stalled") else 0,
                "restart_in_s": round(max(0.0, spawn_at - now), 1) if spawn_at is not None else None,
                "stall_limit_s": self._watch.limit() if self._running else None,
                "load_s": self._worker_info.get("load_s"),
                # what multiplies the quantized weights (a numerics choice: W4A8 under auto with humming), once loaded
                "kernels": {"experts": self._worker_info["moe_kernels"], "mxfp8": self._worker_info["mxfp8_kernels"],
                            "text": self._worker_info.get("kernels_text", "")}
                if "moe_kernels" in self._worker_info else None,
                "scheduler": self._worker_info.get("scheduler"),
                "warmup": self._worker_info.get("warmup"),
                "worker_pids": self._workers.pids if self._workers is not None else [],
                "ranks": self._worker_info.get("ranks", []),
            }

    def _counts(self) -> dict[str, Any]:
        """Health's view of the requests: running (in the engine's batch) and waiting (queued beyond it)."""
        return {"running": len(self._running), "waiting": len(self._waiting), "queue": len(self._waiting),
                "max_batch": self.max_batch, "running_ids": [j.sub.request_id for j in self._running.values()]}

    def reload(self) -> bool:
        """The way back from "failed" without restarting the process: load the model again (the folder
        may have been fixed meanwhile). False when the engine is not in the failed state."""
        with self._lock:
            if self._closing or self._state != "failed":
                return False
            self._restarts.reset(time.monotonic())
            self._state, self._loading = "loading", "starting"
            print("engine server: reloading the model on request", file=sys.stderr, flush=True)
        self._kick()
        return True

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Block until the model is loaded (True) or loading failed / the time ran out (False)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            state = self.health()["state"]
            if state in ("ready", "busy"):
                return True
            if state in ("failed", "closed") or (deadline is not None and time.monotonic() > deadline):
                return False
            time.sleep(0.05)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the workers (gracefully, then by force) and end every pending request. Idempotent."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
            pending = list(self._waiting) + list(self._running.values())
            self._waiting.clear()
            for job in pending:
                job.sub.push(Error("engine", "the engine was shut down"))
        self._kick()
        self._pump.join(timeout)
        with self._lock:
            workers, self._workers = self._workers, None
        if workers is not None:
            workers.stop(timeout)
        for doomed in self._take_doomed():
            doomed.kill()
        with self._lock:
            self._state = "closed"
        for c in (self._wake_r, self._wake_w):
            c.close()

    def __enter__(self) -> EngineServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:    # a forgotten server must not leave workers behind
        try:
            if not self._closing:
                self.close(timeout=2.0)
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ------------------------------------------------------------------ LoRA adapters
    def adapters(self) -> list[str]:
        """The names of the LoRA adapters served (a request's `lora` names one)."""
        return [n for n, _ in self.config.loras]

    def load_adapter(self, name: str, folder: str | Path) -> None:
        """Serve another LoRA adapter from now on (every rank loads it before its next step). ValueError
        when it cannot be: no free slot, a name in use, or a folder that is not a servable adapter."""
        with self._adapter_lock:          # one change at a time: the adapter is read outside the server's lock
            with self._lock:
                self._refuse_if_merged()
                config = self.config
            folder = check_load(self.info, config.loras, config.lora_slots, config.max_lora_rank, name, folder,
                                config.lora_mlp)
            with self._lock:              # a restarted engine loads the current set; the running one is told
                self.config = dataclasses.replace(self.config, loras=self.config.loras + ((name, folder),))
                self._send(AdapterChange("load", name, folder))

    def unload_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter; refused (ValueError) while a queued or running request uses it."""
        with self._adapter_lock, self._lock:
            if name in self.adapters():
                self._refuse_if_merged()
            users = [j.sub.request_id for j in (*self._waiting, *self._running.values())
                     if j.prepared.lora == name and not j.sub.ended]
            self.config = dataclasses.replace(self.config, loras=check_unload(self.config.loras, name, users))
            self._send(AdapterChange("unload", name))

    def merged_adapter(self) -> str | None:
        """The adapter folded into the weights (--lora-merged): every request runs it; None otherwise."""
        merged = self._merged()
        return None if merged is None else merged[0]

    def _merged(self) -> tuple[str, float] | None:
        """The adapter folded into the weights and its strength (--lora-merged), or None."""
        return (self.config.loras[0][0], self.config.lora_merged_scale) if self.config.lora_merged else None

    def _refuse_if_merged(self) -> None:
        if self.config.lora_merged:
            raise ValueError(f"this engine serves the LoRA adapter {self.config.loras[0][0]!r} merged into its "
                             "weights (--lora-merged): adapters cannot be loaded or unloaded")

    # ------------------------------------------------------------------ the workers
    def _spawn(self) -> Workers:
        """Start every rank's worker process (called without the lock held, but for the first start)."""
        return Workers.spawn(self._ctx, self.config, self._kick)

    def _install(self, workers: Workers) -> None:
        """Make `workers` the running engine (with the lock held, or before the pump starts)."""
        self._workers = workers
        self._loading = "starting"
        self._restarts.spawned()
        self._watch.new_engine()

    def _detach(self) -> None:
        """Take the running engine's processes and pipes out of service (lock held); the pump kills them
        once the lock is released."""
        if self._workers is not None:
            self._doomed.append(self._workers)
        self._workers = None

    def _take_doomed(self) -> list[Workers]:
        with self._lock:
            doomed, self._doomed = self._doomed, []
        return doomed

    def _send(self, msg: ToWorker) -> None:
        """Hand the engine a message (lock held); a worker that is gone is its sentinel's news, and a restarted
        engine starts from the config."""
        if self._workers is not None:
            self._workers.send(msg)

    def _kick(self) -> None:
        try:
            self._wake_w.send_bytes(b"!")
        except (OSError, ValueError):
            pass

    # ------------------------------------------------------------------ the pump thread
    def _pump_loop(self) -> None:
        """Wake at a message, a death, a kick or a deadline; take the workers' messages; act under the lock,
        which is never held while anything waits on a worker (health() answers whatever the worker does)."""
        while True:
            with self._lock:
                if self._closing:
                    return
                workers = self._workers
                timeout = self._next_wake(time.monotonic())
            sentinels = [] if workers is None else [p.sentinel for p in workers.procs]
            wait([self._wake_r, *sentinels], timeout)
            while self._wake_r.poll():
                self._wake_r.recv_bytes()
            messages = [] if workers is None else self._take_messages(workers)
            with self._lock:
                if self._closing:
                    return
                for msg in messages:
                    if workers is not self._workers:       # restarted meanwhile: the rest is the old start's
                        break
                    self._on_message(msg)
                self._supervise(time.monotonic())
                self._dispatch()
                start = self._workers is None and self._state in ("loading", "restarting", "stalled") and \
                    self._restarts.due(time.monotonic())
            if not self._replace_workers(start):
                return

    def _take_messages(self, workers: Workers) -> list[FromWorker]:
        """The workers' messages since the last round (lock not held), a rank's failure first: its peers' errors
        (a collective broken by its exit) come after it. Rank 0 failing in a collective is often the echo of
        another rank's death: such an error waits briefly for that death to show (its broken pipe can reach
        rank 0 before the dying process reads as dead), so that the death names the cause."""
        messages = workers.inbox.take()
        if self.world_size > 1 and any(_engine_failure(m) for m in messages):
            workers.dead_within(DEATH_GRACE_S)
            messages += workers.inbox.take()
        return sorted(messages, key=lambda m: not isinstance(m, RankFailed))

    def _replace_workers(self, start: bool) -> bool:
        """The slow part, without the lock: reap the old workers, start the new ones (False: closing)."""
        for doomed in self._take_doomed():
            doomed.kill()
        if not start:
            return True
        try:
            workers = self._spawn()
        except Exception as e:  # noqa: BLE001 - (out of processes, files, memory): try again later
            with self._lock:
                self._restart(f"the engine could not be started ({type(e).__name__}: {e})", while_loading=True)
            return True
        with self._lock:
            if self._closing:
                self._doomed.append(workers)
                return False
            self._install(workers)
        return True

    def _next_wake(self, now: float) -> float:
        """How long the pump may sleep: until the next deadline (a cancel's grace, a stall, a start)."""
        times = [now + 0.5, self._restarts.spawn_at]
        if (stuck := self._oldest_cancel()) is not None:
            times.append(stuck + self.cancel_grace_s)
        times.append(self._watch.deadline(self._sending_since()))
        return max(0.0, min(t for t in times if t is not None) - now)

    def _sending_since(self) -> float | None:
        """Since when rank 0 has left the server's message in its pipe unread (None: it is not)."""
        return None if self._workers is None else self._workers.outbox.sending_since

    def _supervise(self, now: float) -> None:
        """Deaths, stalls and ignored cancels end in a restart (lock held)."""
        if self._state in ("failed", "closed") or self._workers is None:
            return
        if dead := self._workers.dead():
            self._on_death(dead[0])
        elif (stuck := self._oldest_cancel()) is not None and now - stuck > self.cancel_grace_s:
            self._restart(f"the engine did not stop within {self.cancel_grace_s:.0f} s of a cancel")
        elif (stalled := self._watch.overdue(now, self._sending_since())) is not None:
            self._restart(stalled, stalled=True)

    def _oldest_cancel(self) -> float | None:
        """When the oldest cancel the engine has not yet acted on was sent (None: there is none)."""
        times = [j.cancelled_at for j in self._running.values() if j.cancelled_at is not None]
        return min(times) if times else None

    # ------------------------------------------------------------------ the workers' messages (lock held)
    def _on_message(self, msg: FromWorker) -> None:
        match msg:
            case EventOut(seq, ev):
                self._on_event(seq, ev)
            case End(seq):
                self._on_end(seq)
            case RankFailed(seq, rank, message):
                if (cause := self._killed_peer(rank)) is not None:     # the echo of that death: name it
                    self._on_death(cause)
                    return
                if seq in self._running:
                    self._running[seq].sub.push(Error("engine", f"{message} (on engine rank {rank}; the engine is "
                                                                "restarting and reloading the model)"))
                self._restart(f"engine rank {rank} failed a request: {message}")
            case Stats(ranks):
                self._worker_info["ranks"] = ranks
            case Loading(done, total, what):
                self._loading = f"{done}/{total} {what}"
            case Ready(info):
                self._worker_info, self._loading, self._state = info, None, "ready"
                self._restarts.ready(time.monotonic())
            case Failed(message):
                self._fail(f"the engine could not load the model: {message}")
            case _:
                assert_never(msg)

    def _on_event(self, seq: int, ev: Event) -> None:
        job = self._running.get(seq)
        if job is None:
            return
        if isinstance(ev, Done):
            self._watch.completed(time.monotonic())
        else:
            self._watch.progress(time.monotonic())
        if isinstance(ev, Error) and ev.kind == "engine":
            if (cause := self._killed_peer(0)) is not None:   # the echo of another rank's death (_take_messages)
                self._on_death(cause)
                return
        if job.recorder is not None:
            job.recorder.see(ev)
        job.sub.push(ev)

    def _killed_peer(self, rank: int) -> Any:
        """Another rank's process that was killed (a signal: SIGKILL, the OOM killer, a crash) while `rank`
        failed, or None. A multi-rank failure reported by one rank is usually a collective broken by such a
        death, whose pipe error can reach the server before the death does (_take_messages waits for it):
        the death names the cause. A peer that exited by itself (code 0 after its own report, 1 when its next
        collective broke because `rank` left) is the echo, not the cause."""
        if self._workers is None or len(self._workers.procs) < 2:
            return None
        for i, proc in enumerate(self._workers.procs):
            if i != rank and not proc.is_alive() and (proc.exitcode or 0) < 0:
                return proc
        return None

    def _on_end(self, seq: int) -> None:
        job = self._running.pop(seq, None)
        if job is None:
            return
        if not self._running:
            self._watch.stop()
        self._jobs.pop(job.sub.request_id, None)
        job.sub.push(Error("engine", "the engine ended the request without a result"))    # no-op if ended
        self._state = "busy" if self._running else "ready"

    def _on_death(self, proc: Any) -> None:
        assert self._workers is not None
        why = self._workers.describe_death(proc)
        if self._state in ("loading", "restarting", "stalled"):
            self._restart(f"{why} while loading the model", while_loading=True)
        else:
            self._restart(why)

    def _restart(self, why: str, while_loading: bool = False, stalled: bool = False) -> None:
        """Fail the in-flight requests, take the workers out of service and schedule the next start (or
        give up: `Restarts`). Nothing here waits on a process. After a stall the state is "stalled" until
        the new start is ready (or fails in turn), else "restarting"."""
        self._last_error = why
        running, self._running = list(self._running.values()), {}
        self._watch.stop()
        for job in running:
            self._jobs.pop(job.sub.request_id, None)
            job.sub.push(Error("engine", f"{why}. The engine is restarting and reloading the model; "
                                         "please try again in a moment."))
        self._detach()
        decision = self._restarts.crashed(time.monotonic(), while_loading, why)
        if decision.failed is not None:
            self._fail(decision.failed)
            return
        self._state, self._loading = "stalled" if stalled else "restarting", None
        wait = f" in {decision.delay_s:g} s" if decision.delay_s else ""
        print(f"engine server: {why}; restarting the engine{wait} (attempt {decision.attempt})",
              file=sys.stderr, flush=True)

    def _fail(self, why: str) -> None:
        """The model cannot load: no point respawning in a loop. Every pending request ends with the
        reason; `reload()` tries again."""
        self._state, self._last_error, self._loading = "failed", why, None
        self._watch.stop()
        print(f"engine server: {why}; the engine stays down until reload()", file=sys.stderr, flush=True)
        pending = list(self._waiting) + list(self._running.values())
        self._waiting.clear()
        self._running = {}
        for job in pending:
            self._jobs.pop(job.sub.request_id, None)
            job.sub.push(Error("engine", why))
        self._detach()

    # ------------------------------------------------------------------ dispatch (lock held)
    def _dispatch(self) -> None:
        """Hand waiting requests to the engine while fewer than max_batch run."""
        while self._state in ("ready", "busy") and self._waiting and len(self._running) < self.max_batch \
                and self._workers is not None:
            job = self._waiting.popleft()
            if not self._running:
                self._watch.start(time.monotonic())      # the engine has work again: its events are watched
            self._running[job.seq] = job
            self._state = "busy"
            if not self._workers.send(Run(job.seq, job.prepared)):    # died between messages: its sentinel tells
                self._last_error = "could not hand the request to the engine: its worker is gone"
                return
