"""Metrics of a scaled-out server: every replica's own metrics, labelled, plus the router's.

`merge_replica_metrics` parses each replica's `/metrics` text and re-renders the families once,
every sample carrying `replica="<name>"` (Prometheus needs a family's samples together, so the
texts cannot simply be concatenated). `RouterMetrics` counts what the router decided:

| metric | labels | meaning |
|---|---|---|
| `speculant:router_requests_total` | `replica`, `route` | requests routed (session, prefix, least_loaded) |
| `speculant:router_replica_failures_total` | `replica`, `stage` | replica died before_output (retried) or mid_stream |
| `speculant:router_replica_restarts_total` | `replica` | a new process answered under the name |
| `speculant:router_replica_healthy` | `replica` | 1 while the replica answers its health probe |
| `speculant:router_requests_in_flight` | `replica` | requests routed there and not finished |
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.core import Metric
from prometheus_client.parser import text_string_to_metric_families

P = "speculant:"


def merge_replica_metrics(texts: dict[str, str]) -> str:
    """Replica name -> its exposition text  ->  one exposition text with a `replica` label."""
    families: dict[str, Metric] = {}
    for replica, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation,
                                                             family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value,
                                  s.timestamp, s.exemplar)
    registry = CollectorRegistry()
    registry.register(_Fixed(list(families.values())))
    return generate_latest(registry).decode()


class _Fixed:
    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self):
        return self._families


class RouterMetrics:
    def __init__(self, replicas: list[str]):
        self.registry = r = CollectorRegistry()
        self._routed = Counter(P + "router_requests", "Requests routed, by replica and why "
                               "(session, prefix, least_loaded)", ["replica", "route"], registry=r)
        self._failures = Counter(P + "router_replica_failures", "Replicas lost under a request: "
                                 "before_output (retried elsewhere) or mid_stream",
                                 ["replica", "stage"], registry=r)
        self._restarts = Counter(P + "router_replica_restarts", "Replica processes replaced",
                                 ["replica"], registry=r)
        self._healthy = Gauge(P + "router_replica_healthy", "1 while the replica answers its "
                              "health probe", ["replica"], registry=r)
        self._in_flight = Gauge(P + "router_requests_in_flight", "Requests routed to the "
                                "replica and not finished", ["replica"], registry=r)
        for name in replicas:  # every series exists from the start, at 0
            self._restarts.labels(name)
            self.set_state(name, True, 0)

    def routed(self, route) -> None:
        self._routed.labels(route.replica, route.reason).inc()

    def failed(self, replica: str, stage: str) -> None:
        self._failures.labels(replica, stage).inc()

    def restarted(self, replica: str) -> None:
        self._restarts.labels(replica).inc()

    def set_state(self, replica: str, healthy: bool, in_flight: int) -> None:
        self._healthy.labels(replica).set(1.0 if healthy else 0.0)
        self._in_flight.labels(replica).set(in_flight)

    def render(self) -> str:
        return generate_latest(self.registry).decode()
