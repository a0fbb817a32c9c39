"""Defects found in review of the packed engine (each test failed before its fix)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from prefixkv.engine import Engine, RequestStatus, SimulatedClock, TinyLlama, TinyLlamaConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return TinyLlama(TinyLlamaConfig(seed=0))


def test_run_waits_for_requests_that_arrive_later_on_a_simulated_clock(model):
    """Nothing running and every waiting request arriving in the future: run() moves the clock to
    the next arrival and carries on (it used to raise 'no request can be scheduled', because the
    empty step had already moved the clock there)."""
    engine = Engine.from_model(model, num_blocks=20, block_size=4, clock=SimulatedClock())
    first = engine.add_request([1, 2, 3], max_new_tokens=2, arrival_time=1.0)
    second = engine.add_request([4, 5, 6, 7], max_new_tokens=3, arrival_time=5.0)
    engine.run()
    assert engine.request(first).status is RequestStatus.FINISHED
    assert engine.request(second).status is RequestStatus.FINISHED
    assert engine.clock.now() >= 5.0
    engine.manager.check_invariants()
    assert engine.manager.stats().active_blocks == 0

