"""The `flashinfer` variants of rms_norm, add_rms_norm, sample and decode_attention (hunyuan_kernels/_flashinfer.py).

CPU: they are registered after the Triton variants (so never chosen by default), offered only where
FlashInfer imports at a supported version, and absent from every op's candidates where it does not.
GPU (`-m gpu`): each variant against its reference at the model's shapes (hidden 4096, vocab 133120,
32 query / 8 KV heads of 128), the registry asserted to have run it, a captured decode step replayed at new
lengths. Where CUDA is there but FlashInfer is not, the GPU tests skip, or fail with
HUNYUAN_REQUIRE_FLASHINFER=1 (the GPU machine's run: `bash bench/device_run.sh flashinfer`).
The bench's FlashInfer side of the `moe` op (bench/suites/flashinfer.py FiMoe: `cutlass_fused_moe`, the
shared MLP as one more expert) against our reference, bf16 and FP8, where its module is built (its JIT
build takes over 9 minutes, so the test never starts it: it skips, even with HUNYUAN_REQUIRE_FLASHINFER=1).
"""
from __future__ import annotations

import os

import pytest
import torch
from test_kernels_decode_attention import naive

import hunyuan_kernels as kernels
from hunyuan_kernels import _flashinfer, decode_attention as da, norm, sampling
from hunyuan_kernels.moe import moe_reference
from hunyuan_kernels.registry import candidates

HIDDEN, VOCAB, HQ, HKV, HEAD_DIM = 4096, 133120, 32, 8, 128
OPS = ("rms_norm", "add_rms_norm", "sample", "decode_attention")
TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3}      # ~2 ulp of each dtype

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


# ---- CPU: where the variants sit and when they are offered -----------------------------------------------

def test_flashinfer_variants_come_after_triton_and_before_the_reference():
    for op in OPS:
        order = kernels.ops()[op]
        assert "flashinfer" in order, (op, order)
        assert order.index("triton") < order.index("flashinfer") < order.index("torch") == len(order) - 1, order


def test_flashinfer_absent_changes_no_candidates():
    if _flashinfer.available():
        pytest.skip("FlashInfer is installed here")
    for op in OPS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            assert "flashinfer" not in [i.backend for i in candidates(op, "cuda", dtype)]


@pytest.mark.parametrize("version,offered", [("0.7.4", True), ("0.7.9.post1", True), ("0.6.18", False),
                                             ("0.8.0", False), ("0.7.3", False), ("unknown", False), (None, False)])
def test_only_the_pinned_versions_are_offered(monkeypatch, version, offered):
    monkeypatch.setattr(_flashinfer, "_dist_version", lambda: version)
    _flashinfer.installed.cache_clear()
    try:
        assert _flashinfer.installed() == (version if offered else None)
    finally:
        _flashinfer.installed.cache_clear()


# ---- GPU ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fi():
    if not _flashinfer.available():
        why = ("flashinfer-python is not installed here at a supported version "
               "(hunyuan_kernels/_flashinfer.py: SUPPORTED)")
        if os.environ.get("HUNYUAN_REQUIRE_FLASHINFER") == "1":
            pytest.fail(why + ", and HUNYUAN_REQUIRE_FLASHINFER=1")
        pytest.skip(why)
    return _flashinfer.lib()


def call(op: str, *args):
    """`op` through the registry with only the flashinfer variant allowed, asserted to be what ran."""
    with kernels.allowed("flashinfer"):
        out = kernels.call(op, *args)
    assert kernels.chosen(op) == "flashinfer", kernels.chosen(op)
    return out


