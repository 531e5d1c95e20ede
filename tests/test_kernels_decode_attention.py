"""hunyuan_kernels/decode_attention.py: attention of the last T queries over the valid prefix of a static KV
cache, its length a device tensor.

CPU: the reference (and the masked whole-cache form the reference takes off the CPU) against a naive
fp64 masked softmax; the engine's static decode step through the op equals the sliced step. Triton
interpreter (child pytest): the split-KV kernels on small shapes (GQA, 1 / 17 / L valid keys, several
chunks, head-slice views of a bigger cache, NaN past `length`, causal T > 1). Compile: every kernel
variant builds for sm_90. GPU (`-m gpu`): the real AR shapes, the Triton backend asserted chosen, and a
captured graph replayed at a new length.
"""
from __future__ import annotations

import math

import pytest
import torch
from kernel_support import INTERPRETED, interpreted, run_interpreter_suite

import hunyuan_kernels as kernels
from hunyuan_kernels import decode_attention as da

TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


def naive(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, n: int) -> torch.Tensor:
    """fp64 softmax(q k^T / sqrt(D)) v over keys [0, n), query t at index n - T + t seeing keys <= it."""
    B, Hq, T, D = q.shape
    G = Hq // k.shape[1]
    k = k[:, :, :n].double().repeat_interleave(G, 1)
    v = v[:, :, :n].double().repeat_interleave(G, 1)
    s = q.double() @ k.transpose(-1, -2) / math.sqrt(D)
    at = n - T + torch.arange(T, device=q.device)
    s = s.masked_fill(torch.arange(n, device=q.device)[None, :] > at[:, None], float("-inf"))
    return s.softmax(-1) @ v


def inputs(B, Hkv, G, T, D, L, dtype, device="cpu", seed=0, view=False):
    """q [B, Hkv*G, T, D] and a cache [B, Hkv, L, D]; with `view`, head and batch slices of a bigger
    cache (strided, as the engine's `KVCache.heads` / `rows` views)."""
    g = torch.Generator(device).manual_seed(seed)
    q = torch.randn(B, Hkv * G, T, D, generator=g, device=device).to(dtype)
    if view:
        big = torch.randn(2, B + 1, Hkv * 2 + 1, L + 5, D, generator=g, device=device).to(dtype)
        k, v = big[0, 1:, 1:1 + 2 * Hkv:2, :L], big[1, :B, Hkv:2 * Hkv, 3:L + 3]
        assert not k.is_contiguous() and not v.is_contiguous()
    else:
        k = torch.randn(B, Hkv, L, D, generator=g, device=device).to(dtype)
        v = torch.randn(B, Hkv, L, D, generator=g, device=device).to(dtype)
    return q, k, v


def check(out: torch.Tensor, q, k, v, n: int) -> None:
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all(), "NaN/inf in the output (an element left unwritten, or a key past length read?)"
    tol = TOL[q.dtype]
    torch.testing.assert_close(out.double(), naive(q, k, v, n), rtol=tol, atol=tol)


# ---- CPU: the reference -----------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,T", [(1, 1), (4, 1), (4, 3), (8, 8)])
@pytest.mark.parametrize("n", [8, 17, 40])
def test_reference_is_masked_softmax(dtype, G, T, n):
    q, k, v = inputs(2, 2, G, T, 64, 40, dtype, view=True, seed=n)
    for length in (torch.tensor([n]), torch.tensor(n)):          # shape [1] or []
        check(da.decode_attention_ref(q, k, v, length), q, k, v, n)
        check(da.masked_whole_cache(q, k, v, length), q, k, v, n)   # the reference off the CPU
    check(kernels.call("decode_attention", q, k, v, torch.tensor([n])), q, k, v, n)
    assert kernels.chosen("decode_attention") == "torch"


def check_rows(out, q, k, v, lengths: list[int]) -> None:
    """Each row against itself alone at its own length."""
    assert out.shape == q.shape
    for b, n in enumerate(lengths):
        check(out[b:b + 1], q[b:b + 1], k[b:b + 1], v[b:b + 1], n)


@pytest.mark.parametrize("view", [False, True])
def test_reference_with_a_length_per_row(view):
    """A decode step batching requests: row b attends to its own [0, length[b])."""
    q, k, v = inputs(3, 2, 4, 1, 64, 40, torch.float32, view=view, seed=3)
    lengths = [1, 40, 17]
    check_rows(kernels.call("decode_attention", q, k, v, torch.tensor(lengths)), q, k, v, lengths)
    check_rows(da.masked_whole_cache(q, k, v, torch.tensor(lengths)), q, k, v, lengths)   # the reference off the CPU


