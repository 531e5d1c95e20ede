"""The studio page: Gradio Blocks wired to the engine server.

Layout: the left column holds the two tabs (T2I, TI2I with 1-3 reference images), each with its own
prompt and Generate/Stop, and the shared settings; the right column shows the run: status and a small
step preview, the final image with a PNG download, the measured timings and the streamed reasoning.

API: `/t2i(prompt, mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
max_new_tokens)` and `/ti2i(prompt, images, ...same...)`, each streaming
`(status, preview, image, download, timings, reasoning)`.
"""
from __future__ import annotations

import asyncio
import tempfile
import traceback
from pathlib import Path
from typing import Any, AsyncIterator, Callable

import gradio as gr

from engine.runtime.request import RequestError
from engine.serve.info import ModelInfo

from .examples import is_small, reference_examples, t2i_prompts
from .options import (AUTO_SIZE, GUIDANCE_MAX, MAX_NEW_TOKENS_MAX, REASONING_MODES, SEED_MAX, STEPS_MAX,
                      Settings, build_request, default_mode, field_of, preset_choices, size_choices)
from .runner import EngineClient, EngineFailure, Update, run, seed_in
from .theme import CSS, theme

TITLE = "HunyuanImage-3.0 Studio"
HEALTH_EVERY_S = 3.0
HISTORY_MAX = 24          # results kept in a page's history strip


def health_text(health: dict[str, Any]) -> str:
    state = health.get("state", "?")
    line = f"Engine **{state}** · {health.get('model_name', '')} · {health.get('device', '')}"
    if health.get("loading"):
        line += f" · loading {health['loading']}"
    if health.get("queue"):
        line += f" · {health['queue']} waiting"
    if state == "failed" and health.get("last_error"):
        line += f"\n\n⚠️ {health['last_error']}"
    return line


def _image_paths(refs: Any) -> list[str]:
    """Gallery values are (path, caption) pairs; the engine wants the paths."""
    out = []
    for item in refs or []:
        out.append(str(item[0] if isinstance(item, (tuple, list)) else item))
    return out


