"""The `moe` kernel op: its reference against an independent fp64 per-token loop, its determinism,
the Triton kernels under Triton's CPU interpreter, and (marked gpu) every CUDA path against the
reference on fresh random bf16 inputs."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_support import interpreted, poisoned, rel_err, run_interpreter_suite

import hunyuan_kernels as kernels
from hunyuan_kernels.moe import moe_reference

# ------------------------------------------------------------------------------------ helpers

def make_moe(n, hidden=64, experts=8, inter=32, shared_inter=32, micros=3, dtype=torch.float32,
             device="cpu", seed=0):
    """Random inputs of the op in the engine's layout: gate/up micro-major, the down packs cols-packed
    (scaled so activations stay O(1))."""
    g = torch.Generator(device=device).manual_seed(seed)     # drawn where they live (GPU shapes are GBs)

    def rnd(*shape, scale=1.0, dt=dtype):
        return (torch.randn(*shape, generator=g, device=device) * scale).to(dt)

    return dict(
        x=rnd(n, hidden),
        gate=rnd(experts, hidden, scale=hidden ** -0.5, dt=torch.float32),
        w1=rnd(micros, experts, 2 * inter, hidden, scale=hidden ** -0.5),
        w2=rnd(experts, hidden, micros * inter, scale=inter ** -0.5),
        shared_w1=rnd(micros, 2 * shared_inter, hidden, scale=hidden ** -0.5) if shared_inter else None,
        shared_w2=rnd(hidden, micros * shared_inter, scale=shared_inter ** -0.5) if shared_inter else None,
    )


def call_args(t, micro_start, micro_count, topk, norm_topk):
    return (t["x"], t["gate"], t["w1"], t["w2"], t["shared_w1"], t["shared_w2"], micro_start, micro_count,
            topk, norm_topk)


def moe_loop_fp64(x, gate, w1, w2, shared_w1, shared_w2, micro_start, micro_count, topk, norm_topk):
    """The op written independently: token by token, route by route, micro by micro, in fp64."""
    d = torch.float64
    out = torch.zeros(x.shape, dtype=d)
    inter = w1.shape[2] // 2
    for t in range(x.shape[0]):
        xt = x[t].to(d)
        probs = torch.softmax(gate.to(d) @ xt, dim=0)
        order = sorted(range(probs.numel()), key=lambda e: -probs[e].item())[:topk]
        weights = torch.stack([probs[e] for e in order])
        if norm_topk:
            weights = weights / max(weights.sum().item(), 1e-8)
        for e, we in zip(order, weights):
            y = torch.zeros(x.shape[1], dtype=d)
            for m in range(micro_start, micro_start + micro_count):
                h = w1[m, e].to(d) @ xt
                y += w2[e, :, m * inter:(m + 1) * inter].to(d) @ (h[:inter] * F.silu(h[inter:]))
            out[t] += we * y
        if shared_w1 is not None:
            is_micro = shared_w1.shape[1] // 2
            for m in range(micro_start, micro_start + micro_count):
                h = shared_w1[m].to(d) @ xt
                out[t] += shared_w2[:, m * is_micro:(m + 1) * is_micro].to(d) @ (h[:is_micro] * F.silu(h[is_micro:]))
    return out


# ---------------------------------------------------------------------------- the reference

@pytest.mark.parametrize("n", [1, 23])
@pytest.mark.parametrize("micro_start,micro_count", [(0, 1), (1, 2), (0, 3)])
@pytest.mark.parametrize("norm_topk", [True, False])
@pytest.mark.parametrize("shared", [True, False])
def test_reference_matches_fp64_loop(n, micro_start, micro_count, norm_topk, shared):
    t = make_moe(n, shared_inter=32 if shared else 0, seed=n + 7 * micro_count)
    args = call_args(t, micro_start, micro_count, 3, norm_topk)
    got = moe_reference(*args)
    assert got.dtype == torch.float32 and got.shape == t["x"].shape
    assert rel_err(got, moe_loop_fp64(*args)) < 1e-5


def test_reference_bf16_within_bf16_bounds_and_shared_is_different_width():
    t = make_moe(17, inter=32, shared_inter=48, dtype=torch.bfloat16, seed=3)
    args = call_args(t, 1, 2, 4, True)
    got = moe_reference(*args)
    assert got.dtype == torch.bfloat16
    assert rel_err(got, moe_loop_fp64(*args)) < 1e-2


def test_kernels_call_uses_the_reference_on_cpu():
    for dt in (torch.float32, torch.bfloat16):
        t = make_moe(5, dtype=dt)
        args = call_args(t, 0, 2, 2, True)
        assert torch.equal(kernels.call("moe", *args), moe_reference(*args))
        assert kernels.chosen("moe") == "torch"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_is_bitwise_reproducible(dtype):
    args = call_args(make_moe(41, dtype=dtype, seed=5), 0, 3, 3, True)
    assert torch.equal(moe_reference(*args), moe_reference(*args))


def test_reference_is_per_token_deterministic():
    """A token's result does not depend on where it sits in its batch. In bf16: MKL's fp32 GEMMs on
    CPU are not row-invariant themselves (a row's sum order depends on its position), so in fp32 this
    would test the BLAS, not the op."""
    t = make_moe(41, dtype=torch.bfloat16, seed=5)
    out = moe_reference(*call_args(t, 0, 3, 3, True))
    for seed in (1, 2):
        perm = torch.randperm(41, generator=torch.Generator().manual_seed(seed))
        permuted = dict(t, x=t["x"][perm])
        assert torch.equal(moe_reference(*call_args(permuted, 0, 3, 3, True)), out[perm])
    # and with other tokens in the batch
    alone = dict(t, x=t["x"][:7])
    assert torch.equal(moe_reference(*call_args(alone, 0, 3, 3, True)), out[:7])


def test_reference_agrees_with_the_engine_moe():
    """The engine's MoE module on the same packed weights (its wiring of the op: argument order,
    micro views)."""
    import engine.model.moe as engine_moe
    import engine.parallel.layout as parallel
    t = make_moe(19, hidden=64, experts=8, inter=32, shared_inter=32, micros=2, seed=11)
    mod = engine_moe.MoE(64, 8, 3, 2 * 32, 2 * 32, True, micros=2, storage_size=1)
    with torch.no_grad():
        for name in ("gate", "w1", "w2", "shared_w1", "shared_w2"):
            getattr(mod, name).copy_(t[name])
        for ms, mc in ((0, 2), (1, 1)):
            want = mod(t["x"], parallel.PhaseView(micro_start=ms, micro_count=mc))
            got = moe_reference(*call_args(t, ms, mc, 3, True))
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------- Triton kernels, CPU interpreter



def test_triton_interpreter_suite():
    """The `test_interp_*` tests below need TRITON_INTERPRET=1 before Triton is first imported (its
    own library functions are decorated then), so they run in a child pytest with it set."""
    run_interpreter_suite(__file__)


@pytest.fixture(scope="module")
def interp():
    return interpreted("hunyuan_kernels.moe.cuda")


INTERP_CASES = [  # (n, micro_start, micro_count, shared_inter, variant)
    (1, 0, 1, 32, "decode"), (5, 1, 2, 32, "decode"), (8, 0, 3, 0, "decode"), (6, 1, 2, 48, "decode"),
    (37, 0, 1, 32, "grouped"), (70, 1, 2, 32, "grouped"), (37, 0, 3, 0, "grouped"),
]


@pytest.mark.parametrize("n,micro_start,micro_count,shared_inter,variant", INTERP_CASES)
def test_interp_pipelines(interp, n, micro_start, micro_count, shared_inter, variant):
    t = make_moe(n, shared_inter=shared_inter, dtype=torch.bfloat16, seed=100 + n)
    args = call_args(t, micro_start, micro_count, 3, True)
    out = torch.full_like(t["x"], float("nan"))
    run = interp.moe_decode if variant == "decode" else interp.moe_grouped
    got = poisoned(run, *args, out=out)           # every scratch buffer starts as NaN
    assert got.data_ptr() == out.data_ptr() and not got.isnan().any()
    truth = moe_loop_fp64(*args)
    ref = moe_reference(*args)
    # the fast path keeps intermediates in fp32 where the reference rounds them to bf16
    assert rel_err(got, truth) < max(1e-2, 1.5 * rel_err(ref, truth))


def test_interp_router_and_counting_sort(interp):
    """The routing kernels alone: same experts and weights as the reference router, and the
    counting sort gives exactly the stable argsort permutation of the reference."""
    from hunyuan_kernels.moe import triton_kernels as tk
    t = make_moe(150, experts=16, dtype=torch.bfloat16, seed=9)
    x, gate = t["x"], t["gate"]
    w_ref, idx_ref = kernels.moe.route(x, gate, 4, True)
    w, ids, (rank, counts, block_tokens) = tk.router_select(tk.router_logits(x, gate), 4, True, plan=True)
    assert block_tokens < 150                     # several token blocks
    assert torch.equal(ids.long(), idx_ref)
    torch.testing.assert_close(w, w_ref, rtol=1e-5, atol=1e-6)
    base, offs = tk.route_plan(counts)
    assert torch.equal(offs, torch.bincount(idx_ref.reshape(-1), minlength=16).cumsum(0).int())
    xs = torch.full((150 * 4, x.shape[1]), float("nan"), dtype=x.dtype)
    inv = tk.dispatch(x, ids, rank, base, block_tokens, xs)
    order = idx_ref.reshape(-1).argsort(stable=True)
    assert torch.equal(inv.reshape(-1).long()[order], torch.arange(600))
    assert torch.equal(xs, x[order // 4])
    # humming's expert layout from the same kernel; a second row tensor moved in the same launch
    base2, layout = tk.route_plan(counts, layout=True)
    assert torch.equal(base2, base) and layout.dtype == torch.int64 and torch.equal(layout, F.pad(offs, (1, 0)).long())
    y = torch.arange(150 * 3, dtype=torch.int32).reshape(150, 3)
    xs2, ys = torch.full_like(xs, float("nan")), torch.full((600, 3), -1, dtype=torch.int32)
    assert torch.equal(tk.dispatch(x, ids, rank, base, block_tokens, xs2, y, ys), inv)
    assert torch.equal(xs2, xs) and torch.equal(ys, y[order // 4])
    # decode form: the compact list of chosen experts
    w1_, ids1, active = tk.router_select(tk.router_logits(x[:3], gate), 4, False, plan=False)
    chosen = sorted(set(ids1.reshape(-1).tolist()))
    assert active.tolist() == chosen + [-1] * (12 - len(chosen))
    torch.testing.assert_close(w1_, kernels.moe.route(x[:3], gate, 4, False)[0], rtol=1e-5, atol=1e-6)
    # a token with non-finite logits (an overflowed activation) still gets k distinct experts in range
    xb = x[:40].clone()
    xb[3], xb[7, 5] = float("nan"), float("inf")
    for plan, rows in ((True, 40), (False, 12)):
        _, ids_b, extra = tk.router_select(tk.router_logits(xb[:rows], gate), 4, True, plan=plan)
        assert ids_b.min() >= 0 and ids_b.max() < 16 and all(len(set(r)) == 4 for r in ids_b.tolist())
        if plan:
            assert int(extra[1].sum()) == rows * 4
    # the decode GEMV splits the hidden size (here 3 slices, the last one partial)
    xw = torch.randn(3, 1100, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    gw = torch.randn(16, 1100, generator=torch.Generator().manual_seed(3))
    lg = tk.router_logits(xw, gw)
    assert lg.shape == (3, 3, 16)
    torch.testing.assert_close(lg.sum(0), xw.float() @ gw.T, rtol=1e-5, atol=1e-5)
    # many tokens: the tensor-core form (bf16 x times the fp32 gate's three bf16 parts), split over H:
    # the fp32 logits up to the summation order (a gate of one bf16 part would be ~1e-3 off)
    xm = torch.randn(200, 2048, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    gm = torch.randn(16, 2048, generator=torch.Generator().manual_seed(5))
    lm = tk.router_logits(xm, gm)
    assert lm.shape[0] > 1                        # split over H
    truth = xm.double() @ gm.double().T
    assert ((lm.sum(0).double() - truth).abs().max() / truth.abs().max()).item() < 1e-5


def test_interp_finalize_weights_and_sums_routes_in_fp32(interp):
    from hunyuan_kernels.moe import triton_kernels as tk
    g = torch.Generator().manual_seed(4)
    n, k, h = 6, 3, 40
    part = torch.randn(n * k, h, generator=g).to(torch.bfloat16)
    inv = torch.randperm(n * k, generator=g).int().view(n, k)
    w = torch.rand(n, k, generator=g)
    add = torch.randn(n, h, generator=g).to(torch.bfloat16)
    out = torch.full((n, h), float("nan"), dtype=torch.bfloat16)
    tk.finalize(part, inv, w, add, out)
    want = (part.float()[inv.long()] * w.unsqueeze(-1)).sum(1) + add.float()
    # one bf16 rounding of the fp32 sum (the interpreter truncates where CUDA rounds to nearest)
    assert ((out.float() - want).abs() <= want.abs() * 2 ** -7).all()
    part_only = torch.full((n, h), float("nan"), dtype=torch.float32)
    tk.finalize(part, None, w, None, part_only)           # route order rows, no addend, fp32 out
    torch.testing.assert_close(part_only, (part.float().view(n, k, h) * w.unsqueeze(-1)).sum(1))


def test_interp_swiglu_writes_a_micro_column_block_in_place(interp):
    """The grouped path's SwiGLU of micro i lands in columns [i*I, (i+1)*I) of one [R, micros*I]
    activation buffer (out=, strided rows): the other columns stay untouched."""
    from hunyuan_kernels.moe import triton_kernels as tk
    g = torch.Generator().manual_seed(6)
    r, inter = 7, 24
    h = torch.randn(r, 2 * inter, generator=g).to(torch.bfloat16)
    act = torch.full((r, 3 * inter), float("nan"), dtype=torch.bfloat16)
    got = tk.swiglu(h, out=act[:, inter:2 * inter])
    assert got.data_ptr() == act[:, inter:].data_ptr()
    torch.testing.assert_close(act[:, inter:2 * inter], tk.swiglu(h))
    assert act[:, :inter].isnan().all() and act[:, 2 * inter:].isnan().all()
    torch.testing.assert_close(tk.swiglu(h).float(), kernels.moe.swiglu_halves(h.float()), rtol=1e-2, atol=1e-2)
    with pytest.raises(ValueError, match="swiglu"):
        tk.swiglu(h, out=act[:, :inter + 1])


# ------------------------------------------------------------------------------------ GPU tests

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
GPU_SHAPES = {  # name: (n, hidden, experts, topk, inter, shared_inter, micros, micro_start, micro_count)
    "small": (300, 256, 16, 4, 64, 64, 3, 1, 2),
    "decode_small": (3, 256, 16, 4, 64, 64, 2, 1, 1),
    "hybrid4_denoise": (4098, 4096, 64, 8, 768, 768, 2, 0, 2),
    "hybrid4_prefill": (600, 4096, 64, 8, 768, 768, 2, 1, 1),   # grouped, K 768 of the [E, H, 1536] pack (strided)
    "hybrid4_decode": (1, 4096, 64, 8, 768, 768, 2, 1, 1),
    "decode8": (8, 4096, 64, 8, 768, 768, 2, 0, 1),
    "tp1_denoise": (2000, 4096, 64, 8, 3072, 3072, 1, 0, 1),
}


def _gpu_inputs(name, seed=0):
    n, h, e, k, i, si, micros, ms, mc = GPU_SHAPES[name]
    t = make_moe(n, hidden=h, experts=e, inter=i, shared_inter=si, micros=micros, dtype=BF16, device="cuda",
                 seed=seed)
    return call_args(t, ms, mc, k, True)


def _fast(args, variant=None):
    """The op through the registry (only `variant` allowed, when given) on poisoned scratch; asserts a
    CUDA variant ran (that one, when given)."""
    out = torch.full_like(args[0], float("nan"))
    with kernels.allowed(*((variant,) if variant else ("decode", "fused", "grouped"))):
        got = poisoned(kernels.call, "moe", *args, out=out)
    assert kernels.chosen("moe") == (variant or ("decode" if args[0].shape[0] <= 8 else "fused"))
    return got


@gpu
@pytest.mark.parametrize("name", list(GPU_SHAPES))
@pytest.mark.parametrize("variant", ["decode", "fused", "grouped"])
def test_gpu_variants_match_reference(name, variant):
    args = _gpu_inputs(name, seed=len(name) + len(variant))
    if variant == "decode" and args[0].shape[0] > 8:
        pytest.skip("the decode variant takes at most 8 tokens (decode_fits)")
    with kernels.allowed():
        ref = kernels.call("moe", *args)
    got = _fast(args, variant)
    assert not got.isnan().any()
    assert rel_err(got, ref) < 1e-2


@gpu
def test_gpu_default_variants_by_size():
    """The registry's order: decode up to 8 tokens, the fused grouped path above."""
    for name, want in (("decode8", "decode"), ("hybrid4_prefill", "fused")):
        kernels.call("moe", *_gpu_inputs(name))
        assert kernels.chosen("moe") == want, name


