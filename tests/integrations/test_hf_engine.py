"""prefixkv.integrations.hf_engine: a Hugging Face model in the packed engine.

Tiny random-weight LlamaForCausalLM (and Qwen2/Mistral) built from a config, float32, CPU. Each
request's engine output must equal its own ``model.generate(..., do_sample=False)`` on
transformers' default cache (DynamicCache, SDPA) token for token, whatever the arrival
order, chunking, prefix sharing and preemption around it; at the end the manager's
invariants hold and every block is back.
"""

from __future__ import annotations

import copy
import random
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
try:
    from prefixkv.integrations.hf_engine import (ENGINE_ATTENTION, HFEngineModel,  # noqa: E402
                                                 engine_from_hf)
except ImportError as exc:  # an unsupported transformers version
    pytest.skip(str(exc), allow_module_level=True)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import AttentionMaskInterface  # noqa: E402

from prefixkv.costs import PreemptionCostModel  # noqa: E402
from prefixkv.engine import Engine, RequestStatus, SchedulerConfig, SimulatedClock  # noqa: E402

B = 4
VOCAB = 512


def _config(**overrides) -> LlamaConfig:
    params = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=1, eos_token_id=None, initializer_range=0.2)
    params.update(overrides)
    return LlamaConfig(**params)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def reference_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).eval()


@pytest.fixture(scope="module")
def model(reference_model):
    """A copy switched to the engine attention, wrapped for the engine."""
    return HFEngineModel(copy.deepcopy(reference_model))


# Per model object, dropped with it: keyed by id(), a model freed by one test and a new one built
# at the same address by the next (test_other_architectures, same prompts) got the old references.
_refs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def reference(hf, prompt, max_new_tokens):
    """The request alone through transformers' generate with its default cache."""
    refs = _refs.setdefault(hf, {})
    key = (tuple(prompt), max_new_tokens)
    if key not in refs:
        ids = torch.tensor([prompt])
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          min_new_tokens=max_new_tokens, do_sample=False, cache=DynamicCache(config=hf.config),
                          pad_token_id=0)
        refs[key] = out[0, len(prompt):].tolist()
    return refs[key]


def engine_for(model, *, num_blocks=64, host=0, caching=True, cost=None, **config):
    config.setdefault("max_num_batched_tokens", 32)
    return Engine.from_model(model, num_blocks=num_blocks, block_size=B, num_host_blocks=host,
                             enable_caching=caching, config=SchedulerConfig(**config), cost_model=cost,
                             clock=SimulatedClock())


def prompts_with(rng, n, lo, hi, shared=()):
    return [list(shared) + [rng.randrange(1, VOCAB) for _ in range(rng.randrange(lo, hi))] for _ in range(n)]


def assert_matches_reference(engine, hf, ids_prompts):
    for rid, prompt in ids_prompts.items():
        r = engine.requests[rid]
        assert r.status is RequestStatus.FINISHED, r
        assert r.output == reference(hf, prompt, r.max_new_tokens), rid


def assert_clean(engine):
    mgr = engine.manager
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.active_blocks == 0 and len(mgr) == 0
    assert stats.evictable_blocks + stats.free_uncached_blocks == stats.capacity
    assert mgr.num_free_host_blocks == mgr.num_host_blocks
    assert not engine.has_unfinished


def test_interface_and_kv_spec(model, reference_model):
    spec = model.config.kv_spec()
    assert (spec.layers, spec.kv_heads, spec.head_dim, spec.dtype) == (2, 2, 16, "float32")
    assert model.device == torch.device("cpu")
    assert model.hf_model.config._attn_implementation == ENGINE_ATTENTION
    assert reference_model.config._attn_implementation != ENGINE_ATTENTION   # the reference is untouched


def test_one_request(model, reference_model):
    engine = engine_for(model)
    prompt = list(range(30, 45))
    rid = engine.add_request(prompt, max_new_tokens=6)
    engine.run()
    assert engine.requests[rid].output == reference(reference_model, prompt, 6)
    assert_clean(engine)


