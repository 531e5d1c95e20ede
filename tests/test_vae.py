"""Tests for engine/model/vae.py (HunyuanImage-3.0 AutoencoderKLConv3D), CPU, fp32.

Golden data (tests/data/vae_golden.safetensors) was produced by the OFFICIAL
`hunyuan_image_3/autoencoder_kl_3d.py` (diffusers 0.35.2, torch 2.13 CPU, fp32, eval mode), built
with TINY below and loaded with `recipe_weights(seed=0)` (same names in both implementations).
Then, with g = torch.Generator().manual_seed(1):
    images = torch.rand(2, 3, 32, 48, generator=g) * 2 - 1
    z      = torch.randn(2, 16, 2, 3, generator=g)
    post   = vae.encode(images).latent_dist             -> "mean", "logvar"   [2,16,1,2,3]
    post.sample(torch.Generator().manual_seed(1234)) * scaling_factor, T squeezed -> "sample_seed1234"
    vae.decode((z / scaling_factor).unsqueeze(2)).sample, T squeezed             -> "decoded"
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import MANIFEST
from engine.model.vae import AutoencoderKLConv3D

DATA = Path(__file__).parent / "data" / "vae_golden.safetensors"

TINY = {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [32, 32, 32, 32, 32], "in_channels": 3,
        "out_channels": 3, "latent_channels": 16, "layers_per_block": 1, "ffactor_spatial": 16,
        "ffactor_temporal": 4, "sample_size": 64, "sample_tsize": 4, "downsample_match_channel": True,
        "upsample_match_channel": True, "scaling_factor": 0.5627}

# The released `vae` config (base_config_reference.json); the Instruct variants use the same VAE.
REAL = {"_class_name": "AutoencoderKLConv3D", "block_out_channels": [128, 256, 512, 1024, 1024], "in_channels": 3,
        "out_channels": 3, "latent_channels": 32, "layers_per_block": 2, "ffactor_spatial": 16,
        "ffactor_temporal": 4, "sample_size": 384, "sample_tsize": 96, "downsample_match_channel": True,
        "upsample_match_channel": True, "scaling_factor": 0.562679178327931}


def recipe_weights(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    """Deterministic weights: one CPU generator, parameters visited in sorted-name order.
    GroupNorm weights ~ 1 + 0.1 N(0,1), other 1-D tensors (biases) ~ 0.05 N(0,1), conv kernels ~ N(0,1)/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for name in sorted(shapes):
        shape = shapes[name]
        t = torch.randn(shape, generator=g, dtype=torch.float32)
        if len(shape) == 1 and ".norm" in name and name.endswith(".weight"):
            t = 1.0 + 0.1 * t
        elif len(shape) == 1:
            t = 0.05 * t
        else:
            t = t / math.sqrt(math.prod(shape[1:]))
        out[name] = t
    return out


@pytest.fixture(scope="module")
def tiny() -> AutoencoderKLConv3D:
    vae = AutoencoderKLConv3D(TINY).eval()
    vae.load_state_dict(recipe_weights({k: tuple(v.shape) for k, v in vae.state_dict().items()}))
    return vae


@pytest.fixture(scope="module")
def golden() -> dict[str, torch.Tensor]:
    return load_file(str(DATA))


def test_real_config_matches_manifest():
    shapes = json.loads(MANIFEST.read_text())["instruct"]["shapes"]
    expected = {k[len("vae."):]: tuple(v) for k, v in shapes.items() if k.startswith("vae.")}
    assert len(expected) == 280
    with torch.device("meta"):
        vae = AutoencoderKLConv3D(REAL)
    got = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    assert sorted(set(got) ^ set(expected)) == []
    assert got == expected
    assert REAL["ffactor_spatial"] == 16 and vae.scaling_factor == REAL["scaling_factor"]
    assert vae.shift_factor is None


def test_golden_encode_moments(tiny, golden):
    with torch.no_grad():
        mean, logvar = tiny.encode_moments(golden["images"])
    assert mean.shape == logvar.shape == (2, 16, 1, 2, 3)
    torch.testing.assert_close(mean, golden["mean"], rtol=0, atol=1e-5)
    torch.testing.assert_close(logvar, golden["logvar"], rtol=0, atol=1e-5)


def test_golden_posterior_sample(tiny, golden):
    with torch.no_grad():
        z = tiny.encode_latent(golden["images"], torch.Generator().manual_seed(1234))
    torch.testing.assert_close(z, golden["sample_seed1234"], rtol=0, atol=1e-5)


def test_golden_decode(tiny, golden):
    with torch.no_grad():
        out = tiny.decode_latent(golden["z"])
    assert out.shape == (2, 3, 32, 48)
    torch.testing.assert_close(out, golden["decoded"], rtol=0, atol=1e-5)


def test_encode_latent_seeded(tiny):
    images = torch.rand(1, 3, 32, 64, generator=torch.Generator().manual_seed(3)) * 2 - 1
    with torch.no_grad():
        a = tiny.encode_latent(images, torch.Generator().manual_seed(0))
        b = tiny.encode_latent(images, torch.Generator().manual_seed(0))
        c = tiny.encode_latent(images, torch.Generator().manual_seed(1))
    assert a.shape == (1, 16, 2, 4)
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize("batch,h,w", [(2, 1, 2), (1, 2, 4)])
def test_decode_shape(tiny, batch, h, w):
    with torch.no_grad():
        out = tiny.decode_latent(torch.randn(batch, 16, h, w))
    assert out.shape == (batch, 3, 16 * h, 16 * w)
    assert torch.isfinite(out).all()


def test_autograd_reaches_all_parameters():
    vae = AutoencoderKLConv3D(TINY)
    images = torch.rand(1, 3, 32, 32) * 2 - 1
    mean, logvar = vae.encode_moments(images)
    loss = vae.decode_latent(mean.squeeze(2)).square().mean() + logvar.square().mean()
    loss.backward()
    assert all(p.grad is not None for p in vae.parameters())


@pytest.mark.parametrize("change,match", [
    ({"latent_channels": 32}, "2\\*latent_channels"),               # 32 % (2 * 32) != 0
    ({"block_out_channels": [32, 32, 48, 32, 32]}, "GroupNorm"),     # 48 is not a multiple of 32 groups
    ({"block_out_channels": [32, 32, 32, 32]}, "levels"),            # too few levels for 16x downsampling
    ({"block_out_channels": [32, 64, 32, 288, 32]}, "downsample"),  # DC-AE 32 -> 288: (8*32) % 288 != 0
    ({"ffactor_spatial": 12}, "power of two"),
])
def test_bad_config_raises(change, match):
    with pytest.raises(ValueError, match=match):
        AutoencoderKLConv3D({**TINY, **change})


def test_bad_image_size_raises(tiny):
    with pytest.raises(ValueError):
        tiny.encode_moments(torch.zeros(1, 3, 40, 64))
