"""MX weights folded at load into FP8 per output channel: MXFP8 (`--mxfp8-kernels fp8`): the fold's exactness on
real quantizer output, the folded packs of the mixed MXFP4 build (every micro view still lines up), the
choice's refusals, and a whole request on the folded model (W8A8 through the reference ops on the CPU); and
every MX pack, the MXFP4 experts too (`fold_all_to_fp8`, `train.evaluate --fp8-activations`: W4A8's numbers
on the CPU)."""
from __future__ import annotations

import io

import numpy as np
import pytest
import torch
from PIL import Image as PILImage

from engine.model.kernel_layouts import fold_all_to_fp8, fold_mxfp8_weights
from engine.model.loader import load
from engine.model.packed import QuantPack
from engine.runtime.events import Error, Image
from engine.runtime.request import Request
from engine_drive import make_engine
from hunyuan_kernels.quant.formats import dequant_mxfp4, dequant_mxfp8, e8m0_to_float, fold_mx, fold_rounded
from tools.tiny import make_tiny
from tools.tiny_quant import quantize_mx

E4M3_MIN_NORMAL = 2.0 ** -6


def _spread_weight(n: int = 48, k: int = 512, binades: int = 12, seed: int = 0) -> torch.Tensor:
    """Gaussian rows whose 32-blocks' magnitudes spread over `binades` (a real layer's spread is a few),
    the first 8 rows with every block at one level."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    level = torch.randint(-binades, 1, (n, k // 32), generator=g).float()
    level[:8] = 0
    return (w.view(n, k // 32, 32) * torch.exp2(level)[..., None]).view(n, k)


def test_fold_keeps_every_value_but_the_subnormal_codes_of_lower_blocks():
    codes, scales = quantize_mx(_spread_weight(), 8)
    wq, s = fold_mx(codes, scales)
    assert wq.dtype == torch.float8_e4m3fn and wq.shape == codes.shape and s.shape == (codes.shape[0], 1)
    assert torch.equal(s, e8m0_to_float(scales.amax(dim=-1, keepdim=True)))       # a row's largest block scale
    exact = dequant_mxfp8(codes, scales, torch.float32)
    got = wq.float() * s
    assert torch.equal(got[:8], exact[:8])                    # one scale a row: the codes unchanged
    # a block d binades below its row's largest keeps a code c exactly when c * 2^-d is still a normal E4M3
    shift = torch.exp2((scales.int() - scales.int().amax(dim=-1, keepdim=True)).float())
    shifted = (codes.float().view(*shift.shape, 32) * shift[..., None]).view_as(exact)
    normal = shifted.abs() >= E4M3_MIN_NORMAL
    assert torch.equal(got[normal], exact[normal])
    err = (got - exact).abs()
    assert (err <= 2.0 ** -10 * s).all()                      # half a subnormal step of the row's scale
    changed = (err > 0).float().mean().item()
    assert 0 < changed < 0.2                                  # the spread does round some
    share, worst = fold_rounded(codes, scales)
    assert share == pytest.approx(changed)
    assert 0 < worst <= 2.0 ** -10 * (s / exact.abs().amax(dim=-1, keepdim=True)).max().item()


def test_an_mxfp4_fold_is_exact_within_eight_binades_and_rounds_below_by_half_a_subnormal_step():
    codes, scales = quantize_mx(_spread_weight(binades=12, seed=1), 4)
    wq, s = fold_mx(codes, scales, "mxfp4")
    assert wq.shape == (codes.shape[0], 2 * codes.shape[1]) and s.shape == (codes.shape[0], 1)
    exact = dequant_mxfp4(codes, scales, torch.float32)
    got = wq.float() * s
    # E2M1's smallest magnitude 0.5 times 2^-8 is E4M3's smallest subnormal: blocks up to 8 binades down are exact
    depth = (scales.int().amax(dim=-1, keepdim=True) - scales.int()).repeat_interleave(32, dim=-1)
    assert torch.equal(got[depth <= 8], exact[depth <= 8])
    assert torch.equal(got[:8], exact[:8])
    assert ((got - exact).abs() <= 2.0 ** -10 * s).all()
    share, worst = fold_rounded(codes, scales, "mxfp4")
    assert 0 < share == pytest.approx(((got - exact) != 0).float().mean().item())
    assert worst > 0
    with pytest.raises(ValueError, match="mxfp8 or mxfp4"):
        fold_mx(codes, scales, "nvfp4")


def test_fold_refuses_a_nan_scale():
    codes, scales = quantize_mx(_spread_weight(8, 64), 8)
    scales[3, 1] = 255
    with pytest.raises(ValueError, match="255"):
        fold_mx(codes, scales)


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """The MXFP4-mixed tiny build (experts MXFP4, attention and shared MLP MXFP8), kept quantized."""
    return make_tiny(tmp_path_factory.mktemp("mixed"), blocks=True, quant="mxfp4")


def _mxfp8_packs(model) -> dict[str, QuantPack]:
    return {n: m for n, m in model.named_modules() if isinstance(m, QuantPack) and m.format.fmt == "mxfp8"}


def test_choice_keeps_triton_unless_fp8_is_asked_or_implied(mixed):
    model = load(mixed, resident="quantized").model
    before = _mxfp8_packs(model)
    assert len(before) == 4 * len(model.transformer.layers)      # qkv, o, shared gate/up and down a layer
    assert fold_mxfp8_weights(model, "auto", "triton") == "triton"
    assert fold_mxfp8_weights(model, "auto", "humming") == "triton"
    assert fold_mxfp8_weights(model, "triton", "humming-fp8") == "triton"
    assert _mxfp8_packs(model).keys() == before.keys()
    with pytest.raises(ValueError, match="--mxfp8-kernels 'int8': one of auto, triton, fp8"):
        fold_mxfp8_weights(model, "int8")
    assert fold_mxfp8_weights(model, "auto", "humming-fp8") == "fp8"     # FP8 activations chosen already
    assert not _mxfp8_packs(model)
    from engine import EMBEDDED_MODEL
    with pytest.raises(ValueError, match="keeps no MXFP8 weights"):
        fold_mxfp8_weights(load(EMBEDDED_MODEL).model, "fp8")
    assert fold_mxfp8_weights(load(EMBEDDED_MODEL).model, "auto", "humming-fp8") == "triton"


def test_folded_packs_hold_the_same_weights_in_every_micro_view(mixed):
    plain, folded = (load(mixed, resident="quantized").model for _ in range(2))
    packs = _mxfp8_packs(plain)
    assert fold_mxfp8_weights(folded, "fp8") == "fp8"
    after = dict(folded.named_modules())
    for name, p in packs.items():
        q = after[name]
        assert q.format.fmt == "fp8" and q.shape == p.shape
        # the codes' bytes as they were, one fp32 scale a row for the K/32 E8M0 bytes (less from K > 128)
        assert q.codes.dtype == p.codes.dtype and q.codes.shape == p.codes.shape
        assert q.scales.dtype == torch.float32 and q.scales.shape == (*p.shape[:-1], 1)
        w0, w1 = p.value(), q.value()
        views = [(w0, w1)]
        if len(p.shape) == 3:                                 # rows-packed [micros, r, K]: each micro's rows
            views += [(w0[m], w1[m]) for m in range(p.shape[0])]
        else:                                                 # cols-packed: micro column blocks
            half = p.shape[-1] // 2
            views += [(w0.cols(0, half), w1.cols(0, half)), (w0.cols(half, 2 * half), w1.cols(half, 2 * half))]
        for a, b in views:
            exact, got = a.dequantize(torch.float32), b.dequantize(torch.float32)
            assert got.shape == exact.shape
            assert ((got - exact).abs() <= 2.0 ** -10 * b.scales).all(), name
    for layer in folded.transformer.layers:                  # the experts stay as they were
        assert layer.mlp.w1.format.fmt == layer.mlp.w2.format.fmt == "mxfp4"


def _image(lm) -> np.ndarray:
    req = Request(prompt="a red circle", bot_task="image", steps=2, seed=3)
    events = list(make_engine(lm, preview_every=0).run(req))
    assert not [e for e in events if isinstance(e, Error)], [e for e in events if isinstance(e, Error)]
    img = next(e for e in events if isinstance(e, Image))
    return np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64)


def test_a_request_on_the_folded_model_gives_the_weight_only_image_within_fp8_rounding(mixed):
    """The same request (no reasoning: no sampled token to drift) on the plain packs (W8A16 through the
    reference ops) and on the folded ones (W8A8: every MXFP8 linear's input rows quantized per token)."""
    plain = load(mixed, resident="quantized")
    folded = load(mixed, resident="quantized")
    fold_mxfp8_weights(folded.model, "fp8")
    a, b = _image(plain), _image(folded)
    assert not np.array_equal(a, b)                           # the FP8 activations did run
    mse = ((a - b) ** 2).mean()
    assert 10 * np.log10(255.0 ** 2 / mse) >= 30


def test_an_mxfp8_build_folds_its_experts_too(tmp_path):
    """Every linear of an MXFP8 build (experts included: then the FP8 grouped MoE path) folds, and a request
    runs to the weight-only image within FP8 rounding."""
    folder = make_tiny(tmp_path / "mxfp8", blocks=True, quant="mxfp8")
    plain, folded = load(folder, resident="quantized"), load(folder, resident="quantized")
    assert fold_mxfp8_weights(folded.model, "fp8") == "fp8"
    assert not _mxfp8_packs(folded.model)
    layer = folded.model.transformer.layers[0]
    assert layer.mlp.w1.format.fmt == layer.mlp.w2.format.fmt == "fp8"
    a, b = _image(plain), _image(folded)
    assert not np.array_equal(a, b)
    assert 10 * np.log10(255.0 ** 2 / ((a - b) ** 2).mean()) >= 30


def test_fold_all_folds_the_experts_too_and_a_request_stays_within_fp8_rounding(mixed):
    """Every MX pack of the mixed build (MXFP4 experts included) folded: each pack holds the same weights to
    the fold's bound, and the same request gives the weight-only image within FP8 rounding (W8A8 everywhere,
    as humming-fp8 with --mxfp8-kernels fp8 multiplies)."""
    plain, folded = load(mixed, resident="quantized"), load(mixed, resident="quantized")
    before = {n: m for n, m in plain.model.named_modules() if isinstance(m, QuantPack)}
    assert fold_all_to_fp8(folded.model) == len(before) == 6 * len(folded.model.transformer.layers)
    after = dict(folded.model.named_modules())
    for name, p in before.items():
        q = after[name]
        assert q.format.fmt == "fp8" and q.shape == p.shape and q.codes.shape == p.shape, name
        exact, got = p.value().dequantize(torch.float32), q.value().dequantize(torch.float32)
        assert ((got - exact).abs() <= 2.0 ** -10 * q.scales).all(), name
    assert fold_all_to_fp8(folded.model) == 0                 # nothing plain left
    a, b = _image(plain), _image(folded)
    assert not np.array_equal(a, b)
    assert 10 * np.log10(255.0 ** 2 / ((a - b) ** 2).mean()) >= 30


def test_evaluate_refuses_fp8_activations_with_nothing_to_fold_or_dense_weights(mixed):
    from engine import EMBEDDED_MODEL
    from train.evaluate import evaluate
    with pytest.raises(ValueError, match="keeps no MXFP8 or MXFP4 weights"):
        evaluate(EMBEDDED_MODEL, n=1, threads=None, fp8_activations=True, log=lambda *_: None)
    with pytest.raises(ValueError, match="--resident dense"):
        evaluate(mixed, n=1, threads=None, fp8_activations=True, resident="dense", log=lambda *_: None)
    from train.evaluate import main
    assert main(["--model", str(mixed), "--fp8-activations", "--resident", "dense"]) == 2   # said, before loading
    assert main(["--model", str(EMBEDDED_MODEL), "--fp8-activations", "--n", "1", "--modes", "off"]) == 2
