"""A simple detector for flat-colour shape scenes (the dataset's renders and the model's outputs).

1. Background: the palette background nearest to the image's most common colour (the median of the
   pixels nearest to it estimates its actual shade).
2. Foreground: pixels farther than a threshold from that background colour; connected components
   (4-neighbour, label propagation with pointer jumping, pure numpy) of at least `min_area` pixels.
3. Each component's colour: the palette shape colour nearest to the median of its pixels that are
   far from the background (its core, free of anti-aliased rims).
4. Its shape, from the core mask: the dominant harmonic (3, 4 or 5) of the boundary's radial profile
   (triangle, square/diamond, star; none: circle), square vs diamond by the fill of the bounding box.
5. Its position: the 3 x 3 cell of its centroid (left/center/right, top/middle/bottom).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from PIL import Image

from .dataset import BACKGROUNDS, COLORS

_SHAPE_RGB = np.array(list(COLORS.values()), dtype=np.float32)
_SHAPE_NAMES = list(COLORS)
_BG_RGB = np.array(list(BACKGROUNDS.values()), dtype=np.float32)
_BG_NAMES = list(BACKGROUNDS)
COLS = ("left", "center", "right")
ROWS = ("top", "middle", "bottom")


@dataclass
class Detection:
    shape: str
    color: str
    cell: tuple[int, int]          # (row, col) of the centroid in the 3 x 3 grid
    area: int
    bbox: tuple[int, int, int, int]  # y0, x0, y1, x1 (inclusive)
    fill: float

    @property
    def name(self) -> str:
        return f"{self.color} {self.shape}"

    @property
    def position(self) -> str:
        return f"{ROWS[self.cell[0]]} {COLS[self.cell[1]]}"


@dataclass
class SceneDetection:
    background: str
    objects: list[Detection]

    def find(self, shape: str | None = None, color: str | None = None) -> list[Detection]:
        return [o for o in self.objects if (shape is None or o.shape == shape) and (color is None or o.color == color)]


def _label(mask: np.ndarray) -> np.ndarray:
    """Connected components (4-neighbour) of a boolean mask: -1 outside, else a component id (the
    smallest flat index in the component)."""
    H, W = mask.shape
    big = H * W
    lab = np.where(mask, np.arange(big).reshape(H, W), big)
    while True:
        prev = lab
        m = lab.copy()
        m[1:, :] = np.minimum(m[1:, :], lab[:-1, :])
        m[:-1, :] = np.minimum(m[:-1, :], lab[1:, :])
        m[:, 1:] = np.minimum(m[:, 1:], lab[:, :-1])
        m[:, :-1] = np.minimum(m[:, :-1], lab[:, 1:])
        m = np.where(mask, m, big)
        flat = m.reshape(-1)
        # pointer jumping: follow labels to their own labels (fast convergence on large blobs)
        valid = flat < big
        for _ in range(4):
            nxt = flat.copy()
            nxt[valid] = flat[flat[valid]]
            flat = nxt
        lab = flat.reshape(H, W)
        if np.array_equal(lab, prev):
            break
    return np.where(mask, lab, -1)


def radial_harmonics(core: np.ndarray, bins: int = 64) -> dict[int, float]:
    """Magnitudes of harmonics 2..5 of the boundary's radial profile r(angle) / mean(r) around the
    centroid: a star has a strong 5th, a triangle a 3rd, a square or diamond a 4th, a circle none.
    Robust to the blur of decoded images (measured on blurred renders)."""
    yy, xx = np.nonzero(core)
    cy, cx = yy.mean(), xx.mean()
    pad = np.pad(core, 1)
    inner = pad[1:-1, 1:-1] & pad[:-2, 1:-1] & pad[2:, 1:-1] & pad[1:-1, :-2] & pad[1:-1, 2:]
    by, bx = np.nonzero(core & ~inner)
    ang = np.arctan2(by - cy, bx - cx)
    r = np.hypot(by - cy, bx - cx) + 0.5
    idx = ((ang + np.pi) / (2 * np.pi) * bins).astype(np.int64) % bins
    prof = np.zeros(bins)
    np.maximum.at(prof, idx, r)
    for i in range(bins):               # empty bins (tiny shapes): the neighbours' value
        if prof[i] == 0:
            prof[i] = max(prof[i - 1], prof[(i + 1) % bins])
    prof = prof / max(prof.mean(), 1e-6)
    th = np.arange(bins) / bins * 2 * np.pi - np.pi
    return {k: float(abs((prof * np.exp(-1j * k * th)).mean())) for k in (2, 3, 4, 5)}


def classify_shape(core: np.ndarray) -> tuple[str, float]:
    """Shape class of a component's core mask (cropped to its bounding box) and its fill ratio."""
    h, w = core.shape
    fill = float(core.sum()) / float(h * w)
    a = radial_harmonics(core)
    k = max((3, 4, 5), key=lambda j: a[j])
    if a[k] < 0.03:
        return ("square" if fill > 0.9 else "circle"), fill
    if k == 5:
        return "star", fill
    if k == 3:
        return "triangle", fill
    return ("square" if fill > 0.8 else "diamond"), fill


