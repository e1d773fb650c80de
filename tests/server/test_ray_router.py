"""Replica routing without Ray: session and prompt-prefix affinity, least-loaded, health."""
import subprocess
import sys

import pytest
from prometheus_client.parser import text_string_to_metric_families

from speculant.server.replica_metrics import merge_replica_metrics
from speculant.server.replica_router import (NoHealthyReplica, ReplicaRouter, RouterConfig,
                                             prompt_key, session_of)

A, B = "r0", "r1"
LONG = "You are a careful assistant. Answer in one short sentence, then stop. " * 3  # > 1 block


def chat(*turns: str) -> str:
    roles = ["user", "assistant"]
    return prompt_key({"messages": [{"role": roles[i % 2], "content": t}
                                    for i, t in enumerate(turns)]})


def test_first_requests_spread_by_load():
    """Without affinity each request goes to the replica with the fewest in flight."""
    router = ReplicaRouter([A, B])
    assert [router.route(None, "").replica for _ in range(4)] == [A, B, A, B]
    router.done(A)
    assert router.route(None, "").replica == A


def test_ties_go_to_the_replica_routed_least():
    """Finished requests leave no load; the next goes where fewer went before."""
    router = ReplicaRouter([A, B])
    router.route(None, "")
    router.done(A)
    assert router.route(None, "").replica == B


def test_session_sticks_while_healthy_then_moves():
    """A session stays on its replica, moves when it is down, and stays where it moved."""
    router = ReplicaRouter([A, B])
    router.route(None, "")  # load A so that the session starts on B
    assert router.route("s1", "").replica == B
    assert router.route("s1", "") == router.route("s1", "")  # reason "session" every time
    assert router.route("s1", "").reason == "session"
    router.set_healthy(B, False)
    assert router.route("s1", "").replica == A
    router.set_healthy(B, True)
    assert router.route("s1", "").replica == A


def test_next_chat_turn_follows_the_shared_prefix():
    """Turn 2 of a conversation (no session id) goes where turn 1 went, even if busier."""
    router = ReplicaRouter([A, B])
    first = router.route(None, chat(LONG))
    router.route(None, "")  # the other replica now has one request, the first one too
    router.route(None, "")
    second = router.route(None, chat(LONG, "It is.", "And then?"))
    assert (second.replica, second.reason) == (first.replica, "prefix")
    assert second.num_prefix_bytes >= 64


def test_prompts_shorter_than_a_block_get_no_prefix_affinity():
    """'Hi' twice is not a conversation: load decides."""
    router = ReplicaRouter([A, B])
    assert router.route(None, "Hi").replica == A
    assert router.route(None, "Hi").reason == "least_loaded"


def test_prefix_affinity_yields_to_imbalance():
    """A prompt prefix shared by every client does not pile them onto one replica."""
    router = ReplicaRouter([A, B], RouterConfig(max_imbalance=2))
    for i in range(20):
        router.route(None, LONG + str(i))
        assert abs(router.in_flight(A) - router.in_flight(B)) <= 2


def test_failed_replica_is_excluded_and_none_left_raises():
    """A retry skips the replica that failed; with nothing healthy the error says so."""
    router = ReplicaRouter([A, B])
    assert router.route("s", "", exclude=[A]).replica == B
    router.set_healthy(B, False)
    with pytest.raises(NoHealthyReplica, match="no healthy"):
        router.route("s", "", exclude=[A])


@pytest.mark.parametrize("misuse, message", [
    (lambda r: r.done(A), "without a request in flight"),
    (lambda r: r.set_healthy("r9", False), "unknown replica 'r9'"),
    (lambda r: ReplicaRouter([A, A]), "distinct"),
    (lambda r: RouterConfig(block_bytes=0), "block_bytes"),
])
def test_misuse_fails_loudly(misuse, message):
    with pytest.raises(ValueError, match=message):
        misuse(ReplicaRouter([A, B]))


def test_in_flight_counts_routes_minus_dones():
    router = ReplicaRouter([A, B])
    for _ in range(3):
        router.route("s", "")
    router.done(A)
    assert (router.in_flight(A), router.in_flight(B)) == (2, 0)


@pytest.mark.parametrize("body, key", [
    ({"prompt": "abc"}, "abc"),
    ({"prompt": ["abc"]}, "abc"),
    ({"prompt": [1, 22, 3]}, "1 22 3 "),
    ({"prompt": 5}, ""),  # malformed: the replica answers it with a 400
    ({"messages": "x"}, ""),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]},
     "user\x1fhi\x1e"),
])
def test_prompt_key(body, key):
    assert prompt_key(body) == key


def test_chat_turn_two_extends_turn_one():
    assert chat("a", "b", "c").startswith(chat("a"))


def test_session_header_wins_over_user_field():
    assert session_of({"x-session-id": "h"}, {"user": "u"}) == "h"
    assert session_of({}, {"user": "u"}) == "u"
    assert session_of({}, {"user": 3}) is None


def test_merged_metrics_label_every_sample_by_replica():
    """Families appear once, with each replica's samples labelled; the text parses back."""
    text = ("# HELP speculant:engine_steps_total Steps\n# TYPE speculant:engine_steps_total "
            "counter\nspeculant:engine_steps_total 7.0\n")
    merged = merge_replica_metrics({A: text, B: text.replace("7.0", "9.0")})
    [family] = text_string_to_metric_families(merged)
    assert {(s.labels["replica"], s.value) for s in family.samples} == {(A, 7.0), (B, 9.0)}


def test_single_process_server_does_not_import_ray():
    """Without --replicas nothing on the serve path loads Ray."""
    code = ("import sys, speculant.cli.main, speculant.cli.serve, speculant.server.app, "
            "speculant.server.routes; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
