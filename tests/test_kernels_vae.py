"""The VAE's kernel ops: `conv3d_same` (hunyuan_kernels/vae/conv.py) and `group_norm_swish`
(hunyuan_kernels/vae/group_norm.py).

CPU: the references are the module's code before the ops (bit for bit, and the VAE's output with the
old forward patched back in is unchanged); the fast paths run under Triton's CPU interpreter (a child
pytest with TRITON_INTERPRET=1) and equal F.conv3d / the reference in fp32 to rounding; their kernels
compile for sm_90. GPU (`-m gpu`): the fast backends are the ones chosen for the VAE's dtypes and agree
with the reference within that dtype's bounds, alone and in a whole decode under fp16 autocast.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from kernel_support import INTERPRETED, interpreted, run_interpreter_suite

import hunyuan_kernels as kernels
from hunyuan_kernels.vae import conv, group_norm

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
HALVES = (torch.float16, torch.bfloat16)


def _old_conv_forward(self, x):
    """engine/model/vae.py's `_Conv3d.forward` before the op."""
    if x.shape[2] == 1:
        k = self.weight.shape[2] // 2
        return F.conv2d(x[:, :, 0], self.weight[:, :, k], self.bias, padding=self.padding[1:]).unsqueeze(2)
    return F.conv3d(x, self.weight, self.bias, padding=self.padding)


def _old_norm_swish(norm, x):
    y = norm(x)
    return y * torch.sigmoid(y)


