"""Prometheus metrics for managers, tiers, engines and routers (extra ``[metrics]``: prometheus-client).

Nothing is global: a ``Metrics`` object owns its ``CollectorRegistry``. Managers, tiers and
engines are read when scraped (a custom collector calls their ``stats()``), so watching costs
nothing between scrapes; router decisions are counted as they happen.

    metrics = Metrics()
    metrics.watch_manager(mgr, worker="w0")
    metrics.watch_engine(engine, worker="w0")
    router = FleetRouter(..., on_decision=metrics.router_decision)
    server = metrics.serve(9400)          # GET http://127.0.0.1:9400/metrics
    ...
    server.shutdown()
"""

from __future__ import annotations

import math
import numbers
import threading
from typing import Callable

from prometheus_client import CollectorRegistry, Counter, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .errors import InvalidArgument

# The router's decision reasons (``prefixkv.fleet.router.REASON_*``), spelled out so this module
# imports no fleet code.
REASONS = frozenset(("round-robin", "least-load", "miss", "overlap", "guard"))

# (name, help, CacheStats field) of the manager's counters
_MANAGER_COUNTERS = (
    ("prefixkv_queries", "Sequences admitted (prefix-cache lookups)", "admitted"),
    ("prefixkv_query_tokens", "Prompt tokens looked up at admission", "query_tokens"),
    ("prefixkv_hit_tokens", "Prompt tokens served from the prefix cache", "hit_tokens"),
    ("prefixkv_evictions", "Cached blocks evicted", "evictions"),
    ("prefixkv_insertions", "Hashes that entered the prefix cache", "insertions"),
    ("prefixkv_preemptions", "Sequences preempted", "preemptions"),
    # (names kept for existing dashboards; they count the swap space, not the host tier's cache)
    ("prefixkv_promotions", "Blocks of preempted sequences swapped back in (host -> device)", "swapped_in_blocks"),
    ("prefixkv_demotions", "Blocks of preempted sequences swapped out (device -> host)", "swapped_out_blocks"),
    ("prefixkv_host_loads", "Blocks loaded from the host tier for prefix hits (host -> device)", "loads"),
    ("prefixkv_host_demotions", "Evicted device blocks demoted to the host tier (device -> host)", "demotions"),
)


# (event, help, StoreTier.stats() key) of the tiers below the host tier (disk, remote): counters
# whose key sums a per-reason dict are summed
_STORE_TIER_EVENTS = (
    ("staged", "Blocks loaded from the tier into host blocks, verified", "staged_blocks"),
    ("queued", "Blocks queued for the tier's background writer", "queued_blocks"),
    ("kept_from_below", "Blocks a tier below served, queued for this one", "kept_from_below"),
    ("written", "Blocks the store wrote", "store_writes"),
    ("evicted", "Blocks the store evicted (disk; a server evicts on its own)", "store_evictions"),
    ("rejected", "Values that failed verification: misses, deleted", "store_rejected"),
    ("dropped", "Writes dropped (queue full, disk full or read-only)", "store_dropped"),
)


# The states a tier's block gauge takes: a tier's stats() may hold more (counters, a URL, a
# fingerprint), which are not block counts and would each add a series.
TIER_STATES = ("active", "cached", "free")


def _label(argument: str, value: object) -> str:
    # checked when watched: prometheus-client only fails on a non-string label at scrape time,
    # and then every series of the registry is lost, not just this one
    if not isinstance(value, str) or not value:
        raise InvalidArgument(argument, f"expected a non-empty string label, got {value!r}")
    return value


def _block_counts(stats: object) -> dict[str, float]:
    """The tier states of one ``stats()`` answer; ValueError when it is not a dict of finite counts."""
    if not isinstance(stats, dict):
        raise ValueError(f"stats() returned {type(stats).__name__}, not a dict")
    out = {}
    for state in TIER_STATES:
        if state in stats:
            value = stats[state]
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
                raise ValueError(f"stats()[{state!r}] is {value!r}, not a finite number")
            out[state] = float(value)
    return out


