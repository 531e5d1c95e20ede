"""hunyuan_kernels/quant/gemv.py: the decode GEMVs on quantized weights. Under Triton's CPU interpreter on small
shapes (every format, 1 / 3 / 8 tokens, routed and shared slots, several micros): the dense GEMV is the
fp32 dot product on the exactly dequantized weight (MX formats: the reference's bf16 weights) up to the
summation order; the MoE decode pair against a per-slot reference; the whole `moe_quant` decode path on
the GEMVs against the op's reference. Marked gpu: the same at the real tp1 / hybrid4 shapes, asserting
that the GEMVs ran."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_support import interpreted, poisoned, rel_err, run_interpreter_suite

import hunyuan_kernels as kernels
import hunyuan_kernels.quant as kq

FMTS = ("mxfp8", "mxfp4", "nvfp4", "fp8")


def _qw(fmt, shape, std, g, device="cpu", inverse=False, gscale_dims=0):
    return kq.random_qweight(fmt, shape, std, device, g, inverse=inverse, gscale_dims=gscale_dims)


# ------------------------------------------------------------------- Triton, CPU interpreter

def test_triton_interpreter_suite():
    """The `test_interp_*` tests below run in a child pytest with TRITON_INTERPRET=1."""
    run_interpreter_suite(__file__)


@pytest.fixture(scope="module")
def qg():
    return interpreted("hunyuan_kernels.quant.gemv")


SMALL = dict(R=16, G=4, num_warps=4)          # several K steps on the small shapes


@pytest.mark.parametrize("fmt", FMTS)
def test_interp_gemv_linear_is_the_dot_product_on_the_dequantized_weight(qg, fmt):
    g = torch.Generator().manual_seed(1)
    for inverse in ((False, True) if fmt == "nvfp4" else (False,)):
        w = _qw(fmt, (40, 256), 0.1, g, inverse=inverse)
        wf = w.dequantize(torch.float32).double()
        for m, prep in ((1, True), (3, False), (8, True)):     # each row count, each layout (CI's time: not all 6)
            x = torch.randn(m, 256, generator=g)                         # fp32: nothing rounded on the way out
            got = poisoned(qg.linear, x, fmt, w.codes, w.scales, w.gscale, w.inverse, cfg=dict(SMALL, PREP=prep))
            assert got.shape == (m, 40) and not got.isnan().any()
            assert rel_err(got, x.double() @ wf.T) < 1e-6, (inverse, m, prep)
        # bf16 tokens against the registered op's reference (its weights rounded to bf16: NVFP4 / FP8 differ
        # by that rounding; FP8 here is weight-only, as the decode path runs it on quantized activations)
        x = torch.randn(2, 5, 256, generator=g).bfloat16()
        got = poisoned(qg.linear, x, fmt, w.codes, w.scales, w.gscale, w.inverse, cfg=dict(SMALL, PREP=True))
        assert got.shape == (2, 5, 40) and got.dtype == torch.bfloat16
        assert rel_err(got, F.linear(x, w.dequantize(torch.bfloat16)).float()) < 5e-3


def test_interp_linear_fp8_gemv_variant_is_w8a8_up_to_a_bf16_activation(qg):
    """linear_fp8's decode variant: rows quantized per token, dequantized to bf16, on the GEMV; against the op's
    reference (cuBLAS's W8A8 numbers in fp32), a cols-packed micro block (strided rows) included."""
    from hunyuan_kernels.quant import cuda
    from hunyuan_kernels.quant.linear import linear_fp8
    g = torch.Generator().manual_seed(8)
    w = _qw("fp8", (40, 512), 0.1, g)
    for m, wt in ((1, w), (5, w), (3, w.cols(256, 512))):
        x = (torch.randn(m, wt.shape[-1], generator=g) * torch.rand(m, 1, generator=g) * 4).bfloat16()
        got = poisoned(cuda.linear_fp8_gemv, x, wt.codes, wt.scales)
        assert got.shape == (m, 40) and got.dtype == torch.bfloat16
        assert rel_err(got, linear_fp8(x, wt.codes, wt.scales)) < 5e-3, m


def test_interp_gemv_linear_strided_rows_and_k_tails(qg):
    g = torch.Generator().manual_seed(2)
    for fmt in FMTS:
        w = _qw(fmt, (24, 512), 0.1, g)
        blk = w.cols(128, 384)                                           # a micro's block of a cols-packed weight
        x = torch.randn(3, 256, generator=g)
        got = poisoned(qg.linear, x, fmt, blk.codes, blk.scales, blk.gscale, blk.inverse, cfg=dict(SMALL, PREP=True))
        assert rel_err(got, x.double() @ w.dequantize(torch.float32).double()[:, 128:384].T) < 1e-6, fmt
    # K a multiple of 16 only (FP8: the last step masked) and 7 MX blocks (one chunk a step)
    for fmt, k in (("fp8", 208), ("mxfp4", 224), ("mxfp8", 224), ("nvfp4", 208)):
        w = _qw(fmt, (20, k), 0.1, g)
        x = torch.randn(2, k, generator=g)
        for prep in (True, False):
            got = poisoned(qg.linear, x, fmt, w.codes, w.scales, w.gscale, w.inverse, cfg=dict(SMALL, PREP=prep))
            assert rel_err(got, x.double() @ w.dequantize(torch.float32).double().T) < 1e-6, (fmt, k)


def test_interp_gemv_every_code_value(qg):
    """Every E2M1 byte (both nibbles) and every finite E4M3 byte, subnormals included, decodes exactly."""
    g = torch.Generator().manual_seed(3)
    e4m3 = torch.arange(256, dtype=torch.int32)
    e4m3 = e4m3[(e4m3 & 0x7F) != 0x7F].to(torch.uint8)                  # 254 finite codes
    codes8 = e4m3.repeat(2)[:256].view(torch.float8_e4m3fn).reshape(8, 32)
    codes4 = torch.arange(256, dtype=torch.int32).to(torch.uint8).reshape(8, 32)        # [8, 64] weight
    cases = [("mxfp8", kq.QWeight("mxfp8", codes8, torch.full((8, 1), 120, dtype=torch.uint8))),
             ("fp8", kq.QWeight("fp8", codes8, torch.full((8, 1), 0.01))),
             ("mxfp4", kq.QWeight("mxfp4", codes4, torch.randint(118, 130, (8, 2), generator=g, dtype=torch.uint8)))]
    for fmt, w in cases:
        k = w.shape[-1]
        x = torch.randn(2, k, generator=g)
        got = poisoned(qg.linear, x, fmt, w.codes, w.scales, cfg=dict(SMALL, PREP=True))
        assert rel_err(got, x.double() @ w.dequantize(torch.float32).double().T) < 1e-6, fmt
        for col in (0, 1, 5, k - 1):                                     # one column at a time: each value
            e = torch.zeros(1, k)
            e[0, col] = 1.0
            got = poisoned(qg.linear, e, fmt, w.codes, w.scales, cfg=dict(SMALL, PREP=False))
            assert torch.equal(got[0], w.dequantize(torch.float32)[:, col]), (fmt, col)


def test_interp_prep_of_fp8_rows_is_quantize_rows_fake_then_prep(qg):
    """The FP8 GEMVs' activations in one launch: bit for bit quantizing and dequantizing each row
    (quantize_rows(fake=True)) and then preparing it; a zero row included; a row read once (its tile in
    registers) and one longer than FP8_PREP_ONE_PASS_WORDS words, read twice."""
    from hunyuan_kernels.quant import triton_kernels as qt
    g = torch.Generator().manual_seed(12)
    for k in (1040, 4 * qg.FP8_PREP_ONE_PASS_WORDS + 16):
        x = (torch.randn(3, k, generator=g) * torch.rand(3, 1, generator=g) * 16).bfloat16()
        x[1] = 0
        x[2, k - 3] = 900.0                       # the amax in the row's last words (the second pass's tile)
        got = poisoned(qg.prep, x, "fp8", fp8_rows=True)
        assert torch.equal(got, qg.prep(qt.quantize_rows(x, fake=True), "fp8")), k


def test_interp_prep_is_the_phase_major_prescaled_layout(qg):
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(4)).bfloat16()
    for fmt in ("mxfp4", "mxfp8"):
        ph = qg.PH[fmt]
        got = poisoned(qg.prep, x, fmt)
        want = x.float().view(3, 64 // ph, ph).transpose(1, 2).reshape(3, 64) * qg.XSCALE
        assert got.dtype == torch.float32 and torch.equal(got, want)


def _routing(n, e, k, g):
    """Each token's k distinct experts (expert 0 for every token: a slot with n tokens), the compact
    ascending list of the chosen ones padded with -1 to min(E, n*k), as router_select returns."""
    ids = torch.stack([torch.cat([torch.zeros(1, dtype=torch.long), 1 + torch.randperm(e - 1, generator=g)[:k - 1]])
                       for _ in range(n)]).int()
    used = torch.unique(ids)
    s = min(e, n * k)
    active = torch.full((s,), -1, dtype=torch.int32)
    active[:used.numel()] = used.int()
    return ids, active


def _swiglu_ref(h, inter):
    return (h[..., :inter] * F.silu(h[..., inter:])).bfloat16().double()


# every format at one row; several rows (and another tile) on the two FP4 formats: CI's time
@pytest.mark.parametrize("fmt,n,tb", [(f, 1, 4) for f in FMTS] + [("mxfp4", 3, 4), ("nvfp4", 3, 4), ("mxfp4", 8, 2)])
def test_interp_gemv_decode_pair_routed_and_shared(qg, fmt, n, tb):
    """decode_up / decode_down on the chosen experts of micros [1, 3) of 3 (the down GEMV on the column
    block of the cols-packed [E, H, micros * I] pack), and on the shared MLP's micro block: every served
    act row and every y row against the fp64 reference on the dequantized weights (act: one bf16
    rounding; y from the kernel's own act, so to fp32 summation order)."""
    g = torch.Generator().manual_seed(5 + n)
    h, inter, e, k, micros, ms, mc = 128, 64, 8, 3, 3, 1, 2
    inv = fmt == "nvfp4"
    ids, active = _routing(n, e, k, g)
    s = active.shape[0]
    x = torch.randn(n, h, generator=g).bfloat16()
    w1 = _qw(fmt, (micros, e, 2 * inter, h), h ** -0.5, g, inverse=inv, gscale_dims=1)
    w2 = _qw(fmt, (e, h, micros * inter), inter ** -0.5, g, inverse=inv, gscale_dims=1)
    d1, d2 = w1.dequantize(torch.float32).double(), w2.dequantize(torch.float32).double()
    ph = qg.act_ph(fmt)
    up, down = dict(BI=8, G=2, num_warps=4, TB=tb), dict(R=16, G=4, num_warps=4, TB=tb)    # up: 2 K steps

    def unprep(a):
        return a.view(*a.shape[:-1], ph, inter // ph).transpose(-1, -2).reshape(a.shape) / qg.XSCALE if ph else a

    # routed
    wa, wb = w1[ms:ms + mc], w2.cols(ms * inter, (ms + mc) * inter)
    act = torch.full((mc, s, n, inter), float("nan"), dtype=torch.float32 if ph else torch.bfloat16)
    qg.decode_up(qg.prep(x, fmt), ids, active, fmt, wa.codes, wa.scales, wa.gscale, wa.inverse, act, s, inter, up,
                 x_prepared=True, act_prep=ph)
    a = unprep(act).double()
    for si in range(s):
        ex = int(active[si])
        toks = [t for t in range(n) if ex >= 0 and ex in ids[t].tolist()]
        for m in range(mc):
            if toks:
                want = _swiglu_ref(x[toks].double() @ d1[ms + m, ex].T, inter)
                assert rel_err(a[m, si, toks], want) < 5e-3, (si, m)
            rest = [t for t in range(n) if t not in toks]
            assert a[m, si, rest].isnan().all()                          # rows of tokens the slot does not serve
    y = torch.full((n * k, h), float("nan"))
    qg.decode_down(act, ids, active, fmt, wb.codes, wb.scales, wb.gscale, wb.inverse, y, s, inter, down=down,
                   act_prepared=bool(ph))
    want = torch.empty(n * k, h, dtype=torch.float64)
    for t in range(n):
        for j in range(k):
            ex = int(ids[t, j])
            si = int((active == ex).nonzero()[0, 0])
            want[t * k + j] = sum(a[m, si, t] @ d2[ex, :, (ms + m) * inter:(ms + m + 1) * inter].T for m in range(mc))
    assert not y.isnan().any() and rel_err(y, want) < 1e-5
    # shared: slot 0 serves every token; down on the cols-packed [H, micros * I] block
    sw1 = _qw(fmt, (micros, 2 * inter, h), h ** -0.5, g, inverse=inv)
    sw2 = _qw(fmt, (h, micros * inter), inter ** -0.5, g, inverse=inv)
    s1, s2 = sw1[ms:ms + mc], sw2.cols(ms * inter, (ms + mc) * inter)
    act_s = torch.full((mc, 1, n, inter), float("nan"), dtype=act.dtype)
    qg.decode_up(qg.prep(x, fmt), ids, None, fmt, s1.codes, s1.scales, s1.gscale, s1.inverse, act_s, 1, inter, up,
                 x_prepared=True, act_prep=ph)
    a_s = unprep(act_s).double()
    ds1, ds2 = sw1.dequantize(torch.float32).double(), sw2.dequantize(torch.float32).double()
    for m in range(mc):
        assert rel_err(a_s[m, 0], _swiglu_ref(x.double() @ ds1[ms + m].T, inter)) < 5e-3
    ys = torch.full((n, h), float("nan"))
    qg.decode_down(act_s, ids, None, fmt, s2.codes, s2.scales, s2.gscale, s2.inverse, ys, 1, inter, down=down,
                   act_prepared=bool(ph))
    want_s = sum(a_s[m, 0] @ ds2[:, (ms + m) * inter:(ms + m + 1) * inter].T for m in range(mc))
    assert not ys.isnan().any() and rel_err(ys, want_s) < 1e-5


def _emulate_scaled_grouped(monkeypatch):
    def emu(xq, xs, wq, ws, offs, dtype):
        acc = torch._grouped_mm(xq.float(), wq.float().transpose(1, 2), offs=offs)
        grp = torch.searchsorted(offs, torch.arange(xq.shape[0], dtype=offs.dtype), right=True)
        return (acc * xs * ws[..., 0].float()[grp.clamp_max(wq.shape[0] - 1).long()]).to(dtype)
    from hunyuan_kernels.quant import cuda
    monkeypatch.setattr(cuda, "scaled_grouped", emu)


@pytest.mark.parametrize("fmt,shared_fmt,n,micro_start,micro_count", [
    ("mxfp4", "mxfp8", 1, 0, 3), ("mxfp4", "mxfp8", 8, 1, 2),                                # MXFP4-mixed
    ("mxfp8", "mxfp8", 2, 0, 2), ("nvfp4", "bf16", 3, 1, 1), ("fp8", "fp8", 5, 0, 2),
])
def test_interp_moe_quant_decode_on_the_gemvs(qg, monkeypatch, fmt, shared_fmt, n, micro_start, micro_count):
    """The op's decode variant (on the GEMVs) against the op's reference."""
    from test_kernels_quant import make_qmoe, qargs
    from hunyuan_kernels.quant import moe, moe_cuda
    _emulate_scaled_grouped(monkeypatch)
    t = make_qmoe(n, fmt, shared_fmt, hidden=128, inter=64, shared_inter=64, inverse=fmt == "nvfp4", seed=30 + n)
    args = qargs(t, micro_start, micro_count)
    calls = []
    real = qg.decode_up
    monkeypatch.setattr(qg, "decode_up", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    out = torch.full_like(t["x"], float("nan"))
    assert moe_cuda.decode_fits(*args)
    got = poisoned(moe_cuda.moe_quant_decode, *args, out=out)
    assert calls and got.data_ptr() == out.data_ptr() and not got.isnan().any()
    assert rel_err(got, moe.moe_quant_reference(*args)) < (3e-2 if fmt == "fp8" else 1e-2)


# ----------------------------------------------------------------------------------------- GPU

gpu = pytest.mark.gpu
BF16 = torch.bfloat16


@pytest.fixture
def gemv_calls(monkeypatch):
    """Counts the GEMV launchers' calls (a GPU test fails if the GEMVs did not run)."""
    from hunyuan_kernels.quant import gemv as quant_gemv
    calls = {"decode_up": 0, "decode_down": 0, "linear": 0}
    for name in calls:
        real = getattr(quant_gemv, name)

        def wrap(*a, _real=real, _name=name, **kw):
            calls[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(quant_gemv, name, wrap)
    return calls


GPU_DECODE = {  # name: (n, experts fmt, shared fmt, inter, micros, micro_start, micro_count)
    "tp1_n1_mxfp4": (1, "mxfp4", "mxfp8", 3072, 1, 0, 1),
    "tp1_n8_mxfp4": (8, "mxfp4", "mxfp8", 3072, 1, 0, 1),
    "tp1_n1_mxfp8": (1, "mxfp8", "mxfp8", 3072, 1, 0, 1),
    "tp1_n3_nvfp4": (3, "nvfp4", "nvfp4", 3072, 1, 0, 1),
    "tp1_n8_fp8": (8, "fp8", "fp8", 3072, 1, 0, 1),
    "hybrid4_n1_mxfp4": (1, "mxfp4", "mxfp8", 768, 2, 1, 1),
    "hybrid4_n8_mxfp4": (8, "mxfp4", "mxfp8", 768, 2, 0, 2),
    "hybrid4_n5_mxfp8": (5, "mxfp8", "bf16", 768, 2, 1, 1),
    "hybrid4_n8_nvfp4": (8, "nvfp4", "nvfp4", 768, 2, 0, 2),
    "hybrid4_n2_fp8": (2, "fp8", "fp8", 768, 2, 0, 1),
    "hybrid4_n8_fp8_two_micros": (8, "fp8", "fp8", 768, 2, 0, 2),    # a down row over both micros, one scale
}


def _gpu_decode_args(name, seed=0):
    from test_kernels_quant import make_qmoe, qargs
    n, fmt, sfmt, inter, micros, ms, mc = GPU_DECODE[name]
    t = make_qmoe(n, fmt, sfmt, hidden=4096, experts=64, inter=inter, shared_inter=inter, micros=micros,
                  inverse=fmt == "nvfp4", device="cuda", seed=seed)
    return qargs(t, ms, mc, topk=8)


def fp8_decode_semantics(x, gate, w1, w2, shared_w1, shared_w2, ms, mc, topk, norm_topk):
    """What the FP8 decode path computes (moe_quant's note): each GEMM input fake-quantized per row to
    E4M3 and rounded to bf16 (a down GEMM's row: every active micro's activations, one scale), the
    weights exact, fp32 products; micro partials summed before the route weights. The W8A8 reference differs from it by those bf16 roundings, which can flip an E4M3 rounding
    of the next GEMM's input (a few 1e-2 on two tokens); against this the kernels must agree closely."""
    import torch.nn.functional as F

    def fake(v):
        q, s = kq.quantize_fp8_rows(v.to(torch.bfloat16))
        return (q.float() * s).to(torch.bfloat16).float()

    def mlp(xq, a, b):                     # a [mc, 2I, H], b [H, mc * I]: one down GEMM over the micros
        h = torch.einsum("th,mih->tmi", xq, a)
        g, u = h.chunk(2, -1)
        return fake((g * F.silu(u)).flatten(1)) @ b.T

    w, idx = kernels.moe.route(x, gate, topk, norm_topk)
    xq = fake(x)
    m = slice(ms, ms + mc)
    i2 = w1.shape[2] // 2
    w1d, w2d = w1[m].dequantize(torch.float32), w2.cols(ms * i2, (ms + mc) * i2).dequantize(torch.float32)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for t in range(x.shape[0]):
        for j in range(topk):
            e = idx[t, j]
            out[t] += w[t, j].float() * mlp(xq[t:t + 1], w1d[:, e], w2d[e])[0]
    if shared_w1 is not None:
        i = shared_w1.shape[1] // 2
        s2 = shared_w2.dequantize(torch.float32)[:, ms * i:(ms + mc) * i]
        out += mlp(xq, shared_w1[m].dequantize(torch.float32), s2)
    return out.to(x.dtype)


@gpu
@pytest.mark.parametrize("name", list(GPU_DECODE))
def test_gpu_moe_decode_gemv_matches_reference(name, gemv_calls):
    from test_kernels_quant import moe_quant_cuda
    args = _gpu_decode_args(name, seed=len(name))
    with kernels.allowed():
        ref = kernels.call("moe_quant", *args)
    out = torch.full_like(args[0], float("nan"))
    got = poisoned(moe_quant_cuda, *args, out=out)
    assert kernels.chosen("moe_quant") == "decode"
    assert gemv_calls["decode_up"] >= 1 and gemv_calls["decode_down"] >= 1
    assert not got.isnan().any()
    if GPU_DECODE[name][1] == "fp8":
        assert rel_err(got, fp8_decode_semantics(*args)) < 5e-3
        assert rel_err(got, ref) < 5e-2
    else:
        assert rel_err(got, ref) < 1e-2


@gpu
@pytest.mark.parametrize("name", ["tp1_n1_mxfp4", "hybrid4_n8_mxfp4"])
def test_gpu_moe_decode_gemv_graph_replay_reproducible_per_token(name, gemv_calls):
    from test_kernels_quant import moe_quant_cuda
    args = _gpu_decode_args(name, seed=7)
    a, b = moe_quant_cuda(*args), moe_quant_cuda(*args)
    assert torch.equal(a, b)
    perm = torch.randperm(args[0].shape[0], device="cuda")
    assert torch.equal(moe_quant_cuda(args[0][perm], *args[1:]), a[perm])
    x_static = args[0].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        moe_quant_cuda(x_static, *args[1:])
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_quant_cuda(x_static, *args[1:])
    fresh = _gpu_decode_args(name, seed=8)[0]
    x_static.copy_(fresh)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, moe_quant_cuda(fresh, *args[1:]))
    assert gemv_calls["decode_up"] > 0


@gpu
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("m", [1, 3, 8])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 4096), (4096, 1024)])     # qkv, o at tp1; o of a TP4 micro
def test_gpu_gemv_linear_matches_reference(fmt, m, n, k, gemv_calls):
    from hunyuan_kernels.quant import gemv as quant_gemv
    g = torch.Generator(device="cuda").manual_seed(m + n + k)
    w = _qw(fmt, (n, k), k ** -0.5, g, "cuda", inverse=fmt == "nvfp4")
    x = torch.randn(m, k, generator=g, device="cuda").to(BF16)
    got = poisoned(quant_gemv.linear, x, fmt, w.codes, w.scales, w.gscale, w.inverse)
    ref = F.linear(x, w.dequantize(BF16))                                # weight-only (FP8 too: the GEMV alone)
    assert gemv_calls["linear"] == 1 and not got.isnan().any()
    assert rel_err(got, ref) < 1e-2


