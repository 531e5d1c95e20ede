"""The edit tab's thread: one image edited turn after turn, as a conversation the engine holds.

Pure functions on an immutable `Thread`, no Gradio. A turn is shown (instruction, reasoning, image)
and recorded in the engine's conversation (`EngineServer.submit_turn`, docs/conversations.md) only once
it has made its image, so a stopped or failed turn leaves the thread as it was.

Invariant: the thread's first k turns are the first k turns of the conversation that holds its k-th turn
(a conversation only grows, and a branch copies a prefix). So the next instruction either continues the
conversation of the last turn or, after "Undo" / "Branch from here" cut the thread at turn k, branches
from turn k of the conversation that holds it: a new conversation, the old one unchanged.

A client without conversations (no `submit_turn`) gets no conversation: each instruction is then a single
edit of the last image (its first reference), as "Edit this result" chained edits before threads.
"""
from __future__ import annotations

from dataclasses import dataclass

from engine.runtime.request import MAX_IMAGES, MAX_TURNS


class ThreadError(ValueError):
    """An action the thread cannot take (the message is for the user)."""


@dataclass(frozen=True)
class ThreadTurn:
    instruction: str
    references: tuple[str, ...]      # the user's own reference images of this turn (paths)
    reasoning: str                   # as the page streamed it
    image: str                       # path of the PNG the turn made
    conversation: str | None         # the engine conversation holding it (None: a client without them)


@dataclass(frozen=True)
class Thread:
    turns: tuple[ThreadTurn, ...] = ()
    cut: bool = False                # the thread ends before its conversation does: the next turn branches

    def submit_args(self) -> tuple[str | None, int | None]:
        """(conversation, branch_from_turn) of the next instruction, for `submit_turn`: none for a fresh
        thread (it starts a conversation), the last turn's conversation to continue, plus the thread's
        length to branch once it was cut."""
        if not self.turns:
            return None, None
        return self.turns[-1].conversation, (len(self.turns) if self.cut else None)

    def images_for(self, references: list[str], conversations: bool) -> list[str]:
        """The next request's reference images. With conversations, the user's own (the engine adds the
        history); without, the last image first, then the user's (a single edit of the last image)."""
        if conversations or not self.turns:
            return list(references)
        return [self.turns[-1].image, *references]


def check_next(thread: Thread, references: list[str], conversations: bool) -> tuple[str, str] | None:
    """What stops the next instruction: (the control at fault, 'images' or 'prompt'; a message), or None."""
    if not thread.turns:
        if not references:
            return "images", "Add 1 to 3 reference images to start the thread (or use the Text to image tab)."
        return None
    if len(thread.turns) >= MAX_TURNS:
        return "prompt", (f"This thread has {MAX_TURNS} turns, as many as a conversation keeps: "
                          "branch from an earlier turn or start over.")
    if not conversations and len(references) + 1 > MAX_IMAGES:
        return "images", (f"Each instruction edits the last image, so at most {MAX_IMAGES - 1} more reference "
                          f"images fit (got {len(references)}).")
    return None


def continued(thread: Thread, turn: ThreadTurn) -> Thread:
    """The thread after a turn made its image."""
    return Thread(thread.turns + (turn,))


def branched(thread: Thread, k: int) -> Thread:
    """'Branch from here' on turn k (1-based): the turns after it leave the thread; the next instruction
    continues from turn k in a new conversation (the old one keeps every turn)."""
    if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= len(thread.turns):
        raise ThreadError(f"there is no turn {k!r} to branch from (the thread has {len(thread.turns)})")
    return Thread(thread.turns[:k], cut=True)


def undone(thread: Thread) -> tuple[Thread, ThreadTurn]:
    """'Undo': the thread without its last turn (a branch from the turn before it; from the first turn,
    a fresh thread), and the turn taken back, whose instruction and references go back in their boxes to
    be changed and sent again."""
    if not thread.turns:
        raise ThreadError("there is no turn to undo")
    last = thread.turns[-1]
    return (branched(thread, len(thread.turns) - 1) if len(thread.turns) > 1 else Thread()), last


def started(image: str | None = None) -> tuple[Thread, list[str]]:
    """'Start over' (no image) or 'Edit this result' (the image): a fresh thread, and the reference
    images it starts with."""
    return Thread(), [image] if image else []
