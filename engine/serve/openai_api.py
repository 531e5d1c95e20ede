"""OpenAI's image API on the studio's server: the routes, their key check, upload limits and errors.

    POST /v1/images/generations   JSON, as `client.images.generate(...)` sends it
    POST /v1/images/edits         multipart (`image` or repeated `image[]`, 1-3 files), as `client.images.edit`
    POST /v1/chat/completions     vLLM-Omni's recipe form: `modalities: ["image"]`, diffusion fields in `extra_body`
    GET  /v1/models (the checkpoint, then each loaded LoRA adapter), GET /health
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   vLLM's names and bodies: {"lora_name", "lora_path"}

Every route drives the one `EngineServer` (its queue, its validation, its cancel) that the page uses:
`python app.py` mounts these routes on the FastAPI app Gradio serves (`OpenAIApi.lifespan`), and
`python app.py --api-only` serves them alone (`api_app` + `serve`). Request parsing lives in
`openai_params`, the mapping of engine events onto OpenAI's bodies and SSE frames in `openai_events`.

A client that disconnects cancels its request on the engine: a watcher waits for the connection's
`http.disconnect` while the request runs (streamed or not) and cancels it, so the engine stops at its
next token or step instead of finishing an image nobody will read.

What a browser may do (README, "Security"): nothing cross-site. The routes send no CORS headers of their
own, JSON routes take JSON content types only (a `text/plain` body, which a web page may send anywhere
without a CORS preflight, is 415), and a POST whose `Origin` is not this server is 403, which also covers
the multipart form of the edit route. Every error, 404 and 405 included, is in OpenAI's shape.

Nothing slow runs on the event loop: a body is checked as it arrives within its route's limit
(`openai_body`: JSON; `openai_form`: the edit's form), then parsed, its images decoded and the request
submitted in threads, so /health and everyone else are answered meanwhile.
"""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import sys
import time
import traceback
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, FastAPI
from starlette.requests import ClientDisconnect, Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Match

from engine.runtime.events import Error
from engine.runtime.request import MAX_IMAGES
from engine.serve.client import Submission
from engine.serve.openai_events import (Outcome, chat_response, chat_stream, collect, failure, image_stream,
                                        images_response)
from engine.serve.openai_body import (FIELDS_ALLOWANCE, HELD_BODIES, BodyLimit, HeldBodies, JsonFields, JsonParser,
                                      JsonScan, chat_limit, declared_size, edit_limit, generation_limit, read_body)
from engine.serve.openai_fields import CHAT_FIELDS, CHAT_NEUTRAL_ONLY, GENERATION_FIELDS, check_fields
from engine.serve.openai_form import Form, FormReader
from engine.serve.openai_params import (ApiError, ImageParams, UploadLimits, check_upload, parse_chat, parse_edit,
                                        parse_generation, parse_int, refusal, size_list)
from engine.serve.origin import foreign_origin

DEFAULT_PORT = 7860          # as Gradio: the first free port from here when none is given
PORT_TRIES = 100


JSON_TYPES = ("application/json",)     # and any application/*+json
# What each JSON route's object may hold (openai_body.JsonScan checks it as the body arrives)
GENERATION_JSON = JsonFields(GENERATION_FIELDS)
CHAT_JSON = JsonFields(CHAT_FIELDS | CHAT_NEUTRAL_ONLY, whole=frozenset({"messages"}),
                       nested=(("extra_body", (CHAT_FIELDS - {"extra_body", "messages"}) | CHAT_NEUTRAL_ONLY),))
ADAPTER_LIMIT = BodyLimit(FIELDS_ALLOWANCE, "an adapter's name and folder")


@dataclass(frozen=True)
class ApiConfig:
    api_key: str | None = None      # required as `Authorization: Bearer KEY` on /v1/* when set
    page_auth: bool = False         # the page has --auth: without a key /v1 is closed, not left open
    limits: UploadLimits = field(default_factory=UploadLimits)
    page: str | None = None         # the page's protection, for /health: "login", "open", None (no page)

    def auth(self) -> dict[str, str | None]:
        """What needs credentials, as /health reports it."""
        api = "key" if self.api_key else ("closed" if self.page_auth else "open")
        return {"api": api, "page": self.page}


