"""The CUDA variants of the `moe_quant` op (definition and reference: moe.py), preferred in this order:

  decode   N <= GEMV_MAX_TOKENS (16; FP8 8): each token on its own (batch invariant),
           reads only the chosen experts' quantized bytes, on gemv.py's GEMVs (no tensor cores, fp32 FMA on the codes as loaded, activations prepared once);
           for fp8 the activations are quantized and dequantized per row first, a down row over all its
           micros (the same numbers as W8A8 up to one bf16 rounding). Its cost grows with every (token,
           expert) pair, not with the experts touched (issue 31's figures).
  batched  N <= BATCHED_MAX_TOKENS (32), after decode: expert-major, each touched expert's weight tile read once for every token routed to it (one program per micro, expert and row tile, its
           tokens gathered from the routing on the device, 16 per MMA on the dequantized bf16 tile:
           triton_kernels.py's `edecode_*`); the shared MLP (quantized or float) on the same kernels on a
           side stream. Batch invariant: tile shapes, K steps and the router's tiles are the same for
           every N, so a token's output is bitwise the same alone or with up to 31 others.
           Measured 2026-12-02 on one H200 (python -m bench moe-decode --quick, 8 layers in one graph), MXFP4:
           2.56 ms at N=1 and 11.3 at 8 against decode's 0.84 and 6.41, 15.1 at 16 (7.0x the touched-experts
           floor); no tile config of its --tune sweep does better. So it comes after `decode` and serves
           17..32 rows (FP8: 9..32), where it is the faster (GEMV_MAX_TOKENS below). The two round
           differently: a server batch that stays within GEMV_MAX_TOKENS (CUDA --max-batch 8) keeps every
           request's tokens independent of its company.
  grouped  every N: routing and permutation as `moe`'s grouped path (moe/cuda.py), the expert GEMMs on
           triton_kernels.py's grouped GEMMs, or torch._scaled_grouped_mm for fp8 (a token's row
           quantized once, before the permutation, for every micro; with one micro the SwiGLU writes the
           down GEMM's quantized rows), the down GEMM on the strided column block of the pack

Earlier tile decode kernels (dequantized tiles into bf16 MMAs) lost to the GEMVs at 1 and 8 tokens (bench
kernels-quant --decode, 2026-11-30) and were removed (git history); `batched` is a tile kernel again, but
per expert over all its tokens: `python -m bench moe-decode` times it against the GEMVs at every N.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from ..moe import triton_kernels as tk
from ..moe.cuda import permute, permute_rows
from ..moe.cuda import available as moe_available
from ..moe.reference import check_packs
from ..registry import backend, call
from ..scratch import empty as _empty
from . import cuda
from . import gemv as qg
from . import triton_kernels as qt
from .formats import QWeight
from .moe import Weight, _expert_cols, _linear, _micro_cols, _micro_rows

def _check(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk):
    if not (isinstance(w1, QWeight) and isinstance(w2, QWeight)):
        raise ValueError("moe_quant: the experts must be quantized (QWeight); use `moe` for float experts")
    check_packs("moe_quant", x, gate, w1.shape, w2.shape, micro_start, micro_count, topk)
    if not all(t.is_contiguous() for t in (*w1.tensors(), *w2.tensors(), gate)):
        raise ValueError("moe_quant: the expert packs and the gate must be contiguous")
    if (shared_w1 is None) != (shared_w2 is None):
        raise ValueError("moe_quant: shared_w1 and shared_w2 come together")


def _run(path, x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out):
    x = x.contiguous()
    _check(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk)
    if out is None:
        out = torch.empty_like(x)
    if x.shape[0] == 0:
        return out
    return path(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)


# The GEMV decode's sizes per expert format; `batched` takes the rest up to 32. Measured 2026-12-02 on one H200
# (python -m bench moe-decode --quick --ns 1,8,16,32 --decode-max 32, 8 layers in one graph), ms at N = 16 /
# 32, decode vs batched: MXFP4 11.3 / 19.5 vs 15.0 / 17.6; NVFP4 12.9 / 22.0 vs 21.2 / 23.9; MXFP8 11.7 / 20.6
# vs 13.0 / 15.1; FP8 15.9 / 30.1 vs 11.6 / 13.4 (at 8: 8.50 vs 8.43).
GEMV_MAX_TOKENS = {"mxfp4": 16, "nvfp4": 16, "mxfp8": 16, "fp8": 8}
BATCHED_MAX_TOKENS = tk.DECODE_ROUTER_ROWS    # the batched decode's: the decode router's one program


def _shared_paired(shared_w1, shared_w2) -> bool:
    return isinstance(shared_w1, QWeight) == isinstance(shared_w2, QWeight)


def plain(w1: QWeight, w2: QWeight) -> bool:
    """Both expert packs in the plain layout (not laid out at load for another kernel family: humming.py)."""
    return w1.layout is None and w2.layout is None


def batched_fits(x, gate, w1, w2, shared_w1, shared_w2, *args, **kwargs) -> bool:
    """A decode step's rows (1..32), and the shared MLP quantized in both linears or in neither (a float
    one in x's dtype: it is multiplied on the same MMAs)."""
    return (x.shape[0] <= BATCHED_MAX_TOKENS and plain(w1, w2) and _shared_paired(shared_w1, shared_w2)
            and (shared_w1 is None or isinstance(shared_w1, QWeight)
                 or shared_w1.dtype == shared_w2.dtype == x.dtype))


