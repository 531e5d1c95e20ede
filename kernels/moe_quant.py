"""The `moe_quant` op: the `moe` op (moe.py) over quantized experts, resident as `quant.QWeight`s.

    moe_quant(x [N, H], gate [E, H] fp32, w1: QWeight [micros, E, 2*I, H], w2: QWeight [E, H, micros*I],
              shared_w1, shared_w2 (QWeight or float tensors as in `moe`, or None),
              micro_start, micro_count, topk, norm_topk) -> [N, H] in x.dtype

The packs are the `moe` op's in the same packing (codes and scales along K: the down pack's micro m
is the column block w2.cols(m*I, (m+1)*I), whole scale blocks). Routing, permutation, ONE down GEMM
over the active micros' columns (the micro partials summed before the route weight) and the fp32
finalize are the `moe` op's (the reference shares `moe.routed_reference`; the CUDA paths reuse
moe_fast.py's and moe_triton.py's kernels); only the GEMMs change, per weight format:
  mxfp8 / mxfp4 / nvfp4  weight-only: the GEMM on the exactly dequantized weights (W8A16 / W4A16);
  fp8 (per output channel)  W8A8: every GEMM's input rows quantized per row to E4M3 (amax / 448)
      first, as `quant.grouped_mm_fp8` / `quant.linear_fp8` define; the down GEMM's row is the whole
      routed row of every active micro (micro_count * I), quantized once.
CUDA (bf16): grouped path (N > DECODE_MAX_TOKENS) on the Triton grouped GEMMs of quant_triton.py, or
`torch._scaled_grouped_mm` for fp8 (GEMM1's rows quantized once for every micro), the down GEMM on the
strided column block of the pack; decode path reading only the chosen experts' quantized bytes, on
quant_gemv.py's GEMVs (DECODE_KERNELS = "gemv") or quant_triton.py's tile kernels ("tile") (for fp8
the activations are quantized and dequantized per row first, a down row over all its micros: the same
numbers as W8A8 up to one bf16 rounding). Deterministic like `moe`: no atomics, fixed sum orders, no
host sync.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .moe import check_packs, routed_reference, swiglu_halves
from .quant import SCALE_BLOCK, QWeight, qgrouped, qlinear
from .registry import backend, reference

Weight = torch.Tensor | QWeight


def _linear(x: torch.Tensor, w: Weight) -> torch.Tensor:
    return qlinear(x, w) if isinstance(w, QWeight) else F.linear(x, w)


def _micro_rows(w: Weight, start: int, count: int) -> Weight:
    """Rows of micros [start, start + count) of a [micros, r, K] pack as one [count * r, K] weight."""
    if isinstance(w, QWeight):
        return w[start:start + count].flat_rows()
    return w[start:start + count].reshape(-1, w.shape[-1])


def _micro_cols(w: Weight, start: int, count: int, width: int) -> Weight:
    """Columns of micros [start, start + count) of a cols-packed [N, micros * width] weight."""
    if isinstance(w, QWeight):
        return w.cols(start * width, (start + count) * width)
    return w[:, start * width:(start + count) * width]


def _expert_cols(w2: QWeight, start: int, count: int, inter: int) -> QWeight:
    """Micros [start, start + count) of the cols-packed [E, H, micros * I] down pack: [E, H, count * I]
    (a strided view of its codes and scales)."""
    block = SCALE_BLOCK[w2.fmt]
    if block and inter % block:
        raise ValueError(f"moe_quant: I_micro {inter} is not a multiple of the {w2.fmt} scale block of {block}: "
                         f"a micro's column block of the down pack would cut its scale blocks")
    return w2.cols(start * inter, (start + count) * inter)


def shared_reference(x, shared_w1: Weight, shared_w2: Weight, micro_start: int, micro_count: int) -> torch.Tensor:
    n = x.shape[0]
    is_micro = shared_w1.shape[1] // 2
    h = _linear(x, _micro_rows(shared_w1, micro_start, micro_count))
    act = swiglu_halves(h.view(n, micro_count, 2 * is_micro)).reshape(n, -1)
    return _linear(act, _micro_cols(shared_w2, micro_start, micro_count, is_micro))


@reference("moe_quant")
def moe_quant_reference(x: torch.Tensor, gate: torch.Tensor, w1: QWeight, w2: QWeight, shared_w1: Weight | None,
                        shared_w2: Weight | None, micro_start: int, micro_count: int, topk: int,
                        norm_topk: bool) -> torch.Tensor:
    inter = w1.shape[2] // 2

    def expert_mlp(xs, offs):
        act = torch.cat([swiglu_halves(qgrouped(xs, w1[m], offs))
                         for m in range(micro_start, micro_start + micro_count)], dim=-1)
        return qgrouped(act, _expert_cols(w2, micro_start, micro_count, inter), offs)

    out = routed_reference(x, gate, topk, norm_topk, expert_mlp)
    if shared_w1 is not None:
        out = out + shared_reference(x, shared_w1, shared_w2, micro_start, micro_count).float()
    return out.to(x.dtype)


def _fast_available() -> bool:
    from .moe import _fast_available as moe_fast_available
    from .quant import _triton_available
    return moe_fast_available() and _triton_available()


@backend("moe_quant", "triton", devices=("cuda",), dtypes=(torch.bfloat16,), available=_fast_available)
def moe_quant_triton(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk):
    return moe_quant_cuda(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk)


# ------------------------------------------------------------------------------------- CUDA paths

def _check(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk):
    if not (isinstance(w1, QWeight) and isinstance(w2, QWeight)):
        raise ValueError("moe_quant: the experts must be quantized (QWeight); use `moe` for float experts")
    check_packs("moe_quant", x, gate, w1.shape, w2.shape, micro_start, micro_count, topk)
    if not all(t.is_contiguous() for t in (*w1.tensors(), *w2.tensors(), gate)):
        raise ValueError("moe_quant: the expert packs and the gate must be contiguous")
    if (shared_w1 is None) != (shared_w2 is None):
        raise ValueError("moe_quant: shared_w1 and shared_w2 come together")


def moe_quant_cuda(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start: int, micro_count: int,
                   topk: int, norm_topk: bool, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The op on CUDA; `out` [N, H] x.dtype may be given."""
    from .moe_fast import DECODE_MAX_TOKENS
    x = x.contiguous()
    _check(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk)
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    args = (x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)
    return _decode(*args) if x.shape[0] <= DECODE_MAX_TOKENS else _grouped(*args)


