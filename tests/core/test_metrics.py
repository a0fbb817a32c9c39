"""prefixkv.metrics: scraped over real HTTP on 127.0.0.1."""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")

from prefixkv import KVCacheManager  # noqa: E402
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
