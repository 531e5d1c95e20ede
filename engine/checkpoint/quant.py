"""Weight formats as data, and what a checkpoint's `quantization_config` says about each layer.

A *layer* is a linear's name without its tensor suffix (`model.layers.0.self_attn.qkv_proj`). The
config only *declares* a format; the tensors' own names, dtypes and shapes decide it
(engine/checkpoint/qtensors.py), and where the two disagree the tensors win and the loader warns naming the
layer. Three producers are read, as their tools write them (research/quant_formats.md §2-§5):

- auto-round (`quant_method` "auto-round"): `bits` / `group_size` / `data_type` defaults, the
  `block_name_to_quantize` scope and `extra_config` overrides. A key is an exact layer name, else a
  pattern: with a regex metacharacter it is searched as a regex (`.*mlp\\.experts`, the key vLLM needs),
  without one it is a substring (`.mlp.experts.`, the key the tool writes from the card's command,
  which vLLM does not match but auto-round itself does).
- compressed-tensors (`quant_method` "compressed-tensors"; written by llm-compressor and by auto-round's
  `llm_compressor` format): `config_groups` with `targets` and `weights`, `ignore`. A target is an exact
  name, `re:` + a regex matched from the start, or the class `Linear`; the most specific match wins
  (exact, then regex, then class), as compressed-tensors orders them; `ignore` wins over all.
- ModelOpt (`quant_method` "modelopt", or `hf_quant_config.json`): `quant_algo` FP8,
  FP8_PER_CHANNEL_PER_TOKEN, NVFP4 (W4A16_NVFP4), MXFP8 or MIXED_PRECISION with `quantized_layers`
  (an entry may name a parent, e.g. `...mlp.experts`); `exclude_modules` / `ignore` are shell wildcards.

Anything else (GPTQ, AWQ, bitsandbytes, integer auto-round or compressed-tensors schemes, an unknown
`quant_method`) is unsupported; the loader refuses it naming the format and the first layer.
"""
from __future__ import annotations

import enum
import fnmatch
import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable


class WeightFormat(enum.Enum):
    BF16 = "bf16"                   # not quantized (any float dtype)
    MXFP8 = "mxfp8"                 # E4M3 elements, E8M0 scale per 32 along K
    MXFP4 = "mxfp4"                 # E2M1 elements two a byte, E8M0 scale per 32 along K
    NVFP4 = "nvfp4"                 # E2M1 elements two a byte, E4M3 scale per 16 along K, fp32 global scale
    FP8_CHANNEL = "fp8-channel"     # E4M3 elements, fp32 scale per output channel
    FP8_TENSOR = "fp8-tensor"       # E4M3 elements, one fp32 scale

    @property
    def block(self) -> int | None:
        """Elements along K that share one scale (None: no block along K)."""
        return {"mxfp8": 32, "mxfp4": 32, "nvfp4": 16}.get(self.value)

    @property
    def per_byte(self) -> int:
        """Elements per stored code byte along K."""
        return 2 if self in (WeightFormat.MXFP4, WeightFormat.NVFP4) else 1

    @property
    def quantized(self) -> bool:
        return self is not WeightFormat.BF16


class UnsupportedFormat(ValueError):
    """A quantization format this engine does not load (the message names it)."""


REGEX_CHARS = set("*+?^$()[]{}|\\")


def _has_regex(key: str) -> bool:
    return any(c in REGEX_CHARS for c in key)


# ------------------------------------------------------------------ auto-round
def _mx_or_nv(data_type: str, bits: int, where: str) -> WeightFormat:
    dt = str(data_type).lower()
    if bits >= 16 or dt in ("float", "fp16", "bf16"):
        return WeightFormat.BF16
    if dt.startswith("mx_fp"):
        if bits == 8:
            return WeightFormat.MXFP8
        if bits == 4:
            return WeightFormat.MXFP4
    if dt.startswith("nv_fp") and bits == 4:
        return WeightFormat.NVFP4
    raise UnsupportedFormat(f"auto-round {dt} {bits}-bit weights ({where})")


