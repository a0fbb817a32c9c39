"""The subscriber and the router following a worker's stream, on real ZMQ sockets on 127.0.0.1.

A scripted worker (``fleet_doubles``) speaks the wire format; a test clock decides the
subscriber's and the router's notion of time; every wait is a bounded loop. A snapshot keeps the
worker's predicted inserts; a worker followed late is picked up where its stream is; garbage
frames, another worker's heartbeat and bad arguments are refused, changing nothing; a lost replay
reply or snapshot end marker is asked for again, at a growing interval, and an overflow asks for
one snapshot; a worker hashing with another seed is not routed to; ``poll`` returns while a worker
keeps talking; the router runs on the clock it is given.
"""

from __future__ import annotations

import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from fleet_doubles import (BOUND_S, Clock, ScriptedWorker, follow, holds, live_link,  # noqa: E402, F401 (follow: a fixture)
                           stored, until)

from prefixkv import InvalidArgument  # noqa: E402
from prefixkv.fleet import subscriber as subscriber_module  # noqa: E402
from prefixkv.fleet import wire  # noqa: E402
from prefixkv.fleet.subscriber import FleetRouter  # noqa: E402

INTERVAL = 10.0    # heartbeat interval the scripted worker announces: the test clock decides expiry


# -- repair: snapshots, late followers, refused frames, lost replies --------------------------------

def _alive(worker, sub, clock) -> None:
    worker.beat()
    link = sub.link("w")
    until(sub, lambda: link.heartbeat is not None and link.last_seen == clock.now)


def _requests(sub, worker, bound: float = BOUND_S) -> list:
    """Poll until the worker got at least one replay request; returns them, unanswered."""
    end = time.monotonic() + bound
    while time.monotonic() < end:
        sub.poll(0.02)
        got = worker.take_requests()
        if got:
            return got
    raise AssertionError(f"no replay request within {bound} s")


def test_a_snapshot_keeps_the_workers_predicted_inserts(follow):
    """A snapshot repairs what the router knows of the worker; the requests routed to it but
    not yet confirmed are still on their way there and must keep counting."""
    worker, sub, clock = follow
    link = sub.link("w")
    _alive(worker, sub, clock)
    worker.publish(stored(1))
    until(sub, lambda: holds(sub, {1}))
    sub.index.predict("w", [1, 50, 51], now=0.0)      # routed there, its events not in yet
    worker.publish(stored(2, parent=1), lost=True)
    del worker.log[1]                                 # the replay falls short: a snapshot
    worker.publish(stored(3, parent=2))
    until(sub, lambda: holds(sub, {1, 2, 3}) and link.asking is None, worker)
    assert link.expected == 3
    assert sub.index.overlaps([1, 50, 51], ["w"]) == [(3, 3)]


def test_a_vllm_worker_followed_late_is_picked_up_where_its_stream_is(follow):
    """vLLM sends no heartbeat and answers the snapshot request with its end marker only. A
    worker followed after its replay buffer moved past seq 0 had nothing applied yet when
    the snapshot fell through, and forgetting it raised UnknownWorker out of poll()."""
    worker, sub, _ = follow
    link = sub.link("w")
    worker.publish(stored(1), lost=True)
    del worker.log[0]                                 # out of vLLM's replay buffer
    worker.publish(stored(2, parent=1))

    def vllm_answers():
        for client, request in worker.take_requests():
            start = int.from_bytes(request, "big")    # vLLM reads any request as a start sequence
            for seq in sorted(worker.log):
                if seq >= start:
                    worker.replay.send_multipart([client, b"", b"", wire.seq_bytes(seq), worker.log[seq]])
            worker.replay.send_multipart([client, b"", b"", wire.END_SEQ, b""])
        return link.expected == 2 and link.asking is None

    until(sub, vllm_answers)
    assert sub.index.blocks_of("w") == {2} and not link.pending


@pytest.mark.parametrize("seq", [0, 7])
def test_a_garbage_live_frame_is_refused_before_it_changes_anything(follow, seq):
    """An undecodable batch used to be acted on first: an old sequence number cleared the
    worker (taken for a restart), a new one raised the live high mark so that the next real
    batch looked like a restart."""
    worker, sub, clock = follow
    link = sub.link("w")
    _alive(worker, sub, clock)
    worker.publish(stored(1))
    worker.publish(stored(2, parent=1))
    until(sub, lambda: holds(sub, {1, 2}) and link.expected == 2)
    worker.events.send_multipart([b"", wire.seq_bytes(seq), b"\x01\x02"])
    with pytest.raises(wire.WireError, match="not a KVEventBatch"):
        until(sub, lambda: False, bound=5.0)
    assert sub.index.blocks_of("w") == {1, 2} and link.expected == 2 and link.live_high == 1
    assert link.asking is None and not link.pending
    worker.publish(stored(3, parent=2))
    until(sub, lambda: holds(sub, {1, 2, 3}), worker, bound=5.0)
    assert sub.index.blocks_of("w") == {1, 2, 3}


def test_a_heartbeat_from_another_worker_is_refused_by_name_and_changes_nothing(follow):
    """Endpoints of the wrong worker (a configuration slip): its heartbeats used to keep the
    connected id alive with another worker's load and sequence numbers."""
    worker, sub, _ = follow
    worker.beat(worker_id="w7")
    with pytest.raises(wire.WireError, match="worker 'w'.*heartbeat.*'w7'"):
        until(sub, lambda: False, bound=5.0)
    link = sub.link("w")
    assert link.heartbeat is None and link.incarnation is None and link.asking is None
    assert "w" not in sub.index and sub.live_workers() == []


