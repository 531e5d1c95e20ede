"""The small fused ops of the hot loops (hunyuan_kernels.norm, hunyuan_kernels.rope, hunyuan_kernels.sampling).

CPU: each reference equals the engine's code bit for bit; the sampler's kept set and draws equal
`choose`'s; the Triton kernels run in Triton's interpreter (a subprocess with TRITON_INTERPRET=1).
GPU (`-m gpu`): every Triton kernel against its reference on fresh random inputs at small and real
shapes, CUDA-graph replay equal to eager at the decode sizes, no host sync in the sampler, and the
Triton backend asserted to be the one chosen.
"""
from __future__ import annotations


import pytest
import torch

import hunyuan_kernels as kernels
from kernel_support import INTERPRETED, interpreted, run_interpreter_suite
from hunyuan_kernels import norm, rope, sampling
from engine.model.attention import Attention, AttnBatch, KVCache
from engine.model.layers import RMSNorm, rope_angles
from engine.parallel.layout import PhaseView
from engine.runtime.sampling import SamplingParams


# ---- the engine's code before the ops existed: the oracles the references must equal bit for bit ----

def _rmsnorm_before(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def _apply_rope_before(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rot * sin


def choose(logits, params, generator, allowed=None):
    """The engine's sampler before the `sample` op (temperature, top-k, top-p as the HF warpers, with
    a full-vocabulary sort for top-p)."""
    if allowed is not None:
        return allowed[logits.index_select(0, allowed).argmax()]
    if params.greedy:
        return logits.argmax()
    x = logits / params.temperature
    if 0 < params.top_k < x.numel():
        kth = x.topk(params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = x.sort(descending=False)
        cum = sorted_x.softmax(-1).cumsum(-1)
        drop = cum <= (1 - params.top_p)
        drop[-1] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return torch.multinomial(x.softmax(-1), 1, generator=generator)[0]

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
SMALL_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 2e-5}   # ~2 ulp of each dtype


def close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    assert a.shape == b.shape and a.dtype == b.dtype
    assert torch.isfinite(a).all(), "NaN/inf in the fast path's output (an element left unwritten?)"
    tol = SMALL_TOL[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)
    if dtype != torch.float32:
        # fp32 rounding differences (reduction order, rsqrt, FMA) flip the 16-bit rounding of a few
        # elements at most; a systematic error within the tolerance flips many
        assert (a != b).float().mean() < 0.01, float((a != b).float().mean())


# ---- references vs the engine ---------------------------------------------------------------------

@pytest.mark.parametrize("dtype", FLOATS)
def test_rms_norm_reference_is_the_engine_rmsnorm(dtype):
    torch.manual_seed(0)
    mod = RMSNorm(96, 1e-5, dtype=dtype)
    mod.weight.data.copy_(torch.randn(96) * 0.3 + 1)
    h = (torch.randn(2, 7, 96) * 4).to(dtype)
    for x in (h, h[:, -1]):                       # contiguous rows and the strided last-token view
        assert torch.equal(norm.rms_norm_ref(x, mod.weight.data, 1e-5), _rmsnorm_before(x, mod.weight.data, 1e-5))
        assert torch.equal(mod(x), _rmsnorm_before(x, mod.weight.data, 1e-5))
    a = (torch.randn(2, 7, 96) * 2).to(dtype)
    s = h + a                                     # the decoder layer's `x = x + attn`, then the next norm
    y, s2 = norm.add_rms_norm_ref(h, a, mod.weight.data, 1e-5)
    assert torch.equal(s2, s) and torch.equal(y, _rmsnorm_before(s, mod.weight.data, 1e-5))


def _capture_attention_inputs(monkeypatch, attn, x, batch, cache):
    seen = {}

    def fake_sdpa(q, k, v, attn_mask=None, enable_gqa=False):
        seen["q"] = q
        return torch.zeros_like(q)
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", fake_sdpa)
    attn(x, batch, cache, 0, PhaseView())
    return seen["q"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_qk_norm_reference_is_the_engine_attention(monkeypatch, dtype):
    torch.manual_seed(1)
    B, T, H, heads, kv, D, L = 2, 5, 64, 8, 2, 16, 12
    attn = Attention(H, heads, kv, D, 1e-5, micros=1, storage_size=1, dtype=dtype)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape) * 0.3 + (1 if p.dim() == 1 else 0))
    x = torch.randn(B, T, H).to(dtype)
    index = torch.tensor([3, 1, 7, 8, 0])
    pos = torch.stack([index, (index * 3) % 5], 1)
    cos, sin = rope_angles(pos, D, 10000.0)
    cache = KVCache.allocate(1, B, kv, L, D, dtype, "cpu")
    with torch.no_grad():
        q_engine = _capture_attention_inputs(monkeypatch, attn, x, AttnBatch(index, cos, sin, L, None), cache)
        qkv = torch.nn.functional.linear(x, attn.qkv[0:1].reshape(-1, H)).view(B, T, kv, heads // kv + 2, D)
        qw, kw = attn.q_norm.weight, attn.k_norm.weight
        q, k, v = rope.rope_qk_norm_ref(qkv, cos, sin, qw, kw, 1e-5)
        ck, cv = torch.full_like(cache.k[0], float("nan")), torch.full_like(cache.v[0], float("nan"))
        q2 = rope.rope_qk_norm_cache_ref(qkv, cos, sin, qw, kw, 1e-5, ck, cv, index)
    g = heads // kv
    q_split = qkv[:, :, :, :g].reshape(B, T, kv * g, D).transpose(1, 2)
    q_before = _rmsnorm_before(_apply_rope_before(q_split, cos, sin), qw, 1e-5).to(dtype)
    assert torch.equal(q, q_before) and torch.equal(q2, q_before) and torch.equal(q_engine, q_before)
    assert torch.equal(k, cache.k[0][:, :, index]) and torch.equal(v, cache.v[0][:, :, index])
    assert torch.equal(ck[:, :, index], cache.k[0][:, :, index]) and torch.equal(cv[:, :, index], cache.v[0][:, :, index])
    untouched = torch.ones(L, dtype=torch.bool)
    untouched[index] = False
    assert ck[:, :, untouched].isnan().all() and cv[:, :, untouched].isnan().all()


def test_cpu_chooses_the_references():
    for op in ("rms_norm", "add_rms_norm", "rope_qk_norm", "rope_qk_norm_cache", "sample"):
        for dt in FLOATS:
            assert [i.backend for i in kernels.registry.candidates(op, "cpu", dt)] == ["torch"], op


# ---- sampling vs choose ---------------------------------------------------------------------------

PARAMS = [(0.6, 1024, 0.95), (1.0, 50, 1.0), (0.8, 100, 0.5), (1.0, 0, 1.0), (1.0, 0, 0.9), (0.7, 0, 0.8),
          (1.3, 3000, 0.99), (1.0, 3, 0.1), (1.0, 5000, 0.9), (0.5, 1, 0.9)]


def _choose_probs(monkeypatch, logits, params, seed):
    """choose's final probabilities (what it hands torch.multinomial) and its token."""
    seen = {}
    real = torch.multinomial

    def spy(p, n, generator=None):
        seen["p"] = p
        return real(p, n, generator=generator)
    monkeypatch.setattr(torch, "multinomial", spy)
    tok = choose(logits, params, torch.Generator().manual_seed(seed))
    monkeypatch.setattr(torch, "multinomial", real)
    return seen["p"], tok


def _kept(x, top_k, top_p):
    c = sampling.cut_ref(x, top_k, top_p)
    return torch.ones_like(x, dtype=torch.bool) if c is None else sampling.kept_mask(x, *c)


@pytest.mark.parametrize("temperature,top_k,top_p", PARAMS)
def test_sample_reference_equals_choose_without_ties(monkeypatch, temperature, top_k, top_p):
    """fp32 logits (no equal values): the same kept set, bit-equal probabilities, the same token."""
    V = 4000
    for seed in range(8):
        g = torch.Generator().manual_seed(100 + seed)
        logits = torch.randn(V, generator=g) * 3
        logits[-7:] = float("-inf")               # the padded vocabulary, as the text phase masks it
        params = SamplingParams(temperature, top_k, top_p)
        probs, tok = _choose_probs(monkeypatch, logits, params, seed)
        kept = _kept(logits / temperature, top_k, top_p) & logits.isfinite()
        assert torch.equal(kept, probs > 0)
        x = (logits / temperature).masked_fill(~kept, float("-inf"))
        assert torch.equal(x.softmax(-1), probs)
        mine = sampling.sample_ref(logits, temperature, top_k, top_p, torch.Generator().manual_seed(seed))
        assert mine.dtype == torch.long and mine.dim() == 0 and int(mine) == int(tok)


@pytest.mark.parametrize("temperature,top_k,top_p", PARAMS)
def test_sample_reference_cut_with_ties_matches_choose_count(monkeypatch, temperature, top_k, top_p):
    """bf16-valued logits (many equal values, as the model's): the kept count equals choose's, every
    token above the cut is kept by both, and the kept ties are the highest ids of the tied group."""
    V = 4000
    for seed in range(8):
        logits = (torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16().float()
        probs, _ = _choose_probs(monkeypatch, logits, SamplingParams(temperature, top_k, top_p), seed)
        x = logits / temperature
        kept, theirs = _kept(x, top_k, top_p), probs > 0
        assert int(kept.sum()) == int(theirs.sum())
        if kept.all():
            continue
        thr = x[kept].min()
        assert torch.equal(kept & (x > thr), theirs & (x > thr)) and not (theirs & (x < thr)).any()
        tied = (x == thr).nonzero().flatten()
        n = int(kept[tied].sum())
        assert torch.equal(kept[tied], torch.arange(len(tied)) >= len(tied) - n)


def test_sample_top_k_ties_are_all_kept():
    x = torch.tensor([5.0, 1.0, 3.0, 3.0, 0.0, 3.0, 3.0, 2.0])
    kept = _kept(x, 2, 1.0)                       # the 2nd largest is 3.0: all four 3.0s stay, as in choose
    assert kept.tolist() == [True, False, True, True, False, True, True, False]
    probs = torch.softmax(x.masked_fill(~kept, float("-inf")), -1)
    for seed in range(20):
        assert int(sampling.sample_ref(x, 1.0, 2, 1.0, torch.Generator().manual_seed(seed))) == \
            int(choose(x, SamplingParams(1.0, 2, 1.0), torch.Generator().manual_seed(seed)))
    assert probs[1] == 0


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 0.99])
def test_sample_cut_inside_the_top_k_ties(monkeypatch, top_p):
    """Top-p mass reaching into the group tied at the k-th value, most of it beyond the k listed."""
    x = torch.zeros(64)
    x[10] = 1.0                                   # top_k=3 keeps x[10] and all 63 zeros (the 3rd value is 0)
    probs, _ = _choose_probs(monkeypatch, x, SamplingParams(1.0, 3, top_p), 0)
    kept = _kept(x, 3, top_p)
    n = int(kept.sum())
    assert n == int((probs > 0).sum()) and kept[10]
    zeros = (x == 0).nonzero().flatten()
    assert torch.equal(kept[zeros], torch.arange(63) >= 63 - (n - 1))   # the highest ids of the ties


def test_sample_distribution_matches_choose(monkeypatch):
    """Empirical frequencies of many draws against choose's exact probabilities (chi-square)."""
    logits = torch.tensor([2.0, 1.5, 1.4, 0.3, -1.0, 0.9, 2.2, -3.0, 0.0, 1.1, 0.5, -0.2])
    params = SamplingParams(0.7, 8, 0.9)
    probs, _ = _choose_probs(monkeypatch, logits, params, 0)
    n = 20000
    g = torch.Generator().manual_seed(7)
    counts = torch.zeros(12)
    for _ in range(n):
        counts[sampling.sample_ref(logits, 0.7, 8, 0.9, g)] += 1
    kept = probs > 0
    assert counts[~kept].sum() == 0
    expected = probs[kept] * n
    chi2 = float(((counts[kept] - expected) ** 2 / expected).sum())
    assert chi2 < 30, chi2                        # dof <= 7: p(chi2 > 30) < 1e-4


def test_sample_greedy_and_allowed_equal_choose():
    g = torch.Generator().manual_seed(3)
    for _ in range(5):
        logits = torch.randn(300, generator=g)
        allowed = torch.tensor([5, 17, 40, 41, 299])
        assert int(sampling.sample_ref(logits, 0.6, 1024, 0.95, None, greedy=True)) == \
            int(choose(logits, SamplingParams(greedy=True), None))
        assert int(sampling.sample_ref(logits, 0.6, 1024, 0.95, None, allowed=allowed)) == \
            int(choose(logits, SamplingParams(), None, allowed))


# ---- Triton interpreter (CPU) ---------------------------------------------------------------------

def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.fixture
def rounding_interpreter():
    """bf16 results of the interpreter rounded as on the GPU (see hunyuan_kernels._triton)."""
    interpreted()


@pytest.mark.parametrize("dtype", FLOATS)
def test_interp_norm(rounding_interpreter, dtype):
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(300, generator=g) * 0.3 + 1).to(dtype)
    h = (torch.randn(2, 4, 300, generator=g) * 3).to(dtype)
    for x in (h, h[:, -1], h[0, :3]):
        close(norm.rms_norm_triton(x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5), dtype)
    r = torch.randn(2, 4, 300, generator=g).to(dtype)
    y, s = norm.add_rms_norm_triton(h, r, w, 1e-5)
    y_ref, s_ref = norm.add_rms_norm_ref(h, r, w, 1e-5)
    assert torch.equal(s, s_ref)
    close(y, y_ref, dtype)


