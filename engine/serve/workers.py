"""The engine's worker processes, one start of them at a time (`Workers`): every rank's process spawned with
fresh pipes, rank 0 handed the server's messages, their messages read, and their end: politely when the
server closes, by SIGKILL when they are replaced (a stopped or hung worker ignores anything politer, and
nothing it holds needs saving). Pipes are created fresh for every start: a worker killed while writing can
leave a shared queue's lock held forever, a closed pipe just reads as EOF.

Nothing the server does waits on a worker: a thread of each start writes the server's messages (`Outbox`: a
bounded queue, so `send` returns at once even when rank 0 has stopped reading; `sending_since` says how long
the message in the pipe has waited, which the stall watch reads) and another reads the workers' (`Inbox`),
so a worker stopped halfway through a message holds up only that thread.

Spawned with the `spawn` context (CUDA cannot be forked). Worker 0 receives the requests, broadcasts them to
the other ranks over a gloo control group and sends rank 0's events back; the other ranks' own pipes carry
only a request that failed on them (engine/serve/worker.py, engine/serve/messages.py).
"""
from __future__ import annotations

import collections
import queue
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext, SpawnProcess
from typing import Callable

from engine.serve.engine_config import EngineConfig
from engine.serve.messages import FromWorker, Stop, ToWorker
from engine.serve.worker import worker_main

KILL_WAIT_S = 5.0           # a SIGKILLed worker is reaped within this (it cannot ignore the signal, even stopped)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "stopped"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else f"signal {-code}"
        why = {"SIGKILL": " - killed, often because the machine ran out of memory",
               "SIGSEGV": " - crashed", "SIGBUS": " - crashed", "SIGABRT": " - aborted"}.get(name, "")
        return f"{name}{why}"
    return f"exit code {code}"


class Outbox:
    """The server's messages to rank 0, written by a thread of their own from a bounded queue: `put` never
    waits, whatever the worker does. Room for every message a healthy engine can have unread (each running
    request's Run and Cancel, adapter changes); a full queue means rank 0 reads nothing, which the stall
    watch sees first through `sending_since`."""

    def __init__(self, conn: Connection, capacity: int):
        self._conn = conn
        self._q: queue.Queue[ToWorker | None] = queue.Queue(capacity)
        self._since: float | None = None      # when the message being written began (None: none is)
        self.gone = False                      # rank 0 closed its end: nothing more can be sent
        self._thread = threading.Thread(target=self._run, name="engine-outbox", daemon=True)
        self._thread.start()

    def put(self, msg: ToWorker) -> bool:
        """Queue `msg` for rank 0; False when it cannot be (the worker is gone, or reads nothing)."""
        if self.gone:
            return False
        try:
            self._q.put_nowait(msg)
            return True
        except queue.Full:
            return False

    @property
    def sending_since(self) -> float | None:
        return self._since

    def _run(self) -> None:
        while (msg := self._q.get()) is not None:
            self._since = time.monotonic()
            try:
                self._conn.send(msg)
            except (OSError, ValueError, TypeError):    # rank 0 is gone (or the pipe was closed under us)
                self.gone = True
                return
            finally:
                self._since = None
            if isinstance(msg, Stop):
                return

    def close(self, timeout: float) -> None:
        """Let the thread end (it has once the worker is dead: a write to a pipe nobody reads fails)."""
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout)


