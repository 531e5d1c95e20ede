"""Example prompts and reference images for the studio.

Reference images are drawn here (simple shapes) into a cache folder on first use, so the examples
work from a clean clone with no binary files in the repository."""
from __future__ import annotations

from pathlib import Path

from PIL import Image, ImageDraw

T2I_PROMPTS = [
    "A red fox sitting in fresh snow at dawn, soft golden light, photorealistic",
    "A cozy reading nook with a window seat, rain on the glass, warm lamp light, watercolor",
    "Isometric illustration of a tiny floating island with a lighthouse, pastel colors",
    "A bowl of ramen on a wooden table, steam rising, shallow depth of field, food photography",
]

# The embedded model (image base size 256) knows simple shape scenes: its examples stay in its world.
SHAPE_PROMPTS = [
    "a red circle on the left on a white background",
    "two blue squares on a gray background",
    "a big yellow star in the center",
    "three small green triangles at the top",
]

# (file name, drawing, edit prompt for a full-size model, edit prompt for the embedded model). The names
# carry the drawing's version: a studio reuses the files already in its cache folder.
_REFERENCES = [
    ("red-circle-2.png", "circle", "Make the circle blue and put it on a beach at sunset", "make the circle blue"),
    ("green-square-2.png", "square", "Turn the square into a wooden crate in a sunny garden",
     "move the square to the right"),
]


def is_small(buckets) -> bool:
    """A model whose largest bucket is at most 512 px is one of the small shape models (the embedded one)."""
    return max(max(b.height, b.width) for b in buckets) <= 512


def t2i_prompts(buckets) -> list[str]:
    return SHAPE_PROMPTS if is_small(buckets) else T2I_PROMPTS


def _draw(kind: str, size: int = 256) -> Image.Image:
    """One shape in the middle of a light background, drawn as the embedded model's training scenes
    draw a large object (extent 0.28 of the side, the same colours): a real photo-scale model takes it
    as well, and the embedded model reads it as it was taught to (a shape filling most of the picture
    is outside its world, and it then describes objects that are not there)."""
    img = Image.new("RGB", (size, size), (245, 245, 245))
    d = ImageDraw.Draw(img)
    c, r = size / 2, 0.28 * size / 2
    if kind == "circle":
        d.ellipse([c - r, c - r, c + r, c + r], fill=(220, 38, 38))
    else:
        h = 0.84 * r
        d.rectangle([c - h, c - h, c + h, c + h], fill=(40, 170, 70))
    return img


def reference_examples(folder: Path, small: bool = False) -> list[tuple[Path, str]]:
    """(image path, edit prompt) pairs, drawing any image that is not on disk yet."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, kind, full_prompt, small_prompt in _REFERENCES:
        prompt = small_prompt if small else full_prompt
        path = folder / name
        if not path.exists():
            tmp = path.with_suffix(".tmp.png")
            _draw(kind).save(tmp)
            tmp.replace(path)         # atomic: two studios starting together never read half a file
        out.append((path, prompt))
    return out
