"""The engine thread: the only thread that ever touches the engine.

The engine is not thread-safe, so HTTP handlers never call it. They post commands to an inbox
(a thread-safe queue) and await events on their request's own `asyncio.Queue`, which the engine
thread fills with `loop.call_soon_threadsafe`. The thread sleeps on the inbox while the engine has
nothing to do and otherwise alternates: drain the inbox (add / abort / call), run one `step()` for
every running request together, post what each request got.

Events of one request, in order: `Accepted` or `Rejected`; then, for streaming requests,
`Progress` (new token ids) after each step that produced tokens; finally one `Finished` that
carries the final text, usage and timings. A finished request is released from the engine at
once; an aborted one (client gone) frees its KV cache before the next step.
"""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from speculant.engine.sampling_params import SamplingParams
from speculant.engine.scheduler import QueueFullError
from speculant.server.responses import request_timings

log = logging.getLogger("speculant.server")


# ---- events (engine thread -> one request's handler) ---------------------------------------------

@dataclass(slots=True, frozen=True)
class Accepted:
    num_prompt: int


@dataclass(slots=True, frozen=True)
class Rejected:
    error: Exception


@dataclass(slots=True, frozen=True)
class Progress:
    token_ids: list[int]  # tokens appended by the last step
    text: str  # the text they completed (decoded incrementally on the engine thread)


@dataclass(slots=True, frozen=True)
class Finished:
    text: str  # the whole output, stop strings cut
    finish_reason: str  # "stop" | "length" | "abort" | "error"
    error: str | None
    num_prompt: int
    num_generated: int
    timings: dict


@dataclass(slots=True)
class RequestHandle:
    """The handler's side of one request: its id and the queue its events arrive on."""

    request_id: str
    stream: bool
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    finished: bool = False  # set by the handler once it has seen `Finished`


# ---- commands (handlers -> engine thread) --------------------------------------------------------

@dataclass(slots=True)
class _Add:
    handle: RequestHandle
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Call:
    fn: Callable[[Any], Any]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop


_STOP = object()


class EngineUnavailable(RuntimeError):
    """The engine thread is not running (not started yet, stopped, or shutting down)."""


