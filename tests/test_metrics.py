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
