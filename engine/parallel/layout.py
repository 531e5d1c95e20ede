"""What a rank keeps resident and which part of it the current phase uses.

Vocabulary (from the hybrid-parallel design):
- storage shard: the TP slice of every sharded weight a rank keeps for its whole life
  (`storage_size` shards, this rank holds `storage_rank`).
- micro: a storage shard is packed as `micros` contiguous micro shards. The AR phase runs TP over
  `storage_size * micros` logical ranks, each using ONE micro of its storage shard; the denoise phase
  runs TP over the storage shards, each rank using ALL its micros.
- A phase switch only changes the active micro range and the TP group, never a weight.

World size 1 is the plan with one storage shard of one micro; every collective is then a no-op.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class ShardLayout:
    storage_size: int = 1
    storage_rank: int = 0
    micros: int = 1

    @property
    def logical_size(self) -> int:
        """Number of micro shards over the whole model = AR tensor-parallel size."""
        return self.storage_size * self.micros

    def split(self, n: int, what: str) -> int:
        """Size of one micro's slice of a dimension of size n."""
        if n % self.logical_size:
            raise ValueError(f"{what} ({n}) is not divisible by {self.logical_size} micro shards")
        return n // self.logical_size


class Comm:
    """A tensor-parallel group as the modules see it. The base class is the group of one rank."""
    size = 1
    rank = 0

    def all_reduce_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def all_gather(self, t: torch.Tensor, dim: int) -> torch.Tensor:
        """Concatenate the ranks' tensors along `dim` in logical rank order."""
        return t

    def all_to_all(self, t: torch.Tensor) -> torch.Tensor:
        """t [size, ...]: chunk i goes to rank i; returns chunk i from rank i."""
        return t

    def broadcast_(self, t: torch.Tensor, src: int = 0) -> torch.Tensor:
        return t


def graph_safe(*comms: Comm) -> bool:
    """Whether a CUDA graph can hold these groups' collectives: NCCL groups and groups of one rank can,
    gloo groups (which stage CUDA tensors through the host) cannot."""
    return all(getattr(c, "stage", False) is False for c in comms)


@dataclass
class PhaseView:
    """The active part of the resident layout: micros [micro_start, micro_start + micro_count), the
    group over which the partial results of sharded matmuls are summed or gathered, and (denoise)
    the group over which the sequence is split with its attention kind."""
    micro_start: int = 0
    micro_count: int = 1
    tp: Comm = field(default_factory=Comm)
    sp: Comm = field(default_factory=Comm)
    sp_kind: str = "ulysses"

    @property
    def micros(self) -> slice:
        return slice(self.micro_start, self.micro_start + self.micro_count)