def decode_fits(x, gate, w1, w2, shared_w1, shared_w2, *args, **kwargs) -> bool:
    """Decode-sized, and the shared MLP quantized in both linears or in neither (the GEMVs' pairing)."""
    return (x.shape[0] <= GEMV_MAX_TOKENS.get(w1.fmt, 8) and plain(w1, w2)
            and _shared_paired(shared_w1, shared_w2))


@backend("moe_quant", "decode", dtypes=(torch.bfloat16,), available=moe_available, fits=decode_fits)
def moe_quant_decode(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start: int, micro_count: int,
                     topk: int, norm_topk: bool, out: torch.Tensor | None = None,
                     tiles: dict | None = None) -> torch.Tensor:
    """The `decode` variant (signature: `moe.moe_quant_reference`; `out` [N, H] x.dtype may be given).
    `tiles` {"up": cfg, "down": cfg} overrides gemv's DECODE_UP / DECODE_DOWN for this call's routed and
    shared GEMVs (bench moe-decode --tune-decode); the engine never passes it."""
    path = functools.partial(_decode_gemv, tiles=tiles or {})
    return _run(path, x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)


@backend("moe_quant", "batched", dtypes=(torch.bfloat16,), available=moe_available, fits=batched_fits)
def moe_quant_batched(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start: int, micro_count: int,
                      topk: int, norm_topk: bool, out: torch.Tensor | None = None,
                      tiles: dict | None = None) -> torch.Tensor:
    """The `batched` variant (signature: `moe.moe_quant_reference`; `out` [N, H] x.dtype may be given).
    `tiles` {"up": cfg, "down": cfg} overrides triton_kernels' EDECODE_UP / EDECODE_DOWN for this call
    (bench moe-decode --tune, small-shape tests); the engine never passes it."""
    path = functools.partial(_batched, tiles=tiles or {})
    return _run(path, x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)


@backend("moe_quant", "grouped", dtypes=(torch.bfloat16,), available=moe_available,
         fits=lambda x, gate, w1, w2, *args, **kwargs: plain(w1, w2))
def moe_quant_grouped(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start: int, micro_count: int,
                      topk: int, norm_topk: bool, out: torch.Tensor | None = None) -> torch.Tensor:
    """The `grouped` variant: every N."""
    return _run(_grouped, x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk, out)


