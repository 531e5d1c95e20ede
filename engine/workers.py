"""Engine worker processes: one per rank of a plan (one per GPU, or gloo processes on a CPU).

Every worker loads only its storage shard, then serves the same program: rank 0 takes a message
from its inbox and broadcasts it over a gloo control group; all ranks run it; rank 0 puts the
events on the outbox. Messages: ("request", Request), ("stats", None), ("stop", None).
"""
from __future__ import annotations

import queue
import traceback
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from .dist import Runtime, init_method_for, free_port, set_threads_for_world, shutdown
from .plan import get_plan

END = "__end__"          # outbox marker after the last event of a request
READY = "__ready__"      # outbox marker once every rank has loaded


@dataclass
class WorkerOptions:
    model: str
    plan: str = "tp1"
    sp_kind: str | None = None
    device: str = "cpu"
    dtype: str | None = None
    preview_every: int = 1
    kv_handoff: bool = True
    cfg_serial: bool = False
    extra: dict = field(default_factory=dict)


def rank_device(device: str, rank: int, world: int) -> torch.device:
    """A GPU per rank; when there are fewer GPUs than ranks (tests), every rank shares GPU 0."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", rank if torch.cuda.device_count() >= world else 0)


def resident_pointers(model) -> dict[str, int]:
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def worker_main(rank: int, opts: WorkerOptions, init_method: str, inbox, outbox, cancel_flag) -> None:
    """Entry point of one rank (spawned). Never raises: failures go to the outbox as ("error", text)."""
    from .loader import load, parse_dtype
    from .pipeline import Pipeline
    plan = get_plan(opts.plan, sp_kind=opts.sp_kind)
    set_threads_for_world(plan.world)
    dev = rank_device(opts.device, rank, plan.world)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        rt = Runtime.init(plan, rank, dev, init_method)
        control = dist.new_group(list(range(plan.world)), backend="gloo") if plan.world > 1 else None
        lm = load(opts.model, dev, parse_dtype(opts.dtype, dev), rt.layout)
        plan.check_model(lm.cfg)
        pointers = resident_pointers(lm.model)
        moved: list[str] = []           # phases at whose start a resident weight was found moved

        def check(phase: str) -> None:
            if resident_pointers(lm.model) != pointers:
                moved.append(phase)

        pipe = Pipeline(lm, rt, preview_every=opts.preview_every, kv_handoff=opts.kv_handoff, on_phase=check,
                        cfg_serial=opts.cfg_serial)
    except Exception:
        outbox.put(("error", f"rank {rank} failed to start:\n{traceback.format_exc()}"))
        return
    if rank == 0:
        outbox.put((READY, {"plan": plan.name, "world": plan.world, "device": str(dev),
                            "load_s": lm.load_s}))

    def receive():
        msg = [inbox.get() if rank == 0 else None]
        if control is not None:
            dist.broadcast_object_list(msg, src=0, group=control)
        return msg[0]

    while True:
        kind, payload = receive()
        if kind == "stop":
            break
        if kind == "stats":
            mine = {"rank": rank, "bytes_read": lm.bytes_read,
                    "pointers_unchanged": resident_pointers(lm.model) == pointers and not moved,
                    "resident_bytes": sum(p.numel() * p.element_size() for p in lm.model.parameters()),
                    "peak_gpu_bytes": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else 0}
            allr = [None] * plan.world
            if control is not None:
                dist.all_gather_object(allr, mine, group=control)
            else:
                allr = [mine]
            if rank == 0:
                outbox.put(("stats", allr))
            continue
        req = payload
        for ev in pipe.run(req, cancelled=cancel_flag.is_set):
            if rank == 0:
                outbox.put((req.request_id, ev))
        if rank == 0:
            outbox.put((req.request_id, END))
    shutdown()


class Workers:
    """Spawns and talks to the ranks of a plan (used by the CLI, tests and benchmarks; the studio's
    server wraps the same entry point)."""

    def __init__(self, opts: WorkerOptions, start_timeout: float = 600.0):
        self.opts = opts
        plan = get_plan(opts.plan, sp_kind=opts.sp_kind)
        ctx = mp.get_context("spawn")
        self.inbox, self.outbox, self.cancel = ctx.Queue(), ctx.Queue(), ctx.Event()
        init = init_method_for(free_port())
        self.procs = [ctx.Process(target=worker_main, args=(r, opts, init, self.inbox if r == 0 else None,
                                                             self.outbox, self.cancel), daemon=True)
                      for r in range(plan.world)]
        for p in self.procs:
            p.start()
        kind, info = self._get(start_timeout)
        if kind != READY:
            self.close()
            raise RuntimeError(info)
        self.info = info

    def _get(self, timeout: float):
        while True:
            try:
                return self.outbox.get(timeout=min(timeout, 1.0))
            except queue.Empty:
                timeout -= 1.0
                dead = [p for p in self.procs if not p.is_alive()]
                if dead:
                    raise RuntimeError(f"engine rank(s) {[self.procs.index(p) for p in dead]} exited "
                                       f"(exit code {dead[0].exitcode})")
                if timeout <= 0:
                    raise TimeoutError("engine workers did not answer in time")

    def run(self, req, timeout: float = 600.0):
        """Yields the events of one request (rank 0's)."""
        self.cancel.clear()
        self.inbox.put(("request", req))
        while True:
            rid, ev = self._get(timeout)
            if rid == "error":
                raise RuntimeError(ev)
            if ev == END:
                return
            yield ev

    def stats(self, timeout: float = 60.0) -> list[dict]:
        self.inbox.put(("stats", None))
        kind, allr = self._get(timeout)
        assert kind == "stats", kind
        return allr

    def close(self) -> None:
        if any(p.is_alive() for p in self.procs):
            try:
                self.inbox.put(("stop", None))
            except Exception:
                pass
        for p in self.procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()

    def __enter__(self) -> "Workers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