def test_arrivals_chunked_prefill_shared_prefix(model, reference_model):
    """Requests join at different steps; an 8-token budget chunks every prefill and mixes
    chunks with decodes; a shared 12-token system prompt is hit in the prefix cache."""
    rng = random.Random(0)
    shared = [rng.randrange(1, VOCAB) for _ in range(12)]
    prompts = prompts_with(rng, 5, 3, 14, shared)
    engine = engine_for(model, max_num_batched_tokens=8)
    calls = []
    real = engine.executor.execute
    engine.executor.execute = lambda plan: calls.append(plan) or real(plan)
    arrivals = {0: [0], 3: [1, 2], 6: [3], 11: [4]}
    ids, step = {}, 0
    while step < 12 or engine.has_unfinished:
        for i in arrivals.get(step, []):
            ids[engine.add_request(prompts[i], max_new_tokens=5 + i)] = prompts[i]
        engine.step()
        step += 1
    assert_matches_reference(engine, reference_model, ids)
    assert all(p.num_tokens <= 8 for p in calls)
    assert any(p.num_prefill_tokens and p.num_decode_tokens for p in calls), "mixed prefill/decode steps"
    prefill_chunks = {}
    for p in calls:
        for r in p.requests:
            if not r.is_decode:
                prefill_chunks.setdefault(r.request_id, []).append(r.num_tokens)
    assert any(len(c) >= 2 for c in prefill_chunks.values()), "some prompt is prefilled in chunks"
    assert engine.summary()["prefix_hit_tokens"] > 0
    assert_clean(engine)


