"""The engine's worker processes, one start of them at a time (`Workers`): every rank's process spawned with
fresh pipes, rank 0 handed the server's messages, and their end: politely when the server closes, by
SIGKILL when they are replaced (a stopped or hung worker ignores anything politer, and nothing it holds
needs saving). Pipes are created fresh for every start: a worker killed while writing can leave a shared
queue's lock held forever, a closed pipe just reads as EOF.

Spawned with the `spawn` context (CUDA cannot be forked). Worker 0 receives the requests, broadcasts them to
the other ranks over a gloo control group and sends rank 0's events back; the other ranks' own pipes carry
only a request that failed on them (engine/serve/worker.py, engine/serve/messages.py).
"""
from __future__ import annotations

import signal
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnContext, SpawnProcess

from engine.serve.engine_config import EngineConfig
from engine.serve.messages import Stop, ToWorker
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


@dataclass
class Workers:
    """One start of the engine: its worker processes and the server's ends of their pipes."""
    procs: list[SpawnProcess]
    requests: Connection                  # to rank 0
    events: Connection                    # rank 0's events
    rank_conns: list[Connection]          # the other ranks': only RankFailed

    @classmethod
    def spawn(cls, ctx: SpawnContext, config: EngineConfig) -> Workers:
        """Start every rank of `config`'s plan, each in its own process."""
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
        return cls(procs, req_w, pipes[0][0], [r for r, _ in pipes[1:]])

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.procs]

    def inbound(self) -> list[Connection]:
        """The pipes the workers write to, the other ranks' first: a rank's failure explains its peers' errors."""
        return [*self.rank_conns, self.events]

    def send(self, msg: ToWorker) -> bool:
        """Hand rank 0 a message; False when it is gone (its death is noticed by its sentinel)."""
        try:
            self.requests.send(msg)
            return True
        except (OSError, ValueError):
            return False

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
        """End a start that is being replaced: SIGKILL, reap, close the pipes."""
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
        for c in (self.requests, *self.inbound()):
            c.close()
