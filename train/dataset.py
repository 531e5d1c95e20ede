"""A procedural dataset of flat-colour shape scenes (no downloads), for T2I and TI2I.

A `Scene` is a background colour, an aspect-ratio format (one of a handful of the model's buckets at
base size 256) and up to four objects, each a shape of one colour and size in one cell of a 3 x 3
grid (with a little jitter inside its cell, so objects never overlap). Scenes render to flat-colour
RGB images at their bucket's size.

A `Sample` is what one training sequence is made of: the user prompt (varied phrasings), the
reference scenes (TI2I), a short `<think>` text, a `<recaption>` text, the bot task and system
prompt preset, and the target scene (its bucket is the ratio token the model must emit). `check`
holds what the evaluator verifies on a generated image.

Tasks: `t2i` (one or two groups of shapes, counts 1-3, optional colour / size / position /
background / format), edits of one reference image (`recolor`, `move`, `add`, `remove`,
`background`) and `combine` (the objects of 2 or 3 reference images arranged in one image).

Everything is a pure function of (seed, split). The held-out split is made of whole scene
specifications: a spec whose hash falls in the held-out class never appears in training.
"""
from __future__ import annotations

import random
import zlib
from dataclasses import dataclass, field, replace

from PIL import Image, ImageDraw

from engine.checkpoint.buckets import Bucket, build_buckets

BASE_SIZE = 256
BUCKETS: tuple[Bucket, ...] = build_buckets(BASE_SIZE)
# format name -> bucket index (H x W at base 256): 256x256, 192x320, 320x192, 192x256, 256x192
FORMATS = {"square": 16, "wide": 12, "tall": 20, "landscape": 35, "portrait": 33}

SHAPES = ("circle", "square", "triangle", "diamond", "star")
COLORS = {"red": (220, 38, 38), "orange": (245, 140, 20), "yellow": (245, 215, 30),
          "green": (40, 170, 70), "blue": (35, 90, 225), "purple": (140, 55, 200)}
BACKGROUNDS = {"white": (245, 245, 245), "black": (20, 20, 20), "gray": (128, 128, 128)}
SIZES = {"small": 0.2, "large": 0.28}           # object extent as a fraction of min(H, W)

CELL_NAMES = {(0, 0): "top left", (0, 1): "top", (0, 2): "top right",
              (1, 0): "left", (1, 1): "center", (1, 2): "right",
              (2, 0): "bottom left", (2, 1): "bottom", (2, 2): "bottom right"}
ALL_CELLS = tuple(CELL_NAMES)
# position regions a prompt can ask for -> the cells that satisfy them
REGIONS: dict[str, tuple[tuple[int, int], ...]] = {
    "left": ((0, 0), (1, 0), (2, 0)), "right": ((0, 2), (1, 2), (2, 2)),
    "top": ((0, 0), (0, 1), (0, 2)), "bottom": ((2, 0), (2, 1), (2, 2)),
    "middle row": ((1, 0), (1, 1), (1, 2)), "center": ((1, 1),),
    "top left": ((0, 0),), "top right": ((0, 2),), "bottom left": ((2, 0),), "bottom right": ((2, 2),),
}
REGION_PHRASES = {
    "left": ["on the left", "on the left side", "at the left"],
    "right": ["on the right", "on the right side", "at the right"],
    "top": ["at the top", "along the top", "near the top"],
    "bottom": ["at the bottom", "along the bottom", "near the bottom"],
    "middle row": ["in the middle row", "across the middle"],
    "center": ["in the center", "in the middle", "at the center"],
    "top left": ["in the top left corner", "at the top left"],
    "top right": ["in the top right corner", "at the top right"],
    "bottom left": ["in the bottom left corner", "at the bottom left"],
    "bottom right": ["in the bottom right corner", "at the bottom right"],
}
CANON_REGION = {k: v[0] for k, v in REGION_PHRASES.items()}
FORMAT_PHRASES = {
    "square": ["square", "1:1"], "wide": ["wide", "widescreen", "5:3"], "tall": ["tall", "vertical", "3:5"],
    "landscape": ["landscape", "4:3"], "portrait": ["portrait", "3:4"],
}
COUNT_WORDS = {1: ["a", "one"], 2: ["two", "2", "a pair of"], 3: ["three", "3"]}
CANON_COUNT = {1: "one", 2: "two", 3: "three"}
SIZE_WORDS = {"small": ["small", "little", "tiny"], "large": ["large", "big"]}

