"""Scale-out on Ray Serve: N engine replicas behind one OpenAI endpoint.

Two kinds of deployment:

- `EngineReplica` (one deployment per replica, `speculant-replica-<i>`, one Ray Serve replica
  each): the single-process server's own app (`create_app`), driven in process through ASGI, so
  routes, validation, errors, streaming and metrics are those of `speculant serve`. It asks Ray
  for as many CPUs as it runs threads, so replicas never oversubscribe the cores. Ray Serve
  health-checks it (`check_health`: the engine thread runs) and restarts it when it dies.
- `Router` (the HTTP ingress, no CPU reserved): picks a replica per request with
  `ReplicaRouter` (session / prompt-prefix affinity while healthy, else least-loaded) and relays
  the replica's response. A replica that fails before any byte reached the client is marked down
  and the request is retried once on another replica; one that dies mid-stream ends that stream
  with an OpenAI error event (`code: replica_died`). `/metrics` merges every replica's metrics,
  each sample labelled `replica="<name>"`, with the router's own; `/health` and `/slots` report
  per replica.

One deployment per replica (rather than one deployment with N replicas) is what lets the router
choose the replica: Ray Serve's handle would otherwise pick one itself. The price is no Ray
autoscaling; the replica count is fixed by `replicas`.

Run it with `speculant serve --replicas N` (starts a local Ray instance), or on a running Ray
cluster: `serve run speculant.server.ray_serve:build_app replicas=2 spec_type=ngram_mod,suffix`
(`build_app` arguments: `ScaleOutConfig` and `EngineConfig` field names).
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import secrets
import signal
import time
from dataclasses import dataclass

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from speculant.engine.config import EngineConfig
from speculant.server.config import ServerConfig
from speculant.server.errors import ApiError, error_body
from speculant.server.replica_router import (NoHealthyReplica, ReplicaRouter, prompt_key,
                                             session_of)
from speculant.server.replica_metrics import RouterMetrics, merge_replica_metrics

log = logging.getLogger("speculant.server.ray")

REPLICA_PREFIX = "speculant-replica-"
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
MAX_ATTEMPTS = 2  # a request that got no byte from a failed replica is tried once elsewhere
CALL_TIMEOUT_S = 30.0  # /metrics, /slots, /v1/models answers from a replica
HEALTH_TIMEOUT_S = 5.0
REPLICA_DIED = (RayActorError, ActorUnavailableError)  # the replica process is gone


@dataclass(slots=True)
class ScaleOutConfig:
    replicas: int = 2
    threads_per_replica: int | None = None  # None: the cores divided among the replicas
    api_key: str | None = None  # required as 'Authorization: Bearer KEY' except on /health
    model_id: str | None = None  # the name /v1/models reports (default: the model file's)
    health_period_s: float = 1.0  # the router probes every replica this often

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be >= 1, got {self.replicas}")
        if self.threads_per_replica is not None and self.threads_per_replica < 1:
            raise ValueError(f"threads_per_replica must be >= 1, got {self.threads_per_replica}")

    def threads(self, num_cpus: int) -> int:
        """Threads per replica: as set, else an equal share of `num_cpus` (at least 1)."""
        return self.threads_per_replica or max(1, num_cpus // self.replicas)


def replica_names(num_replicas: int) -> list[str]:
    return [f"{REPLICA_PREFIX}{i}" for i in range(num_replicas)]


# ---- one engine replica -----------------------------------------------------------------------

QUIET = {"enable_access_log": False}  # no log line per request and per health probe


@serve.deployment(health_check_period_s=1.0, health_check_timeout_s=10.0,
                  graceful_shutdown_timeout_s=5.0, logging_config=QUIET)
class EngineReplica:
    """The single-process server's app in a Ray actor, called by the router through ASGI."""

    async def __init__(self, config: EngineConfig, name: str, model_id: str | None,
                       server: ServerConfig):
        from speculant.server.app import create_app

        self.name = name
        self._app = create_app(config, model_id=model_id, config=server)
        self._lifespan = _Lifespan(self._app)
        await self._lifespan.start()
        self._tasks: set[asyncio.Task] = set()
        log.info("replica %s (pid %d) serving with %s threads", name, os.getpid(),
                 config.num_threads)

    async def handle(self, method: str, path: str, headers: list[tuple[str, str]], body: bytes):
        """The app's ASGI response messages for one request, as they come (a stream of lists:
        every message ready when the router asks, so a whole JSON answer is one Ray item)."""
        async for batch in asgi_messages(self._app, method, path, headers, body, self._tasks):
            yield batch

    async def get(self, path: str) -> tuple[int, bytes]:
        """(status, body) of a GET on the app (/health, /metrics, /slots, /v1/models)."""
        status, chunks = 500, []
        async for batch in asgi_messages(self._app, "GET", path, [], b"", self._tasks):
            for message in batch:
                status = message.get("status", status)
                chunks.append(message.get("body", b""))
        return status, b"".join(chunks)

    async def ping(self) -> dict:
        status, _ = await self.get("/health")
        return {"name": self.name, "pid": os.getpid(), "healthy": status == 200}

    async def check_health(self) -> None:
        """Ray Serve restarts the replica when this raises."""
        if not (await self.ping())["healthy"]:
            raise RuntimeError(f"replica {self.name}: the engine thread is not running")

    async def __del__(self):
        await self._lifespan.stop()


