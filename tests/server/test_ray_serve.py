"""`speculant serve --replicas 2` on a local Ray instance, against a single-process server.

Two replicas with one thread each and the model-free chain; one module-wide Ray instance (~15 s
to start). The kill test runs last: it leaves a freshly restarted replica behind.
"""
import concurrent.futures
import contextlib
import ctypes
import json
import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest

pytest.importorskip("ray.serve", reason="needs the ray extra: pip install 'speculant[ray]'")

API_KEY = "sk-ray-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
SPEC = ["--spec-type", "ngram_mod,suffix", "--kv-cache-tokens", "8192", "--parallel", "8"]
REPLICAS = ("speculant-replica-0", "speculant-replica-1")


def _free_port() -> int:
    """A free port outside the kernel's ephemeral range and Ray's worker ports (10002-19999):
    Ray's own processes bind ephemeral ports while the cluster starts, and once took the one
    handed to the HTTP proxy (measured: "Failed to bind to address 127.0.0.1:39185")."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port in 20000-32000")


def _die_with_parent() -> None:
    """A new session (our signals never reach Ray's processes), killed if pytest dies."""
    os.setsid()
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


@contextlib.contextmanager
def _serve(extra: list[str], ready, timeout_s: float = 240.0):
    """A `speculant serve` subprocess; yields its URL once `ready(url)`; stops its process group."""
    port = _free_port()
    cmd = [sys.executable, "-m", "speculant.cli.main", "serve", "--port", str(port),
           "--threads", "1", *SPEC, *extra]
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while not _ready(ready, url):
            if proc.poll() is not None or time.monotonic() > deadline:
                log.seek(0)
                raise RuntimeError(f"{' '.join(cmd)} did not start:\n{log.read()[-4000:]}")
            time.sleep(0.5)
        yield url
    finally:
        _stop(proc)
        log.close()


def _ready(ready, url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        return ready(url)
    return False


def _stop(proc) -> None:
    proc.terminate()  # --replicas: serve.shutdown() and ray.shutdown() run on SIGTERM
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # whatever of Ray's processes is left
    proc.wait()


def _replicas_healthy(url: str) -> bool:
    replicas = httpx.get(url + "/health", timeout=2).json()["replicas"]
    return all(replicas[n]["healthy"] for n in REPLICAS)


@pytest.fixture(scope="module")
def single():
    with _serve([], lambda url: httpx.get(url + "/health", timeout=2).status_code == 200) as url:
        yield url


@pytest.fixture(scope="module")
def ray_url():
    with _serve(["--replicas", "2", "--api-key", API_KEY], _replicas_healthy) as url:
        yield url


def _stream(url: str, path: str, body: dict, headers: dict | None = None) -> dict:
    """Text, finish reason, error and serving replica of one streamed request."""
    out = {"text": "", "finish_reason": None, "error": None}
    with httpx.stream("POST", url + path, json={**body, "stream": True},
                      headers={**AUTH, **(headers or {})}, timeout=120) as r:
        assert r.status_code == 200, r.read()
        out["replica"] = r.headers.get("x-speculant-replica")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                out["error"] = chunk["error"]
                continue
            choice = chunk["choices"][0]
            out["text"] += choice.get("text") or choice.get("delta", {}).get("content") or ""
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    return out


def _requests() -> list[tuple[str, dict]]:
    """16 different requests: chat and completions, per-request speculation options."""
    specs = [None, {"type": ["suffix"], "n_max": 4}, {"enabled": False}, {"verify": "greedy"}]
    topics = ["the sea", "a robot", "Paris", "winter", "tea", "a lighthouse", "chess", "rain"]
    out = []
    for i, topic in enumerate(topics):
        base = {"max_tokens": 24, "temperature": 0.0}
        if specs[i % 4]:
            base["speculative"] = specs[i % 4]
        out.append(("/v1/chat/completions",
                    {**base, "messages": [{"role": "user", "content": f"Write about {topic}."}]}))
        out.append(("/v1/completions", {**base, "prompt": f"A short story about {topic}:"}))
    return out


def _metric(url: str, name: str, **labels) -> float:
    text = httpx.get(url + "/metrics", headers=AUTH, timeout=30).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_sixteen_concurrent_streams_equal_single_process(ray_url, single):
    """16 streaming clients over 2 replicas get what each request gets alone from one process."""
    reqs = _requests()
    alone = [_stream(single, path, body) for path, body in reqs]
    with concurrent.futures.ThreadPoolExecutor(len(reqs)) as pool:
        together = list(pool.map(lambda r: _stream(ray_url, *r), reqs))
    assert [(o["text"], o["finish_reason"]) for o in together] == \
           [(o["text"], o["finish_reason"]) for o in alone]
    assert all(o["text"] and o["error"] is None for o in together)
    assert {o["replica"] for o in together} == set(REPLICAS)


def test_routes_health_models_and_key(ray_url, single):
    """Same /v1/models as one process; /health open and per replica; the key is required."""
    models = httpx.get(ray_url + "/v1/models", headers=AUTH).json()
    assert models["data"][0]["id"] == httpx.get(single + "/v1/models").json()["data"][0]["id"]
    assert httpx.get(ray_url + "/v1/models").status_code == 401
    health = httpx.get(ray_url + "/health").json()
    assert health["status"] == "ok" and set(health["replicas"]) == set(REPLICAS)
    bad = httpx.post(ray_url + "/v1/completions", headers=AUTH,
                     json={"prompt": "x", "speculative": {"type": ["draft"]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "speculative.type"


def test_session_affinity_seen_in_replica_metrics(ray_url):
    """Three turns of one session all finish on one replica (its labelled request counter)."""
    before = {n: _metric(ray_url, "speculant:request_success_total", replica=n) for n in REPLICAS}
    messages, served = [], set()
    for turn in ("Name a color.", "Name another.", "And one more."):
        messages.append({"role": "user", "content": turn})
        out = _stream(ray_url, "/v1/chat/completions",
                      {"max_tokens": 8, "temperature": 0.0, "messages": messages},
                      headers={"X-Session-Id": "conversation-1"})
        messages.append({"role": "assistant", "content": out["text"]})
        served.add(out["replica"])
    [replica] = served
    after = {n: _metric(ray_url, "speculant:request_success_total", replica=n) for n in REPLICAS}
    assert {n: after[n] - before[n] for n in REPLICAS} == {
        n: 3.0 if n == replica else 0.0 for n in REPLICAS}
    assert _metric(ray_url, "speculant:router_requests_total", replica=replica,
                   route="session") >= 2


def test_killed_replica_restarts_and_the_other_finishes(ray_url):
    """SIGKILL one replica mid-stream: its stream ends with replica_died, the other's completes,
    and Ray Serve brings the killed one back (a new pid, routed to again)."""
    # Plain decoding of 1500 tokens: 10+ seconds for a one-thread replica even on a fast
    # machine, so the victim's stream is still running when it is killed 0.5 s after both
    # started (counting with the chain once finished 800 tokens first).
    body = {"prompt": "Count from one to a thousand: one, two,", "max_tokens": 1500,
            "temperature": 0.0, "ignore_eos": True, "speculative": {"enabled": False}}
    pids = {n: r["pid"] for n, r in httpx.get(ray_url + "/health").json()["replicas"].items()}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(_stream, ray_url, "/v1/completions", body, {"X-Session-Id": n})
                   for n in ("kill-a", "kill-b")]
        victim = _both_busy(ray_url)
        time.sleep(0.5)  # both streams have started: the victim's cannot be retried elsewhere
        os.kill(pids[victim], signal.SIGKILL)
        outs = [f.result(timeout=240) for f in futures]
    by_replica = {o["replica"]: o for o in outs}
    assert set(by_replica) == set(REPLICAS)
    assert by_replica[victim]["error"]["code"] == "replica_died"
    [survivor] = set(REPLICAS) - {victim}
    assert by_replica[survivor]["finish_reason"] == "length" and not by_replica[survivor]["error"]
    deadline = time.monotonic() + 120
    while not _replicas_healthy(ray_url):
        assert time.monotonic() < deadline, "the killed replica was not restarted"
        time.sleep(1.0)
    assert httpx.get(ray_url + "/health").json()["replicas"][victim]["pid"] != pids[victim]
    again = _stream(ray_url, "/v1/completions", {**body, "max_tokens": 4},
                    headers={"X-Session-Id": "kill-a"})
    assert again["finish_reason"] == "length"


def _both_busy(url: str, timeout_s: float = 30.0) -> str:
    """Once every replica has a request in flight: the first replica's name."""
    deadline = time.monotonic() + timeout_s
    while not all(r["in_flight"] for r in httpx.get(url + "/health").json()["replicas"].values()):
        assert time.monotonic() < deadline, "the two streams were not both routed"
        time.sleep(0.05)
    return REPLICAS[0]


def test_threads_share_the_cores_unless_set():
    """Replicas split the cores (at least one thread each); an explicit count wins."""
    from speculant.server.ray_serve import ScaleOutConfig

    assert [ScaleOutConfig(replicas=2).threads(c) for c in (1, 2, 8)] == [1, 1, 4]
    assert ScaleOutConfig(replicas=2, threads_per_replica=3).threads(2) == 3


def test_build_app_takes_config_field_names():
    """`serve run ...:build_app k=v`: config fields only; values parsed as JSON when JSON."""
    from speculant.server.ray_serve import build_app

    assert build_app({"replicas": "2", "spec_type": "suffix", "max_prompt_tokens": "512"})
    with pytest.raises(ValueError, match="unknown build_app arguments: \\['bogus'\\]"):
        build_app({"bogus": "1"})


# ---- the router alone, with fake replica handles (no Ray instance) -----------------------------

class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _FakeReplica:
    """A replica handle: answers one JSON body, or dies (ActorDiedError) before answering."""

    def __init__(self, dead: bool):
        self.dead, self.calls = dead, 0
        self.handle = _Remote(self._handle)
        self.ping = _Remote(self._ping)

    def options(self, stream: bool = False):
        return self

    def _handle(self, *args):
        self.calls += 1
        return _FakeStream(self.dead)

    async def _ping(self):
        return {"healthy": True, "pid": 1}


class _FakeStream:
    def __init__(self, dead: bool):
        self.dead, self.sent = dead, False

    def __aiter__(self):
        return self

    async def __anext__(self):
        from ray.exceptions import ActorDiedError

        if self.dead:
            raise ActorDiedError()
        if self.sent:
            raise StopAsyncIteration
        self.sent = True
        return [{"type": "http.response.start", "status": 200, "headers": []},
                {"type": "http.response.body", "body": b'{"ok": true}', "more_body": False}]

    def cancel(self):
        pass


def test_request_retried_when_its_replica_dies_before_answering():
    """Nothing reached the client: the request runs on the other replica; the dead one is down."""
    import asyncio

    from starlette.requests import Request

    from speculant.server.ray_serve import Router, ScaleOutConfig

    async def run():
        cls = Router.func_or_class
        router = cls.__new__(cls)
        dead, alive = _FakeReplica(dead=True), _FakeReplica(dead=False)
        await router.__init__(ScaleOutConfig(health_period_s=60), dead, alive)
        router._health_task.cancel()  # both count as healthy: the first request goes to `dead`
        body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()

        async def receive():
            return {"type": "http.request", "body": body, "more_body": False}

        scope = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [],
                 "query_string": b""}
        response = await router(Request(scope, receive))
        return router, response, dead, alive

    router, response, dead, alive = asyncio.run(run())
    assert response.status_code == 200 and response.body == b'{"ok": true}'
    assert response.headers["x-speculant-replica"] == REPLICAS[1]
    assert (dead.calls, alive.calls) == (1, 1)
    assert not router.router.is_healthy(REPLICAS[0])
    assert 'stage="before_output"} 1.0' in router.metrics.render()
