"""The benchmarks' command runs on the CPU: `python -m bench --help` lists every suite, each suite module
has what the command needs, a few suites' --dry paths (Triton's interpreter or the reference ops at tiny
shapes) write their JSON and tables to the output folder, a suite that needs a GPU says so, and the
pieces the suites share (the timing helper, FakeComm, the two-dispatch ablation) do what they say."""
from __future__ import annotations

import argparse
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.runtime.request import Request

from bench.suites import SUITES, module_name

ROOT = Path(__file__).resolve().parents[1]


def bench(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("OUT", "TRITON_INTERPRET")}
    return subprocess.run([sys.executable, "-m", "bench", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def test_help_lists_every_suite():
    proc = bench("--help")
    assert proc.returncode == 0, proc.stderr
    for name in SUITES:
        assert f"  {name} " in proc.stdout


@pytest.mark.parametrize("name", list(SUITES))
def test_each_suite_module_has_what_the_command_needs(name):
    suite = importlib.import_module(module_name(name))
    assert suite.__doc__ and f"python -m bench {name}" in suite.__doc__, "the docstring is the suite's --help"
    assert isinstance(suite.DRY, bool) and callable(suite.run)
    ap = argparse.ArgumentParser()
    suite.add_arguments(ap)
    ap.parse_args([])                      # every option has a default


@pytest.mark.parametrize("args", [
    ["decode-attention"],                                             # Triton's interpreter: the op's kernels
    ["denoise-attention"],                                            # plain SDPA forms
    ["tables", "--plans", "hybrid4", "--decode", "5", "--steps", "1"],  # the engine's code on one rank, tiny model
    ["serving", "--builds", "mxfp4-distil", "--max-denoise-batch", "2", "--lookahead", "on,off"],   # the scheduler
    ["lora", "--steps", "1"],                                         # the LoRA tables on a hybrid4 rank, tiny model
    ["kernels-quant", "--decode", "--sections", "rows"],              # the GEMV past LINEAR_MAX_M, interpreter
    ["one-gpu", "--builds", "mxfp4-distil"],                          # the whole request after the warm-up's capture
])
def test_dry_run_writes_json_and_tables(tmp_path, args):
    proc = bench(*args, "--dry", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    stem = args[0] + ("-decode" if args[:2] == ["kernels-quant", "--decode"] else "")   # its own files
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["command"] == "python -m bench " + " ".join(args + ["--dry", "--out", str(tmp_path)])
    assert data["suite"] == stem and data["dry"] and data["checks_passed"] and data["date"]
    assert data["machine"]["torch"] == torch.__version__ and data["machine"]["triton"]
    assert data["rows"] or data["checks"]
    text = (tmp_path / f"{stem}.txt").read_text()
    assert text.startswith("# python -m bench " + args[0]) and "(dry run)" in text
    if args[0] == "serving":            # each closed row against the 1-client closed row of its policy and batch
        closed = [r for r in data["rows"] if r.get("mode") == "closed"]
        for r in closed:
            alone = [a for a in closed if a["clients"] == 1 and all(a[k] == r[k] for k in
                                                                   ("max_denoise_batch", "policy", "lookahead"))]
            assert len(alone) == 1 and r["p90_over_alone"] == pytest.approx(r["p90_s"] / alone[0]["p50_s"]), r
        for r in data["rows"]:          # the slowest long CoT's rate: of a subset of the requests (NaN: none)
            long, every = r["tokens_per_s_min_long"], r["tokens_per_s_min"]
            assert long != long or long >= every, r


def test_a_gpu_suite_without_a_gpu_says_so(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    proc = bench("prefill-host", "--out", str(tmp_path))
    assert proc.returncode == 2 and "needs a CUDA GPU" in proc.stderr
    assert not list(tmp_path.iterdir())


def test_timing_and_stages_on_the_cpu():
    from bench.timing import Stages, time_ms
    calls = []
    assert time_ms(lambda: calls.append(1), "bench", n=3, warmup=2) >= 0 and len(calls) == 5
    with pytest.raises(ValueError):
        time_ms(lambda: None, "fast")
    clock = Stages()
    with clock("a"):
        pass
    with clock("b"):
        pass
    assert list(clock.seconds) == ["a", "b"] and clock.total == sum(clock.seconds.values())


def test_fake_comm_keeps_shapes_and_moves_nothing():
    from engine.parallel.fake import FakeComm
    from engine.parallel.layout import Comm
    c = FakeComm(4)
    assert isinstance(c, Comm) and (c.size, c.rank) == (4, 0)
    t = torch.arange(6.0).view(2, 3)
    assert c.all_gather(t, 1).shape == (2, 12)
    s = torch.arange(24.0).view(4, 3, 2).transpose(1, 2)
    out = c.all_to_all(s)
    assert out.is_contiguous() and torch.equal(out, s)
    assert c.all_reduce_(t) is t and FakeComm(1).all_to_all(s) is s


def test_two_dispatch_ablation_is_the_moe_op():
    """The ablation the tables time against the engine's MoE computes the op (under the interpreter)."""
    code = """
import torch

from engine.runtime.request import Request
from hunyuan_kernels._triton import prepare_interpreter
prepare_interpreter()
from bench import ablations
from hunyuan_kernels.moe import moe_reference
from bench.checks import rel_err
ablations.register()
g = torch.Generator().manual_seed(0)
def r(*s, scale=1.0, dt=torch.bfloat16):
    return (torch.randn(*s, generator=g) * scale).to(dt)
H, E, I, M = 64, 8, 32, 2
args = (r(9, H), r(E, H, scale=H ** -0.5, dt=torch.float32), r(M, E, 2 * I, H, scale=H ** -0.5),
        r(E, H, M * I, scale=I ** -0.5), r(M, 2 * I, H, scale=H ** -0.5), r(H, M * I, scale=I ** -0.5), 0, 2, 3, True)
err = rel_err(ablations.two_dispatch(*args), moe_reference(*args))
assert err < 2e-2, err
print("ok", err)
"""
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


def test_the_determinism_probe_names_the_first_module_that_differs(tiny):
    """bench determinism's probe on the tiny model (CPU fp32): two runs repeat each other call for call; a run in
    which one layer's MLP output is nudged by 1e-6 differs first at that module's first call."""
    from bench.suites.determinism import first_difference, run_once
    req = Request(prompt="a green square on black", bot_task="image", steps=2, seed=5, size="256x256")
    a, png_a = run_once(tiny, req, graphs=False)
    b, png_b = run_once(tiny, req, graphs=False)
    assert first_difference(a, b) is None and png_a == png_b and len(a) > 100
    target = next(name for name, _ in tiny.model.named_modules() if name.endswith("layers.1.mlp"))
    module = dict(tiny.model.named_modules())[target]
    nudge = module.register_forward_hook(lambda m, i, o: o + 1e-6)
    try:
        c, _ = run_once(tiny, req, graphs=False)
    finally:
        nudge.remove()
    i, ours, theirs = first_difference(a, c)
    assert ours[0] == theirs[0] == target and ours != theirs, (ours, theirs)
    assert all(x[0] != target for x in a[:i]), "an earlier call of the module was equal: not its first"


def test_the_folds_suite_reports_each_kind_of_mx_pack(tmp_path):
    """`bench folds` on the MXFP4-mixed tiny build: one row a kind of linear, humming's share for the experts
    only, shares in [0, 1], the folded model's image within FP8 rounding of the weight-only one; a checkpoint
    without MX weights is a failed run that says so."""
    from tools.tiny import make_tiny
    folder = make_tiny(tmp_path / "mixed", blocks=True, quant="mxfp4")
    proc = bench("folds", "--model", str(folder), "--images", "1", "--steps", "2", "--out", str(tmp_path / "out"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "out" / "folds.json").read_text())
    rows = {r["kind"]: r for r in data["rows"]}
    assert set(rows) == {f"transformer.layers.N.{k}" for k in
                         ("self_attn.qkv", "self_attn.o_proj", "mlp.w1", "mlp.w2", "mlp.shared_w1", "mlp.shared_w2")}
    for kind, r in rows.items():
        experts = kind.endswith((".mlp.w1", ".mlp.w2"))
        assert r["fmt"] == ("mxfp4" if experts else "mxfp8") and (r["humming_clamped"] is not None) == experts
        assert 0 <= r["fold_changed"] <= 1 and r["spread_max"] >= r["spread_median"] >= 0
    (img,) = data["images"]                                  # no --reference: the folded image vs the weight-only one
    assert img["against"] == "weight-only" and 30 <= img["psnr_db"] < 120     # close, and not the same bits
    proc = bench("folds", "--out", str(tmp_path / "none"))       # the embedded model: no MX weights
    assert proc.returncode == 1 and "keeps no MXFP8 or MXFP4 weights" in proc.stdout


def test_humming_tune_candidates_vary_n_ctas_and_stages_only():
    """The sweep's grid: every (block N dividing the layer's N, CTAs an SM, stages), each of humming's intervals
    up to the routes asked kept with its M and K tiles (the M tile is align's, the K tile the sums' order)."""
    import types
    from bench.suites.humming_tune import candidates
    pick = {"block_shape": [8, 256, 128], "warp_shape": [8, 32, 128], "num_stages": 4, "mma_type": "wgmma"}
    intervals = [[0, 400, pick], [400, 832, dict(pick, block_shape=[16, 256, 128], warp_shape=[16, 32, 128])]]
    config = types.SimpleNamespace(indexed=json.dumps(intervals), layer=types.SimpleNamespace(shape_n=4160))
    got = candidates(config, 16, [64, 128, 256], [1, 2], [4, 6])
    assert len(got) == 1 * 2 * 2                      # 4160 = 65 x 64: only N 64 divides it
    for label, tuning in got:
        (lo, hi, cfg), = json.loads(tuning)           # only the interval that 16 routes can meet
        assert (lo, hi) == (0, 400) and cfg["block_shape"] == [8, 64, 128] and cfg["warp_shape"] == [8, 16, 128]
        assert label == f"N 64, {cfg['num_ctas_per_sm']} CTA/SM, {cfg['num_stages']} stages"
    assert {(json.loads(t)[0][2]["num_ctas_per_sm"], json.loads(t)[0][2]["num_stages"]) for _, t in got} == \
        {(1, 4), (1, 6), (2, 4), (2, 6)}