def _conv_inputs(B, cin, cout, T, H, W, k, bias, g, device="cpu", dtype=torch.float32):
    x = torch.randn(B, cin, T, H, W, generator=g, device=device)
    w = torch.randn(cout, cin, k, k, k, generator=g, device=device) / (cin * k ** 3) ** 0.5
    b = torch.randn(cout, generator=g, device=device) if bias else None
    return x.to(dtype), w.to(dtype), (b.to(dtype) if bias else None), (k // 2,) * 3


# ---- CPU: references and the module --------------------------------------------------------------

def test_cpu_chooses_the_references():
    for dt in (torch.float32, *HALVES):
        for op in ("conv3d_same", "group_norm_swish"):
            assert [i.backend for i in kernels.registry.candidates(op, "cpu", dt)] == ["torch"], op


def test_references_are_the_old_module_code():
    from engine.model.vae import _conv
    g = torch.Generator().manual_seed(0)
    for T in (1, 2, 4):
        for k in (1, 3):
            m = _conv(8, 6, k)
            x = torch.randn(2, 8, T, 5, 7, generator=g)
            assert torch.equal(conv.conv3d_same_ref(x, m.weight, m.bias, m.padding), _old_conv_forward(m, x))
    norm = torch.nn.GroupNorm(4, 8, eps=1e-6)
    x = torch.randn(2, 8, 3, 5, 7, generator=g)
    assert torch.equal(group_norm.group_norm_swish_ref(x, norm.weight, norm.bias, 4, 1e-6), _old_norm_swish(norm, x))


def test_vae_output_unchanged(monkeypatch):
    """The tiny VAE (the golden tests' config and weights) gives the same numbers with the pre-op
    forward code patched back in."""
    import engine.model.vae as vae_mod
    from test_vae import TINY, recipe_weights
    vae = vae_mod.AutoencoderKLConv3D(TINY).eval()
    vae.load_state_dict(recipe_weights({k: tuple(v.shape) for k, v in vae.state_dict().items()}))
    g = torch.Generator().manual_seed(5)
    images, z = torch.rand(1, 3, 32, 48, generator=g) * 2 - 1, torch.randn(1, 16, 2, 3, generator=g)

    def run():
        with torch.no_grad():
            return vae.encode_moments(images)[0], vae.decode_latent(z)
    new = run()
    monkeypatch.setattr(vae_mod._Conv3d, "forward", _old_conv_forward)
    monkeypatch.setattr(vae_mod, "_norm_swish", _old_norm_swish)
    old = run()
    assert all(torch.equal(a, b) for a, b in zip(new, old))


def test_conv_tap_plan():
    assert conv.used_taps(3, 1, 1) == (1, 2)          # one frame: the centre tap only
    assert conv.used_taps(3, 1, 2) == (0, 3)
    assert conv.used_taps(1, 0, 4) == (0, 1)
    w = torch.randn(3, 8, 3, 3, 3)
    ws, cpad = conv.stacked_tap_weight(w, 0, 3)
    assert cpad == 8 and ws.shape == (24, 8, 3, 3) and ws.is_contiguous(memory_format=torch.channels_last)
    for k in range(3):
        assert torch.equal(ws[k * 8:k * 8 + 3], w[:, :, k]) and not ws[k * 8 + 3:(k + 1) * 8].any()


# ---- Triton interpreter (CPU) --------------------------------------------------------------------

def test_triton_interpreter_suite():
    run_interpreter_suite(__file__)


@pytest.fixture
def interp(monkeypatch):
    """Interpreter shims, and every torch.empty of a float dtype NaN-filled (unwritten outputs fail)."""
    interpreted()
    real = torch.empty

    def nan_empty(*a, **kw):
        t = real(*a, **kw)
        return t.fill_(float("nan")) if t.is_floating_point() else t
    monkeypatch.setattr(torch, "empty", nan_empty)


CONV_CASES = [  # (B, Cin, Cout, T, H, W, k)
    (1, 8, 8, 1, 5, 7, 3), (2, 8, 5, 1, 7, 9, 3), (1, 16, 24, 2, 5, 3, 3), (2, 8, 13, 2, 9, 5, 3),
    (1, 8, 8, 4, 7, 7, 3), (2, 16, 3, 4, 5, 9, 3), (1, 16, 24, 4, 5, 3, 1), (2, 8, 8, 2, 3, 5, 1),
]


@pytest.mark.parametrize("B,cin,cout,T,H,W,k", CONV_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_interp_conv_taps_equals_conv3d(interp, B, cin, cout, T, H, W, k, bias):
    x, w, b, pad = _conv_inputs(B, cin, cout, T, H, W, k, bias, torch.Generator().manual_seed(T * 100 + cout))
    want = F.conv3d(x, w, b, padding=pad)
    got = conv.conv3d_same_taps(x, w, b, pad)
    assert got.shape == want.shape and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # channels_last_3d input (its frames are a view) and a strided one give the same numbers
    assert torch.equal(conv.conv3d_same_taps(x.to(memory_format=torch.channels_last_3d), w, b, pad), got)
    xs = torch.cat([x, x], dim=3)[:, :, :, :H]
    assert torch.equal(conv.conv3d_same_taps(xs, w, b, pad), got)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_interp_frames_channels_last_is_the_permute_copy(interp, dtype):
    x = torch.randn(2, 24, 3, 5, 7, generator=torch.Generator().manual_seed(1)).to(dtype)
    for v in (x, x[:, 4:20]):                              # contiguous; a channel slice (strided b)
        f = conv.frames_channels_last(v)
        assert f.shape == (6, v.shape[1], 5, 7) and f.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(f, v.transpose(1, 2).reshape(6, v.shape[1], 5, 7))


def test_interp_conv_taps_bf16(interp):
    x, w, b, pad = _conv_inputs(1, 16, 16, 4, 6, 5, 3, True, torch.Generator().manual_seed(9), dtype=torch.bfloat16)
    want = F.conv3d(x.float(), w.float(), b.float(), padding=pad)
    got = conv.conv3d_same_taps(x, w, b, pad)
    assert got.dtype == torch.bfloat16
    # three taps rounded to bf16 then summed: a few bf16 ulps of the output's scale
    torch.testing.assert_close(got.float(), want, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("shape,groups", [((2, 8, 3, 5, 7), 4), ((1, 64, 2, 9, 11), 32), ((3, 32, 17), 8)])
@pytest.mark.parametrize("in_dtype,out_dtype", [(torch.float32, None), (torch.float32, torch.bfloat16),
                                                (torch.bfloat16, torch.float32)])
@pytest.mark.parametrize("block,split", [(4096, 1024), (16, 3)])   # one block per group; many, merged
def test_interp_group_norm_swish(interp, shape, groups, in_dtype, out_dtype, block, split):
    g = torch.Generator().manual_seed(groups)
    x = (torch.randn(shape, generator=g) * 3 + 2).to(in_dtype)
    w, b = torch.randn(shape[1], generator=g) * 0.3 + 1, torch.randn(shape[1], generator=g) * 0.2
    want = group_norm.group_norm_swish_ref(x.float(), w, b, groups, 1e-6, out_dtype)
    got = group_norm.launch(x, w, b, groups, 1e-6, out_dtype, block=block, max_split=split)
    assert got.dtype == (out_dtype or in_dtype) and got.shape == x.shape
    tol = 1e-5 if got.dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(got.float(), want.float().to(got.dtype).float(), rtol=tol, atol=tol)


def _sm90_compile(fn, sig: dict, const: dict, num_warps: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    sig = {**sig, **{k: "constexpr" for k in const}}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps})


@pytest.mark.skipif(INTERPRETED, reason="compiles for the GPU")
def test_kernels_compile_for_hopper():
    pytest.importorskip("triton")
    try:
        from triton.backends import backends
        assert "nvidia" in backends
    except (ImportError, AssertionError):
        pytest.skip("Triton has no NVIDIA backend here")
    i32 = "i32"
    for dt in ("fp16", "bf16"):
        p = f"*{dt}"
        for taps, first, has_bias, block_c in ((3, -1, True, 64), (1, 0, False, 16), (3, -1, False, 16),
                                               (2, 0, True, 64), (1, 0, True, 64)):
            _sm90_compile(conv._tap_sum_kernel, dict(
                y_ptr=p, bias_ptr=p, out_ptr=p, T=i32, P=i32, C=i32, **{s: i32 for s in (
                    "syb", "syt", "syp", "syk", "syc", "sob", "soc", "sot", "sop")}),
                dict(TAPS=taps, FIRST=first, HAS_BIAS=has_bias, BLOCK_P=4096 // block_c, BLOCK_C=block_c), 4)
    for xt in ("*fp32", "*fp16", "*bf16"):
        _sm90_compile(group_norm._gn_partial_kernel, dict(x_ptr=xt, part_ptr="*fp32", N=i32, CHUNK=i32, SPLIT=i32),
                      dict(BLOCK=group_norm.BLOCK), 8)
        for ot in ("*fp16", "*bf16", "*fp32"):
            _sm90_compile(group_norm._gn_swish_kernel, dict(x_ptr=xt, stats_ptr="*fp32", w_ptr="*fp32", b_ptr="*fp32",
                                                            out_ptr=ot, C=i32, S=i32, CG=i32),
                          dict(BLOCK=group_norm.BLOCK), 8)
    _sm90_compile(group_norm._gn_stats_kernel, dict(part_ptr="*fp32", stats_ptr="*fp32", SPLIT=i32, eps="fp32"),
                  dict(BLOCK_S=1024), 4)


# ---- CUDA -----------------------------------------------------------------------------------------

def _poison_pool(*shapes_dtypes):
    """NaN-fill freed blocks of the caching allocator so that an element a kernel leaves unwritten
    reads NaN (the next allocations of these sizes reuse them)."""
    bufs = [torch.full(s, float("nan"), dtype=d, device="cuda") for s, d in shapes_dtypes]
    del bufs


def _err(got, want):
    return (got.double() - want.double()).abs().max().item()


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", HALVES)
@pytest.mark.parametrize("B,cin,cout,T,H,W,k", [
    (1, 128, 128, 4, 96, 80, 3), (2, 64, 48, 2, 33, 47, 3), (1, 256, 512, 1, 32, 32, 3), (1, 128, 3, 4, 64, 64, 3),
    (1, 1024, 1024, 1, 16, 16, 1), (1, 64, 64, 4, 20, 20, 1)])
def test_gpu_conv3d_same(dtype, B, cin, cout, T, H, W, k):
    x, w, b, pad = _conv_inputs(B, cin, cout, T, H, W, k, True, torch.Generator("cuda").manual_seed(cin + T),
                                device="cuda", dtype=dtype)
    truth = F.conv3d(x.double(), w.double(), b.double(), padding=pad)     # exact for the rounded inputs
    ref = conv.conv3d_same_ref(x, w, b, pad)
    _poison_pool((ref.shape, dtype), ((B * T, 3 * cout, H, W), dtype))
    got = kernels.call("conv3d_same", x, w, b, pad)
    assert kernels.chosen("conv3d_same") == "taps2d"
    assert got.shape == ref.shape and got.dtype == dtype and torch.isfinite(got).all()
    # the fast path rounds each tap's sum once more than F.conv3d: its error to the exact result
    # stays within a small multiple of the reference's own
    ulp = 2.0 ** -10 if dtype == torch.float16 else 2.0 ** -7
    e_got, e_ref = _err(got, truth), _err(ref, truth)
    assert e_got <= 3 * e_ref + ulp * truth.abs().max().item(), (e_got, e_ref)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("in_dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 128, 4, 256, 256), (2, 64, 3, 17, 29), (1, 1024, 1, 64, 64)])
def test_gpu_group_norm_swish(in_dtype, shape):
    g = torch.Generator("cuda").manual_seed(shape[1])
    x = (torch.randn(shape, generator=g, device="cuda") * 2 + 0.5).to(in_dtype)
    w = torch.randn(shape[1], generator=g, device="cuda") * 0.1 + 1
    b = torch.randn(shape[1], generator=g, device="cuda") * 0.1
    out_dtype = torch.bfloat16 if in_dtype == torch.bfloat16 else torch.float16
    with torch.autocast("cuda", dtype=out_dtype):
        ref = group_norm.group_norm_swish_ref(x, w, b, 32, 1e-6, out_dtype)
        _poison_pool((shape, out_dtype))
        got = kernels.call("group_norm_swish", x, w, b, 32, 1e-6, out_dtype)
    assert kernels.chosen("group_norm_swish") == "triton"
    assert got.dtype == out_dtype and torch.isfinite(got).all()
    tol = 2e-3 if out_dtype == torch.float16 else 1.6e-2
    torch.testing.assert_close(got.float(), ref.float(), rtol=tol, atol=tol)
    assert (got != ref).float().mean() < 0.01      # rounding flips only, not a systematic error


@pytest.mark.gpu
@needs_cuda
def test_gpu_vae_decode_fast_equals_reference():
    """The real VAE config (recipe weights) decoding a 256x256 image under fp16 autocast: with the fast
    ops its error to the fp32 decode (TF32 off) is within a small multiple of the reference ops' own."""
    from engine.model.vae import AutoencoderKLConv3D
    from test_vae import REAL
    with torch.device("cuda"):
        vae = AutoencoderKLConv3D(REAL).eval()
    g = torch.Generator("cuda").manual_seed(0)
    with torch.no_grad():     # test_vae's recipe (norms ~1, biases ~0.05, kernels ~1/sqrt(fan_in)), drawn on the GPU
        for name, p in vae.named_parameters():
            r = torch.randn(p.shape, generator=g, device="cuda")
            p.copy_(1 + 0.1 * r if ".norm" in name and name.endswith(".weight") else
                    0.05 * r if p.ndim == 1 else r / p[0].numel() ** 0.5)
    z = torch.randn(1, 32, 16, 16, generator=g, device="cuda")

    def decode(autocast):
        with torch.no_grad(), torch.autocast("cuda", dtype=torch.float16, enabled=autocast):
            return vae.decode_latent(z).float()
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with kernels.allowed():
            truth, ref = decode(False), decode(True)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    got = decode(True)
    assert kernels.chosen("conv3d_same") == "taps2d" and kernels.chosen("group_norm_swish") == "triton"
    assert torch.isfinite(got).all()
    def rms(a):
        return a.double().square().mean().sqrt().item()
    e_ref, e_got = rms(ref - truth) / rms(truth), rms(got - truth) / rms(truth)
    print(f"decode rms error vs fp32: reference ops {e_ref:.2e}, fast ops {e_got:.2e}; "
          f"max |fast - reference| {_err(got, ref):.2e}")
    assert e_got <= 2 * e_ref + 1e-4
