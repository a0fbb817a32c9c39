"""prefixkv.integrations.hf: PrefixKVCache in transformers' generate, against DynamicCache.

A tiny random-weight LlamaForCausalLM built from a config (no hub, no network),
float32 on the CPU. Every generation is compared token for token with the same
call on transformers' default cache (DynamicCache). Cached-prefix cases also
count the tokens the model actually embedded (a forward hook on the input
embeddings), to show that the prefill was skipped, not just that the output
is right. A chunk that is all padding for a row says to prepare; assisted decoding
with a cached prefix is refused by name; a prepare that does not fit evicts no
cached prefix; continuing forked rows is not refused.
"""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch", reason="the HF integration needs torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'prefixkv[hf]')")
try:
    import prefixkv.integrations.hf  # noqa: F401
except ImportError as exc:  # an unsupported transformers version
    pytest.skip(str(exc), allow_module_level=True)

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, create_causal_mask  # noqa: E402

from prefixkv import OutOfBlocks  # noqa: E402
from prefixkv.integrations.hf import PAGED_ATTENTION, PrefixKVCache, PrefixKVStore  # noqa: E402

BLOCK = 8
NEW = 12
PAD = 0
VOCAB = 512


def _config(**overrides) -> LlamaConfig:
    params = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  pad_token_id=PAD, bos_token_id=1, eos_token_id=None, initializer_range=0.2)
    params.update(overrides)
    return LlamaConfig(**params)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = LlamaForCausalLM(_config()).eval()
    return m


@pytest.fixture(scope="module")
def paged_model(model):
    m = copy.deepcopy(model)
    m.set_attn_implementation(PAGED_ATTENTION)
    return m


@pytest.fixture(scope="module")
def eager_model(model):
    m = copy.deepcopy(model)
    m.set_attn_implementation("eager")
    return m


def _model_for(mode, model, paged_model):
    return paged_model if mode == "paged" else model


class TokenCounter:
    """Counts the tokens each forward embeds: the work the model actually did."""

    def __init__(self, model):
        self.calls: list[tuple[int, int]] = []
        self.handle = model.get_input_embeddings().register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.calls.append(tuple(args[0].shape))

    @property
    def prefill_tokens(self) -> int:
        return self.calls[0][1]

    def close(self):
        self.handle.remove()


def _ids(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (n,), generator=g).tolist()


SYSTEM = _ids(1, 27)            # shared prefix: 3 full blocks + 3 tokens


def _left_pad(prompts: list[list[int]]):
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p)
        mask[b, width - len(p):] = 1
    return ids, mask


def _reference(model, ids, mask=None, **kw):
    """transformers' default cache (DynamicCache)."""
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("do_sample", False)
    return model.generate(ids, attention_mask=mask, **kw)


def _run(model, store, ids, mask=None, *, mode="gather", prepare=True, seed=None, expect_empty=True,
         check_rows=True, **kw):
    """generate through a PrefixKVCache; returns (sequences, cache stats, tokens embedded per forward, info)."""
    kw.setdefault("max_new_tokens", NEW)
    kw.setdefault("do_sample", False)
    counter = TokenCounter(model)
    try:
        with store.cache(model, mode=mode) as cache:
            info = cache.prepare(ids, mask) if prepare else None
            if seed is not None:
                torch.manual_seed(seed)
            out = model.generate(ids, attention_mask=mask, cache=cache, **kw)
            if check_rows:
                _check_after_generate(store, cache, out, mask)
            counters = dict(cache.counters)
    finally:
        counter.close()
    store.check_invariants()
    if expect_empty:
        assert store.stats().active_blocks == 0, "release must return every block"
    return out, counters, counter.calls, info


def _check_after_generate(store, cache, sequences, mask):
    """The cache holds every token but the last sampled one, for every row."""
    assert cache.get_seq_length() == sequences.shape[1] - 1
    for b in range(cache.batch_size):
        pad = cache.padding(b)
        assert cache.tokens(b) == sequences[b, pad:-1].tolist()
        assert store.manager.num_tokens(cache.seq_ids[b]) == sequences.shape[1] - 1 - pad
    store.check_invariants()


def _store(model, **kw):
    kw.setdefault("num_blocks", 256)
    return PrefixKVStore(model, block_size=BLOCK, hash_seed=0, **kw)


