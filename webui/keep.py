"""What a page keeps in its browser across reloads: its history strip, its edit thread and its settings (Gradio
BrowserState, encrypted with a secret that lasts as long as the server's results). The images stay on the
server (engine.serve.results); the browser keeps their ids, so an image the server no longer keeps (evicted,
or a server started again without `--results-dir`) leaves the history at the next load. Pure functions, no
Gradio."""
from __future__ import annotations

from typing import Any

from engine.serve.results import ResultStore

from .options import REASONING_MODES
from .thread import Thread, ThreadTurn

HISTORY_MAX = 24          # results kept in a page's history strip (and its browser)
CAPTION_PROMPT_CHARS = 48
MODE_LABELS = {value: label for label, value in REASONING_MODES}


def caption(record: dict[str, Any]) -> str:
    """A history tile's caption, so that runs of one prompt can be told apart: what it was (an edit), the
    reasoning mode, the seed, the steps, then the prompt (cut)."""
    prompt = " ".join(str(record.get("prompt") or "").split())
    if len(prompt) > CAPTION_PROMPT_CHARS:
        prompt = prompt[:CAPTION_PROMPT_CHARS - 1] + "…"
    mode = MODE_LABELS.get(record.get("mode"), record.get("mode") or "?")
    what = "Edit · " if record.get("references") else ""
    return f"{what}{mode} · seed {record.get('seed')} · {record.get('steps')} steps — {prompt}"


def remembered(saved: Any, rid: str, text: str) -> list[dict[str, str]]:
    """The browser's history with a new result at its front (newest first, HISTORY_MAX kept)."""
    return [{"id": rid, "caption": text}, *entries(saved)][:HISTORY_MAX]


def entries(saved: Any) -> list[dict[str, str]]:
    """The well-formed entries of a stored history (what a browser sends back may be anything)."""
    if not isinstance(saved, list):
        return []
    return [{"id": e["id"], "caption": e["caption"]} for e in saved
            if isinstance(e, dict) and isinstance(e.get("id"), str) and isinstance(e.get("caption"), str)][:HISTORY_MAX]


def history_strip(saved: Any, results: ResultStore) -> tuple[list[tuple[str, str]], list[dict[str, str]]]:
    """(the strip's items, the entries kept) of a stored history: those whose image the server still keeps."""
    kept = [e for e in entries(saved) if results.path(e["id"]) is not None]
    return [(str(results.path(e["id"])), e["caption"]) for e in kept], kept


def kept_thread(thread: Thread, results: ResultStore) -> dict[str, Any]:
    """The edit thread as the browser keeps it: each turn's instruction, reasoning, image (by id) and engine
    conversation. The turns' own reference images were uploads, which the server does not keep: a restored
    turn has none (Undo then gives back its instruction alone)."""
    turns = []
    for t in thread.turns:
        rid = results.id_of(t.image)
        if rid is None:                  # an image no longer kept ends what can be restored
            break
        turns.append({"instruction": t.instruction, "reasoning": t.reasoning, "image": rid,
                      "conversation": t.conversation})
    return {"turns": turns, "cut": thread.cut or len(turns) < len(thread.turns)}


def restored_thread(saved: Any, results: ResultStore) -> Thread:
    """The thread of a stored one, as far as its images are still kept (a gap would break the invariant that
    the turns are a prefix of one conversation: what follows it is dropped, and the thread is then cut)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("turns"), list):
        return Thread()
    turns = []
    for t in saved["turns"]:
        if not isinstance(t, dict):
            break
        path = results.path(t.get("image"))
        text, reasoning, conversation = t.get("instruction"), t.get("reasoning"), t.get("conversation")
        if path is None or not isinstance(text, str) or not isinstance(reasoning, str) or \
                not (conversation is None or isinstance(conversation, str)):
            break
        turns.append(ThreadTurn(text, (), reasoning, str(path), conversation))
    cut = bool(saved.get("cut")) or len(turns) < len(saved["turns"])
    return Thread(tuple(turns), cut=cut and bool(turns))
