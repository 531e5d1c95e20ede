"""A LoRA adapter folder as PEFT's `save_pretrained` writes it, read and checked against the model.

The folder: `adapter_config.json` (peft_type LORA, r, lora_alpha, target_modules, use_rslora,
rank_pattern / alpha_pattern: per-module overrides whose keys match a module name's dotted suffix, as
PEFT's `get_pattern_key` matches them) and `adapter_model.safetensors`, one pair per adapted linear:
`base_model.model.<module>.lora_A.weight` [r, in] and `...lora_B.weight` [out, r], where <module> is the
name the trainer saw, which for HunyuanImage-3.0 is the checkpoint's layer name
(`model.layers.3.self_attn.qkv_proj`). PEFT applies y = W x + scale * B (A x) with scale = alpha / r
(alpha / sqrt(r) with rslora).

Supported targets: each decoder layer's `qkv_proj` and `o_proj` (the trainers' default); with
`targets=ALL_TARGETS` also the MLPs' `gate_and_up_proj` and `down_proj` (the shared MLP and every expert:
what PEFT's target names match), which adapter tables hold only when the engine keeps MLP tables
(engine/model/lora.py, `--lora-mlp`) and the merged fast path always takes (engine/model/lora_merge.py).
Everything the low-rank product alone cannot reproduce is refused with a message naming it (DoRA,
modules_to_save, trained biases, ...), as are targets not supported (the MLPs where the engine has no
MLP tables), names that are not this model's, and shapes that do not match its layers. Nothing is read
before the config has been checked.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.model.packed import shard_block
from engine.parallel.layout import ShardLayout
from engine.checkpoint import names
from engine.checkpoint.config import ModelConfig
from engine.checkpoint.shapes import backbone_linears

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."                     # PeftModel's wrapping of the trained model
TARGETS = (names.QKV_PROJ, names.O_PROJ)         # a layer's linears any adapter tables hold
ALL_TARGETS = TARGETS + names.MLP_LINEARS        # ... and with the MLPs' (MLP tables, or merged)
KEY = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.weight$")

# config fields whose non-default value changes what the adapter computes beyond B A x: refused by name
# (value read -> why). Defaults: False / None / "none" / empty.
UNSUPPORTED = {
    "use_dora": "DoRA (use_dora) rescales the merged weight's columns, which an unmerged low-rank product cannot do",
    "modules_to_save": "modules_to_save replaces whole modules of the base model",
    "lora_bias": "lora_bias adds a trained bias to lora_B",
    "fan_in_fan_out": "fan_in_fan_out stores the weights transposed (Conv1D models), not this model's layout",
    "target_parameters": "target_parameters adapts raw parameters, not linear layers",
    "layer_replication": "layer_replication duplicates decoder layers",
    "trainable_token_indices": "trainable_token_indices trains embedding rows",
    "use_qalora": "QA-LoRA (use_qalora) pools the input before lora_A",
    "alora_invocation_tokens": "activated LoRA (alora_invocation_tokens) applies only after given tokens",
}


class AdapterError(ValueError):
    """The adapter folder cannot be served: the message names the folder and what is wrong."""


@dataclass(frozen=True)
class LoraWeights:
    """One adapted linear: A [r, in] and B [out, r] in fp32 (or a rank's slice of them), and PEFT's scale."""
    a: torch.Tensor
    b: torch.Tensor
    scale: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    """An adapter read from a folder: checkpoint layer name -> its weights, the slices a rank of `layout`
    keeps (`_slices`; the default layout: whole)."""
    folder: Path
    layers: dict[str, LoraWeights]
    layout: ShardLayout = ShardLayout()

    @property
    def rank(self) -> int:
        return max(w.rank for w in self.layers.values())

    @property
    def adapts_mlp(self) -> str:
        """The first MLP linear it adapts ('' when it adapts the attention projections only)."""
        return next((m for m in sorted(self.layers) if m.endswith(names.MLP_LINEARS)), "")


def adapted_modules(folder: str | Path) -> set[str]:
    """The layer names a PEFT folder's weights adapt, from the safetensors header alone (no tensor read):
    whether an adapter needs MLP tables is known before anything is loaded. Empty when unreadable (the
    full read then says why)."""
    try:
        with safe_open(str(Path(folder) / WEIGHTS), framework="pt") as f:
            keys = list(f.keys())
    except Exception:      # noqa: BLE001  (a missing or broken file: read_peft names what is wrong)
        return set()
    return {m["module"] for k in keys if (m := KEY.match(k.removeprefix(PREFIX)))}


def _pattern(patterns: dict, module: str, default):
    """PEFT's rule: the first pattern key that matches the module name's dotted suffix."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_config(cfg: dict, where: str) -> None:
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{where}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are supported")
    for field, why in UNSUPPORTED.items():
        if cfg.get(field) not in (None, False, [], {}, ""):
            raise AdapterError(f"{where}: {field} = {cfg[field]!r} is not supported: {why}")
    if cfg.get("bias", "none") != "none":
        raise AdapterError(f"{where}: bias = {cfg['bias']!r} is not supported: the adapter trains base-model "
                           "biases (only bias='none' adapters can be applied beside the base weights)")
    for field in ("r", "lora_alpha"):
        value = cfg.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise AdapterError(f"{where}: {field} must be a positive number (got {value!r})")


def read_peft(folder: str | Path, model: ModelConfig, layout: ShardLayout = ShardLayout(),
              targets: tuple[str, ...] = TARGETS) -> PeftAdapter:
    """Read and check the adapter in `folder` for `model`, keeping the slices a rank of `layout` holds (the
    whole adapter by default) of the linears named `targets`; AdapterError names what is wrong."""
    folder = Path(folder)
    where = f"LoRA adapter {folder}"
    if not (folder / CONFIG).is_file():
        raise AdapterError(f"{where}: no {CONFIG} (a PEFT adapter folder, as save_pretrained writes it)")
    if not (folder / WEIGHTS).is_file():
        bin_file = " (adapter_model.bin is a pickle, which is not loaded: save with safe_serialization)" \
            if (folder / "adapter_model.bin").exists() else ""
        raise AdapterError(f"{where}: no {WEIGHTS}{bin_file}")
    try:
        cfg = json.loads((folder / CONFIG).read_text())
    except (OSError, ValueError) as e:
        raise AdapterError(f"{where}: {CONFIG} is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{where}: {CONFIG} is not a JSON object")
    _check_config(cfg, where)
    shapes = backbone_linears(model)
    with safe_open(str(folder / WEIGHTS), framework="pt") as f:
        parts: dict[str, dict[str, str]] = {}
        for key in f.keys():
            m = KEY.match(key.removeprefix(PREFIX))
            if m is None:
                raise AdapterError(f"{where}: tensor {key!r} is not a lora_A/lora_B weight (trained biases, "
                                   "embeddings or saved modules are not supported)")
            _check_target(m["module"], shapes, where, targets)
            parts.setdefault(m["module"], {})[m["part"]] = key
        if not parts:
            raise AdapterError(f"{where}: {WEIGHTS} holds no LoRA weights")
        layers = {}
        for module, keys in sorted(parts.items()):
            if set(keys) != {"A", "B"}:
                missing = ({"A", "B"} - set(keys)).pop()
                raise AdapterError(f"{where}: {module} has no lora_{missing} weight")
            a, b = f.get_slice(keys["A"]), f.get_slice(keys["B"])
            n, k = shapes[module][:2]
            r = int(_pattern(cfg.get("rank_pattern"), module, cfg["r"]))
            if tuple(a.get_shape()) != (r, k) or tuple(b.get_shape()) != (n, r):
                raise AdapterError(f"{where}: {module} has lora_A {tuple(a.get_shape())} and lora_B "
                                   f"{tuple(b.get_shape())}; this model's layer is [{n}, {k}] at rank {r}, so they "
                                   f"must be ({r}, {k}) and ({n}, {r})")
            alpha = float(_pattern(cfg.get("alpha_pattern"), module, cfg["lora_alpha"]))
            # this rank's slice only: B by output rows (column-parallel qkv, gate/up), A by input columns
            # (row-parallel o_proj, down_proj)
            layers[module] = LoraWeights(*_slice(module, a, b, n, k, layout),
                                         alpha / (math.sqrt(r) if cfg.get("use_rslora") else r))
    return PeftAdapter(folder, layers, layout)


def _slice(module: str, a, b, n: int, k: int, layout: ShardLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """(A, B) in fp32 as a rank of `layout` keeps them of an adapted layer [n, k] (a, b: tensors, or a
    safetensors file's slices, read here): the input columns of its shard of a row-parallel layer
    (o_proj, down_proj), else the output rows of its shard (qkv_proj; gate_and_up_proj as its pack holds
    them: per micro, that micro's gate block, then its up block, engine/model/packed.py `read_gate_up`)."""
    if module.endswith((names.O_PROJ, names.DOWN_PROJ)):
        return a[:, shard_block(k, layout)].float(), b[:].float()
    if module.endswith(names.GATE_AND_UP_PROJ):
        inter, blk = n // 2, shard_block(n // 2, layout)
        gate, up = (b[s].float() for s in (blk, slice(inter + blk.start, inter + blk.stop)))
        return a[:].float(), torch.cat([gate.view(layout.micros, -1, gate.shape[-1]),
                                        up.view(layout.micros, -1, up.shape[-1])], dim=1).flatten(0, 1)
    return a[:].float(), b[shard_block(n, layout)].float()


def sliced(adapter: PeftAdapter, layout: ShardLayout) -> PeftAdapter:
    """A whole adapter (read for one rank, or made in memory) cut to the slices a rank of `layout` keeps."""
    if adapter.layout != ShardLayout():
        raise ValueError(f"adapter {adapter.folder} is already a slice ({adapter.layout})")
    out = {}
    for module, w in adapter.layers.items():
        out[module] = LoraWeights(*_slice(module, w.a, w.b, w.b.shape[0], w.a.shape[1], layout), w.scale)
    return PeftAdapter(adapter.folder, out, layout)


def _check_target(module: str, shapes: dict, where: str, targets: tuple[str, ...]) -> None:
    """A module name must be one of this model's adapted layers."""
    if module in shapes and module.endswith(targets):
        return
    if module in shapes:
        raise AdapterError(f"{where}: it adapts {module}; this engine's adapter tables hold the attention "
                           f"projections ({', '.join(t.rsplit('.', 1)[-1] for t in TARGETS)}), not the MLPs: "
                           "start it with --lora-mlp (MLP tables), or merge the adapter into the weights "
                           "(--lora-merged)")
    raise AdapterError(f"{where}: it adapts {module!r}, which is not a linear layer of this model (its layers "
                       f"are named like {names.layer(0).qkv_proj}); was it trained on another model?")
