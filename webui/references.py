"""A reference image as the studio checks it on upload: the same per-image limits as the `/v1` API
(file bytes, pixels from the header, before decoding) and readable as an image by the engine's own loader.
Messages name the file by its own name, never by the server's temporary path."""
from __future__ import annotations

from pathlib import Path

from engine.runtime.images import ImageError, open_image
from engine.serve.openai_errors import ApiError
from engine.serve.openai_params import UploadLimits, check_upload

LIMITS = UploadLimits()


def check_reference(path: str | Path, limits: UploadLimits = LIMITS) -> str | None:
    """None when the file at `path` is a usable reference image, else a message for the user."""
    name = Path(path).name
    try:
        data = Path(path).read_bytes()
        check_upload(data, name, "image", limits)
        open_image(data, name)
    except ApiError as e:
        return e.message
    except ImageError as e:
        # the loader's own reason names an in-memory buffer, not the file: the name is enough
        return str(e) if "too large" in str(e) or "zero size" in str(e) else f"{name} cannot be read as an image"
    except OSError as e:
        return f"{name} cannot be read ({e.strerror or e})"
    return None