class EngineLoop:
    """Owns the engine thread. `add`, `abort` and `call` may be used from the event loop."""

    def __init__(self, engine, on_finish: Callable[[Any], None] | None = None):
        self.engine = engine
        self.on_finish = on_finish  # called on the engine thread with each finished Sequence
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._handles: dict[str, tuple[RequestHandle, Any]] = {}  # request id -> (handle, seq)
        self._slot_of: dict[str, int] = {}  # request id -> slot index shown by /slots
        self._thread: threading.Thread | None = None

    # ---- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        if self._thread is not None:
            raise RuntimeError("engine loop already started")
        self._thread = threading.Thread(target=self._run, name="speculant-engine", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        if self._thread is None:
            return
        self._inbox.put(_STOP)
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    # ---- event-loop side -------------------------------------------------------------------------

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  stream: bool) -> RequestHandle:
        """Queue a request; raises what the engine raised (ValueError, QueueFullError)."""
        if not self.alive:
            raise EngineUnavailable("the engine thread is not running")
        handle = RequestHandle(request_id, stream, asyncio.get_running_loop())
        self._inbox.put(_Add(handle, prompt_ids, params))
        event = await handle.events.get()
        if isinstance(event, Rejected):
            raise event.error
        return handle

    def abort(self, request_id: str) -> None:
        """Stop a request and free its KV cache (no-op if it already finished)."""
        self._inbox.put(_Abort(request_id))

    async def call(self, fn: Callable[[Any], Any]) -> Any:
        """Run `fn(engine)` on the engine thread (between steps) and return its result."""
        if not self.alive:
            raise EngineUnavailable("the engine thread is not running")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._inbox.put(_Call(fn, future, loop))
        return await future

    async def slots(self) -> dict:
        return await self.call(self._slots_now)

    # ---- engine thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._drain(block=not self.engine.has_unfinished()):
                if self.engine.has_unfinished():
                    self._step()
        finally:
            self._shutdown()

    def _drain(self, block: bool) -> bool:
        """Handle every queued command (waiting for one if `block`); False once told to stop."""
        try:
            cmd = self._inbox.get(block=block)
        except queue.Empty:
            return True
        while True:
            if cmd is _STOP:
                return False
            self._handle(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _handle(self, cmd) -> None:
        if isinstance(cmd, _Add):
            self._add(cmd)
        elif isinstance(cmd, _Abort):
            entry = self._handles.get(cmd.request_id)
            if entry is not None and self.engine.abort(cmd.request_id):
                self._finish(entry[1])
        else:
            self._call(cmd)

    def _add(self, cmd: _Add) -> None:
        handle = cmd.handle
        try:
            seq = self.engine.add_request(cmd.prompt_ids, cmd.params, handle.request_id)
        except (ValueError, QueueFullError) as exc:
            _post(handle, Rejected(exc))
            return
        except Exception as exc:  # an engine bug fails this request, not the thread
            log.exception("add_request failed")
            _post(handle, Rejected(exc))
            return
        self._handles[handle.request_id] = (handle, seq)
        _post(handle, Accepted(seq.num_prompt))

    def _call(self, cmd: _Call) -> None:
        try:
            result, error = cmd.fn(self.engine), None
        except Exception as exc:
            result, error = None, exc
        cmd.loop.call_soon_threadsafe(_resolve, cmd.future, result, error)

    def _step(self) -> None:
        try:
            updates = self.engine.step()
        except Exception:  # the engine contains request failures; anything else is a bug
            log.exception("engine step failed")
            self._fail_all("engine step failed; details are in the server log")
            return
        for update in updates:
            seq = update.seq
            if update.finished:
                self._finish(seq)
            elif update.new_token_ids:
                entry = self._handles.get(seq.request_id)
                if entry is not None and entry[0].stream:
                    _post(entry[0], Progress(list(update.new_token_ids), update.new_text))

    def _finish(self, seq, reason: str | None = None, error: str | None = None) -> None:
        entry = self._handles.pop(seq.request_id, None)
        if entry is not None:
            try:
                text = self.engine.output_text(seq)
            except Exception:  # a detokenization failure fails this request only
                log.exception("request %s: output text failed", seq.request_id)
                text, reason = "", "error"
                error = f"request {seq.request_id} failed; details are in the server log"
            _post(entry[0], Finished(
                text=text, finish_reason=reason or seq.finish_reason,
                error=error or seq.error, num_prompt=seq.num_prompt,
                num_generated=seq.num_generated, timings=request_timings(seq)))
        if self.on_finish is not None:
            self.on_finish(seq)
        self.engine.release(seq)

    def _fail_all(self, message: str) -> None:
        for _, seq in list(self._handles.values()):
            try:
                self.engine.abort(seq.request_id)
            except Exception:
                log.exception("abort after a failed step failed")
            self._finish(seq, "error", message)

    def _shutdown(self) -> None:
        self._fail_all("server shutting down")
        try:  # what speculators keep across runs (ngram_cache's dynamic table) is written now
            self.engine.save_speculators()
        except Exception:
            log.exception("saving speculator state failed")
        while True:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                _post(cmd.handle, Rejected(EngineUnavailable("server shutting down")))
            elif isinstance(cmd, _Call):
                cmd.loop.call_soon_threadsafe(
                    _resolve, cmd.future, None, EngineUnavailable("server shutting down"))

    def _slots_now(self, engine) -> dict:
        """What each of the `max_num_seqs` slots is doing; slot ids are stable per request."""
        status = engine.status()
        running = {s.request_id: s for s in status.running}
        self._slot_of = {r: i for r, i in self._slot_of.items() if r in running}
        free = sorted(set(range(status.max_num_seqs)) - set(self._slot_of.values()))
        for rid in running:
            if rid not in self._slot_of and free:
                self._slot_of[rid] = free.pop(0)
        by_slot = {i: running[r] for r, i in self._slot_of.items()}
        return {
            "parallel": status.max_num_seqs,
            "num_running": len(running),
            "num_waiting": status.num_waiting,
            "kv_cache": {"num_blocks": status.num_blocks, "num_free_blocks": status.num_free_blocks,
                         "block_size": status.block_size},
            "slots": [_slot_info(i, by_slot.get(i), engine)
                      for i in range(status.max_num_seqs)],
        }


def _slot_info(slot_id: int, seq, engine) -> dict:
    if seq is None:
        return {"id": slot_id, "state": "idle"}
    p = seq.params
    return {
        "id": slot_id,
        "state": "prefill" if seq.is_prefilling else "decode",
        "request_id": seq.request_id,
        "prompt_tokens": seq.num_prompt,
        "computed_tokens": seq.num_computed,
        "generated_tokens": seq.num_generated,
        "max_tokens": p.max_tokens,
        "temperature": p.temperature,
        "speculative": {
            "types": list(seq.spec_types),
            "n_max": engine.config.spec_n_max if p.spec.n_max is None else p.spec.n_max,
            "num_drafts": seq.spec.num_drafts,
            "num_draft_tokens": seq.spec.num_draft_tokens,
            "num_accepted_tokens": seq.spec.num_accepted_tokens,
        },
    }


def _post(handle: RequestHandle, event) -> None:
    try:
        handle.loop.call_soon_threadsafe(handle.events.put_nowait, event)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _resolve(future: asyncio.Future, result, error: Exception | None) -> None:
    if future.done():  # the caller gave up (cancelled)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
