"""The remote tier's model digest (``prefixkv.tiers.remote.model_weights_digest``): everything that
shapes a model's KV bytes reaches the fingerprint (rope theta and scaling, norm epsilon, the engine
wrapper of a Hugging Face model); a model without weights is refused naming it."""

from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")

from prefixkv.engine import TinyLlama, TinyLlamaConfig  # noqa: E402
from prefixkv.errors import InvalidArgument  # noqa: E402
from prefixkv.tiers.remote import model_weights_digest  # noqa: E402


def same_weights(config_a, config_b):
    a, b = TinyLlama(config_a), TinyLlama(config_b)
    b.load_state_dict(a.state_dict())
    return a, b


def test_equal_weights_with_another_rope_theta_get_another_digest():
    """Keys are post-RoPE: the same checkpoint run with another rope theta (a long-context
    setting) computes other KV bytes, so replicas must not share blocks."""
    cfg = TinyLlamaConfig(num_layers=1, hidden_size=32, head_dim=8)
    a, b = same_weights(cfg, dataclasses.replace(cfg, rope_theta=500_000.0))
    assert not torch.equal(a.inv_freq, b.inv_freq)
    assert model_weights_digest(a) != model_weights_digest(b)
    c = TinyLlama(cfg)
    c.load_state_dict(a.state_dict())
    assert model_weights_digest(a) == model_weights_digest(c)      # same weights and config: shared


def test_equal_weights_with_another_norm_eps_get_another_digest():
    cfg = TinyLlamaConfig(num_layers=1, hidden_size=32, head_dim=8)
    a, b = same_weights(cfg, dataclasses.replace(cfg, rms_norm_eps=1e-2))
    assert model_weights_digest(a) != model_weights_digest(b)


def _hf_llama(**kwargs):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, **kwargs)
    return transformers.LlamaForCausalLM(config)


def test_a_hugging_face_checkpoint_with_rope_scaling_gets_another_digest():
    """HF keeps the rotary frequencies in non-persistent buffers (absent from state_dict) and the
    rest of the rope setting in the config: a replica configured with another rope theta or
    scaling must not read the other's blocks; equal configs still share."""
    a = _hf_llama()
    b = _hf_llama(rope_parameters={"rope_type": "default", "rope_theta": 500_000.0})
    b.load_state_dict(a.state_dict())
    assert model_weights_digest(a) != model_weights_digest(b)
    c = _hf_llama()
    c.load_state_dict(a.state_dict())
    c.config._name_or_path = "/another/path/to/the/same/checkpoint"   # where it was loaded from: not KV
    assert model_weights_digest(a) == model_weights_digest(c)


def test_the_engine_wrapper_of_a_hugging_face_model_has_a_digest():
    """``Engine.from_model(HFEngineModel(hf), remote=URL)`` digests the wrapped model's weights; the
    wrapper has no ``state_dict`` of its own."""
    pytest.importorskip("transformers")
    from prefixkv.integrations.hf_engine import HFEngineModel

    a = _hf_llama()
    b = _hf_llama()
    b.load_state_dict(a.state_dict())
    digest = model_weights_digest(b)
    assert model_weights_digest(HFEngineModel(a)) == digest


def test_model_weights_digest_of_a_model_without_weights_names_model():
    pytest.importorskip("torch")
    from prefixkv.tiers.remote import model_weights_digest

    with pytest.raises(InvalidArgument) as info:
        model_weights_digest(object())
    assert info.value.argument == "model"
