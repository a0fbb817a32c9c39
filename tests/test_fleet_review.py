"""Review of prefixkv/fleet: each test pins one defect that was found and fixed.

ZeroMQ tests use real sockets on 127.0.0.1 (a scripted worker speaking the wire format),
a test clock for the subscriber's notion of time, and bounded loops for every wait.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest

from prefixkv.fleet.simulator import FleetConfig, simulate
from prefixkv.sim.traces import Trace
from prefixkv.sim.workloads import builtin_trace



# -- simulator ---------------------------------------------------------------------------

def test_simulated_queue_waits_do_not_depend_on_where_the_trace_clock_starts():
    """Waits were (relative now) - (absolute timestamp): a trace whose first request is not
    at t=0 (a slice of a trace, a kv-cache-tester file) got waits shifted by its start."""
    base = builtin_trace("default")
    requests = base.requests[:60]
    at_zero = simulate(Trace(requests, base.block_size), FleetConfig(replicas=2, capacity=200))
    shifted = [replace(r, timestamp=r.timestamp + 1000.0) for r in requests]
    later = simulate(Trace(shifted, base.block_size), FleetConfig(replicas=2, capacity=200))
    assert min(later.waits) >= 0.0
    assert later.waits == pytest.approx(at_zero.waits, abs=1e-6)
    assert later.as_dict()["p99_wait_s"] == pytest.approx(at_zero.as_dict()["p99_wait_s"], abs=1e-6)


# -- a scripted worker on real sockets ------------------------------------------------------

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from fleet_doubles import BOUND_S, ScriptedWorker, follow, holds, stored, until  # noqa: E402, F401 (follow: a fixture)

from prefixkv.fleet import wire  # noqa: E402

INTERVAL = 10.0    # heartbeat interval the scripted worker announces: the test clock decides expiry


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


def test_the_worker_tool_answers_a_bad_command_with_an_error_and_keeps_serving():
    """A line that is not JSON, a command without its fields or an unknown op used to kill the
    worker with a traceback (an unknown op was even answered "ok")."""
    import json
    import queue
    import subprocess
    import sys
    import threading

    proc = subprocess.Popen([sys.executable, "-m", "prefixkv.fleet.worker", "--worker-id", "w0",
                             "--heartbeat-interval", "1"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: queue.Queue = queue.Queue()
    reader = threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout], daemon=True)
    reader.start()

    def ask(line: str) -> dict:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()
        return json.loads(lines.get(timeout=BOUND_S))

    try:
        hello = json.loads(lines.get(timeout=60))
        assert hello["worker_id"] == "w0"
        assert "not JSON" in ask("{nope")["error"]
        assert "'id'" in ask(json.dumps({"op": "admit", "tokens": [1, 2, 3, 4, 5]}))["error"]
        assert "'bogus'" in ask(json.dumps({"op": "bogus"}))["error"]
        assert ask(json.dumps({"op": "admit", "id": "a", "tokens": list(range(9))})) == {"ok": "admit"}
        assert "error" in ask(json.dumps({"op": "admit", "id": "a", "tokens": list(range(9))}))
        assert ask(json.dumps({"op": "free", "id": "a"})) == {"ok": "free"}
        proc.stdin.close()
        assert proc.wait(BOUND_S) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(BOUND_S)
        proc.stdout.close()
        proc.stderr.close()


def test_a_trace_out_of_arrival_order_is_refused_by_the_simulator():
    """Arrivals went back in simulated time (before prefills already finished): the run ended
    with figures for a timeline that never was. Loaders refuse such files; a Trace built in
    code is now refused the same way."""
    base = builtin_trace("default")
    shuffled = [base.requests[1], base.requests[0], *base.requests[2:20]]
    assert shuffled[0].timestamp > shuffled[1].timestamp
    with pytest.raises(ValueError, match=r"request 1: timestamp .* earlier than"):
        simulate(Trace(shuffled, base.block_size), FleetConfig(replicas=2, capacity=200))