# -- equality with DynamicCache ------------------------------------------------------
@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_batch1_without_prefix(model, paged_model, mode):
    m = _model_for(mode, model, paged_model)
    ids = torch.tensor([SYSTEM + _ids(2, 10)])
    ref = _reference(model, ids)
    out, counters, calls, info = _run(m, _store(m), ids, mode=mode)
    assert torch.equal(out, ref)
    assert info.cached_columns == 0 and calls[0] == (1, ids.shape[1])
    assert counters["hit_tokens"] == 0


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_batch1_cached_prefix_skips_prefill(model, paged_model, mode):
    m = _model_for(mode, model, paged_model)
    store = _store(m)
    first = torch.tensor([SYSTEM + _ids(3, 9)])
    second = torch.tensor([SYSTEM + _ids(4, 14)])
    out1, *_ = _run(m, store, first, mode=mode)
    assert torch.equal(out1, _reference(model, first))
    out2, counters, calls, info = _run(m, store, second, mode=mode)
    assert torch.equal(out2, _reference(model, second))
    hit = (len(SYSTEM) // BLOCK) * BLOCK                      # the shared full blocks
    assert info.hit_tokens == (hit,) and info.cached_columns == hit
    assert calls[0] == (1, second.shape[1] - hit)              # prefill computed only the rest
    assert counters["skipped_tokens"] == hit > 0


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_batch2_left_padding_without_prefix(model, paged_model, mode):
    m = _model_for(mode, model, paged_model)
    ids, mask = _left_pad([_ids(5, 21), _ids(6, 9)])
    ref = _reference(model, ids, mask)
    out, counters, calls, info = _run(m, _store(m), ids, mask, mode=mode)
    assert torch.equal(out, ref)
    assert info.cached_columns == 0 and calls[0] == tuple(ids.shape)


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_batch2_left_padding_cached_prefix(model, paged_model, mode):
    m = _model_for(mode, model, paged_model)
    store = _store(m)
    warm = torch.tensor([SYSTEM + _ids(7, 30)])               # caches the system prompt and more
    _run(m, store, warm, mode=mode)
    # Row 0 is long (no padding), row 1 short (padded): their hits sit at different columns.
    ids, mask = _left_pad([SYSTEM + _ids(8, 17), SYSTEM[:20] + _ids(9, 2)])
    ref = _reference(model, ids, mask)
    out, counters, calls, info = _run(m, store, ids, mask, mode=mode)
    assert torch.equal(out, ref)
    pad1 = int((mask[1] == 0).sum())
    assert info.hit_tokens == (24, 16)
    assert info.cached_columns == min(24, pad1 + 16) > 0
    assert calls[0] == (2, ids.shape[1] - info.cached_columns)
    assert counters["skipped_tokens"] > 0


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_num_return_sequences_forks_with_copy_on_write(model, paged_model, mode):
    """Sampling with top_k=1 is greedy, but goes through num_return_sequences=2: the rows are forked."""
    m = _model_for(mode, model, paged_model)
    store = _store(m)
    _run(m, store, torch.tensor([SYSTEM + _ids(10, 5)]), mode=mode)
    ids, mask = _left_pad([SYSTEM + _ids(11, 6), _ids(12, 13)])
    kw = dict(do_sample=True, top_k=1, num_return_sequences=2)
    ref = _reference(model, ids, mask, **kw)
    cow_before = store.stats().cow_copies
    out, counters, calls, info = _run(m, store, ids, mask, mode=mode, **kw)
    assert out.shape[0] == 4 and torch.equal(out, ref)
    assert counters["forks"] == 2 and info.hit_tokens == (24, 0)
    assert calls[0] == (4, ids.shape[1] - info.cached_columns)
    assert store.stats().cow_copies > cow_before      # the forks diverged on a shared tail


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_num_return_sequences_sampling_diverges(model, paged_model, mode):
    m = _model_for(mode, model, paged_model)
    ids = torch.tensor([_ids(13, 11)])
    kw = dict(do_sample=True, num_return_sequences=2, temperature=1.5)
    torch.manual_seed(123)
    ref = _reference(model, ids, **kw)
    out, counters, *_ = _run(m, _store(m), ids, mode=mode, seed=123, **kw)
    assert torch.equal(out, ref)
    assert not torch.equal(out[0], out[1])            # two different continuations from one prompt


def test_beam_search_reorders_by_forking(model):
    store = _store(model)
    ids = torch.tensor([SYSTEM + _ids(14, 4)])
    kw = dict(num_beams=3, num_return_sequences=2, max_new_tokens=8)
    ref = _reference(model, ids, **kw)
    # The returned sequences are the best finished beams, not the rows the cache holds at the end.
    out, counters, *_ = _run(model, store, ids, check_rows=False, **kw)
    assert torch.equal(out, ref)
    assert counters["forks"] > 2


def test_gather_mode_with_eager_attention(model, eager_model):
    store = _store(eager_model)
    _run(eager_model, store, torch.tensor([SYSTEM]))
    ids, mask = _left_pad([SYSTEM + _ids(15, 3), _ids(16, 8)])
    out, *_ , info = _run(eager_model, store, ids, mask)
    assert torch.equal(out, _reference(eager_model, ids, mask))
    assert info.hit_tokens[0] == 24


# -- the silent-failure cases ---------------------------------------------------------
@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_whole_prompt_cached_still_computes_last_token(model, paged_model, mode):
    m = _model_for(mode, model, paged_model)
    store = _store(m)
    ids = torch.tensor([SYSTEM[:24] + _ids(17, 8)])           # 32 tokens: exactly 4 blocks
    _run(m, store, ids, mode=mode)
    out, counters, calls, info = _run(m, store, ids, mode=mode)
    assert torch.equal(out, _reference(model, ids))
    # Everything is cached, but the last block is recomputed so the model sees the last prompt token.
    assert info.cached_columns == 24 and calls[0] == (1, 8)


def test_suffix_ids_with_covering_mask(model):
    store = _store(model)
    _run(model, store, torch.tensor([SYSTEM]))
    full = torch.tensor([SYSTEM + _ids(18, 6)])
    ref = _reference(model, full)
    with store.cache(model) as cache:
        info = cache.prepare(full)
        suffix = full[:, info.cached_columns:]
        out = model.generate(suffix, attention_mask=torch.ones_like(full), cache=cache, max_new_tokens=NEW,
                             do_sample=False)
    assert torch.equal(out, ref[:, info.cached_columns:])
    store.check_invariants()
    assert store.stats().active_blocks == 0


def test_suffix_ids_without_mask_raise(model):
    store = _store(model)
    _run(model, store, torch.tensor([SYSTEM]))
    full = torch.tensor([SYSTEM + _ids(19, 30)])
    with store.cache(model) as cache:
        info = cache.prepare(full)
        suffix = full[:, info.cached_columns:]
        with pytest.raises(ValueError, match="full prompt"):
            model.generate(suffix, cache=cache, max_new_tokens=4, do_sample=False)
    store.check_invariants()
    assert store.stats().active_blocks == 0


def test_other_prompt_than_prepared_raises(model):
    store = _store(model)
    with store.cache(model) as cache:
        cache.prepare(torch.tensor([_ids(20, 12)]))
        with pytest.raises(ValueError, match="differ from the tokens"):
            model.generate(torch.tensor([_ids(21, 12)]), cache=cache, max_new_tokens=2, do_sample=False)
    assert store.stats().active_blocks == 0


def test_right_padding_is_refused(model):
    store = _store(model)
    ids = torch.tensor([[5, 6, 7, 0], [5, 6, 7, 8]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    with store.cache(model) as cache, pytest.raises(ValueError, match="left padding"):
        cache.prepare(ids, mask)


def test_lazy_admission_without_prepare(model):
    """No prepare(): correct, rows admitted on the first forward, nothing skipped (hits are not rewritten)."""
    store = _store(model)
    _run(model, store, torch.tensor([SYSTEM]))
    ids, mask = _left_pad([SYSTEM + _ids(22, 5), _ids(23, 7)])
    out, counters, calls, _ = _run(model, store, ids, mask, prepare=False)
    assert torch.equal(out, _reference(model, ids, mask))
    assert calls[0] == tuple(ids.shape)
    assert counters["hit_tokens"] == 24
    assert counters["written_tokens"] == counters["computed_tokens"] - 24


def test_continue_with_same_cache_computes_last_token(model):
    """After generate the last sampled token is not stored; passing out.sequences back computes it."""
    store = _store(model)
    ids = torch.tensor([_ids(24, 10)])
    ref = _reference(model, ids, max_new_tokens=2 * NEW)
    with store.cache(model) as cache:
        cache.prepare(ids)
        first = model.generate(ids, cache=cache, max_new_tokens=NEW, do_sample=False)
        assert cache.get_seq_length() == first.shape[1] - 1
        second = model.generate(first, cache=cache, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(second, ref)
        assert cache.tokens(0) == second[0, :-1].tolist()
    store.check_invariants()
    assert store.stats().active_blocks == 0


def test_pool_kv_equals_dynamic_cache_after_generate(model):
    store = _store(model)
    ids, mask = _left_pad([_ids(25, 19), _ids(26, 6)])
    ref = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False,
                         return_dict_in_generate=True, cache=DynamicCache(config=model.config))
    with store.cache(model) as cache:
        cache.prepare(ids, mask)
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=NEW, do_sample=False)
        assert torch.equal(out, ref.sequences)
        for layer in range(model.config.num_hidden_layers):
            dyn = ref.cache.layers[layer]
            for b in range(2):
                pad = cache.padding(b)
                length = out.shape[1] - 1 - pad
                k, v = store.kv.gather(layer, cache.block_table(b), length)
                torch.testing.assert_close(k, dyn.keys[b, :, pad:].transpose(0, 1))
                torch.testing.assert_close(v, dyn.values[b, :, pad:].transpose(0, 1))
    assert store.stats().active_blocks == 0


def test_unwritten_blocks_are_not_hits(model):
    """A cache prepared but never run published its blocks' hashes; another request must not read them."""
    store = _store(model)
    ids = torch.tensor([SYSTEM + _ids(27, 9)])
    idle = store.cache(model)
    assert idle.prepare(ids).hit_tokens == (0,)
    out, counters, calls, info = _run(model, store, ids, expect_empty=False)   # same prompt; `idle` holds it
    assert info.hit_tokens == (0,) and calls[0] == (1, ids.shape[1])
    assert torch.equal(out, _reference(model, ids))
    idle.release()
    # The run above wrote those blocks: now they are hits.
    out, counters, calls, info = _run(model, store, ids)
    assert info.hit_tokens == (32,) and torch.equal(out, _reference(model, ids))


def test_failed_forward_leaves_blocks_untrusted(model):
    store = _store(model)
    ids = torch.tensor([SYSTEM + _ids(28, 9)])
    with store.cache(model) as cache:
        cache.prepare(ids)
        def boom(module, args):
            raise KeyError("boom")

        handle = model.model.layers[1].register_forward_pre_hook(boom)
        try:
            with pytest.raises(KeyError):
                model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
        finally:
            handle.remove()
        with pytest.raises(RuntimeError, match="did not finish"):
            model.generate(ids, cache=cache, max_new_tokens=2, do_sample=False)
    assert store.stats().active_blocks == 0
    out, counters, calls, info = _run(model, store, ids)
    assert info.hit_tokens == (0,) and torch.equal(out, _reference(model, ids))


def test_chunked_prefill_with_in_batch_sharing(model):
    """Two rows share a prefix inside one batch (row 1 hits row 0's still-unwritten blocks) and are padded
    differently; a chunked prefill writes them chunk by chunk."""
    store = _store(model)
    ids, mask = _left_pad([SYSTEM + _ids(29, 3), SYSTEM + _ids(30, 17)])
    kw = dict(prefill_chunk_size=8)
    ref = _reference(model, ids, mask, **kw)
    out, counters, calls, info = _run(model, store, ids, mask, **kw)
    assert torch.equal(out, ref)
    assert info.hit_tokens == (0, 0)
    # Again, now with the prefix cached: the chunks start after the cached columns.
    ids, mask = _left_pad([SYSTEM + _ids(29, 3), SYSTEM + _ids(43, 12)])
    out, counters, calls, info = _run(model, store, ids, mask, **kw)
    assert torch.equal(out, _reference(model, ids, mask, **kw))
    assert info.hit_tokens == (24, 24) and info.cached_columns == 24
    assert calls[0] == (2, 8)


def test_out_of_blocks_admits_nothing(model):
    store = _store(model, num_blocks=6)
    ids, mask = _left_pad([_ids(31, 30), _ids(32, 30)])        # 4 + 4 blocks
    with store.cache(model) as cache:
        with pytest.raises(OutOfBlocks):
            cache.prepare(ids, mask)
        assert cache.batch_size == 0
    store.check_invariants()
    assert store.stats().active_blocks == 0


# -- the registered attention and mask -------------------------------------------------
def test_mask_function_registered_and_covers_cached_prefix(paged_model):
    assert PAGED_ATTENTION in ALL_MASK_ATTENTION_FUNCTIONS._global_mapping
    store = _store(paged_model)
    _run(paged_model, store, torch.tensor([SYSTEM]), mode="paged")
    with store.cache(paged_model, mode="paged") as cache:
        info = cache.prepare(torch.tensor([SYSTEM + _ids(33, 5)]))
        q_len = 32 - info.cached_columns
        embeds = torch.zeros((1, q_len, paged_model.config.hidden_size))
        mask = create_causal_mask(config=paged_model.config, inputs_embeds=embeds, attention_mask=None,
                                  cache=cache)
    assert mask is not None and mask.shape[-1] == info.cached_columns + q_len


def test_paged_mode_needs_paged_attention(model):
    store = _store(model)
    with pytest.raises(ValueError, match=PAGED_ATTENTION):
        PrefixKVCache(store, model, mode="paged")


def test_paged_attention_falls_back_to_sdpa_without_prefixkv_cache(model, paged_model):
    ids, mask = _left_pad([SYSTEM + _ids(34, 4), _ids(35, 9)])
    assert torch.equal(_reference(paged_model, ids, mask), _reference(model, ids, mask))


def test_cache_for_another_model_is_refused(model, eager_model):
    store = _store(model)
    store.cache(model).release()                      # the model's hooks are installed
    with store.cache(eager_model) as cache:
        cache.prepare(torch.tensor([_ids(36, 5)]))
        with pytest.raises(RuntimeError, match="another model"):
            model.generate(torch.tensor([_ids(36, 5)]), cache=cache, max_new_tokens=2, do_sample=False)


def test_past_key_values_keyword_still_works(model):
    store = _store(model)
    _run(model, store, torch.tensor([SYSTEM]))
    ids = torch.tensor([SYSTEM + _ids(37, 5)])
    with store.cache(model) as cache:
        assert cache.prepare(ids).cached_columns == 24
        with pytest.warns(FutureWarning):
            out = model.generate(ids, past_key_values=cache, max_new_tokens=NEW, do_sample=False)
    assert torch.equal(out, _reference(model, ids))


def test_inputs_embeds_alone_are_refused(model):
    store = _store(model)
    embeds = model.get_input_embeddings()(torch.tensor([_ids(38, 6)]))
    with store.cache(model) as cache, pytest.raises(ValueError, match="input_ids"):
        model.generate(inputs_embeds=embeds, cache=cache, max_new_tokens=2, do_sample=False)
    assert store.stats().active_blocks == 0


def test_mask_not_given_to_prepare_is_caught(model):
    """The prompt has left padding but prepare() did not get the mask; generate infers one from pad_token_id."""
    store = _store(model)
    ids, mask = _left_pad([_ids(39, 9), _ids(40, 5)])
    with store.cache(model) as cache:
        cache.prepare(ids)                                  # pads taken for tokens
        with pytest.raises(ValueError, match="give prepare"):
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False)
    assert store.stats().active_blocks == 0


def test_prepare_pads_token_lists(model):
    store = _store(model)
    prompts = [SYSTEM + _ids(41, 4), _ids(42, 11)]
    with store.cache(model) as cache:
        info = cache.prepare(prompts)
        ids, mask = _left_pad(prompts)
        assert torch.equal(info.input_ids, ids) and torch.equal(info.attention_mask, mask)
        out = model.generate(info.input_ids, attention_mask=info.attention_mask, cache=cache, max_new_tokens=NEW,
                             do_sample=False)
    assert torch.equal(out, _reference(model, ids, mask))


def test_out_of_blocks_during_decode_leaves_a_consistent_cache(model):
    store = _store(model, num_blocks=5)                       # 40 slots
    ids = torch.tensor([_ids(44, 30)])                        # 4 blocks, then 10 more tokens fit
    with store.cache(model) as cache:
        cache.prepare(ids)
        with pytest.raises(OutOfBlocks):
            model.generate(ids, cache=cache, max_new_tokens=20, do_sample=False)
        assert cache.get_seq_length() == 40 and len(cache.tokens(0)) == 40
        store.check_invariants()
    store.check_invariants()
    assert store.stats().active_blocks == 0


# -- one store per model -----------------------------------------------------------------
def test_store_refuses_kv_of_another_model(model):
    """Model B of the same shape must not be handed model A's cached KV (wrong tokens, silently)."""
    torch.manual_seed(1)
    other = LlamaForCausalLM(_config()).eval()              # same architecture, other weights
    store = _store(model)
    ids = torch.tensor([SYSTEM + _ids(45, 9)])
    _run(model, store, ids)                                  # model A writes KV into the store
    with pytest.raises(ValueError, match="another model.*one store per model.*store.reset"):
        store.cache(other)
    # A cache built for B before A wrote anything is refused at its first forward.
    fresh = _store(model)
    cache_b = fresh.cache(other)
    _run(model, fresh, ids)
    with cache_b, pytest.raises(ValueError, match="another model"):
        cache_b.prepare(ids)
        other.generate(ids, cache=cache_b, max_new_tokens=2, do_sample=False)
    assert fresh.stats().active_blocks == 0
    # reset() forgets A's blocks and binds the store to B: no hits, B's own tokens.
    store.reset(other)
    out, counters, calls, info = _run(other, store, ids)
    assert info.hit_tokens == (0,) and torch.equal(out, _reference(other, ids))
    with pytest.raises(ValueError, match="another model"):
        store.cache(model)


# -- other architectures --------------------------------------------------------------
def _tiny(arch: str, **overrides):
    import transformers

    torch.manual_seed(0)
    if arch == "opt":
        cfg = transformers.OPTConfig(hidden_size=64, ffn_dim=128, num_hidden_layers=2, num_attention_heads=4,
                                     vocab_size=VOCAB, word_embed_proj_dim=64, pad_token_id=PAD, **overrides)
        return transformers.OPTForCausalLM(cfg).eval()
    if arch == "gpt2":
        cfg = transformers.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, pad_token_id=PAD,
                                      **overrides)
        return transformers.GPT2LMHeadModel(cfg).eval()
    if arch == "falcon":
        cfg = transformers.FalconConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=VOCAB,
                                        initializer_range=0.5, pad_token_id=PAD, **overrides)
        return transformers.FalconForCausalLM(cfg).eval()
    if arch == "mistral":
        cfg = transformers.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, vocab_size=VOCAB,
                                         pad_token_id=PAD, eos_token_id=None, **overrides)
        return transformers.MistralForCausalLM(cfg).eval()
    if arch == "bloom":
        cfg = transformers.BloomConfig(hidden_size=64, n_layer=2, n_head=4, vocab_size=VOCAB, pad_token_id=PAD)
        return transformers.BloomForCausalLM(cfg).eval()
    raise AssertionError(arch)


