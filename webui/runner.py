"""One request's life in the studio: submit to the engine, turn its events into view updates.

`run(...)` is an async generator of `Update`s (only the fields that changed). It knows nothing about
Gradio components, so it is tested with a plain engine, and the studio maps an `Update` onto outputs.
Events that arrive faster than a browser can draw are merged: the page gets at most one update every
UPDATE_EVERY_S with all that came since (the text so far, the newest status), and the step previews at a
rate chosen from the engine's step time (PreviewRate), as Fooocus drops stale previews for slow connections.
"""
from __future__ import annotations

import asyncio
import io
import math
import sys
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Callable

from PIL import Image as PILImage

from engine.runtime.events import Denoising, Done, Error, Image, Ratio, Started, Step, Text
from engine.runtime.request import Request
from engine.serve.client import EngineClient     # the engine's one client API (tests pass stand-ins)
from engine.serve.image_meta import image_record, reasoning_text, with_record
from engine.serve.info import ModelInfo
from engine.serve.results import ResultStore

PREVIEW_MAX_SIDE = 256
HEARTBEAT_S = 1.0          # yield at least this often: a closed tab is only noticed at a yield
# The page is updated at most this often: each update is a diff sent to the browser, which redraws; a
# token every 7 ms on a CPU made 140 a second, and the browser drawing them took the CPU from the model
# (a page run took 3x the API's time on 2 cores). Four a second still reads as streaming; ten a second, with
# a preview every 0.25 s, made a page run 1.46-1.51x the API's time against 1.30-1.33x (`python -m bench page`).
UPDATE_EVERY_S = 0.25
# Previews are at least this far apart (PreviewRate): each costs the page about the same (decode, encode,
# the browser drawing it) whatever a step costs the engine.
PREVIEW_GAP_S = 0.5
SECTION_TITLES = {"think": "Thinking", "recaption": "Recaption", "answer": "Answer"}


class EngineFailure(Exception):
    """The request ended with an error from the engine; the message is meant for the user. `kind` is
    the Error event's: invalid, busy (the engine holds --max-queue requests already) or engine."""

    def __init__(self, message: str, kind: str = "engine", param: str | None = None):
        super().__init__(message)
        self.kind, self.param = kind, param     # param: the request field at fault (Error.param)


@dataclass
class Update:
    status: str | None = None
    preview: PILImage.Image | None = None   # the step preview, drawn on the canvas while denoising
    image: str | None = None          # path of the final PNG, which replaces the preview
    cot: str | None = None
    timings: str | None = None
    record: dict[str, Any] | None = None   # what made the final image (image_meta.image_record; its PNG has it)
    conversation: str | None = None   # the engine conversation the finished turn was added to (submit_turn's)
    reset: bool = False               # clear every output first (start of a run)
    final: bool = False               # the run is over: send every output

    @property
    def changed(self) -> bool:
        return self.reset or self.final or any(v is not None for v in (self.status, self.preview, self.image,
                                                                         self.cot, self.timings))

    def merge(self, newer: "Update") -> "Update":
        """This update and a newer one as one (the newer's values win): what is held back between sends."""
        for name in ("status", "preview", "image", "cot", "timings"):
            if getattr(newer, name) is not None:
                setattr(self, name, getattr(newer, name))
        return self


@dataclass
class PreviewRate:
    """Which step previews the page shows: the first, then one every `every` steps, chosen from the engine's
    measured step time (since its denoising began): a step of PREVIEW_GAP_S or more shows its preview, faster
    steps are spaced so that one preview comes every PREVIEW_GAP_S (the real model's ~120 ms steps on an
    H200: every 5th; the embedded model on a CPU, 40 ms a step: every 13th)."""
    last: int | None = None          # the step whose preview was shown last

    def due(self, step: Step, denoise_s: float | None) -> bool:
        if step.preview is None:
            return False
        if self.last is not None:
            step_s = denoise_s / step.i if denoise_s else 0.0
            if step.i - self.last < (math.ceil(PREVIEW_GAP_S / step_s) if step_s > 0 else 1):
                return False
        self.last = step.i
        return True


@dataclass
class CotLog:
    """The reasoning text as it streams, with a title line whenever the section changes. It counts the
    characters written: a text event carries a piece of decoded text, not one token (the engine's
    token count comes with the timings at the end)."""
    text: str = ""
    section: str | None = None
    chars: int = 0
    sections: dict[str, str] = field(default_factory=dict)     # each section's text, as the model wrote it

    def add(self, ev: Text) -> None:
        if ev.section != self.section:
            title = SECTION_TITLES.get(ev.section, ev.section.title())
            self.text += ("\n\n" if self.text else "") + f"[{title}]\n"
            self.section = ev.section
        self.text += ev.delta
        self.chars += len(ev.delta)
        self.sections[ev.section] = self.sections.get(ev.section, "") + ev.delta