class _Lifespan:
    """Runs an ASGI app's lifespan (startup now, shutdown later), as uvicorn would."""

    def __init__(self, app):
        self._app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._outbox: asyncio.Queue = asyncio.Queue()
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        scope = {"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}}
        self._task = asyncio.ensure_future(self._app(scope, self._inbox.get, self._outbox.put))
        await self._expect("lifespan.startup")

    async def stop(self) -> None:
        if self._task is not None and not self._task.done():
            await self._expect("lifespan.shutdown")

    async def _expect(self, event: str) -> None:
        await self._inbox.put({"type": event})
        reply = await self._outbox.get()
        if reply["type"] != event + ".complete":
            raise RuntimeError(f"{event} failed: {reply.get('message', reply)}")


async def asgi_messages(app, method: str, path: str, headers: list[tuple[str, str]],
                        body: bytes, tasks: set):
    """Drive one HTTP request through `app` in process; yield its response messages in lists
    (all those ready at once: fewer, larger items to send to the router).

    Closing the generator early (the client left) tells the app the client disconnected, so it
    aborts the request and frees its KV cache as it does under uvicorn."""
    sent: asyncio.Queue = asyncio.Queue()
    disconnected = asyncio.Event()
    body_taken = False

    async def receive() -> dict:
        nonlocal body_taken
        if not body_taken:
            body_taken = True
            return {"type": "http.request", "body": body, "more_body": False}
        await disconnected.wait()
        return {"type": "http.disconnect"}

    async def run() -> None:
        try:
            await app(_http_scope(method, path, headers), receive, sent.put)
        finally:
            sent.put_nowait(None)

    task = asyncio.ensure_future(run())
    tasks.add(task)  # keeps the task alive until the app has finished, even after a disconnect
    task.add_done_callback(tasks.discard)
    try:
        done = False
        while not done:
            batch = [await sent.get()]
            while not sent.empty():
                batch.append(sent.get_nowait())
            done = batch[-1] is None
            if batch := [_plain(m) for m in batch if m is not None]:
                yield batch
        await task
    finally:
        disconnected.set()


def _plain(message: dict) -> dict:
    return {k: v for k, v in message.items() if k in ("type", "status", "headers", "body",
                                                      "more_body")}


def _http_scope(method: str, path: str, headers: list[tuple[str, str]]) -> dict:
    path, _, query = path.partition("?")
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": query.encode(), "root_path": "",
            "headers": [(k.lower().encode(), v.encode()) for k, v in headers],
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0), "state": {}}


# ---- the ingress --------------------------------------------------------------------------------