SYSTEM_PRESETS = ("en_unified", "None", "en_think_recaption", "en_recaption", "en_vanilla")
SYSTEM_WEIGHTS = (0.75, 0.1, 0.05, 0.05, 0.05)
# The texts of the checkpoint's system_prompt.py (our own short prompts, official variable names).
SYSTEM_TEXTS = {
    "en_unified": "You draw and edit simple images of shapes. Think in <think> tags, describe the image "
                  "in <recaption> tags, then draw it.",
    "en_think_recaption": "Think about the request in <think> tags, describe the image in <recaption> tags, "
                          "then draw it.",
    "en_recaption": "Describe the image in <recaption> tags, then draw it.",
    "en_vanilla": "Draw what the user asks for.",
}
SYSTEM_PROMPT_PY = f'''"""System prompts of the embedded default model (same variable names as the official file)."""

t2i_system_prompt_en_vanilla = """
{SYSTEM_TEXTS["en_vanilla"]}
"""

t2i_system_prompt_en_recaption = """
{SYSTEM_TEXTS["en_recaption"]}
"""

t2i_system_prompt_en_think_recaption = """
{SYSTEM_TEXTS["en_think_recaption"]}
"""

unified_system_prompt_en = """
{SYSTEM_TEXTS["en_unified"]}
"""
'''

BOT_TASKS = ("think_recaption", "recaption", "image")
BOT_TASK_WEIGHTS = (0.84, 0.08, 0.08)
# Reference-image groups (the trainer batches samples of one group together: equal-ish lengths).
GROUP_TASKS = {0: ("t2i",), 1: ("recolor", "move", "add", "remove", "background"), 2: ("combine",), 3: ("combine",)}
EDIT_WEIGHTS = (0.3, 0.22, 0.2, 0.18, 0.1)
HELDOUT_MOD = 16          # 1 in 16 scene specifications is held out


def system_text(preset: str) -> str:
    return "" if preset == "None" else SYSTEM_TEXTS[preset]


# --------------------------------------------------------------------------------------------- scenes
@dataclass(frozen=True)
class Obj:
    shape: str
    color: str
    size: str
    cell: tuple[int, int]
    jx: float = 0.0          # jitter in [-1, 1] of the free room inside the cell
    jy: float = 0.0

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"

    def phrase(self) -> str:
        return f"{self.size} {self.color} {self.shape} {CELL_NAMES[self.cell]}"


@dataclass(frozen=True)
class Scene:
    fmt: str
    background: str
    objects: tuple[Obj, ...]

    @property
    def bucket(self) -> Bucket:
        return BUCKETS[FORMATS[self.fmt]]

    def sorted_objects(self) -> tuple[Obj, ...]:
        return tuple(sorted(self.objects, key=lambda o: o.cell))

    def caption(self) -> str:
        """The recaption: format, background, then every object (size colour shape cell), row-major."""
        objs = ", ".join(o.phrase() for o in self.sorted_objects())
        return f"{self.fmt}, {self.background} background: {objs}." if objs else \
            f"{self.fmt}, {self.background} background, empty."

    def free_cells(self) -> list[tuple[int, int]]:
        used = {o.cell for o in self.objects}
        return [c for c in ALL_CELLS if c not in used]

    def render(self, scale: int = 2) -> Image.Image:
        """Flat colours, anti-aliased by drawing at `scale`x and box-downsampling."""
        b = self.bucket
        H, W = b.height, b.width
        img = Image.new("RGB", (W * scale, H * scale), BACKGROUNDS[self.background])
        draw = ImageDraw.Draw(img)
        for o in self.objects:
            cx, cy, d = object_geometry(o, H, W)
            draw_shape(draw, o.shape, cx * scale, cy * scale, d * scale, COLORS[o.color])
        return img.resize((W, H), Image.Resampling.BOX) if scale > 1 else img


def object_geometry(o: Obj, H: int, W: int) -> tuple[float, float, float]:
    """Centre (x, y) and extent d of an object in pixels."""
    ch, cw = H / 3, W / 3
    d = SIZES[o.size] * min(H, W)
    rx, ry = max(0.0, cw - d) / 2 * 0.7, max(0.0, ch - d) / 2 * 0.7
    return (o.cell[1] + 0.5) * cw + o.jx * rx, (o.cell[0] + 0.5) * ch + o.jy * ry, d


