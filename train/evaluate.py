"""Evaluate a checkpoint folder on held-out prompts through the inference pipeline, in every reasoning
mode the studio offers.

    python -m train.evaluate --model DIR [--n N] [--modes off,think,think_recaption] [--example-seeds K]
                             [--seed S] [--threads 2] [--json OUT.json]

For each reasoning mode (off = bot_task `image`: no reasoning, the model only picks the size; think;
think + recaption) and each held-out sample (the dataset's test split: scene specifications never seen
in training; the same samples and seeds in every mode) the engine (`Engine.run`) runs the request (size
auto, the generation config's steps) and the detector reads the image. The studio's example prompts
and example edits run too, each with K seeds:

- T2I attribute accuracy: for every requested group, its colour (when the prompt gives one), shape,
  count and position (when given) are checked on the detected objects; the headline is the mean
  over all checked attributes. Background and aspect ratio (bucket) are reported beside it.
- TI2I edit accuracy: the requested change holds (recolour / move / add / remove / background /
  combine); `kept` reports whether the untouched objects survived.
- Reasoning well-formed: the generated ids are the mode's form with non-empty texts and no stray
  special tokens: `think-text </think> <recaption> text </recaption> <answer> <boi> <img_size>
  <img_ratio_k>` (think + recaption), `think-text </think> <answer> <boi> <img_size> <img_ratio_k>`
  (think), `<img_ratio_k>` alone (off).
- CoT correct (recaption modes): the recaption describes what the prompt asks for (T2I); image follows
  CoT: the detected objects are exactly the recaption's.
- Examples: the attribute accuracy of the studio's example prompts, and how often each example edit
  makes its change.
- Chained edits (`--chains N`): a conversation of 3 edits, each turn under every history policy
  (engine/runtime/history.py) and, as the yardstick, alone on a perfect image of the scene before it.
- Time: median wall time of one T2I request (reasoning included) with `--threads` CPU threads.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Image, Ratio
from engine.runtime.history import POLICIES, Turn, reasoning_of
from engine.model.loader import load
from engine.model.kernel_layouts import fold_all_to_fp8
from engine.runtime.engine import Engine
from engine.runtime.options import EngineOptions
from engine.runtime.request import Request
from engine.runtime.step_cache import named_setting

from .dataset import COLORS, FORMATS, REGIONS, SHAPES, edit_chain, make_sample
from .detect import Detection, SceneDetection, detect

T2I_ATTRS = ("color", "shape", "count", "position")
CHAIN_TURNS = 3
# The studio's names for the reasoning modes -> the engine's bot_task (webui/options.py REASONING_MODES).
MODES = {"off": "image", "think": "think", "think_recaption": "think_recaption"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# What the studio's examples for the embedded model ask for (webui/examples.py), in the checks' terms:
# T2I prompts -> check_t2i's check; edit prompts -> (task, check_edit's check).
EXAMPLE_T2I_CHECKS = {
    "a red circle on the left on a white background":
        {"groups": [{"shape": "circle", "color": "red", "count": 1, "region": "left"}], "background": "white"},
    "two blue squares on a gray background":
        {"groups": [{"shape": "square", "color": "blue", "count": 2, "region": None}], "background": "gray"},
    "a big yellow star in the center":
        {"groups": [{"shape": "star", "color": "yellow", "count": 1, "region": "center"}], "background": None},
    "three small green triangles at the top":
        {"groups": [{"shape": "triangle", "color": "green", "count": 3, "region": "top"}], "background": None},
}
EXAMPLE_EDIT_CHECKS = {
    "make the circle blue": ("recolor", {"shape": "circle", "old": "red", "new": "blue", "preserve": []}),
    "move the square to the right": ("move", {"shape": "square", "color": "green", "region": "right",
                                              "preserve": ["green square"]}),
}
CELL_BY_NAME = {"top left": (0, 0), "top": (0, 1), "top right": (0, 2), "left": (1, 0), "center": (1, 1),
                "right": (1, 2), "bottom left": (2, 0), "bottom": (2, 1), "bottom right": (2, 2)}
_OBJ = re.compile(r"(small|large) (" + "|".join(COLORS) + r") (" + "|".join(SHAPES) + r") (" +
                  "|".join(sorted(CELL_BY_NAME, key=len, reverse=True)) + r")")


def parse_recaption(text: str) -> dict | None:
    """`fmt, bg background: size colour shape cell, ...` -> {fmt, background, objects}."""
    m = re.match(r"\s*(\w+), (\w+) background[:,]\s*(.*)$", text.strip())
    if not m:
        return None
    objs = [(c, s, CELL_BY_NAME[p]) for _, c, s, p in _OBJ.findall(m.group(3))]
    return {"format": m.group(1), "background": m.group(2), "objects": objs}


def recaption_scene(parsed: dict) -> SceneDetection:
    """A parsed recaption as the detector's result type, so the edit checks can read the CoT too."""
    return SceneDetection(parsed["background"], [Detection(s, c, cell, 0, (0, 0, 0, 0), 0.0)
                                                 for c, s, cell in parsed["objects"]])


