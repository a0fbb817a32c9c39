"""The host tier through the engine and Hugging Face ``generate``: with a device pool too small to
keep the shared prefixes, the host tier saves more prefill tokens than no tier, and outputs stay
token-identical (to the run without tiers, and to the run without any cache)."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from hf_generate import generate_plain, generate_through  # noqa: E402
from prefixkv.engine import Engine, SchedulerConfig, TinyLlama, TinyLlamaConfig  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def shared_prefix_prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """Four system prompts of 6 blocks of 8, each asked three times, round robin: a pool of
    16 blocks cannot keep the four prefixes between their turns."""
    rng = random.Random(seed)
    systems = [[rng.randrange(3, vocab) for _ in range(48)] for _ in range(4)]
    return [s + [rng.randrange(3, vocab) for _ in range(5)] for _ in range(3) for s in systems]


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return TinyLlama(TinyLlamaConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                     vocab_size=256))


def run_engine(model, prompts, *, host: int, caching: bool = True):
    engine = Engine.from_model(model, num_blocks=16, block_size=8, num_host_blocks=host,
                               host_cache=bool(host) and caching, enable_caching=caching,
                               config=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=2))
    outputs = engine.generate(prompts, max_new_tokens=4)
    engine.manager.check_invariants()
    return outputs, engine.manager.stats()


def test_engine_with_the_host_tier_saves_more_prefill_and_generates_the_same(tiny):
    prompts = shared_prefix_prompts(256)
    no_tier, device_only = run_engine(tiny, prompts, host=0)
    tiered, with_host = run_engine(tiny, prompts, host=64)
    uncached, _ = run_engine(tiny, prompts, host=0, caching=False)
    assert tiered == no_tier == uncached
    assert with_host.hit_tokens > device_only.hit_tokens
    assert with_host.host_hit_tokens > 0 and with_host.loads > 0 and with_host.demotions > 0


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_hf_generate_with_the_host_tier(tiny_hf_models, mode):
    from prefixkv.integrations.hf import PrefixKVStore    # the fixture skipped where it cannot import

    model = tiny_hf_models[mode]
    prompts = shared_prefix_prompts(256, seed=1)

    def run(host):
        store = PrefixKVStore(model, num_blocks=16, block_size=8, hash_seed=0, num_host_blocks=host,
                              host_cache=bool(host))
        return generate_through(store, model, prompts, mode), store.manager.stats()

    reference = generate_plain(model, prompts)
    no_tier, device_only = run(0)
    tiered, with_host = run(64)
    assert tiered == no_tier == reference
    assert with_host.hit_tokens > device_only.hit_tokens and with_host.host_hit_tokens > 0
