"""Tiny quantized checkpoints made by the REAL tools, kept small enough to commit (tests/data/quant/), and
rebuilt into complete checkpoint folders for the tests.

    python -m tools.quant_fixtures            # rerun every tool, rewrite tests/data/quant/ (needs the tools)

The source is `make_tiny(blocks=True, seed=0)` (block-aligned dimensions, so every plan up to 8 ranks
splits whole blocks; the default tiny dimensions are accepted by the tools too, but only load quantized
at tp1). A fixture keeps only what the tool changed: the quantized layers' tensors (as written, in
their shards), its `quantization_config` and side files, the command, and the SHA-256 of each layer
dequantized to bfloat16 by the tool's OWN code (auto-round's `dequant_mx_fp8` / `to_dtype` for its
`auto_round` format, compressed-tensors' compressors' `decompress` for compressed-tensors configs), so
CI checks our dequantization bit for bit without the tools installed. `build` puts the unchanged tensors
back from make_tiny (deterministic), giving the folder the tool wrote; the slow test
tests/test_quant_tools.py reruns the tools and checks fixture, folder and digests against a fresh run.

Tools: auto-round 0.15.0 (the seed cards' version), compressed-tensors 0.19.0, llmcompressor 0.14.0.1,
installed beside torch with `pip install --no-deps` plus their dependencies (README, Quantized checkpoints).
"""
from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from tools.tiny import make_tiny

DATA = Path(__file__).resolve().parents[1] / "tests" / "data" / "quant"
SEED = 0
CARD_IGNORE = "vision,guidance_emb,timestep_emb,timestep_r_emb,final_layer,wte"
# the card's --layer_config as typed (auto-round writes the key back as `.mlp.experts.`)
CARD_LAYER_CONFIG = "{.mlp.experts.:{bits:4,data_type:mx_fp}}"


def _autoround(scheme_args: list[str], fmt: str) -> list[str]:
    return ["auto-round", "--model", "{src}", "--model_free", "--scheme", "MXFP8", *scheme_args,
            "--ignore_layers", CARD_IGNORE, "--format", fmt, "--device", "cpu", "--output_dir", "{out}"]


# case -> (command with {src} / {out}, the fixture whose tensors it shares: the formats of one tool run
# are byte-identical, the check is in the slow test)
CASES: dict[str, tuple[list[str], str | None]] = {
    "autoround-mxfp8": (_autoround([], "auto_round"), None),
    "autoround-mxfp8-llmc": (_autoround([], "llm_compressor"), "autoround-mxfp8"),
    "autoround-mxfp4": (_autoround(["--layer_config", CARD_LAYER_CONFIG], "auto_round"), None),
    "autoround-mxfp4-llmc": (_autoround(["--layer_config", CARD_LAYER_CONFIG], "llm_compressor"), "autoround-mxfp4"),
    "llmc-nvfp4a16": ([sys.executable, "-m", "tools.quant_fixtures", "--ptq", "NVFP4A16", "{src}", "{out}"], None),
    "llmc-mxfp4a16": ([sys.executable, "-m", "tools.quant_fixtures", "--ptq", "MXFP4A16", "{src}", "{out}"], None),
    "llmc-mxfp8a16": ([sys.executable, "-m", "tools.quant_fixtures", "--ptq", "MXFP8A16", "{src}", "{out}"], None),
}
PTQ_IGNORE = ["re:.*lm_head", "re:.*ln_f", "re:.*wte", "re:.*mlp\\.gate\\.wg", "re:vision_model\\..*",
              "re:vision_aligner\\..*", "re:vae\\..*", "re:patch_embed\\..*", "re:final_layer\\..*", "re:time_embed.*",
              "re:timestep.*", "re:guidance_emb.*"]


def model_free_ptq(scheme: str, src: str, out: str) -> None:
    """llm-compressor's model-free PTQ on CPU (ln_f does not end in "norm", so it is ignored by name)."""
    from llmcompressor.entrypoints.model_free import model_free_ptq as ptq
    ptq(src, out, scheme=scheme, ignore=PTQ_IGNORE, device="cpu")


def source(folder: Path) -> Path:
    return make_tiny(folder, blocks=True, seed=SEED)


def run_tool(case: str, src: Path, out: Path) -> None:
    cmd = [a.replace("{src}", str(src)).replace("{out}", str(out)) for a in CASES[case][0]]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")


def _tensors(folder: Path) -> dict[str, tuple[str, torch.Tensor]]:
    index = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    out = {}
    for file in sorted(set(index.values())):
        for name, t in load_file(str(folder / file)).items():
            out[name] = (file, t)
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bytes(a), _bytes(b))


def changed(src: Path, out: Path) -> dict[str, tuple[str, torch.Tensor]]:
    """The tensors the tool wrote that are not byte-identical copies of the source's."""
    a, b = _tensors(src), _tensors(out)
    return {n: ft for n, ft in b.items() if n not in a or a[n][0] != ft[0] or not _same(a[n][1], ft[1])}