def _shared(x, shared_w1: Weight, shared_w2: Weight, micro_start: int, micro_count: int) -> torch.Tensor:
    """The shared MLP over the active micros on the quantized (or float) linears, [N, H] x.dtype (the rows of
    the grouped paths: decode-sized ones take the GEMVs, `shared_fork`). An FP8 down linear of one micro takes
    its input rows quantized by the SwiGLU's kernel (one pass less than linear_fp8's own quantization)."""
    is_micro = shared_w1.shape[1] // 2
    h = _linear(x, _micro_rows(shared_w1, micro_start, micro_count))
    w2 = _micro_cols(shared_w2, micro_start, micro_count, is_micro)
    if isinstance(w2, QWeight) and w2.fmt == "fp8" and micro_count == 1 and is_micro <= qt.SWIGLU_QUANT_MAX_I:
        return call("fp8_scaled_mm", *qt.swiglu_quantize_rows(h), w2.codes, w2.scales, x.dtype)
    return _linear(tk.swiglu(h, groups=micro_count), w2)


class _Gemm:
    """One expert GEMM's input rows, prepared once for every weight they meet (GEMM1: every micro):
    fp8 quantizes them per row (or takes them quantized: `q`, codes and scales)."""

    def __init__(self, rows: torch.Tensor, fmt: str, q: tuple[torch.Tensor, torch.Tensor] | None = None,
                 dtype: torch.dtype | None = None):
        self.rows, self.fmt, self.dtype = rows, fmt, dtype or rows.dtype
        self.q = q if q is not None else qt.quantize_rows(rows) if fmt == "fp8" else None

    def __call__(self, w: QWeight, offs: torch.Tensor) -> torch.Tensor:
        if self.q is not None:
            return cuda.scaled_grouped(*self.q, w.codes, w.scales, offs, self.dtype)
        return qt.grouped(self.rows, w.fmt, w.codes, w.scales, offs, w.gscale, w.inverse)


def _grouped(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
             out) -> torch.Tensor:
    shared = _shared(x, shared_w1, shared_w2, micro_start, micro_count) if shared_w1 is not None else None
    if w1.fmt == "fp8":
        # quantized per token, then permuted (a row's quantization is its own: the same codes as quantizing
        # the top-k copies), so the quantizer reads N rows instead of N * top-k and the copy moves 1-byte codes
        w, inv, (xs, xs_scale), offs = permute_rows(x, gate, topk, norm_topk, *qt.quantize_rows(x))
        gemm1 = _Gemm(xs, w1.fmt, (xs, xs_scale), x.dtype)
    else:
        w, inv, xs, offs = permute(x, gate, topk, norm_topk)
        gemm1 = _Gemm(xs, w1.fmt)
    inter = w1.shape[2] // 2
    down = _expert_cols(w2, micro_start, micro_count, inter)
    if w2.fmt == "fp8" and micro_count == 1 and inter <= qt.SWIGLU_QUANT_MAX_I:
        # one micro: a down row is its SwiGLU alone, quantized in the kernel that makes it
        q = qt.swiglu_quantize_rows(gemm1(w1[micro_start], offs))
        return tk.finalize(_Gemm(q[0], w2.fmt, q, x.dtype)(down, offs), inv, w, shared, out)
    act = _empty(xs.shape[0], micro_count * inter, dtype=x.dtype, device=x.device)
    for i in range(micro_count):                # each micro's SwiGLU into its column block of act
        tk.swiglu(gemm1(w1[micro_start + i], offs), out=act[:, i * inter:(i + 1) * inter])
    y = _Gemm(act, w2.fmt)(down, offs)          # one down GEMM over the micros' columns
    return tk.finalize(y, inv, w, shared, out)


