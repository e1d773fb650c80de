"""The HTTP application, built by `create_app`: all state lives in the app, none in modules.

`create_app(engine_or_config)` wraps an `Engine` (or builds one from an `EngineConfig`) in an
`EngineLoop` thread that starts and stops with the app's lifespan, so the same app runs under
uvicorn (`speculant serve`) or any ASGI test client.
"""
from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from speculant.engine.config import EngineConfig
from speculant.server.config import ServerConfig
from speculant.server.engine_loop import EngineLoop
from speculant.server.errors import ApiError, validation_error
from speculant.server.metrics import ServerMetrics
from speculant.server.middleware import ApiKey, BoundedBody, StatusCounter
from speculant.server.openapi import document_errors
from speculant.server.routes import add_routes

log = logging.getLogger("speculant.server")

DEFAULT_MODEL_NAME = "default"  # always accepted in a request's `model`


@dataclass(slots=True)
class ServerState:
    """What the route handlers share: the engine thread, metrics, and the model's identity."""

    loop: EngineLoop
    metrics: ServerMetrics
    tokenizer: object  # speculant.models.tokenizer.Tokenizer; thread-safe for encode / decode
    model_id: str
    max_model_len: int
    speculators: tuple[str, ...]  # loaded in the engine's chain
    config: ServerConfig = field(default_factory=ServerConfig)
    model_names: frozenset[str] = frozenset()
    created: int = field(default_factory=lambda: int(time.time()))

    def check_model(self, name: str) -> None:
        if name not in self.model_names:
            raise ApiError(404, f"model {name!r} not found: this server serves "
                           f"{self.model_id!r} (or use {DEFAULT_MODEL_NAME!r})",
                           param="model", code="model_not_found")


def create_app(engine_or_config, api_key: str | None = None, model_id: str | None = None,
               max_queue: int | None = None, config: ServerConfig | None = None) -> FastAPI:
    """An app serving `engine_or_config` (an `Engine`, or an `EngineConfig` to build one).

    `api_key`: when set, every path but `/health` needs `Authorization: Bearer <api_key>`.
    `model_id`: the name `/v1/models` reports (default: the model file or folder name).
    `max_queue`: requests that may wait for a slot before new ones get 429 (default: the
    engine's `max_queue`).
    `config`: request limits and prompt handling (default: `ServerConfig()`).
    """
    config = config or ServerConfig()
    engine = engine_or_config
    if isinstance(engine_or_config, EngineConfig):
        from speculant.engine.engine import Engine

        engine = Engine(engine_or_config)
    if max_queue is not None:
        engine.set_limits(max_queue=max_queue)
    metrics = ServerMetrics()
    model_id = model_id or _model_id(engine.model_path)
    state = ServerState(
        loop=EngineLoop(engine, on_finish=metrics.observe_finished),
        metrics=metrics,
        tokenizer=engine.tokenizer, model_id=model_id, max_model_len=engine.max_model_len,
        speculators=tuple(engine.speculator_names), config=config,
        model_names=frozenset({model_id, DEFAULT_MODEL_NAME, engine.config.model}))

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        from speculant.kernels.native import (kernel_path, kv_attention, prompt_attention,
                                              thread_team, vnni_wide_rows,
                                              weight_prefetch_blocks)

        log.info("CPU kernel path: %s (SPECULANT_KERNEL_PATH=auto|avx2|avx512_vnni|amx_int8 "
                 "forces one), weight prefetch %s blocks ahead (SPECULANT_PREFETCH_BLOCKS), "
                 "VNNI wide row tiles from %s rows (SPECULANT_VNNI_WIDE_ROWS), "
                 "prompt attention %s (SPECULANT_PROMPT_ATTENTION=auto|fp32), KV cache %s "
                 "(--kv-dtype; bfloat16: every position attended on %s, "
                 "SPECULANT_KV_ATTENTION=auto|avx512_bf16), threads: "
                 "%s (OMP_WAIT_POLICY=passive before torch loads: the kernels' pool)",
                 kernel_path(), weight_prefetch_blocks(), vnni_wide_rows(), prompt_attention(),
                 engine.config.kv_dtype, kv_attention(), thread_team())
        state.loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(state.loop.stop)

    app = FastAPI(title="speculant", description="OpenAI-compatible speculative decoding server",
                  lifespan=lifespan)
    app.state.server = state
    # The last added runs first: count every status, check the key, then read the body.
    app.add_middleware(BoundedBody, max_bytes=config.max_body_bytes,
                       timeout_s=config.body_timeout_s)
    if api_key:
        app.add_middleware(ApiKey, api_key=api_key)
    app.add_middleware(StatusCounter, metrics=metrics)
    _add_error_handlers(app)
    add_routes(app)
    document_errors(app, with_auth=bool(api_key))
    return app


def _model_id(model_path: str) -> str:
    name = os.path.basename(os.path.normpath(model_path))
    return name.removesuffix(".gguf") or DEFAULT_MODEL_NAME


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(request: Request, exc: ApiError):
        if exc.status < 500:
            request.app.state.server.metrics.rejected.labels(exc.code or "invalid_request").inc()
        return exc.response()

    async def invalid_request(request: Request, exc: RequestValidationError):
        return await api_error(request, validation_error(exc.errors()))

    async def http_error(request: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "server_error"
        message = f"{exc.detail}: {request.method} {request.url.path}"
        return ApiError(exc.status_code, message, type=kind,
                        headers=getattr(exc, "headers", None)).response()

    async def server_error(request: Request, exc: Exception):
        # Details go to the log under an id the client gets; the client gets nothing else.
        # (This handler runs outside the middleware that counts statuses: count here.)
        error_id = f"err-{uuid.uuid4().hex[:16]}"
        log.error("unhandled error %s on %s %s", error_id, request.method, request.url.path,
                  exc_info=exc)
        request.app.state.server.metrics.errors.labels("500").inc()
        return ApiError(500, f"internal server error (request id {error_id}; details are in "
                        "the server log)", type="server_error", code=error_id).response()

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(RequestValidationError, invalid_request)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_exception_handler(Exception, server_error)