@dataclass
class _AutoRound:
    cfg: dict

    def __post_init__(self) -> None:
        c = self.cfg
        self.bits = int(c.get("bits", 4))
        self.data_type = str(c.get("data_type", "int"))
        packing = str(c.get("packing_format", ""))
        if packing and packing not in ("auto_round:llm_compressor", "auto_round"):
            raise UnsupportedFormat(f"auto-round packing format {packing!r}")
        scope = c.get("block_name_to_quantize")
        if isinstance(scope, str):
            scope = [s.strip() for s in scope.split(",") if s.strip()]
        self.scope = tuple(scope or ())
        self.extra = dict(c.get("extra_config") or {})
        # fail now, not at the first layer, when the default itself is a format we do not load
        _mx_or_nv(self.data_type, self.bits, "the default scheme")

    def _override(self, layer: str) -> dict | None:
        if layer in self.extra:
            return self.extra[layer]
        for key, val in self.extra.items():
            if _has_regex(key):
                if re.search(key, layer):
                    return val
            elif key in layer:
                return val
        return None

    def declared(self, layer: str) -> WeightFormat:
        over = self._override(layer)
        if over is None and self.scope and not layer.startswith(self.scope):
            return WeightFormat.BF16
        over = over or {}
        bits = int(over.get("bits", self.bits))
        return _mx_or_nv(over.get("data_type", self.data_type), bits, f"layer {layer}")


# ------------------------------------------------------------------ compressed-tensors
def _ct_weights(weights: dict | None, fmt: str, where: str) -> WeightFormat:
    if not weights:
        return WeightFormat.BF16
    kind, bits = str(weights.get("type", "int")), int(weights.get("num_bits", 0))
    strategy, group = str(weights.get("strategy", "")), weights.get("group_size")
    if kind == "float" and bits == 8 and strategy == "group" and group == 32:
        return WeightFormat.MXFP8
    if kind == "float" and bits == 4 and group == 32:
        return WeightFormat.MXFP4
    if kind == "float" and bits == 4 and group == 16:
        return WeightFormat.NVFP4
    if kind == "float" and bits == 8 and strategy == "channel":
        return WeightFormat.FP8_CHANNEL
    if kind == "float" and bits == 8 and strategy == "tensor":
        return WeightFormat.FP8_TENSOR
    desc = f"{kind}{bits}" + (f" {strategy}" if strategy else "") + (f" group {group}" if group else "")
    raise UnsupportedFormat(f"compressed-tensors {desc} weights (format {fmt!r}, {where})")


def _ct_match(target: str, layer: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], layer) is not None
    return target == layer


@dataclass
class _CompressedTensors:
    cfg: dict

    def __post_init__(self) -> None:
        c = self.cfg
        if c.get("kv_cache_scheme"):
            raise UnsupportedFormat("compressed-tensors KV-cache quantization (kv_cache_scheme)")
        top = str(c.get("format", ""))
        self.ignore = list(c.get("ignore") or [])
        self.groups: list[tuple[str, list[str], WeightFormat]] = []
        for name, g in (c.get("config_groups") or {}).items():
            fmt = str(g.get("format") or top)
            self.groups.append((name, list(g.get("targets") or []), _ct_weights(g.get("weights"), fmt, f"group {name}")))

    def declared(self, layer: str) -> WeightFormat:
        if any(_ct_match(t, layer) for t in self.ignore):
            return WeightFormat.BF16
        ranked = []   # (specificity, target, format): exact 0, regex 1, class 2
        for _, targets, fmt in self.groups:
            for t in targets:
                if t.startswith("re:"):
                    if _ct_match(t, layer):
                        ranked.append((1, t, fmt))
                elif t == layer:
                    ranked.append((0, t, fmt))
                elif t == "Linear":
                    ranked.append((2, t, fmt))
        return min(ranked, key=lambda r: (r[0], r[1]))[2] if ranked else WeightFormat.BF16


