"""Conversations: multi-turn editing as a list of turns, held by the server under an id.

A conversation is its turns, oldest first (history.Turn: the user's instruction and reference images,
the model's reasoning and image). A new turn is an ordinary Request whose `history` is the
conversation's turns; the history policy (engine/runtime/history.py) decides, where the request is
prepared, what the model sees of them. A turn is added only once it has made its image
(`TurnRecorder`), so a refused, failed or cancelled turn leaves the conversation as it was.

Branching from turn k (1-based: after the model's k-th answer; 0: before the first) is a new
conversation holding the first k turns; the original is unchanged, so "undo", "try again" and "branch
from here" are all a branch. Turns are immutable and shared between a conversation and its branches.

The store is bounded: at most `max_conversations` and about `max_bytes` of images held, the least
recently used conversation dropped first; one conversation keeps its last `history.MAX_TURNS` turns.
"""
from __future__ import annotations

import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field

from PIL import Image as PILImage

from engine.runtime.events import Done, Event, Image
from engine.runtime.history import MAX_TURNS, Turn, reasoning_of
from engine.runtime.request import Request

MAX_CONVERSATIONS = 256
MAX_BYTES = 1 << 30               # images held by all conversations together (encoded size; PIL: RGB size)


class ConversationError(LookupError):
    """An unknown (or dropped) conversation id, or a turn it does not have; `field` names the request
    field at fault."""

    def __init__(self, message: str, field: str = "conversation_id"):
        super().__init__(message)
        self.field = field


def _image_bytes(img: object) -> int:
    if isinstance(img, (bytes, bytearray)):
        return len(img)
    if isinstance(img, PILImage.Image):
        return img.width * img.height * 3
    return 0                       # a path: read when the turn is prepared, nothing held here


def turn_bytes(turn: Turn) -> int:
    return sum(_image_bytes(i) for i in turn.images) + _image_bytes(turn.image)


@dataclass
class Conversation:
    id: str
    turns: list[Turn] = field(default_factory=list)
    parent: tuple[str, int] | None = None        # (conversation id, turns taken) when it is a branch

    @property
    def nbytes(self) -> int:
        return sum(turn_bytes(t) for t in self.turns)


class ConversationStore:
    """The server's conversations by id, least recently used dropped first. Thread-safe."""

    def __init__(self, max_conversations: int = MAX_CONVERSATIONS, max_bytes: int = MAX_BYTES):
        if max_conversations < 1 or max_bytes < 1:
            raise ValueError(f"a conversation store holds at least one conversation and one byte "
                             f"(got {max_conversations}, {max_bytes})")
        self.max_conversations, self.max_bytes = max_conversations, max_bytes
        self._lock = threading.Lock()
        self._items: OrderedDict[str, Conversation] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def nbytes(self) -> int:
        """Images held, counted once per distinct turn (branches share theirs)."""
        with self._lock:
            return sum(turn_bytes(t) for t in {id(t): t for c in self._items.values() for t in c.turns}.values())

    def _evict(self, keep: str) -> None:
        """Drop the least recently used conversations (never `keep`, the one just touched) until the
        store is within its bounds."""
        total = sum(c.nbytes for c in self._items.values())
        while len(self._items) > 1 and (len(self._items) > self.max_conversations or total > self.max_bytes):
            oldest = next(iter(self._items))
            if oldest == keep:
                self._items.move_to_end(keep)
                continue
            total -= self._items.pop(oldest).nbytes

    def create(self, turns: tuple[Turn, ...] = (), parent: tuple[str, int] | None = None) -> Conversation:
        conv = Conversation(f"conv_{uuid.uuid4().hex[:16]}", list(turns)[-MAX_TURNS:], parent)
        with self._lock:
            self._items[conv.id] = conv
            self._evict(conv.id)
        return conv

    def get(self, conv_id: object) -> Conversation:
        with self._lock:
            conv = self._items.get(conv_id) if isinstance(conv_id, str) else None
            if conv is None:
                raise ConversationError(f"no conversation {conv_id!r} on this server (unknown, or dropped as the "
                                        f"least recently used; the server keeps {self.max_conversations})")
            self._items.move_to_end(conv_id)
            return conv

    def turns_until(self, conv_id: object, turn: object = None) -> tuple[Turn, ...]:
        """The first `turn` turns of a conversation (None: all of them): the history of a turn that
        continues it (None) or branches from it."""
        conv = self.get(conv_id)
        turns = tuple(conv.turns)
        if turn is None:
            return turns
        if isinstance(turn, bool) or not isinstance(turn, int) or not 0 <= turn <= len(turns):
            raise ConversationError(f"conversation {conv.id} has {len(turns)} turns: branch from a turn from 0 to "
                                    f"{len(turns)} (got {turn!r})", "branch_from_turn")
        return turns[:turn]

    def discard(self, conv_id: str) -> None:
        with self._lock:
            self._items.pop(conv_id, None)

    def record(self, conv_id: str, turn: Turn) -> int:
        """Add a finished turn to a conversation still held: its number (1-based); 0 if it was dropped."""
        with self._lock:
            conv = self._items.get(conv_id)
            if conv is None:
                return 0
            conv.turns.append(turn)
            del conv.turns[:-MAX_TURNS]
            self._items.move_to_end(conv_id)
            self._evict(conv_id)
            return len(conv.turns)


class TurnRecorder:
    """Watches one request's events and, when it ends with its image, adds its turn (instruction,
    references, the reasoning the image phase read, the first image) to the conversation. The server
    calls `see` with each event before its client gets it, so the turn is recorded before a client
    that saw `Done` can send the next one. `bot_task`: the request's, resolved (Prepared.bot_task)."""

    def __init__(self, store: ConversationStore, conv_id: str, request: Request, bot_task: str):
        self.store, self.conv_id, self.request, self.bot_task = store, conv_id, request, bot_task
        self.image: bytes | None = None

    def see(self, ev: Event) -> None:
        if isinstance(ev, Image) and ev.index == 0:
            self.image = ev.png
        elif isinstance(ev, Done) and self.image is not None:
            self.store.record(self.conv_id, Turn(self.request.prompt, tuple(self.request.images),
                                                 reasoning_of(self.bot_task, ev.cot_text), self.image))
