"""The engine's executor side on the tiny model: sampling (temperatures that are not finite numbers
>= 0 refused, a tiny temperature drawing the argmax, ordinary draws unchanged, infinite logits drawn),
the demo's options (``prefixkv generate``), request checks (an empty prompt, a bad eos token id),
the tiny model's config, the remote tier's prefetch step and the executor's block ops."""

from __future__ import annotations

import argparse
import math

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


# -- the demo (prefixkv generate) ---------------------------------------------------


def _demo_args(*argv):
    from prefixkv.cli import add_generate_command

    parser = argparse.ArgumentParser(prog="prefixkv")
    add_generate_command(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["generate", "--requests", "1", "--max-new-tokens", "1", "--layers", "1",
                              "--repeat", "1", *argv])


@pytest.mark.parametrize("bad", [-0.5, float("nan"), float("inf")])
def test_demo_refuses_a_bad_temperature_naming_the_option(bad, monkeypatch):
    """A temperature set on the namespace (programmatic use) reached SamplingParams after the
    model was built, and its error did not say which option was wrong."""
    from prefixkv.engine import demo

    args = _demo_args("--hidden-size", "32", "--heads", "4", "--kv-heads", "2")
    args.temperature = bad
    monkeypatch.setattr(demo, "run_demo", lambda a: pytest.fail("ran the demo"))
    with pytest.raises(ValueError, match="--temperature"):
        demo.cmd_generate(args)


def test_demo_refuses_an_odd_head_dim_naming_the_options(monkeypatch):
    """--hidden-size 24 --heads 8 gives head dim 3: the error was TinyLlamaConfig's "rotary
    embeddings need an even head_dim, got 3", an option the command does not have."""
    from prefixkv.engine import demo

    args = _demo_args("--hidden-size", "24", "--heads", "8", "--kv-heads", "2")
    monkeypatch.setattr(demo, "run_demo", lambda a: pytest.fail("ran the demo"))
    with pytest.raises(ValueError, match="--hidden-size.*--heads"):
        demo.cmd_generate(args)


# -- requests -----------------------------------------------------------------------


def test_generate_with_an_empty_prompt_adds_nothing_and_names_the_prompt(model):
    """The empty prompt was only refused by Request, after the prompts before it had been added:
    they were left in engine.requests (cancelled), the error named an automatic id the caller
    never saw, and the arrival numbers of later per-request seeds had moved."""
    engine = engine_for(model)
    with pytest.raises(ValueError, match="prompt 1 of the batch.*empty"):
        engine.generate([[1, 2, 3], []], max_new_tokens=2)
    assert engine.requests == {} and engine._num_added == 0
    params = SamplingParams(temperature=1.0)
    fresh = engine_for(model)
    assert engine.generate([[1, 2, 3]], max_new_tokens=3, sampling=params) == \
        fresh.generate([[1, 2, 3]], max_new_tokens=3, sampling=params)
    assert_clean(engine)


@pytest.mark.parametrize("bad", ["2", 2.0, [2, 3], -1, True])
def test_a_bad_eos_token_id_is_refused_naming_it(model, bad):
    """An eos_token_id that no sampled token can equal ("2", a list as in HF generation configs,
    -1) was accepted and silently never stopped the request."""
    engine = engine_for(model)
    with pytest.raises((TypeError, ValueError), match="eos_token_id"):
        engine.add_request([1, 2, 3], max_new_tokens=2, eos_token_id=bad)
    assert engine.requests == {}


# -- the tiny model -----------------------------------------------------------------


@pytest.mark.parametrize("field, bad, error", [
    ("rope_theta", 0.0, ValueError), ("rope_theta", float("nan"), ValueError), ("rope_theta", -2.0, ValueError),
    ("rms_norm_eps", -1.0, ValueError), ("rms_norm_eps", float("inf"), ValueError),
    ("hidden_size", 64.0, TypeError), ("num_layers", "2", TypeError), ("num_layers", True, TypeError),
    ("seed", 1.5, TypeError),
])
def test_tiny_llama_config_refuses_bad_fields_naming_them(field, bad, error):
    """rope_theta=0/NaN and a negative eps built a model whose logits were all NaN; a float size or
    seed failed deep in torch (randn, manual_seed) and a string in a bare '<=' comparison."""
    with pytest.raises(error, match=field):
        TinyLlamaConfig(**{field: bad})


# -- the remote tier's engine side ----------------------------------------------------


class _FakeTier:
    def __init__(self, manager):
        self.manager = manager
        self.prefetched = []

    def prefetch(self, prompt):
        self.prefetched.append(prompt.tokens if hasattr(prompt, "tokens") else prompt)
        return 0


def test_remote_prefetch_probes_a_new_request_that_reuses_a_finished_ones_id(model):
    """RemoteStep remembered prefetches by request id and token count: a new request reusing a
    finished one's id with a prompt of the same length was never probed, so the blocks another
    replica had stored for it were recomputed."""
    from prefixkv.engine.remote import RemoteStep

    engine = engine_for(model)
    tier = _FakeTier(engine.manager)
    step = RemoteStep(tier)
    engine.add_request([1, 2, 3, 4, 5], max_new_tokens=1, request_id="a")
    step.before(engine.scheduler, engine.clock.now())
    engine.run()
    assert len(tier.prefetched) == 1
    engine.add_request([9, 8, 7, 6, 5], max_new_tokens=1, request_id="a")
    step.before(engine.scheduler, engine.clock.now())
    assert len(tier.prefetched) == 2
    step.before(engine.scheduler, engine.clock.now())       # the same request waiting again: no probe
    assert len(tier.prefetched) == 2
    engine.run()
    assert_clean(engine)


# -- the executor -------------------------------------------------------------------


def test_executor_refuses_an_unknown_block_op_before_moving_any_block(model):
    """Any kind that was not swap_out/demote/swap_in/load ran as a device copy: a misspelt
    'swapin' from another scheduler copied device blocks at host indices, silently."""
    from prefixkv.engine.plan import BlockOp, StepPlan

    engine = engine_for(model)
    store = engine.executor.kv_store
    before = store.k[0].clone() if hasattr(store, "k") else None
    calls = []
    store.copy_blocks = lambda pairs: calls.append(pairs)
    plan = StepPlan(step=0, block_size=B, block_ops=(BlockOp("copy", ((1, 2),)), BlockOp("swapin", ((0, 1),))))
    with pytest.raises(ValueError, match="swapin"):
        engine.executor.execute(plan)
    assert calls == []
    if before is not None:
        assert torch.equal(store.k[0], before)


# -- sampling: an infinite logit ---------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7, 1e-310])
def test_a_positive_infinite_logit_is_drawn_instead_of_failing_the_step(temperature):
    # A half-precision overflow gives a +inf logit: greedy takes it, but a temperature draw put
    # NaN into softmax and multinomial raised inside the step, failing every request of it.
    torch = pytest.importorskip("torch")
    from prefixkv.engine.request import SamplingParams
    from prefixkv.engine.sampling import sample

    one = torch.tensor([1.0, math.inf, 2.0, -math.inf], dtype=torch.float16)
    two = torch.tensor([math.inf, 0.0, math.inf, 5.0])
    drawn = set()
    for i in range(16):
        params = SamplingParams(temperature=temperature, seed=i)
        assert sample(one, params, i) == 1
        drawn.add(sample(two, params, i))
    assert drawn == {0, 2}