def split_cot(cot: str) -> tuple[str | None, str | None]:
    think = re.search(r"^(.*?)</think>", cot, re.S)
    recap = re.search(r"<recaption>(.*?)</recaption>", cot, re.S)
    return (think.group(1) if think else None), (recap.group(1) if recap else None)


def well_formed(ids: list[int], sp, bot_task: str = "think_recaption") -> bool:
    """The ids of the mode's reasoning: think ids </think> <recaption> ids </recaption> <answer> <boi>
    <img_size> <img_ratio_k> (think_recaption); think ids </think> <answer> <boi> <img_size>
    <img_ratio_k> (think); <img_ratio_k> alone (image)."""
    specials = {sp.end_think, sp.recaption, sp.end_recaption, sp.answer, sp.boi, sp.size, sp.think, sp.eos,
                sp.img, sp.eoi, sp.end_answer, sp.cfg, sp.pad, sp.timestep, *sp.ratio}
    if bot_task == "image":
        return len(ids) == 1 and ids[0] in sp.ratio
    if bot_task == "think":
        tail = ids[-5:]
        think = ids[:-5]
        return (len(ids) > 5 and tail[:4] == [sp.end_think, sp.answer, sp.boi, sp.size] and tail[4] in sp.ratio
                and not any(t in specials for t in think))
    try:
        a = ids.index(sp.end_think)
    except ValueError:
        return False
    tail = ids[a:]
    if len(tail) < 8 or tail[1] != sp.recaption:
        return False
    try:
        b = tail.index(sp.end_recaption)
    except ValueError:
        return False
    think, recap = ids[:a], tail[2:b]
    if not think or not recap or any(t in specials for t in think + recap):
        return False
    return tail[b + 1:] == [sp.answer, sp.boi, sp.size, tail[-1]] and tail[-1] in sp.ratio


def check_t2i(check: dict, det: SceneDetection) -> dict[str, list[bool]]:
    out: dict[str, list[bool]] = {k: [] for k in T2I_ATTRS}
    for g in check["groups"]:
        shape, color = g["shape"], g["color"]
        has_shape = bool(det.find(shape=shape))
        out["shape"].append(has_shape)
        if color:
            out["color"].append(bool(det.find(shape=shape, color=color)) if has_shape else bool(det.find(color=color)))
        match = det.find(shape=shape, color=color)
        out["count"].append(len(match) == g["count"])
        if g["region"]:
            cells = REGIONS[g["region"]]
            out["position"].append(bool(match) and all(o.cell in cells for o in match))
    return out


def check_edit(task: str, check: dict, det: SceneDetection) -> tuple[bool, bool]:
    """(the requested change holds, the untouched objects are still there)."""
    kept = all(det.find(*reversed(name.split(" "))) for name in check.get("preserve", []))
    if task == "recolor":
        ok = bool(det.find(check["shape"], check["new"])) and not det.find(check["shape"], check["old"])
    elif task == "move":
        m = det.find(check["shape"], check["color"])
        ok = bool(m) and all(o.cell in REGIONS[check["region"]] for o in m)
    elif task == "add":
        m = det.find(check["shape"], check["color"])
        ok = bool(m) and (check["region"] is None or any(o.cell in REGIONS[check["region"]] for o in m))
    elif task == "remove":
        ok = not det.find(check["shape"], check["color"])
    elif task == "background":
        ok = det.background == check["background"]
    elif task == "combine":
        ok = all(any(o.cell in REGIONS[c["region"]] for o in det.find(c["shape"], c["color"]))
                 for c in check["objects"])
        kept = all(det.find(c["shape"], c["color"]) for c in check["objects"])
    else:
        raise ValueError(task)
    return ok, kept


