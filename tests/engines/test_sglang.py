"""prefixkv's HiCache backend under SGLang 0.5.23's real HiCacheController (issue 27's acceptance).

Each step runs in a fresh process of the SGLang venv (engine_runner): ``write`` fills a real
MHATokenToKVPoolHost on CPU and backs the pages up through the controller (``batch_set_v1``);
``read`` is another process whose controller prefetches them (``batch_exists`` then
``batch_get_v1``) into its own host pool, and compares bytes with what was written. The
torchvision SGLang imports is a test-only stub package (tests/engines/stubs/torchvision).
"""

from __future__ import annotations

import json
import subprocess

import pytest

from engine_runner import run, tier_stats
from redis_fixtures import cluster_url, needs_redis, own_redis_server, redis_cluster, redis_server  # noqa: F401

pytestmark = [pytest.mark.sglang]

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
PAGES, PAGE = 6, 8
CAPACITY = {"capacity_bytes": 64 * 2**20}


def spec(tmp_path, store: str, **more) -> dict:
    extra = CAPACITY if store.startswith("disk://") else {}
    return {"store": store, "layouts": LAYOUTS, "model": "tiny-a", "pages": PAGES, "out": str(tmp_path / "out"),
            "extra": extra, **more}


@pytest.fixture(params=["disk", pytest.param("redis", marks=needs_redis)])
def store_url(request, tmp_path):
    if request.param == "disk":
        return f"disk://{tmp_path / 'disk'}"
    server = request.getfixturevalue("redis_server")
    server.command("FLUSHALL")
    return server.url


def test_write_then_fresh_process_prefetch_every_layout(tmp_path, store_url):
    s = spec(tmp_path, store_url)
    wrote = run("sglang", "write", s, tmp_path)
    for layout in LAYOUTS:
        w = wrote[layout]
        assert w["completed_tokens"] == PAGES * PAGE and w["flushed"], (layout, w)
        assert w["stats"]["store"]["writes"] == PAGES and w["stats"]["errors"] == 0, (layout, w)
    assert len({w["fingerprint"] for w in wrote.values()}) == len(LAYOUTS)     # a layout is a namespace
    scrape = {"extra": {**s["extra"], "metrics_port": 0}}
    got = run("sglang", "read", {**s, **scrape}, tmp_path)
    for layout in LAYOUTS:
        r = got[layout]
        kind = "disk" if store_url.startswith("disk://") else "redis"
        series = f'prefixkv_engine_loaded_pages_total{{engine="sglang",fingerprint="{r["fingerprint"]}",store="{kind}"}}'
        assert f"{series} {float(PAGES)}" in r["metrics"], (layout, r["metrics"])
        assert r["hit_tokens"] == PAGES * PAGE and r["completed_tokens"] == PAGES * PAGE, (layout, r)
        assert r["bytes_equal"] == [True] * PAGES, layout
        assert r["stats"]["hit_pages"] == PAGES and r["stats"]["loaded_pages"] == PAGES
        assert r["fingerprint"] == wrote[layout]["fingerprint"]
    # the operator's view: the pages each layout's backend wrote
    if store_url.startswith("disk://"):
        found = {n["fingerprint"]: n["blocks"] for n in tier_stats(store_url)["namespaces"]}
        assert found == {w["fingerprint"]: PAGES for w in wrote.values()}
    else:
        nodes = tier_stats(store_url)["nodes"]
        assert sum(n["keys"] for n in nodes) == PAGES * len(LAYOUTS)


@pytest.mark.redis
def test_a_redis_cluster_store(tmp_path, redis_cluster):  # noqa: F811
    """redis+cluster:// in the extra config: pages spread over the three masters by their own
    keys' slots; a fresh process prefetches them all, bytes equal."""
    s = spec(tmp_path, cluster_url(redis_cluster), layouts=["page_first", "layer_first"], pages=12)
    wrote = run("sglang", "write", s, tmp_path)
    assert all(w["stats"]["store"]["writes"] == 12 for w in wrote.values()), wrote
    got = run("sglang", "read", s, tmp_path)
    for layout, r in got.items():
        assert r["completed_tokens"] == 12 * PAGE and r["bytes_equal"] == [True] * 12, (layout, r)
    keys = [int(n.command("DBSIZE").split(b":")[1].split(b"\r")[0]) for n in redis_cluster]
    assert sum(keys) == 24 and all(k > 0 for k in keys), keys


