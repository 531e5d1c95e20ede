"""Resolution buckets and the ratio tokens that name them.

The official table: start at base x base, walk height up / width down (and the mirror) in steps of
base/16, clamp at [base/2, 2*base], align to 16, sort by H/W -> 33 buckets; then the Instruct models
append 1024x768, 1280x720, 768x1024, 720x1280 (H x W) where their ratio is new -> 37 buckets.
Bucket k is named by the token `<img_ratio_k>`.

For base sizes other than 1024 (our tiny models) the four extra buckets are scaled by base/1024 and
aligned to 16; at base 1024 this is exactly the official table.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

ALIGN = 16
_EXTRA_AT_1024 = ((1024, 768), (1280, 720), (768, 1024), (720, 1280))


@dataclass(frozen=True)
class Bucket:
    index: int
    height: int
    width: int

    @property
    def ratio(self) -> float:
        return self.height / self.width

    @property
    def token(self) -> str:
        return f"<img_ratio_{self.index}>"

    def __str__(self) -> str:
        return f"{self.height}x{self.width}"


class SizeError(ValueError):
    """An image size string that names no bucket."""


def _by_step(base: int) -> list[tuple[int, int]]:
    step = base // 16
    lo, hi = base // 2, base * 2
    out = [(base, base)]
    for sign in (1, -1):
        h = w = base
        while not ((sign > 0 and h >= hi and w <= lo) or (sign < 0 and h <= lo and w >= hi)):
            h = min(h + step, hi) if sign > 0 else max(h - step, lo)
            w = max(w - step, lo) if sign > 0 else min(w + step, hi)
            out.append((h // ALIGN * ALIGN, w // ALIGN * ALIGN))
    return sorted(out, key=lambda hw: hw[0] / hw[1])  # stable, as the official sort


def build_buckets(base_size: int) -> tuple[Bucket, ...]:
    if base_size % ALIGN or base_size < 2 * ALIGN * 2:
        raise ValueError(f"image_base_size {base_size} must be a multiple of {ALIGN} and at least {4 * ALIGN}")
    sizes = _by_step(base_size)
    ratios = {h / w for h, w in sizes}
    for h, w in _EXTRA_AT_1024:
        if base_size != 1024:
            h = max(ALIGN, round(h * base_size / 1024 / ALIGN) * ALIGN)
            w = max(ALIGN, round(w * base_size / 1024 / ALIGN) * ALIGN)
        if h / w not in ratios:
            sizes.append((h, w))
            ratios.add(h / w)
    return tuple(Bucket(i, h, w) for i, (h, w) in enumerate(sizes))


def nearest_bucket(buckets: tuple[Bucket, ...], height: float, width: float) -> Bucket:
    """The bucket with the nearest H/W ratio (first on ties, as numpy argmin)."""
    r = height / width
    return min(buckets, key=lambda b: (abs(b.ratio - r), b.index))


MAX_SIZE_DIGITS = 9         # a height, width or bucket index longer than this is no size (and Python's int()
                            # refuses text past 4300 digits with a message of its own)
_HXW = re.compile(r"^\s*(\d+)\s*[xX×*]\s*(\d+)\s*$")
_W_H = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*:\s*(\d+(?:\.\d+)?)\s*$")
_RATIO = re.compile(r"^\s*<img_ratio_(\d+)>\s*$")


def parse_size(size: str, buckets: tuple[Bucket, ...]) -> Bucket | None:
    """`auto` -> None (the model picks); `HxW` (height first) or `W:H` -> nearest bucket; `<img_ratio_k>` -> bucket k."""
    s = size.strip()
    if s.lower() == "auto":
        return None
    longest = max(map(len, re.findall(r"\d+", s)), default=0)
    if longest > MAX_SIZE_DIGITS:
        raise SizeError(f"size: heights, widths and bucket numbers have at most {MAX_SIZE_DIGITS} digits (got a "
                        f"{longest}-digit number)")
    if m := _RATIO.match(s):
        k = int(m.group(1))
        if k >= len(buckets):
            raise SizeError(f"size {size!r}: there are only {len(buckets)} buckets (0..{len(buckets) - 1})")
        return buckets[k]
    if m := _HXW.match(s):
        h, w = int(m.group(1)), int(m.group(2))
    elif m := _W_H.match(s):
        w, h = float(m.group(1)), float(m.group(2))
    else:
        raise SizeError(f"size {size!r} is not understood: use 'auto', 'HxW' (height first, e.g. 1024x768), "
                        "'W:H' (e.g. 16:9) or '<img_ratio_k>'")
    if h <= 0 or w <= 0:
        raise SizeError(f"size {size!r}: height and width must be positive")
    return nearest_bucket(buckets, h, w)
