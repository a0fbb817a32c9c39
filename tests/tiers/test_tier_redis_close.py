"""Closing the Redis block store, on a real redis-server on loopback: ``close()`` is bounded, and
nothing opens a socket once it has returned (a writer round still running then, a breaker probe,
a probe / fetch / put, which are refused); a store dropped without ``close()`` stops its thread.
Every wait is bounded; nothing asserts on timing."""

from __future__ import annotations

import gc
import threading
import weakref

import numpy as np
import pytest

from redis_fixtures import Blocks, needs_redis, own_redis_server, raw, redis_server, server  # noqa: F401 (fixtures)

pytestmark = needs_redis
redis = pytest.importorskip("redis")

from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_net import RemoteTierError  # noqa: E402
from prefixkv.tiers.redis_store import RedisBlockStore  # noqa: E402

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)
BOUND_S = 10.0


def stored(store, blocks):
    n = store.put(blocks.chain, 0, blocks.payloads, blocks.contents)
    assert store.flush()
    return n


def sockets_open(store) -> list[str]:
    """The store's connections that hold a socket."""
    return [f"{node.name}/{which}" for node in store.topology.nodes.values()
            for which, conn in (("fg", node.fg), ("bg", node.bg)) if conn._sock is not None]


def test_a_writer_round_that_outlives_close_opens_no_socket(server, raw):  # noqa: F811
    """close() joins the writer for a bounded time; a round still running then (a slow node) went on
    after the store had closed its sockets, and its EXISTS / SET reopened them: the late write
    reached the server and the socket stayed open for the life of the process."""
    blocks = Blocks(FP, 3, seed=1)
    store = RedisBlockStore(server.url, FP)
    writer = store.writer
    entered, gate = threading.Event(), threading.Event()
    real_write = writer._write

    def held_write(batch):          # the round is in flight when close() gives up on the join
        entered.set()
        gate.wait(BOUND_S)
        real_write(batch)

    writer._write = held_write
    writer.join_timeout_s = 0.05
    assert store.put(blocks.chain, 0, blocks.payloads) == 3
    assert entered.wait(BOUND_S)
    store.close(flush_timeout_s=0.0)
    assert writer._thread.is_alive()       # the join timed out: the round is still running
    gate.set()
    writer._thread.join(BOUND_S)
    assert not writer._thread.is_alive()
    assert raw.exists(*store.keys.keys(blocks.chain, 0, 3)) == 0
    assert sockets_open(store) == []


def test_a_breaker_probe_after_close_opens_no_socket(own_redis_server):  # noqa: F811
    """The writer's breaker probe (PING) of a node, run after close() by a round that outlived the
    join, reconnected the node's background socket."""
    blocks = Blocks(FP, 2, seed=2)
    store = RedisBlockStore(own_redis_server.url, FP)
    stored(store, blocks)
    node = store.topology.single
    store.close()
    assert node.ping() is False
    assert sockets_open(store) == []


def test_probe_fetch_put_after_close_are_refused_and_open_no_socket(server):  # noqa: F811
    """After close(), probe and fetch reconnected (a fresh socket the store never closes again) and
    answered as if the store were open; put dropped silently. Each is refused with StoreClosed."""
    from prefixkv.tiers.redis_net import StoreClosed

    blocks = Blocks(FP, 2, seed=3)
    store = RedisBlockStore(server.url, FP)
    stored(store, blocks)
    assert store.probe(blocks.chain) == 2
    store.close()
    before = store.stats()
    for call in (lambda: store.probe(blocks.chain), lambda: store.fetch(blocks.chain, 0, 2),
                 lambda: store.put(blocks.chain, 0, blocks.payloads), store.server_stats, store.clear,
                 store.capacity_blocks):
        with pytest.raises(StoreClosed, match="closed"):
            call()
    assert isinstance(StoreClosed("x"), RemoteTierError)
    assert sockets_open(store) == []
    assert store.stats() == before
    store.close()                           # twice: a no-op


def test_a_store_dropped_without_close_stops_its_thread(server):
    """The writer thread (probing every 2 s, holding sockets) referenced nothing of the store, so a
    store garbage-collected without close() left it running for the life of the process."""
    store = RedisBlockStore(server.url, FP)
    thread = store.writer._thread
    assert thread.is_alive()
    ref = weakref.ref(store)
    del store
    gc.collect()
    assert ref() is None
    thread.join(timeout=BOUND_S)
    assert not thread.is_alive()