# ------------------------------------------------------------------ ModelOpt
_MODELOPT_ALGOS = {"FP8": WeightFormat.FP8_TENSOR, "FP8_PER_CHANNEL_PER_TOKEN": WeightFormat.FP8_CHANNEL,
                   "NVFP4": WeightFormat.NVFP4, "W4A16_NVFP4": WeightFormat.NVFP4, "MXFP8": WeightFormat.MXFP8}


def _modelopt_algo(algo: Any, where: str) -> WeightFormat:
    if algo is None:
        return WeightFormat.BF16
    try:
        return _MODELOPT_ALGOS[str(algo).upper()]
    except KeyError:
        raise UnsupportedFormat(f"ModelOpt {algo} weights ({where})") from None


@dataclass
class _ModelOpt:
    cfg: dict

    def __post_init__(self) -> None:
        c = self.cfg.get("quantization", self.cfg)       # hf_quant_config.json nests it under "quantization"
        kv = c.get("kv_cache_quant_algo") or c.get("kv_cache_scheme")
        if kv:
            raise UnsupportedFormat(f"ModelOpt KV-cache quantization ({kv})")
        self.algo = str(c.get("quant_algo") or "").upper()
        self.exclude = list(c.get("exclude_modules") or c.get("ignore") or [])
        self.layers = dict(c.get("quantized_layers") or {})
        if self.algo == "MIXED_PRECISION":
            for name, spec in self.layers.items():
                _modelopt_algo(spec.get("quant_algo"), f"layer {name}")
        else:
            self.default = _modelopt_algo(self.algo, "quant_algo")

    def declared(self, layer: str) -> WeightFormat:
        if any(fnmatch.fnmatchcase(layer, pat) for pat in self.exclude):
            return WeightFormat.BF16
        if self.algo != "MIXED_PRECISION":
            return self.default
        spec = self.layers.get(layer)
        if spec is None:     # a parent entry (e.g. "...mlp.experts") covers its children
            parents = [k for k in self.layers if layer.startswith(k + ".")]
            spec = self.layers[max(parents, key=len)] if parents else None
        return _modelopt_algo(spec.get("quant_algo"), f"layer {layer}") if spec else WeightFormat.BF16


# ------------------------------------------------------------------ the scheme
@dataclass
class QuantScheme:
    """The declared format of every layer, from a checkpoint's quantization config.

    `method` is the producer ("none", "auto-round", "compressed-tensors", "modelopt"). A config the engine
    cannot load keeps its reason in `unsupported` (the loader raises naming the first layer)."""
    method: str = "none"
    declare: Callable[[str], WeightFormat] = field(default=lambda layer: WeightFormat.BF16, repr=False)
    unsupported: str | None = None
    config: dict = field(default_factory=dict, repr=False)

    def declared(self, layer: str) -> WeightFormat:
        if self.unsupported:
            raise UnsupportedFormat(self.unsupported)
        return self.declare(layer)

    @classmethod
    def from_config(cls, raw: dict, folder: str | Path | None = None) -> "QuantScheme":
        """From `config.json`'s `quantization_config`, else a `quantization_config.json` or
        `hf_quant_config.json` beside it."""
        qc = raw.get("quantization_config")
        if qc is None and folder is not None:
            for name in ("quantization_config.json", "hf_quant_config.json"):
                p = Path(folder) / name
                if p.exists():
                    qc = json.loads(p.read_text())
                    break
        if not qc:
            return cls()
        method = str(qc.get("quant_method") or "").lower()
        if not method and (qc.get("producer") or {}).get("name") == "modelopt":
            method = "modelopt"
        kinds = {"auto-round": _AutoRound, "auto_round": _AutoRound, "intel/auto-round": _AutoRound,
                 "compressed-tensors": _CompressedTensors, "modelopt": _ModelOpt}
        if method not in kinds:
            known = "auto-round, compressed-tensors, modelopt"
            return cls(method or "unknown", unsupported=f"quant_method {method or '(none)'!r} (supported: {known})",
                       config=qc)
        try:
            reader = kinds[method](qc)
        except UnsupportedFormat as e:
            return cls(method, unsupported=str(e), config=qc)
        return cls(method, reader.declared, config=qc)
