"""A prompt set run in one go: a list of prompts, each with its seed, as ordinary requests through the engine's
one queue, under one setting (A) or two side by side (A and B, paired: the same prompt and seed), shown as a
grid and kept as one archive (the PNGs, each with its record, and a table of settings and timings).

`parse_set` reads the list (one prompt a line, `prompt | seed` to fix a seed; a CSV with a prompt column
and maybe a seed column; JSON lines with "prompt" and maybe "seed"). `run_set` submits the requests a few
at a time (SET_IN_FLIGHT: one can reason while another is denoised, and the queue stays open to others),
waits and tries again when the queue is full, and reports each result as it finishes. `write_archive`
writes the zip.
"""
from __future__ import annotations

import asyncio
import csv
import dataclasses
import io
import json
import time
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from engine.runtime.request import MAX_PROMPT_CHARS, SEED_RANGE, Request, RequestError

from .runner import EngineFailure, Update

MAX_SET = 200                # prompts in one set
SET_IN_FLIGHT = 2            # requests of a set submitted at once
BUSY_RETRY_S = 1.0           # a full queue: try again after this
ARCHIVES_KEPT = 8            # archives kept on the server (the newest)
TABLE_COLUMNS = ("index", "setting", "prompt", "seed", "file", "mode", "steps", "guidance", "size", "step_cache",
                 "lora", "lora_scale", "system_prompt", "max_new_tokens", "kernels", "wall_s", "engine_s",
                 "ms_per_token", "ms_per_step", "vae_ms", "reasoning", "error")


@dataclass(frozen=True)
class SetItem:
    index: int                   # 1-based, the line's order in the set
    prompt: str
    seed: int | None             # None: the set's base seed + index - 1


@dataclass
class SetResult:
    item: SetItem
    setting: str                 # "A" or "B"
    seed: int
    image: str | None = None     # the PNG (with its record), once made
    record: dict | None = None
    wall_s: float = 0.0          # the user's time for it, submit to image (the wait in line included)
    error: str | None = None


