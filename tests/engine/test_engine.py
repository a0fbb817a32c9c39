"""The packed engine on the tiny random-weight model: every request's tokens equal its own
standalone generation (dense attention over the whole sequence, no cache), whatever the
batching, chunking, preemption, cancellation or failure around it; no block leaks."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from prefixkv.costs import GiB, PreemptionCostModel  # noqa: E402
from prefixkv.engine import (Engine, RequestStatus, SamplingParams,  # noqa: E402
                             SchedulerConfig, SimulatedClock, StepOutput, TinyLlama, TinyLlamaConfig)
from prefixkv.engine.sampling import sample  # noqa: E402

B = 4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return TinyLlama(TinyLlamaConfig(seed=0))


_reference_cache: dict = {}


def reference(model, prompt, max_new_tokens, sampling=SamplingParams()):
    """Standalone generation: recompute the whole sequence with dense causal attention each token."""
    key = (id(model), tuple(prompt), max_new_tokens, sampling)
    if key not in _reference_cache:
        tokens = list(prompt)
        for i in range(max_new_tokens):
            tokens.append(sample(model.dense_logits(tokens)[-1], sampling, i))
        _reference_cache[key] = tokens[len(prompt):]
    return _reference_cache[key]


def engine_for(model, *, num_blocks=64, host=0, caching=True, cost=None, clock=None, **config):
    config.setdefault("max_num_batched_tokens", 32)
    return Engine.from_model(model, num_blocks=num_blocks, block_size=B, num_host_blocks=host,
                             enable_caching=caching, config=SchedulerConfig(**config),
                             cost_model=cost, clock=clock or SimulatedClock())


def prompts_with(rng, n, lo, hi, shared=()):
    return [list(shared) + [rng.randrange(256) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def assert_matches_reference(engine, model, ids_prompts, max_new=None):
    for rid, prompt in ids_prompts.items():
        r = engine.requests[rid]
        assert r.status is RequestStatus.FINISHED, r
        assert r.output == reference(model, prompt, max_new or r.max_new_tokens, r.sampling), rid


def assert_clean(engine):
    mgr = engine.manager
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.active_blocks == 0 and len(mgr) == 0
    assert stats.evictable_blocks + stats.free_uncached_blocks == stats.capacity
    assert mgr.num_free_host_blocks == mgr.num_host_blocks
    assert not engine.has_unfinished


def test_model_is_deterministic_and_paged_equals_dense(model):
    again = TinyLlama(TinyLlamaConfig(seed=0))
    assert torch.equal(again.dense_logits([1, 2, 3]), model.dense_logits([1, 2, 3]))
    assert not torch.equal(TinyLlama(TinyLlamaConfig(seed=1)).dense_logits([1, 2, 3]),
                           model.dense_logits([1, 2, 3]))
    engine = engine_for(model)
    prompt = list(range(30, 45))
    rid = engine.add_request(prompt, max_new_tokens=5)
    engine.run()
    assert engine.requests[rid].output == reference(model, prompt, 5)
    assert_clean(engine)


def test_requests_join_at_different_steps_and_share_forwards(model):
    rng = random.Random(0)
    engine = engine_for(model, max_num_batched_tokens=16)
    calls = []
    real = engine.executor.execute
    engine.executor.execute = lambda plan: calls.append(plan) or real(plan)
    prompts = prompts_with(rng, 5, 3, 20)
    arrivals = {0: [0], 2: [1, 2], 5: [3], 9: [4]}
    ids = {}
    step = 0
    while step < 10 or engine.has_unfinished:
        for i in arrivals.get(step, []):
            ids[engine.add_request(prompts[i], max_new_tokens=6 + i)] = prompts[i]
        engine.step()
        step += 1
    assert_matches_reference(engine, model, ids)
    assert len(calls) == engine.run_metrics.steps      # one forward per step
    mixed = [p for p in calls if p.num_prefill_tokens and p.num_decode_tokens]
    assert mixed, "some step packs prefill chunks and decodes into one row"
    packed = mixed[0].packed()
    assert packed.query_start_loc[-1] == packed.token_ids.shape[0] == mixed[0].num_tokens
    assert_clean(engine)


def test_chunked_prefill(model):
    rng = random.Random(1)
    engine = engine_for(model, max_num_batched_tokens=8)
    prompts = prompts_with(rng, 3, 20, 31)
    ids = {engine.add_request(p, max_new_tokens=5): p for p in prompts}
    chunks: dict = {}
    while engine.has_unfinished:
        plan = engine.step().plan
        assert plan.num_tokens <= 8
        for r in plan.requests:
            if not r.is_decode:
                chunks.setdefault(r.request_id, []).append(r.num_tokens)
    assert all(len(c) >= 3 for c in chunks.values())
    assert_matches_reference(engine, model, ids)
    assert_clean(engine)


def tight_run(model, *, host, cost, caching=True, seed=2):
    """Five requests sharing a prefix, growing in a pool too small for all of them."""
    rng = random.Random(seed)
    shared = [rng.randrange(256) for _ in range(8)]
    engine = engine_for(model, num_blocks=14, host=host, caching=caching, cost=cost,
                        max_num_batched_tokens=24, max_num_seqs=5)
    prompts = prompts_with(rng, 5, 2, 7, shared)
    ids = {engine.add_request(p, max_new_tokens=12): p for p in prompts}
    engine.run()
    return engine, ids


def test_preemption_by_recompute_mid_generation(model):
    engine, ids = tight_run(model, host=0, cost=None)
    summary = engine.summary()
    assert summary["preemptions"] > 0 and summary["swaps"] == 0
    assert summary["recomputed_tokens"] > 0
    # Their full blocks stayed cached: a resume re-prefills only what was evicted or partial.
    assert any(r.metrics.reused_on_resume > 0 for r in engine.requests.values())
    assert any(r.metrics.preemptions and r.metrics.token_times and
               r.metrics.token_times[0] < r.metrics.finished for r in engine.requests.values())
    assert_matches_reference(engine, model, ids)
    assert_clean(engine)


def test_preemption_by_swap_mid_generation(model):
    # The tiny model's KV is 512 B/token: swapping it over 25 GiB/s beats recomputing at 20k tokens/s.
    engine, ids = tight_run(model, host=32, cost=PreemptionCostModel(kv_bytes_per_token=512))
    summary = engine.summary()
    assert summary["swaps"] > 0 and summary["swaps"] == summary["preemptions"]
    assert engine.manager.stats().swaps_in > 0
    assert_matches_reference(engine, model, ids)
    assert_clean(engine)


def test_cost_model_picks_recompute_on_a_slow_link(model):
    slow = PreemptionCostModel(kv_bytes_per_token=512, link_bytes_per_s=0.001 * GiB)
    engine, ids = tight_run(model, host=32, cost=slow, caching=False)
    summary = engine.summary()
    assert summary["preemptions"] > 0 and summary["swaps"] == 0
    assert all(choice.mode == "recompute" and choice.swap_s > choice.recompute_s
               for _, _, choice in engine.scheduler.preemption_log)
    assert_matches_reference(engine, model, ids)
    assert_clean(engine)


def test_cancellation(model):
    rng = random.Random(3)
    engine = engine_for(model, max_num_batched_tokens=16, max_num_seqs=3)
    prompts = prompts_with(rng, 5, 5, 15)
    ids = [engine.add_request(p, max_new_tokens=10) for p in prompts]
    for _ in range(4):
        engine.step()
    states = {rid: engine.requests[rid].status for rid in ids}
    assert states[ids[0]] is RequestStatus.RUNNING and states[ids[4]] is RequestStatus.WAITING
    assert engine.cancel(ids[0]) and engine.cancel(ids[4])
    engine.manager.check_invariants()
    for _ in range(3):
        engine.step()
    assert engine.cancel(ids[2])
    engine.run()
    assert [engine.requests[i].status for i in ids] == [
        RequestStatus.CANCELLED, RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FINISHED,
        RequestStatus.CANCELLED]
    assert_matches_reference(engine, model, {ids[1]: prompts[1], ids[3]: prompts[3]})
    assert_clean(engine)


def test_exception_inside_the_forward_releases_blocks(model, monkeypatch):
    rng = random.Random(4)
    shared = [rng.randrange(256) for _ in range(12)]
    engine = engine_for(model, max_num_batched_tokens=12)
    first = engine.add_request(shared + [1, 2, 3], max_new_tokens=8)
    for _ in range(3):
        engine.step()
    victim = engine.add_request(shared + [9, 9, 9, 9, 9], max_new_tokens=4)

    armed = {"on": True}
    block = model.layers[1]
    real_forward = block.forward

    def exploding(*args, **kwargs):
        if armed["on"]:
            raise RuntimeError("boom in layer 1")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(block, "forward", exploding)
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()          # layer 0 already wrote this step's K/V; layer 1 raises
    armed["on"] = False
    engine.manager.check_invariants()
    assert engine.manager.stats().active_blocks == 0
    assert engine.requests[victim].status is RequestStatus.FAILED
    assert engine.requests[first].status is RequestStatus.FAILED
    assert isinstance(engine.requests[victim].error, RuntimeError)
    # The prefix cache must not serve the blocks that step published but never finished writing.
    ids = {engine.add_request(p, max_new_tokens=4): p for p in (shared + [9, 9, 9, 9, 9], shared + [1, 2, 3])}
    engine.run()
    assert_matches_reference(engine, model, ids)
    assert_clean(engine)


def test_generate_releases_its_requests_when_interrupted(model):
    engine = engine_for(model)
    real = engine.executor.execute
    steps = {"n": 0}

    def interrupt_on_third(plan):
        steps["n"] += 1
        if steps["n"] == 3:
            raise KeyboardInterrupt
        return real(plan)

    engine.executor.execute = interrupt_on_third
    with pytest.raises(KeyboardInterrupt):
        engine.generate([[1, 2, 3, 4, 5, 6], [7, 8, 9]], max_new_tokens=8)
    assert_clean(engine)


def engine_state(engine):
    return ({rid: (r.status, list(r.tokens)) for rid, r in engine.requests.items()},
            dict(engine.scheduler.requests), engine.manager.snapshot(), engine._next_id, engine._num_added)


@pytest.mark.parametrize("bad, why", [(256, "outside the model's vocabulary \\[0, 256\\)"),
                                      (300, "outside the model's vocabulary"), (-1, "outside"),
                                      (1.5, "not an integer"), ("a", "not an integer")])
def test_a_bad_token_id_is_refused_when_added_and_the_others_keep_running(model, bad, why):
    from prefixkv import InvalidTokens
    from prefixkv.engine import InvalidRequestTokens

    assert model.vocab_size == 256 and engine_for(model).vocab_size == 256
    engine = engine_for(model, max_num_batched_tokens=8)
    good = engine.add_request([1, 2, 3, 4, 5, 6], max_new_tokens=5)
    engine.step()
    before = engine_state(engine)
    with pytest.raises(InvalidRequestTokens, match=f"request 'bad': token id .* at position 2 .*{why}") as info:
        engine.add_request([1, 2, bad, 4], max_new_tokens=3, request_id="bad")
    assert isinstance(info.value, InvalidTokens) and isinstance(info.value, ValueError)
    assert (info.value.request_id, info.value.token, info.value.position) == ("bad", bad, 2)
    assert info.value.vocab_size == 256
    with pytest.raises(InvalidRequestTokens, match="request 'req-1'"):   # the automatic id it would get
        engine.add_request([bad], max_new_tokens=3)
    assert engine_state(engine) == before
    other = engine.add_request([7, 8, 255], max_new_tokens=4)         # the last id of the vocabulary is fine
    assert other == "req-1"
    engine.run()
    assert_matches_reference(engine, model, {good: [1, 2, 3, 4, 5, 6], other: [7, 8, 255]})
    assert_clean(engine)


def test_generate_checks_every_prompt_before_adding_any(model):
    from prefixkv.engine import InvalidRequestTokens

    engine = engine_for(model)
    live = engine.add_request([5, 6, 7], max_new_tokens=3)
    before = engine_state(engine)
    with pytest.raises(InvalidRequestTokens, match="prompt 1 of the batch: token id 300 at position 2") as info:
        engine.generate([[1, 2, 3], [1, 2, 300]], max_new_tokens=3)
    assert (info.value.request_id, info.value.prompt_index, info.value.token) == (None, 1, 300)
    assert engine_state(engine) == before
    # Nothing of the refused batch ran; the live request and the next batch run as usual.
    assert engine.generate([[1, 2, 3], torch.tensor([1, 2, 4])], max_new_tokens=3) == \
        [reference(model, [1, 2, 3], 3), reference(model, [1, 2, 4], 3)]
    assert engine.requests[live].output == reference(model, [5, 6, 7], 3)
    assert_clean(engine)


def test_typed_token_error_pickles():
    import pickle

    from prefixkv.engine import InvalidRequestTokens

    err = pickle.loads(pickle.dumps(InvalidRequestTokens("r", 300, 2, 256)))
    assert (type(err), err.request_id, err.token, err.position, err.vocab_size) == \
        (InvalidRequestTokens, "r", 300, 2, 256)
    assert str(err) == "request 'r': token id 300 at position 2 is outside the model's vocabulary [0, 256)"


def test_vocab_size_comes_from_the_model_or_its_config(model):
    from prefixkv.engine import Engine, InvalidRequestTokens
    from prefixkv.engine.model import model_vocab_size

    class ConfigOnly:
        """An HFEngineModel-like wrapper: no vocab_size of its own, config.vocab_size."""

        def __init__(self, inner, config):
            self.inner, self.config = inner, config

        device = property(lambda self: self.inner.device)

        def __call__(self, *args):
            return self.inner(*args)

        def logits(self, hidden):
            return self.inner.logits(hidden)

    class Config:
        def __init__(self, vocab_size):
            self.vocab_size = vocab_size

        def kv_spec(self):
            return model.config.kv_spec()

    assert model_vocab_size(model) == 256
    assert model_vocab_size(ConfigOnly(model, Config(100))) == 100
    assert model_vocab_size(ConfigOnly(model, Config(None))) is None
    small = Engine.from_model(ConfigOnly(model, Config(100)), num_blocks=16, block_size=B)
    with pytest.raises(InvalidRequestTokens, match=r"token id 100 at position 0 .*\[0, 100\)"):
        small.add_request([100])
    unknown = Engine.from_model(ConfigOnly(model, Config(None)), num_blocks=16, block_size=B)
    assert unknown.vocab_size is None
    with pytest.raises(InvalidRequestTokens, match=r"outside \[0, 2\*\*32\)"):
        unknown.add_request([2**32])
    assert unknown.generate([[1, 2, 3]], max_new_tokens=2) == [reference(model, [1, 2, 3], 2)]


def test_requests_without_a_seed_sample_their_own_streams(model):
    from prefixkv.engine import request_seed

    hot = SamplingParams(temperature=1.0)
    prompts = [[1, 2, 3]] * 4
    engine = engine_for(model)
    outputs = engine.generate(prompts, max_new_tokens=8, sampling=hot)
    assert len({tuple(o) for o in outputs}) == 4, outputs              # identical prompts, distinct samples
    requests = list(engine.requests.values())
    assert [r.sampling for r in requests] == [SamplingParams(1.0, request_seed(0, n)) for n in range(4)]
    # Each is still its own standalone generation with the seed it was given (request.sampling).
    assert_matches_reference(engine, model, {r.request_id: [1, 2, 3] for r in requests})
    # Reproducible: the same engine seed and the same requests in the same order, however batched.
    again = engine_for(model, max_num_batched_tokens=4, max_num_seqs=2)
    assert again.generate(prompts, max_new_tokens=8, sampling=hot) == outputs
    one_by_one = engine_for(model)
    assert [one_by_one.generate([p], max_new_tokens=8, sampling=hot)[0] for p in prompts] == outputs
    # Another engine seed, other streams; the next requests of an engine continue its numbering.
    reseeded = Engine.from_model(model, num_blocks=64, block_size=B, seed=1)
    assert reseeded.generate(prompts, max_new_tokens=8, sampling=hot) != outputs
    assert engine.generate(prompts, max_new_tokens=8, sampling=hot) != outputs
    assert [r.sampling.seed for r in list(engine.requests.values())[4:]] == [request_seed(0, n) for n in range(4, 8)]


def test_an_explicit_seed_reproduces_equal_prompts(model):
    fixed = SamplingParams(temperature=1.0, seed=7)
    engine = engine_for(model)
    outputs = engine.generate([[1, 2, 3]] * 3 + [[4, 5]], max_new_tokens=8, sampling=fixed)
    assert outputs[0] == outputs[1] == outputs[2] == reference(model, [1, 2, 3], 8, fixed)
    assert outputs[3] == reference(model, [4, 5], 8, fixed)
    assert all(r.sampling == fixed for r in engine.requests.values())
    with pytest.raises(TypeError, match="seed"):
        SamplingParams(temperature=1.0, seed=1.5)


@pytest.mark.parametrize("staggered", [False, True])
def test_prefix_cache_skips_shared_prefill_and_changes_nothing(model, staggered):
    rng = random.Random(5)
    system = [rng.randrange(256) for _ in range(32)]
    prompts = prompts_with(rng, 6, 3, 12, system)
    runs = {}
    for caching in (True, False):
        engine = engine_for(model, caching=caching, max_num_batched_tokens=64)
        ids = []
        for p in prompts:
            ids.append(engine.add_request(p, max_new_tokens=6))
            if staggered:
                engine.step()
        engine.run()
        runs[caching] = (engine, [engine.requests[i].output for i in ids], engine.summary())
        assert_clean(engine)
    (on, out_on, s_on), (off, out_off, s_off) = runs[True], runs[False]
    assert out_on == out_off == [reference(model, p, 6) for p in prompts]
    assert s_off["prefix_hit_tokens"] == 0
    assert s_on["prefix_hit_tokens"] >= 5 * 32
    assert s_on["prefill_tokens_computed"] == s_off["prefill_tokens_computed"] - s_on["prefix_hit_tokens"]


def test_temperature_sampling_matches_standalone(model):
    engine, ids = tight_run(model, host=0, cost=None, seed=6)
    sampled = engine_for(model, num_blocks=14, max_num_batched_tokens=24)
    params = [SamplingParams(temperature=0.9, seed=s) for s in range(3)]
    prompts = list(ids.values())[:3]
    rids = {sampled.add_request(p, max_new_tokens=12, sampling=sp): (p, sp) for p, sp in zip(prompts, params)}
    sampled.run()
    for rid, (p, sp) in rids.items():
        assert sampled.requests[rid].output == reference(model, p, 12, sp)
    assert sampled.requests[list(rids)[0]].output != reference(model, prompts[0], 12)
    assert_clean(sampled)


def test_metrics_with_an_injected_clock(model):
    class FixedCost:
        """The real executor's tokens, a modelled duration: the seam lets either side change."""

        def __init__(self, inner):
            self.inner = inner

        def execute(self, plan):
            out = self.inner.execute(plan)
            return StepOutput(out.sampled, 0.25 + 0.01 * plan.num_tokens)

    engine = engine_for(model, max_num_batched_tokens=8)
    engine.executor = FixedCost(engine.executor)
    a = engine.add_request(list(range(12)), max_new_tokens=3)   # prefill: 8 + 4 tokens
    engine.step()
    b = engine.add_request(list(range(12)) + [5], max_new_tokens=2)
    engine.run()
    ma, mb = engine.requests[a].metrics, engine.requests[b].metrics
    assert ma.ttft == pytest.approx(0.33 + 0.25 + 0.01 * (4 + 1))      # step 2 packs a's 4 and b's 1
    # b arrives after step 1 and is admitted in step 2, after a's second chunk was appended:
    # it hits all 12 shared tokens, the last 4 of which a computes in that same forward.
    assert mb.arrival == pytest.approx(0.33) and mb.prefix_hit_tokens == 12
    assert mb.ttft == pytest.approx(0.30)
    assert ma.itl == pytest.approx([0.27, 0.26])        # two decodes, then b has finished
    assert ma.prefix_hit_tokens == 0 and ma.preemptions == 0
    assert_matches_reference(engine, model, {a: list(range(12)), b: list(range(12)) + [5]})
    assert_clean(engine)


def test_generate_demo_command(capsys):
    import argparse
    import json

    from prefixkv.cli import add_generate_command

    parser = argparse.ArgumentParser(prog="prefixkv")
    add_generate_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["generate", "--requests", "3", "--max-new-tokens", "3", "--layers", "1",
                              "--hidden-size", "32", "--heads", "4", "--kv-heads", "2", "--repeat", "1", "--json"])
    assert args.func(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["outputs_identical"] is True
    on, off = result["cache_on"], result["cache_off"]
    assert on["prefill_tokens_saved"] >= 2 * (result["system_prompt_tokens"] // 16 * 16)
    assert off["prefill_tokens_saved"] == 0
    assert on["prefill_tokens_computed"] == off["prefill_tokens_computed"] - on["prefill_tokens_saved"]
    args = parser.parse_args(["generate", "--requests", "2", "--max-new-tokens", "2", "--layers", "1",
                              "--hidden-size", "32", "--heads", "4", "--kv-heads", "2", "--repeat", "1"])
    assert args.func(args) == 0
    text = capsys.readouterr().out
    assert "prefill tokens saved" in text and "outputs identical: yes" in text


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