class Studio:
    """The handlers behind the page, bound to one engine client and one model."""

    def __init__(self, client: EngineClient, info: ModelInfo, out_dir: Path):
        self.client, self.info, self.out_dir = client, info, out_dir

    # ---------------------------------------------------------------- validation (before queueing)
    def validation(self, prompt: str, refs: Any, settings: Settings, need_images: bool) -> dict[str, str]:
        """Field name -> message for every problem found. The engine's `prepare` is the one judge of a
        request; this only routes its message to the control it concerns."""
        problems: dict[str, str] = {}
        images = _image_paths(refs)
        if need_images and not images:
            problems["images"] = "Add 1 to 3 reference images to edit (or use the Text to image tab)."
        try:
            self.info.validate(build_request(prompt, images, settings, seed=0 if settings.random_seed else None))
        except RequestError as e:
            msg = str(e)
            problems.setdefault(field_of(msg), msg[:1].upper() + msg[1:])
        except (TypeError, ValueError) as e:     # a value of the wrong type sent through the API
            problems.setdefault("prompt", f"Invalid input: {e}")
        return problems

    def validator(self, names: tuple[str, ...], need_images: bool) -> Callable[..., list[dict]]:
        def validate(*values: Any) -> list[dict]:
            by_name = dict(zip(names, values))
            settings = Settings(*(by_name[n] for n in Settings.NAMES))
            problems = self.validation(by_name["prompt"], by_name.get("images"), settings, need_images)
            return [gr.validate(n not in problems, problems.get(n, "")) for n in names]
        return validate

    def advice(self, settings: Settings) -> list[str]:
        """Things worth knowing that do not stop the run (shown as warnings)."""
        out = []
        state = self.client.health().get("state")
        if state in ("loading", "restarting"):
            out.append("The engine is still loading the model; your request starts as soon as it is ready.")
        if not self.info.distil and isinstance(settings.guidance, (int, float)) and settings.guidance <= 1.0:
            out.append("Guidance ≤ 1 turns classifier-free guidance off: the image follows the prompt less.")
        if settings.system_prompt == "custom" and not (settings.custom_system_prompt or "").strip():
            out.append("The custom system prompt is empty, so the model runs without a system prompt.")
        return out

    # ---------------------------------------------------------------- running
    async def generate(self, prompt: str, refs: Any, settings: Settings) -> AsyncIterator[tuple]:
        try:
            for message in self.advice(settings):
                gr.Warning(message)
            req = build_request(prompt, _image_paths(refs), settings)
            async for update in run(self.client, req, self.out_dir):
                yield self.outputs(update)
        except EngineFailure as e:
            raise gr.Error(str(e), title="Generation failed", print_exception=False) from None
        except (gr.Error, asyncio.CancelledError, GeneratorExit):
            raise
        except Exception as e:  # noqa: BLE001 - a bug here must show as a message, not take the page down
            traceback.print_exc()
            raise gr.Error(f"The studio hit an internal error ({type(e).__name__}: {e}); the engine is fine, "
                           "please try again.", print_exception=False) from None

    @staticmethod
    def to_edit(result: str | None) -> tuple:
        """'Edit this result': the last image becomes the one reference of the edit tab, which opens
        (a conversation of edits, one instruction after another; the instruction box keeps its text)."""
        if not result:
            gr.Warning("Generate an image first: the result is what gets edited.")
            return gr.skip(), gr.skip()
        return [result], gr.Tabs(selected="ti2i")

    @staticmethod
    def remember(result: str | None, prompt: str, history: Any) -> Any:
        """The finished image at the front of this page's history (newest first, HISTORY_MAX kept)."""
        if not result:
            return gr.skip()
        caption = prompt if len(prompt) <= 60 else prompt[:59] + "…"
        return [(result, caption), *(history or [])][:HISTORY_MAX]

    @staticmethod
    def used_seed(timings: str | None) -> Any:
        """The seed box shows the seed the finished image used (a random one too): untick "Random seed"
        to draw it again."""
        seed = seed_in(timings)
        return gr.skip() if seed is None else seed

    @staticmethod
    def outputs(u: Update) -> tuple:
        """An Update as values for (status, preview, image, download, timings, reasoning)."""
        if u.reset:
            return (u.status or "", None, None, None, "", "")
        if u.final:
            return (u.status or "", u.preview, u.image,
                    u.image, u.timings or "", u.cot or "")
        skip = gr.skip()
        return (skip if u.status is None else u.status,
                skip if u.preview is None else u.preview,
                skip if u.image is None else u.image,
                skip if u.image is None else u.image,
                skip if u.timings is None else u.timings,
                skip if u.cot is None else u.cot)


