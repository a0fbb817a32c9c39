"""Real ZMQ on 127.0.0.1: four worker processes publishing, one router following them.

Targets (gap repaired in 1 s, 3 missed heartbeats) are measured and reported; the bounds
here are generous (>= 5x) so a busy 2-core machine cannot make them flake. The worker tool
answers a bad command with an error and keeps serving.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

from prefixkv.fleet.subscriber import FleetRouter  # noqa: E402

BLOCK = 4
INTERVAL = 0.1     # heartbeat interval of the test workers
BOUND_S = 15.0     # generous bound for anything that should take well under a second


class Worker:
    def __init__(self, worker_id: str, endpoints: dict | None = None) -> None:
        cmd = [sys.executable, "-m", "prefixkv.fleet.worker", "--worker-id", worker_id, "--block-size", str(BLOCK),
               "--heartbeat-interval", str(INTERVAL)]
        for name, flag in (("events", "--endpoint"), ("replay", "--replay-endpoint"),
                           ("heartbeat", "--heartbeat-endpoint")):
            if endpoints:
                cmd += [flag, endpoints[name]]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        hello = json.loads(self.proc.stdout.readline())
        self.worker_id, self.incarnation, self.endpoints = worker_id, hello["incarnation"], hello["endpoints"]

    def send(self, **cmd) -> None:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        assert json.loads(self.proc.stdout.readline())["ok"] == cmd["op"]

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait(30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(30)


def _wait_until(router: FleetRouter, condition, bound: float = BOUND_S) -> float:
    start = time.monotonic()
    while time.monotonic() - start < bound:
        router.poll(0.02)
        if condition():
            return time.monotonic() - start
    raise AssertionError(f"condition not met within {bound} s")


def _prompt(worker_index: int, n: int) -> list[int]:
    return [1000 * worker_index + k for k in range(n * BLOCK + 1)]


@pytest.fixture
def fleet():
    workers = [Worker(f"w{i}") for i in range(4)]
    router = FleetRouter("kv-aware+guard", block_size=BLOCK, hash_seed=0)
    for w in workers:
        router.connect(w.worker_id, w.endpoints)
    _wait_until(router, lambda: len(router.workers()) == 4)
    yield workers, router
    for w in workers:
        w.stop()
    router.close()


def test_gap_repair_dead_worker_and_restart(fleet):
    workers, router = fleet
    for i, w in enumerate(workers):
        w.send(op="admit", id="a", tokens=_prompt(i, 3))
    hashes = [router.hashes(_prompt(i, 3)) for i in range(4)]
    _wait_until(router, lambda: all(router.index.overlaps(hashes[i], [f"w{i}"])[0][0] == 3 for i in range(4)))

    # A batch lost on the wire: the next one (or a heartbeat) shows the gap; the replay repairs it.
    w0 = workers[0]
    lost, after = _prompt(7, 2), _prompt(8, 2)
    w0.send(op="drop_next")
    w0.send(op="admit", id="lost", tokens=lost)
    w0.send(op="admit", id="after", tokens=after)
    repair = _wait_until(router, lambda: router.index.overlaps(router.hashes(lost), ["w0"])[0][0] == 2
                         and router.index.overlaps(router.hashes(after), ["w0"])[0][0] == 2)
    link = router.subscriber.link("w0")
    assert link.repairs and not link.pending
    print(f"gap repaired in {1000 * max(link.repairs):.1f} ms (poll-to-index {1000 * repair:.1f} ms)")

    # A killed worker gets no requests once 3 heartbeats are missed.
    w3 = workers[3]
    w3.kill()
    killed = time.monotonic()
    _wait_until(router, lambda: "w3" not in {w.worker_id for w in router.workers()})
    print(f"dead worker dropped {1000 * (time.monotonic() - killed):.0f} ms after the kill")
    assert all(router.pick(hashes=hashes[3]).worker_id != "w3" for _ in range(20))
    assert "w3" not in router.index

    # A restarted worker (same endpoints, new incarnation) starts empty in the index.
    w1 = workers[1]
    old = w1.incarnation
    w1.kill()
    workers[1] = w1 = Worker("w1", w1.endpoints)
    assert w1.incarnation != old
    _wait_until(router, lambda: router.subscriber.link("w1").incarnation == w1.incarnation)
    assert router.index.blocks_of("w1") == set()
    assert router.index.overlaps(hashes[1], ["w1"]) == [(0, 0)]
    w1.send(op="admit", id="b", tokens=_prompt(1, 2))
    _wait_until(router, lambda: router.index.overlaps(hashes[1][:2], ["w1"])[0][0] == 2)


def test_cache_reset_clears_the_index_and_routing_follows_the_cache(fleet):
    workers, router = fleet
    workers[2].send(op="admit", id="a", tokens=_prompt(2, 6))
    hashes = router.hashes(_prompt(2, 6))
    _wait_until(router, lambda: router.index.overlaps(hashes, ["w2"])[0][0] == 6)
    decision = router.pick(hashes=hashes)
    assert decision.worker_id == "w2" and decision.overlap_blocks == 6
    workers[2].send(op="reset")
    _wait_until(router, lambda: router.index.blocks_of("w2") == set())

@pytest.mark.parametrize("kwargs", [dict(router="no-such-router"), dict(hash_algorithm="md5"), dict(block_size=0)])
def test_a_refused_fleet_router_leaves_no_zmq_context_behind(monkeypatch, kwargs):
    """The arguments are checked before the subscriber makes its ZMQ context (a context nobody
    holds is never terminated)."""
    import zmq

    from prefixkv.fleet import subscriber

    made = []

    class Counting(zmq.Context):
        def __init__(self, *args, **kw):
            made.append(self)
            super().__init__(*args, **kw)

    monkeypatch.setattr(subscriber.zmq, "Context", Counting)
    options = dict(block_size=16, hash_seed=0) | kwargs
    with pytest.raises((ValueError, KeyError)):
        subscriber.FleetRouter(**options)
    assert made == []


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
