"""The publisher's and subscriber's edges on real ZMQ sockets on 127.0.0.1 (in process).

A scripted worker (``FakeWorker``: raw PUB, ROUTER and heartbeat PUB sockets speaking the
wire format) lets a test decide which batches reach the router and when, and how (or
whether) each replay request is answered; every wait is a bounded loop.
"""

from __future__ import annotations

import socket
import time

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixkv.fleet import wire  # noqa: E402
from prefixkv.fleet.publisher import KVEventPublisher  # noqa: E402

BOUND_S = 15.0


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