def run_one(pipe: Engine, sample, seed: int, bot_task: str | None = None, images: list | None = None,
            fields: dict | None = None, history: tuple = (), policy: str | None = None) -> dict:
    """One request; `fields`: more Request fields (steps, the step cache), the same for every sample;
    `history`, `policy`: a conversation's earlier turns and its history policy."""
    refs = images if images is not None else [sc.render() for sc in sample.refs]
    req = Request(prompt=sample.prompt, images=refs, seed=seed, bot_task=bot_task, history=history,
                  history_policy=policy, **(fields or {}))
    t0 = time.perf_counter()
    res: dict = {"error": None, "image": None, "ratio": None, "cot": "", "timings": None}
    for ev in pipe.run(req):
        if isinstance(ev, Image):
            import io
            res["image"] = PILImage.open(io.BytesIO(ev.png)).convert("RGB")
        elif isinstance(ev, Ratio):
            res["ratio"] = ev.bucket
        elif isinstance(ev, Done):
            res["cot"], res["timings"] = ev.cot_text, ev.timings
        elif isinstance(ev, Error):
            res["error"] = f"{ev.kind}: {ev.message}"
    res["wall_s"] = time.perf_counter() - t0
    return res


@dataclass
class _Prompt:
    """An example prompt in the shape `run_one` takes."""
    prompt: str
    refs: tuple = ()


def evaluate_examples(pipe: Engine, bot_task: str | None, seeds: int, log=print, fields: dict | None = None) -> dict:
    """The studio's examples for the embedded model, each run with seeds 0..seeds-1: the attribute
    accuracy of the T2I examples (and each prompt's share of fully correct images), the share of edits
    that make their change (and each edit's)."""
    import tempfile

    from webui.examples import SHAPE_PROMPTS, reference_examples
    missing = [p for p in SHAPE_PROMPTS if p not in EXAMPLE_T2I_CHECKS]
    if missing:
        raise ValueError(f"no check for the example prompts {missing}")
    out: dict = {}
    attrs: list[bool] = []
    for prompt in SHAPE_PROMPTS:
        check, ok_all = EXAMPLE_T2I_CHECKS[prompt], []
        for k in range(seeds):
            r = run_one(pipe, _Prompt(prompt), k, bot_task, fields=fields)
            det = detect(r["image"]) if r["image"] is not None else SceneDetection("?", [])
            res = check_t2i(check, det)
            if check["background"]:
                res["background"] = [det.background == check["background"]]
            attrs += [x for v in res.values() for x in v]
            ok_all.append(r["image"] is not None and all(all(v) for v in res.values()))
            log(f"example {prompt!r} seed {k}: {[o.name + ' ' + o.position for o in det.objects]} on "
                f"{det.background} | {res}")
        out[f"example: {prompt}"] = sum(ok_all) / len(ok_all)
    edits: list[bool] = []
    with tempfile.TemporaryDirectory() as folder:
        for path, prompt in reference_examples(Path(folder), small=True):
            if prompt not in EXAMPLE_EDIT_CHECKS:
                raise ValueError(f"no check for the example edit {prompt!r}")
            task, check = EXAMPLE_EDIT_CHECKS[prompt]
            ref, oks = PILImage.open(path).convert("RGB"), []
            for k in range(seeds):
                r = run_one(pipe, _Prompt(prompt), k, bot_task, images=[ref], fields=fields)
                det = detect(r["image"]) if r["image"] is not None else SceneDetection("?", [])
                ok = r["image"] is not None and check_edit(task, check, det)[0]
                oks.append(ok)
                log(f"example edit {prompt!r} seed {k}: {[o.name + ' ' + o.position for o in det.objects]} "
                    f"on {det.background} | ok={ok}")
            edits += oks
            out[f"example edit: {prompt}"] = sum(oks) / len(oks)
    out["examples_t2i_attribute_accuracy"] = sum(attrs) / len(attrs) if attrs else float("nan")
    out["examples_edit_accuracy"] = sum(edits) / len(edits) if edits else float("nan")
    return out


