"""Our own writer of quantized tiny checkpoints (`python -m tools.tiny OUT --quant FORMAT`), laid out
as the real tools write them (research/quant_formats.md §2-§5; checked against auto-round 0.15.0 and
llm-compressor 0.14.0.1 outputs on the same tiny model): the tool keeps the source's shard files and puts
each quantized layer's tensors in the shard that held its weight, updates the index, and adds the
tool's `quantization_config` to config.json (auto-round also writes it to quantization_config.json,
ModelOpt writes hf_quant_config.json).

The backbone linears are quantized (round to nearest; the tools' scale searches change codes, not the
layout); everything else stays as it was, as the cards keep it.

Formats:
  mxfp8            auto-round `--scheme MXFP8 --format auto_round`
  mxfp4            auto-round MXFP4-mixed (experts MXFP4, other linears MXFP8), `--format auto_round`, with
                   the stock `.mlp.experts.` extra_config key the card's command produces
  mxfp8-ct         the same MXFP8 tensors, `--format llm_compressor` (compressed-tensors mxfp8-quantized)
  mxfp4-ct         the same MXFP4-mixed tensors, `--format llm_compressor` (mixed-precision)
  nvfp4-ct         llm-compressor `model_free_ptq(scheme="NVFP4A16")`
  fp8-modelopt     ModelOpt FP8 (per-tensor weight scale, static input scale)
  fp8-channel-modelopt  ModelOpt FP8_PER_CHANNEL_PER_TOKEN
  nvfp4-modelopt   ModelOpt MIXED_PRECISION: experts NVFP4, other linears FP8 (ModelOpt's GPU-only tool is
                   not run; the layout follows its exporter, §5)
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from engine.checkpoint import names
from engine.checkpoint.config import ModelConfig
from engine.checkpoint.shapes import backbone_linears
from hunyuan_kernels.quant import E2M1_VALUES, FP8_MAX, pack_fp4, quantize_fp8_rows

QUANT_FORMATS = ("mxfp8", "mxfp4", "mxfp8-ct", "mxfp4-ct", "nvfp4-ct", "fp8-modelopt", "fp8-channel-modelopt",
                 "nvfp4-modelopt")
# what each tool leaves in high precision (the card's --ignore_layers, auto-round's own skips)
CARD_IGNORE = "vision,guidance_emb,timestep_emb,timestep_r_emb,final_layer,wte"
CT_IGNORE = ["re:.*lm_head", "re:.*ln_f", "re:.*wte", "re:.*mlp\\.gate\\.wg", "re:vision_model\\..*",
             "re:vision_aligner\\..*", "re:vae\\..*", "re:patch_embed\\..*", "re:final_layer\\..*", "re:time_embed.*",
             "re:timestep.*", "re:guidance_emb.*"]
MODELOPT_EXCLUDE = ["lm_head", "model.wte", "model.layers.*.mlp.gate.wg", "vision_model*", "vision_aligner*", "vae*",
                    "patch_embed*", "final_layer*", "time_embed*", "timestep_emb*", "timestep_r_emb*", "guidance_emb*"]


def _expert(layer: str) -> bool:
    """A backbone linear of one expert (read into the pack its layer's experts share)."""
    return names.pack_of(layer) not in (None, layer)


# ------------------------------------------------------------------ element quantizers (round to nearest)
def _to_e2m1(q: torch.Tensor) -> torch.Tensor:
    """float32 values (already scaled into [-6, 6]) -> raw 4-bit codes, nearest magnitude."""
    mags = torch.tensor(E2M1_VALUES[:8])
    idx = (q.abs().clamp(max=6.0).unsqueeze(-1) - mags).abs().argmin(dim=-1).to(torch.uint8)
    return idx | ((q < 0).to(torch.uint8) << 3)


def quantize_mx(w: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (codes E4M3 [N, K] or packed E2M1 [N, K/2], E8M0 bytes [N, K/32]); OCP MX scale
    2^(floor(log2 amax) - emax) per 32-block, emax 8 (E4M3) or 2 (E2M1), exponent clamped to +-127."""
    n, k = w.shape
    blocks = w.float().reshape(n, k // 32, 32)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.full_like(amax, -127.0))
    exp = (exp - (8 if bits == 8 else 2)).clamp(-127, 127)
    q = blocks / torch.exp2(exp)
    scales = (exp + 127).to(torch.uint8).reshape(n, k // 32)
    if bits == 8:
        return q.clamp(-FP8_MAX, FP8_MAX).reshape(n, k).to(torch.float8_e4m3fn), scales
    return pack_fp4(_to_e2m1(q.reshape(n, k))), scales


def quantize_nvfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, K] -> (packed E2M1 [N, K/2], E4M3 block scales [N, K/16], weight_scale_2 = amax / (6 * 448) as a
    0-d float32: the ModelOpt convention; compressed-tensors stores 1 / weight_scale_2)."""
    n, k = w.shape
    s2 = (w.float().abs().amax() / (6 * FP8_MAX)).clamp_min(torch.finfo(torch.float32).tiny)
    blocks = w.float().reshape(n, k // 16, 16)
    s = (blocks.abs().amax(dim=-1, keepdim=True) / (6 * s2)).clamp(2.0 ** -9, FP8_MAX).to(torch.float8_e4m3fn)
    q = blocks / (s.float() * s2)
    return pack_fp4(_to_e2m1(q.reshape(n, k))), s.reshape(n, k // 16), s2.reshape(())


def _fp8_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    s = (w.float().abs().amax() / FP8_MAX).clamp_min(torch.finfo(torch.float32).tiny)
    return (w.float() / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), s.reshape(())


def tensor_set(layer: str, w: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """The tensors a tool writes for one layer in `fmt` (mxfp8, mxfp4, nvfp4-ct, nvfp4-modelopt, fp8, fp8-channel)."""
    p = layer + "."
    if fmt in ("mxfp8", "mxfp4"):
        codes, scales = quantize_mx(w, 8 if fmt == "mxfp8" else 4)
        return {p + ("weight" if fmt == "mxfp8" else "weight_packed"): codes, p + "weight_scale": scales}
    if fmt.startswith("nvfp4"):
        packed, s, s2 = quantize_nvfp4(w)
        if fmt == "nvfp4-ct":
            return {p + "weight_packed": packed, p + "weight_scale": s, p + "weight_global_scale": (1.0 / s2).reshape(1)}
        return {p + "weight": packed, p + "weight_scale": s, p + "weight_scale_2": s2,
                p + "input_scale": torch.tensor(1.0 / (6 * FP8_MAX))}
    if fmt == "fp8":
        codes, s = _fp8_tensor(w)
        return {p + "weight": codes, p + "weight_scale": s, p + "input_scale": torch.tensor(1.0 / FP8_MAX)}
    if fmt == "fp8-channel":
        codes, s = quantize_fp8_rows(w)
        return {p + "weight": codes, p + "weight_scale": s.reshape(-1), p + "input_scale": torch.tensor(1.0 / FP8_MAX)}
    raise ValueError(f"unknown tensor format {fmt!r}")


# ------------------------------------------------------------------ configs, as each tool writes them
def _ar_scheme(bits: int) -> dict:
    return {"num_bits": bits, "type": "float", "symmetric": True, "group_size": 32, "strategy": "group",
            "block_structure": None, "dynamic": False, "actorder": None, "scale_dtype": "torch.uint8",
            "zp_dtype": None, "observer": None, "observer_kwargs": {}}


def _ar_group(targets: list[str], bits: int) -> dict:
    return {"targets": targets, "weights": _ar_scheme(bits), "input_activations": dict(_ar_scheme(bits), dynamic=True),
            "output_activations": None, "format": "mxfp8-quantized" if bits == 8 else "mxfp4-pack-quantized"}


def _config(fmt: str, layer_fmt: dict[str, str], kept: list[str]) -> tuple[dict, dict[str, dict]]:
    """(quantization_config, {extra file name: content})."""
    experts = sorted(l for l in layer_fmt if _expert(l))
    if fmt in ("mxfp8", "mxfp4"):
        qc = {"quant_method": "auto-round", "packing_format": "auto_round:llm_compressor", "bits": 8, "group_size": 32,
              "sym": True, "data_type": "mx_fp", "iters": 0, "model_free": True, "autoround_version": "0.15.0",
              "enable_quanted_input": False, "block_name_to_quantize": "model.layers", "act_bits": 8,
              "act_data_type": "mx_fp", "act_dynamic": True, "act_group_size": 32, "act_sym": True}
        extra = {".mlp.experts.": {"bits": 4}} if fmt == "mxfp4" else {}
        for layer in kept:   # auto-round lists every kept >=2-D weight except names with embed / conv
            if not re.search("embed|conv", layer):
                extra[layer] = {"bits": 16, "data_type": "float", "act_bits": 16, "act_data_type": "float"}
        qc["extra_config"] = extra
        return qc, {"quantization_config.json": qc}
    if fmt in ("mxfp8-ct", "mxfp4-ct"):
        groups = ({"group_0": _ar_group(experts, 4), "group_1": _ar_group(["Linear"], 8)} if fmt == "mxfp4-ct"
                  else {"group_0": dict(_ar_group(["Linear"], 8), format=None)})
        qc = {"config_groups": groups, "quant_method": "compressed-tensors", "kv_cache_scheme": None,
              "format": "mixed-precision" if fmt == "mxfp4-ct" else "mxfp8-quantized",
              "quantization_status": "compressed", "global_compression_ratio": None, "ignore": kept,
              "provider": "auto-round"}
        return qc, {"quantization_config.json": qc}
    if fmt == "nvfp4-ct":
        w = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": 16, "num_bits": 4,
             "observer": None, "observer_kwargs": {}, "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group",
             "symmetric": True, "type": "float", "zp_dtype": None}
        qc = {"config_groups": {"NVFP4A16": {"format": "nvfp4-pack-quantized", "input_activations": None,
                                             "output_activations": None, "targets": ["Linear"], "weights": w}},
              "format": "nvfp4-pack-quantized", "global_compression_ratio": None, "ignore": CT_IGNORE,
              "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
              "transform_config": {}, "version": "0.19.0"}
        return qc, {}
    producer = {"name": "modelopt", "version": "0.47.0"}
    fp8 = {"input_activations": {"dynamic": False, "num_bits": 8, "type": "float"},
           "weights": {"dynamic": False, "num_bits": 8, "type": "float"}}
    if fmt == "nvfp4-modelopt":
        layers = {l: ({"quant_algo": "NVFP4", "group_size": 16} if f.startswith("nvfp4") else {"quant_algo": "FP8"})
                  for l, f in sorted(layer_fmt.items())}
        nv = {"input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
              "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}}
        qc = {"config_groups": {"group_0": dict(fp8, targets=sorted(l for l in layers if l not in experts)),
                                "group_1": dict(nv, targets=experts)},
              "quantized_layers": layers, "ignore": MODELOPT_EXCLUDE, "quant_algo": "MIXED_PRECISION",
              "producer": producer, "quant_method": "modelopt"}
        hf = {"producer": producer, "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": None,
                                                     "quantized_layers": layers, "exclude_modules": MODELOPT_EXCLUDE}}
        return qc, {"hf_quant_config.json": hf}
    algo = "FP8" if fmt == "fp8-modelopt" else "FP8_PER_CHANNEL_PER_TOKEN"
    group = fp8 if algo == "FP8" else dict(fp8, weights=dict(fp8["weights"], strategy="channel"))
    qc = {"config_groups": {"group_0": dict(group, targets=["Linear"])}, "ignore": MODELOPT_EXCLUDE,
          "quant_algo": algo, "producer": producer, "quant_method": "modelopt"}
    hf = {"producer": producer, "quantization": {"quant_algo": algo, "kv_cache_quant_algo": None,
                                                 "exclude_modules": MODELOPT_EXCLUDE}}
    return qc, {"hf_quant_config.json": hf}


def _layer_format(fmt: str, layer: str) -> str:
    expert = _expert(layer)
    return {"mxfp8": "mxfp8", "mxfp8-ct": "mxfp8", "mxfp4": "mxfp4" if expert else "mxfp8",
            "mxfp4-ct": "mxfp4" if expert else "mxfp8", "nvfp4-ct": "nvfp4-ct", "fp8-modelopt": "fp8",
            "fp8-channel-modelopt": "fp8-channel", "nvfp4-modelopt": "nvfp4-modelopt" if expert else "fp8"}[fmt]


def quantize_folder(folder: str | Path, fmt: str) -> Path:
    """Quantize the backbone linears of the float checkpoint in `folder`, in place, as the tool of `fmt` does."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"unknown quantized format {fmt!r}; choose one of {', '.join(QUANT_FORMATS)}")
    folder = Path(folder)
    cfg_path, index_path = folder / "config.json", folder / "model.safetensors.index.json"
    raw = json.loads(cfg_path.read_text())
    linears = backbone_linears(ModelConfig.from_dict(raw))
    index = json.loads(index_path.read_text())
    layer_fmt: dict[str, str] = {}
    kept: list[str] = []
    weight_map: dict[str, str] = {}
    total = 0
    for file in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(folder / file))
        out: dict[str, torch.Tensor] = {}
        for name in sorted(tensors):
            layer, _, leaf = name.rpartition(".")
            t = tensors[name]
            if layer in linears and leaf == "weight":
                layer_fmt[layer] = _layer_format(fmt, layer)
                out |= tensor_set(layer, t, layer_fmt[layer])
            else:
                if leaf == "weight" and t.dim() >= 2:
                    kept.append(layer)
                out[name] = t
        save_file({n: v.contiguous() for n, v in out.items()}, str(folder / file), metadata={"format": "pt"})
        for n, v in out.items():
            weight_map[n] = file
            total += v.numel() * v.element_size()
    index_path.write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    qc, extra_files = _config(fmt, layer_fmt, kept)
    raw["quantization_config"] = qc
    cfg_path.write_text(json.dumps(raw, indent=1))
    for name, content in extra_files.items():
        (folder / name).write_text(json.dumps(content, indent=2))
    return folder
