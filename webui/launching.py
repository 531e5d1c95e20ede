"""How the studio is served: Gradio's launch with the studio's look, its results' routes (the links, behind
the page's login: engine/serve/results.py) beside the /v1 API's, and a queue that idles without polling
every millisecond."""
from __future__ import annotations

from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Callable, Union

import gradio as gr

from engine.serve.results import results_router

from .theme import CSS, theme


# Gradio 6.31's queue loop polls every 1 ms while no event waits, and its progress loop every 10 ms: an idle
# studio spent 3-5% of a core on them. 20 ms and 100 ms instead (the first wait is at most 20 ms more before
# an event starts, against runs of seconds; the page sends no gr.Progress updates). `queue()` has no option
# for them, so the instance's settings are changed here, by name: a Gradio without them fails loudly.
QUEUE_IDLE_POLL_S = 0.02
PROGRESS_POLL_S = 0.1


def idle_gently(demo: gr.Blocks) -> None:
    queue = demo._queue
    for name, seconds in (("sleep_when_free", QUEUE_IDLE_POLL_S), ("progress_update_sleep_when_free", PROGRESS_POLL_S)):
        if not isinstance(getattr(queue, name, None), (int, float)):
            raise RuntimeError(f"this Gradio's queue has no {name}: update webui.launching.idle_gently")
        setattr(queue, name, max(getattr(queue, name), seconds))


Login = Union[tuple[str, str], Callable[[str, str], bool]]


def logged_in(request: Any) -> bool:
    """Whether a request to the studio's own routes (a result's link) may be answered: the page is open, or
    it carries the page's login cookie (Gradio 6.31 keeps its tokens on its app, as its /user route reads
    them). A Gradio without them answers no link of a protected page."""
    app = request.app
    if getattr(app, "auth", None) is None and getattr(app, "auth_dependency", None) is None:
        return True
    if getattr(app, "auth_dependency", None) is not None or not hasattr(app, "tokens"):
        return False
    cookie = getattr(app, "cookie_id", "")
    token = request.cookies.get(f"access-token-{cookie}") or request.cookies.get(f"access-token-unsecure-{cookie}")
    return app.tokens.get(token) is not None


def with_routes(router: Any, inner: Callable[[Any], Any] | None) -> Callable[[Any], Any]:
    """A lifespan for Gradio's app (`launch(app_kwargs={"lifespan": ...})`) that adds `router` once (Gradio may
    start the app more than once while it looks for a port), around `inner` (the /v1 API's)."""
    @asynccontextmanager
    async def lifespan(app: Any) -> AsyncIterator[None]:
        if not getattr(app.state, "studio_routes", False):
            app.include_router(router)
            app.state.studio_routes = True
        if inner is None:
            yield
        else:
            async with inner(app):
                yield
    return lifespan


def launch(demo: gr.Blocks, *, host: str | None = None, port: int | None = None, share: bool = False,
           auth: Login | None = None, **kwargs: Any) -> tuple[Any, str, str | None]:
    """Launch with the studio's look. host/port None: Gradio's defaults and its GRADIO_SERVER_NAME /
    GRADIO_SERVER_PORT variables (what hosting platforms such as Spaces set). `auth`: a (user, password)
    or a check(user, password); it guards the page and its whole Gradio API (uploads, /t2i, /ti2i)."""
    results = demo.studio.results
    kwargs["allowed_paths"] = [*kwargs.get("allowed_paths", []), str(results.folder)]
    app_kwargs = dict(kwargs.pop("app_kwargs", None) or {})
    app_kwargs["lifespan"] = with_routes(results_router(results, logged_in), app_kwargs.get("lifespan"))
    kwargs["app_kwargs"] = app_kwargs
    return demo.launch(server_name=host, server_port=port, share=share, auth=auth, theme=theme(), css=CSS,
                       footer_links=["api", "settings"], **kwargs)
