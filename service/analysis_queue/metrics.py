"""Prometheus metrics: one registry per application instance, scraped at ``/metrics``.

Counters are incremented where things happen; gauges of the queue's open work are read from the
database at scrape time with queries that only touch the partial indexes of open jobs.
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST as CONTENT_TYPE
from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

__all__ = ["CONTENT_TYPE", "Metrics"]

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        # The process's own: CPU, memory, file descriptors, start time (process_*), the garbage
        # collector (python_gc_*) and the interpreter (python_info). They read the process, so
        # sharing the default collectors between several apps in one process is safe.
        for collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
            r.register(collector)
        self.jobs = Gauge("aq_jobs", "Open jobs by status", ["status"], registry=r)
        self.admits = Counter("aq_admits", "Admit requests by outcome", ["outcome"], registry=r)
        self.admit_seconds = Histogram(
            "aq_admit_seconds", "Admit latency", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.promotions = Counter(
            "aq_promotions", "Jobs promoted from queued, by trigger", ["trigger"], registry=r
        )
        self.releases = Counter(
            "aq_release_attempts", "Held-run release attempts by outcome", ["outcome"], registry=r
        )
        self.refunds = Counter("aq_refunds", "Credits refunded, by reason", ["reason"], registry=r)
        self.callbacks = Counter(
            "aq_core_callbacks", "Core callbacks by outcome", ["outcome"], registry=r
        )
        self.listener_reconnects = Counter(
            "aq_listener_reconnects", "LISTEN connection losses", registry=r
        )
        self.listener_up = Gauge(
            "aq_listener_up", "1 while the LISTEN connection is up", registry=r
        )
        self.group_commit_statements = Counter(
            "aq_group_commit_statements",
            "Statements written by a group commit (reserve, admit, finish, claim, running), "
            "each for one or more jobs",
            ["what"],
            registry=r,
        )
        self.group_commit_jobs = Counter(
            "aq_group_commit_jobs", "Jobs those statements were written for", ["what"], registry=r
        )
        self.notifications = Counter(
            "aq_notifications",
            "Notifications received: one per committed transaction that changed jobs, through "
            'any instance (so, over aq_admits_total{outcome="admitted"}, the notifying '
            "commits per admitted job)",
            registry=r,
        )
        self.notification_lag = Histogram(
            "aq_notification_lag_seconds",
            "From the job change being written to its notification arriving here",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 5.0),
            registry=r,
        )
        self.sweep_seconds = Histogram(
            "aq_sweep_seconds", "Duration of one sweep pass", buckets=_LATENCY_BUCKETS_S, registry=r
        )
        self.ceiling = Gauge(
            "aq_global_max_running", "The provider ceiling in force; 0 when off", registry=r
        )
        self.slots_in_use = Gauge(
            "aq_global_slots_in_use", "Jobs pending or running, across instances", registry=r
        )
        self.waiting_for_capacity = Gauge(
            "aq_waiting_for_capacity",
            "Queued jobs and users whose user has room: they wait for the provider",
            ["unit"],
            registry=r,
        )
        self.pool_size = Gauge("aq_db_pool_connections", "Pool connections", ["state"], registry=r)
        self.http_connections = Gauge(
            "aq_http_connections", "Client connections open, within AQ_MAX_CONNECTIONS", registry=r
        )
        self.http_over_cap = Counter(
            "aq_http_connections_over_cap",
            "Connections accepted past AQ_MAX_CONNECTIONS, by answer: 503, healthz (answered "
            "anyway), closed (at accept, the refusal lane full too)",
            ["answer"],
            registry=r,
        )
        self.http_timeouts = Counter(
            "aq_http_timeouts",
            "Connections closed (head) or requests answered 408 (body) for arriving too slowly",
            ["phase"],
            registry=r,
        )
        self.http_responses = Counter(
            "aq_http_responses",
            "Responses the routes answered, by status code (the edge's own refusals are "
            "aq_http_connections_over_cap and aq_http_timeouts)",
            ["code"],
            registry=r,
        )
        self.users_stuck = Gauge(
            "aq_users_stuck",
            "Users with a free slot and a queued job that should have started (the sweep's "
            "candidates, up to 1,000): above 0 past a sweep interval, the queue is stuck",
            registry=r,
        )
        self.event_subscribers = Gauge(
            "aq_event_subscribers", "Open event-stream subscribers", registry=r
        )

    def batch_counter(self, what: str) -> Callable[[int], None]:
        """What a group commit calls with each batch's size: one statement, that many jobs."""
        statements = self.group_commit_statements.labels(what)
        jobs = self.group_commit_jobs.labels(what)

        def count(n: int) -> None:
            statements.inc()
            jobs.inc(n)

        return count

    def render(self) -> bytes:
        return generate_latest(self.registry)