class _Gemvs:
    """One decode call's MLPs on gemv.py's GEMVs: x prepared once per code-word width (prep), gate/up +
    SwiGLU writing act prepared for the down GEMV (fp32; FP8 writes bf16 act, quantized per row in place,
    read as is), down GEMV summing the micros. `tiles` {"up": cfg, "down": cfg} overrides the GEMVs' tiles."""

    def __init__(self, x: torch.Tensor, micro_count: int, tiles: dict):
        self.x, self.mc, self.tiles = x, micro_count, tiles
        self.preps: dict[str, torch.Tensor] = {}

    def x_in(self, fmt: str) -> torch.Tensor:          # the up GEMV's activations of `fmt`, prepared once
        key = _x_key(fmt)
        if key not in self.preps:                      # (fp8: quantized per row and dequantized, in the prep)
            self.preps[key] = qg.prep(self.x, fmt, fp8_rows=fmt == "fp8")
        return self.preps[key]

    def mlp(self, wa: QWeight, wb: QWeight, ids, slots, width, act_active, y) -> None:
        ph = qg.act_ph(wb.fmt)
        act = _empty(self.mc, slots, self.x.shape[0], width, dtype=torch.float32 if ph else self.x.dtype,
                     device=self.x.device)
        qg.decode_up(self.x_in(wa.fmt), ids, act_active, wa.fmt, wa.codes, wa.scales, wa.gscale, wa.inverse, act,
                     slots, width, self.tiles.get("up"), x_prepared=True, act_prep=ph)
        if not ph:                 # fp8: a down row (every micro's slice of it) quantized once
            qt.quantize_rows(act, fake=True, out=act, micros=self.mc)
        qg.decode_down(act, ids, act_active, wb.fmt, wb.codes, wb.scales, wb.gscale, wb.inverse, y, slots, width,
                       self.tiles.get("down"), act_prepared=bool(ph))

    def shared(self, shared_w1: QWeight, shared_w2: QWeight, micro_start: int, ids: torch.Tensor,
               ys: torch.Tensor) -> None:
        """The quantized shared MLP over the active micros into ys [N, H] fp32 (its GEMVs read no routing:
        `ids` only gives the top-k width)."""
        is_micro = shared_w1.shape[1] // 2
        self.mlp(shared_w1[micro_start:micro_start + self.mc],
                 shared_w2.cols(micro_start * is_micro, (micro_start + self.mc) * is_micro), ids, 1, is_micro, None, ys)


def shared_fork(x: torch.Tensor, shared_w1: QWeight, shared_w2: QWeight, micro_start: int, micro_count: int,
                topk: int, gemvs: "_Gemvs | None" = None) -> tuple[torch.Tensor, Callable[[], None]]:
    """A quantized shared MLP does not depend on the routing: it runs on a side stream (inside a captured
    decode graph: a parallel branch) while the main stream routes and runs the routed experts, so the
    small routing kernels and each GEMV's tail overlap the other's weight reads. Returns its output ys
    [N, H] fp32 (made on the main stream before the fork) and the join to call before reading it. Batch
    invariant (the decode GEMVs). Off CUDA (the interpreter's tests) it runs at once."""
    g = gemvs or _Gemvs(x, micro_count, {})
    n, h = x.shape
    ys = _empty(n, h, dtype=torch.float32, device=x.device)
    ids = _empty(n, topk, dtype=torch.int32, device=x.device)
    if x.device.type != "cuda":
        g.shared(shared_w1, shared_w2, micro_start, ids, ys)
        return ys, lambda: None
    side = _side_stream(x.device)
    main = torch.cuda.current_stream(x.device)
    side.wait_stream(main)
    with torch.cuda.stream(side):
        g.shared(shared_w1, shared_w2, micro_start, ids, ys)
    return ys, lambda: main.wait_stream(side)


def _decode_gemv(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
                 out, tiles: dict) -> torch.Tensor:
    """The decode path on gemv.py's GEMVs (`_Gemvs`): the routed experts' MLP, the shared MLP on a side
    stream (`shared_fork`), one finalize."""
    n, h = x.shape
    mc = micro_count
    dev = x.device
    inter = w1.shape[2] // 2
    g = _Gemvs(x, mc, tiles)
    ys, join = None, None
    if isinstance(shared_w1, QWeight):
        if _x_key(shared_w1.fmt) == _x_key(w1.fmt):   # one prepared input for both branches: made before the fork
            g.x_in(w1.fmt)
        ys, join = shared_fork(x, shared_w1, shared_w2, micro_start, mc, topk, g)
    w, ids, active = tk.router_select(tk.router_logits(x, gate), topk, norm_topk, plan=False)
    y = _empty(n * topk, h, dtype=torch.float32, device=dev)
    g.mlp(w1[micro_start:micro_start + mc], _expert_cols(w2, micro_start, mc, inter), ids, active.shape[0], inter,
          active, y)
    if join is not None:
        join()
    elif shared_w1 is not None:                   # a float shared MLP: the bf16 decode kernels
        is_micro = shared_w1.shape[1] // 2
        ys = _empty(n, h, dtype=torch.float32, device=dev)
        act_s = _empty(mc, 1, 16, is_micro, dtype=x.dtype, device=dev)
        tk.decode_up(x, ids, None, None, shared_w1[micro_start:micro_start + mc], act_s, 1, is_micro)
        tk.decode_down(act_s, ids, None, None, shared_w2[:, micro_start * is_micro:], None, ys, 1, is_micro)
    return tk.finalize(y, None, w, ys, out)


