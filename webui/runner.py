"""One request's life in the studio: submit to the engine, turn its events into view updates.

`run(...)` is an async generator of `Update`s (only the fields that changed). It knows nothing about
Gradio components, so it is tested with a plain engine, and the studio maps an `Update` onto outputs.
Events that arrive faster than a browser can draw are merged: all pending text deltas become one
update and only the newest step preview is sent (as Fooocus does for slow connections).
"""
from __future__ import annotations

import asyncio
import io
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, AsyncIterator, Protocol

from PIL import Image as PILImage

from engine.runtime.events import Done, Error, Image, Ratio, Started, Step, Text
from engine.runtime.request import Request

PREVIEW_MAX_SIDE = 256
HEARTBEAT_S = 1.0          # yield at least this often: a closed tab is only noticed at a yield
SECTION_TITLES = {"think": "Thinking", "recaption": "Recaption", "answer": "Answer"}


class EngineClient(Protocol):
    """What the studio needs from `engine.server.EngineServer` (tests may pass a stand-in)."""
    def submit(self, request: Request) -> Any: ...
    def cancel(self, request_id: str) -> bool: ...
    def health(self) -> dict[str, Any]: ...
    def reload(self) -> bool: ...


class EngineFailure(Exception):
    """The request ended with an error from the engine; the message is meant for the user. `kind` is
    the Error event's: invalid, busy (the engine holds --max-queue requests already) or engine."""

    def __init__(self, message: str, kind: str = "engine"):
        super().__init__(message)
        self.kind = kind


@dataclass
class Update:
    status: str | None = None
    preview: PILImage.Image | None = None   # the step preview, drawn on the canvas while denoising
    image: str | None = None          # path of the final PNG, which replaces the preview
    cot: str | None = None
    timings: str | None = None
    reset: bool = False               # clear every output first (start of a run)
    final: bool = False               # the run is over: send every output

    @property
    def changed(self) -> bool:
        return self.reset or self.final or any(v is not None for v in (self.status, self.preview, self.image,
                                                                         self.cot, self.timings))


@dataclass
class CotLog:
    """The reasoning text as it streams, with a title line whenever the section changes. It counts the
    characters written: a text event carries a piece of decoded text, not one token (the engine's
    token count comes with the timings at the end)."""
    text: str = ""
    section: str | None = None
    chars: int = 0

    def add(self, ev: Text) -> None:
        if ev.section != self.section:
            title = SECTION_TITLES.get(ev.section, ev.section.title())
            self.text += ("\n\n" if self.text else "") + f"[{title}]\n"
            self.section = ev.section
        self.text += ev.delta
        self.chars += len(ev.delta)


def running_count(health: dict[str, Any]) -> int:
    """How many requests the engine runs (health's count; an engine that reports only whether one runs: 0 or 1)."""
    n = health.get("running")
    return n if isinstance(n, int) and not isinstance(n, bool) else int(bool(n))


def waiting_status(health: dict[str, Any], ahead: int | None = None) -> str:
    """`ahead`: how many requests wait before this one (None: unknown)."""
    state = health.get("state")
    if state in ("loading", "restarting"):
        what = f" ({health['loading']})" if health.get("loading") else ""
        verb = "restarting" if state == "restarting" else "loading the model"
        return f"Waiting for the engine: {verb}{what}…"
    running = f", {running_count(health)} running" if health.get("running") else ""
    if ahead is not None:
        return f"In line: {ahead} ahead of you{running}…"
    if health.get("queue"):
        return f"In line: {health['queue']} waiting{running}…"
    return "Starting…"


def preview_image(png: bytes, size: tuple[int, int] | None = None) -> PILImage.Image:
    """The step preview (a small decode of the current estimate) at the final image's size when it is
    known (width, height), so the canvas keeps its shape when the final image replaces it."""
    img = PILImage.open(io.BytesIO(png)).convert("RGB")
    if size is not None:
        w, h = size
        scale = min(1.0, PREVIEW_MAX_SIDE / max(w, h))
        return img.resize((max(1, round(w * scale)), max(1, round(h * scale))), PILImage.Resampling.BILINEAR)
    img.thumbnail((PREVIEW_MAX_SIDE, PREVIEW_MAX_SIDE))
    return img


