"""The studio page: Gradio Blocks wired to the engine server.

Layout: three columns that the page arranges by width. On a wide screen the heading and the prompt (two
tabs: T2I, and TI2I, each with Generate/Stop and examples) sit above the shared settings on the left, and
the run fills the right from the top of the page: a status line, the streamed reasoning, the canvas (the
step preview is drawn in it while denoising, then the final image replaces it; it gives up height so that
the reasoning, the image, Download / Edit this result and the timings share one 1440x900 screen), then the
page's history (a click opens an item on the canvas). On a phone they stack prompt, run, settings, and
Generate scrolls to the run, which fits a 390x844 screen. The TI2I tab is a thread (webui/thread.py, drawn by thread_view.py): each finished edit stays
there as a turn and the next instruction continues the engine conversation (the first turn takes 1-3
reference images, later ones may add some); Undo, Branch from here, Start over.

API: `/t2i(prompt, mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
max_new_tokens)` and `/ti2i(prompt, images, ...same...)`, each streaming `(status, image, timings,
reasoning)`; every parameter after the prompt (and images) has a default. An API call to `/ti2i` is one
edit (the thread is the page's).
"""
from __future__ import annotations

import asyncio
import dataclasses
import html
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import gradio as gr
from PIL import Image as PILImage

from engine.runtime.request import (GUIDANCE_RANGE, LORA_SCALE_RANGE, MAX_IMAGES, MAX_NEW_TOKENS_RANGE,
                                    MAX_PROMPT_CHARS, SEED_RANGE, STEPS_RANGE, RequestError, random_seed)
from engine.serve.info import ModelInfo

from engine.serve.image_meta import NotARecord, read_record
from engine.serve.results import ResultStore

from .fields import lenient
from .keep import caption, history_strip, kept_thread, remembered, restored_thread
from .examples import is_small, reference_examples, t2i_prompts
from .options import (AUTO_SIZE, NO_LORA, REASONING_MODES, STEP_CACHES, Settings, build_request, control_of,
                      default_mode, preset_choices, size_choices)
from .launching import idle_gently, launch  # noqa: F401 (launch: build_studio's page, served)
from .page_scripts import HEALTH_JS, RANGE_JS, RESTORE_PROMPTS_JS, SHOW_RUN_JS
from .prompt_set import MAX_SET, parse_set, run_set, seeded, write_archive
from .references import check_reference
from .restore import restored
from .runner import EngineClient, EngineFailure, RecentRuns, Update, run, running_count
from .thread import Thread, ThreadTurn, check_next, continued, started
from .thread_view import QUEUED, thread_panel

TITLE = "HunyuanImage-3.0 Studio"
CANVAS_HEIGHT = 512       # at most; the CSS lets it shrink so the reasoning above it stays in view
PROMPTS_KEY = "hunyuan-studio-prompts"   # the browser storage that keeps the two prompts over a reload
HISTORY_KEY, THREAD_KEY, SETTINGS_KEY = "hunyuan-studio-history", "hunyuan-studio-thread", "hunyuan-studio-settings"
# What failed, said first in the message: Gradio 6.31's page ignores gr.Error's title (its toast always
# reads "Error"), and API clients see only the message.
FAILURE_PREFIX = {"invalid": "Request refused", "busy": "Not queued", "engine": "Generation failed"}
# The engine dropped the thread's conversation (its store keeps the most recently used ones).
LOST_THREAD = ("The engine no longer holds this thread: press Start over (its images are in this page's "
               "history; open one and press Edit this result to go on from it)")

def health_line(health: dict[str, Any]) -> str:
    """The engine line (HTML): state, model, device, what is loading, the queue, the restart attempt, and
    why it failed, with a button that loads the model again (the page's poller wires it)."""
    e = html.escape
    state = health.get("state", "?")
    line = f"Engine <b>{e(str(state))}</b> · {e(str(health.get('model_name', '')))} · {e(str(health.get('device', '')))}"
    if (health.get("kernels") or {}).get("text"):       # e.g. experts on humming-fp8 (W4A8): the numerics that ran
        line += f" · {e(health['kernels']['text'])}"
    if health.get("attempt"):
        wait = health.get("restart_in_s")
        line += f" · attempt {int(health['attempt'])}" + (f", next start in {wait:.0f} s" if wait else "")
    if health.get("loading"):
        line += f" · loading {e(str(health['loading']))}"
    if health.get("running") or health.get("queue"):
        line += f" · {running_count(health)} running, {health.get('queue', 0)} waiting"
    if state in ("failed", "restarting", "stalled", "loading") and health.get("last_error"):
        line += f"<br>⚠️ {e(str(health['last_error']))}"
    if state == "failed":
        line += ' <button class="engine-reload" type="button">Load the model again</button>'
    return line


def clamp(value: float, bounds: tuple[float, float]) -> float:
    """A checkpoint default as the control can show it."""
    return min(max(value, bounds[0]), bounds[1])


def _image_paths(refs: Any) -> list[str]:
    """Gallery values are (path, caption) pairs; the engine wants the paths."""
    out = []
    for item in refs or []:
        out.append(str(item[0] if isinstance(item, (tuple, list)) else item))
    return out


def _without_paths(message: str, paths: list[str]) -> str:
    """A message about an uploaded file names it by its file name, not by the server's temporary path."""
    for path in paths:
        message = message.replace(path, Path(path).name)
    return message


MERGED_INFO = "merged into the weights at start (--lora-merged): every image uses it"
SAME_AS_A = "same as A"                   # a choice of setting B that keeps A's
SETTING_B = ("mode", "step_cache", "lora")   # what setting B may change (the comparisons people make)