def test_a_lost_replay_reply_is_asked_for_again(follow):
    """The worker's ROUTER drops a reply it cannot deliver (or past its high-water mark): the
    subscriber used to wait for it forever, heartbeats announcing the gap changed nothing."""
    worker, sub, clock = follow
    link = sub.link("w")
    _alive(worker, sub, clock)
    worker.publish(stored(1), lost=True)
    worker.publish(stored(2, parent=1))
    assert _requests(sub, worker)                     # asked; the reply never comes
    clock.now += 5.0                                  # well within the worker's liveness (3 x 10 s)
    worker.beat()
    until(sub, lambda: holds(sub, {1, 2}) and link.asking is None, worker, bound=5.0)
    assert link.expected == 2 and not link.pending and "w" in {lk.worker_id for lk in sub.live_workers()}


def test_a_lost_snapshot_end_marker_does_not_block_repair_forever(follow):
    worker, sub, clock = follow
    link = sub.link("w")
    _alive(worker, sub, clock)
    worker.publish(stored(1), lost=True)
    del worker.log[0]                                 # the replay falls short: a snapshot is asked
    worker.publish(stored(2, parent=1))
    end = time.monotonic() + BOUND_S
    snapshot = None
    while snapshot is None and time.monotonic() < end:
        sub.poll(0.02)
        for client, request in worker.take_requests():
            if request == wire.SNAPSHOT_REQUEST:
                snapshot = client
            else:
                worker.answer(client, request)
    assert snapshot is not None
    batch = wire.KVEventBatch(ts=time.time(), events=[wire.AllBlocksCleared(), stored(1, 2)])
    worker.replay.send_multipart([snapshot, b"", b"", wire.seq_bytes(2), wire.encode(batch)])   # no end marker
    until(sub, lambda: holds(sub, {1, 2}))
    worker.publish(stored(3, parent=2), lost=True)   # announced by the next heartbeat only
    clock.now += 5.0
    worker.beat()
    until(sub, lambda: holds(sub, {1, 2, 3}), worker, bound=5.0)
    assert link.expected == 3


@pytest.mark.parametrize("timeout_s", [-1.0, float("nan")])
def test_a_negative_or_nan_poll_timeout_is_refused_instead_of_waiting_forever(follow, timeout_s):
    """poll(-1) became ZMQ's poll(-1000): wait with no end for a message."""
    import threading

    worker, sub, _ = follow
    outcome = []

    def call():
        try:
            sub.poll(timeout_s)
            outcome.append("returned")
        except ValueError as exc:
            outcome.append(str(exc))

    caller = threading.Thread(target=call, daemon=True)
    caller.start()
    caller.join(BOUND_S)
    stuck = caller.is_alive()
    end = time.monotonic() + BOUND_S
    while caller.is_alive() and time.monotonic() < end:   # unblock it, so the fixture can close
        worker.beat()
        caller.join(0.05)
    assert not stuck, "poll() with a negative timeout never returned"
    assert outcome and "timeout_s" in outcome[0]


def test_a_worker_hashing_with_another_seed_is_not_routed_to():
    """The fleet pins one hash seed: a worker with another one (or none: a random seed per
    process) can never match the router's hashes, yet was picked like any other."""
    from prefixkv.fleet.router import NoWorkerAvailable
    from prefixkv.fleet.subscriber import FleetRouter

    odd, good = ScriptedWorker("odd", interval=INTERVAL), ScriptedWorker("good", interval=INTERVAL)
    router = FleetRouter("kv-aware+guard", block_size=4, hash_seed=0)
    try:
        router.connect("odd", odd.endpoints)
        odd.wait_subscribed()
        odd.beat(hash_seed=1)
        link = router.subscriber.link("odd")
        until(router.subscriber, lambda: link.heartbeat is not None)
        with pytest.raises(NoWorkerAvailable, match="hash seed 0.*'', 4, 1"):
            router.pick(list(range(9)))
        router.connect("good", good.endpoints)
        good.wait_subscribed()
        good.beat(hash_seed=0)
        until(router.subscriber, lambda: router.subscriber.link("good").heartbeat is not None)
        assert {router.pick(list(range(9))).worker_id for _ in range(10)} == {"good"}
        odd.beat(hash_seed=None)
        until(router.subscriber, lambda: link.heartbeat.hash_seed is None)
        assert {router.pick(list(range(9))).worker_id for _ in range(10)} == {"good"}
    finally:
        router.close()
        odd.close()
        good.close()


def test_poll_returns_while_a_worker_keeps_talking(follow):
    """poll() drained until every socket was empty at once: a worker that never stops talking
    (here: one more heartbeat each time the subscriber reads its clock) held the caller in
    poll() for as long as it talked, with no pick() and no expiry of the others."""
    worker, sub, clock = follow
    link = sub.link("w")
    beats = [0]

    def talking_clock():
        if beats[0] < 5000:                  # a bound for the test itself
            beats[0] += 1
            worker.beat()
        return 1000.0

    sub.clock = talking_clock
    handled = []
    end = time.monotonic() + BOUND_S
    while link.heartbeat is None and time.monotonic() < end:
        handled.append(sub.poll(0.05, max_messages=20))
    assert link.heartbeat is not None
    assert max(handled) <= 20
    assert sub.poll(0.05, max_messages=20) <= 20
    with pytest.raises(ValueError, match="max_messages"):
        sub.poll(0, max_messages=0)


def _refused(info, argument: str, *fragments: str) -> None:
    error = info.value
    assert isinstance(error, InvalidArgument) and error.argument == argument, repr(error)
    for fragment in fragments:
        assert fragment in str(error), str(error)


# -- overflow and replay requests never answered --------------------------------------------------

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


# -- connect and the router's on_decision are refused up front -------------------------------------

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