def tool_dequant(folder: Path) -> dict[str, torch.Tensor]:
    """Every quantized layer of the folder dequantized to bfloat16 by the producing tool's own code."""
    cfg = json.loads((folder / "config.json").read_text())["quantization_config"]
    tensors = {n: t for n, (_, t) in _tensors(folder).items()}
    layers = sorted({n.rpartition(".")[0] for n in tensors if n.endswith((".weight_scale", ".weight_packed"))})
    out = {}
    if cfg["quant_method"] == "auto-round":
        from auto_round_extension.vllm_ext.mxfp4_qdq_utils import to_dtype
        from auto_round_extension.vllm_ext.mxfp8_qdq_utils import dequant_mx_fp8
        for layer in layers:
            s = tensors[layer + ".weight_scale"]
            if layer + ".weight_packed" in tensors:
                out[layer] = to_dtype(tensors[layer + ".weight_packed"].contiguous(), s, "fp4_e2m1", 32, torch.bfloat16)
            else:
                out[layer] = dequant_mx_fp8(tensors[layer + ".weight"], s, 32, torch.bfloat16)
        return out
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.utils.match import match_name
    qc = QuantizationConfig.model_validate(cfg)
    for layer in layers:
        group = None
        for g in sorted(qc.config_groups.values(), key=lambda g: "Linear" in g.targets):   # explicit names first
            if any(match_name(layer, t) for t in g.targets) or "Linear" in g.targets:
                group = g
                break
        fmt = group.format or qc.format
        comp = BaseCompressor.get_value_from_registry(fmt)
        state = {k.rpartition(".")[2]: t for k, t in tensors.items() if k.rpartition(".")[0] == layer}
        out[layer] = comp.decompress(state, group)["weight"].to(torch.bfloat16)
    return out


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(_bytes(t).numpy().tobytes()).hexdigest()


def _side_files(folder: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))
            if p.name in ("quantization_config.json", "hf_quant_config.json")}


def versions() -> dict[str, str]:
    from importlib.metadata import version
    return {p: version(p) for p in ("auto-round", "compressed-tensors", "llmcompressor")}


def write_fixture(case: str, src: Path, out: Path, data: Path = DATA) -> None:
    data.mkdir(parents=True, exist_ok=True)
    shared = CASES[case][1]
    new = changed(src, out)
    meta = {"case": case, "command": " ".join(CASES[case][0]), "tools": versions(), "source": f"make_tiny(blocks=True, seed={SEED})",
            "quantization_config": json.loads((out / "config.json").read_text())["quantization_config"],
            "side_files": _side_files(out), "weight_map": {n: f for n, (f, _) in sorted(new.items())},
            "tensors": f"{shared or case}.safetensors",
            "dequant_bf16_sha256": {layer: digest(w) for layer, w in tool_dequant(out).items()}}
    (data / f"{case}.json").write_text(json.dumps(meta, indent=1))
    if shared is None:
        save_file({n: t.contiguous() for n, (_, t) in sorted(new.items())}, str(data / f"{case}.safetensors"))


def fixture(case: str, data: Path = DATA) -> dict:
    return json.loads((data / f"{case}.json").read_text())


def build(case: str, folder: str | Path, data: Path = DATA) -> Path:
    """The folder the tool wrote for `case`, from make_tiny and the committed fixture."""
    folder = Path(folder)
    meta = fixture(case, data)
    source(folder)
    quant = meta["weight_map"]
    replaced = {n.rpartition(".")[0] for n in quant}
    with safe_open(str(data / meta["tensors"]), framework="pt") as f:
        qt = {n: f.get_tensor(n) for n in quant}
    index_path = folder / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    weight_map = {}
    for file in sorted(set(index["weight_map"].values()) | set(quant.values())):
        tensors = {n: t for n, t in load_file(str(folder / file)).items()
                   if not (n.rpartition(".")[0] in replaced and n.endswith(".weight"))}
        tensors |= {n: qt[n] for n, f in quant.items() if f == file}
        save_file(tensors, str(folder / file))
        weight_map |= {n: file for n in tensors}
    index["weight_map"] = weight_map
    index_path.write_text(json.dumps(index, indent=2))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = meta["quantization_config"]
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    for name, content in meta["side_files"].items():
        (folder / name).write_text(json.dumps(content, indent=2))
    return folder


def main(argv: list[str]) -> int:
    if argv[:1] == ["--ptq"]:
        model_free_ptq(*argv[1:4])
        return 0
    cases = argv or list(CASES)
    with tempfile.TemporaryDirectory() as tmp:
        src = source(Path(tmp) / "src")
        for case in cases:
            out = Path(tmp) / case
            run_tool(case, src, out)
            write_fixture(case, src, out)
            shutil.rmtree(out)
            print(f"{case}: {DATA / (case + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
