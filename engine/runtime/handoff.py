"""KV hand-off from the AR phase to the denoise phase, without recompute where the layouts allow.

The request's KV cache is allocated once for the union of the KV heads the two phases use on this
rank. The AR phase writes the cond row for its micro's heads; the image-stage sequence shares the AR
prefix token for token (same user turn, same CoT ids as long as re-tokenizing the decoded CoT gives
the sampled ids), so the cond branch starts its first denoise step at the first token that differs.
On the seed's layout (AR TP4 -> TP2 x Ulysses SP2) each rank's AR heads ARE its denoise heads:
nothing moves. Where the denoise phase needs the sibling micros' heads (KV all-gather SP,
CFG-parallel) they are gathered over the replica group once.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.model.attention import KVCache
from engine.parallel.layout import Comm
from engine.parallel.plan import ParallelPlan


@dataclass(frozen=True)
class CacheHeads:
    """KV heads of this rank's storage shard, shard-local: the allocation, and the AR and denoise
    phases' slices of it."""
    alloc: slice
    ar: slice
    denoise: slice


def cache_heads(plan: ParallelPlan, rank: int, sp_rank: int, kv_per_micro: int) -> CacheHeads:
    shard = kv_per_micro * plan.micros
    ar = (plan.micro(rank) * kv_per_micro, (plan.micro(rank) + 1) * kv_per_micro)
    if plan.sp > 1 and plan.sp_kind == "ulysses":
        c = shard // plan.sp
        dn = (sp_rank * c, (sp_rank + 1) * c)
    else:
        dn = (0, shard)
    lo, hi = min(ar[0], dn[0]), max(ar[1], dn[1])
    return CacheHeads(slice(0, hi - lo), slice(ar[0] - lo, ar[1] - lo), slice(dn[0] - lo, dn[1] - lo))


def reusable_prefix(image_ids: list[int], ar_ids: list[int], fed: int) -> int:
    """How many leading tokens of the image-stage sequence the AR cache already holds: the common
    prefix of the two id lists, at most the `fed` tokens whose K/V the AR phase wrote."""
    n = min(len(image_ids), len(ar_ids), fed)
    for i in range(n):
        if image_ids[i] != ar_ids[i]:
            return i
    return n


def gather_sibling_heads(cache: KVCache, heads: CacheHeads, prefix: int, plan: ParallelPlan,
                         replica: Comm) -> None:
    """Where the denoise heads of this rank are more than its AR micro's heads (KV all-gather SP,
    CFG-parallel), fetch the cond prefix of the sibling micros from the replica group, once."""
    ar, dn = heads.ar, heads.denoise
    if dn.start >= ar.start and dn.stop <= ar.stop or prefix == 0:
        return
    kvr = ar.stop - ar.start
    for layer in range(len(cache.k)):
        for buf in (cache.k[layer], cache.v[layer]):
            mine = buf[0:1, ar, :prefix]
            parts = replica.all_gather(mine, dim=0)          # [replicas, kvr, prefix, D] in replica order
            for q in range(replica.size):
                m = q % plan.micros
                buf[0, m * kvr:(m + 1) * kvr, :prefix] = parts[q]