def test_reference_ignores_keys_past_length():
    q, k, v = inputs(1, 2, 4, 1, 64, 37, torch.float32)
    want = da.decode_attention_ref(q, k, v, torch.tensor([17]))
    k[:, :, 17:], v[:, :, 17:] = float("nan"), 1e30
    assert torch.equal(da.decode_attention_ref(q, k, v, torch.tensor([17])), want)


def test_static_decode_step_through_the_op_equals_sliced(tiny, monkeypatch):
    """The decode step's attention (device lengths, one per row, static cache bound, no mask) goes through
    the op over the whole static cache of each layer, and equals the sliced CPU forward, token after token."""
    from engine.model.attention import KVCache
    from engine.parallel.layout import PhaseView
    from engine.runtime.decode_step import DecodeStep
    from engine.runtime.graphs import Graphs
    from engine.runtime.sequence import text_phase_sequence, user_turn
    from engine_drive import run_backbone
    model, tok, c = tiny.model, tiny.tok, tiny.cfg
    seq = text_phase_sequence(user_turn(tok, "", "a small green triangle", []), "think", 256)
    L = len(seq)
    T = seq.tensors(length=L + 16)
    cache = KVCache.allocate(c.num_layers, 1, c.num_kv_heads, L + 17, c.head_dim, model.dtype, "cpu")
    sliced_cache = KVCache.allocate(c.num_layers, 1, c.num_kv_heads, L + 16, c.head_dim, model.dtype, "cpu")
    view = PhaseView()
    step = DecodeStep(model, cache, T["pos"][None], view, Graphs(), ())
    lengths = []
    real = kernels.call

    def recording(op, *a, **kw):
        if op == "decode_attention":
            assert a[1] is step._views[1].k[len(lengths) % c.num_layers]     # the whole static cache of the layer
            lengths.append(a[3].tolist())
        return real(op, *a, **kw)
    words = tok.encode(" red circle")
    with torch.no_grad():
        for kv in (cache, sliced_cache):
            run_backbone(model, model.transformer.embed(T["ids"][None]), torch.arange(L), T["pos"], T["blocks"], kv, L,
                         view)
        for s, t in enumerate(words):
            x = model.transformer.embed(torch.tensor([[t]]))
            h = run_backbone(model, x, torch.tensor([L + s]), T["pos"], T["blocks"], sliced_cache, L + s + 1, view,
                             masked=False)
            sliced = model.transformer.logits(h[:, -1], view)[0]
            monkeypatch.setattr(kernels, "call", recording)
            static = step([(0, t, L + s)])[0]
            monkeypatch.setattr(kernels, "call", real)
            assert (static - sliced).abs().max().item() <= 1e-5
    assert lengths == [[L + s + 1] for s in range(len(words)) for _ in range(c.num_layers)]


def _attention_decode(device, dtype, heads, kv, D, L, n, seed=0):
    """One engine `Attention` layer decoding the token at index n - 1 over a cache whose first n - 1
    slots are filled: (the device-length batch's output, the sliced batch's output, the op's backend)."""
    from engine.model.attention import Attention, AttnBatch, KVCache
    from engine.model.layers import rope_angles
    from engine.parallel.layout import PhaseView
    g = torch.Generator(device).manual_seed(seed)
    H = 256
    attn = Attention(H, heads, kv, D, 1e-5, micros=1, storage_size=1, dtype=dtype, device=device)
    with torch.no_grad():
        for p in attn.parameters():
            p.copy_(torch.randn(p.shape, generator=g, device=device) * 0.1 + (1 if p.dim() == 1 else 0))
    x = torch.randn(1, 1, H, generator=g, device=device).to(dtype)
    index = torch.tensor([n - 1], device=device)
    cos, sin = rope_angles(torch.stack([index, index], 1), D, 10000.0)
    outs = []
    for dev_len in (True, False):
        cache = KVCache.allocate(1, 1, kv, L, D, dtype, device)
        torch.manual_seed(seed)
        cache.k[0][:, :, :n - 1] = torch.randn(1, kv, n - 1, D).to(device, dtype)
        cache.v[0][:, :, :n - 1] = torch.randn(1, kv, n - 1, D).to(device, dtype)
        cache.k[0][:, :, n:] = 1e4              # stale slots past the token: must not count
        batch = (AttnBatch(index, cos, sin, L, None, kv_len_dev=torch.tensor([n], device=device)) if dev_len
                 else AttnBatch(index, cos, sin, n, None))
        with torch.no_grad():
            outs.append(attn(x, batch, cache, 0, PhaseView()))
        if dev_len:
            impl = kernels.chosen("decode_attention")
    return outs[0], outs[1], impl


def test_attention_with_a_device_length_equals_sliced():
    for n in (1, 9, 30):
        fast, sliced, impl = _attention_decode("cpu", torch.float32, 8, 2, 16, 32, n)
        assert impl == "torch"
        torch.testing.assert_close(fast, sliced, rtol=1e-5, atol=1e-5)


