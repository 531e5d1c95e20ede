"""Reference-image input and image output: open, bucket-fit, tensors, PNG."""
from __future__ import annotations

import io
import math
from pathlib import Path

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.spec.buckets import Bucket, nearest_bucket

MAX_PIXELS = 64_000_000   # refuse decompression bombs before decoding


class ImageError(ValueError):
    pass


def open_image(src: "str | Path | bytes | Image.Image", what: str = "image") -> Image.Image:
    """An RGB PIL image from a path, bytes or PIL image; unreadable or empty input is refused clearly."""
    try:
        if isinstance(src, Image.Image):
            img = src
        elif isinstance(src, (bytes, bytearray)):
            img = Image.open(io.BytesIO(src))
        else:
            img = Image.open(Path(src))
        if img.width <= 0 or img.height <= 0:
            raise ImageError(f"{what} has zero size")
        if img.width * img.height > MAX_PIXELS:
            raise ImageError(f"{what} is too large ({img.width}x{img.height}); the limit is {MAX_PIXELS} pixels")
        img.load()
        img = ImageOps.exif_transpose(img)   # camera orientation, as the official loader applies it
    except ImageError:
        raise
    except FileNotFoundError:
        raise ImageError(f"{what}: file {src} not found") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{what} cannot be read as an image ({e})") from None
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        bg = Image.new("RGB", img.size, (255, 255, 255))     # transparent areas become white
        bg.paste(img.convert("RGBA"), mask=img.convert("RGBA").split()[-1])
        return bg
    return img.convert("RGB")


def fit_to_bucket(img: Image.Image, bucket: Bucket, stretch: bool = False) -> Image.Image:
    """LANCZOS resize to the bucket: keep the aspect ratio and center-crop (default), or stretch."""
    tw, th = bucket.width, bucket.height
    if stretch:
        return img.resize((tw, th), resample=Image.Resampling.LANCZOS)
    w, h = img.size
    if h / w < th / tw:
        rw, rh = int(round(th / h * w)), th
    else:
        rw, rh = tw, int(round(tw / w * h))
    top, left = int(round((rh - th) / 2.0)), int(round((rw - tw) / 2.0))
    return img.resize((rw, rh), resample=Image.Resampling.LANCZOS).crop((left, top, left + tw, top + th))


def reference_bucket(buckets: tuple[Bucket, ...], img: Image.Image) -> Bucket:
    return nearest_bucket(buckets, img.height, img.width)


def to_tensor(img: Image.Image) -> torch.Tensor:
    """[3, H, W] float32 in [-1, 1]."""
    a = torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).float() / 255.0
    return a * 2.0 - 1.0


def to_pil(x: torch.Tensor) -> Image.Image:
    """[3, H, W] in about [-1, 1] -> PIL (x/2 + 0.5, clamped, rounded to uint8)."""
    a = ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0).cpu().numpy()
    return Image.fromarray(a)


def png_bytes(img: Image.Image) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def align_to_reference(out: Image.Image, refs: list[Image.Image], buckets: tuple[Bucket, ...],
                       base_size: int) -> Image.Image:
    """The official `infer_align_image_size` post-step: resize the output to the aspect of the first
    reference image in the same bucket (keeping about base_size^2 pixels), when they differ noticeably."""
    out_bucket = reference_bucket(buckets, out)
    for ref in refs:
        if reference_bucket(buckets, ref).index == out_bucket.index:
            if abs(ref.height / ref.width - out_bucket.ratio) >= 0.01:
                scale = math.sqrt(base_size ** 2 / (ref.width * ref.height))
                return out.resize((round(ref.width * scale), round(ref.height * scale)),
                                  resample=Image.Resampling.LANCZOS)
            break
    return out
