"""humming-kernels as the `moe_quant` op's `humming` variant (hunyuan_kernels/quant/humming.py): a pack laid
out for it at load runs only there (the reference and our variants refuse it by name); the route lists of
its indexed GEMMs (`align`: its PyTorch definition against humming's own construction, the Triton kernel
against that definition under the interpreter), the kernel interval of a row count, the path of a row
count; under the interpreter, the whole variant with humming's GEMMs replaced by the contract humming.py
reads from them (the indexed path gives the grouped path's bits); and (marked gpu, on the H200 with the
`humming` extra installed) the variant against the reference on plain packs: W4A16 and W4A8, one and two
micros, decode and denoise sizes, NVFP4, MXFP8 and FP8 experts, the indexed path at 1..16 rows, the same bits a
second time, a token alone the same bits as in a batch, the same bits on both sides of INDEXED_MAX_ROWS, inside
a CUDA graph."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from kernel_support import interpreted, run_interpreter_suite

import hunyuan_kernels as kernels
import hunyuan_kernels.quant as kq
from hunyuan_kernels.quant import humming
from hunyuan_kernels.quant.formats import KernelLayout

from test_kernels_quant import make_qmoe, qargs


def fake_layout(w: kq.QWeight, micros: int | None = None) -> kq.QWeight:
    """A pack whose layout says humming (its tensors untouched): what the refusals must see."""
    shape = tuple(w.shape) if micros is None else (micros, *w.shape[:-1], w.shape[-1] // micros)
    return kq.QWeight(w.fmt, w.codes, w.scales, None, False, KernelLayout("humming", shape, "bf16", None))


def test_a_laid_out_pack_keeps_its_logical_shape_and_refuses_plain_reads():
    t = make_qmoe(4, "mxfp4", "mxfp8", micros=2)
    w = fake_layout(t["w1"])
    assert w.shape == t["w1"].shape
    for read in (lambda: w[0], lambda: w.cols(0, 32), lambda: w.flat_rows(), lambda: w.dequantize(torch.float32)):
        with pytest.raises(ValueError, match="laid out at load for the 'humming' kernels"):
            read()


def test_only_the_humming_variant_takes_laid_out_packs():
    """The reference refuses such packs by name, every other CUDA variant's `fits` declines them."""
    t = make_qmoe(4, "mxfp4", "mxfp8", micros=2)
    laid = dict(t, w1=fake_layout(t["w1"]), w2=fake_layout(t["w2"], micros=2))
    with pytest.raises(ValueError, match="moe_quant's reference reads the plain layout"):
        kernels.call("moe_quant", *qargs(laid, 0, 2))
    from hunyuan_kernels.quant import moe_cuda
    for fits in (moe_cuda.decode_fits, moe_cuda.batched_fits):
        assert fits(*qargs(t, 0, 2)) and not fits(*qargs(laid, 0, 2))
    assert humming.humming_fits(*qargs(laid, 0, 2)) and not humming.humming_fits(*qargs(t, 0, 2))


def test_fits_pack_names_what_it_cannot_lay_out():
    assert "N % 64" in humming.fits_pack(kq.random_qweight("mxfp4", (4, 96, 256)))
    assert "K % 128" in humming.fits_pack(kq.random_qweight("fp8", (4, 128, 192)))
    assert "activations 'int8'" in humming.fits_pack(kq.random_qweight("mxfp4", (4, 128, 256)), "int8")
    for fmt, act in (("mxfp4", "bf16"), ("mxfp4", "fp8"), ("mxfp8", "bf16"), ("mxfp8", "fp8"), ("nvfp4", "bf16"),
                     ("fp8", "fp8")):              # every resident quantized format, with what passed its GPU check
        assert humming.fits_pack(kq.random_qweight(fmt, (4, 128, 256)), act) is None, (fmt, act)
    # what failed its GPU check (one H200, 2026-12-05) is refused by name
    assert "NVFP4 with FP8 activations" in humming.fits_pack(kq.random_qweight("nvfp4", (4, 128, 256)), "fp8")
    assert "FP8 with bf16 activations" in humming.fits_pack(kq.random_qweight("fp8", (4, 128, 256)), "bf16")
    with pytest.raises(ValueError, match="mxfp4 packs only, not nvfp4"):
        humming.clamped_share(kq.random_qweight("nvfp4", (4, 128, 256)))