# ---- Triton interpreter (CPU) -----------------------------------------------------------------------

def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.fixture
def interpreter():
    interpreted()


@pytest.mark.parametrize("B,D,L,n,view", [(1, 64, 37, 1, False), (2, 64, 37, 17, True), (1, 128, 37, 37, False),
                                          (2, 128, 130, 1, True), (1, 64, 130, 17, False), (1, 128, 130, 130, True)])
def test_interp_decode_attention(interpreter, B, D, L, n, view):
    q, k, v = inputs(B, 2, 4, 1, D, L, torch.bfloat16, view=view, seed=n + L)
    check(da.launch(q, k, v, torch.tensor([n])), q, k, v, n)


def test_interp_decode_attention_with_a_length_per_row(interpreter):
    q, k, v = inputs(3, 2, 4, 1, 64, 130, torch.bfloat16, view=True, seed=11)
    lengths = [130, 1, 65]
    check_rows(da.launch(q, k, v, torch.tensor(lengths)), q, k, v, lengths)


@pytest.mark.parametrize("chunk,block_n", [(32, 16), (16, 16)])
def test_interp_many_chunks(interpreter, chunk, block_n):
    """Several chunks per row, and (chunk 16, L 600: 38 chunks) more than one combine block of splits;
    a length past L reads as L."""
    q, k, v = inputs(1, 2, 4, 1, 64, 600, torch.float16, seed=chunk)
    for n in (1, 31, 33, 517, 600):
        check(da.launch(q, k, v, torch.tensor([n]), chunk=chunk, block_n=block_n), q, k, v, n)
    check(da.launch(q, k, v, torch.tensor([10 ** 6]), chunk=chunk, block_n=block_n), q, k, v, 600)


def test_interp_never_reads_past_length(interpreter):
    q, k, v = inputs(1, 2, 4, 1, 64, 130, torch.bfloat16, seed=3)
    for n in (1, 17, 64, 65):
        kp, vp = k.clone(), v.clone()
        kp[:, :, n:], vp[:, :, n:] = float("nan"), float("inf")
        out = da.launch(q, kp, vp, torch.tensor(n), chunk=64, block_n=32)
        check(out, q, k, v, n)
        assert torch.equal(out, da.launch(q, k, v, torch.tensor(n), chunk=64, block_n=32))


@pytest.mark.parametrize("G,T,n", [(4, 3, 3), (4, 3, 70), (2, 8, 130), (8, 2, 17)])
def test_interp_causal_queries(interpreter, G, T, n):
    q, k, v = inputs(1, 2, G, T, 64, 130, torch.bfloat16, view=True, seed=G * T)
    check(da.launch(q, k, v, torch.tensor([n]), chunk=64, block_n=32), q, k, v, n)


# ---- compile for the GPU (CPU machine) --------------------------------------------------------------

def _sm90_compile(fn, sig: dict, const: dict, num_warps: int, num_stages: int | None = None):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**sig, **{k: "constexpr" for k in const}}
    opts = {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                          options=opts)


@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU")
def test_kernels_compile_for_hopper():
    """The variants the op launches (G 1..8, T 1..8, D 64..256, bf16/fp16) build to sm_90 cubins."""
    pytest.importorskip("triton")
    try:
        from triton.backends import backends
        assert "nvidia" in backends
    except (ImportError, AssertionError):
        pytest.skip("Triton has no NVIDIA backend here")
    i32 = "i32"
    part = dict(m_ptr="*fp32", l_ptr="*fp32", acc_ptr="*fp32")
    for dt, G, T, D in (("bf16", 4, 1, 128), ("bf16", 4, 1, 64), ("fp16", 8, 8, 128), ("bf16", 1, 1, 256),
                        ("bf16", 8, 1, 128)):
        p = f"*{dt}"
        _sm90_compile(da._split_kernel, dict(
            q_ptr=p, k_ptr=p, v_ptr=p, len_ptr="*i64", **part, KV=i32, L=i32, n_splits=i32, qk_scale="fp32",
            stride_qb=i32, stride_qh=i32, stride_qt=i32, stride_kb=i32, stride_kh=i32, stride_kl=i32,
            stride_vb=i32, stride_vh=i32, stride_vl=i32, stride_len=i32),
            dict(G=G, T=T, D=D, BLOCK_M=max(da.MIN_ROWS, 1 << (G * T - 1).bit_length()), BLOCK_N=da.BLOCK_N,
                 CHUNK=da.CHUNK, UPCAST=False), 4, 2)
        _sm90_compile(da._combine_kernel, dict(**part, len_ptr="*i64", out_ptr=p, KV=i32, L=i32, n_splits=i32,
                                               stride_len=i32),
                      dict(G=G, T=T, D=D, CHUNK=da.CHUNK, BLOCK_S=32), 4)


