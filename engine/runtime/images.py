"""Input images and image output: open (once: a request keeps what the model consumes of each image, not
the image), bucket-fit, tensors, PNG."""
from __future__ import annotations

import ctypes
import functools
import hashlib
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from engine.model.vit import vit_resize
from engine.runtime.sequence import CondImageLayout
from engine.checkpoint.buckets import Bucket, nearest_bucket
from engine.checkpoint.config import ModelConfig

MAX_PIXELS = 64_000_000   # one image: refuse decompression bombs before decoding
# all the images one request decodes together (its references and the earlier turns' images the history
# policy shows: at most MAX_IMAGES, history.py), checked before each is decoded: three 4096x4096 fit
MAX_REQUEST_PIXELS = 64_000_000
# an image this large gives its freed pixels back to the system once it is read (`give_back_freed_heap`)
TRIM_PIXELS = 1 << 22


class ImageError(ValueError):
    pass


def _header(src: "str | Path | bytes | Image.Image", what: str) -> Image.Image:
    """The image behind `src`, opened lazily (its header read, its pixels not decoded), its size checked."""
    try:
        if isinstance(src, Image.Image):
            img = src
        elif isinstance(src, (bytes, bytearray)):
            img = Image.open(io.BytesIO(src))
        else:
            img = Image.open(Path(src))
    except FileNotFoundError:
        raise ImageError(f"{what}: file {src} not found") from None
    except Image.DecompressionBombError:
        raise ImageError(f"{what} is too large (it declares more pixels than PIL opens); the limit is "
                         f"{MAX_PIXELS} pixels") from None
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{what} cannot be read as an image ({e})") from None
    if img.width <= 0 or img.height <= 0:
        raise ImageError(f"{what} has zero size")
    if img.width * img.height > MAX_PIXELS:
        raise ImageError(f"{what} is too large ({img.width}x{img.height}); the limit is {MAX_PIXELS} pixels")
    return img


def check_image(src: "str | Path | bytes | Image.Image", what: str = "image") -> None:
    """Refuse what `open_image` would refuse by its header (not an image, no size, too many pixels),
    without decoding it: the images of earlier turns a request does not show are checked, never decoded."""
    _header(src, what)