def test_faults_are_misses_counted_and_nothing_wrong_is_loaded(tmp_path, store_url):
    """A flipped byte, a truncated value and another model's value each end the run of hits at
    that page (the pages before it load, bytes equal); another model or another cache_salt finds
    nothing. Every refusal is counted by reason."""
    layouts = ["page_first", "layer_first", "page_head"]
    s = spec(tmp_path, store_url, layouts=layouts)
    run("sglang", "write", s, tmp_path)
    run("sglang", "write", {**s, "model": "tiny-b", "layouts": ["page_head"]}, tmp_path)
    damage = [{"layout": "page_first", "page": 2, "how": "flip"},
              {"layout": "layer_first", "page": 1, "how": "truncate"},
              {"layout": "page_head", "page": 3, "how": "foreign", "from_model": "tiny-b"}]
    runs = [{"damage": damage}, {"model": "tiny-c"}, {"salt": "tenant-2"}]
    damaged, other_model, other_salt = run("sglang", "read", {**s, "runs": runs}, tmp_path)
    for layout, good, reason in (("page_first", 2, "payload_checksum"), ("layer_first", 1, "truncated"),
                                 ("page_head", 3, "fingerprint")):
        r = damaged[layout]
        assert r["hit_tokens"] == PAGES * PAGE, (layout, r)            # present: exists cannot tell
        assert r["completed_tokens"] == good * PAGE, (layout, r)       # the run ends at the damaged page
        assert r["bytes_equal"] == [True] * good, layout
        rejected = r["stats"]["store"]["rejected"]
        assert sum(rejected.values()) == 1 and (reason in rejected or reason == "truncated" and
                                                 set(rejected) <= {"truncated", "length"}), (layout, rejected)
        assert r["stats"]["stops"] == {next(iter(rejected)): 1}
    for r in (*other_model.values(), *other_salt.values()):
        assert r["hit_tokens"] == 0 and r["completed_tokens"] == 0, r
        assert r["stats"]["lookup_pages"] == PAGES and r["stats"]["hit_pages"] == 0 and r["stats"]["loads"] == 0


@pytest.mark.redis
def test_redis_hung_then_killed_is_a_miss_after_at_most_one_timeout(tmp_path, own_redis_server):  # noqa: F811
    """SIGSTOP (a hung server: the socket accepts, nothing answers), then SIGKILL (refused): each
    fresh reader's prefetch finds nothing after at most one 0.2 s timeout, and nothing raises."""
    s = spec(tmp_path, own_redis_server.url, layouts=["page_first"], extra={"timeout_s": 0.2})
    run("sglang", "write", s, tmp_path)
    own_redis_server.pause()
    try:
        hung = run("sglang", "read", s, tmp_path)["page_first"]
    finally:
        own_redis_server.resume()
    own_redis_server.stop()
    killed = run("sglang", "read", s, tmp_path)["page_first"]
    for r in (hung, killed):
        assert r["hit_tokens"] == 0 and r["completed_tokens"] == 0, r
        assert r["query_s"] < 0.2 + 0.5, r             # one socket timeout (0.2 s), slack for 2 shared cores
        assert r["stats"]["errors"] == 0               # nothing raised, into SGLang or into the adapter
        assert r["stats"]["store"]["breaker_opens"] >= 1


def test_legacy_calls_write_the_values_v1_reads(tmp_path):
    """``interface_v1: 0``: the controller's generic batch_set of flat page tensors; a v1 reader
    finds the same values (one value per page, whichever call wrote it)."""
    s = spec(tmp_path, f"disk://{tmp_path / 'disk'}", layouts=["layer_first", "page_first"])
    wrote = run("sglang", "write", {**s, "interface_v1": 0}, tmp_path)
    assert all(w["completed_tokens"] == PAGES * PAGE for w in wrote.values()), wrote
    got = run("sglang", "read", s, tmp_path)
    for layout, r in got.items():
        assert r["completed_tokens"] == PAGES * PAGE and r["bytes_equal"] == [True] * PAGES, (layout, r)


def test_the_engine_bench_runs(tmp_path):
    """benches/engine_backends_bench.py, once and small, so it cannot rot (no timing asserted)."""
    from engine_runner import PYTHONS, REPO, absent, engine_env

    reason = absent("sglang")
    if reason:
        pytest.skip(reason)
    proc = subprocess.run([PYTHONS["sglang"], str(REPO / "benches" / "engine_backends_bench.py"), "--pages", "8",
                           "--repeat", "1", "--json", "--dir", str(tmp_path / "bench")], capture_output=True,
                          text=True, timeout=300, env=engine_env())
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {"disk"} <= set(out) and out["disk"]["batch_get_v1"]["median_ms"] > 0
