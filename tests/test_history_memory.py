"""History images cost what the model consumes, once: a chat request whose earlier turns carry many large
images is prepared with each image it shows decoded once and kept only as the model consumes it (the
others checked by their headers), under one budget of decoded pixels for the whole request, and its
memory goes back after it. The soak of 20 such requests is `python -m bench history-memory`."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import pytest
from PIL import Image

from engine.runtime.images import MAX_REQUEST_PIXELS
from engine.runtime.request import Request, RequestError, prepare

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# The budget the test states: the peak resident memory a request may add while it is prepared, and what
# may stay after three. One 4096x4096 image decoded (48 MiB as RGB) and its transient copies (the digest's
# bytes, the ViT resize's array) fit; decoding the 32 history images (1.5 GiB) would not. What stays is
# small: the decoded image's freed heap is given back (PIL's 64 MiB of blocks, which glibc kept in the
# preparing thread's arena: 72 MiB stayed after each request before engine/runtime/images.py trimmed it).
PEAK_MIB, HELD_MIB = 400, 24


def test_a_long_history_of_large_images_stays_within_its_memory_budget(tiny_dir, tmp_path):
    """A 2.5 MB chat body of 8 turns x 4 PNGs of 4096x4096 (each ~50 KB), parsed and admitted three times
    as the server does it, in a pool's threads (in a process of its own, so that its resident memory is the
    request's)."""
    run = subprocess.run([sys.executable, "-m", "bench", "history-memory", "--in-process", "--dry",
                          "--requests", "3", "--model", str(tiny_dir), "--out", str(tmp_path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    got = json.loads((tmp_path / "history-memory.json").read_text())
    assert 2.0 <= got["body_mib"] <= 3.0, got["body_mib"]
    rows = got["rows"]
    assert len(rows) == 3
    for r in rows:
        assert r["peak_mib"] < PEAK_MIB, rows
        assert r["prepared_kib"] < 1024, rows            # what crosses the pipe: the model's inputs, not the body
    assert rows[-1]["after_mib"] < HELD_MIB, rows


def _png(side: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30, 30)).save(buf, "PNG")
    return buf.getvalue()


def test_the_budget_refusal_names_the_image_that_was_too_large(tiny):
    """Three references of 4700x4700 (each within the per-image limit): the third would take the request
    past its budget of decoded pixels, and is refused by name before it is decoded."""
    big = _png(4700)
    assert 3 * 4700 * 4700 > MAX_REQUEST_PIXELS > 2 * 4700 * 4700
    with pytest.raises(RequestError) as e:
        prepare(Request(prompt="put them together", images=[big, big, big], seed=1), tiny)
    assert e.value.field == "images"
    assert "reference image 3 (4700x4700" in str(e.value) and str(MAX_REQUEST_PIXELS) in str(e.value)
