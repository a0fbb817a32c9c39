"""prefixkv.metrics: scraped over real HTTP on 127.0.0.1; a failing tier, a bad watch argument or a
router reason without bound never breaks a scrape or grows the series."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.errors import InvalidArgument  # noqa: E402
from prefixkv.fleet.router import Decision  # noqa: E402
from prefixkv.metrics import Metrics  # noqa: E402


def test_manager_tier_and_router_metrics_over_http():
    mgr = KVCacheManager(32, 4, hash_seed=0, num_host_blocks=8)
    mgr.admit("a", list(range(10)))
    mgr.free("a")
    mgr.admit("b", list(range(10)))
    metrics = Metrics()
    metrics.watch_manager(mgr, worker="w0")
    metrics.watch_tier("redis", lambda: {"cached": 5}, worker="w0")
    for reason in ("overlap", "overlap", "guard"):
        metrics.router_decision(Decision("w0", reason, 0, 0, 0.0))
    server = metrics.serve(0)
    try:
        body = urllib.request.urlopen(f"http://127.0.0.1:{server.server_port}/metrics", timeout=30).read().decode()
    finally:
        server.shutdown()
    lines = set(body.splitlines())
    s = mgr.stats()
    assert f'prefixkv_blocks{{state="active",tier="device",worker="w0"}} {float(s.active_blocks)}' in lines
    assert 'prefixkv_blocks{state="free",tier="host",worker="w0"} 8.0' in lines
    assert 'prefixkv_blocks{state="cached",tier="redis",worker="w0"} 5.0' in lines
    assert 'prefixkv_queries_total{worker="w0"} 2.0' in lines
    assert f'prefixkv_hit_tokens_total{{worker="w0"}} {float(s.hit_tokens)}' in lines and s.hit_tokens == 8
    assert 'prefixkv_router_decisions_total{reason="overlap",router="kv-aware+guard"} 2.0' in lines
    assert 'prefixkv_router_decisions_total{reason="guard",router="kv-aware+guard"} 1.0' in lines


def test_host_tier_loads_and_demotions_are_exported_apart_from_swaps():
    """prefixkv_promotions / _demotions count swap-ins and swap-outs only; the host tier's cache
    traffic (a prefix hit loaded from the host, an evicted block demoted to it) had no series."""
    from prometheus_client import generate_latest

    mgr = KVCacheManager(2, 4, hash_seed=0, num_host_blocks=8, host_cache=True)
    mgr.admit("a", list(range(8)), compute_last_token=False)
    mgr.free("a")
    mgr.admit("b", list(range(100, 108)), compute_last_token=False)     # evicts a's 2 blocks: demoted
    mgr.take_demotions()
    mgr.free("b")
    assert mgr.admit("c", list(range(8)), compute_last_token=False) == 8  # a's blocks, from the host
    mgr.take_demotions()
    mgr.take_loads()
    metrics = Metrics()
    metrics.watch_manager(mgr, worker="w0")
    lines = set(generate_latest(metrics.registry).decode().splitlines())
    s = mgr.stats()
    assert s.loads == 2 and s.demotions >= 2 and s.swapped_in_blocks == 0
    assert 'prefixkv_host_loads_total{worker="w0"} 2.0' in lines
    assert f'prefixkv_host_demotions_total{{worker="w0"}} {float(s.demotions)}' in lines
    assert 'prefixkv_promotions_total{worker="w0"} 0.0' in lines


# -- what a scrape leaves out, what watching refuses ------------------------------------------------

def _metrics_lines(metrics) -> set[str]:
    from prometheus_client import generate_latest

    return set(generate_latest(metrics.registry).decode().splitlines())


def _watched_manager():
    pytest.importorskip("prometheus_client")
    from prefixkv import KVCacheManager
    from prefixkv.metrics import Metrics

    mgr = KVCacheManager(8, 4, hash_seed=0)
    metrics = Metrics()
    metrics.watch_manager(mgr, worker="w0")
    return mgr, metrics


def test_metrics_one_failing_tier_does_not_lose_every_series():
    """A tier's stats() that raised (a closed store), or held a value that is not a number (a
    RemoteTier's stats() carries its URL and fingerprint), failed the whole scrape: no worker's
    series were served. Now that tier is left out of the scrape and counted; the rest is exported."""
    mgr, metrics = _watched_manager()
    calls = []

    def closed():
        calls.append(1)
        raise RuntimeError("store closed")

    metrics.watch_tier("redis", lambda: {"cached": 3, "url": "redis://h:1", "fingerprint": "ab" * 16}, worker="w0")
    metrics.watch_tier("disk", closed, worker="w0")
    metrics.watch_tier("nvme", lambda: {"active": "many"}, worker="w0")
    lines = _metrics_lines(metrics)
    assert 'prefixkv_blocks{state="free",tier="device",worker="w0"} 8.0' in lines
    assert 'prefixkv_blocks{state="cached",tier="redis",worker="w0"} 3.0' in lines
    assert not any('tier="redis"' in line and 'state="url"' in line for line in lines)
    assert not any("prefixkv_blocks" in line and ('tier="disk"' in line or 'tier="nvme"' in line) for line in lines)
    assert 'prefixkv_tier_stats_errors_total{tier="disk",worker="w0"} 1.0' in lines
    assert 'prefixkv_tier_stats_errors_total{tier="nvme",worker="w0"} 1.0' in lines
    lines = _metrics_lines(metrics)
    assert 'prefixkv_tier_stats_errors_total{tier="disk",worker="w0"} 2.0' in lines and len(calls) == 2


def test_metrics_tier_states_are_block_states_only():
    """Every key of a tier's stats() became a prefixkv_blocks state: a HostTier's stats() added
    capacity, stores, hits, evictions (counters, summed into the blocks) as block gauges; the
    series per tier were as many as the dict's keys. Only active / cached / free are blocks."""
    from prefixkv.tiers.host import HostTier

    _, metrics = _watched_manager()
    metrics.watch_tier("spare", HostTier(16, 4).stats, worker="w1")
    tier_lines = {line for line in _metrics_lines(metrics) if 'tier="spare"' in line}
    assert tier_lines == {f'prefixkv_blocks{{state="{state}",tier="spare",worker="w1"}} {value}'
                          for state, value in (("active", 0.0), ("cached", 0.0), ("free", 16.0))}


