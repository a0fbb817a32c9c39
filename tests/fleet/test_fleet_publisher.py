"""The KV event publisher on real ZMQ sockets on 127.0.0.1: ``close()`` returns while peers never
read; what its heartbeat or socket thread cannot carry is refused up front; it takes the block size
and hash seed from its manager and refuses one that hashes unlike its heartbeat says; a medium
routers cannot decode is refused, taking no sequence number. Every wait is a bounded loop.
"""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from fleet_doubles import BOUND_S, holds, until  # noqa: E402

from prefixkv import InvalidArgument, KVCacheManager  # noqa: E402
from prefixkv.events import BlockStored as CoreStored  # noqa: E402
from prefixkv.fleet import wire  # noqa: E402
from prefixkv.fleet.publisher import KVEventPublisher  # noqa: E402
from prefixkv.fleet.subscriber import FleetRouter  # noqa: E402


def _refused(info, argument: str, *fragments: str) -> None:
    error = info.value
    assert isinstance(error, InvalidArgument) and error.argument == argument, repr(error)
    for fragment in fragments:
        assert fragment in str(error), str(error)


def _in_thread(call, bound: float = BOUND_S) -> list:
    """Run ``call`` in a daemon thread; returns [result] or [exception], or [] if it hung."""
    outcome: list = []

    def run():
        try:
            outcome.append(call())
        except BaseException as exc:   # noqa: BLE001 - reported to the test
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(bound)
    return outcome


# -- publisher ------------------------------------------------------------------------------

def test_close_returns_while_peers_never_read():
    """A subscriber and a replay client that never read what the publisher sends them: close()
    must not wait for them (every socket is closed without lingering)."""
    pub = KVEventPublisher("w", block_size=4, buffer_steps=5000, heartbeat_interval_s=0.01)
    ctx = zmq.Context()
    sub, dealer = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        for sock, name in ((sub, "events"), (dealer, "replay")):
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.RCVBUF, 1024)
            sock.connect(pub.endpoints[name])
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        for i in range(2000):
            h = i.to_bytes(16, "big")
            pub.publish([CoreStored(h, None, 4, None, 0)], tokens={h: list(range(4))})
        for _ in range(5):
            dealer.send_multipart([b"", wire.seq_bytes(0)])      # replays nobody reads
        outcome = _in_thread(pub.close)
        assert outcome == [None], "close() hung on peers that never read"
    finally:
        sub.close(0)
        dealer.close(0)
        ctx.term()


@pytest.mark.parametrize("kwargs,argument,fragment", [
    (dict(heartbeat_interval_s=float("inf")), "heartbeat_interval_s", "finite"),
    (dict(heartbeat_interval_s=float("nan")), "heartbeat_interval_s", "finite"),
    (dict(heartbeat_interval_s=0), "heartbeat_interval_s", "> 0"),
    (dict(heartbeat_interval_s="1"), "heartbeat_interval_s", "number"),
    (dict(hash_seed=2**64), "hash_seed", "64-bit"),
    (dict(hash_seed=-2**63 - 1), "hash_seed", "64-bit"),
    (dict(hash_seed="0"), "hash_seed", "int or None"),
    (dict(hash_seed=True), "hash_seed", "int or None"),
    (dict(block_size="4"), "block_size", "int"),
    (dict(block_size=0), "block_size", "positive"),
    (dict(buffer_steps=None), "buffer_steps", "int"),
    (dict(buffer_steps=-1), "buffer_steps", ">= 1"),
    (dict(buffer_steps=0), "buffer_steps", ">= 1"),
    (dict(fingerprint=None), "fingerprint", "str"),
    (dict(topic=b"kv"), "topic", "str"),
    (dict(data_parallel_rank=-1), "data_parallel_rank", ">= 0"),
    (dict(worker_id=7), "worker_id", "str"),
])
def test_a_publisher_refuses_what_its_heartbeat_or_socket_thread_cannot_carry(kwargs, argument, fragment):
    """An infinite or huge interval overflowed the socket thread's poll timeout, a seed past
    64 bits could not be encoded into a heartbeat (the thread died: no heartbeats, the worker
    dropped by every router), a non-str worker id or fingerprint made every router's poll()
    fail to decode the heartbeat, and buffer_steps=None or -1 failed with a TypeError or
    deque's 'maxlen must be non-negative'. Each is refused naming the argument, before any
    socket is made."""
    args = dict(worker_id="w", block_size=4)
    args.update(kwargs)
    with pytest.raises(InvalidArgument) as info:
        KVEventPublisher(args.pop("worker_id"), **args)
    _refused(info, argument, fragment)


