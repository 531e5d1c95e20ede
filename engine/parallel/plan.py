"""The parallel plan: how `world` ranks hold the weights and how each phase uses them.

Ranks form a (replica, storage) mesh: physical rank p = replica * storage_tp + storage_rank.
- Storage: every weight that tensor parallelism splits is split `storage_tp` ways; rank p keeps
  shard `p % storage_tp` for its whole life (the ABAB layout for storage_tp 2 on 4 GPUs).
- Denoise: TP over the `storage_tp` ranks of a replica, each using its full storage shard; the
  replica axis (`world / storage_tp` ranks holding the same shard) splits the sequence (SP, Ulysses
  or KV all-gather) or runs the CFG branches side by side.
- AR: TP over `ar_tp` ranks. A storage shard is packed as `ar_tp / storage_tp` micros; the replicas
  of a shard activate different micros, so the AR weights of every rank are a subset of what it
  keeps (the subset rule). When ar_tp < world the remaining replicas repeat the AR work.

Logical AR rank of p = storage_rank * micros + micro, micro = replica % micros. For hybrid4 this is
the physical -> logical map [0, 2, 1, 3]; outputs gathered over the AR group are read in logical order.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.parallel.layout import ShardLayout
from engine.checkpoint.config import ModelConfig


class PlanError(ValueError):
    pass


@dataclass(frozen=True)
class ParallelPlan:
    name: str
    world: int
    storage_tp: int
    ar_tp: int
    replica_mode: str = "sp"          # what the denoise replica axis does: "sp" or "cfg"
    sp_kind: str = "ulysses"          # SP attention: "ulysses" or "kv_gather"

    def __post_init__(self) -> None:
        w, s, a = self.world, self.storage_tp, self.ar_tp
        if min(w, s, a) < 1:
            raise PlanError(f"plan {self.name}: sizes must be positive")
        if w % s:
            raise PlanError(f"plan {self.name}: storage TP {s} does not divide the world size {w}")
        if a % s:
            raise PlanError(f"plan {self.name}: AR TP {a} is not a multiple of storage TP {s}, so an AR shard "
                            "would not be a subset of a resident storage shard")
        if w % a:
            raise PlanError(f"plan {self.name}: AR TP {a} does not divide the world size {w}")
        if self.replica_mode not in ("sp", "cfg"):
            raise PlanError(f"plan {self.name}: replica mode must be 'sp' or 'cfg'")
        if self.replica_mode == "cfg" and self.replicas != 2:
            raise PlanError(f"plan {self.name}: CFG-parallel needs exactly 2 replicas of each storage shard "
                            f"(cond, uncond), this plan has {self.replicas}")
        if self.sp_kind not in ("ulysses", "kv_gather"):
            raise PlanError(f"plan {self.name}: SP attention must be 'ulysses' or 'kv_gather'")

    # ------------------------------------------------------------------ derived sizes
    @property
    def replicas(self) -> int:
        """Ranks holding the same storage shard (the denoise SP or CFG axis)."""
        return self.world // self.storage_tp

    @property
    def micros(self) -> int:
        return self.ar_tp // self.storage_tp

    @property
    def sp(self) -> int:
        return self.replicas if self.replica_mode == "sp" else 1

    # ------------------------------------------------------------------ rank maps
    def storage_rank(self, p: int) -> int:
        return p % self.storage_tp

    def replica(self, p: int) -> int:
        return p // self.storage_tp

    def micro(self, p: int) -> int:
        return self.replica(p) % self.micros

    def logical_ar_rank(self, p: int) -> int:
        return self.storage_rank(p) * self.micros + self.micro(p)

    def layout(self, p: int) -> ShardLayout:
        return ShardLayout(self.storage_tp, self.storage_rank(p), self.micros)

    def ar_group(self, p: int) -> list[int]:
        """Physical ranks of p's AR TP group, in logical order (the ordered-gather order)."""
        g = self.replica(p) // self.micros
        members = [r for r in range(self.world) if self.replica(r) // self.micros == g]
        return sorted(members, key=self.logical_ar_rank)

    def tp_group(self, p: int) -> list[int]:
        """Denoise TP group: the storage shards of p's replica, in storage order."""
        q = self.replica(p)
        return [q * self.storage_tp + s for s in range(self.storage_tp)]

    def replica_group(self, p: int) -> list[int]:
        """Ranks holding p's storage shard, in replica order (the SP / CFG group)."""
        s = self.storage_rank(p)
        return [q * self.storage_tp + s for q in range(self.replicas)]

    def all_groups(self) -> dict[str, list[list[int]]]:
        """Every group of each kind, for creating process groups once, in the same order on all ranks."""
        def uniq(gs):
            out = []
            for g in gs:
                if g not in out:
                    out.append(g)
            return out
        r = range(self.world)
        return {"ar": uniq(sorted(self.ar_group(p)) for p in r), "tp": uniq(self.tp_group(p) for p in r),
                "replica": uniq(self.replica_group(p) for p in r)}

    # ------------------------------------------------------------------ model fit
    def check_model(self, cfg: ModelConfig) -> None:
        """Refuse a plan the model's dimensions cannot be split by, saying why."""
        need = [("attention heads", cfg.num_heads, self.ar_tp), ("KV heads", cfg.num_kv_heads, self.ar_tp),
                ("vocab_size", cfg.vocab_size, self.ar_tp)]
        for i in sorted(set(range(cfg.num_layers))):
            need.append((f"layer {i} expert intermediate size", cfg.moe_intermediate_size[i], self.ar_tp))
            if cfg.shared_intermediate(i):
                need.append((f"layer {i} shared MLP intermediate size", cfg.shared_intermediate(i), self.ar_tp))
        if self.sp > 1 and self.sp_kind == "ulysses":
            need += [("attention heads (Ulysses)", cfg.num_heads, self.storage_tp * self.sp),
                     ("KV heads (Ulysses)", cfg.num_kv_heads, self.storage_tp * self.sp)]
        for what, n, k in need:
            if n % k:
                raise PlanError(f"plan {self.name}: {what} ({n}) is not divisible by {k}")
        if self.replica_mode == "cfg" and cfg.cfg_distilled:
            raise PlanError(f"plan {self.name} runs the two CFG branches in parallel, but this is an "
                            "Instruct-Distil checkpoint (one branch per step): use hybrid4 or tp4")


PRESETS: dict[str, ParallelPlan] = {p.name: p for p in (
    ParallelPlan("tp1", 1, 1, 1),
    ParallelPlan("tp2", 2, 2, 2),
    ParallelPlan("tp4", 4, 4, 4),
    ParallelPlan("hybrid4", 4, 2, 4),                        # AR TP4 -> denoise TP2 x SP2 (the seed's plan)
    ParallelPlan("tp2sp2", 4, 2, 2),                         # TP2 x SP2 in both phases (AR repeated per replica)
    ParallelPlan("tp2cfg2", 4, 2, 4, replica_mode="cfg"),    # AR TP4 -> denoise TP2 x CFG-parallel 2
    ParallelPlan("tp8", 8, 8, 8),
    ParallelPlan("hybrid8", 8, 4, 8),                        # AR TP8 -> denoise TP4 x SP2
    ParallelPlan("hybrid8sp4", 8, 2, 8),                     # AR TP8 -> denoise TP2 x SP4
    ParallelPlan("tp4cfg2", 8, 4, 8, replica_mode="cfg"),    # AR TP8 -> denoise TP4 x CFG-parallel 2
)}

DEFAULT_FOR_WORLD = {1: "tp1", 2: "tp2", 4: "hybrid4", 8: "hybrid8"}


def get_plan(name: str | None, world: int | None = None, sp_kind: str | None = None) -> ParallelPlan:
    if name is None:
        world = world or 1
        if world not in DEFAULT_FOR_WORLD:
            raise PlanError(f"no default plan for {world} ranks; choose one of {', '.join(PRESETS)}")
        name = DEFAULT_FOR_WORLD[world]
    if name not in PRESETS:
        raise PlanError(f"unknown plan {name!r}; choose one of {', '.join(PRESETS)}")
    plan = PRESETS[name]
    if world is not None and world != plan.world:
        raise PlanError(f"plan {name} needs {plan.world} ranks, {world} were given")
    if sp_kind and sp_kind != plan.sp_kind:
        plan = ParallelPlan(plan.name, plan.world, plan.storage_tp, plan.ar_tp, plan.replica_mode, sp_kind)
    return plan


def default_step_policy(world: int, device_type: str) -> str:
    """The step policy an engine takes when none is asked for: `overlap` on one GPU, where it was the fastest
    or level in every serving run measured (docs/benchmarks.md: 4 and 16 clients on triton's decode, 4 on
    humming-fp8's), `interleave` elsewhere (several GPUs refuse overlap, check_step_policy; a CPU has no
    second stream to overlap on)."""
    return "overlap" if world == 1 and device_type == "cuda" else "interleave"


def check_step_policy(policy: str, world: int, device_type: str) -> None:
    """Refuse `overlap` on several GPUs: its image lane would run the denoise phase's collectives (the TP /
    SP communicators) beside the decode's (the AR communicator) on another stream, and NCCL does not order
    kernels of two communicators on a device the same way on every rank: a rank's decode all-reduce can
    wait for a peer that is spinning in the denoise's, a hang (NCCL's "using multiple communicators
    concurrently"). One GPU has no collectives; gloo on the CPU has one lane. (engine/runtime/scheduler.py:
    the policies.)"""
    if policy.split(":")[0] == "overlap" and world > 1 and device_type == "cuda":
        raise ValueError(f"--step-policy {policy} runs on one GPU: on {world} GPUs its second stream would run the "
                         "decode's and the denoise's NCCL collectives at once, which can hang the ranks; use "
                         "interleave or waves with --gpus > 1")
