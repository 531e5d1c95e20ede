"""LoRA adapters as PEFT writes them (the real `peft` library, on a module tree with the checkpoint's layer
names and shapes), applied unmerged: an adapter changes the output and equals a checkpoint with the
merged weights (greedy text identical, image >= 40 dB, fp32 CPU), a request without one equals the base
model bit for bit, requests with different adapters in one batch each give what they give alone, and
folders that cannot be served are refused with a message naming why."""
from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image as PILImage
from safetensors.torch import load_file, save_file
from torch import nn

from engine.model.loader import load
from engine.model.lora import load_adapter
from engine.model.peft import AdapterError, read_peft
from engine.runtime.events import Error, Image, Text
from engine.runtime.pipeline import Pipeline
from engine.runtime.request import Request, RequestError, prepare
from engine.spec import names
from engine.spec.config import ModelConfig
from engine_drive import run_together

peft = pytest.importorskip("peft")

REQUEST = dict(prompt="a red circle", bot_task="think_recaption", max_new_tokens=8, steps=2, seed=3, greedy=True)


# ----------------------------------------------------------------------------- adapters made by peft
class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        D = cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, (cfg.num_heads + 2 * cfg.num_kv_heads) * D, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * D, cfg.hidden_size, bias=False)


class _SharedMlp(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_and_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.shared_intermediate(0), bias=False)


class _Mlp(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.shared_mlp = _SharedMlp(cfg)


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.mlp = _Mlp(cfg)


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.layers = nn.ModuleList(_Layer(cfg) for _ in range(cfg.num_layers))


class _Trained(nn.Module):
    """The module tree a trainer sees: `model.layers.{i}.self_attn.qkv_proj`, ... with the checkpoint's shapes."""
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.model = _Backbone(cfg)


def make_adapter(folder: Path, cfg: ModelConfig, seed: int, std: float = 0.3, **config) -> Path:
    """A PEFT adapter written by peft's save_pretrained, its lora_B non-zero (drawn from `seed`)."""
    torch.manual_seed(seed)
    kw = dict(r=8, lora_alpha=16, target_modules=["qkv_proj", "o_proj"]) | config
    model = peft.get_peft_model(_Trained(cfg), peft.LoraConfig(**kw))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0.0, std)
    model.save_pretrained(str(folder))
    return folder


def merged_checkpoint(src: Path, dst: Path, adapter: Path, cfg: ModelConfig) -> Path:
    """A copy of the checkpoint with W + scale B A in every adapted linear (stored in fp32: no rounding)."""
    shutil.copytree(src, dst)
    layers = read_peft(adapter, cfg).layers
    for shard in dst.glob("*.safetensors"):
        tensors = load_file(str(shard))
        for layer, w in layers.items():
            key = names.weight(layer)
            if key in tensors:
                tensors[key] = tensors[key].float() + w.scale * (w.b @ w.a)
        save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def cfg(tiny) -> ModelConfig:
    return tiny.cfg


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, cfg) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {"plain": make_adapter(root / "plain", cfg, seed=1),
            # rsLoRA with per-module rank and alpha: PEFT's scale alpha / sqrt(r), the patterns as PEFT matches them
            "patterned": make_adapter(root / "patterned", cfg, seed=2, r=4, lora_alpha=8, use_rslora=True,
                                      rank_pattern={"layers.1.self_attn.o_proj": 2}, alpha_pattern={"o_proj": 3})}


@pytest.fixture(scope="module")
def served(tiny_dir, adapters):
    """The tiny checkpoint with both adapters loaded (its own copy of the model: the tables are its own)."""
    lm = load(tiny_dir)
    tables = lm.model.enable_lora(capacity=3, max_rank=8)
    for name, folder in adapters.items():
        load_adapter(tables, name, folder)
    return lm


def outcome(events: list) -> tuple[str, np.ndarray]:
    errors = [e for e in events if isinstance(e, Error)]
    assert not errors, errors
    text = "".join(e.delta for e in events if isinstance(e, Text))
    img = next(e for e in events if isinstance(e, Image))
    return text, np.asarray(PILImage.open(io.BytesIO(img.png)), dtype=np.float64)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a - b) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255 ** 2 / mse)


def differs(a: tuple[str, np.ndarray], b: tuple[str, np.ndarray]) -> bool:
    """Another text, image size (the model chose another ratio) or image (< 30 dB)."""
    return a[0] != b[0] or a[1].shape != b[1].shape or psnr(a[1], b[1]) < 30


def alone(lm, **kw) -> tuple[str, np.ndarray]:
    return outcome(list(Pipeline(lm, preview_every=0).run(Request(**(REQUEST | kw)))))


@pytest.fixture(scope="module")
def base(tiny):
    return alone(tiny)


# ----------------------------------------------------------------------------- reading PEFT folders
def test_reads_what_peft_wrote(adapters, cfg):
    """Every adapted layer's A/B at its rank, and PEFT's scale: alpha / r, or alpha / sqrt(r) with rslora
    and the rank / alpha patterns (o_proj: alpha 3; layer 1's o_proj: rank 2)."""
    plain = read_peft(adapters["plain"], cfg)
    n = [names.layer(i) for i in range(cfg.num_layers)]
    assert set(plain.layers) == {x for i in n for x in (i.qkv_proj, i.o_proj)}
    assert {w.rank for w in plain.layers.values()} == {8} and {w.scale for w in plain.layers.values()} == {2.0}
    pat = read_peft(adapters["patterned"], cfg).layers
    assert (pat[n[0].qkv_proj].rank, pat[n[0].qkv_proj].scale) == (4, 8 / 2)
    assert (pat[n[0].o_proj].rank, pat[n[0].o_proj].scale) == (4, 3 / 2)
    assert pat[n[1].o_proj].rank == 2 and pat[n[1].o_proj].scale == pytest.approx(3 / 2 ** 0.5)
    assert all(w.b.abs().sum() > 0 for w in pat.values())


