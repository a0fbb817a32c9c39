"""The packed engine running a Hugging Face model vs transformers' own generate, CPU.

The tiny random-weight LlamaForCausalLM (2 layers, hidden 64, float32, built from a
config), one torch thread. Eight 256-token prompts, 16 new tokens each, greedy, in
two prompt sets: ``unique`` (no shared tokens) and ``shared50`` (the first 128 tokens
of every prompt are one shared prefix). Each set runs through

* ``hf-sequential``: ``model.generate`` with its default cache (DynamicCache, SDPA),
  one prompt at a time;
* ``hf-batched``: the same, all eight prompts in one call (equal lengths, no padding);
* ``engine-cache-on`` / ``engine-cache-off``: ``Engine.from_model(HFEngineModel(...))``
  (the registered ``prefixkv_engine`` attention over the packed row), a fresh engine
  (empty prefix cache) each round, so cache-on only reuses what its own requests publish.

``extra_info`` holds the tokens per round (prompt + generated), prefill tokens computed
and saved, and ``tokens_per_s`` from the median. Engine outputs are checked against the
sequential HF outputs (token for token). No timing assertions.

    .venv/bin/pytest benches/test_bench_engine_vs_hf.py --benchmark-only
"""

from __future__ import annotations

import copy
import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("pytest_benchmark")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from prefixkv.engine import Engine, SchedulerConfig, WallClock  # noqa: E402
from prefixkv.integrations.hf_engine import HFEngineModel  # noqa: E402

NUM_PROMPTS, PROMPT_TOKENS, NEW_TOKENS = 8, 256, 16
VOCAB = 512
PROMPT_SETS = {"unique": 0, "shared50": PROMPT_TOKENS // 2}   # shared prefix tokens
RUNNERS = ["hf-sequential", "hf-batched", "engine-cache-on", "engine-cache-off"]


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=0, bos_token_id=1, eos_token_id=None, initializer_range=0.2)
    return LlamaForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def engine_model(hf_model):
    return HFEngineModel(copy.deepcopy(hf_model))


def make_prompts(shared_tokens: int) -> list[list[int]]:
    rng = random.Random(0)
    shared = [rng.randrange(1, VOCAB) for _ in range(shared_tokens)]
    return [shared + [rng.randrange(1, VOCAB) for _ in range(PROMPT_TOKENS - shared_tokens)]
            for _ in range(NUM_PROMPTS)]


def _generate(hf, ids):
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                          min_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                          cache=DynamicCache(config=hf.config))
    return out[:, ids.shape[1]:].tolist()


def run_hf_sequential(hf, prompts):
    return [_generate(hf, torch.tensor([p]))[0] for p in prompts], None


def run_hf_batched(hf, prompts):
    return _generate(hf, torch.tensor(prompts)), None


def run_engine(model, prompts, caching: bool):
    engine = Engine.from_model(model, num_blocks=256, block_size=16, enable_caching=caching,
                               config=SchedulerConfig(max_num_batched_tokens=512, max_num_seqs=16),
                               clock=WallClock())
    outputs = engine.generate(prompts, max_new_tokens=NEW_TOKENS)
    engine.manager.check_invariants()
    return outputs, engine.summary()


_expected: dict = {}


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("prompt_set", list(PROMPT_SETS))
def test_engine_vs_hf_generate(benchmark, hf_model, engine_model, prompt_set, runner):
    prompts = make_prompts(PROMPT_SETS[prompt_set])
    if runner == "hf-sequential":
        fn, args = run_hf_sequential, (hf_model, prompts)
    elif runner == "hf-batched":
        fn, args = run_hf_batched, (hf_model, prompts)
    else:
        fn, args = run_engine, (engine_model, prompts, runner == "engine-cache-on")
    fn(*(a[:2] if isinstance(a, list) else a for a in args))          # warm-up on two prompts
    outputs, summary = benchmark.pedantic(fn, args=args, rounds=5, iterations=1)
    total = NUM_PROMPTS * (PROMPT_TOKENS + NEW_TOKENS)
    info = dict(prompt_set=prompt_set, runner=runner, shared_prefix_tokens=PROMPT_SETS[prompt_set],
                tokens_per_round=total, output_tokens=NUM_PROMPTS * NEW_TOKENS,
                prefill_tokens_computed=NUM_PROMPTS * PROMPT_TOKENS, prefill_tokens_saved=0)
    if summary is not None:
        info.update(prefill_tokens_computed=summary["prefill_tokens_computed"],
                    prefill_tokens_saved=summary["prefix_hit_tokens"], steps=summary["steps"])
    stats = getattr(benchmark, "stats", None)
    if stats is not None and getattr(stats, "stats", None) is not None and stats.stats.median:
        info.update(tokens_per_s=total / stats.stats.median,
                    output_tokens_per_s=NUM_PROMPTS * NEW_TOKENS / stats.stats.median)
    benchmark.extra_info.update(info)

    assert [len(o) for o in outputs] == [NEW_TOKENS] * NUM_PROMPTS
    if runner.startswith("engine"):
        key = prompt_set
        if key not in _expected:
            _expected[key] = run_hf_sequential(hf_model, prompts)[0]
        assert outputs == _expected[key], "the engine's greedy tokens equal HF generate's"
        if runner == "engine-cache-off" or prompt_set == "unique":
            assert summary["prefix_hit_tokens"] == 0
        else:
            assert summary["prefix_hit_tokens"] > 0
