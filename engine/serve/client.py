"""The client side of the engine: what every front end calls (`EngineClient`, served by one engine server or
by engine replicas), and one submitted request's events, in order, for sync and async consumers
(`Submission`)."""
from __future__ import annotations

import asyncio
import collections
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterator, Protocol, Self

from engine.runtime.events import Done, Error, Event
from engine.runtime.request import Prepared, Request

if TYPE_CHECKING:
    from engine.serve.conversation import ConversationStore, TurnRecorder
    from engine.serve.info import ModelInfo


class Submission:
    """The events of one submitted request, in order, ending with `Done` or `Error`.

    Iterate it with `async for` (in any event loop) or plain `for`; or poll with `get`/`aget`, which
    return None on timeout without losing anything. Leaving an `async for`/`for` loop early cancels the
    request on the engine (a closed browser tab must not keep the GPUs busy).
    """

    def __init__(self, request: Request, cancel: Callable[[str], bool]):
        self.request = request
        self.request_id = request.request_id
        self.conversation_id: str | None = None      # EngineServer.submit_turn: the conversation of this turn
        self._cancel = cancel
        self._items: collections.deque[Event] = collections.deque()
        self._cond = threading.Condition()
        self._waiter: tuple[asyncio.AbstractEventLoop, asyncio.Future] | None = None
        self._ended = False       # a terminal event was pushed; later pushes are dropped
        self._consumed = False    # the consumer has taken the terminal event

    @classmethod
    def refused(cls, request: Request, error: Error, cancel: Callable[[str], bool]) -> Submission:
        """A request that ends at once with `error` (bad input, a full queue, an engine down)."""
        sub = cls(request, cancel)
        sub.push(error)
        return sub

    # -- producer side (server threads)
    def push(self, ev: Event) -> bool:
        """Add the next event (False: the stream has ended; a later event is dropped)."""
        with self._cond:
            if self._ended:
                return False
            self._items.append(ev)
            self._ended = isinstance(ev, (Done, Error))
            self._cond.notify_all()
            waiter, self._waiter = self._waiter, None
        if waiter is not None:
            loop, fut = waiter
            try:
                loop.call_soon_threadsafe(_wake, fut)
            except RuntimeError:        # the consumer's loop is closed: nobody is listening any more
                pass
        return True

    @property
    def ended(self) -> bool:
        """True once the request's final event (Done or Error) has been produced."""
        return self._ended

    def cancel(self) -> bool:
        return self._cancel(self.request_id)

    # -- consumer side
    def _pop(self) -> Event | None:
        ev = self._items.popleft() if self._items else None
        if ev is not None and isinstance(ev, (Done, Error)):
            self._consumed = True
        return ev

    def get(self, timeout: float | None = None) -> Event | None:
        """The next event, or None when `timeout` seconds pass first (or the stream is exhausted)."""
        with self._cond:
            if not self._items and not self._consumed:
                self._cond.wait_for(lambda: bool(self._items), timeout)
            return self._pop()

    async def aget(self, timeout: float | None = None) -> Event | None:
        """Async `get`: waits without blocking the event loop; a timeout loses no event."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            with self._cond:
                if self._items or self._consumed:
                    return self._pop()
                fut = loop.create_future()
                self._waiter = (loop, fut)
            remaining = None if deadline is None else deadline - loop.time()
            if remaining is not None and remaining <= 0:
                return None
            # asyncio.wait, not wait_for: Python 3.11's wait_for returns the result when the future completes
            # in the same tick as a cancel of this task, so the cancel is lost (a replica's generator cancelled
            # by a closed client then streamed its request to the end).
            try:
                done, _ = await asyncio.wait((fut,), timeout=remaining)
            finally:
                with self._cond:
                    if self._waiter is not None and self._waiter[1] is fut:
                        self._waiter = None
            if not done:
                with self._cond:
                    if not self._items:
                        return None

    def __iter__(self) -> Iterator[Event]:
        try:
            while not self._consumed:
                ev = self.get()
                if ev is not None:
                    yield ev
        finally:
            if not self._ended:
                self.cancel()

    def __aiter__(self) -> AsyncIterator[Event]:
        return self._aiter()

    async def _aiter(self) -> AsyncIterator[Event]:
        try:
            while not self._consumed:
                ev = await self.aget()
                if ev is not None:
                    yield ev
        finally:                 # the consumer left early (Stop, disconnect, exception): free the engine
            if not self._ended:
                self.cancel()


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


class EngineClient(Protocol):
    """The engine as every front end sees it (the studio, /v1, the command line, the benchmarks): one engine
    (engine/serve/server.py `EngineServer`) or replicas of it (engine/serve/replicas.py `ReplicaPool`), which
    both declare it."""
    info: ModelInfo
    conversations: ConversationStore           # the conversations whose turns `submit_turn` continues
    model: str
    device: str
    plan: str
    world_size: int
    max_batch: int
    max_queue: int | None

    def submit(self, request: Request, recorder: Callable[[Request, Prepared], TurnRecorder] | None = None
               ) -> Submission: ...
    def submit_turn(self, request: Request, conversation: str | None = None,
                    branch_from_turn: int | None = None) -> Submission: ...
    def stream(self, request: Request) -> Iterator[Event]: ...
    def cancel(self, request_id: str) -> bool: ...
    def position(self, request_id: str) -> int | None: ...
    def health(self) -> dict[str, Any]: ...
    def adapters(self) -> list[str]: ...
    def merged_adapter(self) -> str | None: ...
    def load_adapter(self, name: str, folder: str | Path) -> None: ...
    def unload_adapter(self, name: str) -> None: ...
    def reload(self) -> bool: ...
    def wait_ready(self, timeout: float | None = None) -> bool: ...
    def close(self) -> None: ...
    def __enter__(self) -> Self: ...
    def __exit__(self, *exc: object) -> None: ...
