"""Evaluate a checkpoint folder on held-out prompts through the inference pipeline.

    python -m train.evaluate --model DIR [--n N] [--seed S] [--threads 2] [--json OUT.json]

For each held-out sample (the dataset's test split: scene specifications never seen in training)
the engine's `Pipeline` runs the model's default mode (think_recaption, size auto, the generation
config's steps) and the detector reads the image:

- T2I attribute accuracy: for every requested group, its colour (when the prompt gives one), shape,
  count and position (when given) are checked on the detected objects; the headline is the mean
  over all checked attributes. Background and aspect ratio (bucket) are reported beside it.
- TI2I edit accuracy: the requested change holds (recolour / move / add / remove / background /
  combine); `kept` reports whether the untouched objects survived.
- Reasoning well-formed: the generated ids are `think-text </think> <recaption> text </recaption>
  <answer> <boi> <img_size> <img_ratio_k>` with non-empty texts and no stray special tokens.
- CoT correct: the recaption describes what the prompt asks for (T2I); image follows CoT: the
  detected objects are exactly the recaption's.
- Time: median wall time of one T2I request (reasoning included) with `--threads` CPU threads.
"""
from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from pathlib import Path

import torch
from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Image, Ratio
from engine.model.loader import load
from engine.runtime.pipeline import Pipeline
from engine.runtime.request import Request

from .dataset import COLORS, FORMATS, REGIONS, SHAPES, make_sample
from .detect import Detection, SceneDetection, detect

T2I_ATTRS = ("color", "shape", "count", "position")
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


def well_formed(ids: list[int], sp) -> bool:
    """think ids </think> <recaption> ids </recaption> <answer> <boi> <img_size> <img_ratio_k>."""
    specials = {sp.end_think, sp.recaption, sp.end_recaption, sp.answer, sp.boi, sp.size, sp.think, sp.eos,
                sp.img, sp.eoi, sp.end_answer, sp.cfg, sp.pad, sp.timestep, *sp.ratio}
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


def run_one(pipe: Pipeline, sample, seed: int) -> dict:
    req = Request(prompt=sample.prompt, images=[sc.render() for sc in sample.refs], seed=seed)
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


def evaluate(model: str | Path, n: int = 40, seed: int = 0, threads: int | None = 2, device: str = "cpu",
             n_edit: int | None = None, save_dir: str | Path | None = None, log=print) -> dict:
    if threads:
        torch.set_num_threads(threads)
    lm = load(model, device)
    pipe = Pipeline(lm, preview_every=0)
    tok, sp = lm.tok, lm.tok.special
    n_edit = n if n_edit is None else n_edit
    save = Path(save_dir) if save_dir else None
    if save:
        save.mkdir(parents=True, exist_ok=True)
    # warm-up (first-call allocations are not part of the steady-state time)
    run_one(pipe, make_sample(10 ** 6 + seed, "test", group=0), seed)

    attrs = {k: [] for k in T2I_ATTRS}
    extra = {"background": [], "ratio": [], "cot_correct": [], "image_follows_cot": [], "all_correct": []}
    formed, times, errors = [], [], 0
    for i in range(n):
        s = make_sample(seed * 100_003 + i, "test", group=0)
        r = run_one(pipe, s, seed + i)
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
        formed.append(well_formed(ids, sp))
        _, recap = split_cot(r["cot"])
        parsed = parse_recaption(recap) if recap else None
        if parsed:
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
        r = run_one(pipe, s, seed + i)
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
        edit_formed.append(well_formed(tok.encode(r["cot"]), sp))
        _, recap = split_cot(r["cot"])
        parsed = parse_recaption(recap) if recap else None
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
    return {
        "model": str(model), "n_t2i": n, "n_ti2i": n_edit, "seed": seed, "threads": threads, "errors": errors,
        "t2i_attribute_accuracy": mean(all_attr), **{f"t2i_{k}": mean(v) for k, v in attrs.items()},
        **{f"t2i_{k}": mean(v) for k, v in extra.items()},
        "ti2i_edit_accuracy": mean(all_edit), **{f"ti2i_{k}": mean(v) for k, v in edits.items()},
        "ti2i_kept": mean(kept), "ti2i_cot_correct": mean(edit_cot), "ti2i_image_follows_cot": mean(edit_follows),
        "reasoning_well_formed": mean(formed + edit_formed),
        "median_t2i_seconds": statistics.median(times) if times else float("nan"),
    }


