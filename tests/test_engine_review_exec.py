"""Review of the engine's executor side: model, executor, plan, sampling, request checks, the demo
and the Hugging Face engine model. Each test failed on the code before its fix."""

from __future__ import annotations

import argparse
import copy

import pytest

torch = pytest.importorskip("torch")

from prefixkv.engine import (Engine, RequestStatus, SamplingParams,  # noqa: E402
                             SchedulerConfig, SimulatedClock, TinyLlama, TinyLlamaConfig)
from prefixkv.engine.sampling import sample  # noqa: E402

B = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return TinyLlama(TinyLlamaConfig(seed=0))


def engine_for(model, *, num_blocks=64, **config):
    config.setdefault("max_num_batched_tokens", 32)
    return Engine.from_model(model, num_blocks=num_blocks, block_size=B, config=SchedulerConfig(**config),
                             clock=SimulatedClock())


def assert_clean(engine):
    mgr = engine.manager
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.active_blocks == 0 and len(mgr) == 0
    assert not engine.has_unfinished


# -- sampling -----------------------------------------------------------------------


@pytest.mark.parametrize("bad", [float("inf"), float("nan"), -1.0])
def test_sampling_params_refuse_a_temperature_that_is_not_a_finite_number_ge_0(bad):
    # inf was accepted and sampled uniformly (every logit / inf == 0), whatever the model said.
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=bad)


@pytest.mark.parametrize("bad", ["1.0", None, True, [1.0]])
def test_sampling_params_refuse_a_temperature_that_is_not_a_number_naming_it(bad):
    # "1.0" raised "'>=' not supported between instances of 'str' and 'int'"; True sampled at 1.0.
    with pytest.raises(TypeError, match="temperature"):
        SamplingParams(temperature=bad)


def test_a_tiny_temperature_samples_the_argmax_instead_of_failing_the_whole_step(model):
    """logits / 1e-310 overflowed to +-inf, softmax gave NaN and multinomial raised inside the
    step: every request of that step failed, the greedy neighbour included."""
    logits = model.dense_logits([5, 6, 7])[-1]
    tiny = SamplingParams(temperature=1e-310, seed=3)
    assert sample(logits, tiny, 0) == int(torch.argmax(logits))
    engine = engine_for(model)
    other = engine.add_request([1, 2, 3, 4, 5], max_new_tokens=3)
    rid = engine.add_request([5, 6, 7], max_new_tokens=3, sampling=tiny)
    engine.run()
    assert engine.requests[other].status is RequestStatus.FINISHED
    assert engine.requests[rid].status is RequestStatus.FINISHED
    assert engine.requests[rid].output == engine.generate([[5, 6, 7]], max_new_tokens=3)[0]   # greedy
    assert_clean(engine)


def test_ordinary_temperatures_draw_what_they_drew_before(model):
    """The overflow fallback leaves the draws of ordinary temperatures unchanged (seeded streams
    stay reproducible across versions)."""
    logits = model.dense_logits([9, 8, 7, 6])[-1]
    for t in (0.5, 1.0, 2.0):
        params = SamplingParams(temperature=t, seed=11)
        for i in range(4):
            gen = torch.Generator().manual_seed(
                (11 * 0x9E3779B97F4A7C15 + (i + 1) * 0xBF58476D1CE4E5B9) & (2**63 - 1))
            probs = torch.softmax(logits.double() / t, dim=-1)
            assert sample(logits, params, i) == int(torch.multinomial(probs, 1, generator=gen))