def _x_key(fmt: str) -> str:
    """Which prepared input an up GEMV of `fmt` reads (formats of one code-word width share it)."""
    return ("fq" if fmt == "fp8" else "x") + str(qg.PH[fmt])


_SIDE: dict[int, torch.cuda.Stream] = {}


def _side_stream(dev: torch.device) -> torch.cuda.Stream:
    """One side stream per device, made once (a graph capture records its work as a parallel branch)."""
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SIDE:
        _SIDE[i] = torch.cuda.Stream(device=i)
    return _SIDE[i]


def _parts(w: Weight) -> tuple:
    """(format, codes, scales, gscale, inverse) of a quantized weight; a float one is "bf16", its values."""
    if isinstance(w, QWeight):
        return w.fmt, w.codes, w.scales, w.gscale, w.inverse
    return "bf16", w, None, None, False


def _batched(x, gate, w1: QWeight, w2: QWeight, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk,
             out, tiles: dict) -> torch.Tensor:
    """The expert-major decode: routing (the decode router), then per MLP one gate/up + SwiGLU launch
    writing act [micros, rows, I] (routed: a row per (token, choice); FP8: each row, every micro's slice of
    it, quantized once) and one down launch summing the micros; the shared MLP on a side stream; finalize."""
    n, h = x.shape
    mc = micro_count
    dev = x.device
    fq = qt.quantize_rows(x, fake=True) if "fp8" in (w1.fmt, getattr(shared_w1, "fmt", None)) else None

    def mlp(wa: Weight, wb: Weight, ids, active, width: int, rows: int, y: torch.Tensor) -> None:
        fa, *pa = _parts(wa)
        fb, *pb = _parts(wb)
        act = _empty(mc, rows, width, dtype=x.dtype, device=dev)
        qt.edecode_up(fq if fa == "fp8" else x, ids, active, fa, *pa, act, cfg=tiles.get("up"))
        if fb == "fp8":            # a down row (every micro's slice of it) quantized once
            qt.quantize_rows(act, fake=True, out=act, micros=mc)
        qt.edecode_down(act, ids, active, fb, *pb, y, cfg=tiles.get("down"))

    ys = side = None
    if shared_w1 is not None:
        # the shared MLP reads no routing (`ids` there gives only the top-k width): on a side stream (inside
        # a captured graph a parallel branch) it overlaps the routing and the routed experts
        is_micro = shared_w1.shape[1] // 2
        ys = _empty(n, h, dtype=torch.float32, device=dev)
        shared = (shared_w1[micro_start:micro_start + mc], _micro_cols(shared_w2, micro_start, mc, is_micro),
                  _empty(n, topk, dtype=torch.int32, device=dev), None, is_micro, n, ys)
        if dev.type == "cuda":
            side = _side_stream(dev)
            main = torch.cuda.current_stream(dev)
            side.wait_stream(main)
            with torch.cuda.stream(side):
                mlp(*shared)
    w, ids, active = tk.router_select(tk.router_logits(x, gate), topk, norm_topk, plan=False)
    inter = w1.shape[2] // 2
    y = _empty(n * topk, h, dtype=torch.float32, device=dev)
    mlp(w1[micro_start:micro_start + mc], _expert_cols(w2, micro_start, mc, inter), ids, active, inter, n * topk, y)
    if side is not None:
        main.wait_stream(side)
    elif ys is not None:                          # (no side stream off CUDA: the interpreter's tests)
        mlp(*shared)
    return tk.finalize(y, None, w, ys, out)
