"""The `moe_quant` op's `batched` variant (hunyuan_kernels/quant/moe_cuda.py, triton_kernels.py `edecode_*`): the
decode MoE of 1..32 rows that reads each touched expert's weights once for all its tokens.

Under Triton's CPU interpreter on small shapes, every expert format with a quantized, float or no shared
MLP: against the op's reference, and batch invariant (a token's output alone equals, bitwise, its output
in batches of 3, 16 and 32 with other tokens, at other positions). Marked gpu: the same at the real tp1 /
hybrid4 shapes, the variant asserted to have run, and the graph replay."""
from __future__ import annotations

import functools
import types

import pytest
import torch
from kernel_support import INTERPRETED, interpreted, poisoned, rel_err, run_interpreter_suite
from test_kernels_quant import make_qmoe, qargs

import hunyuan_kernels as kernels

BATCHES = (3, 16, 32)


def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.fixture(scope="module")
def mc_mod():
    return interpreted("hunyuan_kernels.quant.moe_cuda")


@pytest.fixture
def small_tiles(mc_mod):
    """`batched` on tiles small enough that the test shapes take several K steps and row tiles."""
    tiles = dict(up=dict(BI=32, BK=64, num_warps=4, num_stages=1), down=dict(BH=64, BK=32, num_warps=4, num_stages=1))
    return types.SimpleNamespace(batched_fits=mc_mod.batched_fits,
                                 moe_quant_batched=functools.partial(mc_mod.moe_quant_batched, tiles=tiles))


@pytest.fixture
def elementwise_dot(monkeypatch):
    """The interpreter's tl.dot is numpy's BLAS matmul, whose sum for one row of the first operand can
    depend on the row's position in the tile (seen: 1 ulp between rows 0 and 14 of a [16, 128] operand in
    the bf16 decode kernel); an MMA's cannot (the GPU tests check it on the hardware). The batch
    invariance tests run the kernels on a dot whose every element is its own fp32 sum over K, in order."""
    from hunyuan_kernels.moe import triton_kernels as tk
    from hunyuan_kernels.quant import triton_kernels as qt
    monkeypatch.setattr(tk, "dot", _elementwise_dot)
    monkeypatch.setattr(qt, "dot", _elementwise_dot)


if INTERPRETED:      # (the child run: Triton is there, under its interpreter)
    import triton
    import triton.language as tl

    @triton.jit
    def _elementwise_dot(a, b, acc, UPCAST: tl.constexpr):
        return acc + tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)

    @triton.jit
    def _nan_tile(a, b, g, FMT: tl.constexpr, INVERSE: tl.constexpr, BS: tl.constexpr, BN: tl.constexpr,
                  BK: tl.constexpr):
        return tl.full((BN, BK), float("nan"), tl.bfloat16)


CASES = [  # experts fmt, shared fmt ("bf16": float, None: no shared MLP), micros, micro_start, micro_count
    ("mxfp4", "mxfp8", 2, 0, 2),          # the MXFP4-mixed build; a down row over two micros
    ("mxfp8", "bf16", 2, 1, 1),           # a float shared MLP on the same kernels
    ("nvfp4", "nvfp4", 1, 0, 1),          # compressed-tensors' inverse global scale (set below)
    ("fp8", "fp8", 2, 0, 2),              # online FP8: rows quantized per row (a down row over both micros)
    ("nvfp4", None, 1, 0, 1),             # ModelOpt's global scale, no shared MLP
]


def _args(n, fmt, sfmt, micros, ms, mc, seed, experts=8, topk=3):
    t = make_qmoe(n, fmt, sfmt or "bf16", hidden=128, experts=experts, inter=64,
                  shared_inter=64 if sfmt else 0, micros=micros, inverse=fmt == "nvfp4" and sfmt is not None,
                  seed=seed)
    return qargs(t, ms, mc, topk=topk)


@pytest.mark.parametrize("fmt,sfmt,micros,ms,mc", CASES)
def test_interp_batched_matches_reference(small_tiles, fmt, sfmt, micros, ms, mc):
    from hunyuan_kernels.quant.moe import moe_quant_reference
    for n in (3, 32):
        args = _args(n, fmt, sfmt, micros, ms, mc, seed=40 + n)
        assert small_tiles.batched_fits(*args)
        out = torch.full_like(args[0], float("nan"))
        got = poisoned(small_tiles.moe_quant_batched, *args, out=out)
        assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
        # the tolerances of the other decode paths' tests (fp8: the activations' E4M3 roundings)
        assert rel_err(got, moe_quant_reference(*args)) < (3e-2 if fmt == "fp8" else 1e-2), n