def running_count(health: dict[str, Any]) -> int:
    """How many requests the engine runs (health's count; an engine that reports only whether one runs: 0 or 1)."""
    n = health.get("running")
    return n if isinstance(n, int) and not isinstance(n, bool) else int(bool(n))


@dataclass
class RecentRuns:
    """How long the last finished runs took (the studio's own clock, submit to Done): the base of the
    wait estimate a request in line is shown."""
    keep: int = 8
    seconds: deque = field(default_factory=deque)

    def add(self, s: float) -> None:
        self.seconds.append(s)
        while len(self.seconds) > self.keep:
            self.seconds.popleft()

    def mean(self) -> float | None:
        return sum(self.seconds) / len(self.seconds) if self.seconds else None


def waiting_status(health: dict[str, Any], ahead: int | None = None, recent: RecentRuns | None = None) -> str:
    """What a request that has not started yet is told. `ahead`: how many requests wait before it (None:
    it is not in the engine's line, so it is being admitted). Neither count includes the request itself.
    The estimate assumes the runs ahead take what the last finished ones took, one after another (an
    upper bound when the engine batches them), and says so."""
    state = health.get("state")
    if state in ("loading", "restarting", "stalled"):
        what = f" ({health['loading']})" if health.get("loading") else ""
        verb = {"restarting": "restarting", "stalled": "restarting after a stall"}.get(state, "loading the model")
        return f"Waiting for the engine: {verb}{what}…"
    if ahead is None:
        return "Starting…"
    running = running_count(health)
    line = "Next in line" if ahead == 0 else f"In line: {ahead} ahead of you"
    if running:
        line += f" ({running} running)"
    mean = recent.mean() if recent is not None else None
    if mean is not None:
        line += f" · about {(ahead + 1) * mean:.0f} s to start (recent runs took {mean:.1f} s each)"
    return line + "…"


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
    """The measured figures as plain text (API clients get it as it is: no markup), and the image's size
    and seed."""
    parts = done.timings.parts()
    if image is not None:
        parts.append(f"{image.width} × {image.height}, seed {image.seed}")
    return " · ".join(parts)


@dataclass
class RunClock:
    """When each part of a run began, on the studio's clock (the user's time, from Generate), and the wait
    for the images ahead as the engine measured it. Each second of the run is counted in one part."""
    submitted: float
    started: float | None = None       # the engine took it: it has a slot (Started)
    sized: float | None = None         # its reasoning, or the size choice, is done (Ratio)
    denoising: float | None = None     # its denoising began (Denoising)
    image_wait_s: float = 0.0          # of sized..denoising, waiting for the images ahead (Denoising.waited_ms)
    reasons: bool = True               # the text phase reasons (think, recaption), or only reads the prompt

    def parts(self, end: float) -> list[tuple[str, float]]:
        """(what, seconds) from submit to `end`: in line, reasoning, the images ahead, denoising."""
        started = self.started if self.started is not None else end
        sized = self.sized if self.sized is not None else started
        return [("waiting for a slot", started - self.submitted),
                ("reasoning" if self.reasons else "reading the prompt", sized - started),
                ("waiting for the image ahead", self.image_wait_s),
                ("denoising", end - sized - self.image_wait_s)]


def done_status(clock: RunClock, end: float) -> str:
    """The user's time, Generate to image, and what it went on (the engine's own total, in the timings,
    starts when the request has its slot)."""
    parts = [f"{s:.1f} s {what}" for what, s in clock.parts(end) if s >= 0.05]
    return f"Done in {end - clock.submitted:.1f} s" + (": " + ", ".join(parts) if len(parts) > 1 else "")


def waiting_for_image(size: tuple[int, int] | None, since: float, now: float) -> str:
    """The status of a request whose reasoning is done while another image is being denoised."""
    what = f"Size {size[0]} × {size[1]} — " if size else ""
    if now - since < HEARTBEAT_S:
        return what + "denoising starts…"
    return what + f"waiting for the image ahead ({now - since:.0f} s)…"