class Studio:
    """The handlers behind the page, bound to one engine client and one model."""

    def __init__(self, client: EngineClient, info: ModelInfo, results: ResultStore | str | Path):
        """`results`: where finished images are kept (a store, or a folder for one)."""
        self.client, self.info = client, info
        self.results = results if isinstance(results, ResultStore) else ResultStore(results)
        self.failed_tile = failed_tile(self.results.folder / "sets")   # a prompt set's grid: an image that failed
        self.recent = RecentRuns()      # this studio's finished runs: the queue's wait estimate
        # the edit tab's thread is an engine conversation where the client holds them (EngineServer, ReplicaPool)
        self.conversations = callable(getattr(client, "submit_turn", None))

    # ---------------------------------------------------------------- validation (before queueing)
    def validation(self, prompt: str, refs: Any, settings: Settings, controls: tuple[str, ...],
                   thread: Thread | None = None) -> dict[str, str]:
        """Control name -> message for what is wrong. The engine's `prepare` is the one judge of a
        request; this only puts its message on the control that holds the field. `thread`: the edit
        tab's (its first turn needs references; later ones may add some)."""
        problems: dict[str, str] = {}
        images = _image_paths(refs)
        if thread is not None and (problem := check_next(thread, images, self.conversations)) is not None:
            problems[problem[0]] = problem[1]
        for path in images:
            if (msg := check_reference(path)) is not None:
                problems.setdefault("images", msg)
        try:
            merged = self.merged_adapter()              # an engine with it merged runs it at strength 1 only
            self.info.validate(build_request(prompt, images, settings, for_check=True), self.adapters(),
                               None if merged is None else (merged, 1.0))
        except RequestError as e:
            msg = _without_paths(str(e), images)
            problems.setdefault(control_of(e.field, controls), msg[:1].upper() + msg[1:])
        except Exception as e:  # noqa: BLE001 - a value of a kind no control sends (API): say so, never a bare 400
            problems.setdefault("prompt", f"Invalid input ({type(e).__name__}: {e})")
        return problems

    def adapters(self) -> list[str]:
        """The LoRA adapters the engine serves now (loaded at start or since)."""
        adapters = getattr(self.client, "adapters", None)
        return adapters() if adapters is not None else []

    def merged_adapter(self) -> str | None:
        """The adapter the engine folded into its weights (--lora-merged), which every request must name."""
        merged = getattr(self.client, "merged_adapter", None)
        return merged() if merged is not None else None

    def picker_fields(self) -> tuple[dict, dict]:
        """The adapter picker's and the strength slider's properties, shown when the engine serves
        adapters (the page's build and its refresh both take them from here). An engine with its adapter
        merged serves nothing else at any other strength: the picker shows that one, chosen and fixed, and
        no slider (the base model would be refused after Generate)."""
        merged = self.merged_adapter()
        if merged is not None:
            return (dict(choices=[merged], value=merged, visible=True, interactive=False, info=MERGED_INFO),
                    dict(value=1.0, visible=False))
        names = self.adapters()
        return dict(choices=[NO_LORA, *names], visible=bool(names)), dict(visible=bool(names))

    def adapter_picker(self) -> tuple:
        """The picker and the slider as updates (adapters loaded or unloaded since the page was built)."""
        picker, slider = self.picker_fields()
        return gr.update(**picker), gr.update(**slider)

    def problems(self, names: tuple[str, ...], values: tuple) -> dict[str, str]:
        """`validation` of an event's input values, named by `names` (the event's inputs, in order)."""
        by_name = dict(zip(names, values))
        settings = Settings(**{n: by_name[n] for n in Settings.NAMES if n in by_name})
        return self.validation(by_name["prompt"], by_name.get("images"), settings, names, by_name.get("thread"))

    def validator(self, names: tuple[str, ...], judge: Callable[..., dict[str, str]] | None = None
                  ) -> Callable[..., list[dict]]:
        """The event's validator: each input's message (`judge(names, values)`, `problems` by default)."""
        def validate(*values: Any) -> list[dict]:
            problems = (judge or self.problems)(names, values)
            return [gr.validate(n not in problems, problems.get(n, "")) for n in names]
        return validate

    def checker(self, names: tuple[str, ...], judge: Callable[..., dict[str, str]] | None = None,
                clears_result: bool = False) -> Callable[..., tuple]:
        """The page's Generate, before its run: (the Generate buttons, the Stop buttons, status), and with
        `clears_result` (a run that draws on the canvas) Download, 'Edit this result' and the link. A valid
        request locks the buttons (the run's end unlocks them) and turns the result's off; a refused one
        leaves them as they are and says why in the Status box, which keeps it (the run's validator, which
        then refuses it, puts each message on its field; Gradio runs nothing after a refusal, so a lock taken
        before it was never released)."""
        def check(*values: Any) -> tuple:
            problems = (judge or self.problems)(names, values)
            if problems:
                reasons = " ".join(m if m.endswith(".") else m + "." for m in problems.values())
                return (*[gr.skip()] * (2 * RUN_BUTTONS), f"{FAILURE_PREFIX['invalid']}: {reasons}",
                        *[gr.skip()] * (RESULT_BUTTONS if clears_result else 0))
            return (*busy_buttons(True), "Starting…", *(self.result_buttons(None) if clears_result else ()))
        return check

    # ---------------------------------------------------------------- a prompt set (webui/prompt_set.py)
    @staticmethod
    def set_settings(by_name: dict[str, Any]) -> list[tuple[str, Settings]]:
        """("A", the page's settings), and with "Compare" ("B", the same with B's choices where they differ)."""
        a = Settings(**{n: by_name[n] for n in Settings.NAMES})
        if not by_name.get("compare"):
            return [("A", a)]
        b = {n: by_name[f"{n}_b"] for n in SETTING_B if by_name.get(f"{n}_b") not in (None, SAME_AS_A)}
        return [("A", a), ("B", dataclasses.replace(a, **b))]

    def set_problems(self, names: tuple[str, ...], values: tuple) -> dict[str, str]:
        """What stops a prompt set, by control: the list (each line), the settings A, and B's choices."""
        by_name = dict(zip(names, values))
        try:
            items = parse_set(by_name["prompt"])
        except RequestError as e:
            return {"prompt": str(e)[:1].upper() + str(e)[1:]}
        problems: dict[str, str] = {}
        for label, settings in self.set_settings(by_name):
            for control, msg in self.validation(items[0].prompt, None, settings, ("prompt", *Settings.NAMES)).items():
                if label == "B":
                    control = f"{control}_b" if control in SETTING_B else control
                    msg = f"Setting B: {msg}"
                problems.setdefault(control if control in names else "prompt", msg)
        return problems

    async def run_prompt_set(self, names: tuple[str, ...], *values: Any) -> AsyncIterator[tuple]:
        """The prompt set's run: (status, grid, archive) as each image comes, then the archive to download."""
        by_name = dict(zip(names, values))
        if self.set_problems(names, values):          # the validator refuses it: nothing to run
            return
        items, settings = parse_set(by_name["prompt"]), self.set_settings(by_name)
        first = settings[0][1]
        base = random_seed() if first.random_seed else int(first.seed or 0)
        jobs = [(item, label, build_request(item.prompt, [], dataclasses.replace(s, seed=seed, random_seed=False)))
                for item, seed in seeded(items, base) for label, s in settings]
        t0, results = time.monotonic(), []
        yield (f"Prompt set: {len(jobs)} images to make ({len(items)} prompts"
               f"{', two settings side by side' if len(settings) > 1 else ''})…", [], gr.DownloadButton(interactive=False))
        async for r in run_set(jobs, lambda req: run(self.client, req, self.info, self.results, self.recent)):
            results.append(r)
            failed = sum(x.error is not None for x in results)
            yield (f"Prompt set: {len(results)} of {len(jobs)} images" + (f", {failed} failed" if failed else "") + "…",
                   gr.Gallery(value=set_grid(results, self.failed_tile), columns=2 if len(settings) > 1 else 4),
                   gr.skip())
        archive = await asyncio.to_thread(write_archive, self.results.folder / "sets", results,
                                          {label: describe(s) for label, s in settings})
        failed = sum(r.error is not None for r in results)
        yield (f"Prompt set done: {len(jobs)} images in {time.monotonic() - t0:.1f} s"
               + (f", {failed} failed (the table says why)" if failed else ""), gr.skip(),
               gr.DownloadButton(value=str(archive), interactive=True))

    @staticmethod
    def set_from_file(file: Any) -> Any:
        """A prompt list uploaded (.txt, .csv, .jsonl): its text goes into the box, to be read and run."""
        if not file:
            return gr.skip()
        path = Path(file if isinstance(file, str) else getattr(file, "name", str(file)))
        try:
            return path.read_text(encoding="utf-8")[:MAX_SET * (MAX_PROMPT_CHARS + 24)]
        except (OSError, UnicodeDecodeError) as e:
            gr.Warning(f"{path.name} cannot be read as text ({e})")
            return gr.skip()

    def advice(self, settings: Settings) -> list[str]:
        """Things worth knowing that do not stop the run (shown as warnings)."""
        out = []
        state = self.client.health().get("state")
        if state in ("loading", "restarting", "stalled"):
            out.append("The engine is still loading the model; your request starts as soon as it is ready.")
        if not self.info.distil and isinstance(settings.guidance, (int, float)) and settings.guidance <= 1.0:
            out.append("Guidance ≤ 1 turns classifier-free guidance off: the image follows the prompt less.")
        if settings.system_prompt == "custom" and not (settings.custom_system_prompt or "").strip():
            out.append("The custom system prompt is empty, so the model runs without a system prompt.")
        return out

    # ---------------------------------------------------------------- running
    async def generate(self, prompt: str, refs: Any, settings: Settings,
                       thread: Thread | None = None, align: bool = False) -> AsyncIterator[tuple]:
        """The run's outputs (`outputs`); with `thread` (the edit tab) the request is the thread's next
        turn and each tuple ends with the turn once it has its image (see `made`); `align`: the edit tab's
        "keep the first reference's aspect"."""
        def out(u: Update) -> tuple:
            return self.outputs(u) if thread is None else (*self.outputs(u), self.made(u, prompt, paths))
        paths, submit = _image_paths(refs), None
        try:
            for message in self.advice(settings):
                gr.Warning(message)
            if thread is None:
                req = build_request(prompt, paths, settings)
            else:
                req = build_request(prompt, thread.images_for(paths, self.conversations), settings, align=align)
                if self.conversations:
                    conversation, branch_from = thread.submit_args()
                    submit = partial(self.client.submit_turn, conversation=conversation,
                                     branch_from_turn=branch_from)
            async for update in run(self.client, req, self.info, self.results, self.recent, submit):
                yield out(update)
        except EngineFailure as e:
            message = f"{FAILURE_PREFIX.get(e.kind, 'Generation failed')}: {e}"
            if thread is not None and e.param in ("conversation_id", "branch_from_turn"):
                message += f". {LOST_THREAD}"
            # the Status box keeps it (the toast hides after a few seconds)
            yield out(Update(status=message))
            raise gr.Error(message, print_exception=False) from None
        except (gr.Error, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must show as a message, not take the page down
            traceback.print_exc()
            raise gr.Error(f"Studio error: an internal error ({type(e).__name__}: {e}); the engine is fine, "
                           "please try again.", print_exception=False) from None

    def health(self) -> dict:
        """What the page's engine line shows (polled by the page; undocumented API `/health`)."""
        h = self.client.health()
        return {"state": h.get("state"), "queue": h.get("queue", 0), "running": running_count(h),
                "attempt": h.get("attempt", 0), "html": health_line(h)}

    def reload(self) -> dict:
        """The engine line's "Load the model again" (undocumented API `/reload`): a failed engine loads
        the model again, without restarting the studio. `reloading` False: it was not failed."""
        return {"reloading": bool(self.client.reload())}

    def made(self, u: Update, prompt: str, references: list[str]) -> Any:
        """The thread's new turn, once a run has its image (None at a run's start, so a stopped or failed
        run adds nothing)."""
        if u.reset:
            return None
        if not (u.final and u.image):
            return gr.skip()
        return ThreadTurn(prompt, tuple(references), u.cot or "", u.image,
                          u.conversation if self.conversations else None)

    @staticmethod
    def add_turn(thread: Thread, turn: ThreadTurn | None) -> tuple:
        """A finished edit joins the thread; the references and the instruction boxes empty for the next."""
        if turn is None:
            return gr.skip(), gr.skip(), gr.skip()
        return continued(thread, turn), [], ""

    @staticmethod
    def to_edit(result: str | None, thread: Thread) -> tuple:
        """'Edit this result' (the canvas's image: the last run's, or a history item reopened): the edit
        tab opens; the next instruction continues the thread when the image is its last turn's, else the
        image starts a new thread as its one reference."""
        if not result:
            gr.Warning("Generate an image first: the result is what gets edited.")
            return gr.skip(), gr.skip(), gr.skip()
        if thread.turns and thread.turns[-1].image == result:
            return gr.skip(), gr.Tabs(selected="ti2i"), gr.skip()
        if thread.turns:
            gr.Info("A new thread starts from this image (the images of the one before are in the page's history).")
        fresh, refs = started(result)
        return refs, gr.Tabs(selected="ti2i"), fresh

    def result_buttons(self, result: str | None) -> tuple:
        """Download, 'Edit this result' and the result's link work on a finished image only: off until there
        is one, and again while the next run draws its previews on the canvas."""
        return (gr.DownloadButton(value=result, interactive=bool(result)), gr.Button(interactive=bool(result)),
                result_link(self.results.id_of(result)))

    def settled(self, result: str | None) -> tuple:
        """The buttons once a run is over (done, stopped, failed or refused by the engine): each Generate live,
        each Stop off, and Download, 'Edit this result' and the link as the canvas's result allows."""
        return (*busy_buttons(False), *self.result_buttons(result))

    def finished(self, result: str | None, record: dict | None, saved: Any) -> tuple:
        """After a finished run, in one reply: the buttons (`settled`), the history (`remember`) and the seed
        the image used (`used_seed`). Each reply is a round trip that the browser draws and the studio
        serves on the CPU the engine shares (four of them, as separate events, delayed the image's Done)."""
        return (*self.settled(result), *self.remember(result, record, saved), self.used_seed(record))

    def remember(self, result: str | None, record: dict | None, saved: Any) -> tuple:
        """The finished image at the front of this page's history, captioned so that runs can be told apart
        (newest first, HISTORY_MAX kept): the strip and what the browser keeps of it."""
        rid = self.results.id_of(result)
        if rid is None or record is None:
            return gr.skip(), gr.skip()
        kept = remembered(saved, rid, caption(record))
        return history_strip(kept, self.results)[0], kept

    @staticmethod
    def used_seed(record: dict | None) -> Any:
        """The seed box shows the seed the finished image used (the engine's Image event says it; a random
        one too): untick "Random seed" to draw it again."""
        return gr.skip() if record is None else record["seed"]

    def applicable(self, saved: Any, current: dict[str, Any]) -> dict[str, Any]:
        """Of stored settings (a browser's), those this page can take: a choice it offers, a value of the
        control's kind, and what the engine accepts with the other settings as they would run (`validation`,
        the one judge); the others are left as they are."""
        if not isinstance(saved, dict):
            return {}
        merged = self.merged_adapter()
        offered = {"mode": [v for _, v in REASONING_MODES], "size": [v for _, v in size_choices(self.info.buckets)],
                   "system_prompt": list(self.info.presets), "step_cache": [v for _, v in STEP_CACHES],
                   "lora": [merged] if merged is not None else [NO_LORA, *self.adapters()]}
        kinds = {"random_seed": bool, "custom_system_prompt": str}
        values = {n: saved[n] for n in Settings.NAMES if n in saved
                  and (n not in offered or saved[n] in offered[n])
                  and (n not in kinds or isinstance(saved[n], kinds[n]))
                  and (n in kinds or not isinstance(saved[n], bool))}
        settings = Settings(**{n: current[n] for n in Settings.NAMES if n in current} | values)
        problems = self.validation("a prompt", None, settings, ("prompt", *Settings.NAMES))
        return {n: v for n, v in values.items() if n not in problems}

    def restore_page(self, saved_history: Any, saved_thread: Any, saved_settings: Any, *current: Any) -> tuple:
        """A page as its browser left it: the history strip (the results still kept), the edit thread, and
        the settings (`applicable`), after the ones the page was built with (`current`, in Settings order)."""
        strip, kept = history_strip(saved_history, self.results)
        values = self.applicable(saved_settings, dict(zip(Settings.NAMES, current)))
        return (strip if strip else gr.skip(), kept, restored_thread(saved_thread, self.results),
                *(values[n] if n in values else gr.skip() for n in Settings.NAMES))

    def reopen(self, evt: gr.SelectData) -> tuple:
        """A history item clicked: it goes back on the canvas as the page's result, and Download and
        "Edit this result" take it in the same update (a chained event could land after a click on
        Download, which then gave the previous file)."""
        path = (evt.value or {}).get("image", {}).get("path") if isinstance(evt.value, dict) else None
        if not path:
            return gr.skip(), gr.skip(), gr.skip(), gr.skip(), gr.skip()
        kept = self.results.path(self.results.id_of(path))    # the result itself, not Gradio's copy of it
        path = str(kept) if kept is not None else path
        return (path, path, *self.result_buttons(path))

    def open_png(self, file: Any, *current: Any) -> tuple:
        """'Open a PNG's settings': a PNG this studio or /v1 made (its record, engine/serve/image_meta.py)
        puts its prompt and every setting back, the seed fixed, so that Generate makes the same image. Outputs:
        (the drop box emptied, the T2I prompt, the edit instruction, the tab, the status, the settings in
        Settings order); what cannot be restored here is said in the status."""
        if not file:
            return (gr.skip(),) * (5 + len(Settings.NAMES))
        path = Path(file if isinstance(file, str) else getattr(file, "name", str(file)))
        return (None, *self.restore_from(path, path.name, current))

    def open_linked(self, rid: str | None, *current: Any) -> tuple:
        """The page opened from a result's link ('Open these settings in the studio': `?result=<id>`): as
        'Open a PNG's settings' with that result's PNG. Outputs as `restore_from`'s."""
        path = self.results.path(rid) if rid else None
        if path is None:
            return (gr.skip(),) * 3 + ((f"Not restored: no result {rid} on this server (it keeps its last "
                                        f"{self.results.max_count})" if rid else gr.skip()),) \
                + (gr.skip(),) * len(Settings.NAMES)
        return self.restore_from(path, f"result {rid}", current)

    def restore_from(self, path: Path, name: str, current: tuple) -> tuple:
        """(the T2I prompt, the edit instruction, the tab, the status, the settings in Settings order) of the
        PNG at `path`: its record's prompt and settings where the page can take them (`applicable`), what it
        cannot said in the status."""
        nothing = (gr.skip(),) * 3
        try:
            record = read_record(path.read_bytes())
        except (NotARecord, OSError) as e:
            message = f"Not restored: {name}: {e}"
            gr.Warning(message)
            return (*nothing, message, *(gr.skip(),) * len(Settings.NAMES))
        r = restored(record, self.info.name, (self.client.health().get("kernels") or {}).get("text"))
        values = self.applicable(r.settings, dict(zip(Settings.NAMES, current)))
        left = [f"{n} {r.settings[n]!r}" for n in Settings.NAMES if n in r.settings and n not in values]
        notes = r.notes + ([f"not offered here: {', '.join(left)}"] if left else [])
        status = (f"Settings of {name} restored (seed {record.get('seed')}): Generate makes the same image."
                  + "".join(f" Note: {n}." for n in notes))
        prompt = r.prompt[:MAX_PROMPT_CHARS]
        return (gr.skip() if r.edit else prompt, prompt if r.edit else gr.skip(),
                gr.Tabs(selected="ti2i" if r.edit else "t2i"), status,
                *(values[n] if n in values else gr.skip() for n in Settings.NAMES))

    @staticmethod
    def checked_references(refs: Any) -> Any:
        """Uploaded references, each checked at once (the /v1 limits, readable as an image) and at most
        MAX_IMAGES of them: a bad one, or one too many, is named and left out, so the gallery never holds a
        file that Generate would refuse (a 4th image was taken and refused only at Generate)."""
        kept, refused = [], []
        for item in refs or []:
            path = str(item[0] if isinstance(item, (tuple, list)) else item)
            msg = check_reference(path)
            if msg is None and len(kept) == MAX_IMAGES:
                msg = f"At most {MAX_IMAGES} reference images: {Path(path).name} was left out."
            (refused.append(msg) if msg else kept.append(item))
        for msg in refused:
            gr.Warning(msg, duration=None)
        return kept if refused else gr.skip()

    @staticmethod
    def select_reference(evt: gr.SelectData) -> tuple:
        return evt.index, gr.Button(interactive=True)

    @staticmethod
    def without_selected(refs: Any, index: int | None) -> tuple:
        """"Remove selected": the clicked reference leaves the gallery, the others stay."""
        if index is None or not refs or not 0 <= index < len(refs):
            gr.Warning("Click a reference image first, then Remove it.")
            return gr.skip(), None
        return [r for i, r in enumerate(refs) if i != index], None

    @staticmethod
    def outputs(u: Update) -> tuple:
        """An Update as values for (status, canvas, timings, reasoning, finished result, its seed). The canvas
        shows the step preview while denoising and the final PNG at the end; the finished result (page
        state, not part of the API) is set only by a completed run."""
        if u.reset:
            return (u.status or "", None, "", "", None, None)
        if u.final:
            return (u.status or "", u.image or u.preview, u.timings or "", u.cot or "", u.image, u.record)
        skip = gr.skip()
        canvas = u.image if u.image is not None else u.preview
        return (skip if u.status is None else u.status,
                skip if canvas is None else canvas,
                skip if u.timings is None else u.timings,
                skip if u.cot is None else u.cot,
                skip, skip)


def build_studio(client: EngineClient, info: ModelInfo, *, notice: str | None = None,
                 out_dir: str | Path | None = None, examples_dir: str | Path | None = None,
                 results: ResultStore | None = None) -> gr.Blocks:
    """The studio page for `client` (an `engine.server.EngineServer` or anything with its API) serving
    the model described by `info`. Launch it with `launch(demo, ...)`. The engine server is the one
    queue (and its `max_queue` the one limit) for this page, its API and any other front end: the page
    hands every request to it at once. `results`: where finished images are kept (engine.serve.results; by
    default a store in `out_dir`, or in a temporary folder that goes with the studio)."""
    results = results if results is not None else ResultStore(out_dir)
    ex_dir = Path(examples_dir) if examples_dir else Path(tempfile.gettempdir()) / "hunyuan-studio" / "examples"
    studio = Studio(client, info, results)
    gen = info.gen
    presets = preset_choices(info.presets)
    preset_default = gen.use_system_prompt if gen.use_system_prompt in info.presets else info.presets[0]

    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600)) as demo:
        with gr.Row(equal_height=False, elem_id="layout"):
            with gr.Column(scale=5, min_width=320, elem_id="col-prompt"):
                # the heading in the left column: on a wide screen the run column starts at the top of the
                # page, so a finished image, its Download and the timings fit a 1440x900 screen
                gr.Markdown(f"# {TITLE}", elem_id="title")
                if notice:
                    gr.Markdown(notice, elem_id="notice")
                # filled by the page's poller as it loads (a value here would be the state at start-up)
                gr.HTML('<span class="engine-line">Engine …</span>', elem_id="engine-health")
                with gr.Tabs() as tabs:
                    with gr.Tab("Text to image", id="t2i"):
                        t2i_prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt",
                                                placeholder="Describe the image you want…")
                        with gr.Row():
                            t2i_run = gr.Button("Generate", variant="primary", elem_id="run", elem_classes="generate")
                            t2i_stop = gr.Button("Stop", variant="secondary", interactive=False, elem_id="stop")
                        gr.Examples([[p] for p in t2i_prompts(info.buckets)], inputs=[t2i_prompt], label="Example prompts")
                    with gr.Tab("Edit images", id="ti2i"):
                        thread = gr.State(Thread())     # the turns so far (webui/thread.py)
                        thread_slot = gr.Column(elem_id="thread")   # drawn below, once the boxes it sets exist
                        # any file may be dropped ("file"): the upload handler names one that is not an image (with
                        # "image", Gradio answered a .txt with its generic error and a red pill over the gallery)
                        refs = gr.Gallery(label="Reference images (1 to 3; later turns may add some)", type="filepath",
                                          interactive=True, file_types=["file"], columns=3, height="auto",
                                          object_fit="contain", allow_preview=False, elem_id="refs")
                        remove_ref = gr.Button("Remove the selected image", size="sm", interactive=False,
                                               elem_id="remove-ref")
                        ti2i_prompt = gr.Textbox(label="Instruction", lines=3, elem_id="ti2i-prompt",
                                                 placeholder="What should change? e.g. “make the sky stormy”")
                        with gr.Row():
                            ti2i_run = gr.Button("Generate", variant="primary", elem_id="ti2i-run",
                                                 elem_classes="generate")
                            ti2i_stop = gr.Button("Stop", variant="secondary", interactive=False, elem_id="ti2i-stop")
                        # below the Generate row: above it, it pushed Generate down, and scrolling to reach it took
                        # the reasoning and the canvas out of view on a desktop
                        align = gr.Checkbox(False, label="Keep the first reference's aspect", elem_id="align",
                                            info="Fits the references by stretching them (not cropping) and resizes "
                                                 "the result to the first one's exact aspect (the official align "
                                                 "option).")
                        gr.Examples([[[str(p)], prompt] for p, prompt in reference_examples(ex_dir, is_small(info.buckets))],
                                    inputs=[refs, ti2i_prompt], label="Example edits", elem_id="edit-examples")
                        with thread_slot:
                            thread_panel(thread, refs, ti2i_prompt, studio.conversations)
                    with gr.Tab("Prompt set", id="set"):
                        set_text = gr.Textbox(
                            label="Prompts, one a line (`prompt | seed` fixes its seed; the others take the seed "
                                  "box's seed plus their line number)", lines=6, elem_id="set-prompts",
                            placeholder="a red circle on the left on a white background | 7\ntwo blue squares")
                        set_file = gr.UploadButton("Load a list (.txt, .csv with a prompt column, .jsonl)", size="sm",
                                                   file_types=[".txt", ".csv", ".jsonl"], elem_id="set-file")
                        compare = gr.Checkbox(False, label="Compare with a second setting (B): each prompt and seed "
                                                           "made twice, side by side", elem_id="set-compare")
                        with gr.Row():
                            mode_b = gr.Dropdown([(SAME_AS_A, SAME_AS_A), *REASONING_MODES], value=SAME_AS_A,
                                                 label="B: reasoning", elem_id="mode-b")
                            step_cache_b = gr.Dropdown([(SAME_AS_A, SAME_AS_A), *STEP_CACHES], value=SAME_AS_A,
                                                       label="B: step cache", elem_id="step-cache-b")
                            lora_b = gr.Dropdown([(SAME_AS_A, SAME_AS_A), *[(n, n) for n in (NO_LORA, *studio.adapters())]],
                                                 value=SAME_AS_A, label="B: LoRA adapter", elem_id="lora-b",
                                                 visible=bool(studio.adapters()))
                        with gr.Row():
                            set_run = gr.Button("Run the set", variant="primary", elem_id="set-run", elem_classes="generate")
                            set_stop = gr.Button("Stop", variant="secondary", interactive=False, elem_id="set-stop")
                        set_grid_view = gr.Gallery(label="The set (each prompt's A beside its B)", columns=4,
                                                   height="auto", object_fit="contain", interactive=False,
                                                   elem_id="set-grid", buttons=["download"])
                        set_download = gr.DownloadButton("Download the set (.zip: the PNGs, a table of settings and "
                                                         "timings)", interactive=False, elem_id="set-download")
            with gr.Column(scale=6, min_width=320, elem_id="col-run"):
                status = gr.Textbox(label="Status", interactive=False, max_lines=4, elem_id="status")
                # the reasoning above the canvas: both in view during a run (1440x900, and a phone)
                cot = gr.Textbox(label="Reasoning (streamed)", lines=4, max_lines=6, interactive=False,
                                 autoscroll=True, elem_id="cot")
                image = gr.Image(label="Result", type="filepath", format="png", interactive=False,
                                 height=CANVAS_HEIGHT, elem_id="result", buttons=["fullscreen"])
                with gr.Row(elem_id="result-actions"):
                    download = gr.DownloadButton("Download PNG", interactive=False, elem_id="download")
                    edit_result = gr.Button("Edit this result", interactive=False, elem_id="edit-result")
                    # a link another person can open (engine/serve/results.py), behind the page's login
                    link = gr.HTML(result_link(None), elem_id="result-link", padding=False)
                timings = gr.Markdown(label="Timings", elem_id="timings")
                history = gr.Gallery(label="Results of this page (newest first; click one to open it)", columns=6,
                                     height="auto", object_fit="contain", allow_preview=False, interactive=False,
                                     elem_id="history", buttons=["download"])
            with gr.Column(scale=5, min_width=320, elem_id="col-settings"):
                # a PNG this studio or /v1 made: its prompt and settings come back, and Generate makes it again
                open_file = gr.File(label="Open a PNG's settings (drop a PNG of this studio or /v1)",
                                    file_types=[".png"], file_count="single", height=120, elem_id="open-png")
                # lenient: a bad value reaches the validator, whose message names the range (not a bare 400)
                mode = lenient(gr.Radio(
                    REASONING_MODES, value=default_mode(gen), label="Reasoning", elem_id="mode",
                    info="Think: the model reasons before drawing. Recaption: it also rewrites the prompt in "
                         "detail. Both stream beside the image."))
                size = lenient(gr.Dropdown(size_choices(info.buckets), value=AUTO_SIZE, label="Size (width × height)",
                                           elem_id="size"))
                with gr.Row():
                    seed = lenient(gr.Number(value=0, precision=0, minimum=SEED_RANGE[0], maximum=SEED_RANGE[1],
                                             label="Seed", elem_id="seed"))
                    random_seed = gr.Checkbox(value=True, label="Random seed", elem_id="random-seed")
                steps = lenient(gr.Slider(*STEPS_RANGE, value=clamp(gen.diff_infer_steps, STEPS_RANGE), step=1,
                                          label="Steps", elem_id="steps"))
                guidance = lenient(gr.Slider(
                    *GUIDANCE_RANGE, value=clamp(gen.diff_guidance_scale, GUIDANCE_RANGE), step=0.1,
                    label="Guidance", elem_id="guidance",
                    info="Distil checkpoints embed the guidance; others run classifier-free guidance when it is above 1."))
                step_cache = lenient(gr.Dropdown(
                    STEP_CACHES, value="none", label="Faster (step cache)", elem_id="step-cache",
                    info="Reuses work between neighbouring denoise steps: fewer steps run in full (the timings "
                         "say how many). Off gives the exact image."))
                with gr.Accordion("Advanced", open=False):
                    system_prompt = lenient(gr.Dropdown(presets, value=preset_default, label="System prompt preset",
                                                        elem_id="system-prompt"))
                    custom_system_prompt = gr.Textbox(value="", label="Custom system prompt (preset “custom text”)",
                                                      lines=3, elem_id="custom-system-prompt")
                    max_new_tokens = lenient(gr.Slider(
                        *MAX_NEW_TOKENS_RANGE, value=clamp(gen.max_new_tokens, MAX_NEW_TOKENS_RANGE), step=1,
                        label="Max new tokens (reasoning length)", elem_id="max-new-tokens"))
                    picker, slider = studio.picker_fields()
                    lora = lenient(gr.Dropdown(**{"value": NO_LORA, **picker}, label="LoRA adapter", elem_id="lora"))
                    lora_scale = lenient(gr.Slider(
                        0.05, LORA_SCALE_RANGE[1], **{"value": 1.0, **slider}, step=0.05, label="LoRA strength",
                        elem_id="lora-scale",
                        info="1: as trained; lower tones the adapter down, higher strengthens it."))
        result = gr.State(None)       # the last finished image of this page (the canvas may hold a preview)
        result_record = gr.State(None)  # what made it (engine.serve.image_meta.image_record: what its PNG carries)
        turn_made = gr.State(None)    # the edit tab's finished turn, for its thread (Studio.made)
        selected_ref = gr.State(None)  # the index of the reference image clicked last
        saved_prompts = gr.BrowserState(["", ""], storage_key=PROMPTS_KEY)
        # what the page keeps across reloads (webui/keep.py), encrypted with a secret that lasts as long as the
        # results it names
        saved_history = gr.BrowserState([], storage_key=HISTORY_KEY, secret=results.secret)
        saved_thread = gr.BrowserState({}, storage_key=THREAD_KEY, secret=results.secret)
        saved_settings = gr.BrowserState({}, storage_key=SETTINGS_KEY, secret=results.secret)

        settings = [mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
                    max_new_tokens, step_cache, lora, lora_scale]
        outputs = [status, image, timings, cot, result, result_record]
        t2i_names = ("prompt", *Settings.NAMES)
        ti2i_names = ("prompt", "images", *Settings.NAMES, "align", "thread")

        async def t2i(prompt, mode, size, seed, random_seed, steps, guidance, system_prompt,
                      custom_system_prompt, max_new_tokens, step_cache="none", lora=NO_LORA,
                      lora_scale=1.0):
            s = Settings(mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
                         max_new_tokens, step_cache, lora, lora_scale)
            async for o in studio.generate(prompt, None, s):
                yield o

        async def ti2i(prompt, images, mode, size, seed, random_seed, steps, guidance, system_prompt,
                       custom_system_prompt, max_new_tokens, step_cache="none", lora=NO_LORA,
                       lora_scale=1.0, align=False, thread=None):
            # `thread` is page state: an API call gets a fresh one (its finished turn is added to the
            # page's thread by a follow-up event only the page runs), so /ti2i stays one edit
            s = Settings(mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
                         max_new_tokens, step_cache, lora, lora_scale)
            async for o in studio.generate(prompt, images, s, thread or Thread(), align=align):
                yield o

        # No concurrency limit here: every accepted request goes straight to the engine server, whose
        # queue orders the page's and the API's requests together and refuses past its max_queue.
        # While a run is on: Generate greyed out (a second click did nothing and said nothing), Stop
        # red and live; after it (done, stopped, failed or refused), the other way round. The check comes
        # first in the click's chain: it locks the buttons of a valid request before the run's first
        # update, and leaves them alone for a refused one. Gradio 6.31's page runs a `.then` only after a
        # run that succeeded (an error runs the `.failure`s alone, a refusal by the validator nothing), so
        # the unlock (`Studio.settled`) follows both ends. No progress overlay: the Status box says what
        # happens, and after a failure keeps the reason (the overlay's red "Error" pill covered it).
        runs, stops = [t2i_run, ti2i_run, set_run], [t2i_stop, ti2i_stop, set_stop]
        private = dict(queue=False, api_visibility="private", show_progress="hidden")
        result_actions = [download, edit_result, link]
        settle = dict(fn=studio.settled, inputs=[result], outputs=[*runs, *stops, *result_actions], **private)
        common = dict(concurrency_limit=None, show_progress="hidden")
        t2i_inputs, ti2i_inputs = [t2i_prompt, *settings], [ti2i_prompt, refs, *settings, align, thread]
        t2i_ev = t2i_run.click(studio.checker(t2i_names, clears_result=True), t2i_inputs,
                               [*runs, *stops, status, *result_actions], **private) \
            .then(t2i, t2i_inputs, outputs, api_name="t2i", validator=studio.validator(t2i_names), **common)
        ti2i_ev = ti2i_run.click(studio.checker(ti2i_names, clears_result=True), ti2i_inputs,
                                 [*runs, *stops, status, *result_actions], **private) \
            .then(ti2i, ti2i_inputs, [*outputs, turn_made], api_name="ti2i", validator=studio.validator(ti2i_names),
                  **common)
        for button, ev in ((t2i_run, t2i_ev), (ti2i_run, ti2i_ev)):
            button.click(None, None, None, js=SHOW_RUN_JS, queue=False, api_visibility="private")

        # a prompt set: N ordinary requests through the engine's queue (webui/prompt_set.py), the page's own
        set_names = ("prompt", "compare", *(f"{n}_b" for n in SETTING_B), *Settings.NAMES)
        set_inputs = [set_text, compare, mode_b, step_cache_b, lora_b, *settings]

        async def prompt_set(*values):
            async for o in studio.run_prompt_set(set_names, *values):
                yield o

        set_ev = set_run.click(studio.checker(set_names, studio.set_problems), set_inputs, [*runs, *stops, status],
                               **private) \
            .then(prompt_set, set_inputs, [status, set_grid_view, set_download], api_visibility="private",
                  validator=studio.validator(set_names, studio.set_problems), **common)
        set_file.upload(studio.set_from_file, set_file, set_text, **QUEUED)
        # after a finished run, one reply (Studio.finished): the buttons, the history and the seed it used;
        # unqueued, so this bookkeeping never waits behind (or is refused by) a full queue
        for ev in (t2i_ev, ti2i_ev):
            ev.then(studio.finished, [result, result_record, saved_history],
                    [*runs, *stops, *result_actions, history, saved_history, seed], **private)
        set_ev.then(**settle)
        for ev in (t2i_ev, ti2i_ev, set_ev):
            ev.failure(**settle)

        def stopped(current: str) -> Any:
            # a cancelled job yields nothing more, so the status is set here (unless nothing was running)
            return "Stopped." if current and not current.startswith(("Done", "Stopped")) else gr.skip()

        for stop in stops:
            # cancel first, then write the status, so no update of the cancelled run can land after it
            stop.click(None, None, None, cancels=[t2i_ev, ti2i_ev, set_ev], queue=False, api_visibility="private") \
                .then(stopped, status, status, queue=False, show_progress="hidden", api_visibility="private") \
                .then(**settle)

        ti2i_ev.success(studio.add_turn, [thread, turn_made], [thread, refs, ti2i_prompt], **QUEUED)
        edit_result.click(studio.to_edit, [result, thread], [refs, tabs, thread], **QUEUED)

        # the buttons in the same update: `result.change` does not fire for a State set by an unqueued
        # event (Gradio 6.31), and a chained `.then` could land after a quick click on Download
        history.select(studio.reopen, None, [image, result, download, edit_result, link], queue=False,
                       api_visibility="private", show_progress="hidden")
        # queued: a warning needs the queue's channel to reach the page
        refs.upload(studio.checked_references, refs, refs, concurrency_limit=None, api_visibility="private",
                    show_progress="hidden")
        refs.select(studio.select_reference, None, [selected_ref, remove_ref],
                    queue=False, api_visibility="private", show_progress="hidden")
        remove_ref.click(studio.without_selected, [refs, selected_ref], [refs, selected_ref], queue=False,
                         api_visibility="private", show_progress="hidden") \
            .then(lambda: gr.Button(interactive=False), None, remove_ref, queue=False, api_visibility="private",
                  show_progress="hidden")
        # the prompts survive a reload (the browser's storage)
        gr.on([t2i_prompt.change, ti2i_prompt.change], lambda a, b: [a, b], [t2i_prompt, ti2i_prompt],
              saved_prompts, queue=False, api_visibility="private", show_progress="hidden")
        # restored in the page itself (no server round trip): a reply landing after the first keystrokes
        # wiped the prompt being typed (CI: a Generate click then found an empty prompt); a prompt that is
        # already typed is kept
        demo.load(None, [saved_prompts, t2i_prompt, ti2i_prompt], [t2i_prompt, ti2i_prompt], js=RESTORE_PROMPTS_JS,
                  queue=False, api_visibility="private", show_progress="hidden")

        # the settings, the history and the thread survive a reload (webui/keep.py); queued, so that the thread
        # it sets is drawn (a State set by an unqueued event fires no change in Gradio 6.31)
        gr.on([c.change for c in settings], lambda *v: dict(zip(Settings.NAMES, v)), settings, saved_settings,
              queue=False, api_visibility="private", show_progress="hidden")
        thread.change(lambda t: kept_thread(t, results), thread, saved_thread, queue=False,
                      api_visibility="private", show_progress="hidden")
        def linked(mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
                   max_new_tokens, step_cache, lora, lora_scale, request: gr.Request) -> tuple:
            # a result's "Open these settings in the studio" (?result=<id>): after the browser's own settings.
            # (Gradio passes the request to a parameter it can see by name, so the settings are spelt out.)
            return studio.open_linked(request.query_params.get("result") if request else None, mode, size, seed,
                                      random_seed, steps, guidance, system_prompt, custom_system_prompt,
                                      max_new_tokens, step_cache, lora, lora_scale)
        demo.load(studio.restore_page, [saved_history, saved_thread, saved_settings, *settings],
                  [history, saved_history, thread, *settings], **QUEUED) \
            .then(linked, settings, [t2i_prompt, ti2i_prompt, tabs, status, *settings], **QUEUED)

        # queued: its warning needs the queue's channel, and the tab it selects must be drawn
        open_file.upload(studio.open_png, [open_file, *settings],
                         [open_file, t2i_prompt, ti2i_prompt, tabs, status, *settings], **QUEUED)

        gr.api(studio.health, api_name="health", queue=False, api_visibility="undocumented")
        gr.api(studio.reload, api_name="reload", queue=False, api_visibility="undocumented")
        # adapters loaded since the page was built (POST /v1/load_lora_adapter) appear on a reload
        # the engine line polls once the picker is filled, so a page whose line has been polled is whole
        demo.load(studio.adapter_picker, None, [lora, lora_scale], api_visibility="private", queue=False) \
            .then(None, None, None, js=HEALTH_JS, queue=False, api_visibility="private")
        demo.load(None, None, None, js=RANGE_JS)

    demo.queue(default_concurrency_limit=1)
    idle_gently(demo)
    demo.studio = studio              # launch() serves the results' folder
    return demo