@pytest.mark.parametrize("fmt,sfmt,micros,ms,mc", [CASES[0], ("mxfp8", "mxfp8", 1, 0, 1)])
def test_interp_batched_on_dot_scaled_matches_reference(mc_mod, monkeypatch, fmt, sfmt, micros, ms, mc):
    """The tile key SCALED (MX formats: tl.dot_scaled on the codes and their E8M0 scales as stored, no
    dequantization of ours): the reference's result, with our dequantization (`_ewtile`) made to give NaN,
    so the result shows it was not used. (Its speed is measured on the GPU: bench moe-decode --tune.)"""
    from hunyuan_kernels.quant import triton_kernels as qt
    from hunyuan_kernels.quant.moe import moe_quant_reference
    monkeypatch.setattr(qt, "_ewtile", _nan_tile)
    tiles = dict(up=dict(BI=32, BK=64, num_warps=4, num_stages=1, SCALED=True),
                 down=dict(BH=64, BK=32, num_warps=4, num_stages=1, SCALED=True))
    args = _args(16, fmt, sfmt, micros, ms, mc, seed=61)
    got = poisoned(mc_mod.moe_quant_batched, *args, out=torch.full_like(args[0], float("nan")), tiles=tiles)
    assert not got.isnan().any()
    assert rel_err(got, moe_quant_reference(*args)) < 1e-2
    tiles["up"].pop("SCALED")                     # (the launcher pops a copy's key, not ours)
    tiles["down"].pop("SCALED")
    assert poisoned(mc_mod.moe_quant_batched, *args, tiles=tiles).isnan().all()      # our dequantization ran


# batch invariance is the kernels' structure, not the format's: two cases (one with a down row over two
# micros and a shared MLP, one without a shared MLP) keep the interpreter suite within CI's time
@pytest.mark.parametrize("fmt,sfmt,micros,ms,mc", [CASES[0], CASES[4]])
def test_interp_batched_is_batch_invariant(small_tiles, elementwise_dot, fmt, sfmt, micros, ms, mc):
    """Token 0 of a 32-row batch alone, then at other rows of batches of 3, 16 and 32 (the rest other
    tokens): the same bits; and another token of the 32 alone. 4 experts of top-2 (two cases): an expert
    serves more than 16 of the 32 tokens (a second pass of its weight tile)."""
    experts, topk = (4, 2) if fmt in ("mxfp4", "fp8") else (8, 3)
    args = _args(32, fmt, sfmt, micros, ms, mc, seed=7, experts=experts, topk=topk)
    x, rest = args[0], args[1:]
    alone = small_tiles.moe_quant_batched(x[:1], *rest)
    for n, row in zip(BATCHES, (2, 9, 31)):
        xb = torch.cat([x[1:row + 1], x[:1], x[row + 1:n]])
        assert xb.shape[0] == n and torch.equal(xb[row], x[0])
        got = poisoned(small_tiles.moe_quant_batched, xb, *rest)
        if n == 32:
            assert torch.equal(got[17], small_tiles.moe_quant_batched(xb[17:18], *rest)[0])
        assert torch.equal(got[row], alone[0]), (n, row)


@pytest.mark.parametrize("shared_inter", [32, 48, 0])    # the shared MLP as one more slot, apart, none
def test_interp_bf16_decode_takes_32_rows_batch_invariant(mc_mod, elementwise_dot, shared_inter):
    """The `moe` op's decode variant (bf16) at 17..32 rows (two token chunks): the reference's result, and
    a token's output the same bits alone and at another row of batches of 3, 16 and 32."""
    from test_kernels_moe import call_args, make_moe, moe_loop_fp64
    from hunyuan_kernels.moe import cuda as moe_cuda
    from hunyuan_kernels.moe import moe_reference
    t = make_moe(32, shared_inter=shared_inter, dtype=torch.bfloat16, seed=5)
    args = call_args(t, 1, 2, 3, True)
    x, rest = args[0], args[1:]
    assert moe_cuda.decode_fits(*args)
    for n in (20,):          # a second token chunk of 4 rows; 32 rows run in the batch invariance below
        a = (x[:n], *rest)
        got = poisoned(moe_cuda.moe_decode, *a, out=torch.full_like(x[:n], float("nan")))
        truth = moe_loop_fp64(*a)
        assert not got.isnan().any() and rel_err(got, truth) < max(1e-2, 1.5 * rel_err(moe_reference(*a), truth)), n
    alone = moe_cuda.moe_decode(x[:1], *rest)
    for n, row in zip(BATCHES, (1, 9, 30)):
        xb = torch.cat([x[1:row + 1], x[:1], x[row + 1:n]])
        assert torch.equal(poisoned(moe_cuda.moe_decode, xb, *rest)[row], alone[0]), (n, row)


