"""transformers' generate: DynamicCache vs PrefixKVCache (gather and paged modes), with and without a shared prefix.

    .venv/bin/pytest benches/test_bench_hf.py --benchmark-only --benchmark-columns=min,median,max
    .venv/bin/pytest benches/test_bench_hf.py --benchmark-disable   # smoke: each body once

Workload: 8 requests served one after another (batch 1, greedy, 16 new tokens),
prompts of 256 tokens. ``unique``: no two prompts share a token block.
``shared50``: the first 128 tokens (50%) of every prompt are the same, a system
prompt. Each timed round starts from an empty ``PrefixKVStore``, so the first
request misses and the seven others find the shared 128 tokens cached:
7 x 128 = 896 of the 2,048 prompt tokens are not prefilled (43.75%).

Model: a tiny random-weight Llama built from a config (hidden 256, 4 layers,
8 query / 4 KV heads, head dim 32, vocab 1024), float32 on the CPU, one torch
thread (steadier timings on shared machines). Block size 16.

Each bench checks its tokens against DynamicCache's and records in
``extra_info`` the prompt tokens, the prefill tokens the model computed and those
the prefix cache saved. No timing is asserted.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'prefixkv[hf]')")
try:
    from prefixkv.integrations.hf import PAGED_ATTENTION, PrefixKVStore
except ImportError as exc:  # an unsupported transformers version
    pytest.skip(str(exc), allow_module_level=True)

from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

REQUESTS, PROMPT, SHARED, NEW, BLOCK, VOCAB = 8, 256, 128, 16, 16, 1024
ROUNDS = 5


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def models():
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                         pad_token_id=0, eos_token_id=None, initializer_range=0.2)
    sdpa = LlamaForCausalLM(config).eval()
    paged = copy.deepcopy(sdpa)
    paged.set_attn_implementation(PAGED_ATTENTION)
    return {"sdpa": sdpa, "paged": paged}


def _prompts(shared: bool) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(3, VOCAB, (SHARED,), generator=g)
    prompts = []
    for _ in range(REQUESTS):
        head = prefix if shared else torch.randint(3, VOCAB, (SHARED,), generator=g)
        prompts.append(torch.cat([head, torch.randint(3, VOCAB, (PROMPT - SHARED,), generator=g)])[None])
    return prompts


@pytest.fixture(scope="module")
def workloads(models):
    out = {}
    for name, shared in (("unique", False), ("shared50", True)):
        prompts = _prompts(shared)
        expect = [models["sdpa"].generate(p, max_new_tokens=NEW, do_sample=False) for p in prompts]
        out[name] = (prompts, expect)
    return out


def _serve_dynamic(model, prompts):
    return [model.generate(p, max_new_tokens=NEW, do_sample=False) for p in prompts], None


def _serve_prefixkv(model, prompts, mode):
    store = PrefixKVStore(model, num_blocks=REQUESTS * (PROMPT + NEW) // BLOCK + 8, block_size=BLOCK, hash_seed=0)
    outs, computed, saved = [], 0, 0
    for p in prompts:
        with store.cache(model, mode=mode) as cache:
            info = cache.prepare(p)
            outs.append(model.generate(p, cache=cache, max_new_tokens=NEW, do_sample=False))
            computed += p.shape[1] - info.cached_columns
            saved += info.skipped_tokens
    store.check_invariants()
    assert store.stats().active_blocks == 0
    return outs, (computed, saved)


@pytest.mark.parametrize("workload", ["unique", "shared50"])
@pytest.mark.parametrize("cache", ["dynamic", "gather", "paged"])
def test_generate_8_requests(benchmark, models, workloads, cache, workload):
    prompts, expect = workloads[workload]
    if cache == "dynamic":
        run = lambda: _serve_dynamic(models["sdpa"], prompts)  # noqa: E731
    else:
        model = models["paged" if cache == "paged" else "sdpa"]
        run = lambda: _serve_prefixkv(model, prompts, cache)  # noqa: E731
    outs, tokens = benchmark.pedantic(run, rounds=ROUNDS, iterations=1, warmup_rounds=1)
    assert all(torch.equal(o, e) for o, e in zip(outs, expect))
    prompt_tokens = REQUESTS * PROMPT
    computed, saved = tokens if tokens is not None else (prompt_tokens, 0)
    benchmark.extra_info.update(requests=REQUESTS, prompt_tokens=prompt_tokens, new_tokens=REQUESTS * NEW,
                                prefill_tokens_computed=computed, prefill_tokens_saved=saved,
                                saved_share=saved / prompt_tokens, block_size=BLOCK, threads=torch.get_num_threads())
    if workload == "shared50" and cache != "dynamic":
        assert saved == (REQUESTS - 1) * SHARED
