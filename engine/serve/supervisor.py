"""Engine supervision as bookkeeping on a clock: when a crashed engine is started again, how long to wait
first, when to give up, and when running work has stalled. No processes and no threads here: the
server's pump thread asks these two objects and acts (kills, spawns, fails a request), so the policy is
tested without an engine and survives changes to how requests are dispatched.

- `Restarts`: every crash schedules a new start. The first attempt after a stable run starts at once,
  the ones after it wait 1, 2, 4 ... 30 s (a crash loop must not spin the machine or flood the log).
  The engine is declared failed only when the model itself cannot load: the worker reported a load
  error (the server handles that message), or the workers died LOAD_DEATHS_LIMIT times in a row while
  loading without ever becoming ready (an out-of-memory kill at every load is "cannot load here").
  `reset()` is the way back from failed without restarting the process (the page's and the API's
  reload).
- `StallWatch`: while the engine has work, some event (a token, a step, an image) must arrive within a
  limit: `--step-timeout` when given, else STALL_FACTOR times the engine's own running figure, never
  under STALL_FLOOR_S nor over STALL_CEILING_S. The first request of each engine start gets the ceiling,
  since it may capture graphs or compile kernels. The figure is the slowest recent request's pace: each
  completed request adds its second-longest gap between events, so one long gap (a one-off cost: the
  first request's compile, a capture; or a stall the watch missed, shorter than the limit) never enters
  it, and at most STALL_GROWTH times the figure before it, so a few missed stalls in a row cannot teach
  the watch to wait minutes. A request the engine has not read from its pipe counts too (`send_limit`).
  A SIGSTOPped worker, a deadlocked collective or a hung kernel all look the same from here: silence.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass

BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0)   # wait before start attempt 1, 2, 3, ... (then 30 s)
STABLE_S = 60.0            # ready this long: the next crash counts as a first attempt again
LOAD_DEATHS_LIMIT = 5      # deaths in a row while loading, never ready in between: the model cannot load
STALL_FLOOR_S = 10.0       # the automatic stall limit is never below this,
STALL_CEILING_S = 120.0    # nor above this, the first request's after each start (graph captures, compiles)
STALL_FACTOR = 20.0        # between them: this many times the longest gap of recent requests
STALL_GROWTH = 2.0         # a request's gap counts at most this many times the figure before it
FIGURE_REQUESTS = 8        # the running figure is the longest gap over this many recent requests


@dataclass(frozen=True)
class Decision:
    """What to do after a crash: start again after `delay_s` (attempt `attempt`), or give up (`failed`:
    the reason, for /health and the page)."""
    attempt: int
    delay_s: float
    failed: str | None = None


class Restarts:
    """Start attempts, backoff and the give-up rule of one engine (times are the caller's clock)."""

    def __init__(self) -> None:
        self.attempt = 0                  # start attempts since the engine was last stable (0: stable)
        self.total = 0                    # restarts over the server's life
        self.load_deaths = 0              # deaths while loading since the engine was last ready
        self.spawn_at: float | None = None    # when the scheduled start is due; None: none scheduled
        self._ready_at: float | None = None

    def crashed(self, now: float, while_loading: bool, why: str) -> Decision:
        """The engine died or was killed (`why`): schedule the next start, or say it cannot load."""
        self.total += 1
        if while_loading:
            self.load_deaths += 1
            if self.load_deaths >= LOAD_DEATHS_LIMIT:
                self.spawn_at = None
                return Decision(self.attempt, 0.0, f"the engine died {self.load_deaths} times in a row while "
                                                   f"loading the model (last: {why})")
        stable = self._ready_at is not None and now - self._ready_at >= STABLE_S
        self.attempt = 1 if stable or self.attempt == 0 else self.attempt + 1
        self._ready_at = None
        delay = BACKOFF_S[min(self.attempt - 1, len(BACKOFF_S) - 1)]
        self.spawn_at = now + delay
        return Decision(self.attempt, delay)

    def ready(self, now: float) -> None:
        """The engine holds the model and takes requests."""
        self.load_deaths = 0
        self._ready_at = now

    def due(self, now: float) -> bool:
        return self.spawn_at is not None and now >= self.spawn_at

    def spawned(self) -> None:
        self.spawn_at = None

    def reset(self, now: float) -> None:
        """Start over (a reload asked for by a person): attempt 1, at once."""
        self.attempt, self.load_deaths, self._ready_at = 1, 0, None
        self.spawn_at = now


class StallWatch:
    """Whether the engine's running work still makes progress. `start` when it gets work, `progress` at
    every event, `completed` when a request finished normally (its longest gap joins the running
    figure), `stop` when it holds no work; `overdue` says why it must be restarted, or None. With several
    requests running, a request's gap is the longest between any two events since the last completion."""

    def __init__(self, step_timeout: float | None = None):
        if step_timeout is not None and step_timeout < 0:
            raise ValueError(f"step_timeout must be >= 0 seconds (0: off), got {step_timeout}")
        self.step_timeout = step_timeout
        self._gaps: collections.deque[float] = collections.deque(maxlen=FIGURE_REQUESTS)
        self._last: float | None = None      # time of the last event of the running work (None: idle)
        self._longest = [0.0, 0.0]            # the two longest gaps since the last completion, longest first
        self._first = True                    # no request completed since the engine (re)started

    def new_engine(self) -> None:
        """A fresh engine start: its first request may compile and capture, so it gets the ceiling."""
        self._first, self._last = True, None

    def start(self, now: float) -> None:
        self._last, self._longest = now, [0.0, 0.0]

    def progress(self, now: float) -> None:
        if self._last is not None:
            self._longest = sorted([*self._longest, now - self._last], reverse=True)[:2]
            self._last = now

    def completed(self, now: float) -> None:
        """A request ended with its result: its pace, the second-longest gap, joins the figure (at most
        STALL_GROWTH times the figure before it)."""
        self.progress(now)
        pace = self._longest[1]
        self._gaps.append(pace if self.figure is None else min(pace, STALL_GROWTH * self.figure))
        self._first, self._longest = False, [0.0, 0.0]

    def stop(self) -> None:
        self._last = None

    @property
    def figure(self) -> float | None:
        """The engine's running figure: the slowest pace of its recent requests (s)."""
        return max(self._gaps) if self._gaps else None

    def limit(self) -> float | None:
        """Seconds the running work may go without an event (None: no limit)."""
        if self.step_timeout is not None:
            return self.step_timeout or None
        if self._first or self.figure is None:
            return STALL_CEILING_S
        return min(STALL_CEILING_S, max(STALL_FLOOR_S, STALL_FACTOR * self.figure))

    def send_limit(self) -> float | None:
        """Seconds a message to the engine may wait unread in its pipe. Its worker reads the pipe in a thread
        of its own whatever the engine is doing, so a message left there longer means the process is not
        running (stopped, swapped out, hung outside Python): the floor, or the limit if it is lower."""
        limit = self.limit()
        return None if limit is None else min(limit, STALL_FLOOR_S)

    def deadline(self, sending_since: float | None = None) -> float | None:
        """When the running work is overdue: no event for the limit, or (`sending_since`: when the message
        the engine has not read yet was sent) a message unread for `send_limit`."""
        limit, send_limit = self.limit(), self.send_limit()
        times = [] if self._last is None or limit is None else [self._last + limit]
        if sending_since is not None and send_limit is not None:
            times.append(sending_since + send_limit)
        return min(times, default=None)

    def overdue(self, now: float, sending_since: float | None = None) -> str | None:
        """Why the running work counts as stalled (for the client's message), or None."""
        deadline = self.deadline(sending_since)
        if deadline is None or now < deadline:
            return None
        unread = None if sending_since is None else (f"it has not read the request sent {now - sending_since:.0f} s "
                                                     "ago: its process is not running, stopped or hung outside Python")
        if self._last is None or now < self._last + (self.limit() or 0):      # overdue by the unread request
            return f"the engine made no progress ({unread}; the limit for a request unread is {self.send_limit():g} s)"
        limit = self.limit()
        if self.step_timeout:
            basis = f"the limit set by --step-timeout is {limit:g} s"
        elif self._first or self.figure is None:
            basis = f"the limit for the first request after the engine starts is {limit:g} s"
        else:
            basis = f"its slowest token or step of late took {self.figure:.2f} s; the limit is {limit:.0f} s"
        return f"the engine made no progress for {now - self._last:.0f} s ({basis}{'; ' + unread if unread else ''})"