def timings_text(done: Done, image: Image | None) -> str:
    """The measured figures (the engine's own labels: ms/token over the sampled tokens, and with
    reasoning off only the prefill, since the size is the one token chosen)."""
    parts = done.timings.parts(bold=True)
    if image is not None:
        parts.append(f"{image.width} × {image.height}, seed {image.seed}")
    return " · ".join(parts)


def seed_in(timings: str | None) -> int | None:
    """The seed that `timings_text` wrote, or None."""
    m = re.search(r", seed (\d+)$", timings or "")
    return int(m.group(1)) if m else None


def save_png(out_dir: Path, request_id: str, image: Image) -> str:
    """Write the PNG as the engine made it (served byte for byte: a filepath is not re-encoded)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"hunyuan-{request_id}-seed{image.seed}.png"
    path.write_bytes(image.png)
    return str(path)


def prune(out_dir: Path, max_age_s: float = 3600.0) -> None:
    """Drop old result files so a long-running studio does not fill the disk."""
    if not out_dir.is_dir():
        return
    cutoff = time.time() - max_age_s
    for p in out_dir.glob("hunyuan-*.png"):
        try:
            if p.stat().st_mtime < cutoff:
                p.unlink()
        except OSError:
            pass


async def run(client: EngineClient, req: Request, out_dir: Path) -> AsyncIterator[Update]:
    """Submit `req` and describe its progress. Raises EngineFailure with a user-facing message when
    the engine refuses or fails the request; a cancelled request just ends with a 'Stopped' status."""
    prune(out_dir)
    sub = await asyncio.to_thread(client.submit, req)      # it validates, so decodes the references: off the loop
    cot, image, started = CotLog(), None, False
    image_path: str | None = None
    size: tuple[int, int] | None = None            # (width, height) of the image, once chosen
    preview: PILImage.Image | None = None          # the newest step preview
    yield Update(reset=True, status="Submitted…")
    try:
        while True:
            ev = await sub.aget(timeout=HEARTBEAT_S)
            if ev is None:
                position = getattr(client, "position", None)      # EngineServer's; a stand-in may lack it
                ahead = None if started or position is None else position(req.request_id)
                yield Update(status=None if started else waiting_status(client.health(), ahead))
                continue
            batch = [ev]
            while not isinstance(batch[-1], (Done, Error)) and (nxt := sub.get(timeout=0)) is not None:
                batch.append(nxt)
            update = Update()
            for ev in batch:
                if isinstance(ev, Started):
                    started = True
                    update.status = "Thinking…" if ev.bot_task != "image" else "Choosing the size…"
                elif isinstance(ev, Text):
                    cot.add(ev)
                    update.cot = cot.text
                    update.status = f"Writing… {cot.chars} characters"
                elif isinstance(ev, Ratio):
                    size = (ev.width, ev.height)
                    update.status = f"Size {ev.width} × {ev.height} — denoising…"
                elif isinstance(ev, Step):
                    update.status = f"step {ev.i}/{ev.n}"
                    if ev.preview is not None:
                        preview = update.preview = preview_image(ev.preview, size)
                elif isinstance(ev, Image):
                    image = ev
                    image_path = update.image = save_png(out_dir, req.request_id, ev)
                    update.status = "Decoded"
                elif isinstance(ev, Done):
                    if update.changed:
                        yield update
                    yield Update(final=True, status=f"Done in {ev.timings.total_s:.1f} s", image=image_path,
                                 cot=cot.text, timings=timings_text(ev, image))
                    return
                elif isinstance(ev, Error):
                    if update.changed:
                        yield update
                    if ev.kind == "cancelled":
                        yield Update(final=True, status="Stopped.", preview=preview, cot=cot.text)
                        return
                    raise EngineFailure(ev.message, ev.kind)
            if update.changed:
                yield update
    finally:
        if not sub.ended:           # Stop, a closed tab or an error in the UI: free the engine
            try:
                client.cancel(req.request_id)
            except Exception as e:  # noqa: BLE001 - the UI must survive an engine that is gone
                print(f"studio: cancel failed: {e}", file=sys.stderr)
