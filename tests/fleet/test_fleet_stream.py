"""The publisher's and subscriber's edges on real ZMQ sockets on 127.0.0.1 (in process).

A scripted worker (``fleet_doubles.ScriptedWorker``: raw PUB, ROUTER and heartbeat PUB sockets
speaking the wire format) lets a test decide which batches reach the router and when, and how (or
whether) each replay request is answered; every wait is a bounded loop.
"""

from __future__ import annotations

import socket
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixkv.events import BlockStored as CoreStored  # noqa: E402
from prefixkv.fleet import wire  # noqa: E402
from prefixkv.fleet.publisher import KVEventPublisher  # noqa: E402

from fleet_doubles import BOUND_S, ScriptedWorker, follow, holds, live_link, stored, until  # noqa: E402, F401 (follow: a fixture)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_a_refused_bind_names_the_socket_and_releases_every_port():
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    try:
        events = f"tcp://127.0.0.1:{_free_port()}"
        taken = f"tcp://127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(zmq.ZMQError, match=f"replay.*{taken}"):
            KVEventPublisher("w", block_size=4, endpoint=events, replay_endpoint=taken)
        # the events port bound before the failure was given back: a retry can take it
        with KVEventPublisher("w", block_size=4, endpoint=events) as pub:
            assert pub.endpoints["events"] == events
    finally:
        busy.close()


# -- a scripted worker ----------------------------------------------------------------

from prefixkv.fleet import subscriber as subscriber_module  # noqa: E402
from prefixkv.fleet.index import KVIndex  # noqa: E402
from prefixkv.fleet.subscriber import FleetSubscriber  # noqa: E402

INTERVAL = 0.1     # heartbeat interval the scripted worker announces (the follow fixture reads it)


def test_pending_overflow_during_a_replay_loses_no_batch(follow, monkeypatch):
    """Too many early batches while a replay is out: the replies of the two requests must not
    be mistaken for one another (a replayed batch read as a snapshot, a snapshot as a batch)."""
    worker, sub, _ = follow
    monkeypatch.setattr(subscriber_module, "MAX_PENDING", 2)
    link = live_link(worker, sub)
    worker.publish(stored(1), lost=True)
    for h in (2, 3, 4):
        worker.publish(stored(h, parent=h - 1))
    until(sub, lambda: link.live_high == 3)            # the replay was asked for at seq 1, overflow at 3
    until(sub, lambda: holds(sub, {1, 2, 3, 4}) and link.asking is None and not link.pending, worker)
    worker.publish(stored(5, parent=4))
    until(sub, lambda: holds(sub, {1, 2, 3, 4, 5}), worker, bound=5.0)
    assert sub.index.blocks_of("w") == {1, 2, 3, 4, 5} and link.expected == worker.next_seq


def test_a_replay_asked_of_a_worker_that_then_died_is_asked_again_after_its_restart(follow):
    """The request the dead worker never answered must not block gap repair forever."""
    worker, sub, clock = follow
    link = live_link(worker, sub)
    worker.publish(stored(1), lost=True)
    worker.publish(stored(2, parent=1))
    until(sub, lambda: worker.take_requests() or False)   # asked; the worker dies without answering
    clock.now += 10 * INTERVAL
    sub.poll(0)
    assert "w" not in sub.index                             # silent for 3 heartbeats: removed
    # It comes back as a new incarnation whose first batches the router never saw.
    worker.incarnation, worker.log, worker.held, worker.next_seq = "two", {}, set(), 0
    worker.publish(stored(7), lost=True)
    worker.publish(stored(8, parent=7), lost=True)
    worker.beat()
    until(sub, lambda: holds(sub, {7, 8}), worker, bound=5.0)


def test_a_refused_connect_names_the_problem_and_leaves_nothing_open():
    import threading

    sub = FleetSubscriber(KVIndex())
    kept = []      # a caller keeping the errors (logging them later) keeps their tracebacks alive
    with pytest.raises(ValueError, match="'heartbeat'") as missing:
        sub.connect("w", {"events": "tcp://127.0.0.1:5999", "replay": "tcp://127.0.0.1:5998"})
    kept.append(missing)
    with pytest.raises(zmq.ZMQError, match="heartbeat.*'nonsense'") as bad:
        sub.connect("w", {"events": "tcp://127.0.0.1:5999", "replay": "tcp://127.0.0.1:5998",
                          "heartbeat": "nonsense"})
    kept.append(bad)
    worker = ScriptedWorker()
    try:
        sub.connect("w", worker.endpoints)          # the id was not taken by the failed attempts
        worker.wait_subscribed()
    finally:
        closer = threading.Thread(target=sub.close, daemon=True)
        closer.start()
        closer.join(BOUND_S)
        worker.close()
    assert not closer.is_alive(), "close() hung on sockets a refused connect left open"


