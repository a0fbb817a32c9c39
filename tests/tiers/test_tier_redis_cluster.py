"""The block store on a three-node Redis Cluster (issue 14, acceptance point 5, at the store level).

Groups of consecutive blocks share a slot (one Lua probe and one MGET per group) while
prompts spread over the shards. With one node killed and the cluster's node timeout passed,
blocks on the other nodes still hit (``cluster-require-full-coverage no``), the dead node's
blocks are misses, and every call stays fast; a master that fails over to its replica is served by
the promoted replica. A command never spans two hash-tag groups, and the tag group depends only on
the fingerprint, so replicas with other ``max_group_blocks`` share blocks. A cluster URL naming a
server without cluster support is refused; one whose seeds are all down still builds.
"""

from __future__ import annotations

import subprocess
import threading
import time

import numpy as np
import pytest

from redis_fixtures import (Blocks, REDIS_CLI, RedisServer, cluster_url, free_cluster_port,  # noqa: F401 (fixtures)
                            needs_redis, redis_cluster, redis_server, server)

pytestmark = needs_redis
pytest.importorskip("redis")

from redis.crc import key_slot  # noqa: E402

from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_net import RemoteTierError  # noqa: E402
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


def stored(store, blocks):
    n = store.put(blocks.chain, 0, blocks.payloads, blocks.contents)
    assert store.flush()
    return n


def test_a_cluster_url_naming_a_server_without_cluster_support_is_refused(server):  # noqa: F811
    """``redis+cluster://`` pointed at a plain server: CLUSTER SLOTS answered 'cluster support
    disabled', the slot map stayed empty and every probe missed and every write was dropped, with
    nothing saying why. Building the store now fails, naming the node and the problem."""
    before = {t.name for t in threading.enumerate()}
    url = f"redis+cluster://127.0.0.1:{server.port}"
    with pytest.raises(RemoteTierError, match=rf"127\.0\.0\.1:{server.port}.*not a Redis Cluster node.*redis://"):
        RedisBlockStore(url, FP)
    assert {t.name for t in threading.enumerate()} - before == set()      # no writer thread left


def test_a_cluster_url_whose_seeds_are_all_down_still_builds(tmp_path):
    """Unreachable seeds stay what they were: the store builds with every breaker open (the
    background probe finds the cluster later); only a seed that answers 'no cluster' is refused."""
    from redis_fixtures import free_port

    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with RedisBlockStore(url, FP) as store:
        assert store.topology.all_down() and store.probe(Blocks(FP, 1, seed=4).chain) == 0


@pytest.mark.parametrize("writer_group,reader_group", [(16, 4), (4, 16), (5, 16)])
def test_replicas_with_different_max_group_blocks_share_blocks(server, writer_group, reader_group):  # noqa: F811
    """The Cluster hash tag of a block came from the first block of its group, and the group was
    ``max_group_blocks``: a replica with another setting named every block past its first group
    differently, and the two shared only that group, silently. The tag group now depends only on
    the fingerprint (what every replica agrees on); ``max_group_blocks`` only caps the keys per
    command."""
    blocks = Blocks(FP, 40, seed=5)
    with RedisBlockStore(server.url, FP, RedisStoreConfig(max_group_blocks=writer_group)) as writer:
        stored(writer, blocks)
        assert writer.probe(blocks.chain) == 40
    with RedisBlockStore(server.url, FP, RedisStoreConfig(max_group_blocks=reader_group)) as reader:
        assert reader.probe(blocks.chain) == 40 and reader.probe(blocks.chain, 7) == 33
        got = reader.fetch(blocks.chain, 3, 40, blocks.contents[3:])
        assert got.stop is None and [p.tobytes() for p in got.payloads] == blocks.payloads[3:]


def test_a_command_never_spans_two_tag_groups():
    """Every probe / MGET range keeps to one hash tag (one Cluster slot), whatever the cap."""
    from redis.crc import key_slot

    from prefixkv.tiers.redis_keys import KeySpace

    chain = Blocks(FP, 70, seed=6).chain
    for cap in (1, 3, 5, 16, 40):
        keys = KeySpace(FP, max_group_blocks=cap)
        for start in (0, 2, 15, 16, 33):
            ranges = keys.group_ranges(start, 70)
            assert ranges[0][0] == start and ranges[-1][1] == 70
            assert all(a < b <= a + min(cap, keys.tag_blocks) for a, b in ranges)
            assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
            for a, b in ranges:
                assert len({key_slot(k) for k in keys.keys(chain, a, b)}) == 1
                assert keys.keys(chain, a, b) == KeySpace(FP).keys(chain, a, b)


BOUND_S = 30.0


def wait_for(check, what, timeout=BOUND_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout} s")


def cluster_node(base, i):
    port = free_cluster_port()
    return RedisServer(base / f"n{i}", port, extra=(
        "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
        "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no")).start()


def test_a_failed_over_master_s_slots_are_served_by_the_promoted_replica(tmp_path):
    """Three masters, the first with a replica. The first master dies; the cluster promotes the
    replica. Blocks of those slots must be written and read again (the slot map reloaded)
    rather than dropped as 'node down' for as long as the dead master stays dead."""
    if REDIS_CLI is None:
        pytest.skip("redis-cli is not installed")
    nodes = []
    try:
        nodes = [cluster_node(tmp_path, i) for i in range(4)]
        masters, replica = nodes[:3], nodes[3]
        subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in masters],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        wait_for(lambda: all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in masters), "cluster ok")
        master_id = masters[0].command("CLUSTER", "MYID").split(b"\r\n")[1].decode()
        subprocess.run([REDIS_CLI, "--cluster", "add-node", f"127.0.0.1:{replica.port}",
                        f"127.0.0.1:{masters[0].port}", "--cluster-slave", "--cluster-master-id", master_id],
                       check=True, capture_output=True, timeout=60)
        wait_for(lambda: b"master_link_status:up" in replica.command("INFO", "replication"), "replica in sync")
        url = "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in masters)
        with RedisBlockStore(url, FP, RedisStoreConfig(probe_interval_s=0.5)) as store:
            chains = [Blocks(FP, 2, seed=900 + i) for i in range(30)]
            dead = store.topology.nodes[f"127.0.0.1:{masters[0].port}"]
            on_dead = [b for b in chains if store.topology.node_for(store.keys.key(b.chain, 0)) is dead]
            assert on_dead
            masters[0].stop()
            wait_for(lambda: b"role:master" in replica.command("INFO", "replication"), "replica promoted")
            store.probe(on_dead[0].chain)           # meets the dead master: opens its breaker

            def all_written():
                for b in on_dead:
                    store.put(b.chain, 0, b.payloads, b.contents)
                store.flush()
                return all(store.probe(b.chain) == 2 for b in on_dead)

            wait_for(all_written, "writes to the failed-over slots resumed")
            for b in on_dead:
                got = store.fetch(b.chain, 0, 2, b.contents)
                assert [p.tobytes() for p in got.payloads] == b.payloads
    finally:
        for node in nodes:
            node.stop()