@gpu
@pytest.mark.parametrize("name", ["small", "decode_small", "hybrid4_denoise", "hybrid4_decode"])
def test_gpu_fast_path_bitwise_reproducible_and_per_token(name):
    args = _gpu_inputs(name, seed=3)
    a, b = _fast(args), _fast(args)
    assert torch.equal(a, b)
    n = args[0].shape[0]
    perm = torch.randperm(n, device="cuda")
    assert torch.equal(_fast((args[0][perm],) + args[1:]), a[perm])


@gpu
@pytest.mark.parametrize("name", ["decode_small", "hybrid4_decode", "decode8"])
def test_gpu_decode_cuda_graph_replay_equals_eager(name):
    args = _gpu_inputs(name, seed=5)
    x_static = args[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm up (compile) outside the capture
        kernels.call("moe", x_static, *args[1:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.call("moe", x_static, *args[1:])
    for seed in (11, 12):                         # new tokens copied in, replayed, compared
        fresh = _gpu_inputs(name, seed=seed)[0]
        x_static.copy_(fresh)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kernels.call("moe", fresh, *args[1:]))


@gpu
def test_gpu_grouped_path_is_capturable():
    """No host sync in the denoise path either (its default fused GEMM1, moe/gemm1.py, included): it
    captures, and the replay equals eager."""
    args = _gpu_inputs("small", seed=6)
    eager = kernels.call("moe", *args)
    x_static = args[0].clone()
    kernels.call("moe", x_static, *args[1:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kernels.call("moe", x_static, *args[1:])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