class _Collector:
    """Reads every watched object at scrape time."""

    def __init__(self) -> None:
        self.managers: list[tuple[str, object]] = []
        self.tiers: list[tuple[str, str, Callable[[], dict]]] = []
        self.engines: list[tuple[str, object]] = []
        self.tier_errors: dict[tuple[str, str], int] = {}
        self._lock = threading.Lock()     # scrapes may run on several server threads at once

    def _tier_counts(self, worker: str, tier: str, stats: Callable[[], dict]) -> dict[str, float]:
        # One tier's failing stats() (a closed store, a non-number) leaves that tier out of this
        # scrape and is counted; raising here would fail the whole scrape, every worker's series.
        try:
            return _block_counts(stats())
        except Exception:
            with self._lock:
                self.tier_errors[worker, tier] = self.tier_errors.get((worker, tier), 0) + 1
            return {}

    def _store_tiers(self):
        """The tiers below each watched manager's host tier (``manager.tiers.lower``)."""
        events = CounterMetricFamily("prefixkv_store_tier_blocks", "Blocks through a tier below the host tier, "
                                     "by event (" + ", ".join(e for e, _, _ in _STORE_TIER_EVENTS) + ")",
                                     labels=["worker", "tier", "event"])
        used = GaugeMetricFamily("prefixkv_store_tier_bytes", "Bytes a disk tier's directory holds (used) and "
                                 "may hold (capacity)", labels=["worker", "tier", "kind"])
        for worker, mgr in self.managers:
            for tier in getattr(getattr(mgr, "tiers", None), "lower", ()):
                name = tier.name.lower()
                try:
                    stats = tier.stats()
                except Exception:
                    with self._lock:
                        self.tier_errors[worker, name] = self.tier_errors.get((worker, name), 0) + 1
                    continue
                for event, _, key in _STORE_TIER_EVENTS:
                    value = stats.get(key, 0)
                    value = sum(value.values()) if isinstance(value, dict) else value
                    events.add_metric([worker, name, event], float(value or 0))
                for kind in ("used", "capacity"):
                    if f"store_{kind}_bytes" in stats:
                        used.add_metric([worker, name, kind], float(stats[f"store_{kind}_bytes"]))
        yield events
        yield used

    def collect(self):
        blocks = GaugeMetricFamily("prefixkv_blocks", "Blocks by tier and state (active, cached, free)",
                                   labels=["worker", "tier", "state"])
        counters = {name: CounterMetricFamily(name, text, labels=["worker"]) for name, text, _ in _MANAGER_COUNTERS}
        for worker, mgr in self.managers:
            s = mgr.stats()
            blocks.add_metric([worker, "device", "active"], s.active_blocks)
            blocks.add_metric([worker, "device", "cached"], s.evictable_blocks)
            blocks.add_metric([worker, "device", "free"], s.free_uncached_blocks)
            if mgr.num_host_blocks:
                # as on the device: the host tier's cached (evictable) blocks are not free ones
                blocks.add_metric([worker, "host", "active"], s.host_active_blocks)
                blocks.add_metric([worker, "host", "cached"], s.host_evictable_blocks)
                blocks.add_metric([worker, "host", "free"], s.host_free_uncached_blocks)
            for name, _, field in _MANAGER_COUNTERS:
                counters[name].add_metric([worker], getattr(s, field))
        for worker, tier, stats in self.tiers:
            for state, value in self._tier_counts(worker, tier, stats).items():
                blocks.add_metric([worker, tier, state], value)
        yield blocks
        yield from counters.values()
        yield from self._store_tiers()
        errors = CounterMetricFamily("prefixkv_tier_stats_errors", "Scrapes that left a tier out: its stats() "
                                     "raised or was not a dict of finite block counts", labels=["worker", "tier"])
        with self._lock:
            failed = list(self.tier_errors.items())
        for (worker, tier), n in failed:
            errors.add_metric([worker, tier], n)
        yield errors
        running = GaugeMetricFamily("prefixkv_engine_running_requests", "Requests holding device blocks",
                                    labels=["worker"])
        waiting = GaugeMetricFamily("prefixkv_engine_waiting_requests", "Requests waiting or preempted",
                                    labels=["worker"])
        steps = CounterMetricFamily("prefixkv_engine_steps", "Engine steps run", labels=["worker"])
        for worker, engine in self.engines:
            scheduler = engine.scheduler
            running.add_metric([worker], len(scheduler.running))
            waiting.add_metric([worker], len(scheduler.waiting))
            # steps the engine ran (the scheduler's step_count also counts empty rounds: idle polls)
            steps.add_metric([worker], engine.run_metrics.steps)
        yield from (running, waiting, steps)


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._collector = _Collector()
        self.registry.register(self._collector)
        self._decisions = Counter("prefixkv_router_decisions", "Router decisions by router and reason",
                                  ["router", "reason"], registry=self.registry)

    def watch_manager(self, manager, *, worker: str = "0") -> None:
        """Export ``manager`` under ``worker``. Watching it again under that label is a no-op (as
        ``watch_engine`` does for its manager); another manager under a watched label is refused
        (``ValueError``): its series would collide."""
        _label("worker", worker)
        if not callable(getattr(manager, "stats", None)) or not hasattr(manager, "num_host_blocks"):
            raise InvalidArgument("manager", f"expected a KVCacheManager, got {type(manager).__name__}")
        for w, watched in self._collector.managers:
            if w == worker:
                if watched is manager:
                    return
                raise ValueError(f"worker {worker!r} already exports another manager; give each its own label")
        for w, tier, _ in self._collector.tiers:
            if w == worker and tier in ("device", "host"):
                raise ValueError(f"worker {worker!r} already exports a tier named {tier!r}")
        self._collector.managers.append((worker, manager))

    def watch_tier(self, tier: str, stats: Callable[[], dict], *, worker: str = "0") -> None:
        """A lower tier: ``stats()`` returns block counts by state (``{"active": n, "free": m}``).
        One tier name per worker, and not a manager's own ``device`` / ``host`` (``ValueError``).
        Only the states in ``TIER_STATES`` are exported; a scrape where ``stats()`` raises or gives
        a state that is not a finite number leaves the tier out and counts it in
        ``prefixkv_tier_stats_errors_total``."""
        _label("tier", tier)
        _label("worker", worker)
        if not callable(stats):
            raise InvalidArgument("stats", f"expected a callable returning block counts by state, got {stats!r}")
        taken = {t for w, t, _ in self._collector.tiers if w == worker}
        if any(w == worker for w, _ in self._collector.managers):
            taken |= {"device", "host"}
        if tier in taken:
            raise ValueError(f"worker {worker!r} already exports tier {tier!r}")
        self._collector.tiers.append((worker, tier, stats))

    def watch_engine(self, engine, *, worker: str = "0") -> None:
        """Export ``engine`` (and its manager) under ``worker``; the same engine again is a no-op,
        another engine under a watched label is refused (``ValueError``)."""
        _label("worker", worker)
        if not all(hasattr(engine, name) for name in ("manager", "scheduler", "run_metrics")):
            raise InvalidArgument("engine", f"expected an Engine, got {type(engine).__name__}")
        for w, watched in self._collector.engines:
            if w == worker:
                if watched is engine:
                    return
                raise ValueError(f"worker {worker!r} already exports another engine; give each its own label")
        self.watch_manager(engine.manager, worker=worker)
        self._collector.engines.append((worker, engine))

    def router_decision(self, decision, router: str = "kv-aware+guard") -> None:
        """Count one routing decision (usable as ``FleetRouter(on_decision=...)``). A reason that is
        not one of the router's own (``REASONS``) is counted as ``other``: each label value is a
        series kept for the life of the process, so a reason carrying an id would grow without end."""
        _label("router", router)
        reason = decision.reason
        known = isinstance(reason, str) and reason in REASONS
        self._decisions.labels(router=router, reason=reason if known else "other").inc()

    def serve(self, port: int = 0, addr: str = "127.0.0.1"):
        """Serve ``/metrics`` over HTTP; returns the server (``.server_port``, ``.shutdown()``)."""
        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        return server