def build_studio(client: EngineClient, info: ModelInfo, *, max_queue: int = 8, notice: str | None = None,
                 out_dir: str | Path | None = None, examples_dir: str | Path | None = None) -> gr.Blocks:
    """The studio page for `client` (an `engine.server.EngineServer` or anything with its API) serving
    the model described by `info`. Launch it with `launch(demo, ...)`."""
    out = Path(out_dir) if out_dir else Path(tempfile.gettempdir()) / "hunyuan-studio" / "outputs"
    ex_dir = Path(examples_dir) if examples_dir else Path(tempfile.gettempdir()) / "hunyuan-studio" / "examples"
    studio = Studio(client, info, out)
    gen = info.gen
    presets = preset_choices(info.presets)
    preset_default = gen.use_system_prompt if gen.use_system_prompt in info.presets else info.presets[0]

    with gr.Blocks(title=TITLE, delete_cache=(3600, 3600)) as demo:
        gr.Markdown(f"# {TITLE}")
        if notice:
            gr.Markdown(notice, elem_id="notice")
        health = gr.Markdown(health_text(client.health()), elem_id="engine-health")
        with gr.Row(equal_height=False):
            with gr.Column(scale=5):
                with gr.Tabs() as tabs:
                    with gr.Tab("Text to image", id="t2i"):
                        t2i_prompt = gr.Textbox(label="Prompt", lines=3, elem_id="prompt", max_length=8000,
                                                placeholder="Describe the image you want…")
                        with gr.Row():
                            t2i_run = gr.Button("Generate", variant="primary", elem_id="run")
                            t2i_stop = gr.Button("Stop", variant="stop", elem_id="stop")
                        gr.Examples([[p] for p in t2i_prompts(info.buckets)], inputs=[t2i_prompt], label="Example prompts")
                    with gr.Tab("Edit with reference images", id="ti2i"):
                        refs = gr.Gallery(label="Reference images (1 to 3)", type="filepath", interactive=True,
                                          file_types=["image"], columns=3, height=220, elem_id="refs")
                        ti2i_prompt = gr.Textbox(label="Instruction", lines=3, elem_id="ti2i-prompt", max_length=8000,
                                                 placeholder="What should change? e.g. “make the sky stormy”")
                        with gr.Row():
                            ti2i_run = gr.Button("Generate", variant="primary", elem_id="ti2i-run")
                            ti2i_stop = gr.Button("Stop", variant="stop", elem_id="ti2i-stop")
                        gr.Examples([[[str(p)], prompt] for p, prompt in reference_examples(ex_dir, is_small(info.buckets))],
                                    inputs=[refs, ti2i_prompt], label="Example edits")
                mode = gr.Radio(REASONING_MODES, value=default_mode(gen), label="Reasoning",
                                info="Think: the model reasons before drawing. Recaption: it also rewrites "
                                     "the prompt in detail. Both stream below.", elem_id="mode")
                size = gr.Dropdown(size_choices(info.buckets), value=AUTO_SIZE, label="Size (width × height)",
                                   elem_id="size")
                with gr.Row():
                    seed = gr.Number(value=0, precision=0, minimum=0, maximum=SEED_MAX, label="Seed", elem_id="seed")
                    random_seed = gr.Checkbox(value=True, label="Random seed", elem_id="random-seed")
                steps = gr.Slider(1, STEPS_MAX, value=min(gen.diff_infer_steps, STEPS_MAX), step=1,
                                  label="Steps", elem_id="steps")
                guidance = gr.Slider(0.0, GUIDANCE_MAX, value=min(gen.diff_guidance_scale, GUIDANCE_MAX), step=0.1,
                                     label="Guidance", elem_id="guidance",
                                     info="Distil checkpoints embed the guidance; others run classifier-free "
                                          "guidance when it is above 1.")
                with gr.Accordion("Advanced", open=False):
                    system_prompt = gr.Dropdown(presets, value=preset_default, label="System prompt preset",
                                                elem_id="system-prompt")
                    custom_system_prompt = gr.Textbox(value="", label="Custom system prompt (preset “custom text”)",
                                                      lines=3, elem_id="custom-system-prompt")
                    max_new_tokens = gr.Slider(1, MAX_NEW_TOKENS_MAX, value=min(gen.max_new_tokens, MAX_NEW_TOKENS_MAX),
                                               step=1, label="Max new tokens (reasoning length)",
                                               elem_id="max-new-tokens")
            with gr.Column(scale=6):
                with gr.Row(equal_height=True):
                    status = gr.Textbox(label="Status", interactive=False, elem_id="status", scale=3)
                    preview = gr.Image(label="Step preview", format="jpeg", height=160, interactive=False,
                                       elem_id="preview", scale=1, buttons=[])
                image = gr.Image(label="Result", type="filepath", format="png", interactive=False,
                                 elem_id="result", buttons=["download", "fullscreen"])
                with gr.Row():
                    download = gr.DownloadButton("Download PNG", elem_id="download")
                    edit_result = gr.Button("Edit this result", elem_id="edit-result")
                timings = gr.Markdown(label="Timings", elem_id="timings")
                cot = gr.Textbox(label="Reasoning (streamed)", lines=10, max_lines=20, interactive=False,
                                 autoscroll=True, elem_id="cot")
                history = gr.Gallery(label="Results of this page (newest first)", columns=6, height=150,
                                     interactive=False, elem_id="history", buttons=["download"])

        settings = [mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
                    max_new_tokens]
        outputs = [status, preview, image, download, timings, cot]
        t2i_names = ("prompt", *Settings.NAMES)
        ti2i_names = ("prompt", "images", *Settings.NAMES)

        async def t2i(prompt, mode, size, seed, random_seed, steps, guidance, system_prompt,
                      custom_system_prompt, max_new_tokens):
            s = Settings(mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
                         max_new_tokens)
            async for o in studio.generate(prompt, None, s):
                yield o

        async def ti2i(prompt, images, mode, size, seed, random_seed, steps, guidance, system_prompt,
                       custom_system_prompt, max_new_tokens):
            s = Settings(mode, size, seed, random_seed, steps, guidance, system_prompt, custom_system_prompt,
                         max_new_tokens)
            async for o in studio.generate(prompt, images, s):
                yield o

        common = dict(outputs=outputs, concurrency_id="engine", concurrency_limit=1, show_progress="full",
                      show_progress_on=[status])
        t2i_ev = t2i_run.click(t2i, [t2i_prompt, *settings], api_name="t2i",
                               validator=studio.validator(t2i_names, need_images=False), **common)
        ti2i_ev = ti2i_run.click(ti2i, [ti2i_prompt, refs, *settings], api_name="ti2i",
                                 validator=studio.validator(ti2i_names, need_images=True), **common)
        def stopped(current: str) -> Any:
            # a cancelled job yields nothing more, so the status is set here (unless nothing was running)
            return "Stopped." if current and not current.startswith(("Done", "Stopped")) else gr.skip()

        for stop in (t2i_stop, ti2i_stop):
            # cancel first, then write the status, so no update of the cancelled run can land after it
            stop.click(None, None, None, cancels=[t2i_ev, ti2i_ev], queue=False, api_visibility="private") \
                .then(stopped, status, status, queue=False, show_progress="hidden", api_visibility="private")

        for ev, prompt in ((t2i_ev, t2i_prompt), (ti2i_ev, ti2i_prompt)):
            # unqueued: bookkeeping after a run never waits behind (or is refused by) a full queue
            ev.success(studio.remember, [image, prompt, history], history, queue=False, api_visibility="private",
                       show_progress="hidden")
            ev.success(studio.used_seed, timings, seed, queue=False, api_visibility="private",
                       show_progress="hidden")
        edit_result.click(studio.to_edit, image, [refs, tabs], api_visibility="private",
                          show_progress="hidden")

        timer = gr.Timer(HEALTH_EVERY_S)
        timer.tick(lambda: health_text(client.health()), None, health, api_visibility="private", queue=False,
                   show_progress="hidden")

    demo.queue(max_size=max_queue, default_concurrency_limit=1)
    return demo


def launch(demo: gr.Blocks, *, host: str | None = None, port: int | None = None, share: bool = False,
           auth: tuple[str, str] | None = None, **kwargs: Any) -> tuple[Any, str, str | None]:
    """Launch with the studio's look. host/port None: Gradio's defaults and its GRADIO_SERVER_NAME /
    GRADIO_SERVER_PORT variables (what hosting platforms such as Spaces set)."""
    return demo.launch(server_name=host, server_port=port, share=share, auth=auth, theme=theme(), css=CSS,
                       footer_links=["api", "settings"], **kwargs)