def shape_polygon(shape: str, cx: float, cy: float, d: float) -> list[tuple[float, float]] | None:
    import math
    r = d / 2
    if shape == "square":
        s = 0.42 * d
        return [(cx - s, cy - s), (cx + s, cy - s), (cx + s, cy + s), (cx - s, cy + s)]
    if shape == "triangle":   # apex up, bounding box centred on (cx, cy)
        return [(cx, cy - r), (cx + r, cy + 0.75 * r), (cx - r, cy + 0.75 * r)]
    if shape == "diamond":
        return [(cx, cy - r), (cx + 0.8 * r, cy), (cx, cy + r), (cx - 0.8 * r, cy)]
    if shape == "star":
        pts = []
        for k in range(10):
            rad = r if k % 2 == 0 else 0.42 * r
            a = -math.pi / 2 + k * math.pi / 5
            pts.append((cx + rad * math.cos(a), cy + 0.08 * r + rad * math.sin(a)))
        return pts
    return None


def draw_shape(draw: ImageDraw.ImageDraw, shape: str, cx: float, cy: float, d: float, rgb) -> None:
    if shape == "circle":
        r = d / 2
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=rgb)
    else:
        draw.polygon(shape_polygon(shape, cx, cy, d), fill=rgb)


# -------------------------------------------------------------------------------------------- samples
@dataclass
class Sample:
    task: str
    prompt: str
    think: str
    recaption: str
    target: Scene
    refs: tuple[Scene, ...] = ()
    bot_task: str = "think_recaption"
    system: str = "en_unified"
    check: dict = field(default_factory=dict)
    key: str = ""

    @property
    def bucket(self) -> Bucket:
        return self.target.bucket

    def cot_text(self) -> str | None:
        """The CoT as the pipeline hands it to the image phase (tags included), or None."""
        if self.bot_task == "think_recaption":
            return f"<think>{self.think}</think><recaption>{self.recaption}</recaption>"
        if self.bot_task == "recaption":
            return f"<recaption>{self.recaption}</recaption>"
        return None


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _count_phrase(rng: random.Random, n: int, next_word: str) -> str:
    w = rng.choice(COUNT_WORDS[n])
    return _article(next_word) if w == "a" else w


def _group_text(n: int, size: str | None, color: str | None, shape: str, canon: bool,
                rng: random.Random | None = None) -> str:
    words = [w for w in ((SIZE_WORDS[size][0] if canon else rng.choice(SIZE_WORDS[size])) if size else None,
                         color, shape + ("s" if n > 1 else "")) if w]
    first = words[0]
    count = CANON_COUNT[n] if canon else _count_phrase(rng, n, first)
    return " ".join([count] + words)


def _place(rng: random.Random, region: str | None, n: int, free: list[tuple[int, int]]) -> list[tuple[int, int]] | None:
    cells = [c for c in (REGIONS[region] if region else ALL_CELLS) if c in free]
    if len(cells) < n:
        return None
    return rng.sample(cells, n)


def _jitter(rng: random.Random) -> tuple[float, float]:
    return rng.uniform(-1, 1), rng.uniform(-1, 1)


def _capitalize(rng: random.Random, s: str) -> str:
    return s[0].upper() + s[1:] if rng.random() < 0.5 else s


_T2I_STARTS = ["", "", "Draw ", "Paint ", "Show ", "Generate ", "Create ", "Make ", "An image of ", "A picture of ",
               "Please draw ", "I want ", "Render "]
_BG_PHRASES = [" on a {} background", " with a {} background", ", {} background", " over {}"]
_FMT_PHRASES = [", {}", " in {} format", ", {} image", " ({})"]
_ENDS = ["", "", ".", "!"]


