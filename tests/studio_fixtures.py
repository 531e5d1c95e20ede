"""Fixtures and helpers shared by the server, studio and browser tests (imported by those modules;
pytest only auto-loads conftest.py). Everything runs on a real tiny checkpoint (`tiny_dir`)."""
from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Union

os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")   # no calls home from tests

import pytest

from engine.runtime.events import Done, Error, Event
from engine.runtime.request import Request
from engine.serve.engine_config import EngineConfig
from engine.serve.server import EngineServer

READY_TIMEOUT_S = 180
# Small enough for a 2-core CI machine: a request takes about a second on the tiny checkpoint.
FAST = dict(mode="think", size="256:192", seed=1, random_seed=False, steps=2, guidance=5.0,
            system_prompt="en_unified", custom_system_prompt="", max_new_tokens=8)
SETTINGS_ORDER = ("mode", "size", "seed", "random_seed", "steps", "guidance", "system_prompt",
                  "custom_system_prompt", "max_new_tokens")


def settings(**over: Any) -> list[Any]:
    """The shared settings in API order, FAST unless overridden."""
    s = {**FAST, **over}
    return [s[k] for k in SETTINGS_ORDER]


def fast_request(prompt: str = "a red circle", **over: Any) -> Request:
    kw = dict(bot_task="think", size="256:192", steps=2, guidance=5.0, seed=1, max_new_tokens=8)
    kw.update(over)
    return Request(prompt=prompt, **kw)


def final(events: list[Event]) -> Event:
    assert events, "no events"
    assert isinstance(events[-1], (Done, Error)), events[-1]
    return events[-1]


def wait_for(cond, timeout: float = 30.0, every: float = 0.02) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not met in time")
        time.sleep(every)


class CountingClient:
    """Wraps the engine server and records what reached it, to prove validation happens before queueing."""

    def __init__(self, server: EngineServer):
        self.server = server
        self.submitted: list[Request] = []
        self.turns: list[tuple[str | None, int | None]] = []   # submit_turn's (conversation, branch_from_turn)

    def submit(self, request: Request):
        self.submitted.append(request)
        return self.server.submit(request)

    def submit_turn(self, request: Request, conversation: str | None = None, branch_from_turn: int | None = None):
        self.submitted.append(request)
        self.turns.append((conversation, branch_from_turn))
        return self.server.submit_turn(request, conversation, branch_from_turn)

    def cancel(self, request_id: str) -> bool:
        return self.server.cancel(request_id)

    def health(self) -> dict[str, Any]:
        return self.server.health()

    def reload(self) -> bool:
        return self.server.reload()


class ScriptedSubmission:
    """A submission that plays a list of engine events (what the engine server's submission gives)."""

    def __init__(self, events):
        self.events, self.ended = list(events), False

    async def aget(self, timeout=None):
        return self.get()

    def get(self, timeout=None):
        if not self.events:
            return None
        ev = self.events.pop(0)
        self.ended = isinstance(ev, (Done, Error))
        return ev


class ScriptedClient:
    """An engine client that plays scripted events: the same list for every request, or `events(request)`'s."""

    def __init__(self, events: Union[list[Event], Callable[[Request], list[Event]]]):
        self.events, self.cancelled = events, []
        self.submitted: list[Request] = []

    def submit(self, request):
        self.submitted.append(request)
        return ScriptedSubmission(self.events(request) if callable(self.events) else self.events)

    def cancel(self, request_id):
        self.cancelled.append(request_id)
        return True

    def health(self):
        return {"state": "ready", "model_name": "scripted", "device": "cpu"}

    def reload(self):
        return False


SERVER_OPTIONS = ("max_queue", "step_timeout", "cancel_grace_s")      # EngineServer's own; the rest: EngineConfig's


def start_server(model: Path, **kw: Any) -> EngineServer:
    """An engine server on `model` with `kw` (EngineConfig's fields and EngineServer's options), ready."""
    options = {k: kw.pop(k) for k in SERVER_OPTIONS if k in kw}
    server = EngineServer(EngineConfig(model, **kw), **options)
    if not server.wait_ready(READY_TIMEOUT_S):
        server.close()
        pytest.fail(f"engine did not become ready: {server.health()}")
    return server


@pytest.fixture(scope="module")
def engine_server(tiny_dir):
    server = start_server(tiny_dir)
    yield server
    server.close()


def launch_studio(server: EngineServer, tmp_path_factory, **kw: Any) -> tuple[str, CountingClient, Any]:
    """(url, counting client, demo) of a studio on `server`, launched in this process on a free port."""
    from webui.studio import build_studio, launch
    client = CountingClient(server)
    demo = build_studio(client, server.info, out_dir=tmp_path_factory.mktemp("out"),
                        examples_dir=tmp_path_factory.mktemp("examples"))
    _, url, _ = launch(demo, host="127.0.0.1", prevent_thread_lock=True, quiet=True, **kw)
    return url, client, demo


@pytest.fixture(scope="module")
def studio(engine_server, tmp_path_factory):
    """(url, counting client, demo) of a studio launched in this process on a free port."""
    url, client, demo = launch_studio(engine_server, tmp_path_factory)
    yield url, client, demo
    demo.close()


@contextmanager
def serve_app(app: Any) -> Iterator[str]:
    """An ASGI app (the /v1 API) on a real socket, uvicorn in a thread: what clients over the network meet
    (a body sent in chunks while others are answered). Yields its URL."""
    import uvicorn
    from engine.parallel.groups import free_port
    from engine.serve.openai_api import bind
    sock = bind("127.0.0.1", free_port())
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        wait_for(lambda: server.started, timeout=10)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(10)