def evaluate_chains(pipe: Engine, n: int, seed: int, bot_task: str, log=print) -> dict:
    """Chained edits (issue 29 item 5): `n` chains of CHAIN_TURNS edits (dataset.edit_chain), turn 1 on
    the reference scene, each later turn a conversation's next turn under each history policy (the model
    sees what the policy shows of the earlier turns: history.py), and, as the yardstick, the same edit
    alone on a perfect rendering of the scene the turn before should have made ("single"). The share of
    turns k whose requested change is in the image, per policy; turn 1 is one run shared by all."""
    out: dict[str, list[bool]] = {}

    def ok_of(r: dict, s) -> bool:
        return r["image"] is not None and check_edit(s.task, s.check, detect(r["image"]))[0]

    for i in range(n):
        chain = edit_chain(seed * 100_003 + i, CHAIN_TURNS)
        refs = [sc.render() for sc in chain[0].refs]
        first = run_one(pipe, chain[0], seed + i, bot_task)
        out.setdefault("chain_turn1", []).append(ok_of(first, chain[0]))
        for policy in POLICIES:
            history, r = (), first
            for k, s in enumerate(chain[1:], start=2):
                prev = chain[k - 2]
                if r["image"] is None:          # the chain broke: the later turns cannot succeed
                    out.setdefault(f"chain_{policy}_turn{k}", []).append(False)
                    continue
                history += (Turn(prev.prompt, tuple(refs if k == 2 else ()), reasoning_of(bot_task, r["cot"]),
                                 r["image"]),)
                r = run_one(pipe, s, seed + i, bot_task, images=[], history=history, policy=policy)
                ok = ok_of(r, s)
                out.setdefault(f"chain_{policy}_turn{k}", []).append(ok)
                log(f"chain {i} [{policy}] turn {k} [{s.task}] {s.prompt!r}: ok={ok} {r['error'] or ''}")
        for k, s in enumerate(chain[1:], start=2):
            out.setdefault(f"chain_single_turn{k}", []).append(ok_of(run_one(pipe, s, seed + i, bot_task), s))
    return {key: sum(v) / len(v) for key, v in out.items()}