RUN_BUTTONS = 3        # the Generate buttons (text to image, edit, prompt set), each with its Stop
RESULT_BUTTONS = 3     # Download, 'Edit this result' and the result's link (Studio.result_buttons)


def busy_buttons(busy: bool) -> tuple:
    """(each Generate, each Stop) for a page with a run on or not."""
    go = gr.Button(interactive=not busy)
    stop = gr.Button(interactive=busy, variant="stop" if busy else "secondary")
    return (go,) * RUN_BUTTONS + (stop,) * RUN_BUTTONS


def result_link(rid: str | None) -> str:
    """The link to a kept result's page (engine/serve/results.py; relative, so it works under a proxy's path
    too), greyed out while there is none."""
    if rid is None:
        return '<span class="result-link off">Link to this result</span>'
    return f'<a class="result-link" href="results/{rid}" target="_blank" rel="noopener">Link to this result</a>'


def failed_tile(folder: Path) -> str:
    """A plain gray tile that stands for an image a prompt set could not make (the grid keeps its pairs)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "failed.png"
    if not path.exists():
        PILImage.new("RGB", (64, 64), (200, 200, 200)).save(path)
    return str(path)


def set_grid(results: list, failed: str) -> list[tuple[str, str]]:
    """The prompt set's grid: its images in order, each prompt's A beside its B, captioned."""
    out = []
    for r in sorted(results, key=lambda r: (r.item.index, r.setting)):
        prompt = r.item.prompt if len(r.item.prompt) <= 40 else r.item.prompt[:39] + "…"
        what = f"failed: {r.error}" if r.error else prompt
        out.append((r.image or failed, f"{r.item.index} {r.setting} · seed {r.seed} — {what}"))
    return out


def describe(s: Settings) -> dict[str, Any]:
    """A setting as the archive names it."""
    return {n: getattr(s, n) for n in Settings.NAMES}