def _cached_prefix_matches_reference(m, mode="gather"):
    """Warm the store, then a left-padded batch with a cached prefix: equal to DynamicCache, prefill skipped."""
    ref_model = copy.deepcopy(m)
    if mode == "paged":
        m.set_attn_implementation(PAGED_ATTENTION)
    store = _store(m)
    _run(m, store, torch.tensor([SYSTEM + _ids(46, 3)]), mode=mode, pad_token_id=PAD)
    ids, mask = _left_pad([SYSTEM + _ids(47, 5), _ids(48, 7)])
    out, counters, calls, info = _run(m, store, ids, mask, mode=mode, pad_token_id=PAD)
    assert torch.equal(out, _reference(ref_model, ids, mask, pad_token_id=PAD))
    assert info.hit_tokens == (24, 0) and calls[0] == (2, ids.shape[1] - info.cached_columns)


@pytest.mark.parametrize("arch,mode", [("opt", "gather"), ("opt", "paged"), ("gpt2", "gather"), ("gpt2", "paged")])
def test_models_whose_lm_skips_the_base_model_forward(arch, mode):
    """OPTForCausalLM calls self.model.decoder, never self.model: the cache follows the top-level model."""
    _cached_prefix_matches_reference(_tiny(arch), mode)


@pytest.mark.parametrize("overrides,kv_heads", [(dict(multi_query=True), 1), (dict(multi_query=False), 4),
                                                (dict(new_decoder_architecture=True, num_kv_heads=2), 4)])
