"""The endpoints: OpenAI completions and chat completions (whole or streamed), models, health,
slots and metrics. Handlers only await: tokenization runs in a worker thread (`prompts`),
generation and its detokenization on the engine thread (`EngineLoop`)."""
from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from speculant.engine.scheduler import QueueFullError
from speculant.server.engine_loop import EngineUnavailable, Finished, Progress, RequestHandle
from speculant.server.errors import ApiError, error_body
from speculant.server.metrics import engine_snapshot
from speculant.server.prompts import check_body, encode_chat, encode_prompt
from speculant.server.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from speculant.server.responses import ChatFormat, CompletionFormat, sse, stream_safe_end, usage

ENGINE_CALL_TIMEOUT_S = 30.0  # /slots and /metrics wait at most this long for the engine thread


def add_routes(app: FastAPI) -> None:
    app.add_api_route("/v1/completions", create_completion, methods=["POST"])
    app.add_api_route("/v1/chat/completions", create_chat_completion, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET", "HEAD"])
    app.add_api_route("/slots", slots, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])


# ---- generation ----------------------------------------------------------------------------------

async def create_completion(body: CompletionRequest, request: Request):
    state = request.app.state.server
    state.check_model(body.model)
    check_body(body, state.config)
    prompt = body.prompt
    prompt_ids = prompt if isinstance(prompt, list) else await encode_prompt(
        state.tokenizer, prompt, state.config)
    return await _generate(request, body, prompt_ids, CompletionFormat(state.model_id))


async def create_chat_completion(body: ChatCompletionRequest, request: Request):
    state = request.app.state.server
    state.check_model(body.model)
    check_body(body, state.config)
    messages = [m.template_dict() for m in body.messages]
    prompt_ids = await encode_chat(state.tokenizer, messages, state.config)
    return await _generate(request, body, prompt_ids, ChatFormat(state.model_id))


async def _generate(request: Request, body: SamplingFields, prompt_ids: list[int], fmt):
    state = request.app.state.server
    handle = await _submit(state, body, prompt_ids, fmt.id)
    if body.stream:
        return _EventStream(_stream_events(state, handle, body, fmt),
                            on_close=lambda: _abort_unfinished(state, handle))
    try:
        done = await _until_finished(request, handle)
    finally:
        _abort_unfinished(state, handle)
    if done is None:  # the client left; nobody will read this
        return Response(status_code=499)
    if done.finish_reason == "error":
        raise ApiError(500, f"generation failed: {done.error}", type="server_error",
                       code=fmt.id)
    return JSONResponse(fmt.body(done.text, done.finish_reason,
                                 usage(done.num_prompt, done.num_generated), done.timings))


async def _submit(state, body: SamplingFields, prompt_ids: list[int],
                  request_id: str) -> RequestHandle:
    _check_speculative(state, body)
    max_tokens = body.max_tokens_for(len(prompt_ids), state.max_model_len)
    try:
        params = body.sampling_params(max_tokens)
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    try:
        return await state.loop.add(request_id, prompt_ids, params, body.stream)
    except QueueFullError as exc:
        raise ApiError(429, f"server busy: {exc}", type="rate_limit_error", code="queue_full",
                       headers={"Retry-After": "1"}) from exc
    except ValueError as exc:
        raise ApiError(400, str(exc)) from exc
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), type="server_error", code="engine_unavailable") from exc
    except asyncio.CancelledError:  # the client left while the request was being queued
        state.loop.abort(request_id)
        raise


def _check_speculative(state, body: SamplingFields) -> None:
    spec = body.speculative
    if spec is None or not spec.type:
        return
    unknown = [t for t in spec.type if t not in state.speculators]
    if unknown:
        loaded = ", ".join(state.speculators) or "none"
        raise ApiError(400, f"speculative.type: {unknown} not loaded on this server "
                       f"(loaded: {loaded})", param="speculative.type")