async def _cancel_on_disconnect(request: HttpRequest, sub: Submission) -> None:
    """Wait for the client to go away, then cancel its request (the body has been read by now, so the
    next ASGI message is the disconnect)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            sub.cancel()
            return


class OpenAIApi:
    """The /v1 routes and /health over one engine server (anything with EngineServer's submit, cancel,
    health and info)."""

    def __init__(self, server: Any, config: ApiConfig | None = None):
        self.server, self.info = server, server.info
        self.config = config or ApiConfig()
        self.created = int(time.time())
        image_bytes = self.config.limits.max_bytes
        self.generation_limit, self.edit_limit = generation_limit(), edit_limit(image_bytes)
        self.chat_limit = chat_limit(image_bytes)
        self.parse_json = JsonParser(parse_int)
        self.held = HeldBodies(HELD_BODIES * max(self.edit_limit.bytes, self.chat_limit.bytes))

    # ------------------------------------------------------------------ plumbing
    def _authorize(self, request: HttpRequest) -> None:
        key = self.config.api_key
        if key is None:
            if self.config.page_auth:
                raise ApiError(401, "this server protects its page with --auth; start it with --api-key KEY "
                                    "(or STUDIO_API_KEY) to use the /v1 API", None, "api_key_required")
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
            raise ApiError(401, "Incorrect or missing API key: send `Authorization: Bearer KEY` with the key "
                                "the server was started with (--api-key / STUDIO_API_KEY)", None, "invalid_api_key")

    @staticmethod
    def _error(e: ApiError) -> JSONResponse:
        headers = {"Retry-After": str(int(e.retry_after))} if e.retry_after else None
        if e.status == 401:
            headers = {"WWW-Authenticate": "Bearer"}
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    def _route(self, handler: Callable[[HttpRequest], Awaitable[Response]], *, auth: bool = True
               ) -> Callable[[HttpRequest], Awaitable[Response]]:
        """Errors in OpenAI's shape, whatever the handler raises; a cross-site POST refused, then the key
        checked, on /v1."""
        async def endpoint(request: HttpRequest) -> Response:
            try:
                if request.method == "POST" and (origin := foreign_origin(request.headers)) is not None:
                    raise ApiError(403, f"cross-site request refused: this API does not answer web pages of other "
                                        f"origins ({origin})", None, "cross_origin_forbidden")
                if auth:
                    self._authorize(request)
                return await handler(request)
            except ApiError as e:
                return self._error(e)
            except ClientDisconnect:           # gone while sending its body: nothing was submitted
                return Response(status_code=400)
            except Exception as e:  # noqa: BLE001 - a bug: still an OpenAI-shaped answer, and logged
                traceback.print_exc(file=sys.stderr)
                return self._error(ApiError(500, f"internal server error ({type(e).__name__}); the engine is "
                                                 "unaffected, please report this", None, "server_error"))
        endpoint.__name__ = handler.__name__
        return endpoint

    def _check_ready(self) -> None:
        h = self.server.health()
        state = h.get("state")
        if state in ("loading", "restarting", "stalled"):
            what = f" ({h['loading']})" if h.get("loading") else ""
            doing = "restarting after a stall (it made no progress)" if state == "stalled" else f"{state} the model"
            raise ApiError(503, f"the engine is {doing}{what}; try again in a moment", None,
                           "engine_loading", retry_after=5)
        if state in ("failed", "closed"):
            raise ApiError(503, f"the engine is not running: {h.get('last_error') or state}", None,
                           "engine_unavailable")

    async def _submit(self, params: ImageParams) -> Submission:
        """Queue the request; a refusal at the door (bad value, full queue, engine down) is an HTTP error,
        not the start of a stream. Submit validates (and so decodes the reference images) in a thread:
        the event loop keeps answering everyone else meanwhile."""
        self._check_ready()
        submit_turn = getattr(self.server, "submit_turn", None)     # conversations: one engine server's
        if params.turn and submit_turn is not None:
            sub = await asyncio.to_thread(submit_turn, params.request, params.conversation_id, params.branch_from_turn)
            params.conversation_id = sub.conversation_id
        elif params.conversation_id is not None or params.branch_from_turn is not None:
            raise ApiError(400, "this server holds no conversations (send the whole history over "
                                "/v1/chat/completions instead)",
                           "conversation_id", "unsupported_parameter")
        else:
            sub = await asyncio.to_thread(self.server.submit, params.request)
        if sub.ended:                    # submit ended it at once: the first event is the refusal
            ev = sub.get(timeout=0)
            if isinstance(ev, Error):
                raise refusal(ev, params, self.info) if ev.kind == "invalid" else failure(ev)
        return sub

    async def _json(self, request: HttpRequest, limit: BodyLimit, fields: JsonFields,
                    hold: Callable[[int], None]) -> Any:
        """The JSON body, scanned as it arrives and parsed in a thread (openai_body); `hold` counts its bytes
        against what all bodies may hold at once."""
        ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if ctype not in JSON_TYPES and not (ctype.startswith("application/") and ctype.endswith("+json")):
            raise ApiError(415, f"send the body as JSON with `Content-Type: application/json` (got "
                                f"{ctype or 'no Content-Type'})", None, "unsupported_media_type")
        scan, body = JsonScan(fields), bytearray()

        def feed(chunk: bytes) -> None:
            scan.feed(chunk)
            hold(len(chunk))
            body.extend(chunk)
        await read_body(request.stream(), limit, declared_size(request.headers), feed)
        try:
            return await self.parse_json(body)
        except ValueError as e:
            raise ApiError(400, f"the request body is not valid JSON ({e})", None, "invalid_json") from None

    async def _form(self, request: HttpRequest, hold: Callable[[int], None]) -> Form:
        """The edit form: its text fields and its reference images (openai_form)."""
        ctype = request.headers.get("content-type", "")
        if not ctype.startswith("multipart/form-data"):
            raise ApiError(400, "send edits as multipart/form-data with the images in `image` or `image[]` "
                                "(as the openai client does)", None, "invalid_content_type")
        reader = FormReader(ctype, self.config.limits.max_bytes)

        def feed(chunk: bytes) -> None:
            hold(len(chunk))
            reader.feed(chunk)
        await read_body(request.stream(), self.edit_limit, declared_size(request.headers), feed)
        return reader.finish()

    def _edit_params(self, form: Form) -> ImageParams:
        """The edit's request, its reference images checked against the limits (in a thread: image headers)."""
        images = [check_upload(data, f"reference image {k + 1}", "image", self.config.limits)
                  for k, data in enumerate(form.images)]
        return parse_edit(form.fields, images, self.info.name, self._adapters())

    async def _run(self, request: HttpRequest, sub: Submission) -> Outcome:
        """All events of a non-streamed request, cancelling it if the client leaves first."""
        watcher = asyncio.create_task(_cancel_on_disconnect(request, sub))
        try:
            out = await collect(sub)
        finally:
            watcher.cancel()
        if out.error is not None:
            raise failure(out.error)
        return out

    @staticmethod
    def _stream(request: HttpRequest, sub: Submission, frames: AsyncIterator[bytes]) -> StreamingResponse:
        async def watched() -> AsyncIterator[bytes]:
            watcher = asyncio.create_task(_cancel_on_disconnect(request, sub))
            try:
                async for frame in frames:
                    yield frame
            finally:
                watcher.cancel()
                await frames.aclose()          # its own `finally` cancels the request if it did not end
        return StreamingResponse(watched(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    # ------------------------------------------------------------------ routes
    async def generations(self, request: HttpRequest) -> Response:
        with self.held.hold() as hold:
            body = await self._json(request, self.generation_limit, GENERATION_JSON, hold)
        params = parse_generation(body, self.info.name, self._adapters())
        return await self._images(request, params, "image_generation")

    async def edits(self, request: HttpRequest) -> Response:
        with self.held.hold() as hold:          # the body's bytes, until the images are checked
            form = await self._form(request, hold)
            params = await asyncio.to_thread(self._edit_params, form)
        return await self._images(request, params, "image_edit")

    async def _images(self, request: HttpRequest, params: ImageParams, kind: str) -> Response:
        sub = await self._submit(params)
        if params.stream:
            return self._stream(request, sub, image_stream(sub, params, self.info, kind))
        out = await self._run(request, sub)
        return JSONResponse(await images_response(out, params, self.info))

    async def chat(self, request: HttpRequest) -> Response:
        with self.held.hold() as hold:          # the body's bytes, until its images are decoded
            body = await self._json(request, self.chat_limit, CHAT_JSON, hold)
            # in a thread: the images' base64 is decoded and their headers read
            params = await asyncio.to_thread(parse_chat, body, self.config.limits, self.info.name, self._adapters())
        sub = await self._submit(params)
        if params.stream:
            return self._stream(request, sub, chat_stream(sub, params, self.info))
        out = await self._run(request, sub)
        return JSONResponse(await chat_response(out, params, self.info))

    def _adapters(self) -> list[str]:
        """The LoRA adapters served (a server without adapter support has none)."""
        adapters = getattr(self.server, "adapters", None)
        return adapters() if adapters is not None else []

    def _model(self, adapter: str | None = None) -> dict[str, Any]:
        """A /v1/models entry: the checkpoint, or a LoRA adapter on it (`parent`, as vLLM lists adapters)."""
        base = {"id": self.info.name, "object": "model", "created": self.created, "owned_by": "hunyuan-studio",
                "sizes": size_list(self.info)}
        return base if adapter is None else base | {"id": adapter, "parent": self.info.name, "root": adapter}

    async def models(self, request: HttpRequest) -> Response:
        return JSONResponse({"object": "list", "data": [self._model()] + [self._model(a) for a in self._adapters()]})

    async def model(self, request: HttpRequest) -> Response:
        name = request.path_params.get("model")
        if name != self.info.name and name not in self._adapters():
            raise ApiError(404, f"The model {name!r} does not exist; this server serves {self.info.name!r} (GET "
                                "/v1/models lists it and its LoRA adapters)", "model", "model_not_found")
        return JSONResponse(self._model(None if name == self.info.name else name))

    async def _adapter_body(self, request: HttpRequest, fields: tuple[str, ...]) -> list[str]:
        """The fields of a load/unload body. These routes name folders of the server's machine: they exist
        only behind an API key (an open /v1 does not let anyone make the server read its files)."""
        if self.config.api_key is None:
            raise ApiError(403, "loading and unloading LoRA adapters needs an API key: start the server with "
                                "--api-key KEY (or STUDIO_API_KEY)", None, "api_key_required")
        if not hasattr(self.server, "load_adapter"):
            raise ApiError(400, "this server does not load LoRA adapters",
                           None, "unsupported_parameter")
        with self.held.hold() as hold:
            body = await self._json(request, ADAPTER_LIMIT, JsonFields(frozenset(fields)), hold)
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object", None, "invalid_json")
        check_fields(body, fields)
        for name in fields:
            if not isinstance(body.get(name), str) or not body[name].strip():
                raise ApiError(400, f"{name} is required (a string)", name, "missing_required_parameter")
        return [body[f] for f in fields]

    async def load_lora_adapter(self, request: HttpRequest) -> Response:
        """POST /v1/load_lora_adapter {"lora_name", "lora_path"} (vLLM's route): serve a PEFT adapter folder of
        the server's machine from the next step on, as /v1/models lists it."""
        name, path = await self._adapter_body(request, ("lora_name", "lora_path"))
        try:
            await asyncio.to_thread(self.server.load_adapter, name, path)
        except (ValueError, OSError) as e:
            raise ApiError(400, str(e), "lora_path", "invalid_lora_adapter") from None
        return JSONResponse({"loaded": name})

    async def unload_lora_adapter(self, request: HttpRequest) -> Response:
        """POST /v1/unload_lora_adapter {"lora_name"}: refused (409) while a request uses it."""
        (name,) = await self._adapter_body(request, ("lora_name",))
        try:
            await asyncio.to_thread(self.server.unload_adapter, name)      # a pool posts it to its replicas
        except KeyError as e:
            raise ApiError(404, e.args[0], "lora_name", "model_not_found") from None
        except ValueError as e:
            raise ApiError(409, str(e), "lora_name", "lora_adapter_in_use") from None
        return JSONResponse({"unloaded": name})

    async def health(self, request: HttpRequest) -> Response:
        h = self.server.health()
        up = h.get("state") in ("ready", "busy")
        keys = ("state", "device", "plan", "world_size", "queue", "max_queue", "max_batch", "loading", "last_error",
                "restarts", "attempt", "restart_in_s", "stall_limit_s", "warmup", "kernels", "scheduler")
        # running: requests in the engine's batch; waiting (= queue): requests queued beyond it
        body = {"status": "ok" if up else "unavailable", "model": self.info.name,
                **{k: h.get(k) for k in keys}, "running": h.get("running") or 0, "waiting": h.get("queue") or 0,
                "auth": self.config.auth()}
        if "replicas" in h:          # engine replicas (engine/serve/replicas.py): each one, the total above
            body.update({k: h.get(k) for k in ("replicas", "replicas_up", "replicas_target", "replicas_min",
                                               "replicas_max")})
        return JSONResponse(body, status_code=200 if up else 503)

    async def reload(self, request: HttpRequest) -> Response:
        """POST /engine/reload: load the model again after it failed to load (the way back without
        restarting the process); 409 when the engine is not in the failed state."""
        if not self.server.reload():
            raise ApiError(409, f"the engine is {self.server.health().get('state')}; reload applies only to a "
                                "failed engine", None, "engine_not_failed")
        return JSONResponse({"reloading": True}, status_code=202)

    async def not_found(self, request: HttpRequest) -> Response:
        """Any other path or method under these routes, in OpenAI's shape (not FastAPI's {"detail": ...})."""
        allowed = sorted({m for r in self._routes for m in (r.methods or ())
                          if r.matches(request.scope)[0] == Match.PARTIAL})
        if allowed:
            return JSONResponse(ApiError(405, f"{request.method} is not allowed on {request.url.path}; use "
                                              f"{' or '.join(allowed)}", None, "method_not_allowed").body(),
                                status_code=405, headers={"Allow": ", ".join(allowed)})
        raise ApiError(404, f"no route {request.method} {request.url.path} (see /v1/models, /v1/images/generations, "
                            "/v1/images/edits, /v1/chat/completions, /health)", None, "not_found")

    def router(self) -> APIRouter:
        r = APIRouter()
        r.add_api_route("/v1/images/generations", self._route(self.generations), methods=["POST"])
        r.add_api_route("/v1/images/edits", self._route(self.edits), methods=["POST"])
        r.add_api_route("/v1/chat/completions", self._route(self.chat), methods=["POST"])
        r.add_api_route("/v1/models", self._route(self.models), methods=["GET"])
        r.add_api_route("/v1/models/{model:path}", self._route(self.model), methods=["GET"])
        r.add_api_route("/v1/load_lora_adapter", self._route(self.load_lora_adapter), methods=["POST"])
        r.add_api_route("/v1/unload_lora_adapter", self._route(self.unload_lora_adapter), methods=["POST"])
        r.add_api_route("/health", self._route(self.health, auth=False), methods=["GET"])
        r.add_api_route("/engine/reload", self._route(self.reload), methods=["POST"])
        self._routes = list(r.routes)
        # last: whatever else comes under /v1 or /engine, and a wrong method on the routes above
        any_method = ["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"]
        for prefix in ("/v1", "/engine"):
            r.add_api_route(prefix + "/{rest:path}", self._route(self.not_found, auth=False), methods=any_method)
        r.add_api_route("/health", self._route(self.not_found, auth=False), methods=any_method)
        return r

    def lifespan(self) -> Callable[[FastAPI], Any]:
        """For Gradio's `launch(app_kwargs={"lifespan": ...})`: the routes join the page's app before the
        server accepts its first connection (Gradio may start the app more than once while it looks for
        a free port, so they are added once)."""
        router = self.router()

        @asynccontextmanager
        async def attach(app: FastAPI) -> AsyncIterator[None]:
            if not getattr(app.state, "openai_api", False):
                app.include_router(router)
                app.state.openai_api = True
            yield
        return attach


def api_app(server: Any, config: ApiConfig | None = None) -> FastAPI:
    """The API alone (`--api-only`): no page, the same engine server and queue."""
    app = FastAPI(title="HunyuanImage-3.0 OpenAI-compatible API", docs_url=None, redoc_url=None, openapi_url=None)
    app.include_router(OpenAIApi(server, config).router())
    return app


def bind(host: str | None, port: int | None) -> socket.socket:
    """A listening socket: on `port`, or (none given) on the first free port from $GRADIO_SERVER_PORT or
    7860, as the page's launcher does."""
    host = host or os.environ.get("GRADIO_SERVER_NAME") or "127.0.0.1"
    if port is not None:
        ports: range | list[int] = [port]
    else:
        first = int(os.environ.get("GRADIO_SERVER_PORT") or DEFAULT_PORT)
        ports = range(first, first + PORT_TRIES)
    for p in ports:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, p))
        except OSError:
            sock.close()
            continue
        sock.listen(128)
        return sock
    raise OSError(f"no free port in {ports[0]}-{ports[-1]} on {host}; choose one with --port")


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Run the API on `sock` until Ctrl-C / SIGTERM (uvicorn's own handlers). Streams still open at
    shutdown get a few seconds, then are cut (the engine is closed after)."""
    import uvicorn
    config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=3)
    uvicorn.Server(config).run(sockets=[sock])