def test_set_load_takes_numpy_integers_and_refuses_what_the_heartbeat_cannot_carry():
    """A load the heartbeat cannot encode used to kill the socket thread: no heartbeats, and
    every later batch queued for a thread that was gone."""
    np = pytest.importorskip("numpy")
    sub = FleetSubscriber(KVIndex())
    with KVEventPublisher("w", block_size=4, heartbeat_interval_s=0.05) as pub:
        sub.connect("w", pub.endpoints)
        try:
            pub.set_load(free_blocks=np.int64(5), queued_prefill_tokens=np.int32(7), running_requests=np.uint8(2))
            with pytest.raises(TypeError, match="free_blocks"):
                pub.set_load(free_blocks=5.5)
            with pytest.raises(ValueError, match="running_requests"):
                pub.set_load(free_blocks=5, running_requests=-1)
            link = sub.link("w")
            until(sub, lambda: link.heartbeat is not None and link.heartbeat.free_blocks == 5)
            hb = link.heartbeat
            assert (hb.queued_prefill_tokens, hb.running_requests) == (7, 2)
            pub.publish([CoreStored(b"a" * 16, None, 4, None, 0)])
            until(sub, lambda: holds(sub, {b"a" * 16}))
        finally:
            sub.close()


def test_a_batch_msgpack_cannot_carry_is_refused_by_publish_and_takes_no_sequence_number():
    """An int block hash outside msgpack's 64-bit range used to kill the socket thread."""
    sub = FleetSubscriber(KVIndex())
    with KVEventPublisher("w", block_size=4, heartbeat_interval_s=0.05) as pub:
        sub.connect("w", pub.endpoints)
        try:
            link = sub.link("w")
            until(sub, lambda: link.heartbeat is not None)
            with pytest.raises((ValueError, OverflowError), match="64-bit"):
                pub.publish([CoreStored(2**64, None, 4, None, 0)])
            pub.publish([CoreStored(5, None, 4, None, 0)])
            until(sub, lambda: holds(sub, {5}))
            assert link.expected == 1 and link.live_high == 0      # the refused batch took no number
            until(sub, lambda: link.heartbeat.next_seq == 1)      # and the thread still beats
        finally:
            sub.close()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")   # the thread killed
def test_publish_and_close_after_close_or_a_dead_socket_thread_say_so_and_never_hang():
    import threading

    pub = KVEventPublisher("w", block_size=4)
    pub.close()
    pub.close()                                       # a second close (a with block around it) is fine
    with pytest.raises(RuntimeError, match="'w' is closed"):
        pub.publish([CoreStored(5, None, 4, None, 0)])

    pub = KVEventPublisher("w", block_size=4, heartbeat_interval_s=0.02)

    def broken():
        raise MemoryError("boom")

    pub._heartbeat = broken                           # whatever kills the socket thread
    end = time.monotonic() + BOUND_S
    while pub._thread.is_alive() and time.monotonic() < end:
        time.sleep(0.01)
    outcome = []

    def use():
        try:
            pub.publish([CoreStored(5, None, 4, None, 0)])
        except RuntimeError as exc:
            outcome.append(str(exc))
        pub.close()
        outcome.append("closed")

    user = threading.Thread(target=use, daemon=True)
    user.start()
    user.join(BOUND_S)
    assert not user.is_alive(), "publish() or close() hung on a dead socket thread"
    assert "boom" in outcome[0] and outcome[1] == "closed"



def test_a_snapshot_is_kept_when_an_announced_batch_arrives_after_its_end_marker(follow):
    """The worker answers the snapshot, then publishes a batch and beats; the heartbeat comes
    in before the snapshot's end marker, the batch itself only after it (another socket).
    That is not a worker without snapshots (vLLM): the snapshot must stay, and the batch
    must apply when it arrives."""
    worker, sub, _ = follow
    link = live_link(worker, sub)
    worker.publish(stored(1), lost=True)
    del worker.log[0]                                  # gone from the replay buffer: a snapshot is needed
    worker.publish(stored(2, parent=1))
    snapshot_from = []

    def serve_replays_until_a_snapshot_request():
        for client, request in worker.take_requests():
            if request == wire.SNAPSHOT_REQUEST:
                snapshot_from.append(client)
            else:
                worker.answer(client, request)
        return bool(snapshot_from)

    until(sub, serve_replays_until_a_snapshot_request)
    snapshot = wire.KVEventBatch(ts=time.time(), events=[wire.AllBlocksCleared(), stored(1, 2)])
    later = worker.publish(stored(3, parent=2), lost=True)          # on its way: delivered below
    worker.beat()                                                     # announces it (next_seq 3)
    until(sub, lambda: link.heartbeat.next_seq == 3)
    client = snapshot_from[0]
    worker.replay.send_multipart([client, b"", b"", wire.seq_bytes(2), wire.encode(snapshot)])
    worker.replay.send_multipart([client, b"", b"", wire.END_SEQ, b""])
    until(sub, lambda: link.asking is None)
    assert sub.index.blocks_of("w") == {1, 2}
    worker.events.send_multipart([b"", wire.seq_bytes(later), worker.log[later]])
    until(sub, lambda: holds(sub, {1, 2, 3}), worker, bound=5.0)
    assert link.expected == 3


def test_a_frame_that_is_not_a_batch_names_its_worker_and_socket(follow):
    worker, sub, _ = follow
    worker.events.send_multipart([b"", wire.seq_bytes(0), b"\x01\x02"])
    with pytest.raises(wire.WireError, match="worker 'w'.*events.*not a KVEventBatch"):
        until(sub, lambda: False, bound=5.0)