# ---- CUDA -------------------------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _poison_pool(*nbytes: int) -> None:
    """0xFF bytes (NaN in every float dtype) into freed blocks of the caching allocator, so an output
    or scratch element left unwritten reads NaN."""
    bufs = [torch.full((n,), 255, dtype=torch.uint8, device="cuda") for n in nbytes]
    del bufs


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("Hq,Hkv", [(32, 8), (8, 2)])
@pytest.mark.parametrize("L", [2017, 8192])
@pytest.mark.parametrize("view", [False, True])
def test_gpu_real_shapes(Hq, Hkv, L, view):
    dt = torch.bfloat16
    q, k, v = inputs(1, Hkv, Hq // Hkv, 1, 128, L, dt, "cuda", seed=L + Hq, view=view)
    for n in (1, 1251, 2017):
        _poison_pool(Hq * 128 * 2, Hkv * -(-L // da.CHUNK) * (Hq // Hkv) * 128 * 4)
        length = torch.tensor([n], device="cuda")
        out = kernels.call("decode_attention", q, k, v, length)
        assert kernels.chosen("decode_attention") == "triton"
        check(out, q, k, v, n)
        ref = da.decode_attention_ref(q, k, v, length)        # cuda: the masked whole-cache SDPA
        torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dt], atol=TOL[dt])


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("B", [3, 16])
def test_gpu_length_per_row(B):
    """A decode step batching B requests at the real AR shape: each row its own prefix."""
    q, k, v = inputs(B, 8, 4, 1, 128, 2017, torch.bfloat16, "cuda", seed=B, view=True)
    lengths = [1 + (b * 397) % 2017 for b in range(B)]
    out = kernels.call("decode_attention", q, k, v, torch.tensor(lengths, device="cuda"))
    assert kernels.chosen("decode_attention") == "triton"
    check_rows(out, q, k, v, lengths)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("G,T", [(4, 1), (4, 4), (8, 8), (1, 1)])
def test_gpu_gqa_and_causal_queries(dt, G, T):
    q, k, v = inputs(2, 2, G, T, 128, 777, dt, "cuda", seed=G * 10 + T, view=True)
    for n in (T, 129, 777):
        check(kernels.call("decode_attention", q, k, v, torch.tensor([n], device="cuda")), q, k, v, n)
        assert kernels.chosen("decode_attention") == "triton"


def _capture(fn):
    """fn() warmed up on a side stream (compiles outside the capture), then captured: (graph, output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_at_a_new_length():
    """Captured once at one length, replayed after the length tensor changes in place: the new prefix."""
    dt = torch.bfloat16
    q, k, v = inputs(1, 8, 4, 1, 128, 2017, dt, "cuda", seed=5)
    length = torch.tensor([300], device="cuda")
    graph, out = _capture(lambda: kernels.call("decode_attention", q, k, v, length))
    assert kernels.chosen("decode_attention") == "triton"
    for n in (1251, 1, 2017, 300):
        length.fill_(n)
        graph.replay()
        torch.cuda.synchronize()
        check(out, q, k, v, n)
        assert torch.equal(out, kernels.call("decode_attention", q, k, v, length))   # graph == eager


@pytest.mark.gpu
@needs_cuda
def test_gpu_fallback_captures_too():
    """Shapes the kernels do not take (the test models' head_dim 32, fp32) run the masked whole-cache
    reference, which also captures and follows the length tensor."""
    for dt, D in ((torch.bfloat16, 32), (torch.float32, 128)):
        q, k, v = inputs(1, 2, 4, 1, D, 100, dt, "cuda", seed=D)
        length = torch.tensor([40], device="cuda")
        graph, out = _capture(lambda: kernels.call("decode_attention", q, k, v, length))
        length.fill_(77)
        graph.replay()
        torch.cuda.synchronize()
        tol = 2e-2 if dt == torch.bfloat16 else 1e-4
        torch.testing.assert_close(out.double(), naive(q, k, v, 77), rtol=tol, atol=tol)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("heads,kv", [(32, 8), (8, 2)])
def test_gpu_engine_attention_through_the_op(heads, kv):
    """The engine's attention layer at the real head shape decodes through the Triton op and equals the
    sliced SDPA step."""
    for n in (1, 1251, 2017):
        fast, sliced, impl = _attention_decode("cuda", torch.bfloat16, heads, kv, 128, 2017, n, seed=n)
        assert impl == "triton"
        assert torch.isfinite(fast).all()
        rel = ((fast.float() - sliced.float()).norm() / sliced.float().norm()).item()
        assert rel < 1e-2, rel          # bf16 rounding of two attention orders, through o_proj
