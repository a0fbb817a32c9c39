"""The packed engine end to end on CPU: tokens/s with the prefix cache on vs off.

Eight 256-token prompts whose first half (128 tokens) is one shared prefix,
16 new tokens each, greedy; a fresh engine (empty cache) per round, so the
cache-on run only reuses what its own requests publish. ``extra_info`` holds
the prefill tokens computed and saved; compare the two medians for the
end-to-end speed-up. No timing assertions.

    .venv/bin/pytest benches/test_bench_engine.py --benchmark-only
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")

from prefixkv.engine import Engine, SchedulerConfig, TinyLlama, TinyLlamaConfig, WallClock  # noqa: E402

NUM_PROMPTS, PROMPT_TOKENS, SHARED_TOKENS, NEW_TOKENS = 8, 256, 128, 16

MODELS = {
    "tiny": TinyLlamaConfig(),                                                  # 2 layers, hidden 64
    "small": TinyLlamaConfig(num_layers=4, hidden_size=256, intermediate_size=512, num_heads=8,
                             num_kv_heads=2, head_dim=32),                       # the demo's model
}


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """One thread: steadier numbers on a shared CPU (OpenMP workers spin when a core is busy)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(SHARED_TOKENS)]
    return [shared + [rng.randrange(256) for _ in range(PROMPT_TOKENS - SHARED_TOKENS)]
            for _ in range(NUM_PROMPTS)]


@pytest.fixture(scope="module", params=list(MODELS))
def model(request):
    return request.param, TinyLlama(MODELS[request.param])


def run_engine(model, prompts, caching: bool):
    engine = Engine.from_model(model, num_blocks=256, block_size=16, enable_caching=caching,
                               config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16),
                               clock=WallClock())
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    return outputs, engine.summary()


@pytest.mark.parametrize("caching", [True, False], ids=["cache-on", "cache-off"])
def test_engine_tokens_per_s(benchmark, model, prompts, caching):
    name, net = model
    run_engine(net, prompts[:2], caching)                      # warm-up: first-call kernel set-up
    outputs, summary = benchmark.pedantic(run_engine, args=(net, prompts, caching), rounds=5, iterations=1)
    total = NUM_PROMPTS * (PROMPT_TOKENS + NEW_TOKENS)
    benchmark.extra_info.update(
        model=name, prompt_tokens=summary["prompt_tokens"],
        prefill_tokens_computed=summary["prefill_tokens_computed"],
        prefill_tokens_saved=summary["prefix_hit_tokens"], output_tokens=summary["output_tokens"],
        steps=summary["steps"], tokens_per_round=total)
    assert [len(o) for o in outputs] == [NEW_TOKENS] * NUM_PROMPTS
    if not caching:
        assert summary["prefix_hit_tokens"] == 0
