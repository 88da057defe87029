"""The FastAPI app: routes, bearer auth, body size limit, OpenAI-shaped errors.

Owns HTTP concerns only; generation is in serving.py and the engine in its own process. No route
reloads or executes code, and the API key is never logged or echoed.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, MutableMapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from moetier.metrics import ServerMetrics
from moetier.server.engine_process import EngineClient
from moetier.server.protocol import ChatCompletionRequest, CompletionRequest, error_body

log = logging.getLogger(__name__)

# /health reports "degraded" (HTTP 200: the server still answers what it can) for this long after
# an engine step failed requests (an unreadable expert shard, non-finite logits, ...).
FAULT_WINDOW_S = 300.0

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_num_seqs: int = 64
    max_waiting: int = 256  # queued requests beyond the running batch before 429
    max_body_bytes: int = 4 << 20
    tool_call_parser: str | None = None  # None: detected from the chat template


class APIError(Exception):
    """An error answered with an OpenAI-shaped body and `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = (
            status,
            message,
            type_,
            param,
            code,
        )

    def response(self) -> JSONResponse:
        body = error_body(self.message, self.type, self.param, self.code)
        return JSONResponse(body, status_code=self.status)


class BodyLimit:
    """ASGI middleware: refuse bodies over `limit` bytes with 413 before the app parses them."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await self._refuse(send)
            return
        chunks: list[bytes] = []
        size, more = 0, True
        while more:
            msg = await receive()
            if msg["type"] != "http.request":
                return  # client went away before sending its body
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                await self._refuse(send)
                return
            more = msg.get("more_body", False)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, send: Send) -> None:
        msg = f"request body larger than {self.limit} bytes"
        await _send_json(send, 413, error_body(msg, code="request_too_large"))


class BearerAuth:
    """ASGI middleware: /v1 routes need `Authorization: Bearer <key>` (constant-time compare)."""

    def __init__(self, app: Any, api_key: str, metrics: ServerMetrics) -> None:
        self.app, self._key, self.metrics = app, api_key.encode(), metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and str(scope.get("path", "")).startswith("/v1"):
            given = dict(scope.get("headers") or []).get(b"authorization", b"")
            scheme, _, token = given.partition(b" ")
            ok = hmac.compare_digest(token.strip(), self._key) and scheme.lower() == b"bearer"
            if not ok:
                self.metrics.observe_rejected(401)
                body = error_body(
                    "missing or wrong API key", "authentication_error", None, "invalid_api_key"
                )
                await _send_json(send, 401, body)
                return
        await self.app(scope, receive, send)


async def _send_json(send: Send, status: int, payload: dict[str, Any]) -> None:
    body = json.dumps(payload).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", b"%d" % len(body))]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def create_app(
    client: EngineClient, tokenizer: Any, settings: ServerSettings, metrics: ServerMetrics
) -> FastAPI:
    from moetier.server.serving import Serving

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.attach(asyncio.get_running_loop())
        yield
        client.shutdown()  # after uvicorn's graceful shutdown let in-flight requests finish

    app = FastAPI(title="moetier", docs_url=None, redoc_url=None, lifespan=lifespan)
    serving = Serving(client, tokenizer, settings, metrics)
    _install_errors(app, metrics)
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    if settings.api_key:  # outermost: refuse before reading a body
        app.add_middleware(BearerAuth, api_key=settings.api_key, metrics=metrics)

    _add_ops_routes(app, client, metrics)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": settings.served_model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "moetier",
            "max_model_len": client.info.get("max_model_len"),
        }
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    return app


def _add_ops_routes(app: FastAPI, client: EngineClient, metrics: ServerMetrics) -> None:
    """/health and /metrics: outside /v1, so probes and scrapers need no key."""

    @app.get("/health")
    async def health(check: bool = False) -> Response:
        """Alive and the latest counters; `?check=true` also asks the engine (between steps)
        to verify its KV blocks and expert slots and returns fresh counters."""
        if client.dead:
            return JSONResponse({"status": "degraded", "error": client.dead}, status_code=503)
        if not check:
            return JSONResponse({**_fault_status(client), **metrics.engine_snapshot()})
        error, stats = await client.check()
        if error:
            return JSONResponse({"status": "degraded", "error": error}, status_code=503)
        return JSONResponse({**_fault_status(client), **stats})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)


def _fault_status(client: EngineClient) -> dict[str, Any]:
    """Status "ok", or "degraded" with the latest engine step error from FAULT_WINDOW_S."""
    fault = getattr(client, "last_fault", None)
    if fault is None or time.monotonic() - fault[0] > FAULT_WINDOW_S:
        return {"status": "ok"}
    return {
        "status": "degraded",
        "error": fault[1],
        "error_age_s": round(time.monotonic() - fault[0], 3),
        "failed_requests": getattr(client, "failed_requests", 0),
    }


def _install_errors(app: FastAPI, metrics: ServerMetrics) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        metrics.observe_rejected(exc.status)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        kind = str(first.get("type", "invalid"))
        if kind == "json_invalid":
            message, code, loc = "request body is not valid JSON", "invalid_json", []
        else:
            where = ".".join(loc) or "body"
            message, code = f"{where}: {first.get('msg', 'invalid value')}", "invalid_value"
        metrics.observe_rejected(400)
        return APIError(400, message, param=".".join(loc) or None, code=code).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = "not_found" if exc.status_code == 404 else None
        return APIError(exc.status_code, str(exc.detail), code=code).response()

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> Response:
        log.exception("unexpected error serving %s", request.url.path)
        return APIError(500, f"internal error: {type(exc).__name__}", "server_error").response()
