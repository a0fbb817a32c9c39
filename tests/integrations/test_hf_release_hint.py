"""A Hugging Face loop that drops caches unreleased runs the store's pool dry; the ``OutOfBlocks``
it ends in now says why (other caches' rows still hold blocks) and what to do (``release()``)."""

from __future__ import annotations

import pytest

from prefixkv.errors import OutOfBlocks

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_out_of_blocks_from_unreleased_caches_names_release(tiny_hf_models):
    from prefixkv.integrations.hf import PrefixKVStore

    model = tiny_hf_models["gather"]
    store = PrefixKVStore(model, num_blocks=12, block_size=4)
    kept = []
    with pytest.raises(OutOfBlocks) as info:
        for i in range(20):               # bounded: 12 blocks hold 4 prompts of 3 blocks
            cache = store.cache(model)
            cache.prepare([[10 + i, 20 + i, 30 + i, 40 + i, 50, 60, 70, 80, 90, 91, 92]])
            kept.append(cache)            # dropped unreleased, as the loop in the issue did
    message = str(info.value)
    assert "row(s) of other caches on this store still hold blocks" in message, message
    assert "cache.release()" in message and "`with` block" in message, message
    for cache in kept:
        cache.release()
    # released, the same admission fits and the message's own numbers were the pool's
    with store.cache(model) as cache:
        cache.prepare([[1, 2, 3, 4, 5, 6, 7, 8, 9]])
    store.manager.check_invariants()


def test_a_lone_cache_too_large_for_the_pool_gets_no_release_hint(tiny_hf_models):
    from prefixkv.integrations.hf import PrefixKVStore

    model = tiny_hf_models["gather"]
    store = PrefixKVStore(model, num_blocks=4, block_size=4)
    with store.cache(model) as cache:
        with pytest.raises(OutOfBlocks) as info:
            cache.prepare([[1, 2, 3, 4, 5, 6, 7, 8, 9], [11, 12, 13, 14, 15, 16, 17, 18, 19]])
    assert "release" not in str(info.value)
