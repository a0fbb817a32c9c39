"""Second review of prefixkv/fleet: each test pins one defect that was found and fixed.

ZeroMQ tests use real sockets on 127.0.0.1 (``fleet_doubles``), a test clock for the
subscriber's and the router's notion of time, and bounded loops for every wait.
"""

from __future__ import annotations

import threading
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from fleet_doubles import BOUND_S, Clock, ScriptedWorker, follow, holds, live_link, stored, until  # noqa: E402, F401 (follow: a fixture)

from prefixkv import InvalidArgument, KVCacheManager  # noqa: E402
from prefixkv.events import BlockStored as CoreStored  # noqa: E402
from prefixkv.fleet import subscriber as subscriber_module  # noqa: E402
from prefixkv.fleet import wire  # noqa: E402
from prefixkv.fleet.publisher import KVEventPublisher  # noqa: E402
from prefixkv.fleet.subscriber import FleetRouter  # noqa: E402

INTERVAL = 10.0    # heartbeat interval the scripted worker announces: the test clock decides expiry



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


# -- subscriber ------------------------------------------------------------------------------

def test_sustained_overflow_asks_for_one_snapshot_and_keeps_it(follow, monkeypatch):
    """Early batches kept overflowing while a snapshot was out: each overflow dropped the request
    (and so any reply to it) and asked again, so a snapshot slower than MAX_PENDING batches
    never landed. One snapshot is asked for; overflow meanwhile drops the oldest early
    batches (the snapshot covers them) and the reply is kept."""
    worker, sub, clock = follow
    monkeypatch.setattr(subscriber_module, "MAX_PENDING", 2)
    link = live_link(worker, sub)
    worker.publish(stored(1), lost=True)
    for h in range(2, 14):
        worker.publish(stored(h, parent=h - 1))
    requests: list = []
    end = time.monotonic() + BOUND_S
    while not (link.live_high == 12 and any(r == wire.SNAPSHOT_REQUEST for _, r in requests)):
        assert time.monotonic() < end, "no snapshot asked for"
        sub.poll(0.02)
        requests += worker.take_requests()
    for _ in range(20):                   # any request asked again on the way in arrives meanwhile
        sub.poll(0.02)
        requests += worker.take_requests()
    snapshots = [(client, r) for client, r in requests if r == wire.SNAPSHOT_REQUEST]
    assert len(snapshots) == 1, [r for _, r in requests]
    assert len(link.pending) <= 2
    worker.answer(*snapshots[0])
    until(sub, lambda: holds(sub, range(1, 14)) and link.asking is None, worker, bound=5.0)
    assert link.expected == worker.next_seq and not link.pending


def test_a_request_never_answered_is_asked_again_at_a_growing_interval(follow):
    """A worker that beats but never answers (a wedged replay socket) was asked again every
    REPLY_TIMEOUT_S for as long as it lived. Asking again backs off, doubling up to
    MAX_RETRY_S; a reply frame starts it over."""
    worker, sub, clock = follow
    link = live_link(worker, sub)
    worker.publish(stored(1), lost=True)
    worker.publish(stored(2, parent=1))
    until(sub, lambda: link.asking == "replay")
    worker.take_requests()
    asked_at = []
    for step in range(60):                # 60 s on the test clock, beating as a live worker does
        clock.now += 1.0
        if step % 5 == 0:
            worker.beat()
        sub.poll(0.01)
        if worker.take_requests():
            asked_at.append(clock.now)
    gaps = [b - a for a, b in zip(asked_at, asked_at[1:])]
    assert len(asked_at) >= 3 and gaps == sorted(gaps) and gaps[-1] > gaps[0], asked_at
    assert max(gaps) <= subscriber_module.MAX_RETRY_S + 1.0
    clock.now += subscriber_module.MAX_RETRY_S + 1.0
    worker.beat()
    until(sub, lambda: holds(sub, {1, 2}) and link.asking is None, worker, bound=5.0)   # answered at last
    assert link.retries == 0


# -- FleetRouter ------------------------------------------------------------------------------

def test_the_router_runs_on_the_clock_it_is_given():
    """FleetRouter read time.monotonic() for predicted inserts (and its subscriber for liveness)
    with no way to pass a clock: their expiry could not be tested, nor driven by a simulated
    clock. clock= now drives both."""
    clock = Clock()
    router = FleetRouter("prefix", block_size=4, hash_seed=0, predict_ttl_s=5.0, clock=clock)
    worker = ScriptedWorker(interval=INTERVAL)
    try:
        router.connect("w", worker.endpoints)
        worker.wait_subscribed()
        worker.beat()
        link = router.subscriber.link("w")
        until(router.subscriber, lambda: link.heartbeat is not None)
        assert link.last_seen == clock.now
        tokens = list(range(12))
        assert router.pick(tokens).overlap_blocks == 0
        assert router.pick(tokens).overlap_blocks == 3        # predicted on w
        clock.now += 6.0                                       # past the TTL, within liveness
        assert router.pick(tokens).overlap_blocks == 0         # the prediction expired on this clock
        clock.now += 3 * INTERVAL + 1
        assert router.subscriber.live_workers() == []
    finally:
        router.close()
        worker.close()


@pytest.mark.parametrize("hash_seed,fragment", [(None, "None"), ("0", "'0'"), (1.5, "1.5"), (2**64, "64-bit")])
def test_the_router_refuses_a_hash_seed_it_cannot_pin(hash_seed, fragment):
    """hash_seed=None hashed prompts with the process's random seed and turned the seed check
    off: no worker's hashes could ever match, yet every worker was picked as usual."""
    with pytest.raises(InvalidArgument) as info:
        FleetRouter("kv-aware", block_size=4, hash_seed=hash_seed).close()
    _refused(info, "hash_seed", fragment)