def test_falcon_kv_heads_and_generation(overrides, kv_heads):
    """Falcon hands the cache 1 K/V head (multi_query) or one per query head (new_decoder_architecture
    broadcasts its grouped K/V): the pool is sized for what update() receives."""
    from prefixkv.integrations.hf import model_kv_spec

    m = _tiny("falcon", **overrides)
    assert model_kv_spec(m).kv_heads == kv_heads
    _cached_prefix_matches_reference(m)
    # Falcon computes attention inline: the paged attention function would never run.
    with pytest.raises(ValueError, match="never calls the registered attention function.*mode='gather'"):
        PrefixKVCache(_store(m), m, mode="paged")


@pytest.mark.parametrize("overrides", [dict(), dict(alibi=True)])
def test_alibi_models_are_refused_up_front(overrides):
    m = _tiny("bloom") if not overrides else _tiny("falcon", **overrides)
    with pytest.raises(ValueError, match="ALiBi.*not support"):
        _store(m)


def test_reusing_a_cache_for_a_new_prompt_without_prepare_says_so(model):
    store = _store(model)
    with store.cache(model) as cache:
        model.generate(torch.tensor([SYSTEM]), cache=cache, max_new_tokens=4, do_sample=False)
        with pytest.raises(ValueError, match=r"still holds 1 row.*previous call.*call cache\.prepare"):
            model.generate(torch.tensor([_ids(49, 3)]), cache=cache, max_new_tokens=4, do_sample=False)
    assert store.stats().active_blocks == 0


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_sliding_window_longer_than_every_sequence(mode):
    """Mistral's default config (sliding_window=4096): while no sequence outgrows the window it masks
    nothing, and the cache is exact."""
    _cached_prefix_matches_reference(_tiny("mistral"), mode)


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_sequence_outgrowing_the_sliding_window_is_refused(mode):
    m = _tiny("mistral", sliding_window=12)
    if mode == "paged":
        m.set_attn_implementation(PAGED_ATTENTION)
    store = _store(m)
    with store.cache(m, mode=mode) as cache:
        with pytest.raises(NotImplementedError, match="13 tokens outgrows the model's sliding window"):
            cache.prepare(torch.tensor([_ids(50, 13)]))
        ids = torch.tensor([_ids(51, 8)])
        cache.prepare(ids)
        with pytest.raises(NotImplementedError, match="sliding window"):     # 8 + 5 fed tokens > 12
            m.generate(ids, cache=cache, max_new_tokens=6, do_sample=False)
    store.check_invariants()
    assert store.stats().active_blocks == 0