def _shared(x, shared_w1: Weight, shared_w2: Weight, micro_start: int, micro_count: int) -> torch.Tensor:
    """The shared MLP over the active micros on the quantized (or float) linears, [N, H] x.dtype."""
    from . import moe_triton as tk
    is_micro = shared_w1.shape[1] // 2
    h = _linear(x, _micro_rows(shared_w1, micro_start, micro_count))
    return _linear(tk.swiglu(h, groups=micro_count), _micro_cols(shared_w2, micro_start, micro_count, is_micro))


class _Gemm:
    """One expert GEMM's input rows, prepared once for every weight they meet (GEMM1: every micro):
    fp8 quantizes them per row."""

    def __init__(self, rows: torch.Tensor, fmt: str):
        from . import quant_triton as qt
        self.rows, self.fmt = rows, fmt
        self.q = qt.quantize_rows(rows) if fmt == "fp8" else None

    def __call__(self, w: QWeight, offs: torch.Tensor) -> torch.Tensor:
        from . import quant_triton as qt
        from .quant import scaled_grouped
        if self.q is not None:
            return scaled_grouped(*self.q, w.codes, w.scales, offs, self.rows.dtype)
        return qt.grouped(self.rows, w.fmt, w.codes, w.scales, offs, w.gscale, w.inverse)


def _grouped(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
             out) -> torch.Tensor:
    from . import moe_triton as tk
    from .moe_fast import _empty, _route
    shared = _shared(x, shared_w1, shared_w2, micro_start, micro_count) if shared_w1 is not None else None
    w, inv, xs, offs = _route(x, gate, topk, norm_topk)
    inter = w1.shape[2] // 2
    gemm1 = _Gemm(xs, w1.fmt)
    act = _empty(xs.shape[0], micro_count * inter, dtype=x.dtype, device=x.device)
    for i in range(micro_count):                # each micro's SwiGLU into its column block of act
        tk.swiglu(gemm1(w1[micro_start + i], offs), out=act[:, i * inter:(i + 1) * inter])
    y = _Gemm(act, w2.fmt)(_expert_cols(w2, micro_start, micro_count, inter), offs)     # one down GEMM
    return tk.finalize(y, inv, w, shared, out)