@pytest.mark.parametrize("call, argument", [
    (lambda m, mgr: m.watch_manager(mgr, worker=0), "worker"),
    (lambda m, mgr: m.watch_manager(mgr, worker=""), "worker"),
    (lambda m, mgr: m.watch_manager(object(), worker="w9"), "manager"),
    (lambda m, mgr: m.watch_tier("redis", None, worker="w9"), "stats"),
    (lambda m, mgr: m.watch_tier(("redis",), lambda: {}, worker="w9"), "tier"),
    (lambda m, mgr: m.watch_tier("redis", lambda: {}, worker=7), "worker"),
    (lambda m, mgr: m.watch_engine(mgr, worker="w9"), "engine"),
])
def test_metrics_bad_watch_arguments_are_refused_when_watched(call, argument):
    """A non-string label (worker=0) or a stats that is not callable was accepted, and every later
    scrape then failed ('int' object has no attribute 'replace'; 'NoneType' object is not callable)."""
    mgr, metrics = _watched_manager()
    with pytest.raises(InvalidArgument) as info:
        call(metrics, mgr)
    assert info.value.argument == argument
    assert 'prefixkv_blocks{state="free",tier="device",worker="w0"} 8.0' in _metrics_lines(metrics)


def test_metrics_router_reasons_are_bounded():
    """Each reason became a label value kept for the life of the process: a router (or wrapper)
    whose reasons carry an id made series without bound. Reasons other than the router's own are
    counted as 'other'; the set matches prefixkv.fleet.router's REASON_* constants."""
    from prefixkv.fleet import router as fleet_router
    from prefixkv.fleet.router import Decision
    from prefixkv.metrics import REASONS

    assert REASONS == {v for k, v in vars(fleet_router).items() if k.startswith("REASON_")}
    _, metrics = _watched_manager()
    for i in range(50):
        metrics.router_decision(Decision("w0", f"sticky-session-{i}", 0, 0, 0.0))
    metrics.router_decision(Decision("w0", ["unhashable"], 0, 0, 0.0))
    metrics.router_decision(Decision("w0", "guard", 0, 0, 0.0))
    lines = [line for line in _metrics_lines(metrics) if line.startswith("prefixkv_router_decisions_total")]
    assert sorted(lines) == ['prefixkv_router_decisions_total{reason="guard",router="kv-aware+guard"} 1.0',
                             'prefixkv_router_decisions_total{reason="other",router="kv-aware+guard"} 51.0']
    with pytest.raises(InvalidArgument, match="router"):
        metrics.router_decision(Decision("w0", "guard", 0, 0, 0.0), router=None)