def test_multimodal_models_are_refused():
    from transformers import LlamaConfig

    from prefixkv.integrations.hf import model_kv_spec

    config = LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                         intermediate_size=128, vocab_size=1000)
    assert model_kv_spec(config).kv_heads == 2
    config.image_token_id = 999
    with pytest.raises(ValueError, match="multimodal models are not supported \\(image_token_id"):
        model_kv_spec(config)


# -- what needs prepare(), what is refused, what is not: padding, assisted decoding, forked rows ---------

def test_lazy_admission_with_a_chunk_that_is_all_padding_for_a_row_says_to_prepare(model):
    """No prepare() and prefill_chunk_size smaller than a row's left padding: the first chunk holds
    no token of that row. The cache refuses, naming the cause and the remedy, instead of claiming
    the row 'is all padding' (it is not), and holds nothing afterwards."""
    store = _store(model)
    ids, mask = _left_pad([_ids(60, 20), _ids(61, 5)])          # row 1: 15 padding columns
    with store.cache(model) as cache:
        with pytest.raises(ValueError, match=r"row 1 has no token in the first forward.*prefill_chunk_size.*"
                                             r"cache\.prepare\(input_ids, attention_mask\)"):
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False,
                           prefill_chunk_size=8)
        assert cache.batch_size == 0
        # The remedy works: prepared, the same call equals DynamicCache.
        cache.prepare(ids, mask)
        out = model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=3, do_sample=False,
                             prefill_chunk_size=8)
    assert torch.equal(out, _reference(model, ids, mask, max_new_tokens=3, prefill_chunk_size=8))
    store.check_invariants()
    assert store.stats().active_blocks == 0