async def run(client: EngineClient, req: Request, info: ModelInfo, results: ResultStore,
              recent: RecentRuns | None = None, submit: Callable[[Request], Any] | None = None
              ) -> AsyncIterator[Update]:
    """Submit `req` and describe its progress. Raises EngineFailure with a user-facing message when
    the engine refuses or fails the request; a cancelled request just ends with a 'Stopped' status.
    `info`: the served model. `results`: where the finished PNG is kept (served from there, as the engine
    made it, with what made it in its text chunks: engine/serve/image_meta.py).
    `recent`: the studio's record of finished runs (read for the wait estimate, this run added).
    `submit`: how to submit (a conversation's turn: `submit_turn` with its arguments); `client.submit`
    when None."""
    clock = RunClock(time.monotonic())
    # it validates, so decodes the references: off the loop
    sub = await asyncio.to_thread(submit or client.submit, req)
    cot, image, started = CotLog(), None, None
    image_path: str | None = None
    size: tuple[int, int] | None = None            # (width, height) of the image, once chosen
    preview: PILImage.Image | None = None          # the newest step preview shown
    rate, held = PreviewRate(), Update()           # held: what waits for the next send (UPDATE_EVERY_S)
    next_send = 0.0
    yield Update(reset=True, status="Submitted…")
    try:
        while True:
            now = time.monotonic()
            if held.changed and now >= next_send:
                yield held
                held, next_send = Update(), now + UPDATE_EVERY_S
            ev = await sub.aget(timeout=max(0.0, next_send - now) if held.changed else HEARTBEAT_S)
            if ev is None:
                if held.changed:
                    continue                       # its time has come: sent at the top
                if clock.started is None:
                    position = getattr(client, "position", None)      # EngineServer's; a stand-in may lack it
                    ahead = None if position is None else position(req.request_id)
                    yield Update(status=waiting_status(client.health(), ahead, recent))
                elif clock.sized is not None and clock.denoising is None:
                    yield Update(status=waiting_for_image(size, clock.sized, time.monotonic()))
                else:
                    yield Update()
                continue
            batch = [ev]
            while not isinstance(batch[-1], (Done, Error)) and (nxt := sub.get(timeout=0)) is not None:
                batch.append(nxt)
            update = Update()
            for ev in batch:
                if isinstance(ev, (Ratio, Image)):
                    # a phase is over (the reasoning at the size choice, the denoising at the image): what is
                    # held of it is shown now, before the next phase's first status (at four updates a second a
                    # fast phase's last words, or all its steps, and the next status arrived as one)
                    if held.merge(update).changed:
                        yield held
                    held, update, next_send = Update(), Update(), time.monotonic() + UPDATE_EVERY_S
                if isinstance(ev, Started):
                    started, clock.started, clock.reasons = ev, time.monotonic(), ev.bot_task != "image"
                    update.status = "Thinking…" if clock.reasons else "Reading the prompt…"
                elif isinstance(ev, Text):
                    cot.add(ev)
                    update.cot = cot.text
                    update.status = f"Writing… {cot.chars} characters"
                elif isinstance(ev, Ratio):
                    size, clock.sized = (ev.width, ev.height), time.monotonic()
                    update.status = waiting_for_image(size, clock.sized, clock.sized)
                elif isinstance(ev, Denoising):
                    clock.denoising, clock.image_wait_s = time.monotonic(), ev.waited_ms / 1e3
                    update.status = f"Denoising {ev.steps} steps…"
                elif isinstance(ev, Step):
                    update.status = f"step {ev.i}/{ev.n}"
                    if rate.due(ev, None if clock.denoising is None else time.monotonic() - clock.denoising):
                        preview = update.preview = preview_image(ev.preview, size)
                elif isinstance(ev, Image):
                    image = ev               # kept at Done, with the timings in its record
                    update.status = "Decoded"
                elif isinstance(ev, Done):
                    record = None
                    if image is not None:
                        record = image_record(req, started, image, info.name, info.gen, reasoning_text(cot.sections),
                                              ev.timings)
                        # the file is written off the loop: a large PNG takes a moment
                        rid = await asyncio.to_thread(results.add, with_record(image.png, record), image.seed)
                        image_path = str(results.path(rid))
                    # what is held ("Decoded") is not sent: the final update sets every output
                    end = time.monotonic()
                    if recent is not None:
                        recent.add(end - clock.submitted)
                    yield Update(final=True, status=done_status(clock, end), image=image_path, cot=cot.text,
                                 timings=timings_text(ev, image),
                                 record=record,
                                 conversation=getattr(sub, "conversation_id", None))
                    return
                elif isinstance(ev, Error):
                    if held.merge(update).changed:
                        yield held
                    if ev.kind == "cancelled":
                        yield Update(final=True, status="Stopped.", preview=preview, cot=cot.text)
                        return
                    raise EngineFailure(ev.message, ev.kind, ev.param)
            held.merge(update)
    finally:
        if not sub.ended:           # Stop, a closed tab or an error in the UI: free the engine
            try:
                client.cancel(req.request_id)
            except Exception as e:  # noqa: BLE001 - the UI must survive an engine that is gone
                print(f"studio: cancel failed: {e}", file=sys.stderr)
