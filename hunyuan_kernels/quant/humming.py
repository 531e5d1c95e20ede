"""`humming-kernels` (`pip install '.[humming]'`, PyPI, Apache-2.0) as a backend of the `moe_quant` op: its
grouped GEMMs convert the MXFP4 (or NVFP4, MXFP8, FP8) codes in registers inside the GEMM (no dequantize pass),
on Hopper's tensor cores: bf16 activations (W4A16 / W8A16) or FP8 E4M3 ones on the FP8 tensor cores (W4A8 /
W8A8). MXFP4 is the format measured (docs/benchmarks.md, humming); NVFP4, MXFP8 and FP8 packs are laid out the
same way on humming's schemas for them (E4M3 block scales of 16 with a per-expert global scale; E8M0 of 32;
FP8's scale per output channel, kept in bf16 there), GPU tests against the reference, not yet timed. Found
without importing it (`available()` reads the installed distribution); `lib()` imports it at the first layout.

A pack it multiplies is laid out for it ONCE, at load (`lay_out`): humming's interleaved codes and its
scales (for MXFP4 W4A8 the E8M0 block scales folded into the FP8 conversion, rebased per expert, with an fp32
remainder per expert) replace the plain codes and scales in the resident `QWeight` (its `layout` says so),
so memory stays what the codes and scales take and nothing is converted per step. Such a pack runs only on
this variant: the other variants' `fits` and the reference refuse it by name. The rebasing of W4A8 keeps
a block exact when its scale is within 11 binades of its expert's largest (`clamped_share` counts the
others, which are rounded toward zero).

    lay_out(w, activations)          a plain [micros, E, N, K] gate/up pack or [E, N, micros * I] down pack
                                     -> the same weight laid out for humming ("bf16": W4A16, "fp8": W4A8)
    moe_quant "humming" variant      one of two paths by the row count (`rows_path`), then per active micro:
                                     GEMM1, SwiGLU (W4A8: fused with the per-row FP8 quantization in
                                     humming's input kernel), GEMM2 over that micro's columns of the down
                                     pack; the micros' partials summed in fp32; the shared MLP on the other
                                     variants' linears; one weighted finalize:
      grouped (above the pack's indexed_rows)  routing and permutation as the `grouped` variant (moe/cuda.py),
                                     the GEMMs grouped-contiguous over the experts' rows of the permuted copy;
      indexed (up to indexed_rows: 1-2 rows)   the same routing, then `align` (one tiny kernel) lists each expert's
                                     routes in blocks of the GEMM's M tile, and humming's INDEXED GEMMs
                                     gather their input rows themselves and write one row per (token,
                                     choice): no permutation, no copy of x, no inverse map in the finalize.

The indexed GEMM's contract, as read from the 0.1.19 wheel (file:line there): for M tile block b (its rows
`BLOCK_SHAPE_M` of the kernel the launcher picks for `shape_m * top_k` routed rows, launcher.cpp:31-46,
141-146) the kernel multiplies by expert `expert_ids[b]` (scheduler.cuh:395) the rows `sorted_ids[b*M ..
b*M+M)` (int32, read 4 at a time: scheduler.cuh:398-404), each a route `token * top_k + choice`: it reads
input row `id / top_k` (scheduler.cuh:417; a row >= shape_m is not loaded, loader_a.cuh:138-143) and writes
output row `id` of C [shape_m * top_k, N] (gmem_writer.cuh:85, 159-161; ids >= shape_m * top_k are not
written): so a pad id of `shape_m * top_k` is skipped on both sides (humming's own test data pads so,
testing/data.py:119-139). It runs ceil(num_tokens_padded[0] / M) tiles (scheduler.cuh:157-159). The epilogue
has no routing weights and no sum over the choices (context.cuh:6-25), so the finalize stays ours. GEMM2 takes
GEMM1's (token, choice) rows with top_k = 1 and the same lists where its M tile is the same.

The API relied on is humming-kernels 0.1.19's (read from its wheel): `humming.schema.Mxfp4WeightSchema`,
`HummingInputSchema`, `humming.transform.prepare_layer_config / prepare_fp16_e8m0_scale /
transform_humming_tensors`, `humming.tune.get_heuristics_config`, `humming.forward.humming_forward /
may_process_input` and `humming.kernel.humming.HummingKernel.prepare_kernels`; other versions are not offered.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import json
from dataclasses import dataclass
from types import ModuleType

import torch
import triton
import triton.language as tl

from .._triton import next_pow2
from ..moe import triton_kernels as tk
from ..moe.cuda import permute_rows
from ..registry import backend
from ..scratch import empty as _empty
from .formats import KernelLayout, QWeight

NAME = "humming"
DIST = "humming-kernels"
SUPPORTED = ("0.1.19",)
# humming's weight schema of each expert format laid out here (its support matrix: FP4 / FP8 weights with bf16 or
# FP8 E4M3 activations, E8M0 / E4M3 block scales, channel scales): the element type, the block scales' type and
# block, and NVFP4's per-expert global scale (humming's "tensor" weight_scale_2, multiplying; compressed-tensors'
# divides: inverted at layout)
SCHEMAS = {"mxfp4": dict(b_dtype="float4e2m1", bs_dtype="float8e8m0", weight_scale_group_size=32),
           "mxfp8": dict(b_dtype="float8e4m3", bs_dtype="float8e8m0", weight_scale_group_size=32),
           "nvfp4": dict(b_dtype="float4e2m1", bs_dtype="float8e4m3", weight_scale_group_size=16,
                         weight_scale_type="group", weight_scale_2_type="tensor"),
           # FP8 per output channel (the --quantize fp8 build): humming keeps channel scales in the output dtype
           "fp8": dict(b_dtype="float8e4m3", weight_scale_group_size=0)}
FORMATS = tuple(SCHEMAS)          # every resident quantized format (quant.formats.FORMATS)
ACTIVATIONS = ("bf16", "fp8")
# x1 * silu(x2) on rows [x1 ; x2] (the official SwiGLU, moe/reference.swiglu_halves), as humming's input
# kernel's binary activation: a the first half, b the second
SWIGLU = "a * (b / (1.0f + __expf(-b)))"
# Both GEMM types on humming's batch-invariant schedule: on SM90 one K tile of 1024 bits of activation for
# every row count (64 bf16 / 128 FP8 values), no stream-K split (sm90_policies.py:1002-1011 in the wheel), so
# a row's sums are one CTA's, in K order, whatever the other rows of the call (its tokens are the narrow
# side of the MMA; humming's own tests assert the same bits across row counts, testing/runner.py:600-650).
# grouped-contiguous over the experts' rows of a permuted copy: every shape
COMPUTE = json.dumps({"gemm_type": "grouped_contiguous", "use_batch_invariant": True})
# indexed: the GEMM gathers each route's row itself (a decode step's rows)
COMPUTE_INDEXED = json.dumps({"gemm_type": "indexed", "use_batch_invariant": True})
# The most rows the indexed path is prepared for (its kernels compiled at layout; `path="indexed"` up to it).
INDEXED_MAX_ROWS = 16
# The rows up to which a pack's calls take the indexed path by itself, per activation: where it was the faster
# on the H200 (`python -m bench humming --ns 1,2,4,8,16 --denoise 0`, 2026-12-05, docs/benchmarks.md humming):
# W4A16 126.8 vs 135.3 us a layer at 1 row, 359.6 vs 199.5 at 2; W4A8 86.9 / 129.6 vs 102.9 / 145.8 at 1 / 2
# rows, 293.2 vs 228.0 at 4. Both paths gave the same bits at every N there, so the threshold changes no result.
INDEXED_ROWS = {"bf16": 1, "fp8": 2}
PATHS = ("indexed", "grouped")


@functools.cache
def installed() -> str | None:
    """The installed humming-kernels version where it is a supported one (nothing imported)."""
    if importlib.util.find_spec("humming") is None:
        return None
    try:
        v = importlib.metadata.version(DIST)
    except importlib.metadata.PackageNotFoundError:
        return None
    return v if v in SUPPORTED else None


def available() -> bool:
    """humming-kernels installed and a Hopper GPU (its SM90 kernels are the ones measured here)."""
    return (installed() is not None and torch.cuda.is_available()
            and torch.cuda.get_device_capability() == (9, 0))


@functools.cache
def lib() -> ModuleType:
    import humming
    import humming.dtypes
    import humming.forward
    import humming.kernel.humming
    import humming.schema
    import humming.transform
    import humming.tune
    return humming


@dataclass(frozen=True, eq=False)
class Config:
    """A laid-out pack's `KernelLayout.config`: humming's layer config, its indexed GEMM's tuning for the
    routed rows of up to INDEXED_MAX_ROWS tokens (`indexed_tuning`), and the rows up to which a call takes
    the indexed path by itself (`rows_path`; chosen at layout, like the rest of the pack's kernel)."""
    layer: object                                   # humming.config.LayerConfig
    indexed: str                                    # tuning config, JSON [[lo, hi, kernel config], ...]
    blocks: tuple[tuple[int, int, int], ...]        # (lo, hi, M tile rows) of each of its intervals
    indexed_rows: int = 0

    @classmethod
    def of(cls, layer, intervals: list, indexed_rows: int = 0) -> "Config":
        """From the indexed kernels' [[lo, hi, kernel config], ...] (routed rows lo < r <= hi)."""
        if not 0 <= indexed_rows <= INDEXED_MAX_ROWS:
            raise ValueError(f"indexed_rows {indexed_rows}: between 0 and {INDEXED_MAX_ROWS}")
        return cls(layer, json.dumps(intervals), tuple((lo, hi, cfg["block_shape"][0]) for lo, hi, cfg in intervals),
                   indexed_rows)


# formats x activations whose humming GEMMs gave results outside the reference's bounds in the GPU tests
# (tests/test_humming.py `test_gpu_humming_takes_nvfp4_mxfp8_and_fp8_experts`, one H200, 2026-12-05, at 5 and
# 700 tokens): refused until they pass; MXFP8 (both), NVFP4 W4A16 and FP8 W8A8 passed there
FAILED_CHECKS = {("nvfp4", "fp8"): "NVFP4 with FP8 activations (W4A8)",
                 ("fp8", "bf16"): "FP8 with bf16 activations (W8A16)"}


def fits_pack(w: QWeight, activations: str = "bf16") -> str | None:
    """Why `w` cannot be laid out for humming (a sentence), or None where it can."""
    if activations not in ACTIVATIONS:
        return f"activations {activations!r}: one of {', '.join(ACTIVATIONS)}"
    *_, n, k = w.shape
    # its SM90 heuristics tile N by 64 and K by 128 (the real shapes: N 6144 / 4096, K 4096 / 3072)
    if n % 64 or k % 128:
        return f"humming's tiles need N % 64 == 0 and K % 128 == 0 (this pack is N {n}, K {k})"
    if (w.fmt, activations) in FAILED_CHECKS:
        return (f"humming's {FAILED_CHECKS[w.fmt, activations]} failed its check against the reference on the "
                "H200 (2026-12-05); the other activations of this format are checked")
    return None


def _layer_config(n: int, k: int, experts: int, activations: str, device: torch.device, fmt: str = "mxfp4"):
    h = lib()
    weight = h.schema.HummingWeightSchema(**SCHEMAS[fmt])
    a = h.dtypes.float8e4m3 if activations == "fp8" else h.dtypes.bfloat16
    inputs = h.schema.HummingInputSchema(a_dtype=a)
    return h.transform.prepare_layer_config(shape_n=n, shape_k=k, weight_schema=weight, input_schema=inputs,
                                            num_experts=experts, torch_dtype=torch.bfloat16, device=device)


def _transform(w: QWeight, activations: str):
    """One [E, N, K] matrix stack (codes [E, N, K / per byte]) -> (layer config, humming's weight, scales, fp32
    per-expert factor or None: MXFP4 W4A8's fold remainder, NVFP4's global scale)."""
    h = lib()
    e, n, k = w.shape
    config = _layer_config(n, k, e, activations, w.codes.device, w.fmt)
    # copies: humming's W4A8 fold rewrites the codes in place, and the plain pack is the caller's
    codes, scales = (t.clone(memory_format=torch.contiguous_format) for t in (w.codes, w.scales))
    if w.fmt == "fp8":            # [E, N, 1] fp32 -> bf16, humming's channel scales (relative rounding <= 2^-9)
        scales = scales.to(torch.bfloat16)
    elif w.fmt != "nvfp4":        # E8M0 bytes as humming's E8M0 dtype
        scales = scales.view(torch.float8_e8m0fnu)
    tensors = {"weight": codes.view(torch.int32), "weight_scale": scales}
    if w.fmt == "nvfp4":          # its global scale per expert, as humming multiplies it
        g = w.gscale.float().reshape(-1).expand(e)
        tensors["weight_scale_2"] = (1.0 / g if w.inverse else g).contiguous()
    config, tensors = h.transform.prepare_fp16_e8m0_scale(config, tensors)
    out = h.transform.transform_humming_tensors(config, tensors)
    h.kernel.humming.HummingKernel.prepare_kernels(config.to_str(), COMPUTE, None, codes.device)  # JIT, once
    return config, out["weight"], out["weight_scale"], out.get("weight_scale_2")


def indexed_tuning(layer, experts: int, device: torch.device, indexed_rows: int) -> Config:
    """The indexed GEMM's kernels for `layer` (humming's LayerConfig), chosen by humming's own heuristics as
    its forward would choose them (`_resolve_configs` -> `get_heuristics_config`), kept for the routed rows
    a call of the indexed path can have (INDEXED_MAX_ROWS tokens, each routed to at most `experts`: the
    top-k is not known at load), and compiled now. Passing this list as the GEMM's tuning config makes the
    kernel's M tile the one `align` packs for (`block_rows`)."""
    h = lib()
    found = h.tune.get_heuristics_config(layer, None, device=device, **json.loads(COMPUTE_INDEXED))
    config = Config.of(layer, [iv for iv in found if iv[0] < INDEXED_MAX_ROWS * experts], indexed_rows)
    h.kernel.humming.HummingKernel.prepare_kernels(layer.to_str(), COMPUTE_INDEXED, config.indexed, device)
    return config


def block_rows(blocks: tuple[tuple[int, int, int], ...], rows: int) -> int:
    """The M tile of the indexed kernel humming's launcher runs for `rows` routed rows: the interval
    lo < rows <= hi (hi <= 0: no bound), as launcher.cpp:31-46 finds it."""
    for lo, hi, block in blocks:
        if lo < rows and (hi <= 0 or rows <= hi):
            return block
    raise ValueError(f"humming's indexed kernels were prepared for {blocks[0][0] + 1}..{blocks[-1][1]} routed rows, "
                     f"not {rows}")


def lay_out(w: QWeight, activations: str = "bf16", micros: int | None = None,
            indexed_rows: int | None = None) -> QWeight:
    """A plain expert pack (one of FORMATS) laid out for humming: a gate/up pack [micros, E, N, K] (each micro a stack
    of E matrices), or, with `micros`, a down pack [E, H, micros * I] (each micro's column block laid out
    as its own stack [E, H, I]). `indexed_rows`: the rows up to which its calls take the indexed path (None: the
    activation's measured INDEXED_ROWS).
    Refuses (ValueError naming why) a pack it cannot take."""
    if w.layout is not None:
        raise ValueError(f"this pack is already laid out for {w.layout.kernel}")
    why = fits_pack(w, activations)
    if why:
        raise ValueError(why)
    if micros is None:
        stacks = [w[m] for m in range(w.shape[0])]
    else:
        inter = w.shape[-1] // micros
        stacks = [w.cols(m * inter, (m + 1) * inter) for m in range(micros)]
    parts = [_transform(c, activations) for c in stacks]
    rows = INDEXED_ROWS[activations] if indexed_rows is None else indexed_rows
    config = indexed_tuning(parts[0][0], stacks[0].shape[0], w.codes.device, rows)
    logical = tuple(w.shape) if micros is None else (micros, *w.shape[:-1], w.shape[-1] // micros)
    scale2 = torch.stack([p[3] for p in parts]) if parts[0][3] is not None else None
    layout = KernelLayout(NAME, logical, activations, config, scale2)
    return QWeight(w.fmt, torch.stack([p[1] for p in parts]), torch.stack([p[2] for p in parts]), None, False, layout)


def clamped_share(w: QWeight, micros: int | None = None) -> float:
    """The share of a plain MXFP4 pack's scale blocks that W4A8's fold rounds (more than 11 binades below
    the largest scale of their expert): those blocks' values lose low bits. (Only MXFP4 W4A8 folds.)"""
    if w.fmt != "mxfp4":
        raise ValueError(f"clamped_share: humming folds the block scales of mxfp4 packs only, not {w.fmt}")
    s = w.scales.to(torch.int16)
    if micros is not None:       # each micro's column block is its own stack
        s = s.unflatten(-1, (micros, -1)).movedim(-2, 0)
    flat = s.flatten(-2)         # [..., E, N * K/32]: one expert's blocks
    top = flat.amax(-1, keepdim=True)
    return (flat < top - 11).float().mean().item()


# ------------------------------------------------------------------------ the indexed GEMM's route lists

def align_sizes(rows: int, experts: int, block: int) -> tuple[int, int]:
    """(slots, tiles) of `align`'s lists for `rows` routes: each expert's routes padded to whole M tiles of
    `block` rows take at most rows + min(experts, rows) * (block - 1) slots (sizes from the row count only,
    so the lists are fixed buffers inside a CUDA graph)."""
    slots = -(-(rows + min(experts, rows) * (block - 1)) // block) * block
    return slots, slots // block


def align_reference(ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What `align` computes, in PyTorch (any device, no host read). ids [N, k]: each route's expert ->
    sorted_ids [slots] int32: expert by expert, each expert's routes `t * k + j` ascending, padded to a
    whole number of `block`-row tiles with the pad id N*k (which also fills the slots past the end);
    expert_ids [tiles] int32: each tile's expert (tiles past the end: the last expert, never run);
    num_tokens_padded [1] int32: the slots in use, a multiple of `block`."""
    flat = ids.reshape(-1).long()
    rows = flat.numel()
    slots, tiles = align_sizes(rows, experts, block)
    hot = (flat[:, None] == torch.arange(experts, device=ids.device)).long()        # [routes, experts]
    padded = (hot.sum(0) + block - 1) // block * block
    ends = padded.cumsum(0)
    rank = ((hot.cumsum(0) - hot) * hot).sum(1)                     # the routes to its expert before it
    sorted_ids = torch.full((slots,), rows, dtype=torch.int32, device=ids.device)
    sorted_ids[(ends - padded)[flat] + rank] = torch.arange(rows, dtype=torch.int32, device=ids.device)
    tile_start = torch.arange(tiles, device=ids.device) * block
    expert_ids = (ends[None, :] <= tile_start[:, None]).sum(1).clamp(max=experts - 1).int()
    return sorted_ids, expert_ids, ends[-1:].int()


@triton.jit
def _align_kernel(ids_ptr, sorted_ptr, experts_ptr, padded_ptr, ROWS, SLOTS, TILES, E: tl.constexpr,
                  E_PAD: tl.constexpr, R_PAD: tl.constexpr, M: tl.constexpr, CHUNK: tl.constexpr):
    # one program holds every route of the call (a decode step's: at most INDEXED_MAX_ROWS * k); each output
    # element has one writer, as a slot finds its route (not a route its slot: no scatter, no barrier)
    ri = tl.arange(0, R_PAD)
    re = tl.arange(0, E_PAD)
    mr = ri < ROWS
    me = re < E
    e = tl.load(ids_ptr + ri, mask=mr, other=-1)
    hit = (e[:, None] == re[None, :]) & mr[:, None]
    hot = hit.to(tl.int32)
    padded = (tl.sum(hot, axis=0) + M - 1) // M * M
    ends = tl.cumsum(padded, axis=0)
    starts = ends - padded
    rank = tl.sum(tl.where(hit, tl.cumsum(hot, axis=0) - hot, 0), axis=1)     # the routes to its expert before it
    tl.store(padded_ptr, tl.sum(padded, axis=0))
    for p0 in range(0, SLOTS, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        e_p = tl.sum(((ends[None, :] <= p[:, None]) & me[None, :]).to(tl.int32), axis=1)      # the slot's expert
        at = p - tl.sum(tl.where(re[None, :] == e_p[:, None], starts[None, :], 0), axis=1)    # its place there
        want = (e[None, :] == e_p[:, None]) & (rank[None, :] == at[:, None])
        src = tl.max(tl.where(want, ri[None, :], -1), axis=1)
        tl.store(sorted_ptr + p, tl.where(src >= 0, src, ROWS), mask=p < SLOTS)
    for b0 in range(0, TILES, CHUNK):
        b = b0 + tl.arange(0, CHUNK)
        e_b = tl.sum(((ends[None, :] <= (b * M)[:, None]) & me[None, :]).to(tl.int32), axis=1)
        tl.store(experts_ptr + b, tl.minimum(e_b, E - 1), mask=b < TILES)


def align(ids: torch.Tensor, experts: int, block: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`align_reference` in one Triton program: ids [N, k] int32 -> (sorted_ids, expert_ids,
    num_tokens_padded), humming's indexed GEMM's route lists for M tiles of `block` rows. No host read,
    buffers sized from N*k: a node of a CUDA graph."""
    if ids.dtype != torch.int32 or not ids.is_contiguous():
        raise ValueError(f"align: ids must be contiguous int32 (got {ids.dtype}, strides {ids.stride()})")
    rows = ids.numel()
    slots, tiles = align_sizes(rows, experts, block)
    sorted_ids = _empty(slots, dtype=torch.int32, device=ids.device)
    expert_ids = _empty(tiles, dtype=torch.int32, device=ids.device)
    padded = _empty(1, dtype=torch.int32, device=ids.device)
    _align_kernel[(1,)](ids, sorted_ids, expert_ids, padded, rows, slots, tiles, E=experts, E_PAD=next_pow2(experts),
                        R_PAD=max(2, next_pow2(rows)), M=block, CHUNK=32, num_warps=4)
    return sorted_ids, expert_ids, padded


# ------------------------------------------------------------------------------------------- the variant

def _locks(device: torch.device) -> torch.Tensor:
    """humming's stream-K locks (its batch-invariant schedules split no K, so they stay zero): made once per
    device, not per call (a zeros tensor a call would be a fill kernel per GEMM, a node in each graph)."""
    locks = _LOCKS.get(device)
    if locks is None:
        locks = _LOCKS[device] = torch.zeros(2048, dtype=torch.int32, device=device)
    return locks


_LOCKS: dict[torch.device, torch.Tensor] = {}


def humming_fits(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, *args, **kwargs) -> bool:
    lay1, lay2 = getattr(w1, "layout", None), getattr(w2, "layout", None)
    return (lay1 is not None and lay2 is not None and lay1.kernel == lay2.kernel == NAME
            and lay1.activations == lay2.activations)


def rows_path(n: int, indexed_rows: int) -> str:
    """The path a call of `n` rows takes: "indexed" up to `indexed_rows` (the pack's, at most
    INDEXED_MAX_ROWS), else "grouped"."""
    return "indexed" if n <= min(indexed_rows, INDEXED_MAX_ROWS) else "grouped"


def _gemm(inputs: torch.Tensor, w: QWeight, m: int, out: torch.Tensor, input_scale: torch.Tensor | None,
          routing: dict) -> torch.Tensor:
    """Micro m's GEMM of a laid-out pack; `routing`: its GEMM type's arguments (`_grouped`, `_routes`)."""
    lay = w.layout
    return lib().forward.humming_forward(
        lay.config.layer, inputs=inputs, weight=w.codes[m], weight_scale=w.scales[m],
        weight_scale_2=lay.scale2[m] if lay.scale2 is not None else None, outputs=out, input_scale=input_scale,
        locks=_locks(inputs.device), **routing)


def _act(h: torch.Tensor, w2: QWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The SwiGLU of GEMM1's rows: bf16 (W4A16), or fused with their per-row FP8 quantization (W4A8)."""
    if w2.layout.activations == "bf16":
        return tk.swiglu(h), None
    q, _, scale = lib().forward.may_process_input(w2.layout.config.layer, h, activation_type="binary_split",
                                                  activation_impl=SWIGLU)
    return q, scale


def _rows(xs: torch.Tensor, w1: QWeight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """GEMM1's input rows, quantized once per row for W4A8 (every micro reads them): codes and token
    scales [rows, 1] fp32 (humming's storage padded to 4 scales, which its GEMMs read 4 at a time)."""
    if w1.layout.activations == "bf16":
        return xs, None
    q, _, scale = lib().forward.may_process_input(w1.layout.config.layer, xs)
    return q, scale


def _scale_storage(rows: int, device: torch.device) -> torch.Tensor:
    """Token scales [rows, 1] fp32 on storage padded to 4, as humming allocates them."""
    return _empty(-(-rows // 4) * 4, dtype=torch.float32, device=device)[:rows].view(rows, 1)


def _experts(rows: torch.Tensor, row_scale: torch.Tensor | None, w1: QWeight, w2: QWeight, micro_start: int,
             micro_count: int, routes: int, up: dict, down: dict, dtype: torch.dtype) -> torch.Tensor:
    """Every active micro's GEMM1, SwiGLU and GEMM2 for `routes` routes on GEMM1's input rows as `_rows` gives
    them -> [routes, H] (one micro: `dtype`; more: their partials summed in fp32). `up` / `down`: the two
    GEMMs' routing arguments."""
    inter2, hidden = w1.layout.shape[-2], w2.layout.shape[-2]
    dev = rows.device
    y = None
    for m in range(micro_start, micro_start + micro_count):
        h = _gemm(rows, w1, m, _empty(routes, inter2, dtype=dtype, device=dev), row_scale, up)
        act, act_scale = _act(h, w2)
        part = _gemm(act, w2, m, _empty(routes, hidden, dtype=dtype, device=dev), act_scale, down)
        y = part if y is None else y.float() + part.float()
    return y


def _grouped(x, gate, w1: QWeight, w2: QWeight, micro_start: int, micro_count: int, topk: int, norm_topk: bool):
    """Routing and permutation as the `grouped` variant (moe/cuda.py `permute`), then the grouped-contiguous
    GEMMs over the permuted copy of the rows -> (weights, [N*k, H] in expert order, each route's row there).
    W4A8 quantizes a token's row once and permutes its codes and scale (as humming's own "scatter" input
    layout does: the quantization is per row), not each of its top-k copies."""
    # the plan's offsets as humming's expert_layout [E + 1] int64 (each expert's first row, then the end)
    if w1.layout.activations == "fp8":
        q, scale = _rows(x, w1)
        w, inv, (rows, row_scale), layout = permute_rows(
            x, gate, topk, norm_topk, q, scale, outs=(None, _scale_storage(x.shape[0] * topk, x.device)), layout=True)
    else:
        w, inv, (rows,), layout = permute_rows(x, gate, topk, norm_topk, x, layout=True)
        row_scale = None
    routing = dict(expert_layout=layout, compute_config=COMPUTE)
    return w, _experts(rows, row_scale, w1, w2, micro_start, micro_count, rows.shape[0], routing, routing,
                       x.dtype), inv


def _routes(ids: torch.Tensor, lay: KernelLayout, top_k: int) -> dict:
    """An indexed GEMM's routing arguments: `align`'s lists for the M tile of its kernel at these routes."""
    config: Config = lay.config
    block = block_rows(config.blocks, ids.numel())
    sorted_ids, expert_ids, padded = align(ids, lay.shape[-3], block)
    return dict(sorted_ids=sorted_ids, expert_ids=expert_ids, num_tokens_padded=padded, top_k=top_k,
                compute_config=COMPUTE_INDEXED, tuning_config=config.indexed)


def _indexed(x, gate, w1: QWeight, w2: QWeight, micro_start: int, micro_count: int, topk: int, norm_topk: bool):
    """The grouped path's routing (router_select with its plan, whose counts go unused: the same weights bit
    for bit, so a row's output does not change where its batch crosses the pack's indexed_rows), `align`'s route
    lists, then the indexed GEMMs: GEMM1 gathers the rows of x itself (row t*k+j of its output: token t's
    j-th choice), GEMM2 reads those rows as they are (top_k 1) -> (weights, [N*k, H] in route order, None)."""
    w, ids, _ = tk.router_select(tk.router_logits(x, gate), topk, norm_topk, plan=True)
    routes = ids.numel()
    up = _routes(ids, w1.layout, topk)
    down_config: Config = w2.layout.config
    if block_rows(w1.layout.config.blocks, routes) == block_rows(down_config.blocks, routes):     # the same lists
        down = dict(up, top_k=1, tuning_config=down_config.indexed)
    else:
        down = _routes(ids, w2.layout, 1)
    return w, _experts(*_rows(x, w1), w1, w2, micro_start, micro_count, routes, up, down, x.dtype), None


@backend("moe_quant", NAME, dtypes=(torch.bfloat16,), available=available, fits=humming_fits)
def moe_quant_humming(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start: int, micro_count: int,
                      topk: int, norm_topk: bool, out: torch.Tensor | None = None,
                      path: str | None = None) -> torch.Tensor:
    """The `humming` variant (signature: `moe.moe_quant_reference`; `out` [N, H] x.dtype may be given):
    the indexed path up to the pack's indexed_rows, else the grouped one (`rows_path`); `path` ("indexed" /
    "grouped") forces one (bench humming times both; the engine never passes it). The shared MLP of a
    decode step's rows (quantized, at most the GEMV decode's rows) runs on the decode GEMVs on a side
    stream, as the `decode` variant runs it (batch invariant, hidden under the routing); otherwise on the
    quantized linears (`moe_cuda._shared`)."""
    from .moe_cuda import GEMV_MAX_TOKENS, _shared, shared_fork
    x = x.contiguous()
    n = x.shape[0]
    path = path or rows_path(n, w1.layout.config.indexed_rows)
    if path not in PATHS or (path == "indexed" and n > INDEXED_MAX_ROWS):
        raise ValueError(f"humming: path {path!r} for {n} rows (indexed: 1..{INDEXED_MAX_ROWS} rows, grouped: any)")
    if out is None:
        out = torch.empty_like(x)
    if n == 0:
        return out
    shared, join = None, None
    if isinstance(shared_w1, QWeight) and isinstance(shared_w2, QWeight) and n <= GEMV_MAX_TOKENS[shared_w1.fmt]:
        shared, join = shared_fork(x, shared_w1, shared_w2, micro_start, micro_count, topk)
    elif shared_w1 is not None:
        shared = _shared(x, shared_w1, shared_w2, micro_start, micro_count)
    experts = _indexed if path == "indexed" else _grouped
    w, y, inv = experts(x, gate, w1, w2, micro_start, micro_count, topk, norm_topk)
    if join is not None:
        join()
    return tk.finalize(y, inv, w, shared, out)