@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=10_000,
                  graceful_shutdown_timeout_s=5.0, logging_config=QUIET)
class Router:
    """The OpenAI endpoint: routes each request to a replica and relays its answer."""

    async def __init__(self, config: ScaleOutConfig, *replicas):
        self.config = config
        self.names = replica_names(len(replicas))
        self.handles = dict(zip(self.names, replicas))
        self.router = ReplicaRouter(self.names)
        self.metrics = RouterMetrics(self.names)
        self._pids: dict[str, int | None] = dict.fromkeys(self.names)
        self._expected_auth = f"Bearer {config.api_key}".encode() if config.api_key else None
        self._health_task = asyncio.ensure_future(self._watch_health())

    async def __call__(self, request: Request) -> Response:
        try:
            self._check_key(request)
            return await self._dispatch(request)
        except ApiError as exc:
            return exc.response()

    def _check_key(self, request: Request) -> None:
        if self._expected_auth is None or request.url.path == "/health":
            return
        given = request.headers.get("authorization", "").encode()
        if not secrets.compare_digest(given, self._expected_auth):
            raise ApiError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                           code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _dispatch(self, request: Request) -> Response:
        path, method = request.url.path, request.method
        if method == "POST" and path in GENERATE_PATHS:
            return await self._generate(request)
        if method in ("GET", "HEAD") and path == "/health":
            return self._health()
        if method == "GET" and path == "/metrics":
            return await self._metrics()
        if method == "GET" and path == "/slots":
            return await self._slots()
        if method == "GET" and path in ("/v1/models", "/openapi.json"):
            status, body = await self._get_any(path)
            return Response(body, status_code=status, media_type="application/json")
        raise ApiError(404, f"Not Found: {method} {path}", type="invalid_request_error")

    # ---- generation ---------------------------------------------------------------------------

    async def _generate(self, request: Request) -> Response:
        body = await request.body()
        parsed = _json_object(body)
        session, key = session_of(request.headers, parsed), prompt_key(parsed)
        headers = [(k, v) for k, v in request.headers.items() if k in ("content-type", "accept")]
        failed: list[str] = []
        for _ in range(MAX_ATTEMPTS):
            try:
                route = self.router.route(session, key, exclude=failed)
            except NoHealthyReplica as exc:
                raise ApiError(503, str(exc), type="server_error", code="no_replica") from exc
            self.metrics.routed(route)
            stream = self.handles[route.replica].options(stream=True).handle.remote(
                request.method, request.url.path, headers, body)
            messages = _flatten(stream)
            try:
                start, first = await _opening(messages)
            except REPLICA_DIED as exc:
                self._lost(route.replica, "before_output", exc)
                failed.append(route.replica)
                continue
            except BaseException:  # the client left (cancelled) or the call failed otherwise
                stream.cancel()
                self.router.done(route.replica)
                raise
            return self._relay(route.replica, stream, messages, start, first)
        raise ApiError(503, f"replicas {', '.join(failed)} failed before answering; "
                       "nothing was generated", type="server_error", code="replica_died")

    def _relay(self, replica: str, stream, messages, start: dict, first: dict) -> Response:
        headers = {k.decode(): v.decode() for k, v in start["headers"]
                   if k.lower() != b"content-length"}
        headers["x-speculant-replica"] = replica
        if not first.get("more_body", False):  # a whole (non-streamed) answer
            self.router.done(replica)
            return Response(first.get("body", b""), status_code=start["status"], headers=headers)
        return StreamingResponse(self._rest(replica, stream, messages, first),
                                 status_code=start["status"], headers=headers)

    async def _rest(self, replica: str, stream, messages, first: dict):
        try:
            yield first.get("body", b"")
            async for message in messages:
                if message.get("body"):
                    yield message["body"]
        except REPLICA_DIED as exc:
            self._lost(replica, "mid_stream", exc, count_done=False)
            text = (f"replica {replica} died mid-stream ({type(exc).__name__}); the output "
                    "above is incomplete; Ray Serve is restarting the replica")
            yield _sse(error_body(text, "server_error", code="replica_died"))
            yield _sse("[DONE]")
        finally:  # also when the client left: cancelling the call aborts the request there
            stream.cancel()
            self.router.done(replica)

    def _lost(self, replica: str, stage: str, exc: BaseException, count_done: bool = True) -> None:
        log.warning("replica %s failed %s: %s", replica, stage, exc)
        self.router.set_healthy(replica, False)
        self.metrics.failed(replica, stage)
        if count_done:
            self.router.done(replica)

    # ---- information --------------------------------------------------------------------------

    def _health(self) -> Response:
        # A replica no probe has answered yet is not reported healthy (its pid is still unknown).
        replicas = {n: {"healthy": self.router.is_healthy(n) and self._pids[n] is not None,
                        "pid": self._pids[n],
                        "in_flight": self.router.in_flight(n)} for n in self.names}
        ok = any(r["healthy"] for r in replicas.values())
        return JSONResponse({"status": "ok" if ok else "error", "replicas": replicas},
                            status_code=200 if ok else 503)

    async def _metrics(self) -> Response:
        answers = await self._get_all("/metrics")
        texts = {n: body.decode() for n, (status, body) in answers.items() if status == 200}
        for name in self.names:
            self.metrics.set_state(name, self.router.is_healthy(name), self.router.in_flight(name))
        text = merge_replica_metrics(texts) + self.metrics.render()
        return Response(text, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _slots(self) -> Response:
        answers = await self._get_all("/slots")
        out = {n: json.loads(body) if status == 200 else {"error": body.decode(errors="replace")}
               for n, (status, body) in answers.items()}
        return JSONResponse({"replicas": out})

    async def _get_any(self, path: str) -> tuple[int, bytes]:
        for name in self.names:
            if self.router.is_healthy(name):
                answer = await self._get(name, path)
                if answer[0] != 599:
                    return answer
        raise ApiError(503, "no healthy engine replica", type="server_error", code="no_replica")

    async def _get_all(self, path: str) -> dict[str, tuple[int, bytes]]:
        names = [n for n in self.names if self.router.is_healthy(n)]
        answers = await asyncio.gather(*(self._get(n, path) for n in names))
        return dict(zip(names, answers))

    async def _get(self, name: str, path: str) -> tuple[int, bytes]:
        """(status, body) from one replica; 599 and the reason when it does not answer."""
        try:
            return await asyncio.wait_for(self.handles[name].get.remote(path), CALL_TIMEOUT_S)
        except (asyncio.TimeoutError, *REPLICA_DIED) as exc:
            return 599, f"replica {name} did not answer: {type(exc).__name__}".encode()

    async def _watch_health(self) -> None:
        """Probe every replica each period; a restarted replica is routed to again once up."""
        while True:
            await asyncio.gather(*(self._probe(n) for n in self.names))
            await asyncio.sleep(self.config.health_period_s)

    async def _probe(self, name: str) -> None:
        try:
            info = await asyncio.wait_for(self.handles[name].ping.remote(), HEALTH_TIMEOUT_S)
        except (asyncio.TimeoutError, *REPLICA_DIED, ray.exceptions.RayError):
            info = {"healthy": False, "pid": None}
        if info["pid"] is not None and info["pid"] != self._pids[name] and self._pids[name]:
            log.warning("replica %s restarted: pid %s -> %s", name, self._pids[name], info["pid"])
            self.metrics.restarted(name)
        self._pids[name] = info["pid"] or self._pids[name]
        self.router.set_healthy(name, info["healthy"])


async def _flatten(stream):
    """A replica's batches of ASGI messages, one message at a time."""
    async for batch in stream:
        for message in batch:
            yield message


async def _opening(messages) -> tuple[dict, dict]:
    """The response start and its first body message (nothing has reached the client yet)."""
    start = await messages.__anext__()
    first = {"type": "http.response.body", "body": b"", "more_body": False}
    async for first in messages:
        break
    return start, first


def _json_object(body: bytes) -> dict:
    try:
        parsed = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return {}
    return parsed if isinstance(parsed, dict) else {}


def _sse(data) -> bytes:
    return f"data: {data if isinstance(data, str) else json.dumps(data)}\n\n".encode()


# ---- building and running -----------------------------------------------------------------------

def build(engine: EngineConfig, scale: ScaleOutConfig, server: ServerConfig | None = None,
          num_cpus: int | None = None):
    """The Ray Serve application: `scale.replicas` engine replicas (each with the request limits
    of `server`) and the router."""
    threads = scale.threads(num_cpus or os.cpu_count() or 1)
    engine = dataclasses.replace(engine, num_threads=threads)
    replicas = []
    for name in replica_names(scale.replicas):
        deployment = EngineReplica.options(
            name=name, num_replicas=1, max_ongoing_requests=engine.max_num_seqs +
            engine.max_queue + 16,  # beyond this Ray queues; the engine's 429 must come first
            ray_actor_options={"num_cpus": threads,
                               "runtime_env": {"env_vars": {"OMP_NUM_THREADS": str(threads)}}})
        replicas.append(deployment.bind(engine, name, scale.model_id, server or ServerConfig()))
    return Router.options(name="speculant-router").bind(scale, *replicas)


def build_app(args: dict | None = None):
    """Ray Serve application builder: `serve run speculant.server.ray_serve:build_app k=v ...`.

    Keys are field names of `ScaleOutConfig` (`replicas`, `threads_per_replica`, `api_key`, ...),
    `EngineConfig` (`model`, `spec_type`, `max_num_seqs`, `kv_cache_tokens`, ...) and
    `ServerConfig` (`max_prompt_tokens`, ...); values are parsed as JSON when they are JSON
    (`spec_options='{"ngram_mod": {"n_match": 16}}'`)."""
    values = {k.replace("-", "_"): _value(v) for k, v in (args or {}).items()}
    parts = {cls: {k: v for k, v in values.items() if k in _field_names(cls)}
             for cls in (ScaleOutConfig, EngineConfig, ServerConfig)}
    unknown = set(values) - {k for part in parts.values() for k in part}
    if unknown:
        raise ValueError(f"unknown build_app arguments: {sorted(unknown)}")
    cpus = int(ray.cluster_resources().get("CPU", os.cpu_count() or 1)) if ray.is_initialized() \
        else None
    return build(EngineConfig(**parts[EngineConfig]), ScaleOutConfig(**parts[ScaleOutConfig]),
                 ServerConfig(**parts[ServerConfig]), cpus)


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _value(text):
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def serve_replicas(engine: EngineConfig, scale: ScaleOutConfig, server: ServerConfig, host: str,
                   port: int, ray_address: str = "local") -> None:
    """`speculant serve --replicas N`: start (or join) Ray, deploy, serve until interrupted."""
    num_cpus = os.cpu_count() or 1
    threads = scale.threads(num_cpus)
    if scale.replicas * threads > num_cpus:
        log.warning("%d replicas x %d threads oversubscribe %d cores", scale.replicas, threads,
                    num_cpus)
    local = {"num_cpus": max(num_cpus, scale.replicas * threads), "_node_ip_address": "127.0.0.1"}
    ray.init(address=ray_address, include_dashboard=False, logging_level=logging.WARNING,
             **(local if ray_address == "local" else {}))
    signal.signal(signal.SIGTERM, _interrupt)  # `kill` stops Ray's processes too
    try:
        serve.start(http_options={"host": host, "port": port})
        t0 = time.perf_counter()
        serve.run(build(engine, scale, server, num_cpus), name="speculant", route_prefix="/")
        print(f"[speculant] {scale.replicas} replicas x {threads} threads ready in "
              f"{time.perf_counter() - t0:.1f} s; serving on http://{host}:{port}", flush=True)
        while True:
            time.sleep(3600)
    finally:
        serve.shutdown()
        ray.shutdown()


def _interrupt(*_) -> None:
    raise KeyboardInterrupt
