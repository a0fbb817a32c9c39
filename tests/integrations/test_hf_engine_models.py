"""``HFEngineModel`` on architectures beyond Llama: the model's own logits scaling is applied (Granite,
HyperCLOVA X) or refused when unknown; Llama 4's stack is found although its ``base_model_prefix``
names no attribute; sequences past an attention chunk, or past a sliding window applied only
through the mask (Qwen2-MoE), are refused, failing only that request; layers that are not
attention (LFM2's convolutions) are refused up front. Each test skips without a supported
transformers."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")

from prefixkv.engine import Engine, RequestStatus, SamplingParams, SimulatedClock  # noqa: E402
from prefixkv.engine.sampling import sample  # noqa: E402

B = 4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def assert_clean(engine):
    mgr = engine.manager
    mgr.check_invariants()
    stats = mgr.stats()
    assert stats.active_blocks == 0 and len(mgr) == 0
    assert not engine.has_unfinished


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
