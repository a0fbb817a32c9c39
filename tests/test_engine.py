"""The packed engine on the tiny random-weight model: every request's tokens equal its own
standalone generation (dense attention over the whole sequence, no cache), whatever the
batching, chunking, preemption, cancellation or failure around it; no block leaks."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from prefixkv.engine import (Engine, PreemptionCostModel, RequestStatus, SamplingParams,  # noqa: E402
                             SchedulerConfig, SimulatedClock, StepOutput, TinyLlama, TinyLlamaConfig)
from prefixkv.engine.cost import GiB  # noqa: E402
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

    from prefixkv.engine.demo import add_generate_command

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
