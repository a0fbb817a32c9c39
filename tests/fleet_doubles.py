"""Test doubles for the fleet's ZMQ tests, on real sockets on 127.0.0.1 (in process).

``ScriptedWorker`` is a worker's three sockets (raw XPUB, ROUTER and heartbeat XPUB speaking
the wire format) driven by the test: it decides which batches reach the router and when, and
how (or whether) each replay request is answered. ``Clock`` is the subscriber's time, moved
by hand. Every wait is a bounded loop.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Iterator

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixkv.fleet import wire  # noqa: E402
from prefixkv.fleet.index import KVIndex  # noqa: E402
from prefixkv.fleet.subscriber import FleetSubscriber  # noqa: E402

BOUND_S = 15.0     # generous bound for anything that should take well under a second


def stored(*hashes, parent=None) -> wire.BlockStored:
    return wire.BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[], block_size=4,
                            lora_id=None, medium="GPU", lora_name=None)


class ScriptedWorker:
    """A worker's sockets driven by the test. XPUB sockets: a subscription message says the
    router's SUB socket is connected, so nothing is lost to the slow-joiner rule.

    ``interval`` is the heartbeat interval its heartbeats announce (the subscriber's liveness
    window is 3 of them, on the test's clock)."""

    def __init__(self, worker_id: str = "w", incarnation: str = "one", *, interval: float = 0.1) -> None:
        self.ctx = zmq.Context()
        self.events, self.replay, self.beats = (self.ctx.socket(k) for k in (zmq.XPUB, zmq.ROUTER, zmq.XPUB))
        self.endpoints = {}
        for name, sock in (("events", self.events), ("replay", self.replay), ("heartbeat", self.beats)):
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind("tcp://127.0.0.1:0")
            self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.worker_id, self.incarnation, self.interval = worker_id, incarnation, interval
        self.log: dict[int, bytes] = {}       # seq -> payload: what a replay answers from
        self.held: set = set()
        self.next_seq = 0
        self.requests: list[bytes] = []       # every replay request received, in order

    def wait_subscribed(self) -> None:
        for sock in (self.events, self.beats):
            sock.setsockopt(zmq.RCVTIMEO, int(BOUND_S * 1000))
            assert sock.recv()[0] == 1          # a subscription

    def beat(self, worker_id: str | None = None, hash_seed: int | None = 0) -> None:
        """One heartbeat; ``worker_id`` and ``hash_seed`` override what a correct worker sends."""
        hb = wire.Heartbeat(worker_id=worker_id or self.worker_id, incarnation=self.incarnation, fingerprint="",
                            block_size=4, hash_seed=hash_seed, free_blocks=100, queued_prefill_tokens=0,
                            running_requests=0, next_seq=self.next_seq, interval_s=self.interval, ts=time.time())
        self.beats.send_multipart([wire.HEARTBEAT_TOPIC, wire.encode(hb)])

    def publish(self, *events, lost: bool = False) -> int:
        """One batch: logged for replays, sent live unless ``lost``; returns its sequence number."""
        seq = self.next_seq
        self.next_seq += 1
        payload = wire.encode(wire.KVEventBatch(ts=time.time(), events=list(events), data_parallel_rank=0))
        self.log[seq] = payload
        for e in events:
            if isinstance(e, wire.BlockStored):
                self.held.update(e.block_hashes)
            elif isinstance(e, wire.BlockRemoved):
                self.held.difference_update(e.block_hashes)
            else:
                self.held.clear()
        if not lost:
            self.events.send_multipart([b"", wire.seq_bytes(seq), payload])
        return seq

    def take_requests(self) -> list[tuple[bytes, bytes]]:
        out = []
        while self.replay.poll(0):
            client, _, request = self.replay.recv_multipart()
            self.requests.append(request)
            out.append((client, request))
        return out

    def answer(self, client: bytes, request: bytes) -> None:
        if request == wire.SNAPSHOT_REQUEST:
            batch = wire.KVEventBatch(ts=time.time(), events=[wire.AllBlocksCleared(), stored(*sorted(self.held))])
            self.replay.send_multipart([client, b"", b"", wire.seq_bytes(self.next_seq), wire.encode(batch)])
        else:
            start = int.from_bytes(request, "big")
            for seq in sorted(self.log):
                if seq >= start:
                    self.replay.send_multipart([client, b"", b"", wire.seq_bytes(seq), self.log[seq]])
        self.replay.send_multipart([client, b"", b"", wire.END_SEQ, b""])

    def close(self) -> None:
        for sock in (self.events, self.replay, self.beats):
            sock.close(0)
        self.ctx.term()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@contextmanager
def following(interval: float) -> Iterator[tuple[ScriptedWorker, FleetSubscriber, Clock]]:
    """(worker, subscriber, clock): a scripted worker beating every ``interval`` s, followed
    by a subscriber on a test clock; both closed afterwards."""
    worker, clock = ScriptedWorker(interval=interval), Clock()
    sub = FleetSubscriber(KVIndex(), clock=clock)
    sub.connect("w", worker.endpoints)
    worker.wait_subscribed()
    try:
        yield worker, sub, clock
    finally:
        sub.close()
        worker.close()


@pytest.fixture
def follow(request):
    """(worker, subscriber, clock) as ``following`` makes them; the worker's heartbeat interval
    is the test module's ``INTERVAL``. A test module takes it with ``from fleet_doubles import follow``."""
    with following(request.module.INTERVAL) as trio:
        yield trio


def until(sub: FleetSubscriber, condition, worker: ScriptedWorker | None = None, bound: float = BOUND_S,
          answer: bool = True) -> list[bytes]:
    """Poll until ``condition()``; the worker's replay requests (when given one) are answered
    (``answer``) or only collected. Returns the requests taken."""
    end = time.monotonic() + bound
    taken = []
    while time.monotonic() < end:
        sub.poll(0.02)
        if worker is not None:
            for client, request in worker.take_requests():
                taken.append(request)
                if answer:
                    worker.answer(client, request)
        if condition():
            return taken
    raise AssertionError(f"condition not met within {bound} s")


def live_link(worker: ScriptedWorker, sub: FleetSubscriber, worker_id: str = "w"):
    """The subscriber's link to ``worker`` once the worker's first heartbeat is in."""
    link = sub.link(worker_id)
    worker.beat()
    until(sub, lambda: link.heartbeat is not None)
    return link


def holds(sub: FleetSubscriber, hashes, worker_id: str = "w") -> bool:
    return worker_id in sub.index and set(hashes) <= sub.index.blocks_of(worker_id)