def tight_run(model, *, host, cost, seed=2):
    """Five requests sharing a prefix, growing in a pool too small for all of them."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, VOCAB) for _ in range(8)]
    engine = engine_for(model, num_blocks=14, host=host, cost=cost, max_num_batched_tokens=24, max_num_seqs=5)
    prompts = prompts_with(rng, 5, 2, 7, shared)
    ids = {engine.add_request(p, max_new_tokens=12): p for p in prompts}
    engine.run()
    return engine, ids


def test_preemption_by_recompute(model, reference_model):
    engine, ids = tight_run(model, host=0, cost=None)
    summary = engine.summary()
    assert summary["preemptions"] > 0 and summary["swaps"] == 0 and summary["recomputed_tokens"] > 0
    assert summary["prefix_hit_tokens"] > 0
    assert_matches_reference(engine, reference_model, ids)
    assert_clean(engine)


def test_preemption_by_swap(model, reference_model):
    # 512 B of KV per token: swapping over the default link beats recomputing at the default rate.
    engine, ids = tight_run(model, host=32, cost=PreemptionCostModel.for_spec(model.config.kv_spec()))
    summary = engine.summary()
    assert summary["swaps"] > 0
    assert_matches_reference(engine, reference_model, ids)
    assert_clean(engine)


def test_cancellation_releases_blocks(model, reference_model):
    rng = random.Random(3)
    prompts = prompts_with(rng, 4, 5, 15)
    engine = engine_for(model, max_num_batched_tokens=16, max_num_seqs=2)
    ids = [engine.add_request(p, max_new_tokens=8) for p in prompts]
    for _ in range(3):
        engine.step()
    assert engine.cancel(ids[0]) and engine.cancel(ids[3])
    engine.run()
    assert_matches_reference(engine, reference_model, {ids[1]: prompts[1], ids[2]: prompts[2]})
    assert_clean(engine)


def test_mask_is_skipped_in_the_engine_and_sdpa_outside(model, reference_model):
    """No dense mask for the packed row; outside the engine the same model is plain SDPA."""
    from prefixkv.integrations import hf_engine

    seen = []
    real = hf_engine.engine_mask

    def spy(*args, **kwargs):
        mask = real(*args, **kwargs)
        seen.append(mask)
        return mask

    AttentionMaskInterface.register(ENGINE_ATTENTION, spy)
    try:
        engine = engine_for(model)
        engine.generate([[5, 6, 7, 8, 9]], max_new_tokens=3)
        assert seen and all(m is None for m in seen)
        seen.clear()
        prompt = [5, 6, 7, 8, 9, 10]
        assert reference(model.hf_model, prompt, 5) == reference(reference_model, prompt, 5)
        assert seen     # outside the engine the mask function ran (sdpa_mask: None only where exactly causal)
        # A left-padded batch needs a real mask: the fallback builds it, and the outputs match SDPA's.
        ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
        attn = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])
        seen.clear()
        kwargs = dict(attention_mask=attn, max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(model.hf_model.generate(ids, **kwargs), reference_model.generate(ids, **kwargs))
        assert any(isinstance(m, torch.Tensor) for m in seen)
    finally:
        hf_engine.register()


def test_backend_kwarg_reaches_every_layer(model):
    engine = engine_for(model)
    layers = []
    from prefixkv.integrations import hf_engine
    real = hf_engine.paged_attention

    def spy(q, store, layer, *a, **k):
        layers.append(layer)
        return real(q, store, layer, *a, **k)

    hf_engine.paged_attention = spy
    try:
        engine.generate([[1, 2, 3]], max_new_tokens=1)
    finally:
        hf_engine.paged_attention = real
    assert layers == [0, 1]


def test_refuses_a_model_not_switched_to_the_engine_attention():
    with pytest.raises(ValueError, match="set_attention"):
        HFEngineModel(LlamaForCausalLM(_config()), set_attention=False)


def test_refuses_a_sequence_longer_than_the_sliding_window():
    import transformers

    cfg = transformers.MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                     num_attention_heads=4, num_key_value_heads=2, sliding_window=4,
                                     pad_token_id=0, eos_token_id=None)
    engine = engine_from_hf(transformers.MistralForCausalLM(cfg), num_blocks=16, block_size=B,
                            clock=SimulatedClock())
    with pytest.raises(NotImplementedError, match="sliding window"):
        engine.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=1)
    assert_clean(engine)


@pytest.mark.parametrize("arch", ["qwen2", "mistral", "opt", "bigcode"])
def test_other_architectures(arch):
    import transformers

    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  pad_token_id=0, bos_token_id=1, eos_token_id=None, initializer_range=0.2)
    if arch == "qwen2":
        cfg, cls = transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    elif arch == "opt":
        cfg = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=VOCAB, word_embed_proj_dim=64, pad_token_id=0, eos_token_id=None)
        cls = transformers.OPTForCausalLM
    elif arch == "bigcode":      # multi-query: one K/V head
        cfg = transformers.GPTBigCodeConfig(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, multi_query=True,
                                            initializer_range=0.5, pad_token_id=0, eos_token_id=None)
        cls = transformers.GPTBigCodeForCausalLM
    else:
        cfg, cls = transformers.MistralConfig(**common, sliding_window=4096), transformers.MistralForCausalLM
    torch.manual_seed(1)
    ref = cls(cfg).eval()
    engine = engine_from_hf(copy.deepcopy(ref), num_blocks=64, block_size=B,
                            config=SchedulerConfig(max_num_batched_tokens=8), clock=SimulatedClock())
    rng = random.Random(5)
    shared = [rng.randrange(1, VOCAB) for _ in range(8)]
    prompts = prompts_with(rng, 3, 3, 10, shared)
    ids = {engine.add_request(p, max_new_tokens=6): p for p in prompts}
    engine.run()
    assert_matches_reference(engine, ref, ids)
    assert engine.summary()["prefix_hit_tokens"] > 0
    assert_clean(engine)


def _falcon(**overrides):
    import transformers

    torch.manual_seed(0)
    cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                                    initializer_range=0.5, pad_token_id=0, **overrides)
    return transformers.FalconForCausalLM(cfg).eval()


def _bloom():
    import transformers

    torch.manual_seed(0)
    return transformers.BloomForCausalLM(transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4,
                                                                  vocab_size=VOCAB)).eval()


@pytest.mark.parametrize("make", [_falcon, _bloom], ids=["falcon", "bloom"])
def test_refuses_models_whose_attention_bypasses_the_attention_function(make):
    """Falcon and Bloom compute attention inline: the pool would never be written (silently wrong tokens)."""
    m = make()
    with pytest.raises(ValueError, match=f"cannot run {type(m).__name__}.*never calls the registered attention"):
        HFEngineModel(m)


def test_a_layer_that_skips_the_engine_attention_is_caught(monkeypatch):
    """Even where the class claims attention-backend support, each forward checks that every layer ran
    the engine attention (here Falcon, with the class flag forced)."""
    import transformers

    monkeypatch.setattr(transformers.FalconForCausalLM, "_supports_attention_backend", True)
    engine = engine_for(HFEngineModel(_falcon()))
    with pytest.raises(RuntimeError, match=r"FalconForCausalLM: .*layer\(s\) \[0, 1\] did not run"):
        engine.generate([[3, 4, 5, 6, 7]], max_new_tokens=3)


@pytest.mark.parametrize("overrides,kv_heads", [(dict(multi_query=True), 1), (dict(multi_query=False), 4),
                                                (dict(new_decoder_architecture=True, num_kv_heads=2), 4)])
def test_falcon_kv_heads(overrides, kv_heads):
    from prefixkv.integrations.hf_engine import HFEngineConfig

    m = _falcon(**overrides)
    assert HFEngineConfig(m.config, torch.float32).kv_spec().kv_heads == kv_heads


def test_refuses_alibi_models():
    from prefixkv.integrations.hf_engine import HFEngineConfig

    with pytest.raises(ValueError, match="ALiBi"):
        HFEngineConfig(_falcon(alibi=True).config, torch.float32)


def test_multimodal_configs_are_refused_before_the_model_is_changed():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                         intermediate_size=128, vocab_size=100)
    config.image_token_id = 99
    model = LlamaForCausalLM(config)
    before = model.config._attn_implementation
    with pytest.raises(ValueError, match="multimodal models are not supported"):
        HFEngineModel(model)
    assert model.config._attn_implementation == before
