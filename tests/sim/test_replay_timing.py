"""Issue 17: a replay reports its own wall time (``replay_s``), outside the result's value."""

from prefixkv.sim.replay import replay
from prefixkv.sim.traces import Trace


class Req:
    def __init__(self, t, n, hashes):
        self.timestamp, self.input_length, self.output_length = t, n, 1
        self.block_hashes, self.tokens = hashes, None
        self.session = self.stop = self.turn = self.parent = None


def _trace():
    reqs = [Req(i, 16, [1, 2, 3, 4 + i % 3]) for i in range(20)]
    return Trace(reqs, 4)


def test_replay_s_is_measured_and_kept_out_of_the_value():
    a, b = replay(_trace(), "lru", 6), replay(_trace(), "lru", 6)
    assert a.replay_s > 0 and b.replay_s > 0
    assert a == b                                    # timing is not part of equality
    assert "replay_s" not in a.as_dict()             # nor of the default dict (sweeps compare them)
    d = a.as_dict(timing=True)
    assert d["replay_s"] == a.replay_s
    assert {k: v for k, v in d.items() if k != "replay_s"} == b.as_dict()