# Which kernels the decode path (N <= DECODE_MAX_TOKENS) runs: "gemv" = quant_gemv.py (no tensor cores,
# fp32 FMA on the codes as loaded, activations prepared once), "tile" = quant_triton.py's decode_up /
# decode_down (dequantized tiles into bf16 MMAs). bench/bench_kernels_quant.py --decode times both.
DECODE_KERNELS = "gemv"


def _decode(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
            out) -> torch.Tensor:
    q1, q2 = isinstance(shared_w1, QWeight), isinstance(shared_w2, QWeight)
    if DECODE_KERNELS == "gemv" and q1 == q2:
        return _decode_gemv(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)
    return _decode_tile(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)


def _decode_gemv(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
                 out) -> torch.Tensor:
    """The decode path on quant_gemv's GEMVs: x prepared once per code-word width (prep), gate/up +
    SwiGLU writing act prepared for the down GEMV (fp32; FP8 writes bf16 act, quantized per row in
    place, read as is), down GEMV summing the micros, the shared MLP likewise, one finalize."""
    from . import moe_triton as tk
    from . import quant_gemv as qg
    from . import quant_triton as qt
    from .moe_fast import _empty
    n, h = x.shape
    mc = micro_count
    dev = x.device
    inter = w1.shape[2] // 2
    fq = qt.quantize_rows(x, fake=True) if "fp8" in (w1.fmt, getattr(shared_w1, "fmt", None)) else None
    preps: dict[str, torch.Tensor] = {}

    def x_in(fmt: str) -> torch.Tensor:          # the up GEMV's activations of `fmt`, prepared once
        key = _x_key(fmt)
        if key not in preps:
            preps[key] = qg.prep(fq if fmt == "fp8" else x, fmt) if qg.PREP_X else (fq if fmt == "fp8" else x)
        return preps[key]

    def mlp(fmt_up, fmt_down, wa: QWeight, wb: QWeight, ids, slots, width, act_active, y):
        ph = qg.act_ph(fmt_down)
        act = _empty(mc, slots, n, width, dtype=torch.float32 if ph else x.dtype, device=dev)
        qg.decode_up(x_in(fmt_up), ids, act_active, fmt_up, wa.codes, wa.scales, wa.gscale, wa.inverse, act, slots,
                     width, x_prepared=qg.PREP_X, act_prep=ph)
        if not ph:                 # fp8: a down row (every micro's slice of it) quantized once
            qt.quantize_rows(act, fake=True, out=act, micros=mc)
        qg.decode_down(act, ids, act_active, fmt_down, wb.codes, wb.scales, wb.gscale, wb.inverse, y, slots, width,
                       act_prepared=bool(ph))

    # A quantized shared MLP does not depend on the routing: it runs on a side stream (inside a captured
    # decode graph: a parallel branch) while the main stream routes and runs the routed experts, so the
    # small routing kernels and each GEMV's tail overlap the other's weight reads. Its output `ys` is made
    # on the main stream before the fork and read after the join. (Its GEMVs read no routing: `ids` there
    # only gives the top-k width.)
    ys = _empty(n, h, dtype=torch.float32, device=dev) if shared_w1 is not None else None
    is_micro = shared_w1.shape[1] // 2 if shared_w1 is not None else 0
    side = _side_stream(dev) if isinstance(shared_w1, QWeight) and dev.type == "cuda" else None
    if side is not None:
        if _x_key(shared_w1.fmt) == _x_key(w1.fmt):   # one prepared input for both branches: made before the fork
            x_in(w1.fmt)
        main = torch.cuda.current_stream(dev)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            mlp(shared_w1.fmt, shared_w2.fmt, shared_w1[micro_start:micro_start + mc],
                shared_w2.cols(micro_start * is_micro, (micro_start + mc) * is_micro),
                _empty(n, topk, dtype=torch.int32, device=dev), 1, is_micro, None, ys)
    w, ids, active = tk.router_select(tk.router_logits(x, gate), topk, norm_topk, plan=False)
    y = _empty(n * topk, h, dtype=torch.float32, device=dev)
    mlp(w1.fmt, w2.fmt, w1[micro_start:micro_start + mc], _expert_cols(w2, micro_start, mc, inter), ids,
        active.shape[0], inter, active, y)
    if side is not None:
        main.wait_stream(side)
    elif isinstance(shared_w1, QWeight):          # (no side stream off CUDA: the interpreter's tests)
        mlp(shared_w1.fmt, shared_w2.fmt, shared_w1[micro_start:micro_start + mc],
            shared_w2.cols(micro_start * is_micro, (micro_start + mc) * is_micro), ids, 1, is_micro, None, ys)
    elif shared_w1 is not None:                   # a float shared MLP: the bf16 decode kernels
        act_s = _empty(mc, 1, 16, is_micro, dtype=x.dtype, device=dev)
        tk.decode_up(x, ids, None, None, shared_w1[micro_start:micro_start + mc], act_s, 1, is_micro)
        tk.decode_down(act_s, ids, None, None, shared_w2[:, micro_start * is_micro:], None, ys, 1, is_micro)
    return tk.finalize(y, None, w, ys, out)


