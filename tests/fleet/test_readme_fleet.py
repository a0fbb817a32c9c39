"""README.md's fleet example runs as copied (read by its marker, ``<!-- example: fleet -->``, as
tests/test_readme_examples.py reads the others): it used to ``poll(0.01)`` once and ``pick``,
which raised ``NoWorkerAvailable: no live worker`` (no heartbeat yet), then reported ``miss 0``
until the replay of what the worker published before the router connected came in.
``FleetRouter.wait_ready`` is the documented wait."""

from __future__ import annotations

import pathlib
import re

import pytest

zmq = pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixkv.errors import InvalidArgument  # noqa: E402
from prefixkv.fleet.publisher import KVEventPublisher  # noqa: E402
from prefixkv.fleet.subscriber import FleetRouter  # noqa: E402

README = (pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def block_after(marker: str) -> str:
    m = re.search(r"^<!-- " + re.escape(marker) + r" -->\n\s*```[a-z]*\n(.*?)^```", README, re.M | re.S)
    assert m, f"README.md has no code block after <!-- {marker} -->"
    return m.group(1)


def test_fleet_example_runs_as_copied():
    tokens = list(range(200))           # 12 full blocks of 16
    ns: dict = {"tokens": tokens}
    try:
        exec(compile(block_after("example: fleet"), "README:fleet", "exec"), ns)
        decision = ns["decision"]
        assert decision.worker_id == "w0"
        assert decision.overlap_blocks == 12 and decision.reason != "miss", decision
    finally:
        for name in ("router", "pub"):
            if name in ns:
                ns[name].close()


def test_wait_ready_names_a_worker_that_never_beats():
    # A publisher beats once as its thread starts; on a slow machine that beat can reach a router
    # that connected first, so the worker that never beats is a heartbeat socket nothing writes to.
    pub = KVEventPublisher("w1", block_size=16, hash_seed=0, heartbeat_interval_s=30.0)
    ctx = zmq.Context.instance()
    silent = ctx.socket(zmq.PUB)
    silent.setsockopt(zmq.LINGER, 0)
    silent.bind("tcp://127.0.0.1:*")
    router = FleetRouter("kv-aware+guard", block_size=16, hash_seed=0)
    try:
        router.connect("w1", {**pub.endpoints, "heartbeat": silent.getsockopt_string(zmq.LAST_ENDPOINT)})
        with pytest.raises(TimeoutError, match=r"after 0.2 s: worker 'w1': no heartbeat yet"):
            router.wait_ready(timeout_s=0.2)
        with pytest.raises(InvalidArgument, match="not connected: 'w9'"):
            router.wait_ready(["w9"])
        with pytest.raises(InvalidArgument, match="timeout_s"):
            router.wait_ready(timeout_s=0)
    finally:
        router.close()
        silent.close(0)
        pub.close()