def test_interp_router_is_batch_invariant(mc_mod):
    """The decode router (logits, softmax, top-k, weights) gives a token the same ids and bits at any N <= 32."""
    from hunyuan_kernels.moe import triton_kernels as tk
    g = torch.Generator().manual_seed(3)
    x = torch.randn(32, 600, generator=g).bfloat16()               # 2 hidden splits, the last partial
    gate = torch.randn(16, 600, generator=g) * 600 ** -0.5
    w0, ids0, _ = tk.router_select(tk.router_logits(x[:1], gate), 4, True, plan=False)
    for n in (3, 17, 32):
        xb = torch.cat([x[1:n], x[:1]])
        w, ids, active = tk.router_select(tk.router_logits(xb, gate), 4, True, plan=False)
        assert torch.equal(ids[-1], ids0[0]) and torch.equal(w[-1], w0[0]), n
        assert active.shape == (min(16, n * 4),)
        assert active[active >= 0].tolist() == sorted(set(ids.reshape(-1).tolist()))
    with pytest.raises(ValueError, match="N <= 32"):
        tk.router_select(torch.zeros(1, 33, 16), 4, True, plan=False)


# ----------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
skip_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GPU_CASES = {  # name: (experts fmt, shared fmt, inter, micros, micro_start, micro_count)
    "tp1_mxfp4": ("mxfp4", "mxfp8", 3072, 1, 0, 1),
    "tp1_mxfp8": ("mxfp8", "mxfp8", 3072, 1, 0, 1),
    "tp1_nvfp4": ("nvfp4", "nvfp4", 3072, 1, 0, 1),
    "tp1_fp8": ("fp8", "fp8", 3072, 1, 0, 1),
    "hybrid4_mxfp4": ("mxfp4", "mxfp8", 768, 2, 0, 2),
    "hybrid4_mxfp8_bf16_shared": ("mxfp8", "bf16", 768, 2, 1, 1),
    "hybrid4_fp8_two_micros": ("fp8", "fp8", 768, 2, 0, 2),
}


def _gpu_args(name, n, seed=0):
    fmt, sfmt, inter, micros, ms, mc = GPU_CASES[name]
    t = make_qmoe(n, fmt, sfmt, hidden=4096, experts=64, inter=inter, shared_inter=inter, micros=micros,
                  inverse=fmt == "nvfp4", device="cuda", seed=seed)
    return qargs(t, ms, mc, topk=8)


def batched_cuda(*args, out=None):
    """The op on its `batched` variant, asserted to have run."""
    with kernels.allowed("batched"):
        got = kernels.call("moe_quant", *args, **({} if out is None else {"out": out}))
    assert kernels.chosen("moe_quant") == "batched"
    return got


@gpu
@skip_no_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
@pytest.mark.parametrize("n", [1, 5, 16, 32])
def test_gpu_batched_matches_reference(name, n):
    from test_kernels_gemv import fp8_decode_semantics
    args = _gpu_args(name, n, seed=len(name) + n)
    with kernels.allowed():
        ref = kernels.call("moe_quant", *args)
    got = poisoned(batched_cuda, *args, out=torch.full_like(args[0], float("nan")))
    assert not got.isnan().any()
    if GPU_CASES[name][0] == "fp8":
        assert rel_err(got, fp8_decode_semantics(*args)) < 5e-3
        assert rel_err(got, ref) < 5e-2
    else:
        assert rel_err(got, ref) < 1e-2


