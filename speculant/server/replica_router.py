"""Which engine replica serves a request: conversation affinity while healthy, else least-loaded.

Speculation is why affinity pays: a replica whose suffix trees and n-gram pools already hold a
conversation's earlier turns drafts its next turn better, and a replica that has seen a long
shared prompt drafts its continuations better. So a request goes, in order, to

1. **session**: the replica that served its session id (`X-Session-Id`, else OpenAI's `user`),
   while that replica is healthy;
2. **prefix**: the replica that most recently served the longest prompt prefix it shares with an
   earlier request (at least one whole block of `block_bytes` UTF-8 bytes; as in vLLM's prefix
   cache, whole blocks are hashed, each chained to the ones before it), unless that replica
   already runs `max_imbalance` more requests than the least-loaded one (a system prompt shared
   by every client must not pile them all onto one replica);
3. **least_loaded**: the healthy replica with the fewest requests in flight (ties: the fewest
   routed so far, then the name).

Pure bookkeeping, no Ray and no I/O: the Ray Serve router (`ray_serve.py`) reports health and
request ends; tests drive it directly.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

ROUTE_REASONS = ("session", "prefix", "least_loaded")


class NoHealthyReplica(RuntimeError):
    pass


@dataclass(slots=True)
class RouterConfig:
    block_bytes: int = 64  # prompts are matched in whole blocks of this many UTF-8 bytes
    max_imbalance: int = 4  # prefix affinity yields to a replica running this many fewer requests
    max_prefix_blocks: int = 1 << 16  # remembered prompt blocks (least recently used dropped)
    max_sessions: int = 1 << 16  # remembered sessions (least recently used dropped)

    def __post_init__(self) -> None:
        for name in ("block_bytes", "max_imbalance", "max_prefix_blocks", "max_sessions"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True, slots=True)
class Route:
    replica: str
    reason: str  # one of ROUTE_REASONS
    num_prefix_bytes: int  # prompt bytes shared with the replica's earlier requests


class ReplicaRouter:
    """Routing state of one ingress: health, requests in flight, sessions and prompt blocks.

    Lifecycle per request: `route(...)` (counts it in flight on the chosen replica and remembers
    its session and prompt blocks there), then exactly one `done(replica)`.
    """

    def __init__(self, replicas: Iterable[str], config: RouterConfig | None = None):
        self.config = config or RouterConfig()
        self.replicas = tuple(replicas)
        if not self.replicas or len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"replicas must be distinct names, got {self.replicas}")
        self._healthy = dict.fromkeys(self.replicas, True)
        self._in_flight = dict.fromkeys(self.replicas, 0)
        self._num_routed = dict.fromkeys(self.replicas, 0)
        self._sessions: OrderedDict[str, str] = OrderedDict()  # session id -> replica
        self._blocks: OrderedDict[bytes, str] = OrderedDict()  # chained block hash -> replica

    # ---- state reported by the ingress ---------------------------------------------------------

    def set_healthy(self, replica: str, healthy: bool) -> None:
        self._check(replica)
        self._healthy[replica] = healthy

    def is_healthy(self, replica: str) -> bool:
        return self._healthy[replica]

    def in_flight(self, replica: str) -> int:
        return self._in_flight[replica]

    def done(self, replica: str) -> None:
        """A request routed to `replica` ended (finished, failed or abandoned)."""
        self._check(replica)
        if self._in_flight[replica] == 0:
            raise ValueError(f"done({replica!r}) without a request in flight there")
        self._in_flight[replica] -= 1

    # ---- the decision --------------------------------------------------------------------------

    def route(self, session_id: str | None, prompt_key: str,
              exclude: Iterable[str] = ()) -> Route:
        """The replica for a request; raises NoHealthyReplica when none outside `exclude` is up."""
        candidates = [r for r in self.replicas if self._healthy[r] and r not in set(exclude)]
        if not candidates:
            raise NoHealthyReplica("no healthy engine replica (all are down or restarting)")
        hashes = block_hashes(prompt_key, self.config.block_bytes)
        route = (self._by_session(session_id, candidates)
                 or self._by_prefix(hashes, candidates)
                 or Route(self._least_loaded(candidates), "least_loaded", 0))
        self._remember(route.replica, session_id, hashes)
        return route

    def _by_session(self, session_id: str | None, candidates: list[str]) -> Route | None:
        replica = self._sessions.get(session_id) if session_id else None
        return Route(replica, "session", 0) if replica in candidates else None

    def _by_prefix(self, hashes: list[bytes], candidates: list[str]) -> Route | None:
        num_blocks, replica = 0, None
        for h in hashes:  # chained hashes: block i matches only if blocks 0..i all match
            if h not in self._blocks:
                break
            num_blocks, replica = num_blocks + 1, self._blocks[h]
        if replica not in candidates:
            return None
        least = min(self._in_flight[r] for r in candidates)
        if self._in_flight[replica] - least >= self.config.max_imbalance:
            return None
        return Route(replica, "prefix", num_blocks * self.config.block_bytes)

    def _least_loaded(self, candidates: list[str]) -> str:
        return min(candidates, key=lambda r: (self._in_flight[r], self._num_routed[r], r))

    def _remember(self, replica: str, session_id: str | None, hashes: list[bytes]) -> None:
        self._in_flight[replica] += 1
        self._num_routed[replica] += 1
        if session_id:
            _put_lru(self._sessions, session_id, replica, self.config.max_sessions)
        for h in hashes:
            _put_lru(self._blocks, h, replica, self.config.max_prefix_blocks)

    def _check(self, replica: str) -> None:
        if replica not in self._healthy:
            raise ValueError(f"unknown replica {replica!r} (known: {', '.join(self.replicas)})")


def block_hashes(text: str, block_bytes: int) -> list[bytes]:
    """One hash per whole block of `text`, each chained to the blocks before it."""
    out, prev = [], b""
    data = text.encode("utf-8", "surrogatepass")  # a block may split a character: harmless here
    for start in range(0, len(data) - block_bytes + 1, block_bytes):
        prev = hashlib.blake2b(prev + data[start:start + block_bytes], digest_size=16).digest()
        out.append(prev)
    return out


def _put_lru(table: OrderedDict, key, value, max_size: int) -> None:
    table[key] = value
    table.move_to_end(key)
    while len(table) > max_size:
        table.popitem(last=False)


# ---- what a request body says about its conversation ----------------------------------------------

def session_of(headers: dict[str, str], body: dict) -> str | None:
    """`X-Session-Id` header (lower-cased `headers`), else the body's OpenAI `user` field."""
    session = headers.get("x-session-id") or body.get("user")
    return session if isinstance(session, str) and session else None


def prompt_key(body: dict) -> str:
    """The prompt as routing text: chat turns in order (so turn 2 extends turn 1), or the prompt.

    Malformed bodies give "" (the replica answers them with a 400 anyway)."""
    messages = body.get("messages")
    if isinstance(messages, list):
        return "".join(f"{m.get('role')}\x1f{_content_text(m.get('content'))}\x1e"
                       for m in messages if isinstance(m, dict))
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list):
        return " ".join(map(str, prompt)) + " "  # token ids: a trailing space ends the last id
    return ""


def _content_text(content) -> str:
    if isinstance(content, list):
        return "\n".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return str(content)
