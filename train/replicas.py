"""Data-parallel training replicas: one process per GPU (torchrun), the same weights on every replica.

Every replica draws its own samples of the same batch index (same reference count and target shape,
so every replica's backward touches the same parameters), the gradients are averaged before the
optimizer step, and replica 0 alone logs, probes and writes the checkpoint. Decisions that depend on
the wall clock (stop, save, probe) are replica 0's, sent to the others once per step, so every
replica takes the same steps. Without torchrun (no WORLD_SIZE) this is one replica and does nothing.
"""
from __future__ import annotations

import os

import torch
import torch.distributed as dist


class Replicas:
    def __init__(self, device: str):
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        dev = torch.device(device)
        if self.world > 1:
            if dev.type == "cuda":
                dev = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
                torch.cuda.set_device(dev)
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo", device_id=dev if dev.type == "cuda" else None)
        self.device = dev

    @property
    def main(self) -> bool:
        return self.rank == 0

    def same_weights(self, model: torch.nn.Module) -> None:
        """Replica 0's parameters and buffers everywhere (a seeded init is already the same; this makes
        it certain)."""
        if self.world == 1:
            return
        with torch.no_grad():
            for t in [*model.parameters(), *model.buffers()]:
                dist.broadcast(t.data, 0)

    def average_grads(self, params: list[torch.Tensor]) -> None:
        """Mean of the replicas' gradients, in one flat all-reduce (params without a gradient this step
        are skipped: every replica has the same such set, see the module docstring)."""
        if self.world == 1:
            return
        grads = [p.grad for p in params if p.grad is not None]
        flat = torch.cat([g.reshape(-1).float() for g in grads])
        dist.all_reduce(flat)
        flat /= self.world
        i = 0
        for g in grads:
            g.copy_(flat[i:i + g.numel()].view_as(g))
            i += g.numel()

    def agree(self, *values: float) -> list[float]:
        """Replica 0's values (flags, a latent scale), on every replica."""
        if self.world == 1:
            return [float(v) for v in values]
        t = torch.tensor([float(v) for v in values], dtype=torch.float64, device=self.device)
        dist.broadcast(t, 0)
        return t.tolist()

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def close(self) -> None:
        if self.world > 1:
            dist.destroy_process_group()