@pytest.mark.parametrize("with_mask", [False, True])
def test_assisted_decoding_with_a_cached_prefix_is_refused_by_name(model, with_mask):
    """Prompt lookup (and assisted) decoding feeds the whole prompt from position 0 whatever the
    cache holds, and needs a croppable cache. With a cached prefix the forward used to be refused
    as 'position ids disagree ... pass the full prompt' (or an attention-mask shape complaint),
    though the user had passed the full prompt; now the refusal names assisted decoding."""
    store = _store(model)
    ids = torch.tensor([SYSTEM + _ids(62, 10)])
    mask = torch.ones_like(ids) if with_mask else None
    with store.cache(model) as cache:                      # cache the system prompt's blocks
        cache.prepare(ids, mask)
        model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=2, do_sample=False)
    with store.cache(model) as cache:
        assert cache.prepare(ids, mask).cached_columns > 0
        with pytest.raises(ValueError, match=r"assisted decoding.*prompt_lookup_num_tokens.*does not support"):
            model.generate(ids, attention_mask=mask, cache=cache, max_new_tokens=4, do_sample=False,
                           prompt_lookup_num_tokens=3)
    store.check_invariants()
    assert store.stats().active_blocks == 0


def test_a_prepare_that_does_not_fit_evicts_no_cached_prefix(model):
    """prepare() is all or nothing: a batch the pool cannot hold must leave the store as it was.
    It used to admit the first rows (evicting cached blocks to make room) before the last one
    failed, so a refused batch cost later prompts their prefix hits."""
    from prefixkv import OutOfBlocks

    store = _store(model, num_blocks=8)                          # 64 slots of 8 tokens
    warm = torch.tensor([SYSTEM[:24] + _ids(63, 3)])             # 3 full blocks stay cached
    with store.cache(model) as cache:
        cache.prepare(warm)
        model.generate(warm, cache=cache, max_new_tokens=2, do_sample=False)
    before = store.stats()
    assert before.evictable_blocks == 3
    # Row 0 alone needs 7 blocks (taking 2 evictable ones), row 1 needs 4 more: 11 > 8.
    ids, mask = _left_pad([_ids(64, 56), _ids(65, 30)])
    with store.cache(model) as cache:
        with pytest.raises(OutOfBlocks):
            cache.prepare(ids, mask)
        assert cache.batch_size == 0
    store.check_invariants()
    after = store.stats()
    assert (after.active_blocks, after.evictable_blocks, after.evictions) == \
        (0, before.evictable_blocks, before.evictions)
    with store.cache(model) as cache:
        assert cache.prepare(warm).hit_tokens == (24,)