def open_image(src: "str | Path | bytes | Image.Image", what: str = "image") -> Image.Image:
    """An RGB PIL image from a path, bytes or PIL image; unreadable or empty input is refused clearly."""
    img = _header(src, what)
    try:
        img.load()
        img = ImageOps.exif_transpose(img)   # camera orientation, as the official loader applies it
    except (UnidentifiedImageError, OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{what} cannot be read as an image ({e})") from None
    if img.mode in ("RGBA", "LA") or (img.mode == "P" and "transparency" in img.info):
        bg = Image.new("RGB", img.size, (255, 255, 255))     # transparent areas become white
        bg.paste(img.convert("RGBA"), mask=img.convert("RGBA").split()[-1])
        return bg
    return img.convert("RGB")


@dataclass(frozen=True)
class ModelImage:
    """An input image as the model consumes it, read once where its request enters (`ImageReader`): its
    pixels fitted to its resolution bucket (the VAE's input), its pixels as the ViT's NaFlex resize makes
    them, its layout in the sequence, the digest of its decoded pixels (it names the image to the engine's
    encoding cache, engine/runtime/conditioning.py) and its size as given (EXIF orientation applied; the
    `stretch` output takes its aspect). The decoded image itself is not kept: a 4096x4096 upload costs its
    48 MiB only while it is read."""
    vae: Image.Image               # RGB, the bucket's size (fitted: centre-cropped, or stretched)
    vit: torch.Tensor              # [3, h, w] uint8, h x w the ViT's patch grid times the patch size
    layout: CondImageLayout
    digest: str
    size: tuple[int, int]          # (width, height)


class ImageReader:
    """Reads a request's images into ModelImages for one checkpoint: its buckets, its VAE's downsampling,
    its ViT's preprocessing, and the request's `stretch` (how an image fits its bucket). Counts the pixels
    it decodes: a request's images together may decode to at most `budget` pixels, checked on each
    image's header before it is decoded."""

    def __init__(self, cfg: ModelConfig, buckets: tuple[Bucket, ...], stretch: bool = False,
                 budget: int = MAX_REQUEST_PIXELS):
        self.cfg, self.buckets, self.stretch, self.budget = cfg, buckets, stretch, budget
        self.decoded = 0                   # pixels decoded so far

    def read(self, src: "str | Path | bytes | Image.Image", what: str = "image") -> ModelImage:
        """The image `src` as the model consumes it; ImageError naming `what` if it cannot be read, or if
        it would take the request past its budget of decoded pixels."""
        w, h = _header(src, what).size
        if self.decoded + w * h > self.budget:
            raise ImageError(f"{what} ({w}x{h} = {w * h} pixels) would take this request's images past "
                             f"{self.budget} decoded pixels together ({self.decoded} before it): send smaller "
                             "images, or fewer")
        image = self._model_image(open_image(src, what))      # the decoded image is dropped on its return
        self.decoded += w * h
        if w * h >= TRIM_PIXELS:
            give_back_freed_heap()
        return image

    def _model_image(self, img: Image.Image) -> ModelImage:
        bucket = reference_bucket(self.buckets, img)
        vit = vit_resize(img, self.cfg.vit_processor)
        p, f = int(self.cfg.vit_processor["patch_size"]), self.cfg.vae_downsample_factor[0]
        layout = CondImageLayout((bucket.height // f, bucket.width // f), bucket.index,
                                 (vit.shape[1] // p, vit.shape[2] // p), int(self.cfg.vit_processor["max_num_patches"]))
        return ModelImage(fit_to_bucket(img, bucket, self.stretch), vit, layout, content_digest(img, self.stretch),
                          img.size)


@functools.cache
def _malloc_trim():
    """glibc's malloc_trim, or None where the C library has none (musl, macOS)."""
    return getattr(ctypes.CDLL(None), "malloc_trim", None)


def give_back_freed_heap() -> None:
    """Return the C heap's free pages to the system. A decoded image is PIL's blocks of 16 MiB (4 bytes a
    pixel: 64 MiB at 4096x4096); once glibc's mmap threshold has grown past that size they come from the
    heap of the thread that decodes (the server reads images in worker threads, each with an arena of its
    own), and freed there below live allocations they stay resident: the server kept ~80 MiB after one
    request with a 4096x4096 history image, for as long as it ran. malloc_trim gives back every arena's free
    pages: ~30 ms for a 4096x4096 image on a loaded 2-core machine, beside ~0.5 s to decode it."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def content_digest(img: Image.Image, stretch: bool) -> str:
    """Names an image as the encoder reads it: its decoded pixels (mode, size, bytes) and the stretch
    option (with the size, they fix its bucket and fit)."""
    h = hashlib.sha256(f"{img.mode} {img.size} {stretch}".encode())
    h.update(img.tobytes())
    return h.hexdigest()[:32]


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
    return Image.fromarray(_pixels(x).cpu().numpy())


def _pixels(x: torch.Tensor) -> torch.Tensor:
    return ((x.float() / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8).permute(1, 2, 0)


class HostPixels:
    """uint8 [H, W, 3] pixels on their way from the GPU: copied into pinned memory without the host waiting
    for the work before them (a step preview's or the final image's VAE decode, the step itself);
    `np.asarray` waits for the copy, in whichever thread reads them first (engine/serve/worker.py's sender,
    off the engine's loop). `ready_at`: the host's clock when that read found them there."""

    def __init__(self, pixels: torch.Tensor):
        self._host = torch.empty(pixels.shape, dtype=torch.uint8, pin_memory=True)
        self._host.copy_(pixels, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        self.ready_at: float | None = None

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self.ready_at is None:
            self._copied.synchronize()
            self.ready_at = time.perf_counter()
        a = self._host.numpy()
        return a if dtype is None else a.astype(dtype)


class Resized:
    """Pixels (an array, or what `np.asarray` makes one of: HostPixels) resized to `size` (width, height) with
    LANCZOS when first read, so a resize waits for its pixels where they are read, not where they are made."""

    def __init__(self, pixels: Any, size: tuple[int, int]):
        self._pixels, self.size = pixels, size
        self._out: np.ndarray | None = None

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        if self._out is None:
            img = Image.fromarray(np.asarray(self._pixels)).resize(self.size, resample=Image.Resampling.LANCZOS)
            self._out = np.asarray(img)
        return self._out if dtype is None else self._out.astype(dtype)


def host_pixels(x: torch.Tensor) -> np.ndarray | HostPixels:
    """[3, H, W] in about [-1, 1] -> its uint8 pixels as `to_pil` rounds them: on a GPU on their way to the
    host (HostPixels), on the CPU the array."""
    a = _pixels(x)
    return HostPixels(a) if a.is_cuda else a.numpy()


def reference_size(size: tuple[int, int], refs: list[tuple[int, int]], buckets: tuple[Bucket, ...],
                   base_size: int) -> tuple[int, int] | None:
    """The official `infer_align_image_size` post-step: the (width, height) an output of `size` (width,
    height) is resized to, the aspect of the first reference image (refs: their (width, height)) in the same
    bucket (keeping about base_size^2 pixels), when they differ noticeably; None: it stays as it is."""
    out_bucket = nearest_bucket(buckets, size[1], size[0])
    for width, height in refs:
        if nearest_bucket(buckets, height, width).index == out_bucket.index:
            if abs(height / width - out_bucket.ratio) >= 0.01:
                scale = math.sqrt(base_size ** 2 / (width * height))
                return round(width * scale), round(height * scale)
            break
    return None
