"""The edit tab's thread drawn on the page: each turn (instruction, reasoning, image with its download,
"Branch from here"), oldest first, then Undo and Start over. The state and its rules are webui/thread.py;
this module only draws them and wires the buttons."""
from __future__ import annotations

import html
from typing import Any

import gradio as gr

from .thread import Thread, ThreadError, branched, started, undone

TURN_IMAGE_HEIGHT = 120
# A client without conversations (no `submit_turn`: EngineServer and ReplicaPool both have it).
NO_CONVERSATIONS = ("This studio's engine client holds no conversations: each instruction edits the last "
                    "image alone (the model does not see the earlier turns).")
HINT = ("Each result stays here as a turn: the next instruction edits its image (the model sees the last image, "
        "not the earlier turns' words: that edited best when measured).")


# Every event that sets the thread is queued (never limited, so never behind a run): in Gradio 6.31 a
# State set by an unqueued event does not fire its change, so the thread would not be drawn again.
QUEUED = dict(concurrency_limit=None, api_visibility="private", show_progress="hidden")


def branch_at(k: int):
    def branch(thread: Thread) -> Any:
        try:
            return branched(thread, k)
        except ThreadError as e:       # a stale page (the thread changed in another event): say so
            gr.Warning(str(e))
            return gr.skip()
    return branch


def undo(thread: Thread) -> tuple:
    """Undo: the thread without its last turn; that turn's instruction and references back in their boxes."""
    try:
        rest, last = undone(thread)
    except ThreadError as e:
        gr.Warning(str(e))
        return gr.skip(), gr.skip(), gr.skip()
    return rest, list(last.references), last.instruction


def start_over() -> tuple:
    """Start over: a fresh thread, no references."""
    thread, refs = started()
    return thread, refs


def _turn(k: int, t: Any, thread: gr.State) -> None:
    with gr.Row(elem_id=f"turn-{k}", elem_classes="turn", equal_height=False):
        gr.Image(t.image, show_label=False, interactive=False, container=False, height=TURN_IMAGE_HEIGHT,
                 buttons=[], elem_classes="turn-image", scale=1, min_width=90)
        with gr.Column(scale=3, min_width=160):
            refs = f" <span class='turn-refs'>(+{len(t.references)} reference image" \
                   f"{'s' if len(t.references) != 1 else ''})</span>" if t.references else ""
            gr.HTML(f"<b>{k}.</b> <span class='turn-instruction'>{html.escape(t.instruction)}</span>{refs}",
                    elem_classes="turn-text")
            with gr.Accordion("Reasoning", open=False, elem_classes="turn-reasoning"):
                gr.Textbox(t.reasoning or "(no reasoning: reasoning was off)", show_label=False, lines=2,
                           max_lines=10, interactive=False)
            with gr.Row():
                gr.DownloadButton("Download", value=t.image, size="sm", elem_classes="turn-download")
                branch = gr.Button("Branch from here", size="sm", elem_classes="turn-branch")
    branch.click(branch_at(k), thread, thread, **QUEUED)


def thread_panel(thread: gr.State, refs: gr.Gallery, instruction: gr.Textbox, conversations: bool) -> None:
    """Draw `thread` where this is called, redrawn whenever it changes. Undo and Start over also set
    the reference images and the instruction (`refs`, `instruction`: the tab's boxes)."""
    if not conversations:
        gr.Markdown(NO_CONVERSATIONS, elem_id="thread-note")

    @gr.render(inputs=thread)
    def draw(current: Thread) -> None:
        if not current.turns:
            return
        gr.Markdown(HINT, elem_classes="thread-hint")
        for k, t in enumerate(current.turns, 1):
            _turn(k, t, thread)
        if current.cut:
            gr.Markdown(f"The next instruction continues from turn {len(current.turns)}, as a new branch "
                        "(the turns after it stay in the page's history).", elem_id="thread-cut")
        with gr.Row():
            undo_button = gr.Button("Undo", size="sm", elem_id="thread-undo")
            over_button = gr.Button("Start over", size="sm", elem_id="thread-start-over")
        undo_button.click(undo, thread, [thread, refs, instruction], **QUEUED)
        over_button.click(start_over, None, [thread, refs], **QUEUED)
