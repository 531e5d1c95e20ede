"""One engine worker process: load this rank's shard, then run every request the server hands over.

Rank 0 owns the pipes to the server and reports; the other ranks follow it through a gloo control
group (requests are broadcast to them), and every rank runs the same pipeline.
"""
from __future__ import annotations

import signal
import sys
from multiprocessing.connection import Connection
from typing import Any

from engine.parallel.plan import get_plan

NO_REQUEST = -1          # the cancel slot's value when no request is to be stopped


def worker_main(rank: int, world_size: int, model: str, device: str, dtype: str | None,
                requests: Connection | None, events: Connection | None, cancel_seq: Any,
                preview_every: int = 1, verbose: bool = False, plan: str | None = None,
                init_method: str = "", sp_kind: str | None = None, pipeline_options: dict | None = None,
                quantize: str | None = None) -> None:
    """Entry point of one engine worker process (rank `rank` of `world_size`). Rank 0 owns the request
    pipe and reports events; the other ranks follow it through a gloo control group and use their own
    `events` pipe only to say that a request failed on them. Load failures are reported by rank 0 as
    ("failed", text); a follower that fails to start prints why and exits, which the server sees. After
    each request rank 0 reports every rank's `rank_stats` (weights read, resident pointers unchanged,
    memory).

    A request that fails on a rank of a multi-rank plan leaves the collectives of the ranks out of step
    (the others wait in one the failed rank will never enter), so that rank reports
    ("rank_failed", seq, rank, message) and exits: the server ends the request with that message and
    restarts the engine."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)       # Ctrl-C belongs to the UI process, which closes us
    import torch
    import torch.distributed as dist

    from engine.model.loader import load, parse_dtype, print_progress
    from engine.parallel.groups import RankGroups, rank_device, resident_pointers, set_threads_for_world, shutdown
    from engine.runtime.events import Error as ErrorEvent
    from engine.runtime.pipeline import Pipeline

    def send(msg: tuple) -> None:
        if events is not None and rank == 0:
            events.send(msg)

    def progress(done: int, total: int, what: str) -> None:
        if verbose:
            print_progress(done, total, what)
        send(("loading", done, total, what))

    control = None
    try:
        p = get_plan(plan, world_size, sp_kind)
        set_threads_for_world(p.world)
        dev = rank_device(device, rank, p.world)
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        rt = RankGroups.init(p, rank, dev, init_method)
        if p.world > 1:
            control = dist.new_group(list(range(p.world)), backend="gloo")
        lm = load(model, dev, parse_dtype(dtype, dev), rt.layout, progress=progress if rank == 0 else None,
                  quantize=quantize)
        p.check_model(lm.cfg)
        pointers = resident_pointers(lm.model)
        moved: list[str] = []          # phases at whose start a resident weight had moved (never, by design)

        def check(phase: str) -> None:
            if resident_pointers(lm.model) != pointers:
                moved.append(phase)

        pipeline = Pipeline(lm, rt, preview_every=preview_every, on_phase=check, **(pipeline_options or {}))
        if control is not None:
            dist.barrier(group=control)              # "ready" means every rank holds its shard
    except Exception as e:  # noqa: BLE001 - any load failure is reported, the server decides
        if rank == 0:
            send(("failed", f"{type(e).__name__}: {e}"))
            return
        print(f"engine rank {rank} failed to start: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    if verbose and rank == 0:
        print(f"\nengine: model loaded in {lm.load_s:.1f} s on {dev} (plan {p.name})", file=sys.stderr, flush=True)
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
    send(("ready", {"load_s": round(lm.load_s, 2), "device": str(dev), "dtype": str(lm.model.dtype),
                    "plan": p.name, "ranks": stats}))

    def receive() -> Any:
        msg: list[Any] = [None]
        if rank == 0:
            try:
                msg[0] = requests.recv()
            except (EOFError, OSError):              # the server is gone
                msg[0] = None
        if control is not None:
            dist.broadcast_object_list(msg, src=0, group=control)
        return msg[0]

    while (msg := receive()) is not None:
        seq, req = msg
        failed = None
        try:
            for ev in pipeline.run(req, cancelled=lambda seq=seq: cancel_seq.value == seq):
                send(("event", seq, ev))
                if isinstance(ev, ErrorEvent) and ev.kind == "engine":
                    failed = ev.message
        except (BrokenPipeError, EOFError, OSError):
            return
        except Exception as e:  # noqa: BLE001 - the pipeline never raises; this guards the transport
            failed = f"{type(e).__name__}: {e}"
            send(("event", seq, ErrorEvent("engine", failed)))
        if failed is not None and p.world > 1:
            if events is not None:
                events.send(("rank_failed", seq, rank, failed))
            return                     # out of step with the other ranks: the server restarts the engine
        send(("stats", rank_stats()))
        send(("end", seq))
    shutdown()
