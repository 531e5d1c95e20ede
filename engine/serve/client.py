"""The client side of one submitted request: its events, in order, for sync and async consumers."""
from __future__ import annotations

import asyncio
import collections
import threading
from typing import AsyncIterator, Callable, Iterator

from engine.runtime.events import Done, Error, Event
from engine.runtime.request import Request


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

    # -- producer side (server threads)
    def _push(self, ev: Event) -> bool:
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
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                with self._cond:
                    if self._waiter is not None and self._waiter[1] is fut:
                        self._waiter = None
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