def _rope_inputs(B, T, kv, g, D, dtype, device="cpu", seed=0):
    gen = torch.Generator(device).manual_seed(seed)
    qkv = torch.randn(B, T, kv * (g + 2) * D, generator=gen, device=device).to(dtype).view(B, T, kv, g + 2, D)
    pos = torch.randint(0, 64, (T, 2), generator=gen, device=device)
    cos, sin = rope_angles(pos, D, 10000.0)
    qw = (torch.randn(D, generator=gen, device=device) * 0.3 + 1).to(dtype)
    kw = (torch.randn(D, generator=gen, device=device) * 0.3 + 1).to(dtype)
    return qkv, cos, sin, qw, kw


def _check_rope_rows(qkv, qw, kw, dtype, max_len, fast_cache):
    """Per-row positions (a decode step batching requests): cos/sin [B, T, D] and index [B, T]; row b
    equals row b alone through the reference, and only its own cache row's slots are written."""
    B, T, kv, _, D = qkv.shape
    dev = qkv.device
    gen = torch.Generator(dev).manual_seed(B * 100 + T)
    pos = torch.randint(0, 64, (B * T, 2), generator=gen, device=dev)
    cos, sin = (c.view(B, T, D) for c in rope_angles(pos, D, 10000.0))
    index = torch.stack([torch.randperm(max_len, generator=gen, device=dev)[:T] for _ in range(B)])
    ck = torch.full((B, kv, max_len, D), float("nan"), dtype=dtype, device=dev)
    cv = torch.full_like(ck, float("nan"))
    q = fast_cache(qkv, cos, sin, qw, kw, 1e-5, ck, cv, index)
    for b in range(B):
        ckb, cvb = torch.full_like(ck[:1], float("nan")), torch.full_like(cv[:1], float("nan"))
        qb = rope.rope_qk_norm_cache_ref(qkv[b:b + 1], cos[b], sin[b], qw, kw, 1e-5, ckb, cvb, index[b])
        close(q[b:b + 1], qb, dtype)
        close(ck[b:b + 1, :, index[b]], ckb[:, :, index[b]], dtype)
        assert torch.equal(cv[b:b + 1, :, index[b]], cvb[:, :, index[b]])
        rest = torch.ones(max_len, dtype=torch.bool, device=dev)
        rest[index[b]] = False
        assert ck[b, :, rest].isnan().all() and cv[b, :, rest].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rope_reference_with_a_position_per_row(dtype):
    qkv, _, _, qw, kw = _rope_inputs(4, 2, 2, 3, 16, dtype, seed=7)
    _check_rope_rows(qkv, qw, kw, dtype, 11, rope.rope_qk_norm_cache_ref)


