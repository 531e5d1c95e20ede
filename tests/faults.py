"""Fault injection for the engine's multi-rank tests, without a hook in the engine: a test replaces
`engine.serve.workers.worker_main` with `faulty_worker`, which the spawned workers import from here (a
spawned child gets the parent's sys.path). The fault fires once per marker file: after the restart the
workers run clean."""
from __future__ import annotations

import os
from pathlib import Path

FAULT_ENV = "HUNYUAN_TEST_FAULT"        # "RANK:STEP:MARKER_PATH"


def faulty_worker(rank: int, *args, **kwargs) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec:
        want_rank, step, marker = spec.split(":", 2)
        if rank == int(want_rank) and not Path(marker).exists():
            from engine.runtime import denoise
            orig = denoise.DenoiseRunner.velocity

            def velocity(self, i, *a, **k):
                if i == int(step):
                    Path(marker).touch()
                    raise ValueError(f"injected fault on rank {rank} at denoise step {i}")
                return orig(self, i, *a, **k)
            denoise.DenoiseRunner.velocity = velocity
    from engine.serve.worker import worker_main
    worker_main(rank, *args, **kwargs)


def fail_request(monkeypatch, prompt: str, when, message: str) -> None:
    """Make the phase program of the request with this prompt raise ValueError(message) at the first
    event it yields for which `when(event)` holds: thrown into the program where it stands, so its
    `finally` runs and the exception leaves it as a real failure would. Other requests run untouched."""
    from engine.runtime.engine import Engine
    orig = Engine.program

    def program(self, p):
        gen = orig(self, p)
        if p.prompt != prompt:
            return (yield from gen)
        answer = None
        while True:
            try:
                item = gen.send(answer)
            except StopIteration:
                return
            if when(item):
                gen.throw(ValueError(message))
            answer = yield item
    monkeypatch.setattr(Engine, "program", program)