@gpu
@pytest.mark.parametrize("fmt", ["mxfp8", "mxfp4", "nvfp4"])
def test_gpu_qlinear_of_a_few_tokens_runs_the_gemv(fmt, gemv_calls):
    """The registered dense op routes decode-sized inputs to the "gemv" variant, larger ones not."""
    g = torch.Generator(device="cuda").manual_seed(9)
    w = _qw(fmt, (4096, 2 * 1024), 0.03, g, "cuda", inverse=fmt == "nvfp4")
    blk = w.cols(1024, 2048)                                              # a cols-packed micro block: strided rows
    x = torch.randn(1, 3, 1024, generator=g, device="cuda").to(BF16)
    got = kq.qlinear(x, blk)
    with kernels.allowed():
        ref = kq.qlinear(x, blk)
    assert gemv_calls["linear"] == 1 and rel_err(got, ref) < 1e-2
    kq.qlinear(x, blk)
    assert kernels.chosen("linear_" + fmt) == "gemv"
    kq.qlinear(torch.randn(64, 1024, device="cuda").to(BF16), blk)
    assert gemv_calls["linear"] == 2 and kernels.chosen("linear_" + fmt) == "triton"


@gpu
def test_gpu_linear_fp8_of_a_few_tokens_runs_the_gemv(gemv_calls):
    """FP8 (an FP8 build's linears, or MXFP8 folded at load): decode-sized inputs on the GEMV variant (W8A8 up to
    a bf16 activation), larger ones on cuBLAS."""
    g = torch.Generator(device="cuda").manual_seed(10)
    w = _qw("fp8", (4096, 2 * 1024), 0.03, g, "cuda")
    blk = w.cols(1024, 2048)
    x = torch.randn(1, 3, 1024, generator=g, device="cuda").to(BF16)
    got = kq.qlinear(x, blk)
    assert gemv_calls["linear"] == 1 and kernels.chosen("linear_fp8") == "gemv"
    with kernels.allowed():
        ref = kq.qlinear(x, blk)
    assert rel_err(got, ref) < 1e-2
    kq.qlinear(torch.randn(64, 1024, device="cuda").to(BF16), blk)
    assert gemv_calls["linear"] == 1 and kernels.chosen("linear_fp8") == "scaled_mm"
