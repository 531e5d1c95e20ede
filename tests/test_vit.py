"""Tests for engine/model/vit.py: SigLIP2 NaFlex preprocessing, vision encoder and aligner.

Golden data (tests/data/vit_golden.safetensors) was produced OUTSIDE this repo by the official
HunyuanImage-3.0 code (hunyuan_image_3/siglip2.py: Siglip2VisionTransformer + LightProjector) and by
transformers 4.57.1's Siglip2ImageProcessorFast (torch 2.14.1 / torchvision 0.29.1, x86_64 AVX512
CPU, fp32), built from TINY_VIT / TINY_PROC / TINY_ALIGNER below. Recipe, reproducible from this file:

* images: ``golden_images()`` (integer-only numpy patterns, so they are identical everywhere);
* preprocessing: ``Siglip2ImageProcessorFast.from_dict(TINY_PROC)(image)`` for each image. The
  valid rows of ``pixel_values`` are stored losslessly as uint8 ``u = pixel * 127.5 + 127.5``
  (exact: pixels are (u - 127.5) / 127.5 in float32); padding rows are all zero;
* weights: ``seed_params(module, 0)`` on the official vision tower (its unused ``head.*`` skipped)
  and ``seed_params(module, 1)`` on the official aligner;
* outputs: the official tower on the batch of the three preprocessed images
  (``last_hidden_state``, [3, 64, 32]) and the official aligner on that ([3, 64, 64]).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import REFERENCE
from engine.model.vit import Siglip2VisionModel, VisionAligner, VitInput, naflex_target_size, vit_preprocess

DATA = Path(__file__).parent / "data" / "vit_golden.safetensors"

TINY_VIT = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_channels": 3, "patch_size": 16, "num_patches": 16, "hidden_act": "gelu_pytorch_tanh",
            "layer_norm_eps": 1e-6, "attention_dropout": 0.0}
TINY_PROC = {"do_normalize": True, "do_rescale": True, "do_resize": True, "image_mean": [0.5, 0.5, 0.5],
             "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Siglip2ImageProcessorFast",
             "max_num_patches": 64, "patch_size": 16, "resample": 2, "rescale_factor": 1 / 255}
TINY_ALIGNER = {"projector_type": "mlp_gelu", "input_dim": 32, "n_embed": 64, "depth": 2}

ATOL = 1e-5  # fp32; measured max abs diff vs official is ~1e-6


def golden_images() -> list[Image.Image]:
    """Wide and tall downscales to 3x18 and 18x3 patches (padded; the 4x4 position grid shrinks on one
    axis, so its antialiasing matters), and a small square upscaled to the full, unpadded 8x8 grid."""
    images = []
    for w, h in [(400, 70), (35, 203), (45, 45)]:
        y, x = np.mgrid[0:h, 0:w].astype(np.int64)
        r = (x * 7 + y * 3) % 256
        g = ((x // 4 + y // 4) % 2) * 200 + 20  # fine checkerboard: exercises the antialias filter
        b = (x * y) % 251
        images.append(Image.fromarray(np.stack([r, g, b], -1).astype(np.uint8), "RGB"))
    return images


def seed_params(module: torch.nn.Module, seed: int) -> None:
    """Deterministic weights: N(0, 0.2^2) for everything, +1 on LayerNorm weights, in sorted-name order."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            if name.startswith("head."):
                continue
            v = torch.randn(p.shape, generator=g) * 0.2
            if "norm" in name and name.endswith("weight"):
                v += 1.0
            p.copy_(v)


def tiny_models() -> tuple[Siglip2VisionModel, VisionAligner]:
    vit, aligner = Siglip2VisionModel(TINY_VIT), VisionAligner(TINY_ALIGNER)
    seed_params(vit, 0)
    seed_params(aligner, 1)
    return vit.eval(), aligner.eval()


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(DATA))