def _abort_unfinished(state, handle: RequestHandle) -> None:
    if not handle.finished:
        handle.finished = True
        state.loop.abort(handle.request_id)


async def _until_finished(request: Request, handle: RequestHandle) -> Finished | None:
    """The request's `Finished` event, or None if the client disconnects first."""
    result = asyncio.ensure_future(_next_finished(handle))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((result, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not result.done():
            result.cancel()
    if result.done() and not result.cancelled():
        handle.finished = True
        return result.result()
    return None


async def _next_finished(handle: RequestHandle) -> Finished:
    while not isinstance(event := await handle.events.get(), Finished):
        pass
    return event


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


class _EventStream(StreamingResponse):
    """Server-sent events that call `on_close` however the stream ends (done, client gone)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def _stream_events(state, handle: RequestHandle, body: SamplingFields, fmt):
    """SSE chunks: text as it is generated, then a final chunk with usage and timings.

    The engine thread sends each step's new text; only a tail that could begin a stop string
    is held back here, so the work per event is bounded by the stop strings, not the output."""
    stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    for chunk in fmt.opening_chunks():
        yield sse(chunk)
    pieces: list[str] = []
    held, num_sent = "", 0
    while (done := await _collect(handle, pieces)) is None:
        held += "".join(pieces)
        pieces.clear()
        end = stream_safe_end(held, stops)
        if end:
            yield sse(fmt.chunk(held[:end]))
            held, num_sent = held[end:], num_sent + end
    handle.finished = True
    if done.finish_reason == "error":
        yield sse(error_body(f"generation failed: {done.error}", "server_error", code=fmt.id))
        yield sse("[DONE]")
        return
    if len(done.text) > num_sent:  # held text, and text the last step completed
        yield sse(fmt.chunk(done.text[num_sent:]))
    use = usage(done.num_prompt, done.num_generated)
    yield sse(fmt.chunk("", done.finish_reason, usage=use, timings=done.timings))
    if body.stream_options is not None and body.stream_options.include_usage:
        yield sse(fmt.usage_chunk(use))
    yield sse("[DONE]")


async def _collect(handle: RequestHandle, pieces: list[str]) -> Finished | None:
    """Wait for events, then take every queued one (a slow client gets fewer, longer chunks)."""
    event = await handle.events.get()
    while True:
        if isinstance(event, Finished):
            return event
        if isinstance(event, Progress):
            pieces.append(event.text)
        if handle.events.empty():
            return None
        event = handle.events.get_nowait()


# ---- information ---------------------------------------------------------------------------------

async def list_models(request: Request):
    state = request.app.state.server
    return {"object": "list", "data": [{
        "id": state.model_id, "object": "model", "created": state.created,
        "owned_by": "speculant", "max_model_len": state.max_model_len,
        "speculators": list(state.speculators),
    }]}


async def health(request: Request):
    if request.app.state.server.loop.alive:
        return {"status": "ok"}
    return JSONResponse({"status": "error", "message": "engine thread is not running"},
                        status_code=503)


async def slots(request: Request):
    return await _engine_call(request, lambda loop: loop.slots())


async def metrics(request: Request):
    state = request.app.state.server
    snapshot = await _engine_call(request, lambda loop: loop.call(engine_snapshot))
    return Response(state.metrics.render(snapshot), media_type=CONTENT_TYPE_LATEST)


async def _engine_call(request: Request, fn):
    """`fn(engine_loop)`, answered between two engine steps (or a 503 if none comes)."""
    try:
        return await asyncio.wait_for(fn(request.app.state.server.loop), ENGINE_CALL_TIMEOUT_S)
    except EngineUnavailable as exc:
        raise ApiError(503, str(exc), type="server_error", code="engine_unavailable") from exc
    except asyncio.TimeoutError as exc:
        raise ApiError(503, f"the engine did not answer within {ENGINE_CALL_TIMEOUT_S:.0f} s "
                       "(a step is taking that long)", type="server_error",
                       code="engine_busy") from exc