def parse_set(text: str) -> list[SetItem]:
    """The set's items; RequestError (field "prompt") naming the line that is wrong."""
    text = (text or "").strip()
    if not text:
        raise RequestError("the prompt set is empty: one prompt a line (`prompt | seed` fixes its seed)", "prompt")
    first = text.splitlines()[0].strip()
    if first.startswith("{"):
        rows = _json_lines(text)
    elif "prompt" in [c.strip().lower() for c in next(csv.reader([first]))]:
        rows = _csv_rows(text)
    else:
        rows = [_line(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]
    if len(rows) > MAX_SET:
        raise RequestError(f"the prompt set has {len(rows)} prompts; at most {MAX_SET} run in one go", "prompt")
    items = []
    for n, (line, prompt, seed) in enumerate(rows, 1):
        if not prompt.strip():
            raise RequestError(f"line {line} of the set has no prompt", "prompt")
        if len(prompt) > MAX_PROMPT_CHARS:
            raise RequestError(f"the prompt of line {line} is too long ({len(prompt)} characters; the limit is "
                               f"{MAX_PROMPT_CHARS})", "prompt")
        items.append(SetItem(n, prompt.strip(), seed))
    return items


def _seed(value: Any, line: int) -> int | None:
    if value is None or (isinstance(value, str) and not value.strip()):
        return None
    try:
        seed = int(str(value).strip())
    except ValueError:
        raise RequestError(f"line {line} of the set: the seed {value!r} is not a whole number", "prompt") from None
    if not SEED_RANGE[0] <= seed <= SEED_RANGE[1]:
        raise RequestError(f"line {line} of the set: the seed must be from {SEED_RANGE[0]} to {SEED_RANGE[1]} "
                           f"(got {seed})", "prompt")
    return seed


def _line(n: int, line: str) -> tuple[int, str, int | None]:
    prompt, sep, seed = line.rpartition(" | ")
    if sep and seed.strip().lstrip("-").isdigit():
        return n, prompt, _seed(seed, n)
    return n, line, None


def _csv_rows(text: str) -> list[tuple[int, str, int | None]]:
    reader = csv.DictReader(io.StringIO(text))
    fields = {f.strip().lower(): f for f in reader.fieldnames or []}
    return [(n, row.get(fields["prompt"]) or "", _seed(row.get(fields["seed"]) if "seed" in fields else None, n))
            for n, row in enumerate(reader, 2)]


def _json_lines(text: str) -> list[tuple[int, str, int | None]]:
    rows = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise RequestError(f"line {n} of the set is not JSON ({e.msg})", "prompt") from None
        if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
            raise RequestError(f'line {n} of the set has no "prompt" text', "prompt")
        rows.append((n, obj["prompt"], _seed(obj.get("seed"), n)))
    return rows


def seeded(items: list[SetItem], base: int) -> list[tuple[SetItem, int]]:
    """Each item with its seed: its own, else the base seed + its index - 1 (kept in range)."""
    return [(it, it.seed if it.seed is not None else (base + it.index - 1) % (SEED_RANGE[1] + 1)) for it in items]


Runner = Callable[[Request], AsyncIterator[Update]]


async def run_set(jobs: list[tuple[SetItem, str, Request]], run_one: Runner) -> AsyncIterator[SetResult]:
    """Run each job's request (through `run_one`: the studio's ordinary run), SET_IN_FLIGHT at a time, and
    yield each result as it finishes; a full queue is waited out, any other failure is that result's error.
    Closing the generator (Stop, a closed tab) stops the requests still running."""
    todo = list(jobs)
    done: asyncio.Queue[SetResult] = asyncio.Queue()

    async def one(item: SetItem, setting: str, req: Request) -> None:
        t0 = time.monotonic()
        out = SetResult(item, setting, req.seed)
        while True:
            try:
                async for u in run_one(dataclasses.replace(req, request_id=uuid.uuid4().hex[:12])):
                    if u.final:
                        out.image, out.record = u.image, u.record
                        out.error = None if u.image else (u.status or "no image")
                break
            except EngineFailure as e:
                if e.kind != "busy":
                    out.error = str(e)
                    break
                await asyncio.sleep(BUSY_RETRY_S)     # the queue is full: this one waits its turn
        out.wall_s = time.monotonic() - t0
        await done.put(out)

    running: set[asyncio.Task] = set()
    try:
        for _ in range(len(todo)):
            while todo and len(running) < SET_IN_FLIGHT:
                running.add(asyncio.create_task(one(*todo.pop(0))))
            result = await done.get()
            running = {t for t in running if not t.done()}
            yield result
    finally:
        for t in running:
            t.cancel()
        if running:
            await asyncio.gather(*running, return_exceptions=True)


def table_row(r: SetResult, file: str | None) -> dict[str, Any]:
    rec, t = r.record or {}, (r.record or {}).get("timings") or {}
    return {"index": r.item.index, "setting": r.setting, "prompt": r.item.prompt, "seed": r.seed, "file": file or "",
            **{k: rec.get(k, "") for k in ("mode", "steps", "guidance", "size", "step_cache", "lora", "lora_scale",
                                            "system_prompt", "max_new_tokens", "kernels", "reasoning")},
            "wall_s": f"{r.wall_s:.2f}", "engine_s": t.get("total_s", ""), "ms_per_token": t.get("ar_ms_per_token", ""),
            "ms_per_step": t.get("dit_ms_per_step", ""), "vae_ms": t.get("vae_ms", ""), "error": r.error or ""}


def write_archive(folder: Path, results: list[SetResult], settings: dict[str, str]) -> Path:
    """A zip of the set: each PNG (as made, with its record) under images/, `settings.csv` (one row per image,
    in grid order: what made it and what it took) and `settings.json` (the settings A and B, and the rows).
    The folder keeps the newest ARCHIVES_KEPT archives."""
    folder.mkdir(parents=True, exist_ok=True)
    ordered = sorted(results, key=lambda r: (r.item.index, r.setting))
    rows = []
    path = folder / f"prompt-set-{time.strftime('%Y%m%d-%H%M%S')}-{len(ordered)}.zip"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for r in ordered:
            name = f"images/{r.item.index:03d}-{r.setting}-seed{r.seed}.png" if r.image else None
            if name:
                z.write(r.image, name)
            rows.append(table_row(r, name))
        buf = io.StringIO()
        w = csv.DictWriter(buf, TABLE_COLUMNS)
        w.writeheader()
        w.writerows(rows)
        z.writestr("settings.csv", buf.getvalue())
        z.writestr("settings.json", json.dumps({"settings": settings, "rows": rows}, indent=1, ensure_ascii=False))
    for old in sorted(folder.glob("prompt-set-*.zip"), key=lambda p: p.stat().st_mtime)[:-ARCHIVES_KEPT]:
        old.unlink(missing_ok=True)
    return path
