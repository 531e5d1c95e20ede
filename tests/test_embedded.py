"""The embedded default model (assets/model) through the real pipeline, on a small held-out sample:
floors that a broken sampler, mask, cache or tokenizer would fall through. The full evaluation and its
numbers are in README.md (`python -m train.evaluate --model assets/model --n 40 --n-edit 40`)."""
from __future__ import annotations


import pytest

from engine import EMBEDDED_MODEL
from engine_drive import make_engine
from train.evaluate import evaluate

MODEL = EMBEDDED_MODEL
pytestmark = pytest.mark.skipif(not (MODEL / "config.json").exists(), reason="no embedded model in assets/")


def test_embedded_model_floor():
    # Measured on this sample (2026-11-29, CPU, 16 steps): well-formed 100%, CoT correct 100%, T2I
    # attributes 85% (colour 100%), edits 4/4. A broken sampler, mask or cache loses the colours first
    # (random-init or mismatched-sequence models score ~15% colour); the floors leave room for float
    # differences between machines (a few objects).
    m = evaluate(MODEL, n=8, n_edit=4, seed=0, threads=None, log=lambda *a: None)
    assert m["reasoning_well_formed"] >= 0.85, m
    assert m["t2i_cot_correct"] >= 0.85, m
    assert m["t2i_color"] >= 0.85, m
    assert m["t2i_attribute_accuracy"] >= 0.65, m
    assert m["ti2i_edit_accuracy"] >= 0.75, m


def test_studio_edit_examples_do_what_they_say(tmp_path):
    """The studio's reference examples for the embedded model: the recolour turns the circle blue, the
    move puts the square in the right column (a reference drawn outside the model's world makes it
    describe and draw objects that are not there)."""
    import io

    from PIL import Image as PILImage

    from engine.runtime.events import Image
    from engine.model.loader import load
    from engine.runtime.request import Request
    from train.detect import detect
    from webui.examples import reference_examples

    pipe = make_engine(load(MODEL), preview_every=0)
    (circle, recolor), (square, move) = reference_examples(tmp_path, small=True)
    found = {}
    for name, path, prompt in (("recolor", circle, recolor), ("move", square, move)):
        img = next(ev for ev in pipe.run(Request(prompt=prompt, images=[PILImage.open(path)], seed=0))
                   if isinstance(ev, Image))
        found[name] = detect(PILImage.open(io.BytesIO(img.png)).convert("RGB"))
    assert [o.name for o in found["recolor"].objects] == ["blue circle"], found["recolor"]
    assert [(o.name, o.cell[1]) for o in found["move"].objects] == [("green square", 2)], found["move"]


def test_the_studio_notice_names_what_the_model_knows():
    """The page's note on the embedded model lists its shapes, colours, backgrounds and edits (the
    dataset's own vocabulary), so a visitor knows what to ask for."""
    from app import EMBEDDED_NOTICE
    from train.dataset import BACKGROUNDS, COLORS, GROUP_TASKS, SHAPES

    edits = {t for tasks in GROUP_TASKS.values() for t in tasks} - {"t2i"}
    missing = [w for w in (*SHAPES, *COLORS, *BACKGROUNDS, *edits) if w not in EMBEDDED_NOTICE]
    assert not missing, missing


def test_every_studio_example_has_a_check(tmp_path):
    """train.evaluate scores the studio's examples in every reasoning mode: each example prompt and
    example edit shown for the embedded model has its check there."""
    from train.evaluate import EXAMPLE_EDIT_CHECKS, EXAMPLE_T2I_CHECKS
    from webui.examples import SHAPE_PROMPTS, reference_examples

    assert set(SHAPE_PROMPTS) == set(EXAMPLE_T2I_CHECKS)
    assert {prompt for _, prompt in reference_examples(tmp_path, small=True)} == set(EXAMPLE_EDIT_CHECKS)


def test_reasoning_forms_of_each_mode():
    """What each mode writes, on the embedded model's tokenizer: off is the ratio token alone, think
    closes its text and goes to the image, think + recaption adds the recaption."""
    from engine.serve.info import ModelInfo
    from engine.checkpoint.tokenizer import Tokenizer
    from train.evaluate import well_formed

    info = ModelInfo.from_folder(MODEL)
    tok = Tokenizer(MODEL / "tokenizer.json", info.cfg.image_base_size, len(info.buckets))
    sp = tok.special
    ratio = "<img_ratio_16>"
    think = "one small blue circle; white background; square."
    recap = "square, white background: small blue circle center."
    forms = {"image": ratio, "think": f"{think}</think><answer><boi><img_size_256>{ratio}",
             "think_recaption": f"{think}</think><recaption>{recap}</recaption><answer><boi><img_size_256>{ratio}"}
    for mode, text in forms.items():
        for other, other_text in forms.items():
            assert well_formed(tok.encode(other_text), sp, mode) == (other == mode), (mode, other)
    assert not well_formed(tok.encode(f"</think><answer><boi><img_size_256>{ratio}"), sp, "think")   # no text


def test_the_page_starts_in_the_mode_that_measures_best():
    """README "Reasoning modes": think + recaption scores 94.7% T2I / 95.0% edits against 79.7 / 72.5%
    (off) and 77.0 / 62.5% (think) on the embedded model; the page starts in it."""
    from engine.serve.info import ModelInfo
    from webui.options import default_mode

    assert default_mode(ModelInfo.from_folder(MODEL).gen) == "think_recaption"