def test_pick_needs_tokens_or_hashes_but_not_both():
    router = FleetRouter("kv-aware", block_size=4, hash_seed=0)
    try:
        for kwargs in ({}, dict(tokens=[1, 2, 3, 4], hashes=[b"x"])):
            with pytest.raises(InvalidArgument) as info:
                router.pick(**kwargs)
            _refused(info, "tokens", "hashes")
    finally:
        router.close()


# -- bad arguments: InvalidArgument naming the argument (still the ValueError / TypeError) ---------

def _router_config(**kwargs):
    from prefixkv.fleet.router import RouterConfig
    return RouterConfig(**kwargs)


def _make_router(name):
    from prefixkv.fleet.index import KVIndex
    from prefixkv.fleet.router import RouterConfig, make_router
    return make_router(name, KVIndex(), RouterConfig(block_size=4))


def _index(**kwargs):
    from prefixkv.fleet.index import KVIndex
    return KVIndex(**kwargs)


def _index_apply(events):
    from prefixkv.fleet.index import KVIndex
    index = KVIndex()
    index.add_worker("w")
    index.apply("w", events)


def _fleet_config(**kwargs):
    from prefixkv.fleet.simulator import FleetConfig
    return FleetConfig(**{"replicas": 2, "capacity": 10, **kwargs})


@pytest.mark.parametrize("call,argument,fragment", [
    (lambda: _router_config(block_size=0), "block_size", "positive"),
    (lambda: _router_config(block_size="4"), "block_size", "int"),
    (lambda: _router_config(block_size=4.5), "block_size", "int"),
    (lambda: _router_config(block_size=4, lower_tier_credit=2.0), "lower_tier_credit", "[0, 1]"),
    (lambda: _router_config(block_size=4, lower_tier_credit="0.5"), "lower_tier_credit", "number"),
    (lambda: _router_config(block_size=4, decode_share=-1), "decode_share", ">= 0"),
    (lambda: _router_config(block_size=4, decode_share=float("inf")), "decode_share", "finite"),
    (lambda: _router_config(block_size=4, guard_slack=None), "guard_slack", "number"),
    (lambda: _router_config(block_size=4, seed="x"), "seed", "int"),
    (lambda: _router_config(block_size=4, hash_seed="0"), "hash_seed", "int or None"),
    (lambda: _router_config(block_size=4, fingerprint=None), "fingerprint", "str"),
    (lambda: _make_router("nearest"), "router", "'nearest'"),
    (lambda: _make_router(["kv-aware"]), "router", "kv-aware"),
    (lambda: _index(predict_ttl=0), "predict_ttl", "> 0"),
    (lambda: _index(predict_ttl="30"), "predict_ttl", "number"),
    (lambda: _index_apply([object()]), "events", "object"),
    (lambda: wire.to_wire([object()], block_size=4), "events", "object"),
    (lambda: _fleet_config(replicas=0), "replicas", "must be positive"),
    (lambda: _fleet_config(capacity=2.5), "capacity", "integer"),
    (lambda: _fleet_config(speedup=0), "speedup", "must be positive"),
])
def test_bad_arguments_are_refused_with_invalid_argument_naming_them(call, argument, fragment):
    with pytest.raises(InvalidArgument) as info:
        call()
    _refused(info, argument, fragment)


def test_the_subscriber_refuses_bad_arguments_by_name(follow):
    worker, sub, _ = follow
    with pytest.raises(InvalidArgument) as info:
        sub.connect("w", worker.endpoints)
    _refused(info, "worker_id", "'w'", "already connected")
    with pytest.raises(InvalidArgument) as info:
        sub.connect("w2", {"events": "tcp://127.0.0.1:5999"})
    _refused(info, "endpoints", "'replay'", "'heartbeat'")
    for timeout_s in (-1, float("nan"), "0"):
        with pytest.raises(InvalidArgument) as info:
            sub.poll(timeout_s)
        _refused(info, "timeout_s")
    for max_messages in (0, 2.5, "9"):
        with pytest.raises(InvalidArgument) as info:
            sub.poll(0, max_messages=max_messages)
        _refused(info, "max_messages")
    assert set(sub._links) == {"w"}


# -- further review ----------------------------------------------------------------------------

def test_connect_refuses_a_worker_id_no_heartbeat_can_carry_and_endpoints_that_are_no_mapping():
    """A non-str id was connected, then every heartbeat of that worker (whose id is a str on the
    wire) was refused as another worker's ("from worker '7', not from 7"); endpoints=None
    failed with "argument of type 'NoneType' is not iterable"."""
    from prefixkv.fleet.index import KVIndex
    from prefixkv.fleet.subscriber import FleetSubscriber

    sub = FleetSubscriber(KVIndex())
    try:
        with pytest.raises(InvalidArgument) as info:
            sub.connect(7, {"events": "tcp://127.0.0.1:5999", "replay": "tcp://127.0.0.1:5998",
                            "heartbeat": "tcp://127.0.0.1:5997"})
        _refused(info, "worker_id", "str")
        with pytest.raises(InvalidArgument) as info:
            sub.connect("w", None)
        _refused(info, "endpoints", "NoneType")
        assert sub._links == {} and sub._by_socket == {}
    finally:
        sub.close()


def test_a_router_refuses_an_on_decision_it_cannot_call():
    """A non-callable on_decision failed in pick() after the decision had been counted on the
    worker (predicted inserts, dispatched tokens): the caller got an error for a routed request."""
    with pytest.raises(InvalidArgument) as info:
        FleetRouter("kv-aware", block_size=4, hash_seed=0, on_decision="metrics").close()
    _refused(info, "on_decision", "callable")


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