def _check_rope(qkv, cos, sin, qw, kw, dtype, max_len, fast, fast_cache):
    B, T, kv, _, D = qkv.shape
    ref = rope.rope_qk_norm_ref(qkv, cos, sin, qw, kw, 1e-5)
    out = fast(qkv, cos, sin, qw, kw, 1e-5)
    for a, b in zip(out, ref):
        close(a, b.contiguous(), dtype)
    assert torch.equal(out[2], ref[2])            # v passes through unchanged
    for parts in (p for p in (2, kv) if p > 1 and kv % p == 0):
        # the Ulysses exchange's send layout: part r = heads [r*h/parts, (r+1)*h/parts), contiguous
        split = fast(qkv, cos, sin, qw, kw, 1e-5, parts)
        for a, b in zip(split, out):
            h = b.shape[1]
            assert a.is_contiguous() and a.shape == (parts, B, h // parts, T, D)
            assert torch.equal(a, b.reshape(B, parts, h // parts, T, D).transpose(0, 1))
    index = torch.randperm(max_len, device=qkv.device)[:T]
    ck = torch.full((B, kv, max_len, D), float("nan"), dtype=dtype, device=qkv.device)
    cv = torch.full_like(ck, float("nan"))
    q = fast_cache(qkv, cos, sin, qw, kw, 1e-5, ck, cv, index)
    close(q, ref[0].contiguous(), dtype)
    close(ck[:, :, index], ref[1], dtype)
    assert torch.equal(cv[:, :, index], ref[2])
    rest = torch.ones(max_len, dtype=torch.bool, device=qkv.device)
    rest[index] = False
    assert ck[:, :, rest].isnan().all() and cv[:, :, rest].isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_interp_rope(rounding_interpreter, dtype):
    for shape in ((2, 5, 2, 4, 16), (1, 1, 3, 1, 8)):
        _check_rope(*_rope_inputs(*shape, dtype), dtype, 9, rope.rope_qk_norm_triton, rope.rope_qk_norm_cache_triton)
    qkv, _, _, qw, kw = _rope_inputs(3, 1, 2, 4, 16, dtype, seed=5)
    _check_rope_rows(qkv, qw, kw, dtype, 9, rope.rope_qk_norm_cache_triton)


def _cut_of(c):
    thr, n = c
    return float(thr), (None if n is None else int(n))


def test_interp_sample(rounding_interpreter):
    V, block = 1000, 128                          # 8 chunks: ties counted across chunks
    cases = [(0.6, 200, 0.95), (1.0, 50, 1.0), (0.8, 100, 0.5), (1.0, 0, 1.0), (1.0, 3, 0.1), (0.5, 1, 0.9)]
    for seed in range(3):
        logits = (torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 3).bfloat16().float()
        for t, k, p in cases:
            x = logits / t
            tok, cut = sampling.sample_device(x, k, p, torch.Generator().manual_seed(seed), block=block)
            assert int(tok) == int(sampling.sample_ref(logits, t, k, p, torch.Generator().manual_seed(seed)))
            if 0 < k < V and p < 1:
                assert (float(cut[0]), int(cut[1])) == _cut_of(sampling.cut_ref(x, k, p))
    small = torch.randn(100, generator=torch.Generator().manual_seed(5)).bfloat16().float()   # one chunk
    tok, cut = sampling.sample_device(small, 20, 0.8, torch.Generator().manual_seed(2), block=block)
    assert int(tok) == int(sampling.sample_ref(small, 1.0, 20, 0.8, torch.Generator().manual_seed(2)))
    assert (float(cut[0]), int(cut[1])) == _cut_of(sampling.cut_ref(small, 20, 0.8))
    # the cut inside a group tied at the k-th value that spans chunks, most of it beyond the k listed
    x = torch.zeros(V)
    x[[3, 500, 998]] = torch.tensor([2.0, 1.0, 0.5])
    for p in (0.3, 0.6, 0.9):
        c = sampling.cut_ref(x, 8, p)
        tok, cut = sampling.sample_device(x, 8, p, torch.Generator().manual_seed(1), block=block)
        assert float(c[0]) == 0.0 and (float(cut[0]), int(cut[1])) == _cut_of(c)
        kept = sampling.kept_mask(x, *c)
        for seed in range(10):
            tok, _ = sampling.sample_device(x, 8, p, torch.Generator().manual_seed(seed), block=block)
            assert kept[tok]
            assert int(tok) == int(sampling.sample_ref(x, 1.0, 8, p, torch.Generator().manual_seed(seed)))


def _sm90_compile(fn, sig: dict, const: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**sig, **{k: "constexpr" for k in const}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU")
def test_triton_kernels_compile_for_hopper():
    """Every kernel variant the ops launch compiles to an sm_90 cubin (Triton's bundled ptxas; no GPU
    needed), so a GPU run does not start with a compile error."""
    pytest.importorskip("triton")
    try:
        from triton.backends import backends
        assert "nvidia" in backends
    except (ImportError, AssertionError):
        pytest.skip("Triton has no NVIDIA backend here")
    i32, f32 = "i32", "fp32"
    for dt in ("bf16", "fp16", "fp32"):
        p = f"*{dt}"
        for res in (False, True):
            _sm90_compile(norm._rms_norm_kernel, dict(
                x_ptr=p, res_ptr=p, w_ptr=p, y_ptr=p, sum_ptr=p, N=i32, stride_x=i32, stride_res=i32, stride_y=i32,
                stride_sum=i32, eps=f32), dict(HAS_RES=res, BLOCK=4096), 8)
        for indexed in (False, True):
            _sm90_compile(rope._rope_qk_norm_kernel, dict(
                qkv_ptr=p, cos_ptr="*fp32", sin_ptr="*fp32", qw_ptr=p, kw_ptr=p, q_ptr=p, k_ptr=p, v_ptr=p,
                index_ptr="*i64" if indexed else p, B=i32, T=i32, KV=i32, KV_P=i32, stride_xb=i32, stride_xt=i32,
                stride_cb=i32, stride_ct=i32, stride_sb=i32, stride_st=i32, stride_ib=i32, stride_kb=i32, stride_kh=i32, stride_kt=i32, stride_vb=i32, stride_vh=i32,
                stride_vt=i32, eps=f32), dict(G=4, D=128, BLOCK_R=16, INDEXED=indexed), 4)
    _sm90_compile(sampling._count_kernel, dict(x_ptr="*fp32", vals_ptr="*fp32", ge_ptr="*i32", eq_ptr="*i32",
                                               V=i32, K=i32), dict(BLOCK=4096), 8)
    for top_k, top_p, block_k in ((True, True, 1024), (True, True, 4096), (True, False, 1024), (False, False, 2)):
        _sm90_compile(sampling._pick_kernel, dict(
            x_ptr="*fp32", q_ptr="*fp32", vals_ptr="*fp32", idx_ptr="*i64" if top_k else "*fp32", ge_ptr="*i32",
            eq_ptr="*i32", best_ptr="*fp32", arg_ptr="*i32", cut_ptr="*fp32", V=i32, K=i32, NCHUNK=i32, cut=f32),
            dict(BLOCK=4096, BLOCK_K=block_k, BLOCK_C=64, TOP_K=top_k, TOP_P=top_p), 8)
    _sm90_compile(sampling._final_kernel, dict(best_ptr="*fp32", arg_ptr="*i32", out_ptr="*i64", N=i32),
                  dict(BLOCK=64), 4)


# ---- CUDA -----------------------------------------------------------------------------------------

def _poison_pool(*shapes_dtypes):
    """Fill freed blocks of the caching allocator with NaN so that an output a kernel leaves unwritten
    reads NaN (the next allocations of these sizes reuse them)."""
    bufs = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del bufs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", FLOATS)
@pytest.mark.parametrize("rows,width", [(1, 4096), (3, 1000), (4098, 4096), (8196, 4096)])
def test_gpu_norms(dtype, rows, width):
    g = torch.Generator("cuda").manual_seed(rows)
    x = (torch.randn(rows, width, generator=g, device="cuda") * 3).to(dtype)
    r = torch.randn(rows, width, generator=g, device="cuda").to(dtype)
    w = (torch.randn(width, generator=g, device="cuda") * 0.3 + 1).to(dtype)
    _poison_pool(((rows, width), dtype))
    close(kernels.call("rms_norm", x, w, 1e-5), norm.rms_norm_ref(x, w, 1e-5), dtype)
    _poison_pool(((rows, width), dtype), ((rows, width), dtype))
    y, s = kernels.call("add_rms_norm", x, r, w, 1e-5)
    assert kernels.chosen("rms_norm") == kernels.chosen("add_rms_norm") == "triton"
    y_ref, s_ref = norm.add_rms_norm_ref(x, r, w, 1e-5)
    assert torch.equal(s, s_ref)
    close(y, y_ref, dtype)
    close(kernels.call("rms_norm", x[:, :width // 2], w[:width // 2], 1e-5),   # strided rows
          norm.rms_norm_ref(x[:, :width // 2], w[:width // 2], 1e-5), dtype)



@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("B,T,kv", [(1, 1, 2), (1, 1, 4), (1, 1, 8), (1, 7, 3), (2, 4098, 2), (1, 8196, 8)])
def test_gpu_rope(dtype, B, T, kv):
    inputs = _rope_inputs(B, T, kv, 4, 128, dtype, "cuda", seed=T)
    _poison_pool(((B, kv * 4, T, 128), dtype), ((B, kv, T, 128), dtype), ((B, kv, T, 128), dtype))
    _check_rope(*inputs, dtype, T + 16,
                lambda *a: kernels.call("rope_qk_norm", *a), lambda *a: kernels.call("rope_qk_norm_cache", *a))
    assert kernels.chosen("rope_qk_norm") == kernels.chosen("rope_qk_norm_cache") == "triton"
    if T <= 7:                            # decode-sized: every row at its own positions
        _check_rope_rows(inputs[0], inputs[3], inputs[4], dtype, T + 16, lambda *a: kernels.call("rope_qk_norm_cache", *a))
        assert kernels.chosen("rope_qk_norm_cache") == "triton"



def _graph_equals_eager(fn, inputs, fresh):
    """Capture fn(*inputs) once, put fresh values into the static inputs, replay: equal to eager."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(*inputs)                           # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(*inputs)
    for t, f in zip(inputs, fresh):
        if isinstance(t, torch.Tensor):
            t.copy_(f)
    graph.replay()
    torch.cuda.synchronize()
    want = fn(*inputs)
    out = out if isinstance(out, tuple) else (out,)
    want = want if isinstance(want, tuple) else (want,)
    for a, b in zip(out, want):
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_equals_eager_at_decode_size():
    dt = torch.bfloat16
    g = torch.Generator("cuda").manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=g, device="cuda").to(dt)
    x, r, w = rnd(1, 4096), rnd(1, 4096), rnd(4096)
    _graph_equals_eager(lambda a, b: kernels.call("rms_norm", a, b, 1e-5), [x, w], [rnd(1, 4096), rnd(4096)])
    _graph_equals_eager(lambda a, b, c: kernels.call("add_rms_norm", a, b, c, 1e-5), [x, r, w],
                        [rnd(1, 4096), rnd(1, 4096), rnd(4096)])
    qkv, cos, sin, qw, kw = _rope_inputs(1, 1, 8, 4, 128, dt, "cuda", seed=1)
    ck = torch.zeros(1, 8, 64, 128, dtype=dt, device="cuda")
    cv = torch.zeros_like(ck)
    index = torch.tensor([5], device="cuda")
    new = _rope_inputs(1, 1, 8, 4, 128, dt, "cuda", seed=2)

    def step(qkv, cos, sin, index):
        return kernels.call("rope_qk_norm_cache", qkv, cos, sin, qw, kw, 1e-5, ck, cv, index), ck.clone(), cv.clone()
    _graph_equals_eager(step, [qkv, cos, sin, index], [new[0], new[1], new[2], torch.tensor([9], device="cuda")])
    assert ck[0, :, 9].abs().sum() > 0            # the replay wrote the new slot



@pytest.mark.gpu
@needs_cuda
def test_gpu_sample_matches_reference_without_host_sync():
    V = 133120
    cases = [(0.6, 1024, 0.95), (1.0, 1024, 1.0), (0.8, 50, 0.5), (1.0, 0, 1.0), (0.6, 4096, 0.99)]
    cut_miss = tok_miss = total = 0
    for seed in range(40):
        g = torch.Generator("cuda").manual_seed(seed)
        logits = (torch.randn(V, generator=g, device="cuda") * 2.5).bfloat16().float()   # ties, as the model's
        logits[-100:] = float("-inf")
        for t, k, p in cases:
            g1, g2 = (torch.Generator("cuda").manual_seed(seed) for _ in range(2))
            torch.cuda.set_sync_debug_mode("error")        # any host read inside the op raises
            try:
                tok = kernels.call("sample", logits, t, k, p, g1)
                ran = kernels.chosen("sample")
                with kernels.allowed():
                    ref = kernels.call("sample", logits, t, k, p, g2)
            finally:
                torch.cuda.set_sync_debug_mode("default")
            assert tok.device.type == "cuda" and tok.dtype == torch.long and tok.dim() == 0
            assert ran == ("triton" if k <= 1024 else "triton_torch_topk"), (k, ran)   # top-k off: the radix variant
            total += 1
            tok_miss += int(tok != ref)
            if 0 < k < V and p < 1:
                x = logits / t
                c = sampling.cut_ref(x, k, p)
                _, cut = sampling.sample_device(x, k, p, torch.Generator("cuda").manual_seed(0))
                cut_miss += int((float(cut[0]), int(cut[1])) != _cut_of(c))
                assert sampling.kept_mask(x, *c)[tok]
    # exp/cumsum round differently in Triton and torch: a cut may move by one token, a near-tie of scores flip
    assert cut_miss <= 2 and tok_miss <= 2, (cut_miss, tok_miss, total)



@pytest.mark.gpu
@needs_cuda
def test_gpu_sample_captures_in_a_graph():
    """The sampler has no host sync and no data-dependent shape: it captures with the request's generator
    registered, and each replay draws new noise."""
    graph = torch.cuda.CUDAGraph()
    if not hasattr(graph, "register_generator_state"):
        pytest.skip("this torch cannot register a generator with a CUDA graph")
    V = 133120
    logits = torch.randn(V, generator=torch.Generator("cuda").manual_seed(0), device="cuda")
    gen = torch.Generator("cuda").manual_seed(1)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            kernels.call("sample", logits, 0.6, 1024, 0.95, gen)
    torch.cuda.current_stream().wait_stream(s)
    graph.register_generator_state(gen)
    with torch.cuda.graph(graph):
        tok = kernels.call("sample", logits, 0.6, 1024, 0.95, gen)
    kept = sampling.kept_mask(logits / 0.6, *sampling.cut_ref(logits / 0.6, 1024, 0.95))
    assert int(kept.sum()) > 20
    drawn = []
    for _ in range(8):
        graph.replay()
        drawn.append(int(tok))
    assert all(kept[t] for t in drawn) and len(set(drawn)) > 1, drawn