def evaluate(model: str | Path, n: int = 40, seed: int = 0, threads: int | None = 2, device: str = "cpu",
             n_edit: int | None = None, save_dir: str | Path | None = None, log=print,
             bot_task: str | None = None, example_seeds: int = 0, quantize: str | None = None,
             resident: str = "auto", dtype: torch.dtype | None = None, steps: int | None = None,
             step_cache: str = "none", chains: int = 0, fp8_activations: bool = False) -> dict:
    """The metrics of one reasoning mode (`bot_task`; None: the checkpoint's default). `quantize`
    ("fp8"): the model quantized online at load, as `--quantize fp8` serves it; `resident` as `load`'s
    ("quantized" on the CPU: the quantized weights stay quantized and run the reference ops, so FP8 is
    W8A8 with per-token activation scales, the semantics the CUDA kernels compute). `steps`: the denoise
    steps of every request (None: the checkpoint's); `step_cache`: a step cache setting by name
    (engine.runtime.step_cache.named_setting). `fp8_activations`: every MX pack folded into FP8 per output
    channel at load (engine/model/kernel_layouts.py `fold_all_to_fp8`), so every quantized GEMM runs W8A8:
    the numbers of `--moe-kernels humming-fp8 --mxfp8-kernels fp8`, on any device (the packs stay quantized:
    `resident` "auto" becomes "quantized")."""
    taylor, block = named_setting(step_cache)
    if fp8_activations:
        if resident == "dense":
            raise ValueError("--fp8-activations folds the quantized packs, which --resident dense dequantizes at load")
        resident = "quantized"
    fields = {"steps": steps, "taylor_cache": taylor, "block_cache": block}
    if threads:
        torch.set_num_threads(threads)
    lm = load(model, device, dtype, quantize=quantize, resident=resident)
    if fp8_activations and not fold_all_to_fp8(lm.model):
        raise ValueError(f"--fp8-activations: {model} keeps no MXFP8 or MXFP4 weights to fold (a checkpoint "
                         "quantized to MX formats, e.g. by auto-round, has them)")
    pipe = Engine(lm, options=EngineOptions(preview_every=0))
    tok, sp = lm.tok, lm.tok.special
    mode = bot_task or lm.gen.bot_task
    n_edit = n if n_edit is None else n_edit
    save = Path(save_dir) if save_dir else None
    if save:
        save.mkdir(parents=True, exist_ok=True)
    # warm-up (first-call allocations are not part of the steady-state time)
    run_one(pipe, make_sample(10 ** 6 + seed, "test", group=0), seed, bot_task, fields=fields)

    attrs = {k: [] for k in T2I_ATTRS}
    extra = {"background": [], "ratio": [], "cot_correct": [], "image_follows_cot": [], "all_correct": []}
    formed, times, errors = [], [], 0
    for i in range(n):
        s = make_sample(seed * 100_003 + i, "test", group=0)
        r = run_one(pipe, s, seed + i, bot_task, fields=fields)
        if r["error"] or r["image"] is None:
            errors += 1
            log(f"t2i {i}: ERROR {r['error']}")
            for k in T2I_ATTRS:
                attrs[k] += [False] * (len(s.check["groups"]) if k != "position" else
                                       sum(1 for g in s.check["groups"] if g["region"]))
            formed.append(False)
            continue
        times.append(r["wall_s"])
        det = detect(r["image"])
        res = check_t2i(s.check, det)
        for k in T2I_ATTRS:
            attrs[k] += res[k]
        extra["all_correct"].append(all(all(v) for v in res.values()))
        if s.check["background"]:
            extra["background"].append(det.background == s.check["background"])
        if s.check["format"]:
            extra["ratio"].append(r["ratio"] == FORMATS[s.check["format"]])
        ids = tok.encode(r["cot"])
        formed.append(well_formed(ids, sp, mode))
        _, recap = split_cot(r["cot"])
        parsed = parse_recaption(recap) if recap else None
        if "recaption" not in mode:
            pass                     # no recaption to check: these rows read n/a
        elif parsed:
            ok = True
            for g in s.check["groups"]:
                objs = [o for o in parsed["objects"] if o[1] == g["shape"] and (not g["color"] or o[0] == g["color"])]
                ok &= len(objs) == g["count"] and (not g["region"] or all(o[2] in REGIONS[g["region"]] for o in objs))
            extra["cot_correct"].append(bool(ok))
            got = sorted((o.color, o.shape, o.cell) for o in det.objects)
            extra["image_follows_cot"].append(got == sorted(parsed["objects"]))
        else:
            extra["cot_correct"].append(False)
            extra["image_follows_cot"].append(False)
        if save:
            r["image"].save(save / f"t2i_{i:03d}.png")
        log(f"t2i {i}: {s.prompt!r} -> {r['cot'][:160]!r} | detected "
            f"{[o.name + ' ' + o.position for o in det.objects]} on {det.background} | {res} | {r['wall_s']:.2f}s")

    edits: dict[str, list[bool]] = {}
    kept: list[bool] = []
    edit_formed, edit_cot, edit_follows = [], [], []
    for i in range(n_edit):
        group = (1, 1, 1, 1, 1, 2, 2, 3)[i % 8]
        s = make_sample(seed * 100_003 + i, "test", group=group)
        r = run_one(pipe, s, seed + i, bot_task, fields=fields)
        if r["error"] or r["image"] is None:
            errors += 1
            edits.setdefault(s.task, []).append(False)
            edit_formed.append(False)
            log(f"ti2i {i}: ERROR {r['error']}")
            continue
        det = detect(r["image"])
        ok, kp = check_edit(s.task, s.check, det)
        edits.setdefault(s.task, []).append(ok)
        kept.append(kp)
        edit_formed.append(well_formed(tok.encode(r["cot"]), sp, mode))
        _, recap = split_cot(r["cot"])
        parsed = parse_recaption(recap) if recap else None
        if "recaption" in mode:
            edit_cot.append(bool(parsed) and check_edit(s.task, s.check, recaption_scene(parsed))[0])
            edit_follows.append(bool(parsed) and sorted((o.color, o.shape, o.cell) for o in det.objects)
                                == sorted(parsed["objects"]))
        if save:
            r["image"].save(save / f"ti2i_{i:03d}_{s.task}.png")
        log(f"ti2i {i} [{s.task}]: {s.prompt!r} -> {r['cot'][:160]!r} | detected "
            f"{[o.name + ' ' + o.position for o in det.objects]} on {det.background} | ok={ok} kept={kp}")

    mean = lambda v: (sum(v) / len(v)) if v else float("nan")
    all_attr = [x for k in T2I_ATTRS for x in attrs[k]]
    all_edit = [x for v in edits.values() for x in v]
    examples = evaluate_examples(pipe, bot_task, example_seeds, log, fields) if example_seeds else {}
    chained = evaluate_chains(pipe, chains, seed, mode, log) if chains else {}
    return {
        "model": str(model), "mode": mode, "steps": steps or lm.gen.diff_infer_steps, "step_cache": step_cache,
        "n_t2i": n, "n_ti2i": n_edit, "seed": seed, "threads": threads,
        "errors": errors, "example_seeds": example_seeds, **examples, "chains": chains, **chained,
        "t2i_attribute_accuracy": mean(all_attr), **{f"t2i_{k}": mean(v) for k, v in attrs.items()},
        **{f"t2i_{k}": mean(v) for k, v in extra.items()},
        "ti2i_edit_accuracy": mean(all_edit), **{f"ti2i_{k}": mean(v) for k, v in edits.items()},
        "ti2i_kept": mean(kept), "ti2i_cot_correct": mean(edit_cot), "ti2i_image_follows_cot": mean(edit_follows),
        "reasoning_well_formed": mean(formed + edit_formed),
        "median_t2i_seconds": statistics.median(times) if times else float("nan"),
    }