@gpu
@skip_no_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_batched_is_batch_invariant(name):
    args = _gpu_args(name, 32, seed=3)
    x, rest = args[0], args[1:]
    alone = batched_cuda(x[:1], *rest)
    for n, row in zip(BATCHES, (2, 9, 31)):
        xb = torch.cat([x[1:row + 1], x[:1], x[row + 1:n]])
        assert torch.equal(batched_cuda(xb, *rest)[row], alone[0]), (n, row)
    whole = batched_cuda(x, *rest)
    for t in range(32):
        assert torch.equal(whole[t], batched_cuda(x[t:t + 1], *rest)[0]), t


@gpu
@skip_no_cuda
@pytest.mark.parametrize("name", list(GPU_CASES))
def test_gpu_the_chosen_variant_is_batch_invariant_to_the_servers_batch(name):
    """What serving runs: the op as the registry picks it (the GEMV `decode` up to its 8 rows, the CUDA
    server's --max-batch) gives each token alone what it gives in a batch of 2..8."""
    from engine.serve.engine_config import SERVING_MAX_BATCH
    args = _gpu_args(name, SERVING_MAX_BATCH, seed=7)
    x, rest = args[0], args[1:]
    alone = [kernels.call("moe_quant", x[t:t + 1], *rest)[0] for t in range(len(x))]
    chosen = kernels.chosen("moe_quant")
    for n in range(2, len(x) + 1):
        got = kernels.call("moe_quant", x[:n], *rest)
        assert kernels.chosen("moe_quant") == chosen, (n, kernels.chosen("moe_quant"), chosen)
        for t in range(n):
            assert torch.equal(got[t], alone[t]), (chosen, n, t)


@gpu
@skip_no_cuda
@pytest.mark.parametrize("name", ["tp1_mxfp4", "tp1_mxfp8", "hybrid4_mxfp4"])
def test_gpu_batched_on_dot_scaled_matches_reference_and_is_batch_invariant(name):
    """The SCALED tile key on the hardware (Triton's own MX upcast before the MMA): the reference's result at
    1 and 16 rows, and each of 16 tokens the same bits alone."""
    from hunyuan_kernels.quant import moe_cuda, triton_kernels as qt
    tiles = dict(up=dict(qt.EDECODE_UP, SCALED=True), down=dict(qt.EDECODE_DOWN, SCALED=True))
    args = _gpu_args(name, 16, seed=21)
    with kernels.allowed():
        ref = kernels.call("moe_quant", *args)
    got = poisoned(moe_cuda.moe_quant_batched, *args, out=torch.full_like(args[0], float("nan")), tiles=tiles)
    assert not got.isnan().any() and rel_err(got, ref) < 1e-2
    for t in range(16):
        assert torch.equal(got[t], moe_cuda.moe_quant_batched(args[0][t:t + 1], *args[1:], tiles=tiles)[0]), t


@gpu
@skip_no_cuda
@pytest.mark.parametrize("name", ["tp1_mxfp4", "hybrid4_fp8_two_micros"])
def test_gpu_batched_cuda_graph_replay_equals_eager(name):
    args = _gpu_args(name, 16, seed=5)
    x_static = args[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        batched_cuda(x_static, *args[1:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = batched_cuda(x_static, *args[1:])
    for seed in (11, 12):
        fresh = _gpu_args(name, 16, seed=seed)[0]
        x_static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, batched_cuda(fresh, *args[1:]))


@gpu
@skip_no_cuda
def test_gpu_bf16_decode_is_batch_invariant_to_32_rows():
    """The `moe` op's decode variant at a hybrid4 rank's shapes: the reference's result at 32 rows, and
    every token of 32 the same bits alone (the registry picks decode up to 32 rows)."""
    from test_kernels_moe import call_args, make_moe
    t = make_moe(32, hidden=4096, experts=64, inter=768, shared_inter=768, micros=2, dtype=torch.bfloat16,
                 device="cuda", seed=4)
    args = call_args(t, 0, 2, 8, True)
    x, rest = args[0], args[1:]
    with kernels.allowed("decode"):
        whole = kernels.call("moe", *args)
        assert kernels.chosen("moe") == "decode"
        for t_ in range(32):
            assert torch.equal(whole[t_], kernels.call("moe", x[t_:t_ + 1], *rest)[0]), t_
        for n, row in zip(BATCHES, (2, 9, 31)):
            xb = torch.cat([x[1:row + 1], x[:1], x[row + 1:n]])
            assert torch.equal(kernels.call("moe", xb, *rest)[row], whole[0]), (n, row)
    with kernels.allowed():
        ref = kernels.call("moe", *args)
    assert rel_err(whole, ref) < 1e-2