def rounding_apart(a: torch.Tensor, b: torch.Tensor) -> None:
    """FlashInfer rounds x * rstd * weight once where the reference rounds x * rstd, then the product: about
    a quarter of the elements differ (measured on the CPU with that arithmetic), each by a unit in the last
    place of the output dtype (two at most: the reference's two roundings can add up)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.isfinite(a).all()
    torch.testing.assert_close(a.float(), b.float(), rtol=TOL[a.dtype], atol=TOL[a.dtype])
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[a.dtype]
    big = torch.maximum(a.float().abs(), b.float().abs())
    ulp = torch.ldexp(torch.ones_like(big), torch.frexp(big).exponent - 1 - mantissa)
    ulp = ulp.clamp_min(torch.finfo(a.dtype).smallest_normal * 2.0 ** -mantissa)      # subnormals: one step
    assert ((a.float() - b.float()).abs() <= 2 * ulp).all(), float(((a.float() - b.float()).abs() / ulp).max())


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 4, 16, 1251, 4098])
def test_gpu_flashinfer_norms(fi, dtype, rows):
    g = torch.Generator("cuda").manual_seed(rows)
    x = (torch.randn(rows, HIDDEN, generator=g, device="cuda") * 3).to(dtype)
    r = torch.randn(rows, HIDDEN, generator=g, device="cuda").to(dtype)
    w = (torch.randn(HIDDEN, generator=g, device="cuda") * 0.3 + 1).to(dtype)
    x0, r0 = x.clone(), r.clone()
    rounding_apart(call("rms_norm", x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5))
    y, s = call("add_rms_norm", x, r, w, 1e-5)
    y_ref, s_ref = norm.add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(s, s_ref)                       # the carried residual stream: the same numbers
    rounding_apart(y, y_ref)
    assert torch.equal(x, x0) and torch.equal(r, r0)   # the inputs are left alone, as the reference leaves them


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [1, 50, 1024, 2048])
def test_gpu_flashinfer_topk_is_torch_topk(fi, k):
    g = torch.Generator("cuda").manual_seed(k)
    x = (torch.randn(VOCAB, generator=g, device="cuda") * 2.5).bfloat16().float()    # bf16 values: many ties
    vals, idx = sampling.topk_flashinfer(x, k)
    assert torch.equal(vals, x.topk(k).values)
    assert torch.equal(x[idx], vals) and idx.unique().numel() == k


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("temperature,top_k,top_p", [(0.6, 1024, 0.95), (1.0, 1024, 1.0), (0.8, 50, 0.5),
                                                     (0.6, 2048, 0.99)])
def test_gpu_flashinfer_sample_is_the_references_draw(fi, temperature, top_k, top_p):
    """The same generator state gives the reference's token (one miss in 20 allowed: two scores that
    round differently between the kernels and PyTorch)."""
    g = torch.Generator("cuda").manual_seed(top_k)
    logits = (torch.randn(VOCAB, generator=g, device="cuda") * 2.5).bfloat16().float()
    misses = 0
    for seed in range(20):
        got = call("sample", logits, temperature, top_k, top_p, torch.Generator("cuda").manual_seed(seed))
        want = sampling.sample_ref(logits, temperature, top_k, top_p, torch.Generator("cuda").manual_seed(seed))
        misses += int(got != want)
    assert misses <= 1, misses


def _decode_inputs(B: int, L: int, dtype=torch.bfloat16, seed: int = 0):
    g = torch.Generator("cuda").manual_seed(seed)
    q = torch.randn(B, HQ, 1, HEAD_DIM, generator=g, device="cuda").to(dtype)
    k = torch.randn(B, HKV, L, HEAD_DIM, generator=g, device="cuda").to(dtype)
    v = torch.randn(B, HKV, L, HEAD_DIM, generator=g, device="cuda").to(dtype)
    return q, k, v


def _check_rows(out, q, k, v, lengths) -> None:
    for b, n in enumerate(lengths):
        n = min(n, k.shape[2])
        want = naive(q[b:b + 1], k[b:b + 1], v[b:b + 1], n)
        torch.testing.assert_close(out[b:b + 1].double(), want, rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B", [1, 4, 16])
def test_gpu_flashinfer_decode_attention_per_row_lengths(fi, B):
    """A 1251-token prompt + 750 CoT tokens: 2001 keys in a 2048 cache, each row its own length; the keys
    past a row's length hold large values that would show if read."""
    L = 2048
    q, k, v = _decode_inputs(B, L, seed=B)
    lengths = [max(1, 2001 - 97 * b) for b in range(B)]
    if B > 1:
        lengths[1] = L + 100                       # above L reads as L
    for b, n in enumerate(lengths):
        k[b, :, n:] = 30.0
        v[b, :, n:] = 30.0
    length = torch.tensor(lengths, device="cuda")
    out = call("decode_attention", q, k, v, length)
    assert out.shape == q.shape and torch.isfinite(out).all()
    _check_rows(out, q, k, v, lengths)
    shared = call("decode_attention", q, k, v, torch.tensor([1251], device="cuda"))   # one length, every row
    _check_rows(shared, q, k, v, [1251] * B)


@pytest.mark.gpu
@needs_cuda
def test_gpu_flashinfer_decode_graph_replays_at_new_lengths(fi):
    """Captured once (planned before the capture), replayed after the lengths and the query change: the
    plan holds no length."""
    B, L = 4, 2048
    q, k, v = _decode_inputs(B, L, seed=7)
    length = torch.tensor([1251, 1300, 17, 2001], device="cuda")
    call("decode_attention", q, k, v, length)       # plans and compiles outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), kernels.allowed("flashinfer"):
        kernels.call("decode_attention", q, k, v, length)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph), kernels.allowed("flashinfer"):
        out = kernels.call("decode_attention", q, k, v, length)
    assert kernels.chosen("decode_attention") == "flashinfer"
    new_lengths = [2001, 1, 1800, 640]
    length.copy_(torch.tensor(new_lengths, device="cuda"))
    q.copy_(_decode_inputs(B, L, seed=8)[0])
    graph.replay()
    torch.cuda.synchronize()
    _check_rows(out, q, k, v, new_lengths)
    assert torch.equal(out, call("decode_attention", q, k, v, length))
    ref = da.decode_attention_ref(q, k, v, length)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt,tol", [("bf16", 1e-2), ("fp8", 1e-1)])
@pytest.mark.parametrize("n", [1, 37])
def test_gpu_flashinfer_fused_moe_is_our_moe(fi, fmt, tol, n):
    """Router + 8 routed experts + the shared MLP on micro 1 of 2 (the AR phase's single micro), at H 4096
    and I 768 with 16 experts: a swapped gate/up order or a dropped shared expert is far outside `tol`."""
    from bench.checks import rel_err
    from bench.suites import flashinfer as suite
    from bench.suites.kernels_moe import Dims
    if not suite.moe_built():
        pytest.skip("FlashInfer's fused MoE module is not built: bash bench/flashinfer_install.sh warm-bg moe")
    dims = Dims(False)
    dims.E = 16
    inter, micros, ms, mc = dims.decode
    w = dims.weights(inter, micros, seed=n)[0]
    x = dims.tokens_of(n, seed=n + 1)
    want = moe_reference(*dims.args(x, w, ms, mc))
    got = suite.FiMoe(w, ms, inter, dims.K, n, fmt, x)(x)
    assert got.shape == want.shape and torch.isfinite(got).all()
    assert rel_err(got, want) < tol, rel_err(got, want)
