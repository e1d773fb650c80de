"""An OpenAI-compatible server as a peer: llama-server, vLLM, `speculant serve`, ...

The same prompts, already templated, go one at a time to `POST {URL}/v1/completions` (greedy:
temperature 0, `max_tokens` N; `ignore_eos` only when the bench was given --ignore-eos). The
decode rate excludes prefill, from the best source the server offers:

1. `timings.predicted_per_second` (llama-server, speculant serve): the server's own decode
   rate; the request's decode tokens are its completion tokens minus the first.
2. otherwise the wall clock, as for the hf peer: (n - 1) / (time(N tokens) - time(1 token)),
   n from `usage.completion_tokens`. Every prompt is first sent once untimed (1 token), so a
   server that caches prompts treats both timed requests alike.

At every `--concurrency` level above 1 the peer is also measured with that many requests in
flight (`openai@host c=8`): the aggregate rate is all completion tokens over the wall time from
the first request to the last answer (prefill included; prompts warmed first). At level 1 the
detail also records `mean_request_s`, the mean wall time of a timed request (a router in front
of the server shows up there, not in the server's own `timings`).

Requests are bounded (at most prompts x (repeats + 2) per level) and each has a timeout. CPU
interference is not judged (the server's own CPU use is another process by design):
`interference` is null.
"""
from __future__ import annotations

import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from urllib.parse import urlparse

from speculant.bench.report import PeerResult


def api_base(url: str) -> str:
    """'http://h:8080' or 'http://h:8080/v1/' -> 'http://h:8080/v1'."""
    base = url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def peer_name(url: str) -> str:
    return f"openai@{urlparse(url).netloc}"


@dataclass(slots=True)
class _Tally:
    decode_tokens: list[int]
    decode_time_s: list[float]
    generated: int = 0
    request_s: list[float] = field(default_factory=list)  # wall time of each timed request
    prompt_tokens: int = 0
    prompt_time_s: float = 0.0
    sources: set = field(default_factory=set)  # "server" and/or "wall"


class OpenAIPeer:
    """A client of one server: its model id, and timed completions."""

    def __init__(self, url: str, timeout_s: float = 300.0, ignore_eos: bool = False):
        import httpx

        self.url, self.api, self.ignore_eos = url, api_base(url), ignore_eos
        self.client = httpx.Client(timeout=httpx.Timeout(timeout_s, connect=10.0))
        self.model = self._model_id()

    def close(self) -> None:
        self.client.close()

    def _model_id(self) -> str:
        import httpx

        try:
            r = self.client.get(f"{self.api}/models")
        except httpx.HTTPError as exc:
            raise RuntimeError(f"openai peer {self.url}: cannot connect ({exc})") from exc
        data = r.json().get("data") if r.status_code == 200 else None
        return data[0]["id"] if data and "id" in data[0] else "default"

    def complete(self, prompt: str, max_tokens: int) -> tuple[float, dict]:
        """(wall seconds, response body) of one greedy completion."""
        import httpx

        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, "stream": False}
        if self.ignore_eos:
            body["ignore_eos"] = True
        t0 = time.perf_counter()
        try:
            r = self.client.post(f"{self.api}/completions", json=body)
        except httpx.HTTPError as exc:
            raise RuntimeError(f"openai peer {self.url}: request failed ({exc})") from exc
        seconds = time.perf_counter() - t0
        if r.status_code != 200:
            raise RuntimeError(f"openai peer {self.url}: HTTP {r.status_code}: {r.text[:200]}")
        return seconds, r.json()


