"""The FastAPI app (factory + lifespan), its routes and `run_server` behind `xpulora serve`.

/v1/*, /tokenize and /detokenize need `Authorization: Bearer KEY` when an API key is set (constant-time
compare); /health, /ping, /metrics and /version stay open. Every error is JSON
{"error": {"message", "type", "code"}}. A request
body over `max_request_bytes` (1 MiB; env XPULORA_MAX_REQUEST_BYTES) is refused with 413 before it is read.
SIGTERM: uvicorn stops accepting, in-flight requests may finish for GRACE_S, then the engine aborts
what is left (streams end with finish_reason "abort" and [DONE], others get a 503), the lifespan joins
the step thread, and the process exits 0. If the engine dies (a tensor-parallel rank died, a step
raised), the server shuts down the same way and the process exits with ENGINE_FAILED_EXIT (3).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import hmac
import json
import logging
import os
import signal
import threading
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import GC_PAUSES, CheckpointError, EngineClient, EngineConfig, EngineCoreExitedError, freeze_startup_heap
from server.adapters import router as adapters_router
from server.chat_tools import ChatOptions, think_close_id
from server.cli_args import VERSION
from server.errors import ERROR_TYPES, error_body, error_response, install_error_handlers
from server.http_limits import uvicorn_limits
from server.metrics import Metrics
from server.openai_protocol import ChatCompletionRequest, CompletionRequest
from server.serving import Serving
from server.tokenize import router as tokenize_router

if TYPE_CHECKING:
    from engine import LLMEngine

log = logging.getLogger(__name__)
GRACE_S = float(os.environ.get("XPULORA_SHUTDOWN_GRACE_S", "30"))
MAX_REQUEST_BYTES = int(os.environ.get("XPULORA_MAX_REQUEST_BYTES", str(1 << 20)))
ENGINE_FAILED_EXIT = 3


class BearerAuth:
    """Pure ASGI (not BaseHTTPMiddleware, which gets in the way of streaming and disconnects)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = _digest(f"Bearer {api_key}".encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and needs_key(scope["path"]):
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            # Digests, not the raw values: compare_digest returns early when the lengths differ, which
            # would leak the key's length; two SHA-256 digests always have the same length.
            if not hmac.compare_digest(_digest(got), self.expected):
                await _send_error(send, 401, "invalid or missing API key (Authorization: Bearer KEY)",
                                  ((b"www-authenticate", b"Bearer"),))
                return
        await self.app(scope, receive, send)


def needs_key(path: str) -> bool:
    """The routes an API key protects: the API proper and the tokenizer (a 1 MiB prompt costs CPU)."""
    return path == "/v1" or path.startswith("/v1/") or path in ("/tokenize", "/detokenize")


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


async def _send_error(send: Send, status: int, message: str, headers: tuple[tuple[bytes, bytes], ...] = ()) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), *headers]})
    await send({"type": "http.response.body", "body": body})