def detect(img: Image.Image | np.ndarray, min_area_frac: float = 0.0025) -> SceneDetection:
    a = np.asarray(img.convert("RGB") if isinstance(img, Image.Image) else img, dtype=np.float32)
    H, W, _ = a.shape
    flat = a.reshape(-1, 3)
    # background: nearest palette background to the most common colour (coarsely quantised)
    q = (flat // 16).astype(np.int32)
    keys = q[:, 0] * 256 + q[:, 1] * 16 + q[:, 2]
    mode = np.bincount(keys).argmax()
    mode_rgb = np.array([mode // 256, (mode // 16) % 16, mode % 16], dtype=np.float32) * 16 + 8
    bg_i = int(np.argmin(((_BG_RGB - mode_rgb) ** 2).sum(1)))
    near_bg = ((flat - mode_rgb) ** 2).sum(1) < 40.0 ** 2
    bg_rgb = np.median(flat[near_bg], axis=0) if near_bg.any() else _BG_RGB[bg_i]
    dist_bg = np.sqrt(((a - bg_rgb) ** 2).sum(-1))
    # distance from the background to the closest shape colour sets the foreground threshold
    min_gap = np.sqrt(((_SHAPE_RGB - bg_rgb) ** 2).sum(1)).min()
    fg = dist_bg > 0.35 * min_gap
    labels = _label(fg)
    ids, counts = np.unique(labels[labels >= 0], return_counts=True)
    min_area = max(8, int(min_area_frac * H * W))
    objects = []
    for cid, n in zip(ids, counts):
        if n < min_area:
            continue
        comp = labels == cid
        pix = a[comp]
        dpix = dist_bg[comp]
        strong = pix[dpix >= np.percentile(dpix, 50)]
        med = np.median(strong, axis=0)
        ci = int(np.argmin(((_SHAPE_RGB - med) ** 2).sum(1)))
        # core: at least half-way from the background to the component's colour
        gap = np.sqrt(((_SHAPE_RGB[ci] - bg_rgb) ** 2).sum())
        core = comp & (dist_bg > 0.5 * gap)
        if core.sum() < min_area // 2:
            continue
        yy, xx = np.nonzero(core)
        y0, y1, x0, x1 = yy.min(), yy.max(), xx.min(), xx.max()
        shape, fill = classify_shape(core[y0:y1 + 1, x0:x1 + 1])
        cy, cx = yy.mean(), xx.mean()
        cell = (min(2, int(cy / H * 3)), min(2, int(cx / W * 3)))
        objects.append(Detection(shape, _SHAPE_NAMES[ci], cell, int(core.sum()), (int(y0), int(x0), int(y1), int(x1)),
                                 fill))
    objects.sort(key=lambda o: o.cell)
    return SceneDetection(_BG_NAMES[bg_i], objects)