def test_continuing_forked_rows_is_not_refused_for_copy_on_write_it_will_not_do(model):
    """Forked rows (num_return_sequences) share a partly filled tail. Continuing them with several
    new tokens each copies the tail for every holder but the last, which then writes in place; the
    capacity check counted a copy for every row and refused an append that fits."""
    from prefixkv.integrations.hf import PrefixKVStore

    store = PrefixKVStore(model, num_blocks=3, block_size=8, hash_seed=0)
    ids = torch.tensor([_ids(70, 9)])                          # 2 blocks, the tail holds 1 token
    kw = dict(do_sample=True, top_k=1, num_return_sequences=2)  # greedy, through forked rows
    with store.cache(model) as cache:
        cache.prepare(ids)
        first = model.generate(ids, cache=cache, max_new_tokens=1, **kw)
        assert cache.batch_size == 2 and store.manager.num_free_blocks == 1
        more = torch.cat([first, torch.tensor([_ids(71, 3)] * 2)], 1)   # 4 new tokens per row
        out = model.generate(more, cache=cache, max_new_tokens=1, do_sample=False)
        assert torch.equal(out, _reference(model, more, max_new_tokens=1))
        assert store.stats().cow_copies == 1
        store.check_invariants()
    assert store.stats().active_blocks == 0