# ----------------------------------------------------------------------------- the adapter's effect on tp1
@pytest.mark.parametrize("adapter", ["plain", "patterned"])
def test_adapter_equals_merged_checkpoint(served, base, tiny_dir, adapters, cfg, tmp_path, adapter):
    """The unmerged adapter gives the merged checkpoint's greedy text and image (>= 40 dB), and differs from the
    base model."""
    got = alone(served, lora=adapter)
    merged = alone(load(merged_checkpoint(tiny_dir, tmp_path / "merged", adapters[adapter], cfg)))
    assert got[0] == merged[0]
    assert psnr(got[1], merged[1]) >= 40
    assert differs(got, base)                                       # it does change the output


def test_lora_scale_is_the_strength(served, base):
    """lora_scale s scales the low-rank update: s and 2s give different images, both unlike the base model."""
    one, two = alone(served, lora="plain"), alone(served, lora="plain", lora_scale=2.0)
    assert differs(one, two) and differs(two, base)


def test_no_adapter_equals_the_base_model(served, base):
    """A request without an adapter on an engine with adapter tables: the base model's text and image, bit
    for bit (slot 0 adds exact zeros)."""
    got = alone(served)
    assert got[0] == base[0] and np.array_equal(got[1], base[1])


def test_different_adapters_in_one_batch_each_equal_their_solo_run(served):
    """Three requests decoded together (one batched decode forward, one row each): no adapter, one and the
    other; each gives its solo run's greedy text and image."""
    kws = [REQUEST, REQUEST | dict(lora="plain"), REQUEST | dict(lora="patterned", lora_scale=0.5)]
    events, scheduler = run_together(served, kws)
    assert scheduler.pipeline.pool.decode.forwards < sum(kw["max_new_tokens"] for kw in kws)    # they shared steps
    for i, kw in enumerate(kws):
        want, got = alone(served, **kw), outcome(events[i])
        assert got[0] == want[0], i
        assert psnr(got[1], want[1]) >= 40, i
    assert differs(outcome(events[1]), outcome(events[0])) and differs(outcome(events[2]), outcome(events[0]))


# ----------------------------------------------------------------------------- what is refused
def test_request_names_a_loaded_adapter(served):
    adapters = Pipeline(served, preview_every=0).adapters()
    assert sorted(adapters) == ["patterned", "plain"]
    with pytest.raises(RequestError, match="unknown LoRA adapter 'nope'; the loaded ones are patterned, plain") as e:
        prepare(Request("a cat", lora="nope", seed=1), served.gen, served.buckets, adapters)
    assert e.value.field == "lora"
    with pytest.raises(RequestError, match=r"lora_scale must be a number in \(0, 4\]") as e:
        prepare(Request("a cat", lora="plain", lora_scale=0, seed=1), served.gen, served.buckets, adapters)
    assert e.value.field == "lora_scale"


def _edit_config(folder: Path, **changes) -> Path:
    cfg = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps(cfg | changes))
    return folder


@pytest.mark.parametrize("case,message", [
    ("dora", "use_dora = True is not supported: DoRA"),
    ("modules_to_save", "modules_to_save = \\['lm_head'\\] is not supported"),
    ("mlp", "it adapts model.layers.0.mlp.shared_mlp.gate_and_up_proj; only the attention projections"),
    ("unknown", "it adapts 'model.layers.0.self_attn.qkv', which is not a linear layer of this model"),
    ("beyond", "it adapts 'model.layers.2.self_attn.qkv_proj', which is not a linear layer of this model"),
    ("shape", r"o_proj has lora_A \(8, 128\) and lora_B \(32, 8\); this model's layer is \[64, 128\] at rank 8, "
              r"so they must be \(8, 128\) and \(64, 8\)"),
    ("no_weights", "no adapter_model.safetensors"),
])
def test_unservable_folders_are_refused(tmp_path, cfg, case, message):
    """Each folder as peft (or a hand edit) leaves it, refused with the reason."""
    folder = tmp_path / case
    if case == "dora":
        make_adapter(folder, cfg, seed=3, use_dora=True)
    elif case == "modules_to_save":
        make_adapter(folder, cfg, seed=3)
        _edit_config(folder, modules_to_save=["lm_head"])
    elif case == "mlp":
        make_adapter(folder, cfg, seed=3, target_modules=["qkv_proj", "gate_and_up_proj"])
    elif case in ("unknown", "beyond"):
        make_adapter(folder, cfg, seed=3)
        f = folder / "adapter_model.safetensors"
        t = load_file(str(f))
        old = "model.layers.0.self_attn.qkv_proj" if case == "unknown" else "model.layers.1.self_attn.qkv_proj"
        new = "model.layers.0.self_attn.qkv" if case == "unknown" else "model.layers.2.self_attn.qkv_proj"
        save_file({k.replace(old, new): v for k, v in t.items()}, str(f))
    elif case == "shape":          # trained on a model half as wide
        other = ModelConfig.from_dict(dict(cfg.raw, hidden_size=cfg.hidden_size // 2))
        make_adapter(folder, other, seed=3)
    else:
        make_adapter(folder, cfg, seed=3)
        (folder / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=message):
        read_peft(folder, cfg)
