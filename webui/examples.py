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

# (file name, drawing, edit prompt)
_REFERENCES = [
    ("red-circle.png", "circle", "Make the circle blue and put it on a beach at sunset"),
    ("green-square.png", "square", "Turn the square into a wooden crate in a sunny garden"),
]


def _draw(kind: str, size: int = 384) -> Image.Image:
    img = Image.new("RGB", (size, size), (245, 245, 240))
    d = ImageDraw.Draw(img)
    m = size // 5
    if kind == "circle":
        d.ellipse([m, m, size - m, size - m], fill=(210, 40, 40))
    else:
        d.rectangle([m, m, size - m, size - m], fill=(40, 160, 70))
    return img


def reference_examples(folder: Path) -> list[tuple[Path, str]]:
    """(image path, edit prompt) pairs, drawing any image that is not on disk yet."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for name, kind, prompt in _REFERENCES:
        path = folder / name
        if not path.exists():
            tmp = path.with_suffix(".tmp.png")
            _draw(kind).save(tmp)
            tmp.replace(path)         # atomic: two studios starting together never read half a file
        out.append((path, prompt))
    return out
