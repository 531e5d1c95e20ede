"""hunyuan_kernels/moe/gemm1.py (the fused GEMM1 + SwiGLU of the grouped MoE path) and triton_kernels.dispatch_rows.
Under Triton's CPU interpreter at small shapes (I a non-multiple of the tile, experts with no rows, one or
two micros from micro 0 or 1, every weight-load form): the kernel equals today's path (dispatch, per
micro grouped GEMM, SwiGLU) in fp32 on poisoned outputs, and the `moe` op's "fused" variant equals the
fp64 loop as the "grouped" one does. Marked gpu: every tile variant at the real hybrid4 shapes in bf16
against today's path and an fp32 truth, and the "fused" variant of the whole op against "grouped"."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_support import interpreted, poisoned, rel_err, run_interpreter_suite

import hunyuan_kernels as kernels

N, K, E, H, MICROS = 37, 4, 8, 64, 2
NO_ROWS = (3, 5, 7)                   # experts the crafted gate never picks (the last one among them)


def routing(tk, x, gate, k):
    _, ids, (rank, counts, block_tokens) = tk.router_select(tk.router_logits(x, gate), k, True, plan=True)
    base, offs = tk.route_plan(counts)
    return ids, rank, base, block_tokens, offs


def current_path(tk, x, w1, r, micro_start, micro_count, inter):
    """Today's steps: dispatch copies x rows, per micro a grouped GEMM -> [R, 2I], SwiGLU into act."""
    ids, rank, base, bt, offs = r
    xs = torch.full((ids.numel(), x.shape[1]), float("nan"), dtype=x.dtype, device=x.device)
    tk.dispatch(x, ids, rank, base, bt, xs)
    act = torch.full((ids.numel(), micro_count * inter), float("nan"), dtype=x.dtype, device=x.device)
    for i in range(micro_count):
        tk.swiglu(torch._grouped_mm(xs, w1[micro_start + i].transpose(1, 2), offs=offs),
                  out=act[:, i * inter:(i + 1) * inter])
    return act


