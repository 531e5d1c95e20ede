"""hunyuan_kernels/sampling.py: the radix-select top-k (`topk_desc`) that `sample_device` uses instead of
torch.topk. Under Triton's CPU interpreter on small shapes: the values equal torch.topk's exactly, the
ids are distinct, in range and give the values, on tie-heavy inputs (a few levels, bf16-rounded), -inf
blocks, one value everywhere, k == V; and the whole `sample_device` on them equals `sample_ref` for the
same generator state. Without a GPU: every variant compiles for sm_90. Marked gpu: the same at
V = 133120 with k 1024 and 4096, and the sampler using it (up to TOPK_TRITON_MAX_K)."""
from __future__ import annotations

import pytest
import torch
from kernel_support import INTERPRETED, interpreted, run_interpreter_suite

import hunyuan_kernels as kernels
from hunyuan_kernels import sampling

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _inputs(V: int, seed: int, device: str = "cpu") -> dict[str, torch.Tensor]:
    """Logits as the model's (bf16 values upcast: many exact ties) and harder cases."""
    g = torch.Generator(device).manual_seed(seed)
    bf16 = (torch.randn(V, generator=g, device=device) * 2.5).bfloat16().float()
    levels = torch.tensor([-3.0, -0.0, 0.0, 1.5, 2.0], device=device)
    few = levels[torch.randint(0, 5, (V,), generator=g, device=device)]        # a few values, mostly ties
    padded = bf16.clone()
    padded[V - V // 4:] = float("-inf")                                         # the padded vocabulary
    holes = few.clone()
    holes[V // 5: V // 5 + V // 3] = float("-inf")                              # a -inf block inside
    neg = -torch.rand(V, generator=g, device=device) - 1                        # every value negative
    return {"bf16": bf16, "few levels": few, "-inf padded": padded, "-inf block": holes, "negative": neg,
            "all equal": torch.full((V,), 0.75, device=device), "all -inf": torch.full((V,), float("-inf"),
                                                                                     device=device)}


def check_topk(x: torch.Tensor, k: int, vals: torch.Tensor, idx: torch.Tensor, label: str = "") -> None:
    ref = x.topk(k)
    assert vals.shape == (k,) and idx.shape == (k,) and idx.dtype == torch.long, label
    assert torch.equal(vals, ref.values), label
    assert bool(((idx >= 0) & (idx < x.numel())).all()), label
    assert idx.unique().numel() == k, label
    assert torch.equal(x[idx], vals), label
    kth = vals[-1]
    above = idx[vals > kth]                      # unique as a set: what the pick kernel relies on
    assert torch.equal(above.sort().values, ref.indices[ref.values > kth].sort().values), label
    # equal values in id order (the sort key's low half), the ties at the cut the lowest ids
    same = vals[1:] == vals[:-1]
    assert bool((idx[1:][same] > idx[:-1][same]).all()), label
    tied = (x == kth).nonzero().flatten()
    assert torch.equal(idx[vals == kth], tied[: int((vals == kth).sum())]), label


# ------------------------------------------------------------------- Triton, CPU interpreter

def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.fixture(scope="module")
def interp():
    interpreted()


TIES = ("bf16", "few levels", "-inf padded", "-inf block", "all equal")


@pytest.mark.parametrize("V,ks,chunk,names", [
    (50, (1, 7, 50), 16, None),                                  # every input kind, 4 chunks
    (3000, (1, 64), 512, TIES),
    (3000, (1024,), 512, ("few levels", "-inf block")),          # the interpreter sorts slowly: few cases
    (20000, (1024,), sampling.TOPK_CHUNK, ("-inf padded",)),      # the model's k over its padded vocabulary
])
def test_interp_topk_equals_torch(interp, V, ks, chunk, names):
    for name, x in _inputs(V, seed=V).items():
        if names is not None and name not in names:
            continue
        for k in ks:
            vals, idx = sampling.topk_desc(x, k, chunk=chunk)
            check_topk(x, k, vals, idx, f"{name} V={V} k={k}")


def test_interp_topk_k_equals_v_and_tail_chunk(interp):
    x = _inputs(1000, seed=3)["few levels"]
    check_topk(x, 1000, *sampling.topk_desc(x, 1000, chunk=256), "k == V")
    y = _inputs(257, seed=4)["bf16"]                     # a last chunk of one element
    for k in (1, 100, 257):
        check_topk(y, k, *sampling.topk_desc(y, k, chunk=128), f"tail k={k}")
    z = torch.tensor([float("inf"), 1.0, float("inf"), -float("inf"), 3.0])
    check_topk(z, 3, *sampling.topk_desc(z, 3, chunk=4), "inf")


def test_interp_sample_device_uses_the_topk_and_equals_the_reference(interp, monkeypatch):
    """The draws and the top-p cut of sample_device, now on topk_desc, equal sample_ref's; with ties that
    straddle the top-k cut and groups above it that span the pick kernel's chunks (ids of listed ties)."""
    real, calls = sampling.topk_desc, []
    monkeypatch.setattr(sampling, "topk_desc", lambda x, k: calls.append(k) or real(x, k, chunk=512))
    V, block = 3000, 1024                                # 3 chunks of the pick kernel, 6 of the top-k
    inputs = _inputs(V, seed=0)
    cases = [(name, t, k, p) for name in ("bf16", "few levels", "-inf padded")
             for t, k, p in ((0.6, 64, 0.95), (1.0, 7, 1.0), (1.0, 200, 0.5), (1.0, 64, 0.3))]
    cases.append(("few levels", 0.8, 1024, 0.9))
    for s, (name, t, k, p) in enumerate(cases):      # one draw a case, each its own seed (CI's time)
        logits = inputs[name]
        x = logits / t
        tok, cut = sampling.sample_device(x, k, p, torch.Generator().manual_seed(s), block=block)
        ref = sampling.sample_ref(logits, t, k, p, torch.Generator().manual_seed(s))
        assert int(tok) == int(ref), (name, t, k, p, s)
        if p < 1:
            thr, n_tie = sampling.cut_ref(x, k, p)
            assert (float(cut[0]), int(cut[1])) == (float(thr), int(n_tie)), (name, t, k, p)
    assert len(calls) == len(cases)


# ------------------------------------------------------------------- sm_90 compile (no GPU needed)

@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU")
def test_topk_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    import triton
    from triton.compiler import ASTSource
    try:
        from triton.backends import backends
        from triton.backends.compiler import GPUTarget
        assert "nvidia" in backends
    except (ImportError, AssertionError):
        pytest.skip("Triton has no NVIDIA backend here")

    def compile_(fn, sig, const, num_warps):
        sig = {**sig, **{k: "constexpr" for k in const}}
        triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": num_warps})
    i32 = "i32"
    P = triton.cdiv(133120, sampling.TOPK_CHUNK)
    block_p = sampling.next_pow2(P)
    for level in range(4):
        compile_(sampling._digit_kernel, dict(x_ptr="*fp32", hist_ptr="*i32", V=i32, K=i32, P=i32),
                 dict(LEVEL=level, CHUNK=sampling.TOPK_CHUNK, BLOCK_P=block_p), 8)
    compile_(sampling._compact_kernel, dict(x_ptr="*fp32", hist_ptr="*i32", pack_ptr="*i64", V=i32, K=i32, P=i32),
             dict(CHUNK=sampling.TOPK_CHUNK, BLOCK_P=block_p), 8)
    for block_k in (1024, 4096):
        compile_(sampling._sort_kernel, dict(pack_ptr="*i64", vals_ptr="*fp32", idx_ptr="*i64", K=i32),
                 dict(BLOCK_K=block_k), 16 if block_k >= 2048 else 8)


# ------------------------------------------------------------------- CUDA

V_MODEL = 133120


def _poison_pool(*shapes_dtypes):
    """NaN / all-ones bits in freed blocks of the caching allocator, so that an output element the kernels
    leave unwritten reads garbage (the next allocations of these sizes reuse them)."""
    bufs = [torch.full(s, -1 if not d.is_floating_point else float("nan"), dtype=d, device="cuda")
            for s, d in shapes_dtypes]
    del bufs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [1024, 4096, 1, 50])
def test_gpu_topk_equals_torch_at_the_vocabulary(k):
    for seed in range(3):
        for name, x in _inputs(V_MODEL, seed, "cuda").items():
            _poison_pool(((k,), torch.float32), ((k,), torch.int64), ((4, 33, 256), torch.int32))
            vals, idx = sampling.topk_desc(x, k)
            check_topk(x, k, vals, idx, f"{name} k={k} seed={seed}")
            y = x / 0.6                                   # as sample_device gets it
            check_topk(y, k, *sampling.topk_desc(y, k), f"{name} / 0.6 k={k}")


@pytest.mark.gpu
@needs_cuda
def test_gpu_sample_uses_the_triton_topk_and_equals_torch_topk(monkeypatch):
    """The sampler on topk_desc picks the same token as on torch.topk for the same generator state (the
    same survivors: equal values, the same ids above the k-th), without a host sync."""
    real, calls = sampling.topk_desc, []
    monkeypatch.setattr(sampling, "topk_desc", lambda x, k: calls.append(k) or real(x, k))
    n = 0
    for seed in range(6):
        for name, logits in _inputs(V_MODEL, seed, "cuda").items():
            if name == "all -inf":
                continue
            for t, k, p in ((0.6, 1024, 0.95), (1.0, 4096, 0.99), (0.8, 1024, 1.0), (1.0, 50, 0.5)):
                torch.cuda.set_sync_debug_mode("error")
                try:
                    tok = kernels.call("sample", logits, t, k, p, torch.Generator("cuda").manual_seed(seed))
                finally:
                    torch.cuda.set_sync_debug_mode("default")
                assert kernels.chosen("sample") == ("triton" if k <= sampling.TOPK_TRITON_MAX_K else "triton_torch_topk")
                with kernels.allowed("triton_torch_topk"):
                    ref = kernels.call("sample", logits, t, k, p, torch.Generator("cuda").manual_seed(seed))
                assert kernels.chosen("sample") == "triton_torch_topk"
                assert int(tok) == int(ref), (name, t, k, p, seed)
                n += k <= sampling.TOPK_TRITON_MAX_K
    assert len(calls) == n and n > 0