def test_a_huge_finite_heartbeat_interval_keeps_the_socket_thread_alive():
    """1e300 s (days, in effect: never) overflowed ZMQ's poll timeout (a C long) and killed
    the socket thread, so nothing could be published."""
    from prefixkv.fleet.index import KVIndex
    from prefixkv.fleet.subscriber import FleetSubscriber

    sub = FleetSubscriber(KVIndex())
    with KVEventPublisher("w", block_size=4, heartbeat_interval_s=1e300) as pub:
        sub.connect("w", pub.endpoints)
        try:
            end, n = time.monotonic() + BOUND_S, 0
            while not holds(sub, {0}) and time.monotonic() < end:
                pub.publish([CoreStored(n, None, 4, None, 0)])   # (the first may be lost: not yet subscribed)
                n += 1
                sub.poll(0.05)
            assert holds(sub, {0})
        finally:
            sub.close()


def test_the_publisher_takes_block_size_and_hash_seed_from_its_manager():
    mgr = KVCacheManager(64, 8, hash_seed=42, record_events=True)
    with KVEventPublisher("w", manager=mgr) as pub:
        assert (pub.block_size, pub.hash_seed) == (8, 42)
    unpinned = KVCacheManager(64, 8, record_events=True)      # a random seed per process
    with KVEventPublisher("w", manager=unpinned) as pub:
        assert pub.hash_seed is None                            # no router pinning a seed picks it
    with pytest.raises(InvalidArgument) as info:
        KVEventPublisher("w", manager=mgr, hash_seed=0)
    _refused(info, "hash_seed", "42", "0")
    with pytest.raises(InvalidArgument) as info:
        KVEventPublisher("w", manager=mgr, block_size=4)
    _refused(info, "block_size", "8", "4")
    with pytest.raises(InvalidArgument) as info:
        KVEventPublisher("w")
    _refused(info, "block_size", "manager")


@pytest.mark.parametrize("manager_seed,publisher_seed,block_size", [
    (None, 0, 4),      # the heartbeat says 0: routers pinning 0 routed to hashes they can never match
    (7, 0, 4),
    (0, None, 4),
    (0, 0, 8),
])
def test_publish_from_refuses_a_manager_hashing_unlike_the_heartbeat_says(manager_seed, publisher_seed,
                                                                         block_size):
    """The heartbeat's hash seed and block size were whatever the publisher was told, not what
    the manager it publishes for hashes with: a mismatch made routers compute other hashes
    for its prompts than its events carry. Refused before any event is drained."""
    mgr = KVCacheManager(64, block_size, hash_seed=manager_seed, record_events=True)
    mgr.admit("a", mgr.prompt(list(range(16))))
    with KVEventPublisher("w", block_size=4, hash_seed=publisher_seed) as pub:
        with pytest.raises(InvalidArgument) as info:
            pub.publish_from(mgr)
        _refused(info, "manager")
        assert mgr.drain_events(), "the refused publish_from drained the manager's events"
        assert pub._next_seq == 0


def test_publish_from_accepts_the_manager_it_was_made_for():
    mgr = KVCacheManager(64, 4, hash_seed=0, record_events=True)
    router = FleetRouter("kv-aware", block_size=4, hash_seed=0)
    try:
        with KVEventPublisher("w", manager=mgr, heartbeat_interval_s=0.05) as pub:
            router.connect("w", pub.endpoints)
            prompt = mgr.prompt(list(range(16)))
            mgr.admit("a", prompt)
            pub.publish_from(mgr, prompts=[prompt])
            # events can land before the first heartbeat: the worker is picked once it is live too
            until(router.subscriber, lambda: holds(router.subscriber, prompt.block_hashes())
                  and router.workers())
            assert router.pick(list(range(16))).overlap_blocks == 4
    finally:
        router.close()


def test_publish_refuses_a_medium_routers_cannot_decode():
    """medium=1 went on the wire as it was: every router's poll() then failed to decode the batch
    (a WireError out of poll, the worker's stream stuck). Refused, taking no sequence number."""
    with KVEventPublisher("w", block_size=4) as pub:
        with pytest.raises(InvalidArgument) as info:
            pub.publish([CoreStored(5, None, 4, None, 0)], medium=1)
        _refused(info, "medium", "str")
        pub.publish([CoreStored(5, None, 4, None, 0)])
        end = time.monotonic() + BOUND_S
        while pub._next_seq != 1 and time.monotonic() < end:
            time.sleep(0.01)
        assert pub._next_seq == 1
