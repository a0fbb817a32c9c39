"""Review defects of the block store on Redis Cluster: a master that fails over to its replica."""

from __future__ import annotations

import subprocess
import time

import numpy as np
import pytest

from redis_fixtures import REDIS_CLI, Blocks, RedisServer, free_cluster_port, needs_redis

pytestmark = needs_redis
pytest.importorskip("redis")

from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_store import RedisBlockStore, RedisStoreConfig  # noqa: E402

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)
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
