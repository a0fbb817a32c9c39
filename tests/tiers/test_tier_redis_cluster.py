"""The block store on a three-node Redis Cluster (issue 14, acceptance point 5, at the store level).

Groups of consecutive blocks share a slot (one Lua probe and one MGET per group) while
prompts spread over the shards. With one node killed and the cluster's node timeout passed,
blocks on the other nodes still hit (``cluster-require-full-coverage no``), the dead node's
blocks are misses, and every call stays fast.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from redis_fixtures import Blocks, cluster_url, needs_redis, redis_cluster  # noqa: F401 (fixture)

pytestmark = needs_redis
pytest.importorskip("redis")

from redis.crc import key_slot  # noqa: E402

from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_store import RedisBlockStore, RedisStoreConfig  # noqa: E402

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)
NODE_TIMEOUT_S = 1.0
CHAINS = [Blocks(FP, 40, seed=200 + i) for i in range(24)]      # 3 groups each


def owners(store, blocks):
    """Node name owning each group of ``blocks``, per the store's slot map."""
    return [store.topology.node_for(store.keys.key(blocks.chain, a)).name
            for a, _ in store.keys.group_ranges(0, len(blocks))]


def test_cluster_round_trip_spreads_prompts_over_shards(redis_cluster):
    with RedisBlockStore(cluster_url(redis_cluster[:1]), FP) as store:     # one seed finds all three
        assert store.topology.cluster and len(store.topology.masters()) == 3
        for b in CHAINS:
            store.put(b.chain, 0, b.payloads, b.contents)
        assert store.flush()
        s = store.stats()
        assert s.writes == 24 * 40 and s.write_errors == 0
        for b in CHAINS:
            assert store.probe(b.chain) == 40
            got = store.fetch(b.chain, 0, 40, b.contents)
            assert got.stop is None and [p.tobytes() for p in got.payloads] == b.payloads
        keys = [int(n.command("DBSIZE")[1:-2]) for n in redis_cluster]
        assert sum(keys) == 24 * 40 and min(keys) > 0, keys
        # all blocks of one group in one slot
        for b in CHAINS[:4]:
            slots = [key_slot(k) for k in store.keys.keys(b.chain, 0, 16)]
            assert len(set(slots)) == 1
        assert store.stats().read_errors == 0
        stats = store.server_stats()
        assert len(stats) == 3 and sum(s["keys"] for s in stats) == 24 * 40
        assert store.clear(FP.hex) == 24 * 40 and store.probe(CHAINS[0].chain) == 0


def test_one_node_hung_calls_stay_bounded_and_recover(redis_cluster):
    """SIGSTOP one master: the first call that meets it costs one socket timeout, later calls
    skip it (its breaker is open), the other shards keep hitting; after SIGCONT it serves again."""
    with RedisBlockStore(cluster_url(redis_cluster), FP, RedisStoreConfig(probe_interval_s=0.5)) as store:
        for b in CHAINS:
            store.put(b.chain, 0, b.payloads)
        assert store.flush()
        hung = redis_cluster[2]
        name = f"127.0.0.1:{hung.port}"
        hung.pause()
        try:
            worst = 0.0
            for b in CHAINS:
                groups = owners(store, b)
                t0 = time.perf_counter()
                n = store.probe(b.chain)
                got = store.fetch(b.chain, 0, 40)
                worst = max(worst, time.perf_counter() - t0)
                expect = 40 if name not in groups else 16 * groups.index(name)
                assert n == expect and got.count == expect
            assert worst < 5 * 0.25, worst
        finally:
            hung.resume()
        t0 = time.monotonic()
        while store.stats().nodes_down and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        assert store.stats().nodes_down == 0
        assert all(store.probe(b.chain) == 40 for b in CHAINS)


def test_one_node_killed_blocks_on_the_others_still_hit(redis_cluster):
    with RedisBlockStore(cluster_url(redis_cluster), FP, RedisStoreConfig(probe_interval_s=1.0)) as store:
        for b in CHAINS:
            store.put(b.chain, 0, b.payloads)
        assert store.flush()
        victim = redis_cluster[1]
        victim.stop()
        time.sleep(NODE_TIMEOUT_S * 3)           # past the node timeout: the others mark it failed
        survivors = [n for n in redis_cluster if n is not victim]
        assert all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in survivors)
        dead = f"127.0.0.1:{victim.port}"
        full = partial = 0
        for b in CHAINS:
            groups = owners(store, b)
            expect = 40 if dead not in groups else 16 * groups.index(dead)
            t0 = time.perf_counter()
            n = store.probe(b.chain)
            got = store.fetch(b.chain, 0, 40)
            assert time.perf_counter() - t0 < 5 * 0.25
            assert n == expect and got.count == expect, (groups, n, got.count)
            assert [p.tobytes() for p in got.payloads] == b.payloads[:expect]
            full += expect == 40
            partial += 0 < expect < 40
        assert full > 0, "no prompt lived only on the surviving nodes"
        s = store.stats()
        assert s.nodes_down == 1 and s.rejected == {}
        # writes to the surviving shards go on; the dead shard's are dropped and counted
        fresh = [Blocks(FP, 16, seed=900 + i) for i in range(12)]
        for b in fresh:
            store.put(b.chain, 0, b.payloads)
        assert store.flush()
        for b in fresh:
            alive = owners(store, b)[0] != dead
            assert store.probe(b.chain) == (16 if alive else 0)
        assert store.stats().dropped_down > 0
