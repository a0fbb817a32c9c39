"""Review defects of the Redis block store (``redis_net``, ``redis_writer``, ``redis_store``,
``redis_keys``), each on a real redis-server on loopback (or, once, a real TCP peer on loopback
that is not Redis). Every wait is bounded; nothing asserts on timing."""

from __future__ import annotations

import gc
import socket
import threading
import time
import weakref

import numpy as np
import pytest

from redis_fixtures import Blocks, needs_redis, own_redis_server, raw, redis_server, server  # noqa: F401 (fixtures)

pytestmark = needs_redis
redis = pytest.importorskip("redis")

from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_store import RedisBlockStore, RedisStoreConfig  # noqa: E402

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)
FAST = RedisStoreConfig(probe_interval_s=0.05)
BOUND_S = 10.0


def wait_until(check, what, timeout=BOUND_S):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.02)
    raise AssertionError(f"not within {timeout} s: {what}")




def stored(store, blocks):
    n = store.put(blocks.chain, 0, blocks.payloads)
    assert store.flush()
    return n


class NotRedis:
    """A TCP peer on loopback that answers every request with an HTTP error (a wrong port, a proxy)."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.stopping = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def _serve(self) -> None:
        while not self.stopping:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            with conn:
                conn.settimeout(0.5)
                try:
                    conn.recv(1 << 16)
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")
                except OSError:
                    pass

    def close(self) -> None:
        self.stopping = True
        self.thread.join(timeout=5)
        self.sock.close()


def test_reads_after_a_restart_do_not_trip_on_the_connection_to_the_dead_server(own_redis_server):  # noqa: F811
    """The server restarts while only the background writer talks to it: the writer's failure opens
    the breaker, its probe closes it once the new server answers. The caller's connection still
    holds the dead server's socket; the first read after the recovery must not fail on it (it
    did: a miss, a read error and the breaker open again for another probe interval)."""
    server = own_redis_server
    blocks = Blocks(FP, 4, seed=11)
    with RedisBlockStore(server.url, FP, FAST) as store:
        stored(store, blocks)
        assert store.probe(blocks.chain) == 4          # the caller's connection is open
        server.stop()
        other = Blocks(FP, 2, seed=12)
        store.put(other.chain, 0, other.payloads)      # only the writer meets the dead server
        assert store.flush()
        assert store.stats().nodes_down == 1
        server.start()                                 # same port, empty
        wait_until(lambda: store.stats().nodes_down == 0, "the breaker closes after the restart")
        stored(store, blocks)
        assert store.probe(blocks.chain) == 4
        got = store.fetch(blocks.chain, 0, 4)
        assert got.stop is None and [p.tobytes() for p in got.payloads] == blocks.payloads
        s = store.stats()
        assert s.read_errors == 0 and s.breaker_opens == 1 and s.nodes_down == 0


def test_a_node_that_answers_its_probe_with_an_error_is_up(own_redis_server):  # noqa: F811
    """A server that refuses PING (an ACL without it) but serves the store's commands: once its
    breaker opened (it hung for a moment), the probe's error reply proves it answers; the breaker
    must close (it stayed open forever: every read a miss, every write dropped as 'down')."""
    server = own_redis_server
    assert server.command("ACL", "SETUSER", "default", "-ping").startswith(b"+OK")
    blocks = Blocks(FP, 4, seed=13)
    with RedisBlockStore(server.url, FP, FAST) as store:
        stored(store, blocks)
        assert store.probe(blocks.chain) == 4
        server.pause()
        try:
            assert store.probe(blocks.chain) == 0       # times out: the breaker opens
        finally:
            server.resume()
        assert store.stats().nodes_down == 1
        wait_until(lambda: store.stats().nodes_down == 0, "the breaker closes once the server answers")
        assert store.probe(blocks.chain) == 4


def test_a_peer_that_is_not_redis_fails_soft():
    """A URL naming a port where something else listens: its replies are not RESP. probe raised
    redis' InvalidResponse into the caller (the engine's step), and every write was counted as a
    server error without opening the breaker (a round trip per call, forever). Now the node is
    down like an unreachable one: calls miss, writes are dropped as 'down', nothing raises."""
    peer = NotRedis()
    blocks = Blocks(FP, 4, seed=14)
    try:
        with RedisBlockStore(peer.url, FP, FAST) as store:
            assert store.probe(blocks.chain) == 0
            assert store.fetch(blocks.chain, 0, 4).stop == "error"
            store.put(blocks.chain, 0, blocks.payloads)
            assert store.flush()
            s = store.stats()
            assert s.nodes_down == 1 and s.breaker_opens == 1
            assert s.write_errors == 0 and s.writes == 0
    finally:
        peer.close()


def test_operator_calls_on_a_peer_that_is_not_redis_raise_remote_tier_error():
    from prefixkv.tiers.redis_net import RemoteTierError

    peer = NotRedis()
    try:
        with RedisBlockStore(peer.url, FP, FAST) as store:
            with pytest.raises(RemoteTierError):
                store.server_stats()
            with pytest.raises(RemoteTierError):
                store.clear()
    finally:
        peer.close()


def test_clear_leaves_other_applications_keys_alone(server, raw):
    """``clear()`` SCANned ``pkv:v*``: an application sharing the server with keys such as
    ``pkv:visits`` lost them. Only keys shaped like block keys are deleted."""
    raw.set(b"pkv:visits", b"12")
    raw.set(b"pkv:v2-notes", b"x")
    blocks = Blocks(FP, 3, seed=15)
    with RedisBlockStore(server.url, FP) as store:
        stored(store, blocks)
        assert store.clear() == 3
        assert store.probe(blocks.chain) == 0
        stored(store, blocks)
        assert store.clear(FP.hex) == 3
    assert raw.get(b"pkv:visits") == b"12" and raw.get(b"pkv:v2-notes") == b"x"


def test_negative_start_is_refused_by_probe_and_fetch(server):
    """``fetch(chain, -2, 3)`` of a 16-block chain returned blocks 14, 15, 0, 1, 2 (negative
    indices wrapped to the chain's end) as five consecutive blocks; ``put`` already refused it."""
    blocks = Blocks(FP, 16, seed=16)
    with RedisBlockStore(server.url, FP) as store:
        stored(store, blocks)
        with pytest.raises(ValueError):
            store.fetch(blocks.chain, -2, 3)
        with pytest.raises(ValueError):
            store.probe(blocks.chain, -1)
        assert store.fetch(blocks.chain, 0, 3).count == 3 and store.probe(blocks.chain, 0) == 16


def test_pending_deletions_are_bounded_and_each_key_is_queued_once(server, raw):
    """Every refused value queued its key for an UNLINK in a list with no bound and no
    deduplication: while the writer was busy (a hung node, a long batch), repeated reads of bad
    values grew it without limit. Now it is a set bounded by ``queue_blocks``; the excess is
    dropped and counted (the next read refuses the value again and retries)."""
    from prefixkv.tiers.block_codec import Reject

    chains = [Blocks(FP, 1, seed=100 + i) for i in range(10)]
    with RedisBlockStore(server.url, FP, RedisStoreConfig(queue_blocks=4)) as store:
        for b in chains:
            stored(store, b)
        for b in chains:
            raw.setrange(store.keys.key(b.chain, 0), 0, b"XXXX")          # bad magic
        with store.writer._cv:       # the writer cannot take work while this thread holds its lock
            for _ in range(3):
                for b in chains:
                    assert store.fetch(b.chain, 0, 1).stop is Reject.BAD_MAGIC
            s = store.stats()
            assert s.delete_queue == 4 and s.deletes_dropped == 18      # 6 keys over the bound, 3 times
        assert store.flush()
        s = store.stats()
        assert s.rejected == {"bad_magic": 30} and s.bad_keys_deleted == 4 and s.delete_queue == 0
        assert sum(raw.exists(store.keys.key(b.chain, 0)) for b in chains) == 6


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


def test_why_a_node_is_down_is_reported(own_redis_server):  # noqa: F811
    """A server that refuses the store's (missing) password answered every command with NOAUTH,
    which redis-py raises as a ConnectionError: the node read as down, exactly like a dead one,
    with nothing saying why. stats().node_errors now names the reason per down node, and clears
    it when the node is back."""
    server = own_redis_server
    assert server.command("CONFIG", "SET", "requirepass", "s3cret").startswith(b"+OK")
    blocks = Blocks(FP, 2, seed=17)
    name = f"127.0.0.1:{server.port}"
    with RedisBlockStore(server.url, FP, FAST) as store:
        assert store.probe(blocks.chain) == 0
        s = store.stats()
        assert s.nodes_down == 1 and "Authentication" in s.node_errors[name]
    url = f"redis://:s3cret@127.0.0.1:{server.port}/0"
    with RedisBlockStore(url, FP, FAST) as store:
        stored(store, blocks)
        server.pause()
        try:
            assert store.probe(blocks.chain) == 0
        finally:
            server.resume()
        assert "Timeout" in store.stats().node_errors[name]
        wait_until(lambda: store.stats().nodes_down == 0, "the breaker closes")
        assert store.stats().node_errors == {} and store.probe(blocks.chain) == 2
