"""Defects found in review of the Hugging Face cache integration (each test failed before its fix).

Same tiny random-weight Llama as tests/test_hf.py; outputs compared with transformers' DynamicCache."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the HF integration needs torch")
pytest.importorskip("transformers", reason="transformers is not installed (pip install 'prefixkv[hf]')")
try:
    import prefixkv.integrations.hf  # noqa: F401
except ImportError as exc:  # an unsupported transformers version
    pytest.skip(str(exc), allow_module_level=True)

from transformers import LlamaForCausalLM  # noqa: E402

from test_hf import SYSTEM, _config, _ids, _left_pad, _reference, _store  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return LlamaForCausalLM(_config()).eval()


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
