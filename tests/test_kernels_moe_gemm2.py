"""kernels/moe_gemm2.py (the grouped MoE path's down GEMM as one Triton kernel) and moe_fast's GEMM2
switch. Under Triton's CPU interpreter at small shapes (experts with no rows, the last among them; H
not a multiple of BN; one or two micros from micro 0 or 1; every A / weight load form): the kernel
equals a per-expert fp64 loop and torch._grouped_mm on the `_down_cols` view, on poisoned outputs, and
the `moe` pipeline with GEMM1 and GEMM2 "fused" equals the fp64 loop. Marked gpu: every tile variant at
the real hybrid4 shapes in bf16 against torch._grouped_mm and an fp32 truth, the whole op with the
switch on, and CUDA-graph capture."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from interpreter import INTERPRETED, ROOT, run_interpreter_suite

import kernels

E, H, MICROS = 8, 48, 3
COUNTS = (20, 0, 37, 5, 0, 16, 1, 0)      # rows per expert: empty ones (the last too), multi-tile ones


def rel_err(got, want):
    want = want.to(torch.float64)
    return ((got.to(torch.float64) - want).norm() / want.norm()).item()


def offs_of(counts, device="cpu"):
    return torch.tensor(counts, device=device).cumsum(0).to(torch.int32)


def loop_truth(act, offs, w2, micro_start, micro_count, dtype=torch.float64):
    """The down GEMM expert by expert, in `dtype`, from offs alone."""
    inter = act.shape[1] // micro_count
    out = torch.zeros(act.shape[0], w2.shape[1], dtype=dtype, device=act.device)
    start = 0
    for e, end in enumerate(offs.tolist()):
        w = w2[e, :, micro_start * inter:(micro_start + micro_count) * inter].to(dtype)
        out[start:end] = act[start:end].to(dtype) @ w.T
        start = end
    return out


def _variants():
    from kernels import moe_gemm2
    return list(moe_gemm2.CONFIGS)


def down_cols_mm(act, offs, w2, micro_start, micro_count):
    from kernels.moe_fast import _down_cols
    return torch._grouped_mm(act, _down_cols(w2, micro_start, micro_count, act.shape[1] // micro_count), offs=offs)


# --------------------------------------------------------------- Triton kernels, CPU interpreter

def test_triton_interpreter_suite():
    run_interpreter_suite(__file__)


@pytest.fixture(scope="module")
def interp():
    if not INTERPRETED:
        pytest.skip("runs in the child pytest of test_triton_interpreter_suite (TRITON_INTERPRET=1)")
    from kernels._triton import shim_interpreter_scalars
    shim_interpreter_scalars()
    from kernels import moe_fast, moe_gemm2
    assert moe_gemm2.INTERPRET
    return moe_fast


_S = dict(BM=16, BN=32, BK=32, GROUP_M=2, num_warps=4, num_stages=2)
CFGS = {  # small tiles for the interpreter; every A / weight load form, both swizzles, BN over H
    "ptr-ptr": dict(_S, ALOAD="ptr", WLOAD="ptr"),
    "ptr-tma": dict(_S, ALOAD="ptr", WLOAD="host"),
    "tma-ptr": dict(_S, ALOAD="host", WLOAD="ptr", GROUP_M=1),
    "tma-tma": dict(_S, ALOAD="host", WLOAD="host", GROUP_M=8),
    "tma-dtma": dict(_S, ALOAD="host", WLOAD="device"),
    "tma-tma-n64k16": dict(_S, ALOAD="host", WLOAD="host", BN=64, BK=16),
}


@pytest.mark.parametrize("cfg", list(CFGS))
@pytest.mark.parametrize("inter", [32, 64])
@pytest.mark.parametrize("micro_start,micro_count", [(0, 1), (1, 1), (0, 2), (1, 2)])
def test_interp_gemm2_equals_the_loop_and_grouped_mm(interp, cfg, inter, micro_start, micro_count):
    from kernels import moe_gemm2
    g = torch.Generator().manual_seed(inter + 7 * micro_start + 3 * micro_count)
    offs = offs_of(COUNTS)
    r = int(offs[-1])
    assert H % CFGS[cfg]["BN"] and max(COUNTS) > CFGS[cfg]["BM"]          # a ragged N tile, multi-tile experts
    act = torch.randn(r, micro_count * inter, generator=g)
    w2 = torch.randn(E, H, MICROS * inter, generator=g) * inter ** -0.5
    wide = torch.full((r, H + 3), float("nan"))                           # out: a view with a wider row
    out = wide[:, :H]
    got = moe_gemm2.gemm2(act, offs, w2, micro_start, micro_count, out, config=CFGS[cfg])
    assert got.data_ptr() == out.data_ptr()
    assert not out.isnan().any() and wide[:, H:].isnan().all()
    want = loop_truth(act, offs, w2, micro_start, micro_count)
    torch.testing.assert_close(out.double(), want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(out, down_cols_mm(act, offs, w2, micro_start, micro_count), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("variant", ["CONFIG"] + _variants())
def test_interp_gemm2_engine_tiles(interp, variant):
    """The GPU tile variants themselves (BM up to 256, BN up to 256, BK up to 128) at a small shape: an
    expert over two BM 256 tiles, empty ones (the last too), H ragged for BN 128 and 256, K = 2 x 64."""
    from kernels import moe_gemm2
    cfg = moe_gemm2.CONFIG if variant == "CONFIG" else moe_gemm2.CONFIGS[variant]
    g = torch.Generator().manual_seed(11)
    counts, h, inter = (300, 0, 40, 3, 0), 160, 64
    offs = offs_of(counts)
    act = torch.randn(int(offs[-1]), 2 * inter, generator=g)
    w2 = torch.randn(len(counts), h, 2 * inter, generator=g) * inter ** -0.5
    out = torch.full((act.shape[0], h), float("nan"))
    moe_gemm2.gemm2(act, offs, w2, 0, 2, out, config=cfg)
    assert not out.isnan().any()
    torch.testing.assert_close(out.double(), loop_truth(act, offs, w2, 0, 2), rtol=1e-4, atol=1e-4)


def test_interp_gemm2_allocates_out_and_takes_no_rows(interp):
    from kernels import moe_gemm2
    g = torch.Generator().manual_seed(3)
    offs = offs_of(COUNTS)
    act = torch.randn(int(offs[-1]), 64, generator=g)
    w2 = torch.randn(E, H, MICROS * 32, generator=g)
    got = moe_gemm2.gemm2(act, offs, w2, 1, 2, config=CFGS["tma-tma"])
    assert got.shape == (act.shape[0], H) and got.dtype == act.dtype
    torch.testing.assert_close(got.double(), loop_truth(act, offs, w2, 1, 2), rtol=1e-4, atol=1e-4)
    empty = moe_gemm2.gemm2(act[:0], torch.zeros(E, dtype=torch.int32), w2, 0, 2, config=CFGS["tma-tma"])
    assert empty.shape == (0, H)


def test_interp_gemm2_rejects_what_it_cannot_run(interp):
    from kernels import moe_gemm2
    offs = offs_of(COUNTS)
    r = int(offs[-1])
    w2 = torch.randn(E, H, MICROS * 32)
    cfg = CFGS["ptr-ptr"]
    with pytest.raises(ValueError, match="BK"):
        moe_gemm2.gemm2(torch.randn(r, 32), offs, w2, 0, 1, config=dict(cfg, BK=64))
    with pytest.raises(ValueError, match="micros"):                      # past the pack's last micro
        moe_gemm2.gemm2(torch.randn(r, 64), offs, w2, 2, 2, config=cfg)
    with pytest.raises(ValueError, match="micros"):                      # not a whole number of micros
        moe_gemm2.gemm2(torch.randn(r, 40), offs, w2, 0, 1, config=dict(cfg, BK=8))
    with pytest.raises(ValueError, match="offs"):
        moe_gemm2.gemm2(torch.randn(r, 32), offs.long(), w2, 0, 1, config=cfg)
    with pytest.raises(ValueError, match="out"):
        moe_gemm2.gemm2(torch.randn(r, 32), offs, w2, 0, 1, out=torch.empty(r, H + 1), config=cfg)
    with pytest.raises(ValueError, match="TMA"):                          # rows of 33 fp32: not 16-byte aligned
        moe_gemm2.gemm2(torch.randn(r, 33)[:, :32], offs, w2, 0, 1, config=CFGS["tma-tma"])
    with pytest.raises(ValueError, match="dtype"):
        moe_gemm2.gemm2(torch.randn(r, 32).double(), offs, w2, 0, 1, config=cfg)


def _count_calls(monkeypatch, module, name):
    calls = []
    real = getattr(module, name)
    monkeypatch.setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("n,micro_start,micro_count,shared_inter", [(37, 0, 1, 32), (70, 1, 2, 32), (37, 0, 3, 0)])
def test_interp_moe_pipeline_with_the_fused_gemm2(interp, monkeypatch, n, micro_start, micro_count, shared_inter):
    """The whole grouped pipeline with GEMM1 and GEMM2 fused (the engine's CONFIGs) against the fp64
    loop, and against GEMM2 = "grouped_mm"."""
    from test_kernels_moe import call_args, make_moe, moe_loop_fp64
    from kernels import moe_gemm2
    from kernels.moe import moe_reference
    calls = _count_calls(monkeypatch, moe_gemm2, "gemm2")
    t = make_moe(n, inter=64, shared_inter=shared_inter, dtype=torch.bfloat16, seed=300 + n)
    args = call_args(t, micro_start, micro_count, 3, True)
    monkeypatch.setattr(interp, "GEMM1", "fused")
    outs = {}
    for mode in ("fused", "grouped_mm"):
        monkeypatch.setattr(interp, "GEMM2", mode)
        out = torch.full_like(t["x"], float("nan"))
        with interp.poisoned():
            outs[mode] = interp.moe_cuda(*args, out=out)
        assert outs[mode].data_ptr() == out.data_ptr() and not out.isnan().any()
        assert len(calls) == 1                          # the fused down GEMM ran (once, for every micro), then not
    truth = moe_loop_fp64(*args)
    ref = moe_reference(*args)
    assert rel_err(outs["fused"], truth) < max(1e-2, 1.5 * rel_err(ref, truth))
    assert rel_err(outs["fused"], outs["grouped_mm"]) < 1e-2


def test_interp_moe_pipeline_falls_back_when_k_is_not_a_multiple_of_bk(interp, monkeypatch):
    """K = micro_count * I = 32 with CONFIG's BK 64: the switch keeps torch._grouped_mm (a shape decision)."""
    from test_kernels_moe import call_args, make_moe, moe_loop_fp64
    from kernels import moe_gemm2
    assert 32 % moe_gemm2.CONFIG["BK"]
    calls = _count_calls(monkeypatch, moe_gemm2, "gemm2")
    monkeypatch.setattr(interp, "GEMM1", "fused")
    monkeypatch.setattr(interp, "GEMM2", "fused")
    t = make_moe(37, inter=32, dtype=torch.bfloat16, seed=5)
    args = call_args(t, 1, 1, 3, True)
    got = interp.moe_cuda(*args)
    assert not calls
    assert rel_err(got, moe_loop_fp64(*args)) < 1e-2


# ------------------------------------------------------------------------------- the env switch

@pytest.mark.parametrize("value", ["fused", "grouped_mm", None])
def test_hunyuan_gemm2_env_sets_the_switch_at_import(value):
    env = {k: v for k, v in os.environ.items() if k != "HUNYUAN_GEMM2"}
    if value is not None:
        env["HUNYUAN_GEMM2"] = value
    proc = subprocess.run([sys.executable, "-c", "from kernels import moe_fast; print(moe_fast.GEMM2)"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split()[-1] == (value or "grouped_mm")


def test_hunyuan_gemm2_env_rejects_other_values():
    env = dict(os.environ, HUNYUAN_GEMM2="cutlass")
    proc = subprocess.run([sys.executable, "-c", "from kernels import moe_fast"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "HUNYUAN_GEMM2" in proc.stderr


# ------------------------------------------------------------------------------------ GPU tests

gpu = pytest.mark.gpu
BF16 = torch.bfloat16
REAL = dict(h=4096, e=64, k=8, inter=768, micros=2)


def _gpu_case(n, micro_count, seed, skewed=False):
    """Real routing of n random tokens (the engine's router; skewed: four hot experts), a random act
    [n*k, micro_count*I] and the cols-packed w2 [E, H, micros*I], bf16."""
    from kernels import moe_triton as tk
    g = torch.Generator(device="cuda").manual_seed(seed)
    h, e, inter = REAL["h"], REAL["e"], REAL["inter"]
    x = torch.randn(n, h, generator=g, device="cuda")
    gate = torch.randn(e, h, generator=g, device="cuda") * 0.02
    if skewed:
        mean = torch.full((h,), 0.5, device="cuda")
        x = x + mean
        for i, b in enumerate((3.0, 2.5, 2.0, 1.5)):
            gate[i] += b * mean / mean.norm() ** 2
    _, _, (_, counts, _) = tk.router_select(tk.router_logits(x.to(BF16), gate), REAL["k"], True, plan=True)
    _, offs = tk.route_plan(counts)
    act = torch.randn(n * REAL["k"], micro_count * inter, generator=g, device="cuda").to(BF16)
    w2 = (torch.randn(e, h, REAL["micros"] * inter, generator=g, device="cuda") * inter ** -0.5).to(BF16)
    return act, offs, w2


@gpu
@pytest.mark.parametrize("variant", _variants())
@pytest.mark.parametrize("n,micro_start,micro_count,skewed", [(4098, 0, 2, False), (1251, 1, 1, True)])
def test_gpu_gemm2_variants_match_grouped_mm(variant, n, micro_start, micro_count, skewed):
    from kernels import moe_gemm2
    act, offs, w2 = _gpu_case(n, micro_count, seed=n + skewed, skewed=skewed)
    want = loop_truth(act, offs, w2, micro_start, micro_count, dtype=torch.float32)
    ref = down_cols_mm(act, offs, w2, micro_start, micro_count)
    runs = []
    for _ in range(2):
        out = torch.full((act.shape[0], REAL["h"]), float("nan"), dtype=BF16, device="cuda")
        runs.append(moe_gemm2.gemm2(act, offs, w2, micro_start, micro_count, out, config=moe_gemm2.CONFIGS[variant]))
    got = runs[0]
    assert not got.isnan().any() and torch.equal(runs[0], runs[1])
    err, err_ref = rel_err(got, want), rel_err(ref, want)
    assert err < 1e-2 and err <= 1.5 * err_ref + 1e-4, (err, err_ref)
    assert rel_err(got, ref) < 1e-2


@gpu
@pytest.mark.parametrize("name", ["hybrid4_denoise", "hybrid4_prefill", "small"])
def test_gpu_moe_op_with_the_fused_gemm2(monkeypatch, name):
    from test_kernels_moe import _fast, _gpu_inputs
    from kernels import moe_fast, moe_gemm2
    calls = _count_calls(monkeypatch, moe_gemm2, "gemm2")
    args = _gpu_inputs(name, seed=23)
    with kernels.allowed():
        ref = kernels.call("moe", *args)
    monkeypatch.setattr(moe_fast, "GEMM1", "fused")
    monkeypatch.setattr(moe_fast, "GEMM2", "grouped_mm")
    off = _fast(args)
    assert not calls
    monkeypatch.setattr(moe_fast, "GEMM2", "fused")
    on = _fast(args)
    assert calls, "the fused GEMM2 did not run"
    assert not on.isnan().any()
    assert rel_err(on, ref) < 1e-2 and rel_err(on, off) < 1e-2
    assert torch.equal(on, _fast(args))                  # bitwise reproducible
    with kernels.allowed("triton"):
        assert kernels.chosen("moe", "cuda", BF16) == "triton"
        assert rel_err(kernels.call("moe", *args), ref) < 1e-2


@gpu
def test_gpu_fused_gemm2_path_is_capturable(monkeypatch):
    from test_kernels_moe import _gpu_inputs
    from kernels import moe_fast, moe_gemm2
    calls = _count_calls(monkeypatch, moe_gemm2, "gemm2")
    monkeypatch.setattr(moe_fast, "GEMM1", "fused")
    monkeypatch.setattr(moe_fast, "GEMM2", "fused")
    args = _gpu_inputs("small", seed=8)
    eager = moe_fast.moe_cuda(*args)
    assert calls
    x_static = args[0].clone()
    moe_fast.moe_cuda(x_static, *args[1:])
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_fast.moe_cuda(x_static, *args[1:])
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