def table(ms: list[dict]) -> str:
    """One column per reasoning mode; n/a where the mode has nothing to check (no recaption)."""
    m0 = ms[0]
    rows = [("T2I attribute accuracy (color, shape, count, position)", "t2i_attribute_accuracy"),
            ("  color", "t2i_color"), ("  shape", "t2i_shape"), ("  count", "t2i_count"),
            ("  position", "t2i_position"), ("  background (when asked)", "t2i_background"),
            ("  aspect ratio token (when asked)", "t2i_ratio"), ("  every attribute of the image", "t2i_all_correct"),
            ("  CoT (recaption) matches the request", "t2i_cot_correct"),
            ("  image matches its recaption", "t2i_image_follows_cot"),
            ("TI2I edit accuracy (requested change)", "ti2i_edit_accuracy")]
    rows += [(f"  {k[5:]}", k) for k in m0 if k.startswith("ti2i_") and k not in
             ("ti2i_edit_accuracy", "ti2i_kept", "ti2i_cot_correct", "ti2i_image_follows_cot")]
    rows += [("  untouched objects kept", "ti2i_kept"),
             ("  CoT (recaption) makes the requested change", "ti2i_cot_correct"),
             ("  image matches its recaption", "ti2i_image_follows_cot"),
             ("Reasoning well-formed (the mode's ids)", "reasoning_well_formed")]
    if m0.get("chains"):
        rows += [(f"Chained edits ({m0['chains']} chains): turn 1 makes its change", "chain_turn1")]
        rows += [(f"  turn {k}, {who}", f"chain_{key}_turn{k}") for k in range(2, CHAIN_TURNS + 1)
                 for key, who in [("single", "alone on a perfect image")] + [(p, f"history policy {p}")
                                                                           for p in POLICIES]]
    if m0.get("example_seeds"):
        k = m0["example_seeds"]
        rows += [(f"Studio examples, {k} seeds each: T2I attribute accuracy", "examples_t2i_attribute_accuracy")]
        rows += [(f"  {key[9:]!r} all correct", key) for key in m0 if key.startswith("example: ")]
        rows += [("Studio example edits: requested change", "examples_edit_accuracy")]
        rows += [(f"  {key[14:]!r}", key) for key in m0 if key.startswith("example edit: ")]

    def cell(v: float) -> str:
        return "n/a" if v != v else f"{v:.1%}"
    names = [{"image": "off", "think_recaption": "think + recaption"}.get(m["mode"], m["mode"]) for m in ms]
    width = max(len(r[0]) for r in rows) + 2
    lines = [f"| {'metric':{width}s} | " + " | ".join(f"{n:>17s}" for n in names) + " |",
             f"|{'-' * (width + 2)}|" + "|".join("-" * 19 for _ in ms) + "|"]
    lines += [f"| {label:{width}s} | " + " | ".join(f"{cell(m.get(key, float('nan'))):>17s}" for m in ms) + " |"
              for label, key in rows]
    lines.append(f"| {'Median time, one 256-px T2I image':{width}s} | "
                 + " | ".join(f"{m['median_t2i_seconds']:16.2f}s" for m in ms) + " |")
    return "\n".join(lines)