def _t2i(rng: random.Random, fmt: str | None = None) -> Sample:
    n_groups = 1 if rng.random() < 0.7 else 2
    fmt = fmt or rng.choice(list(FORMATS))
    bg = rng.choice(list(BACKGROUNDS))
    shapes = rng.sample(SHAPES, n_groups)
    colors = rng.sample(list(COLORS), n_groups)
    objects: list[Obj] = []
    prompt_groups, think_groups, spec_groups, checks = [], [], [], []
    for g in range(n_groups):
        if n_groups == 1:
            n = rng.choices((1, 2, 3), (0.45, 0.3, 0.25))[0]
        else:
            n = 1 if rng.random() < 0.75 else 2
        region = rng.choice(list(REGIONS)) if rng.random() < 0.6 else None
        cells = _place(rng, region, n, [c for c in ALL_CELLS if c not in {o.cell for o in objects}])
        if cells is None:
            region = None
            cells = _place(rng, None, n, [c for c in ALL_CELLS if c not in {o.cell for o in objects}])
        size_given = rng.random() < 0.35
        size = "large" if rng.random() < (0.5 if n == 1 else 0.25) else "small"
        color_given = rng.random() < 0.9
        shape, color = shapes[g], colors[g]
        for c in cells:
            objects.append(Obj(shape, color, size, c, *_jitter(rng)))
        p = _group_text(n, size if size_given else None, color if color_given else None, shape, False, rng)
        t = _group_text(n, size, color, shape, True)
        if region:
            p += " " + rng.choice(REGION_PHRASES[region])
            t += " " + CANON_REGION[region]
        prompt_groups.append(p)
        think_groups.append(t)
        spec_groups.append((n, size if size_given else None, color if color_given else None, shape, region))
        checks.append({"shape": shape, "color": color if color_given else None, "count": n, "region": region,
                       "chosen_color": color})
    bg_given, fmt_given = rng.random() < 0.5, rng.random() < 0.5
    prompt = rng.choice(_T2I_STARTS) + " and ".join(prompt_groups)
    if bg_given:
        prompt += rng.choice(_BG_PHRASES).format(bg)
    if fmt_given:
        prompt += rng.choice(_FMT_PHRASES).format(rng.choice(FORMAT_PHRASES[fmt]))
    prompt = _capitalize(rng, prompt.strip()) + rng.choice(_ENDS)
    scene = Scene(fmt, bg, tuple(objects))
    think = f"{'; '.join(think_groups)}; {bg} background; {fmt}."
    key = repr(("t2i", tuple(spec_groups), bg if bg_given else None, fmt if fmt_given else None))
    check = {"groups": checks, "background": bg if bg_given else None, "format": fmt if fmt_given else None}
    return Sample("t2i", prompt, think, scene.caption(), scene, check=check, key=key)


def _ref_scene(rng: random.Random, n_objects: int, fmt: str | None = None) -> Scene:
    """A reference scene: n objects of distinct shapes (so 'the circle' names one object)."""
    shapes = rng.sample(SHAPES, n_objects)
    cells = rng.sample(ALL_CELLS, n_objects)
    objs = tuple(Obj(s, rng.choice(list(COLORS)), rng.choice(list(SIZES)), c, *_jitter(rng))
                 for s, c in zip(shapes, cells))
    return Scene(fmt or rng.choice(list(FORMATS)), rng.choice(list(BACKGROUNDS)), objs)


def _describe_ref(i: int, scene: Scene) -> str:
    names = ", ".join(o.name for o in scene.sorted_objects())
    return f"image {i}: {names} on {scene.background}."