def table(m: dict) -> str:
    rows = [("T2I attribute accuracy (color, shape, count, position)", m["t2i_attribute_accuracy"]),
            ("  color", m["t2i_color"]), ("  shape", m["t2i_shape"]), ("  count", m["t2i_count"]),
            ("  position", m["t2i_position"]), ("  background (when asked)", m["t2i_background"]),
            ("  aspect ratio token (when asked)", m["t2i_ratio"]), ("  every attribute of the image", m["t2i_all_correct"]),
            ("  CoT (recaption) matches the request", m["t2i_cot_correct"]),
            ("  image matches its recaption", m["t2i_image_follows_cot"]),
            ("TI2I edit accuracy (requested change)", m["ti2i_edit_accuracy"])]
    rows += [(f"  {k[5:]}", v) for k, v in m.items() if k.startswith("ti2i_") and k not in
             ("ti2i_edit_accuracy", "ti2i_kept", "ti2i_cot_correct", "ti2i_image_follows_cot")]
    rows += [("  untouched objects kept", m["ti2i_kept"]),
             ("  CoT (recaption) makes the requested change", m["ti2i_cot_correct"]),
             ("  image matches its recaption", m["ti2i_image_follows_cot"]),
             ("Reasoning well-formed (think/recaption/ratio ids)", m["reasoning_well_formed"])]
    lines = [f"| {'metric':55s} | {'value':>7s} |", f"|{'-' * 57}|{'-' * 9}|"]
    lines += [f"| {k:55s} | {v:7.1%} |" for k, v in rows]
    lines.append(f"| {'Median time, one 256-px T2I image with reasoning':55s} | {m['median_t2i_seconds']:6.2f}s |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="checkpoint folder (official layout)")
    ap.add_argument("--n", type=int, default=40, help="held-out T2I prompts (and as many TI2I edits)")
    ap.add_argument("--n-edit", type=int, default=None, help="held-out TI2I samples (default: --n)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="CPU threads (the timing target is 2 cores)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", help="also write the metrics here")
    ap.add_argument("--save-images", help="write every generated image into this folder")
    ap.add_argument("--quiet", action="store_true")
    ap.add_argument("--min-attr", type=float, default=None, help="exit 1 if T2I attribute accuracy is lower")
    ap.add_argument("--min-edit", type=float, default=None, help="exit 1 if TI2I edit accuracy is lower")
    ap.add_argument("--min-formed", type=float, default=None, help="exit 1 if well-formed reasoning is rarer")
    args = ap.parse_args(argv)
    m = evaluate(args.model, args.n, args.seed, args.threads, args.device, args.n_edit, args.save_images,
                 log=(lambda *_: None) if args.quiet else print)
    cmd = "python -m train.evaluate " + " ".join(sys.argv[1:] if argv is None else argv)
    print(table(m))
    print(f"command: {cmd}")
    if args.json:
        Path(args.json).write_text(json.dumps(m, indent=1))
    fails = [name for name, floor, key in (("attribute", args.min_attr, "t2i_attribute_accuracy"),
                                           ("edit", args.min_edit, "ti2i_edit_accuracy"),
                                           ("well-formed", args.min_formed, "reasoning_well_formed"))
             if floor is not None and not m[key] >= floor]
    if fails:
        print(f"below the floor: {', '.join(fails)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
