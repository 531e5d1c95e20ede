"""A prompt set (webui/prompt_set.py): reading the list, the seeds, running it through a studio's ordinary
runs (a full queue waited out, a failure kept as its row's error), the archive."""
from __future__ import annotations

import asyncio
import csv
import io
import zipfile

import pytest
from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Image, Started, Timings
from engine.runtime.request import MAX_PROMPT_CHARS, Request, RequestError
from engine.serve.image_meta import read_record
from engine.serve.info import ModelInfo
from engine.serve.results import ResultStore
from studio_fixtures import ScriptedClient
from webui.prompt_set import MAX_SET, SetItem, parse_set, run_set, seeded, write_archive
from webui.runner import run


def test_the_list_reads_lines_csv_and_json_lines_each_with_its_seed():
    assert parse_set("a red circle | 7\n\n  two blue squares  \na | b | 3") == [
        SetItem(1, "a red circle", 7), SetItem(2, "two blue squares", None), SetItem(3, "a | b", 3)]
    assert parse_set("id,prompt,seed\n1,a red circle,5\n2,\"a star, yellow\",\n") == [
        SetItem(1, "a red circle", 5), SetItem(2, "a star, yellow", None)]
    assert parse_set('{"prompt": "a red circle", "seed": 9}\n{"prompt": "a star"}') == [
        SetItem(1, "a red circle", 9), SetItem(2, "a star", None)]
    assert [s for _, s in seeded(parse_set("a | 7\nb\nc"), base=100)] == [7, 101, 102]


@pytest.mark.parametrize("text,words", [
    ("", "the prompt set is empty"),
    ("a | 7\nb | -3", "line 2 of the set: the seed must be from 0"),
    ('{"prompt": "a"}\n{"text": "b"}', 'line 2 of the set has no "prompt" text'),
    ("prompt,seed\na,x\n", "line 2 of the set: the seed 'x' is not a whole number"),
    ("\n".join(["p"] * (MAX_SET + 1)), f"at most {MAX_SET} run in one go"),
    ("x" * (MAX_PROMPT_CHARS + 1), "the prompt of line 1 is too long"),
])
def test_a_wrong_list_is_refused_naming_the_line(text, words):
    with pytest.raises(RequestError, match=words):
        parse_set(text)


def _png(color) -> bytes:
    buf = io.BytesIO()
    PILImage.new("RGB", (16, 12), color).save(buf, format="PNG")
    return buf.getvalue()


class BusyOnce(ScriptedClient):
    """Refuses each prompt's first submit as a full queue; "broken" fails; the others make an image."""

    def __init__(self):
        super().__init__(self.events)
        self.refused: set[str] = set()

    def events(self, req):
        if req.prompt not in self.refused:
            self.refused.add(req.prompt)
            return [Error("busy", "the queue is full (8 requests waiting); try again in a moment")]
        if req.prompt == "broken":
            return [Started(req.request_id, "image", "auto", 2, 5.0, req.seed), Error("engine", "boom")]
        return [Started(req.request_id, "image", "auto", 2, 5.0, req.seed, kernels="experts on humming-fp8 (W4A8)"),
                Image(_png((req.seed % 256, 0, 0)), 16, 12, req.seed), Done(Timings(total_s=0.01))]


def test_a_set_runs_as_ordinary_requests_waits_out_a_full_queue_and_archives_what_it_made(tiny_dir, tmp_path):
    info, store, client = ModelInfo.from_folder(tiny_dir), ResultStore(tmp_path / "results"), BusyOnce()
    items = seeded(parse_set("a red circle | 3\nbroken\na star"), base=10)
    jobs = [(item, label, Request(prompt=item.prompt, bot_task=mode, seed=seed, steps=2))
            for item, seed in items for label, mode in (("A", "image"), ("B", "think"))]

    async def collect():
        return [r async for r in run_set(jobs, lambda req: run(client, req, info, store))]
    results = asyncio.run(collect())
    assert len(results) == 6 and len(client.submitted) == 6 + 3          # each prompt refused once, then run
    broken = [r for r in results if r.item.prompt == "broken"]
    assert all(r.error == "boom" and r.image is None for r in broken)
    made = [r for r in results if r.error is None]
    assert all(read_record(open(r.image, "rb").read())["seed"] == r.seed for r in made)
    archive = write_archive(tmp_path / "sets", results, {"A": {"mode": "image"}, "B": {"mode": "think"}})
    with zipfile.ZipFile(archive) as z:
        rows = list(csv.DictReader(io.StringIO(z.read("settings.csv").decode())))
        assert [(r["index"], r["setting"], r["seed"]) for r in rows] == [
            ("1", "A", "3"), ("1", "B", "3"), ("2", "A", "11"), ("2", "B", "11"), ("3", "A", "12"), ("3", "B", "12")]
        assert [r["error"] for r in rows if r["index"] == "2"] == ["boom", "boom"]
        assert {r["kernels"] for r in rows if r["file"]} == {"experts on humming-fp8 (W4A8)"}   # what ran, per image
        for r in (r for r in rows if r["file"]):
            assert PILImage.open(io.BytesIO(z.read(r["file"]))).getpixel((0, 0)) == (int(r["seed"]), 0, 0)