def run_mode(args: argparse.Namespace, mode: str, save: str | None) -> dict:
    """`evaluate` of one reasoning mode with the command line's settings."""
    return evaluate(args.model, args.n, args.seed, args.threads, args.device, args.n_edit, save,
                    log=(lambda *_: None) if args.quiet else print,
                    bot_task=MODES.get(mode), example_seeds=args.example_seeds, quantize=args.quantize,
                    resident=args.resident, dtype=DTYPES.get(args.dtype), steps=args.steps,
                    step_cache=args.step_cache, chains=args.chains, fp8_activations=args.fp8_activations)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (official layout)")
    ap.add_argument("--n", type=int, default=40, help="held-out T2I prompts (and as many TI2I edits)")
    ap.add_argument("--n-edit", type=int, default=None, help="held-out TI2I samples (default: --n)")
    ap.add_argument("--modes", default=",".join(MODES),
                    help=f"reasoning modes to measure, comma-separated: {', '.join(MODES)} (default: all; "
                         "'default' is the checkpoint's own)")
    ap.add_argument("--example-seeds", type=int, default=5,
                    help="runs of each of the studio's examples per mode (0: none; default 5)")
    ap.add_argument("--chains", type=int, default=0,
                    help=f"chained edits ({CHAIN_TURNS} turns each) per mode, every history policy (0: none)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (the timing target is 2 cores)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default=None,
                    help="weights' and activations' dtype (default: fp32 on the CPU, bf16 on CUDA); bf16 on "
                         "the CPU separates bf16 itself from CUDA's fast paths")
    ap.add_argument("--quantize", choices=["fp8"], default=None,
                    help="quantize the backbone at load (online FP8)")
    ap.add_argument("--resident", choices=["auto", "quantized", "dense"], default="auto",
                    help="quantized weights stay quantized (CUDA default) or are dequantized at load (CPU "
                         "default); 'quantized' on the CPU runs the reference ops (FP8: W8A8)")
    ap.add_argument("--fp8-activations", action="store_true",
                    help="fold every MX-quantized weight into FP8 per output channel and run W8A8 (activations "
                         "quantized per token): the numbers of --moe-kernels humming-fp8 --mxfp8-kernels fp8, on "
                         "any device and any model size")
    ap.add_argument("--json", help="also write the metrics here (a list, one entry per mode)")
    ap.add_argument("--save-images", help="write every generated image into this folder (one subfolder a mode)")
    ap.add_argument("--steps", type=int, default=None, help="denoise steps of every request (default: the checkpoint's)")
    ap.add_argument("--step-cache", default="none",
                    help="step cache setting: none, taylor, taylor-enhance, taylor-N, block, block-T")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--min-attr", type=float, default=None, help="exit 1 if T2I attribute accuracy is lower (any mode)")
    ap.add_argument("--min-edit", type=float, default=None, help="exit 1 if TI2I edit accuracy is lower (any mode)")
    ap.add_argument("--min-formed", type=float, default=None, help="exit 1 if well-formed reasoning is rarer (any mode)")
    args = ap.parse_args(argv)
    try:
        named_setting(args.step_cache)
    except ValueError as e:
        ap.error(f"--step-cache: {e}")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    unknown = [m for m in modes if m not in MODES and m != "default"]
    if unknown or not modes:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}, default")
    ms = []
    for mode in modes:
        save = str(Path(args.save_images) / mode) if args.save_images else None
        try:
            ms.append(run_mode(args, mode, save))
        except ValueError as e:          # what the checkpoint cannot do (e.g. nothing to fold): said, not a trace
            print(f"python -m train.evaluate: error: {e}", file=sys.stderr)
            return 2
    cmd = "python -m train.evaluate " + " ".join(sys.argv[1:] if argv is None else argv)
    print(table(ms))
    print(f"command: {cmd}")
    if args.json:
        Path(args.json).write_text(json.dumps(ms, indent=1))
    fails = [f"{name} ({m['mode']})" for m in ms
             for name, floor, key in (("attribute", args.min_attr, "t2i_attribute_accuracy"),
                                      ("edit", args.min_edit, "ti2i_edit_accuracy"),
                                      ("well-formed", args.min_formed, "reasoning_well_formed"))
             if floor is not None and not m[key] >= floor]
    if fails:
        print(f"below the floor: {', '.join(fails)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