def test_clamped_share_counts_blocks_more_than_11_binades_below_their_experts_largest():
    w = kq.random_qweight("mxfp4", (2, 64, 128))
    s = torch.full_like(w.scales, 120)
    s[0, 0, 0] = 140                        # expert 0: every other block 20 binades below -> rounded
    s[1, 0, 0] = 125                        # expert 1: within 11
    share = humming.clamped_share(kq.QWeight("mxfp4", w.codes, s))
    assert share == pytest.approx((s[0].numel() - 1) / s.numel())


# ------------------------------------------------------------------- the indexed GEMM's route lists

def humming_lists(ids: torch.Tensor, experts: int, block: int) -> tuple[list[int], list[int], int]:
    """The route lists as humming's own tests build them (testing/data.py:119-139 in the 0.1.19 wheel), in
    plain Python: expert by expert, the flat indices of its routes ascending, padded with N*k to whole
    tiles; each tile's expert; the padded length."""
    flat = ids.reshape(-1).tolist()
    sorted_ids, expert_ids = [], []
    for e in range(experts):
        mine = [i for i, v in enumerate(flat) if v == e]
        tiles = -(-len(mine) // block)
        sorted_ids += mine + [len(flat)] * (tiles * block - len(mine))
        expert_ids += [e] * tiles
    return sorted_ids, expert_ids, len(sorted_ids)


def routings() -> list[tuple[torch.Tensor, int, int]]:
    """(ids [N, k], experts, block): random top-k choices at decode sizes, the real shapes' (64 experts,
    top-8, 16 rows), routes crowding a few experts (several tiles each), one token, blocks of 8 and 16."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for n, k, e, block in [(1, 8, 64, 8), (16, 8, 64, 8), (7, 4, 16, 8), (16, 4, 16, 16), (3, 1, 8, 8), (13, 2, 8, 16)]:
        cases.append((torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).int(), e, block))
    cases.append((torch.arange(4).repeat(16, 1).int(), 16, 8))             # 16 routes to each of 4 experts
    cases.append((torch.tensor([[5, 0, 3]] * 9, dtype=torch.int32), 8, 8))  # 9 a expert: a full tile and one more
    return cases


@pytest.mark.parametrize("case", range(len(routings())))
def test_align_reference_lists_the_routes_as_humming_builds_them(case):
    ids, experts, block = routings()[case]
    sorted_ids, expert_ids, padded = humming.align_reference(ids, experts, block)
    want_sorted, want_experts, want_padded = humming_lists(ids, experts, block)
    slots, tiles = humming.align_sizes(ids.numel(), experts, block)
    assert sorted_ids.dtype == expert_ids.dtype == padded.dtype == torch.int32
    assert sorted_ids.shape == (slots,) and expert_ids.shape == (tiles,) and padded.shape == (1,)
    assert padded.item() == want_padded <= slots and padded.item() % block == 0
    assert sorted_ids[:want_padded].tolist() == want_sorted
    assert expert_ids[:want_padded // block].tolist() == want_experts
    # past the end: pad ids (never read, never written) and an expert in range (its tiles never run)
    assert (sorted_ids[want_padded:] == ids.numel()).all() and (expert_ids[want_padded // block:] == experts - 1).all()


def test_align_sizes_hold_the_worst_routing():
    """Every route on its own expert, each a tile of one route and block-1 pads: the bound is reached."""
    ids = torch.arange(12, dtype=torch.int32).reshape(3, 4)
    for block in (8, 16):
        slots, tiles = humming.align_sizes(12, 16, block)
        assert slots == 12 * block == tiles * block
        assert humming.align_reference(ids, 16, block)[2].item() == slots


def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.mark.parametrize("case", range(len(routings())))
def test_interp_align_kernel_equals_its_reference(case):
    interpreted()
    ids, experts, block = routings()[case]
    got = humming.align(ids, experts, block)
    want = humming.align_reference(ids, experts, block)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


def test_block_rows_finds_the_launchers_interval():
    """lo < rows <= hi, as humming's launcher picks the kernel (launcher.cpp:31-46); hi <= 0 is no bound;
    rows outside every interval are refused naming the prepared range."""
    blocks = ((0, 104, 8), (104, 208, 16), (208, 312, 24))
    assert [humming.block_rows(blocks, r) for r in (1, 104, 105, 208, 209, 312)] == [8, 8, 16, 16, 24, 24]
    assert humming.block_rows(((0, 8, 8), (8, 0, 16)), 10 ** 6) == 16
    with pytest.raises(ValueError, match="prepared for 1..312 routed rows, not 313"):
        humming.block_rows(blocks, 313)


def test_config_of_reads_each_intervals_m_tile():
    intervals = [[0, 400, {"block_shape": [8, 256, 64], "num_stages": 4}], [400, 832, {"block_shape": [16, 256, 64]}]]
    config = humming.Config.of("layer", intervals)
    assert config.blocks == ((0, 400, 8), (400, 832, 16)) and json.loads(config.indexed) == intervals


TOP = humming.INDEXED_MAX_ROWS         # packs laid out to take the indexed path by themselves up to here


def test_rows_path_takes_the_indexed_gemms_up_to_the_threshold():
    assert {humming.rows_path(n, 0) for n in (1, 16, 4096)} == {"grouped"}
    # the measured defaults: a pack of each activation takes the indexed path by itself only where it won
    assert set(humming.INDEXED_ROWS) == set(humming.ACTIVATIONS)
    assert [humming.rows_path(n, humming.INDEXED_ROWS["fp8"]) for n in (1, 2, 3, 16)] == ["indexed"] * 2 + ["grouped"] * 2
    assert [humming.rows_path(n, humming.INDEXED_ROWS["bf16"]) for n in (1, 2)] == ["indexed", "grouped"]
    assert [humming.rows_path(n, TOP) for n in (1, TOP, TOP + 1, 4096)] == ["indexed", "indexed", "grouped", "grouped"]
    with pytest.raises(ValueError, match="indexed_rows 17: between 0 and 16"):
        humming.Config.of("layer", [], TOP + 1)


# ----------------------------------------- the variant's wiring on humming's GEMM contract (interpreter)

def contract_gemm(layer, inputs, weight, outputs, compute_config, expert_layout=None, sorted_ids=None,
                  expert_ids=None, num_tokens_padded=None, top_k=1, tuning_config=None, **unused):
    """humming_forward as humming.py's docstring reads its GEMMs, in PyTorch, weight [E, N, K] dequantized
    (fp64 sums, each row on its own, cast to the output's dtype). grouped-contiguous: rows
    [layout[e], layout[e+1]) by expert e. indexed: the M tile of the kernel the launcher would pick for
    shape_m * top_k routed rows (from the tuning config passed, not from `align`'s caller), then tile b:
    routes sorted_ids[b*M:(b+1)*M] below shape_m * top_k, input row id // top_k, output row id, expert
    expert_ids[b]; ceil(num_tokens_padded / M) tiles. Rows no tile writes keep what `outputs` held."""
    gemm = json.loads(compute_config)["gemm_type"]
    CONTRACT_CALLS.append(gemm)
    assert gemm == "grouped_contiguous" or json.loads(tuning_config) == TILES[layer]      # this layer's kernels
    a, w = inputs.double(), weight.double()
    if gemm == "grouped_contiguous":
        ends = expert_layout.tolist()
        for e in range(len(ends) - 1):
            outputs[ends[e]:ends[e + 1]] = (a[ends[e]:ends[e + 1]] @ w[e].T).to(outputs.dtype)
        return outputs
    assert gemm == "indexed" and sorted_ids.dtype == expert_ids.dtype == num_tokens_padded.dtype == torch.int32
    routes = inputs.shape[0] * top_k
    assert outputs.shape[0] == routes
    block = next(cfg["block_shape"][0] for lo, hi, cfg in json.loads(tuning_config) if lo < routes <= hi)
    for b in range(-(-int(num_tokens_padded.item()) // block)):
        ids = sorted_ids[b * block:(b + 1) * block].long()
        ids = ids[ids < routes]
        outputs[ids] = (a[ids // top_k] @ w[int(expert_ids[b])].T).to(outputs.dtype)
    return outputs


CONTRACT_CALLS: list[str] = []
TILES = {"up": [[0, 40, {"block_shape": [8, 256, 64]}], [40, 400, {"block_shape": [16, 256, 64]}]],
         "down": [[0, 24, {"block_shape": [16, 256, 64]}], [24, 400, {"block_shape": [8, 256, 128]}]]}


@pytest.fixture
def on_the_contract(monkeypatch):
    """The variant's humming calls on `contract_gemm` (W4A16: no input kernel of humming's runs)."""
    import types
    fake = types.SimpleNamespace(forward=types.SimpleNamespace(humming_forward=contract_gemm))
    monkeypatch.setattr(humming, "lib", lambda: fake)
    CONTRACT_CALLS.clear()
    return CONTRACT_CALLS


def contract_packs(t: dict, micros: int) -> dict:
    """t's expert packs as `contract_gemm` reads them: each micro's matrices dequantized, laid out "humming"
    (W4A16) with kernels (TILES) whose M tiles differ between the GEMMs at some row counts; the layer
    config is the GEMM's name."""
    w1, w2 = t["w1"], t["w2"]
    inter = w2.shape[-1] // micros
    up = w1.dequantize(torch.float32)
    down = torch.stack([w2.cols(m * inter, (m + 1) * inter).dequantize(torch.float32) for m in range(micros)])

    def pack(dense: torch.Tensor, gemm: str) -> kq.QWeight:
        lay = KernelLayout("humming", tuple(dense.shape), "bf16", humming.Config.of(gemm, TILES[gemm], TOP))
        return kq.QWeight("mxfp4", dense, torch.zeros(micros), None, False, lay)
    return dict(t, w1=pack(up, "up"), w2=pack(down, "down"))


@pytest.mark.parametrize("n,micros,ms,mc", [(1, 1, 0, 1), (5, 2, 1, 1), (9, 2, 0, 2), (16, 1, 0, 1)])
def test_interp_indexed_path_equals_the_grouped_one_on_humming_s_contract(on_the_contract, n, micros, ms, mc):
    """The whole variant (routing, `align`, both GEMMs, SwiGLU, the MXFP8 shared MLP, finalize) with humming's
    GEMMs as the contract reads them: the indexed path gives the grouped path's bits (every route's row
    found, in the finalize's order, with the same routing weights), both near the op's reference. Top-4:
    at 9 rows (36 routes) both GEMMs' M tiles are 8 (one set of lists), at 1, 5 and 16 rows they differ."""
    interpreted()
    from hunyuan_kernels.scratch import poisoned
    t = make_qmoe(n, "mxfp4", "mxfp8", micros=micros, seed=n)
    with kernels.allowed():
        want = kernels.call("moe_quant", *qargs(t, ms, mc, topk=4))
    args = qargs(contract_packs(t, micros), ms, mc, topk=4)
    with poisoned():                        # a route's row left unwritten would be NaN
        indexed = humming.moe_quant_humming(*args, path="indexed")
        grouped = humming.moe_quant_humming(*args, path="grouped")
    assert on_the_contract == ["indexed"] * 2 * mc + ["grouped_contiguous"] * 2 * mc
    assert torch.equal(indexed, grouped)
    err = ((indexed.double() - want.double()).norm() / want.double().norm()).item()
    assert err < 1e-2, err


def test_interp_the_variant_takes_the_indexed_path_up_to_the_threshold(on_the_contract):
    interpreted()
    top = humming.INDEXED_MAX_ROWS
    t = make_qmoe(top + 1, "mxfp4", "mxfp8", shared_inter=0, micros=1, seed=2)
    args = qargs(contract_packs(t, 1), 0, 1, topk=2)
    humming.moe_quant_humming(args[0][:top], *args[1:])
    humming.moe_quant_humming(*args)
    assert on_the_contract == ["indexed", "indexed", "grouped_contiguous", "grouped_contiguous"]
    with pytest.raises(ValueError, match=f"path 'indexed' for {top + 1} rows"):
        humming.moe_quant_humming(*args, path="indexed")


# ------------------------------------------------------------------------------------------------- GPU
gpu = pytest.mark.gpu


def laid(t: dict, act: str, micros: int) -> dict:
    return dict(t, w1=humming.lay_out(t["w1"], act, indexed_rows=TOP),
                w2=humming.lay_out(t["w2"], act, micros=micros, indexed_rows=TOP))


@gpu
def test_gpu_humming_is_available():
    assert humming.available(), f"humming-kernels {humming.installed()} on {torch.cuda.get_device_name()}"


@gpu
@pytest.mark.parametrize("act", ["bf16", "fp8"])
@pytest.mark.parametrize("n", [1, 5, 16, 700])
@pytest.mark.parametrize("micros,ms,mc", [(1, 0, 1), (2, 0, 2), (2, 1, 1)])
def test_gpu_humming_matches_the_reference(act, n, micros, ms, mc):
    t = make_qmoe(n, "mxfp4", "mxfp8", hidden=512, experts=16, inter=256, shared_inter=256, micros=micros,
                  device="cuda", seed=n)
    with kernels.allowed():
        want = kernels.call("moe_quant", *qargs(t, ms, mc, topk=4))
    lt = laid(t, act, micros)
    got = kernels.call("moe_quant", *qargs(lt, ms, mc, topk=4))
    assert kernels.chosen("moe_quant") == "humming"
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < (5e-2 if act == "fp8" else 1e-2), err
    assert torch.equal(got, kernels.call("moe_quant", *qargs(lt, ms, mc, topk=4)))      # the same bits again
    if n <= 16:                                    # a token alone: the same bits as in the batch
        for i in range(0, n, 4):
            alone = kernels.call("moe_quant", t["x"][i:i + 1], *qargs(lt, ms, mc, topk=4)[1:])
            assert torch.equal(alone[0], got[i]), i


@gpu
@pytest.mark.parametrize("fmt,inverse,act", [("mxfp8", False, "bf16"), ("mxfp8", False, "fp8"), ("nvfp4", False, "bf16"),
                                              ("nvfp4", True, "bf16"), ("fp8", False, "fp8")])
@pytest.mark.parametrize("n", [5, 700])
def test_gpu_humming_takes_nvfp4_mxfp8_and_fp8_experts(fmt, inverse, act, n):
    """NVFP4 (its global scale multiplying, ModelOpt, or dividing, compressed-tensors), MXFP8 and FP8 (per output
    channel) experts laid out on humming's schemas for them: the reference's result within the activations'
    rounding, the same bits again, a token alone the same bits as in its batch."""
    t = make_qmoe(n, fmt, "mxfp8", hidden=512, experts=16, inter=256, shared_inter=256, micros=2, inverse=inverse,
                  device="cuda", seed=n)
    with kernels.allowed():
        want = kernels.call("moe_quant", *qargs(t, 0, 2, topk=4))
    lt = laid(t, act, 2)
    got = kernels.call("moe_quant", *qargs(lt, 0, 2, topk=4))
    assert kernels.chosen("moe_quant") == "humming"
    err = ((got.double() - want.double()).norm() / want.double().norm()).item()
    assert err < (5e-2 if act == "fp8" else 1e-2), err
    assert torch.equal(got, kernels.call("moe_quant", *qargs(lt, 0, 2, topk=4)))
    if n <= 16:
        alone = kernels.call("moe_quant", t["x"][:1], *qargs(lt, 0, 2, topk=4)[1:])
        assert torch.equal(alone[0], got[0])


@gpu
@pytest.mark.parametrize("micros,ms,mc", [(1, 0, 1), (2, 0, 2)])
def test_gpu_w4a8_grouped_quantizes_each_token_once_with_the_copies_bits(micros, ms, mc):
    """The grouped W4A8 path quantizes x's rows and permutes codes and scales: the bits of permuting x first
    and quantizing each of a token's top-k copies (the path before; humming's quantization is per row)."""
    from hunyuan_kernels.moe.cuda import permute
    t = make_qmoe(700, "mxfp4", "mxfp8", hidden=512, experts=16, inter=256, shared_inter=256, micros=micros,
                  device="cuda", seed=3)
    x, gate, w1, w2, *_, topk, norm_topk = qargs(laid(t, "fp8", micros), ms, mc, topk=4)
    _, inv, xs, offs = permute(x, gate, topk, norm_topk)
    routing = dict(expert_layout=F.pad(offs, (1, 0)).long(), compute_config=humming.COMPUTE)
    before = humming._experts(*humming._rows(xs, w1), w1, w2, ms, mc, xs.shape[0], routing, routing, x.dtype)
    _, now, inv_now = humming._grouped(x, gate, w1, w2, ms, mc, topk, norm_topk)
    assert torch.equal(inv_now, inv) and torch.equal(now, before)


def small_moe(n: int, micros: int = 2, seed: int = 0) -> dict:
    return make_qmoe(n, "mxfp4", "mxfp8", hidden=512, experts=16, inter=256, shared_inter=256, micros=micros,
                     device="cuda", seed=seed)


@gpu
@pytest.mark.parametrize("act", ["bf16", "fp8"])
def test_gpu_indexed_path_matches_the_reference_at_1_to_16_rows(act):
    """The indexed path (forced, whatever INDEXED_MAX_ROWS is) at every row count 1..16, two micros summed:
    near the reference, every output written (scratch poisoned), the same bits again, and each row the same
    bits as in the 16-row batch (batch invariance within the path)."""
    from hunyuan_kernels.scratch import poisoned
    t = small_moe(16, seed=7)
    args = qargs(laid(t, act, 2), 0, 2, topk=4)
    full = humming.moe_quant_humming(*args, path="indexed")
    for n in range(1, 17):
        with kernels.allowed():
            want = kernels.call("moe_quant", t["x"][:n], *qargs(t, 0, 2, topk=4)[1:])
        with poisoned():
            got = humming.moe_quant_humming(args[0][:n], *args[1:], path="indexed")
        err = ((got.double() - want.double()).norm() / want.double().norm()).item()
        assert err < (5e-2 if act == "fp8" else 1e-2), (n, err)
        assert torch.equal(got, humming.moe_quant_humming(args[0][:n], *args[1:], path="indexed")), n
        assert torch.equal(got, full[:n]), n


@gpu
@pytest.mark.parametrize("act", ["bf16", "fp8"])
@pytest.mark.parametrize("micros,ms,mc", [(1, 0, 1), (2, 0, 2)])
@pytest.mark.parametrize("top,shared", [(2, 256), (8, 256), (humming.INDEXED_MAX_ROWS, 0)])
def test_gpu_paths_give_the_same_bits_across_the_threshold(act, micros, ms, mc, top, shared):
    """A request's rows do not change where its batch crosses the pack's indexed_rows (`top`): `top` rows (the
    indexed path) give the bits of the same rows among `top` + 1 (the grouped path); and at 1 and `top` rows
    both paths, forced, give the same bits. At INDEXED_MAX_ROWS without a shared MLP: the shared MLP's decode
    GEMVs end at 16 rows (moe_cuda.GEMV_MAX_TOKENS, the triton variants' documented boundary too), so with
    one, 16 rows and 17 differ whatever the experts' path (the H200 run of 2026-12-05 failed there)."""
    t = make_qmoe(top + 1, "mxfp4", "mxfp8", hidden=512, experts=16, inter=256, shared_inter=shared,
                  micros=micros, device="cuda", seed=11)
    lt = dict(t, w1=humming.lay_out(t["w1"], act, indexed_rows=top),
              w2=humming.lay_out(t["w2"], act, micros=micros, indexed_rows=top))
    args = qargs(lt, ms, mc, topk=4)
    above = kernels.call("moe_quant", *args)
    at = kernels.call("moe_quant", args[0][:top], *args[1:])
    assert torch.equal(at, above[:top])
    for n in (1, top):
        indexed = humming.moe_quant_humming(args[0][:n], *args[1:], path="indexed")
        assert torch.equal(indexed, humming.moe_quant_humming(args[0][:n], *args[1:], path="grouped")), n


def captured(args: tuple) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]:
    """The op on `args` captured in a CUDA graph (warmed up on a side stream first): (graph, its x, its out)."""
    x = args[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        kernels.call("moe_quant", x, *args[1:])
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = kernels.call("moe_quant", x, *args[1:])
    return g, x, out


@gpu
@pytest.mark.parametrize("act,n", [("bf16", 1), ("bf16", humming.INDEXED_MAX_ROWS), ("fp8", 1),
                                   ("fp8", humming.INDEXED_MAX_ROWS), ("bf16", humming.INDEXED_MAX_ROWS + 1)])
def test_gpu_humming_in_a_cuda_graph(act, n):
    """Both paths (up to INDEXED_MAX_ROWS rows indexed, one more grouped) replay as they ran eagerly, and a
    replay on new tokens routes them anew (the route lists are made inside the graph, no host read)."""
    t = small_moe(n, micros=1, seed=3)
    args = qargs(laid(t, act, 1), 0, 1, topk=4)
    eager = kernels.call("moe_quant", *args)
    g, x, out = captured(args)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    fresh = torch.randn(x.shape, generator=torch.Generator(device="cuda").manual_seed(9), device="cuda").to(x.dtype)
    x.copy_(fresh)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, kernels.call("moe_quant", fresh, *args[1:]))


# ------------------------------------------------------------------------------- the engine's choice
@pytest.fixture(scope="module")
def mxfp4_folder(tmp_path_factory):
    from tools.tiny import make_tiny
    return make_tiny(tmp_path_factory.mktemp("mxfp4"), blocks=True, quant="mxfp4")


@pytest.fixture(scope="module")
def mxfp4_model(mxfp4_folder):
    from engine.model.loader import load
    return load(mxfp4_folder, resident="quantized").model


def test_moe_kernels_choice(mxfp4_model, monkeypatch):
    """auto keeps our kernels where humming cannot serve; a named humming choice is refused saying why
    (here: humming-kernels is not installed, or the model keeps no quantized experts); unknown names too."""
    from engine.model.kernel_layouts import lay_out_experts
    from engine.model.loader import load
    assert lay_out_experts(mxfp4_model, "auto") == "triton"
    assert lay_out_experts(mxfp4_model, "triton") == "triton"
    assert mxfp4_model.transformer.layers[0].mlp.w1.layout is None
    if humming.installed() is None:
        with pytest.raises(ValueError, match=r"--moe-kernels humming-fp8: humming-kernels 0.1.19 is not installed"):
            lay_out_experts(mxfp4_model, "humming-fp8")
    with pytest.raises(ValueError, match="--moe-kernels 'cutlass': one of auto, triton, humming, humming-fp8"):
        lay_out_experts(mxfp4_model, "cutlass")
    from engine import EMBEDDED_MODEL
    with pytest.raises(ValueError, match="keeps no quantized experts"):
        lay_out_experts(load(EMBEDDED_MODEL).model, "humming")


@pytest.mark.parametrize("choice, activations", [("auto", "fp8"), ("humming-fp8", "fp8"), ("humming", "bf16")])
def test_auto_lays_the_experts_out_for_w4a8(mxfp4_folder, monkeypatch, choice, activations):
    """Where humming can take the experts, auto is its W4A8 (humming-fp8: faster in every phase, as accurate on
    the embedded model scored with W4A8's numbers, docs/benchmarks.md); `humming` keeps bf16 activations. The
    layout itself is humming's (GPU tests): here a stand-in records what it was asked for."""
    from engine.model import kernel_layouts
    from engine.model.loader import load
    from hunyuan_kernels.quant.formats import KernelLayout, QWeight
    asked = []

    def lay_out(w, acts="bf16", micros=None):
        asked.append(acts)
        return QWeight(w.fmt, w.codes, w.scales, None, False, KernelLayout("humming", w.shape, acts, None))
    monkeypatch.setattr(kernel_layouts, "why_not_humming", lambda moes, lora_mlp, activations="fp8": None)
    monkeypatch.setattr(humming, "lay_out", lay_out)
    model = load(mxfp4_folder, resident="quantized").model
    assert kernel_layouts.lay_out_experts(model, choice) == ("humming" if activations == "bf16" else "humming-fp8")
    assert asked and set(asked) == {activations}
    assert all(m.mlp.w1.layout.activations == activations for m in model.transformer.layers)


def test_auto_keeps_triton_when_humming_fails_on_the_first_layer(mxfp4_folder, monkeypatch):
    """humming installed but unable to compile here: auto keeps ours before any pack changed and says why;
    a named choice fails the load with humming's error."""
    from engine.model import kernel_layouts
    from engine.model.loader import load

    def lay_out(w, acts="bf16", micros=None):
        raise RuntimeError("NVRTC is not available")
    monkeypatch.setattr(kernel_layouts, "why_not_humming", lambda moes, lora_mlp, activations="fp8": None)
    monkeypatch.setattr(humming, "lay_out", lay_out)
    model = load(mxfp4_folder, resident="quantized").model
    notes: list[str] = []
    assert kernel_layouts.lay_out_experts(model, "auto", notes=notes) == "triton"
    assert notes == ["humming could not lay out the experts (RuntimeError: NVRTC is not available); "
                     "they run on triton"]
    assert all(m.mlp.w1.layout is None and m.mlp.w2.layout is None for m in model.transformer.layers)
    with pytest.raises(RuntimeError, match="NVRTC"):
        kernel_layouts.lay_out_experts(model, "humming-fp8")


@pytest.mark.parametrize("quant", ["mxfp8", "nvfp4-ct", "fp8-channel-modelopt"])
def test_auto_keeps_other_formats_on_triton_and_a_named_choice_lays_them_out(tmp_path, monkeypatch, quant):
    """NVFP4 / MXFP8 / FP8 experts go to humming only when named (not timed there yet): auto keeps triton."""
    from engine.model import kernel_layouts
    from engine.model.loader import load
    from hunyuan_kernels.quant.formats import KernelLayout, QWeight
    from tools.tiny import make_tiny
    asked = []

    def lay_out(w, acts="bf16", micros=None):
        asked.append((w.fmt, acts))
        return QWeight(w.fmt, w.codes, w.scales, w.gscale, w.inverse, KernelLayout("humming", w.shape, acts, None))
    monkeypatch.setattr(kernel_layouts, "why_not_humming", lambda moes, lora_mlp, activations="fp8": None)
    monkeypatch.setattr(humming, "lay_out", lay_out)
    folder = make_tiny(tmp_path / quant, blocks=True, quant=quant)
    fmt = {"mxfp8": "mxfp8", "nvfp4-ct": "nvfp4"}.get(quant, "fp8")
    assert kernel_layouts.lay_out_experts(load(folder, resident="quantized").model, "auto") == "triton"
    assert not asked
    assert kernel_layouts.lay_out_experts(load(folder, resident="quantized").model, "humming-fp8") == "humming-fp8"
    assert asked and set(asked) == {(fmt, "fp8")}
    assert kernel_layouts.humming_hint(load(folder, resident="quantized").model, (9, 0)) is None


def test_the_start_up_line_names_the_kernels_that_are_not_ours():
    from engine.model.kernel_layouts import kernels_text
    assert kernels_text("triton", "triton") == kernels_text(None, None) == ""
    assert kernels_text("humming-fp8", "triton") == "experts on humming-fp8 (W4A8)"
    assert kernels_text("humming", "fp8") == "experts on humming (W4A16), MXFP8 weights on fp8 (W8A8)"


def test_the_start_up_hint_says_when_humming_is_one_pip_away(mxfp4_model, monkeypatch):
    """Only on a Hopper GPU, with MXFP4 experts humming could take, when it is not installed."""
    from engine import EMBEDDED_MODEL
    from engine.model.kernel_layouts import humming_hint
    from engine.model.loader import load
    assert humming_hint(mxfp4_model, (9, 0)) is None            # the tiny shapes: humming's tiles do not fit
    monkeypatch.setattr(humming, "fits_pack", lambda w, activations="bf16": None)
    monkeypatch.setattr(humming, "installed", lambda: None)
    assert "pip install '.[humming]'" in humming_hint(mxfp4_model, (9, 0))
    assert humming_hint(mxfp4_model, (8, 0)) is None and humming_hint(mxfp4_model, None) is None
    assert humming_hint(load(EMBEDDED_MODEL).model, (9, 0)) is None      # no quantized experts
    monkeypatch.setattr(humming, "installed", lambda: "0.1.19")
    assert humming_hint(mxfp4_model, (9, 0)) is None


def test_why_not_humming_names_the_mlp_adapters_and_the_tiles(mxfp4_model, monkeypatch):
    from engine.model import kernel_layouts
    monkeypatch.setattr(humming, "available", lambda: True)     # as on a Hopper GPU with the extra installed
    moes = kernel_layouts._quantized_moes(mxfp4_model)
    assert "--lora-mlp" in kernel_layouts.why_not_humming(moes, lora_mlp=True)
    assert "N % 64 == 0 and K % 128 == 0" in kernel_layouts.why_not_humming(moes, lora_mlp=False)   # tiny shapes