def run_openai_peer(url: str, groups: dict[str, list[str]], max_tokens: int, repeats: int,
                    timeout_s: float = 300.0, ignore_eos: bool = False,
                    levels: tuple[int, ...] = (1,)) -> list[PeerResult]:
    """Every category of `groups` (category -> prompt texts) through the server at `url`, one
    request at a time and at every other concurrency of `levels`."""
    from tqdm import tqdm

    peer = OpenAIPeer(url, timeout_s, ignore_eos)
    bar = tqdm(total=sum(map(len, groups.values())) * len(levels), desc="openai peer",
               unit="prompt", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    out = []
    try:
        for category, prompts in groups.items():
            tally = _Tally([0] * repeats, [0.0] * repeats)
            for prompt in prompts:
                _measure_prompt(peer, prompt, max_tokens, repeats, tally)
                bar.update()
            out.append(_peer_result(peer, category, len(prompts), tally))
            for level in (c for c in levels if c > 1):
                out.append(_measure_concurrent(peer, category, prompts, max_tokens, repeats,
                                               level))
                bar.update(len(prompts))
    finally:
        bar.close()
        peer.close()
    return out


def _measure_prompt(peer: OpenAIPeer, prompt: str, max_tokens: int, repeats: int,
                    tally: _Tally) -> None:
    # Untimed: warms the server and its prompt cache; its timings hold the uncached prefill.
    _count_prefill(tally, peer.complete(prompt, 1)[1])
    t_first = None
    for i in range(repeats):
        seconds, body = peer.complete(prompt, max_tokens)
        tally.request_s.append(seconds)
        n = _num_completion(body, max_tokens)
        rate = _server_rate(body)
        if rate is not None:
            tokens, decode_s, source = n - 1, (n - 1) / rate, "server"
        else:
            if t_first is None:
                t_first = peer.complete(prompt, 1)[0]
            tokens, decode_s, source = n - 1, seconds - t_first, "wall"
        if tokens > 0 and decode_s > 0:
            tally.decode_tokens[i] += tokens
            tally.decode_time_s[i] += decode_s
            tally.sources.add(source)
        if i == 0:
            tally.generated += n


def _measure_concurrent(peer: OpenAIPeer, category: str, prompts: list[str], max_tokens: int,
                        repeats: int, level: int) -> PeerResult:
    """The category's prompts with `level` requests in flight; per repeat, all completion
    tokens and the wall time they took."""
    tokens, seconds, generated = [], [], 0
    with ThreadPoolExecutor(level) as pool:
        list(pool.map(lambda p: peer.complete(p, 1), prompts))  # warm, untimed
        for _ in range(repeats):
            t0 = time.perf_counter()
            bodies = [body for _, body in pool.map(lambda p: peer.complete(p, max_tokens),
                                                   prompts)]
            seconds.append(time.perf_counter() - t0)
            tokens.append(sum(_num_completion(b, max_tokens) for b in bodies))
            generated = generated or tokens[-1]
    return PeerResult(f"{peer_name(peer.url)} c={level}", "openai", "server", category,
                      len(prompts), generated, tokens, seconds, interference=None,
                      detail={"url": peer.url, "model": peer.model, "concurrency": level,
                              "timings_source": "wall-aggregate"})


def _num_completion(body: dict, max_tokens: int) -> int:
    usage = body.get("usage") or {}
    return int(usage.get("completion_tokens", max_tokens))


def _server_rate(body: dict) -> float | None:
    rate = (body.get("timings") or {}).get("predicted_per_second")
    return float(rate) if isinstance(rate, (int, float)) and rate > 0 else None


def _count_prefill(tally: _Tally, body: dict) -> None:
    timings = body.get("timings") or {}
    if timings.get("prompt_n") and timings.get("prompt_ms"):
        tally.prompt_tokens += int(timings["prompt_n"])
        tally.prompt_time_s += float(timings["prompt_ms"]) / 1e3


def _peer_result(peer: OpenAIPeer, category: str, num_prompts: int, t: _Tally) -> PeerResult:
    source = "+".join(sorted(t.sources)) or "none"
    prefill = round(t.prompt_tokens / t.prompt_time_s, 1) if t.prompt_time_s else 0.0
    return PeerResult(peer_name(peer.url), "openai", "server", category, num_prompts, t.generated,
                      t.decode_tokens, t.decode_time_s, prefill_tok_s=prefill, interference=None,
                      detail={"url": peer.url, "model": peer.model, "timings_source": source,
                              "mean_request_s": round(sum(t.request_s) / len(t.request_s), 4)
                              if t.request_s else None})
