"""Process groups of a plan and the collectives the model needs (gloo on CPU, NCCL on CUDA).

Groups are created once at start-up, in the same order on every rank; a phase switch only picks
which of them (and which micros) the modules use.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.parallel.layout import Comm, PhaseView
from engine.parallel.plan import ParallelPlan


class GroupComm(Comm):
    """A process group whose members have a logical order (the order gathers are read in).

    With gloo and CUDA tensors (several ranks sharing one GPU, a test set-up) tensors are staged
    through host memory; with NCCL they stay on the device."""

    def __init__(self, group, logical_ranks: list[int], me: int):
        self.group = group
        self.stage = dist.get_backend(group) == "gloo"
        self.size = len(logical_ranks)
        self.rank = logical_ranks.index(me)
        group_ranks = dist.get_process_group_ranks(group)
        # gathered item i comes from group rank i; read them in logical order
        self._order = [group_ranks.index(r) for r in logical_ranks]

    def _host(self, t: torch.Tensor) -> torch.Tensor:
        return t.cpu() if self.stage and t.is_cuda else t

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        h = self._host(t)
        dist.all_reduce(h, group=self.group)
        return t.copy_(h) if h is not t else t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        h = self._host(t.contiguous())
        parts = [torch.empty_like(h) for _ in range(self.size)]
        dist.all_gather(parts, h, group=self.group)
        return torch.cat([parts[i] for i in self._order], dim=dim).to(t.device)

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """t [size, ...]: chunk i goes to logical rank i; returns [size, ...] with chunk i from rank i."""
        assert self._order == list(range(self.size)), "all_to_all needs group order == logical order"
        h = self._host(t.contiguous())
        out = torch.empty_like(h)
        dist.all_to_all_single(out, h, group=self.group)
        return out.to(t.device)

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        h = self._host(t)
        dist.broadcast(h, dist.get_process_group_ranks(self.group)[self._order[src]], group=self.group)
        return t.copy_(h) if h is not t else t


def _comm(group, logical: list[int], me: int) -> Comm:
    return Comm() if len(logical) == 1 else GroupComm(group, logical, me)


@dataclass
class RankGroups:
    """One rank's place in the plan: its process groups and the two phase views over its resident shard."""
    plan: ParallelPlan
    rank: int
    device: torch.device
    world: Comm = field(default_factory=Comm)
    ar: PhaseView = field(default_factory=PhaseView)
    denoise: PhaseView = field(default_factory=PhaseView)
    replica: Comm = field(default_factory=Comm)     # ranks holding the same storage shard (SP / CFG group)

    @property
    def layout(self):
        return self.plan.layout(self.rank)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    @classmethod
    def single(cls, device: torch.device | str = "cpu") -> "RankGroups":
        from engine.parallel.plan import PRESETS
        return cls(PRESETS["tp1"], 0, torch.device(device))

    @classmethod
    def init(cls, plan: ParallelPlan, rank: int, device: torch.device | str, init_method: str) -> "RankGroups":
        """Join the process group and create every group of the plan (collective: all ranks call it)."""
        device = torch.device(device)
        if plan.world == 1:
            return cls.single(device)
        # NCCL needs a GPU per rank; ranks sharing a GPU (tests on a one-GPU machine) use gloo
        backend = "nccl" if device.type == "cuda" and torch.cuda.device_count() >= plan.world else "gloo"
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=plan.world)
        made: dict[str, dict[tuple[int, ...], object]] = {}
        for kind, groups in plan.all_groups().items():
            made[kind] = {tuple(g): dist.new_group(g) for g in groups}
        me = rank
        ar_ranks, tp_ranks, rep_ranks = plan.ar_group(me), plan.tp_group(me), plan.replica_group(me)
        ar_comm = _comm(made["ar"][tuple(sorted(ar_ranks))], ar_ranks, me)
        tp_comm = _comm(made["tp"][tuple(tp_ranks)], tp_ranks, me)
        rep_comm = _comm(made["replica"][tuple(rep_ranks)], rep_ranks, me)
        world = _comm(dist.group.WORLD, list(range(plan.world)), me)
        ar = PhaseView(plan.micro(me), 1, ar_comm)
        sp = rep_comm if plan.replica_mode == "sp" else Comm()
        denoise = PhaseView(0, plan.micros, tp_comm, sp, plan.sp_kind)
        return cls(plan, rank, device, world, ar, denoise, rep_comm)


def rank_device(device: str | torch.device, rank: int, world: int) -> torch.device:
    """A GPU per rank; when there are fewer GPUs than ranks (tests), every rank shares GPU 0."""
    d = torch.device(device)
    if d.type != "cuda":
        return d
    return torch.device("cuda", rank if torch.cuda.device_count() >= world else 0)


def resident_pointers(model: torch.nn.Module) -> dict[str, int]:
    """Where every resident weight lives; a phase switch must leave this unchanged."""
    return {n: p.data_ptr() for n, p in model.named_parameters()}


def free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_method_for(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def set_threads_for_world(world: int) -> None:
    """CPU ranks share the machine's cores; oversubscription makes gloo runs crawl."""
    if world > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