def crafted(inter, seed, experts=E, hidden=H, n=N):
    """x > 0 and gate rows NO_ROWS all negative: those experts never make the top-k."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, hidden, generator=g).abs() + 0.1
    gate = torch.randn(experts, hidden, generator=g) * hidden ** -0.5
    for e in NO_ROWS:
        gate[e] = -gate[e].abs() - 1.0
    w1 = torch.randn(MICROS, experts, 2 * inter, hidden, generator=g) * hidden ** -0.5
    return x, gate, w1


# --------------------------------------------------------------- Triton kernels, CPU interpreter

def test_triton_interpreter_suite():
    run_interpreter_suite(__file__)


@pytest.fixture(scope="module")
def interp():
    return interpreted("hunyuan_kernels.moe.cuda")


def test_interp_dispatch_rows_is_dispatch_without_the_copy(interp):
    from hunyuan_kernels.moe import triton_kernels as tk
    g = torch.Generator().manual_seed(1)
    x = torch.randn(150, 32, generator=g)
    gate = torch.randn(16, 32, generator=g)
    ids, rank, base, bt, offs = routing(tk, x, gate, 4)
    assert bt < 150                                     # several token blocks
    inv, src = tk.dispatch_rows(ids, rank, base, bt)
    xs = torch.full((600, 32), float("nan"))
    assert torch.equal(inv, tk.dispatch(x, ids, rank, base, bt, xs))
    order = ids.reshape(-1).long().argsort(stable=True)
    assert src.dtype == torch.int32 and torch.equal(src.long(), order // 4)    # the token of each row
    assert torch.equal(x[src.long()], xs)
    assert torch.equal(src.long()[inv.reshape(-1).long()], torch.arange(150).repeat_interleave(4))


CFGS = {  # small tiles for the interpreter; every weight-load form and both tile orders
    "ptr": dict(BM=16, BN=16, BK=32, GROUP_M=2, WLOAD="ptr", num_warps=4, num_stages=2),
    "ptr-wide": dict(BM=32, BN=32, BK=64, GROUP_M=1, WLOAD="ptr", num_warps=4, num_stages=2),
    "tma": dict(BM=16, BN=32, BK=32, GROUP_M=4, WLOAD="host", num_warps=4, num_stages=2),
    "dtma": dict(BM=16, BN=16, BK=32, GROUP_M=8, WLOAD="device", num_warps=4, num_stages=2),
    "fuse": dict(BM=16, BN=16, BK=32, GROUP_M=2, WLOAD="ptr", FUSE_N=True, num_warps=4, num_stages=2),
    "fuse-tma": dict(BM=16, BN=32, BK=32, GROUP_M=4, WLOAD="host", FUSE_N=True, num_warps=4, num_stages=2),
    "fuse-dtma": dict(BM=16, BN=16, BK=32, GROUP_M=8, WLOAD="device", FUSE_N=True, num_warps=4, num_stages=2),
}


# every tile config on two micros at inter 48 (the K tail); the micro layouts and inter 32 on "ptr" and
# "fuse" (each tile order): the full cross product took over 5 min of CI's 30 under the interpreter
GEMM1_CASES = [(c, 48, 0, 2) for c in CFGS] + [(c, i, ms, mc) for c in ("ptr", "fuse") for i in (32, 48)
                                              for ms, mc in ((0, 1), (1, 1), (0, 2)) if (i, ms, mc) != (48, 0, 2)]


@pytest.mark.parametrize("cfg,inter,micro_start,micro_count", GEMM1_CASES)
def test_interp_gemm1_swiglu_equals_the_current_path(interp, cfg, inter, micro_start, micro_count):
    from hunyuan_kernels.moe import gemm1 as moe_gemm1
    from hunyuan_kernels.moe import triton_kernels as tk
    x, gate, w1 = crafted(inter, seed=inter + micro_start + 3 * micro_count)
    r = routing(tk, x, gate, K)
    ids, rank, base, bt, offs = r
    counts = torch.diff(offs, prepend=torch.zeros(1, dtype=torch.int32))
    assert all(counts[e] == 0 for e in NO_ROWS) and (counts > CFGS[cfg]["BM"]).any()   # empty and multi-tile experts
    want = current_path(tk, x, w1, r, micro_start, micro_count, inter)
    _, src = tk.dispatch_rows(ids, rank, base, bt)
    wide = torch.full((N * K, micro_count * inter + 5), float("nan"))    # act: a view with a wider row
    act = wide[:, :micro_count * inter]
    got = moe_gemm1.gemm1_swiglu(x, src, offs, w1, micro_start, micro_count, act, config=CFGS[cfg])
    assert got.data_ptr() == act.data_ptr()
    assert not act.isnan().any() and wide[:, micro_count * inter:].isnan().all()
    torch.testing.assert_close(act, want, rtol=1e-4, atol=1e-5)


def test_interp_gemm1_swiglu_rejects_what_it_cannot_run(interp):
    from hunyuan_kernels.moe import gemm1 as moe_gemm1
    x, gate, w1 = crafted(32, seed=2)
    src = torch.zeros(N * K, dtype=torch.int32)
    offs = torch.full((E,), N * K, dtype=torch.int32)
    with pytest.raises(ValueError, match="act"):
        moe_gemm1.gemm1_swiglu(x, src, offs, w1, 0, 2, torch.empty(N * K, 32), config=CFGS["ptr"])
    with pytest.raises(ValueError, match="BK"):
        moe_gemm1.gemm1_swiglu(x, src, offs, w1, 0, 1, torch.empty(N * K, 32), config=dict(CFGS["ptr"], BK=48))
    with pytest.raises(ValueError, match="micros"):
        moe_gemm1.gemm1_swiglu(x, src, offs, w1, 1, 2, torch.empty(N * K, 64), config=CFGS["ptr"])


@pytest.mark.parametrize("n,micro_start,micro_count,shared_inter", [(37, 0, 1, 32), (70, 1, 2, 32), (37, 0, 3, 0)])
def test_interp_moe_pipeline_with_the_fused_gemm1(interp, monkeypatch, n, micro_start, micro_count, shared_inter):
    """The "fused" variant (gemm1.CONFIG, the engine's tiles) against the fp64 loop, as
    tests/test_kernels_moe.py checks "grouped", and against "grouped"."""
    from test_kernels_moe import call_args, make_moe, moe_loop_fp64
    from hunyuan_kernels.moe import gemm1 as moe_gemm1
    from hunyuan_kernels.moe import moe_reference
    calls = []
    real = moe_gemm1.gemm1_swiglu
    monkeypatch.setattr(moe_gemm1, "gemm1_swiglu", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    t = make_moe(n, shared_inter=shared_inter, dtype=torch.bfloat16, seed=200 + n)
    args = call_args(t, micro_start, micro_count, 3, True)
    outs = {}
    for variant in ("fused", "grouped"):
        out = torch.full_like(t["x"], float("nan"))
        outs[variant] = poisoned(getattr(interp, "moe_" + variant), *args, out=out)
        assert outs[variant].data_ptr() == out.data_ptr() and not out.isnan().any()
        assert len(calls) == 1                          # the fused kernel ran (once, for every micro), then not
    truth = moe_loop_fp64(*args)
    ref = moe_reference(*args)
    assert rel_err(outs["fused"], truth) < max(1e-2, 1.5 * rel_err(ref, truth))
    assert rel_err(outs["fused"], outs["grouped"]) < 1e-2


# ------------------------------------------------------------------------------------ GPU tests

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
REAL = dict(h=4096, e=64, k=8, inter=768)


def _gpu_case(n, seed, skewed=False):
    from hunyuan_kernels.moe import triton_kernels as tk
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, e = REAL["h"], REAL["e"]
    x = torch.randn(n, h, generator=g, device="cuda")
    gate = torch.randn(e, h, generator=g, device="cuda") * 0.02
    if skewed:                                          # four hot experts take nearly every token
        mean = torch.full((h,), 0.5, device="cuda")
        x = x + mean
        for i, b in enumerate((3.0, 2.5, 2.0, 1.5)):
            gate[i] += b * mean / mean.norm() ** 2
    x = x.to(BF16)
    w1 = (torch.randn(MICROS, e, 2 * REAL["inter"], h, generator=g, device="cuda") * h ** -0.5).to(BF16)
    return tk, x, w1, routing(tk, x, gate, REAL["k"])


def _truth(x, w1, r, micro_start, micro_count, inter):
    ids, _, _, _, offs = r
    k = ids.shape[1]
    xs = x[ids.reshape(-1).long().argsort(stable=True) // k].float()
    ends = offs.tolist()
    out = torch.empty(xs.shape[0], micro_count * inter, device=x.device)
    for e in range(w1.shape[1]):
        s, t = (ends[e - 1] if e else 0), ends[e]
        for i in range(micro_count):
            hm = xs[s:t] @ w1[micro_start + i, e].float().T
            out[s:t, i * inter:(i + 1) * inter] = hm[:, :inter] * F.silu(hm[:, inter:])
    return out


def _variants():
    from hunyuan_kernels.moe import gemm1 as moe_gemm1
    return list(moe_gemm1.CONFIGS)


@gpu
@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("n,micro_start,micro_count,skewed", [(4098, 0, 2, False), (1251, 1, 1, True)])
def test_gpu_gemm1_swiglu_variants_match_the_current_path(variant, n, micro_start, micro_count, skewed):
    from hunyuan_kernels.moe import gemm1 as moe_gemm1
    tk, x, w1, r = _gpu_case(n, seed=n + skewed, skewed=skewed)
    inter = REAL["inter"]
    cur = current_path(tk, x, w1, r, micro_start, micro_count, inter)
    want = _truth(x, w1, r, micro_start, micro_count, inter)
    ids, rank, base, bt, offs = r
    _, src = tk.dispatch_rows(ids, rank, base, bt)
    runs = []
    for _ in range(2):
        act = torch.full((n * REAL["k"], micro_count * inter), float("nan"), dtype=BF16, device="cuda")
        runs.append(moe_gemm1.gemm1_swiglu(x, src, offs, w1, micro_start, micro_count, act,
                                           config=moe_gemm1.CONFIGS[variant]))
    got = runs[0]
    assert not got.isnan().any() and torch.equal(runs[0], runs[1])
    err, err_cur = rel_err(got, want), rel_err(cur, want)
    # fp32 to the end and one bf16 rounding (today's path rounds [R, 2I] first): within bf16 bounds
    assert err < 1e-2 and err <= 1.5 * err_cur + 1e-4, (err, err_cur)


@gpu
@pytest.mark.parametrize("name", ["hybrid4_denoise", "hybrid4_prefill", "small"])
def test_gpu_fused_variant_equals_grouped_and_is_reproducible(name):
    from test_kernels_moe import _fast, _gpu_inputs
    args = _gpu_inputs(name, seed=21)
    on, off = _fast(args, "fused"), _fast(args, "grouped")
    assert not on.isnan().any()
    assert rel_err(on, off) < 1e-2
    assert torch.equal(on, _fast(args, "fused"))          # bitwise reproducible


def test_shapes_the_kernel_cannot_run_take_grouped_mm():
    """`fits` is host-known shape arithmetic: H off the K tile (or misaligned rows) sends the grouped path
    to torch._grouped_mm instead of a launch error."""
    from hunyuan_kernels.moe import gemm1 as moe_gemm1
    w1 = torch.zeros(2, 4, 2 * 48, 64, dtype=torch.bfloat16)
    assert moe_gemm1.fits(torch.zeros(3, 64, dtype=torch.bfloat16), w1)
    assert not moe_gemm1.fits(torch.zeros(3, 64, dtype=torch.float32), w1)          # dtypes differ
    w1_odd = torch.zeros(2, 4, 2 * 48, 72, dtype=torch.bfloat16)                    # H 72: not a multiple of 64
    assert not moe_gemm1.fits(torch.zeros(3, 72, dtype=torch.bfloat16), w1_odd)
