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


# -- Hugging Face engine model ------------------------------------------------------

HF_VOCAB = 128


def _hf_common(**overrides):
    params = dict(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                  eos_token_id=None, initializer_range=0.2)
    params.update(overrides)
    return params


def _hf_engine_model():
    pytest.importorskip("transformers")
    try:
        from prefixkv.integrations.hf_engine import HFEngineModel
    except ImportError as exc:  # an unsupported transformers version
        pytest.skip(str(exc))
    return HFEngineModel


def _hf_reference(hf, prompt, max_new_tokens):
    ids = torch.tensor([prompt])
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                      min_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("arch", ["granite", "hyperclovax"])
def test_hf_engine_logits_apply_the_models_logits_scaling(arch):
    """GraniteForCausalLM divides its logits by config.logits_scaling (HyperCLOVA X multiplies):
    HFEngineModel ignored it, so temperature sampling drew from another distribution than the
    model's own (greedy argmax hid it)."""
    HFEngineModel = _hf_engine_model()
    import transformers

    torch.manual_seed(0)
    if arch == "granite":
        cfg = transformers.GraniteConfig(**_hf_common(), logits_scaling=8.0, attention_multiplier=0.3,
                                         embedding_multiplier=2.0, residual_multiplier=0.5)
        ref = transformers.GraniteForCausalLM(cfg).eval()
    else:
        cfg = transformers.HyperCLOVAXConfig(**_hf_common(), logits_scaling=0.25)
        ref = transformers.HyperCLOVAXForCausalLM(cfg).eval()
    wrapped = HFEngineModel(copy.deepcopy(ref))
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    with torch.no_grad():
        want = ref(ids).logits[0]
        got = wrapped.logits(ref.model(ids).last_hidden_state[0])
    torch.testing.assert_close(got, want.float())
    # End to end: seeded temperature sampling equals a standalone loop over the model's own logits.
    params = SamplingParams(temperature=1.0, seed=7)
    tokens = [3, 4, 5, 6, 7, 8]
    expected = []
    for i in range(4):
        with torch.no_grad():
            expected.append(sample(ref(torch.tensor([tokens + expected])).logits[0, -1], params, i))
    engine = Engine.from_model(wrapped, num_blocks=32, block_size=B, clock=SimulatedClock())
    assert engine.generate([tokens], max_new_tokens=4, sampling=params) == [expected]
    assert_clean(engine)


def test_hf_engine_refuses_a_logits_scaling_it_does_not_know_how_to_apply():
    HFEngineModel = _hf_engine_model()
    import transformers

    cfg = transformers.LlamaConfig(**_hf_common())
    cfg.logits_scaling = 4.0
    torch.manual_seed(0)
    with pytest.raises(ValueError, match="logits_scaling"):
        HFEngineModel(transformers.LlamaForCausalLM(cfg).eval())


def _served_within_refused_past(ref, reason):
    """An engine on ``ref`` (an 8-token chunk or window) generates as ``ref`` does for a prompt inside
    it and refuses (``reason``) a longer one, failing only that request."""
    HFEngineModel = _hf_engine_model()
    engine = Engine.from_model(HFEngineModel(copy.deepcopy(ref)), num_blocks=32, block_size=B,
                               clock=SimulatedClock())
    short = [3, 4, 5, 6, 7]
    assert engine.generate([short], max_new_tokens=3) == [_hf_reference(ref, short, 3)]
    rid = engine.add_request([3, 4, 5, 6, 7, 8, 9, 10, 11, 12], max_new_tokens=2)
    with pytest.raises(NotImplementedError, match=reason):
        engine.run()
    assert engine.requests[rid].status is RequestStatus.FAILED
    assert_clean(engine)


def _llama4(chunk):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Llama4TextConfig(**_hf_common(num_hidden_layers=4), head_dim=16, intermediate_size_mlp=128,
                                        num_local_experts=2, attention_chunk_size=chunk)
    return transformers.Llama4ForCausalLM(cfg).eval()


def test_hf_engine_runs_llama4_whose_base_model_prefix_names_no_attribute():
    """Llama4ForCausalLM's base_model_prefix is 'language_model' but its stack is `model`:
    get_decoder() returned the whole model, whose forward gives logits, and the first step died
    on "'MoeCausalLMOutputWithPast' object has no attribute 'last_hidden_state'"."""
    HFEngineModel = _hf_engine_model()
    ref = _llama4(chunk=64)
    wrapped = HFEngineModel(copy.deepcopy(ref))
    assert wrapped.base is wrapped.hf_model.model
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12]
    engine = Engine.from_model(wrapped, num_blocks=32, block_size=B, clock=SimulatedClock())
    assert engine.generate([prompt], max_new_tokens=5) == [_hf_reference(ref, prompt, 5)]
    assert_clean(engine)


def test_hf_engine_refuses_sequences_longer_than_an_attention_chunk():
    """Llama 4's chunked layers attend only inside their chunk, which transformers expresses as a
    mask the engine drops: past the chunk the outputs were silently different from the model's."""
    _hf_engine_model()          # skips without transformers or a supported version
    _served_within_refused_past(_llama4(chunk=8), "attention chunk")


def test_hf_engine_refuses_non_attention_layers_up_front():
    """LFM2's convolution layers keep state the KV pool does not hold: refused when wrapped, not by
    a RuntimeError that fails the first step."""
    HFEngineModel = _hf_engine_model()
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Lfm2Config(vocab_size=HF_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, full_attn_idxs=[1], pad_token_id=0)
    hf = transformers.Lfm2ForCausalLM(cfg).eval()
    before = hf.config._attn_implementation
    with pytest.raises(ValueError, match="layer types"):
        HFEngineModel(hf)
    assert hf.config._attn_implementation == before       # refused before switching the attention


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


def test_hf_engine_refuses_sequences_past_a_window_the_model_applies_only_through_its_mask():
    """Qwen2-MoE's sliding layers never pass ``sliding_window`` to the attention function (the
    mask alone applies it), so the attention function's window check never fired and sequences
    past the window were silently wrong."""
    _hf_engine_model()          # skips without transformers or a supported version
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen2MoeConfig(**_hf_common(), moe_intermediate_size=64, shared_expert_intermediate_size=64,
                                      num_experts=2, num_experts_per_tok=1, use_sliding_window=True,
                                      sliding_window=8, max_window_layers=2)
    _served_within_refused_past(transformers.Qwen2MoeForCausalLM(cfg).eval(), "sliding window")


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