def _golden_inputs(golden: dict[str, torch.Tensor]) -> list[VitInput]:
    out = []
    for i in range(3):
        u8 = golden[f"pre{i}.pixel_u8"]
        n = TINY_PROC["max_num_patches"]
        pv = torch.zeros(n, u8.shape[1])
        pv[: u8.shape[0]] = (u8.float() - 127.5) / 127.5
        h, w = golden[f"pre{i}.spatial_shape"].tolist()
        out.append(VitInput(pv, golden[f"pre{i}.mask"].bool(), (h, w)))
    return out


def _batch(inputs: list[VitInput]):
    return (torch.stack([x.pixel_values for x in inputs]), torch.stack([x.pixel_attention_mask for x in inputs]),
            [x.spatial_shapes for x in inputs])


# ---------------------------------------------------------------- real config vs the manifest


def _reference_json(name: str) -> dict:
    return json.loads((REFERENCE / name).read_text())


def test_real_config_names_and_shapes_match_manifest():
    cfg = _reference_json("base_config_reference.json")
    manifest = _reference_json("hunyuan_image3_manifest.json")
    with torch.device("meta"):
        ours = {f"vision_model.{k}": list(v.shape) for k, v in Siglip2VisionModel(cfg["vit"]).state_dict().items()}
        ours |= {f"vision_aligner.{k}": list(v.shape) for k, v in VisionAligner(cfg["vit_aligner"]).state_dict().items()}
    for variant in ("instruct", "instruct_distil"):
        shapes = manifest[variant]["shapes"]
        expected = {k: v for k, v in shapes.items()
                    if k.startswith(("vision_model.", "vision_aligner.")) and not k.startswith("vision_model.head.")}
        assert len(expected) == 3 + 27 * 16 + 2 + 4  # embeddings, 27 layers, post-LN, 2 aligner linears
        assert ours == expected, variant


def test_layer_norm_eps_from_config():
    # 1e-6 vs a default 1e-5 is too small an effect to show in the golden comparison
    eps = {m.eps for m in Siglip2VisionModel(TINY_VIT | {"layer_norm_eps": 1e-3}).modules()
           if isinstance(m, torch.nn.LayerNorm)}
    assert eps == {1e-3}


def test_real_config_preprocess_shapes():
    cfg = _reference_json("base_config_reference.json")
    x = vit_preprocess(Image.new("RGB", (1000, 700), (10, 200, 30)), cfg["vit_processor"])
    assert x.pixel_values.shape == (1024, 768) and x.pixel_values.dtype == torch.float32
    h, w = x.spatial_shapes
    assert h * w <= 1024 and int(x.pixel_attention_mask.sum()) == h * w
    assert torch.allclose(x.pixel_values[: h * w, :3], torch.tensor([10, 200, 30]) / 127.5 - 1)


# ---------------------------------------------------------------- golden equivalence


def test_preprocess_matches_official(golden):
    for i, image in enumerate(golden_images()):
        x = vit_preprocess(image, TINY_PROC)
        assert x.spatial_shapes == tuple(golden[f"pre{i}.spatial_shape"].tolist())
        assert torch.equal(x.pixel_attention_mask, golden[f"pre{i}.mask"].bool())
        n = x.spatial_shapes[0] * x.spatial_shapes[1]
        expected = (golden[f"pre{i}.pixel_u8"].float() - 127.5) / 127.5
        assert torch.equal(x.pixel_values[:n], expected), f"image {i}: max diff " \
            f"{(x.pixel_values[:n] - expected).abs().max():.3g}"
        assert not x.pixel_values[n:].any()


def test_forward_matches_official(golden):
    vit, aligner = tiny_models()
    with torch.no_grad():
        out = vit(*_batch(_golden_inputs(golden)))
        torch.testing.assert_close(out, golden["vit_out"], rtol=0, atol=ATOL)
        torch.testing.assert_close(aligner(golden["vit_out"]), golden["aligner_out"], rtol=0, atol=ATOL)


