"""Fixtures shared by several test files, and the Hypothesis profiles.

Property-based tests without explicit sizes (the manager's state machine) take them from a
profile chosen by ``PREFIXKV_HYPOTHESIS_PROFILE``: ``ci`` (the default, what CI runs), ``quick``
(a smoke run) or ``long`` (a soak run: ``PREFIXKV_HYPOTHESIS_PROFILE=long .venv/bin/pytest
tests/core/test_stateful.py``, 4,400 examples of up to 130 steps). Explicit ``@settings`` on a test
override the profile.
"""

import os

import pytest
from hypothesis import HealthCheck, settings

_SLOW_OK = [HealthCheck.too_slow, HealthCheck.filter_too_much]
settings.register_profile("ci", max_examples=300, stateful_step_count=50, deadline=None,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("quick", max_examples=10, stateful_step_count=20, deadline=None,
                          suppress_health_check=_SLOW_OK)
settings.register_profile("long", max_examples=4_400, stateful_step_count=130, deadline=None,
                          suppress_health_check=_SLOW_OK)
settings.load_profile(os.environ.get("PREFIXKV_HYPOTHESIS_PROFILE", "ci"))


def pytest_configure(config):
    config.addinivalue_line("markers", "ray: needs ray (extra [ray]; skipped with the reason where it is absent)")


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of small tensors: faster than two, and immune to OpenMP
    threads spinning on a busy CPU. Restored afterwards for the rest of the session."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny_hf_models():
    """A tiny random-weight LlamaForCausalLM (vocab 256, 2 layers), as ``{"gather": model,
    "paged": a copy on prefixkv's paged attention}``; skipped without a supported transformers."""
    import copy

    pytest.importorskip("transformers")
    try:
        from prefixkv.integrations.hf import PAGED_ATTENTION
    except ImportError as exc:  # an unsupported transformers version
        pytest.skip(str(exc))
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None, initializer_range=0.2)
    model = LlamaForCausalLM(config).eval()
    paged = copy.deepcopy(model)
    paged.set_attn_implementation(PAGED_ATTENTION)
    return {"gather": model, "paged": paged}