class Inbox:
    """The workers' messages, read by a thread of their own as they come (another rank's pipe before rank 0's
    in each round: a rank's failure explains its peers' errors) and kept until the server takes them;
    `on_message` is called after each round (the server's pump wakes up)."""

    def __init__(self, conns: list[Connection], on_message: Callable[[], None]):
        self._conns, self._on_message = conns, on_message
        self._messages: collections.deque[FromWorker] = collections.deque()
        self._thread = threading.Thread(target=self._run, name="engine-inbox", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        live = list(self._conns)
        while live:
            try:
                ready = wait(live)
            except (OSError, ValueError):          # a pipe closed under us: this start is being ended
                return
            for conn in [c for c in live if c in ready]:
                try:
                    self._messages.append(conn.recv())
                except (EOFError, OSError, ValueError):   # that worker is gone: its sentinel tells the server
                    live.remove(conn)
                except Exception as e:  # noqa: BLE001 - a message that does not unpickle (its bytes were read
                    # whole): reported, and the thread reads on, or every later message would wait forever
                    print(f"engine server: a worker's message could not be read: {type(e).__name__}: {e}",
                          file=sys.stderr, flush=True)
            self._on_message()

    def take(self) -> list[FromWorker]:
        """What arrived since the last call, in order."""
        out = []
        while self._messages:
            out.append(self._messages.popleft())
        return out

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)


class Workers:
    """One start of the engine: its worker processes, the server's ends of their pipes and the threads that
    write and read them."""

    def __init__(self, procs: list[SpawnProcess], requests: Connection, inbound: list[Connection],
                 capacity: int, on_message: Callable[[], None]):
        self.procs, self._requests, self._inbound = procs, requests, inbound
        self.outbox = Outbox(requests, capacity)
        self.inbox = Inbox(inbound, on_message)

    @classmethod
    def spawn(cls, ctx: SpawnContext, config: EngineConfig, on_message: Callable[[], None]) -> Workers:
        """Start every rank of `config`'s plan, each in its own process; `on_message`: called when the
        workers have said something (from the inbox's thread)."""
        from engine.parallel.groups import free_port, init_method_for
        req_r, req_w = ctx.Pipe(duplex=False)
        pipes = [ctx.Pipe(duplex=False) for _ in range(config.world_size)]     # one event pipe a rank
        init_method = init_method_for(free_port())      # a fresh rendezvous for every start
        procs = []
        for rank in range(config.world_size):
            p = ctx.Process(target=worker_main, name=f"engine-worker-{rank}", daemon=True,
                            args=(rank, config, init_method, req_r if rank == 0 else None, pipes[rank][1]))
            p.start()
            procs.append(p)
        req_r.close()      # the children hold their ends; ours must close so a dead worker reads as EOF
        for _, w in pipes:
            w.close()
        inbound = [r for r, _ in pipes[1:]] + [pipes[0][0]]      # the other ranks' first
        return cls(procs, req_w, inbound, 2 * config.max_batch + 8, on_message)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    def send(self, msg: ToWorker) -> bool:
        """Hand rank 0 a message, without waiting; False when it cannot take it (gone, or reading nothing:
        its death or stall is noticed by the pump)."""
        return self.outbox.put(msg)

    def dead(self) -> list[SpawnProcess]:
        return [p for p in self.procs if not p.is_alive()]

    def dead_within(self, seconds: float) -> list[SpawnProcess]:
        """The worker processes that are dead now or within `seconds` (at once if one already is)."""
        deadline = time.monotonic() + seconds
        while not (dead := self.dead()) and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead

    def describe_death(self, proc: SpawnProcess) -> str:
        proc.join(1.0)
        rank = f" (rank {self.procs.index(proc)})" if len(self.procs) > 1 else ""
        return f"the engine process{rank} stopped unexpectedly ({describe_exit(proc.exitcode)})"

    def kill(self) -> None:
        """End a start that is being replaced: SIGKILL, reap, let the pipe threads end, close the pipes."""
        for p in self.procs:
            if p.is_alive():
                p.kill()
        for p in self.procs:
            p.join(KILL_WAIT_S)
            if not p.is_alive():
                p.close()
        self._close_pipes()

    def stop(self, timeout: float) -> None:
        """End the workers at the server's close: a polite Stop (an idle worker exits at once), then by force."""
        self.send(Stop())
        deadline = time.monotonic() + timeout
        for p in self.procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self.procs:
            if p.is_alive():
                p.terminate()
                p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(2.0)
            p.close()
        self._close_pipes()

    def _close_pipes(self) -> None:
        self.outbox.close(1.0)
        self.inbox.join(1.0)
        for c in (self._requests, *self._inbound):
            c.close()