class BodyLimit:
    """413 for a request body larger than max_bytes: refused on its Content-Length before any byte is
    read, or (chunked uploads) as soon as the bytes read pass the limit. The body is buffered here
    (it is JSON the app parses whole anyway) and replayed to the app, so the app never sees a partial
    body; later receive() calls (disconnect detection) go straight through."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await _send_error(send, 413, f"request body of {int(declared)} bytes exceeds the limit of "
                                         f"{self.max_bytes} bytes")
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":  # disconnected while uploading
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            more = msg.get("more_body", False)
            if size > self.max_bytes:
                await _send_error(send, 413, f"request body exceeds the limit of {self.max_bytes} bytes")
                return
        replay: list[Message] = [{"type": "http.request", "body": b"".join(chunks), "more_body": False}]

        async def replayed() -> Message:
            return replay.pop() if replay else await receive()

        await self.app(scope, replayed, send)


def create_app(engine_config: EngineConfig, *, engine: LLMEngine | None = None, client: EngineClient | None = None,
               api_key: str | None = None,
               max_waiting_requests: int | None = None, progress: bool = False,
               max_request_bytes: int = MAX_REQUEST_BYTES,
               on_engine_failure: Callable[[BaseException], None] | None = None,
               chat: ChatOptions | None = None) -> FastAPI:
    """The app; its lifespan starts the engine core unless given one: `client` (already spawned, see
    run_server), else `engine` (an LLMEngine of this process: its core loop runs on a thread), else a
    new engine-core process. on_engine_failure is called on the event loop once if the core dies."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        limit = (max_waiting_requests if max_waiting_requests is not None
                 else engine_config.scheduler.max_waiting_requests)
        if client is not None:
            core = client
        elif engine is not None:
            core = EngineClient.in_thread(engine, limit, on_engine_failure)
        else:
            core = await EngineClient.spawn(engine_config, progress, limit, on_engine_failure)
        metrics = Metrics(core)
        app.state.engine, app.state.metrics = core, metrics
        app.state.serving = Serving(core, metrics, chat)
        await core.start()
        try:
            yield
        finally:
            await core.shutdown(grace_s=5.0)
            app.state.serving.close()

    app = FastAPI(title="xpulora", version=VERSION, lifespan=lifespan)
    app.openapi = lambda: _openapi(app, bool(api_key))  # type: ignore[method-assign]
    install_error_handlers(app)
    app.add_middleware(BodyLimit, max_bytes=max_request_bytes)
    if api_key:  # added last: outermost, so an unauthenticated body is never read
        app.add_middleware(BearerAuth, api_key=api_key)
    app.include_router(adapters_router)
    app.include_router(tokenize_router)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await request.app.state.serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await request.app.state.serving.chat(body, request)

    @app.get("/health")
    async def health(request: Request) -> Response:
        e: EngineClient = request.app.state.engine
        if e.healthy:
            return Response(json.dumps({"status": "healthy"}), media_type="application/json")
        return error_response(503, f"the engine is not running: {e.error!r}")

    @app.get("/ping")  # vLLM's (SageMaker's) liveness probe, GET and POST: /health's answer
    @app.post("/ping")
    async def ping(request: Request) -> Response:
        return await health(request)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        return Response(request.app.state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict[str, Any]:
        return {"version": VERSION}

    return app


# -- the OpenAPI document ---------------------------------------------------------------------------
_ERRORS: dict[str, tuple[int, ...]] = {  # what each route answers besides 200 (and 401, 413, 405)
    "/v1/completions": (400, 404, 500, 503), "/v1/chat/completions": (400, 404, 500, 503),
    "/v1/load_lora_adapter": (400, 403, 404), "/v1/unload_lora_adapter": (400, 404), "/health": (503,),
    "/ping": (503,), "/tokenize": (400, 404), "/detokenize": (400, 404)}
_ERROR_SCHEMA = {"type": "object", "required": ["error"], "properties": {"error": {
    "type": "object", "required": ["message", "type", "code"],
    "properties": {"message": {"type": "string"}, "type": {"type": "string"}, "code": {"type": "integer"}}}}}


_SSE_EVENT = {"type": "object", "required": ["data"], "properties": {"data": {"type": "string"}}}  # one event


def _openapi(app: FastAPI, api_key: bool) -> dict[str, Any]:
    """FastAPI's document, corrected to what the server really answers (checked by tests/e2e/test_fuzz.py):
    invalid input is 400 with the JSON error shape (never FastAPI's 422), each route's error codes,
    the bearer key on /v1/*, SSE on the completion routes and Prometheus text on /metrics."""
    if app.openapi_schema:
        return app.openapi_schema
    from fastapi.openapi.utils import get_openapi

    doc = get_openapi(title=app.title, version=app.version, routes=app.routes)
    comps = doc.setdefault("components", {})
    schemas = comps.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["Error"] = _ERROR_SCHEMA
    if api_key:
        comps["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    err = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    for path, ops in doc["paths"].items():
        for method, op in ops.items():
            responses = op["responses"]
            responses.pop("422", None)
            codes = list(_ERRORS.get(path, ()))
            if method == "post":
                codes.append(413)
            if api_key and needs_key(path):
                codes.append(401)
                op["security"] = [{"bearer": []}]
            for code in codes:
                responses[str(code)] = {"description": ERROR_TYPES.get(code, "error"), **err}
            if path in ("/v1/completions", "/v1/chat/completions"):
                responses["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
            if path == "/metrics":
                responses["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
    app.openapi_schema = doc
    return doc


# -- xpulora serve -----------------------------------------------------------------------------------
def _ready_lines(host: str, port: int, core: EngineClient, demo: bool, api_key: bool) -> str:
    shown = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
    url = f"http://{shown}:{port}"
    adapters = [n for n, _ in core.list_adapters()]
    base = core.served.name
    model = adapters[0] if adapters else base
    prompt = "words: cat dog fox =>" if demo else "Hello, my name is"
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 16, "temperature": 0})
    auth = ' -H "Authorization: Bearer $XPULORA_API_KEY"' if api_key else ""
    listed = f"; adapters: {', '.join(adapters)}" if adapters else ""
    return (f"xpulora ready: {url}/v1 (base model {base!r}{listed})\n"
            f"  try: curl {url}/v1/completions -H 'Content-Type: application/json'{auth} -d '{body}'")


async def _stop(core: EngineClient) -> None:
    await core.start()
    await core.shutdown(0)


def _ignore_signal(sig: int, _frame: object) -> None:
    # uvicorn re-raises the signal it handled once it has shut down; exiting 0 is the contract.
    log.info("signal %d: server already shut down", sig)


def run_server(args: argparse.Namespace, engine_config: EngineConfig) -> int:
    from server.cli import DEMO_MODEL, demo_config, is_demo

    demo = is_demo(args.model)
    if demo:
        if not (DEMO_MODEL / "config.json").is_file():
            print(f"xpulora: the demo model is not built ({DEMO_MODEL} is missing); build it with "
                  "`PYTHONPATH=. .venv/bin/python demo/make_demo.py --out demo` or pass a MODEL folder")
            return 2
        engine_config = demo_config(engine_config)
    chat = ChatOptions(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    if chat.enable_auto_tool_choice and chat.tool_call_parser is None:
        print("xpulora: --enable-auto-tool-choice needs --tool-call-parser (hermes)")
        return 2
    failures: list[BaseException] = []

    def engine_failed(e: BaseException) -> None:
        # A dead engine serves nothing again: shut down (in-flight requests already got their error)
        # and exit non-zero so that a supervisor restarts the server instead of it idling unhealthy.
        failures.append(e)
        log.error("the engine failed (%r); shutting the server down", e)
        server.should_exit = True
        if isinstance(e, EngineCoreExitedError):  # the core vanished: be gone within a second whatever stalls
            backstop = threading.Timer(0.6, os._exit, (ENGINE_FAILED_EXIT,))
            backstop.daemon = True
            backstop.start()

    limit = args.max_waiting_requests
    try:  # the engine-core process: its start-up errors are reported as before, with exit code 2
        core = asyncio.run(EngineClient.spawn(engine_config, True, limit if limit is not None
                                              else engine_config.scheduler.max_waiting_requests, engine_failed))
    except (CheckpointError, OSError, ValueError) as e:  # ConfigError, AdapterError are ValueErrors
        print(f"xpulora: cannot start: {e}")
        return 2
    if chat.reasoning_parser is not None:
        try:
            think_close_id(core.served.tokenizer.get_vocab())
        except ValueError as e:
            print(f"xpulora: cannot start: {e}")
            asyncio.run(_stop(core))
            return 2

    app = create_app(engine_config, client=core, api_key=args.api_key,
                     max_waiting_requests=args.max_waiting_requests,
                     on_engine_failure=engine_failed, chat=chat)
    ready = _ready_lines(args.host, args.port, core, demo, bool(args.api_key))

    class _Server(uvicorn.Server):
        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                # the app, the tokenizer and the imports live as long as the process: out of every later full
                # collection's walk (engine.gc_pauses), then count what collections still cost
                log.info("API process: %d start-up objects frozen out of garbage collection", freeze_startup_heap())
                GC_PAUSES.install()
                print(ready, flush=True)

        async def shutdown(self, sockets: Any = None) -> None:
            # Drain for GRACE_S, then abort what still runs so that every client gets a complete
            # response (finish_reason "abort" / 503) rather than a connection cut by uvicorn's backstop.
            engine: EngineClient | None = getattr(app.state, "engine", None)
            timer = None
            if engine is not None:
                engine.stop_accepting()
                timer = asyncio.get_running_loop().call_later(GRACE_S, engine.abort_all)
            try:
                await super().shutdown(sockets)
            finally:
                if timer is not None:
                    timer.cancel()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="info",
                            timeout_graceful_shutdown=int(GRACE_S) + 10, lifespan="on", **uvicorn_limits())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _ignore_signal)
    server = _Server(config)
    server.run()  # the lifespan stops the engine core (and it its tensor-parallel ranks)
    if failures and isinstance(failures[0], EngineCoreExitedError):
        logging.shutdown()  # then skip the interpreter's teardown (half a second): nothing is left to stop
        os._exit(ENGINE_FAILED_EXIT)
    if failures:
        return ENGINE_FAILED_EXIT
    return 0 if server.started else 1