def test_end_to_end_from_images(golden):
    vit, aligner = tiny_models()
    with torch.no_grad():
        out = aligner(vit(*_batch([vit_preprocess(im, TINY_PROC) for im in golden_images()])))
    torch.testing.assert_close(out, golden["aligner_out"], rtol=0, atol=ATOL)


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("max_patches", [64, 256, 1024])
def test_target_size_fits_and_keeps_aspect(max_patches):
    rng = np.random.default_rng(0)
    sizes = [(1, 5000), (5000, 1), (16, 16), (17, 15), (1024, 1024), (2048, 512)]
    sizes += [tuple(int(v) for v in rng.integers(1, 4000, 2)) for _ in range(300)]
    p = 16
    for height, width in sizes:
        th, tw = naflex_target_size(height, width, p, max_patches)
        hp, wp = th // p, tw // p
        assert th % p == 0 and tw % p == 0 and hp >= 1 and wp >= 1
        assert hp * wp <= max_patches, (height, width)
        # Some common scale s gives both sides to within one patch: hp-1 < H*s/p <= hp, same for w.
        lo = max((hp - 1) * p / height, (wp - 1) * p / width)
        hi = min(hp * p / height, wp * p / width)
        assert lo < hi, (height, width, hp, wp)
        if min(height, width) >= 32:  # then the search is not capped by its 100x scale limit
            assert (hp + 1) * (wp + 1) > max_patches, (height, width, hp, wp)


def test_preprocess_mask_and_padding():
    for image in golden_images() + [Image.new("L", (33, 500), 77), Image.new("RGBA", (500, 33))]:
        x = vit_preprocess(image, TINY_PROC)
        h, w = x.spatial_shapes
        assert x.pixel_values.shape == (64, 768)
        assert x.pixel_attention_mask.tolist() == [True] * (h * w) + [False] * (64 - h * w)
        assert (h * 16, w * 16) == naflex_target_size(image.height, image.width, 16, 64)
        assert not x.pixel_values[h * w:].any()


def test_padding_rows_do_not_change_valid_rows():
    vit, _ = tiny_models()
    x = vit_preprocess(golden_images()[1], TINY_PROC)
    h, w = x.spatial_shapes
    n = h * w
    assert n < 64
    junk = x.pixel_values.clone()
    junk[n:] = torch.randn(64 - n, 768, generator=torch.Generator().manual_seed(3)) * 5
    with torch.no_grad():
        padded = vit(x.pixel_values[None], x.pixel_attention_mask[None], [(h, w)])[0]
        junked = vit(junk[None], x.pixel_attention_mask[None], [(h, w)])[0]
        exact = vit(x.pixel_values[None, :n], torch.ones(1, n, dtype=torch.bool), [(h, w)])[0]
        unmasked = vit(junk[None], None, [(h, w)])[0]
    torch.testing.assert_close(padded[:n], exact, rtol=0, atol=ATOL)
    torch.testing.assert_close(junked[:n], exact, rtol=0, atol=ATOL)
    assert (unmasked[:n] - exact).abs().max() > 1e-2  # the mask really is doing the work


def test_batch_equals_single():
    vit, _ = tiny_models()
    inputs = [vit_preprocess(im, TINY_PROC) for im in golden_images()]
    with torch.no_grad():
        batched = vit(*_batch(inputs))
        for i, x in enumerate(inputs):
            torch.testing.assert_close(batched[i], vit(*_batch([x]))[0], rtol=0, atol=ATOL)


def test_autograd_cpu():
    vit, aligner = tiny_models()
    vit.train(), aligner.train()
    inputs = [vit_preprocess(im, TINY_PROC) for im in golden_images()[:2]]
    loss = aligner(vit(*_batch(inputs))).square().mean()
    loss.backward()
    for name, p in list(vit.named_parameters()) + list(aligner.named_parameters()):
        assert p.grad is not None and torch.isfinite(p.grad).all() and p.grad.abs().sum() > 0, name