def _edit(rng: random.Random, kind: str, fmt: str | None = None, ref: Scene | None = None) -> Sample:
    """An edit of `kind` on a random reference scene, or on `ref` (an edit chain's next turn)."""
    if ref is None:
        n_obj = {"remove": rng.choice((2, 2, 3)), "add": rng.choice((1, 1, 2, 3)),
                 "background": rng.choice((1, 2, 3))}.get(kind, rng.choice((1, 1, 2, 3)))
        ref = _ref_scene(rng, n_obj, fmt)
    objs = list(ref.objects)
    preserve = [o.name for o in objs]
    if kind == "recolor":
        k = rng.randrange(len(objs))
        o = objs[k]
        new = rng.choice([c for c in COLORS if c != o.color])
        objs[k] = replace(o, color=new)
        preserve.remove(o.name)
        prompt = rng.choice([f"make the {o.shape} {new}", f"change the color of the {o.shape} to {new}",
                             f"turn the {o.name} {new}", f"paint the {o.shape} {new}", f"recolor the {o.shape} {new}"])
        op = f"recolor the {o.shape} to {new}."
        check = {"shape": o.shape, "old": o.color, "new": new}
        spec = (o.name, new)
    elif kind == "move":
        k = rng.randrange(len(objs))
        o = objs[k]
        free = ref.free_cells()
        options = [r for r in REGIONS if o.cell not in REGIONS[r] and any(c in free for c in REGIONS[r])]
        region = rng.choice(options)
        cands = [c for c in REGIONS[region] if c in free]
        same_line = [c for c in cands if c[0] == o.cell[0] or c[1] == o.cell[1]]
        cell = rng.choice(same_line or cands)
        objs[k] = replace(o, cell=cell)
        prompt = rng.choice([f"move the {o.shape} {p}" for p in REGION_PHRASES[region]]
                            + [f"put the {o.name} {REGION_PHRASES[region][0]}"])
        op = f"move the {o.shape} {CANON_REGION[region]}."
        check = {"shape": o.shape, "color": o.color, "region": region}
        spec = (o.name, region)
    elif kind == "add":
        shape = rng.choice([s for s in SHAPES if s not in {o.shape for o in objs}])
        color, size = rng.choice(list(COLORS)), rng.choice(list(SIZES))
        region = rng.choice(list(REGIONS)) if rng.random() < 0.6 else None
        cells = _place(rng, region, 1, ref.free_cells())
        if cells is None:
            region, cells = None, _place(rng, None, 1, ref.free_cells())
        objs.append(Obj(shape, color, size, cells[0], *_jitter(rng)))
        where = (" " + rng.choice(REGION_PHRASES[region])) if region else ""
        what = f"{_article(color)} {color} {shape}" if rng.random() < 0.6 else \
            f"{_article(size)} {rng.choice(SIZE_WORDS[size])} {color} {shape}"
        prompt = rng.choice(["add ", "also draw ", "put ", "insert "]) + what + where
        op = f"add {_article(size)} {size} {color} {shape}" + (f" {CANON_REGION[region]}." if region else ".")
        check = {"shape": shape, "color": color, "region": region}
        spec = (shape, color, region)
    elif kind == "remove":
        k = rng.randrange(len(objs))
        o = objs.pop(k)
        preserve.remove(o.name)
        prompt = rng.choice([f"remove the {o.shape}", f"delete the {o.name}", f"take away the {o.shape}",
                             f"erase the {o.shape}", f"get rid of the {o.name}"])
        op = f"remove the {o.shape}."
        check = {"shape": o.shape, "color": o.color}
        spec = (o.name,)
    elif kind == "background":
        bg = rng.choice([b for b in BACKGROUNDS if b != ref.background])
        prompt = rng.choice([f"change the background to {bg}", f"make the background {bg}",
                             f"use a {bg} background", f"put it on a {bg} background"])
        op = f"background to {bg}."
        check = {"background": bg}
        spec = (bg,)
        target = Scene(ref.fmt, bg, tuple(objs))
    else:
        raise ValueError(kind)
    if kind != "background":
        target = Scene(ref.fmt, ref.background, tuple(objs))
    prompt = _capitalize(rng, prompt) + rng.choice(_ENDS)
    think = f"{_describe_ref(1, ref)} {op}"
    check |= {"preserve": preserve, "format": ref.fmt}
    key = repr((kind, tuple(sorted(o.name for o in ref.objects)), ref.background, spec))
    return Sample(kind, prompt, think, target.caption(), target, refs=(ref,), check=check, key=key)


_ARRANGE = {2: {"row": ("left", "right"), "column": ("top", "bottom")},
            3: {"row": ("left", "center", "right"), "column": ("top", "center", "bottom")}}
_ARRANGE_CELLS = {"left": (1, 0), "right": (1, 2), "top": (0, 1), "bottom": (2, 1), "center": (1, 1)}


def _combine(rng: random.Random, n: int, fmt: str | None = None) -> Sample:
    refs = []
    shapes = rng.sample(SHAPES, n)
    for k, s in enumerate(shapes):
        refs.append(Scene((fmt if k == 0 else None) or rng.choice(list(FORMATS)), rng.choice(list(BACKGROUNDS)),
                          (Obj(s, rng.choice(list(COLORS)), rng.choice(list(SIZES)), rng.choice(ALL_CELLS),
                               *_jitter(rng)),)))
    kind = "row" if rng.random() < 0.7 else "column"
    places = _ARRANGE[n][kind]
    objs = [o.objects[0] for o in refs]
    target = Scene(refs[0].fmt, refs[0].background,
                   tuple(replace(o, cell=_ARRANGE_CELLS[p], jx=0.0, jy=0.0) for o, p in zip(objs, places)))
    num = {2: "two", 3: "three"}[n]
    explicit = rng.random() < 0.5
    if explicit:
        parts = [f"the {o.shape} from image {i + 1} {REGION_PHRASES[p][0] if p != 'center' else 'in the center'}"
                 for i, (o, p) in enumerate(zip(objs, places))]
        prompt = rng.choice(["put ", "place ", "arrange "]) + (", ".join(parts[:-1]) + " and " + parts[-1])
    else:
        layout = "in a row" if kind == "row" else rng.choice(["in a column", "stacked vertically"])
        prompt = rng.choice([f"combine the shapes of the {num} images {layout}",
                             f"put the {num} shapes together {layout}",
                             f"merge the {num} images {layout}", f"combine these shapes {layout}"])
    prompt = _capitalize(rng, prompt) + rng.choice(_ENDS)
    think = " ".join(f"image {i + 1}: {o.name}." for i, o in enumerate(objs)) + " " + \
        ", ".join(f"{o.shape} {p}" for o, p in zip(objs, places)) + "; background of image 1."
    check = {"objects": [{"shape": o.shape, "color": o.color, "region": p}
                         for o, p in zip(objs, places)], "background": refs[0].background, "format": refs[0].fmt}
    key = repr(("combine", tuple(o.name for o in objs), kind, refs[0].background))
    return Sample("combine", prompt, think, target.caption(), target, refs=tuple(refs), check=check, key=key)


