"""The settings a PNG carries (engine/serve/image_meta.py): pure functions, no engine."""
from __future__ import annotations

import io

import pytest
from PIL import Image as PILImage

from engine.runtime.events import Image, Started, Timings
from engine.runtime.request import Request
from engine.runtime.step_cache import TaylorCacheParams
from engine.serve.image_meta import (NotARecord, image_record, parameters_text, read_record, reasoning_text,
                                     step_cache_name, with_record)
from engine.checkpoint.config import GenerationConfig


def png(size=(24, 16), color=(10, 20, 30)) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", size, color).save(buf, format="PNG")
    return buf.getvalue()


def record(**over) -> dict:
    req = Request(prompt="ein roter Kreis — 赤い円", bot_task="think", size="auto", seed=7, steps=None,
                  taylor_cache=TaylorCacheParams(), lora="style", lora_scale=0.5)
    r = image_record(req, Started("r", "think", "auto", 16, 2.5, 7), Image(b"", 24, 16, 7), "tiny-model",
                     GenerationConfig(), reasoning_text({"think": " a red circle ", "recaption": "red circle, left"}),
                     Timings(total_s=1.5))
    return {**r, **over}


def test_a_record_goes_into_the_png_and_comes_back_with_the_pixels_untouched():
    raw, rec = png(), record()
    out = with_record(raw, rec)
    assert read_record(out) == rec
    with PILImage.open(io.BytesIO(out)) as img:
        assert img.info["parameters"] == parameters_text(rec)           # what image tools show, before loading
        assert img.tobytes() == PILImage.open(io.BytesIO(raw)).tobytes()
        assert img.info["parameters"].startswith("ein roter Kreis — 赤い円\nSteps: 16, Guidance: 2.5, Seed: 7")
    again = with_record(out, {**rec, "seed": 8})                         # written again: replaced, not added
    assert read_record(again)["seed"] == 8 and again.count(b"hunyuan-studio") == 1


def test_the_record_says_what_ran():
    rec = record()
    assert (rec["mode"], rec["steps"], rec["guidance"], rec["seed"], rec["size"]) == ("think", 16, 2.5, 7, "24x16")
    assert rec["reasoning"] == "a red circle\n\nred circle, left"
    assert (rec["step_cache"], rec["lora"], rec["lora_scale"], rec["model"]) == ("taylor", "style", 0.5, "tiny-model")
    assert rec["system_prompt"] == GenerationConfig().use_system_prompt and rec["timings"]["total_s"] == 1.5
    assert step_cache_name(None, None) == "none"
    assert step_cache_name(TaylorCacheParams(taylor_cache_interval=3), None) == "custom"


def test_a_png_without_a_record_or_not_a_png_is_named_as_such():
    with pytest.raises(NotARecord, match="carries no settings"):
        read_record(png())
    with pytest.raises(NotARecord, match="not a PNG"):
        read_record(b"GIF89a....")
    with pytest.raises(NotARecord, match="not a whole PNG"):
        read_record(with_record(png(), record())[:40])


def test_the_record_says_which_kernels_ran_and_a_restore_notes_a_difference():
    """The quantized weights' kernels (Started.kernels: "" for ours) go into the record and, where not ours,
    into the parameters line; restoring on an engine that runs other kernels says the pixels will differ."""
    from webui.restore import restored
    req = Request(prompt="a red circle", seed=3)
    w4a8 = "experts on humming-fp8 (W4A8)"
    rec = image_record(req, Started("r", "image", "auto", 8, 2.5, 3, kernels=w4a8), Image(b"", 24, 16, 3), "m",
                       GenerationConfig(), "")
    assert rec["kernels"] == w4a8 and parameters_text(rec).endswith(f"Kernels: {w4a8}")
    ours = record()
    assert ours["kernels"] == "" and "Kernels" not in parameters_text(ours)
    differ = "will differ slightly"
    assert any(differ in n for n in restored(rec, "m", "").notes)              # made on W4A8, restored on ours
    assert any(differ in n for n in restored(ours, "tiny-model", w4a8).notes)
    assert not any(differ in n for n in restored(rec, "m", w4a8).notes)
    assert not any(differ in n for n in restored(rec, "m", None).notes)        # this engine's kernels unknown
    old = {k: v for k, v in ours.items() if k != "kernels"}                  # a PNG from before the record said
    assert not any(differ in n for n in restored(old, "tiny-model", w4a8).notes)


def test_an_edit_at_its_references_aspect_says_so_and_a_restore_tells_how_to_get_it_again():
    from webui.restore import restored
    req = Request(prompt="make it red", seed=3, images=[b"png"], stretch=True)
    rec = image_record(req, None, Image(b"", 314, 209, 3), "m", GenerationConfig(), "")
    assert rec["infer_align_image_size"] is True and rec["size"] == "314x209"
    back = restored(rec, "m")
    assert back.edit and any("Keep the first reference's aspect" in n for n in back.notes)
    assert back.settings["size"] == "auto"                 # as asked (a fixed size: the image's, which snaps back)
    plain = image_record(Request(prompt="make it red", seed=3, images=[b"png"]), None, Image(b"", 304, 208, 3), "m",
                         GenerationConfig(), "")
    assert plain["infer_align_image_size"] is False and not any("aspect" in n for n in restored(plain, "m").notes)