def _x_key(fmt: str) -> str:
    """Which prepared input an up GEMV of `fmt` reads (formats of one code-word width share it)."""
    from . import quant_gemv as qg
    return ("fq" if fmt == "fp8" else "x") + str(qg.PH[fmt])


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(dev: torch.device) -> torch.cuda.Stream:
    """One side stream per device, made once (a graph capture records its work as a parallel branch)."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def _decode_tile(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
                 out) -> torch.Tensor:
    from . import moe_triton as tk
    from . import quant_triton as qt
    from .moe_fast import _empty
    n, h = x.shape
    mc = micro_count
    dev = x.device
    w, ids, active = tk.router_select(tk.router_logits(x, gate), topk, norm_topk, plan=False)
    s = active.shape[0]
    bn = 16                                           # token rows of one decode tile (tl.dot's minimum)
    inter = w1.shape[2] // 2
    fq = qt.quantize_rows(x, fake=True) if "fp8" in (w1.fmt, getattr(shared_w1, "fmt", None)) else None
    w1a, w2a = w1[micro_start:micro_start + mc], _expert_cols(w2, micro_start, mc, inter)
    act = _empty(mc, s, bn, inter, dtype=x.dtype, device=dev)
    qt.decode_up(fq if w1.fmt == "fp8" else x, ids, active, w1.fmt, w1a.codes, w1a.scales, w1a.gscale, w1.inverse,
                 act, s, inter)
    if w2.fmt == "fp8":                               # a down row over all its micros quantized once
        qt.quantize_rows(act, fake=True, out=act, micros=mc)
    y = _empty(n * topk, h, dtype=torch.float32, device=dev)
    qt.decode_down(act, ids, active, w2.fmt, w2a.codes, w2a.scales, w2a.gscale, w2.inverse, y, s, inter)
    ys = None
    if shared_w1 is not None:
        is_micro = shared_w1.shape[1] // 2
        ys = _empty(n, h, dtype=torch.float32, device=dev)
        act_s = _empty(mc, 1, bn, is_micro, dtype=x.dtype, device=dev)
        if isinstance(shared_w1, QWeight):
            sw1 = shared_w1[micro_start:micro_start + mc]
            qt.decode_up(fq if shared_w1.fmt == "fp8" else x, ids, None, shared_w1.fmt, sw1.codes, sw1.scales,
                         sw1.gscale, shared_w1.inverse, act_s, 1, is_micro)
        else:
            tk.decode_up(x, ids, None, None, shared_w1[micro_start:micro_start + mc], act_s, 1, is_micro)
        if isinstance(shared_w2, QWeight):
            if shared_w2.fmt == "fp8":
                qt.quantize_rows(act_s, fake=True, out=act_s, micros=mc)
            sw2 = shared_w2.cols(micro_start * is_micro, (micro_start + mc) * is_micro)
            qt.decode_down(act_s, ids, None, shared_w2.fmt, sw2.codes, sw2.scales, sw2.gscale, shared_w2.inverse,
                           ys, 1, is_micro)
        else:
            tk.decode_down(act_s, ids, None, None, shared_w2[:, micro_start * is_micro:], None, ys, 1, is_micro)
    return tk.finalize(y, None, w, ys, out)