def is_heldout(key: str) -> bool:
    return zlib.crc32(key.encode()) % HELDOUT_MOD == 0


def _draw(rng: random.Random, group: int | None, task: str | None, fmt: str | None = None) -> Sample:
    if task is None:
        if group is None:
            group = rng.choices((0, 1, 2, 3), (0.5, 0.32, 0.11, 0.07))[0]
        task = GROUP_TASKS[group][0] if group != 1 else rng.choices(GROUP_TASKS[1], EDIT_WEIGHTS)[0]
    if task == "t2i":
        return _t2i(rng, fmt)
    if task == "combine":
        return _combine(rng, group if group in (2, 3) else rng.choice((2, 3)), fmt)
    return _edit(rng, task, fmt)


def make_sample(seed: int, split: str = "train", group: int | None = None, task: str | None = None,
                vary_format: bool | None = None, fmt: str | None = None) -> Sample:
    """Sample `seed` of `split` ('train' or 'test'). `group` = number of reference images (0 = T2I),
    `task` forces a task. Train samples vary the bot task and system prompt; test samples use the
    model's defaults (think_recaption, en_unified) unless vary_format is True. `fmt` forces the target's
    format (the trainer's batches share one: one image shape per batch)."""
    if split not in ("train", "test"):
        raise ValueError(f"split must be 'train' or 'test', not {split!r}")
    rng = random.Random(f"{split}:{seed}:{group}:{task}:{fmt}")
    while True:
        s = _draw(rng, group, task, fmt)
        if is_heldout(s.key) == (split == "test"):
            break
    if vary_format if vary_format is not None else split == "train":
        s.bot_task = rng.choices(BOT_TASKS, BOT_TASK_WEIGHTS)[0]
        s.system = rng.choices(SYSTEM_PRESETS, SYSTEM_WEIGHTS)[0]
    return s


def _edit_fits(kind: str, scene: Scene) -> bool:
    """Whether `_edit` can make an edit of `kind` on `scene` (as its own reference scenes always allow)."""
    if kind == "remove":
        return len(scene.objects) >= 2
    if kind == "add":
        return bool(scene.free_cells()) and len({o.shape for o in scene.objects}) < len(SHAPES)
    if kind == "move":
        free = scene.free_cells()
        return any(any(c in free for c in REGIONS[r]) and o.cell not in REGIONS[r] for o in scene.objects
                   for r in REGIONS)
    return bool(scene.objects) or kind == "background"


def edit_chain(seed: int, turns: int = 3) -> list[Sample]:
    """Chained edits (issue 29 item 5): turn 1 is the held-out single edit `make_sample(seed, 'test',
    group=1)`; each later turn edits the scene the turn before should have made (its target), with a
    kind that scene allows. Later turns' scenes are not held out (they are new combinations anyway)."""
    chain = [make_sample(seed, "test", group=1)]
    rng = random.Random(f"chain:{seed}")
    while len(chain) < turns:
        ref = chain[-1].target
        kinds = [k for k in GROUP_TASKS[1] if _edit_fits(k, ref)]
        for _ in range(20):             # a move may find no free cell for the object it drew: draw again
            try:
                chain.append(_edit(rng, rng.choice(kinds), ref=ref))
                break
            except IndexError:
                continue
        else:
            raise ValueError(f"no edit of chain {seed} after turn {len(chain)}")
    return chain


def corpus(n: int = 6000, seed: int = 0) -> list[str]:
    """Texts for training the tokenizer: prompts, CoTs, system prompts and the template's fixed strings."""
    out = list(SYSTEM_TEXTS.values()) + ["User: ", "Assistant: ", "\n\n"]
    for i in range(n):
        s = make_sample(seed * 1_000_003 + i, "train")
        out += [s.prompt, s.think, s.recaption]
    return out
