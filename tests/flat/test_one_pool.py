"""One BlockPool: the flat pool is BlockPool with a FlatIndex component (and fused batches with
CompiledLRU), not a second pool that mirrors the first's methods."""

import inspect

import pytest

pytest.importorskip("numba")

from prefixkv.flat.fused import FusedLRU  # noqa: E402
from prefixkv.flat.index import FlatIndex  # noqa: E402
from prefixkv.flat.lru import CompiledLRU  # noqa: E402
from prefixkv.flat.pool import FlatBlockPool  # noqa: E402
from prefixkv.index import DictIndex  # noqa: E402
from prefixkv.policies import LRUPolicy  # noqa: E402
from prefixkv.pool import BlockPool  # noqa: E402

# The calls BlockPool makes of its index (prefixkv/index.py's docstring lists them).
PROTOCOL = ["get", "held", "count_held", "count_unheld", "held_flags", "primaries", "hashes_of", "run", "run_array",
            "holds_none", "probe_keys", "run_outside", "key_tags", "prepare", "check_keys", "enter_many",
            "insert", "remove", "take_blocks", "take_blocks_checked", "ensure_blocks", "clear",
            "block_storage", "__len__"]


def test_the_flat_pool_overrides_nothing_but_its_construction():
    assert [name for name in vars(FlatBlockPool) if callable(vars(FlatBlockPool)[name])] == ["__init__"]
    assert FlatBlockPool.__mro__[1] is BlockPool


@pytest.mark.parametrize("index", [DictIndex(), FlatIndex(16)], ids=["dict", "flat"])
def test_both_indexes_implement_the_calls_a_pool_makes(index):
    missing = [name for name in PROTOCOL if not callable(getattr(index, name, None))]
    assert missing == []
    assert hasattr(index, "hashes") and hasattr(index, "mapping") and hasattr(index, "digest_size")


def test_both_indexes_take_the_calls_with_the_same_parameters():
    for name in PROTOCOL:
        if name in ("get", "__len__"):
            continue
        a, b = inspect.signature(getattr(DictIndex, name)), inspect.signature(getattr(FlatIndex, name))
        assert list(a.parameters) == list(b.parameters), name


def test_fused_batches_come_with_the_compiled_lru_only():
    assert isinstance(FlatBlockPool(64, 4, CompiledLRU())._fused, FusedLRU)
    assert FlatBlockPool(64, 4, LRUPolicy())._fused is None
    assert BlockPool(64, 4, LRUPolicy())._fused is None


def test_a_hash_read_back_through_the_views_is_the_one_stored():
    pool = FlatBlockPool(64, 4, CompiledLRU())
    blocks = pool.allocate(3, 4)
    hashes = [bytes([i]) * 16 for i in (1, 2, 3)]
    pool.publish_many(blocks, hashes, [None] * 3, [0, 1, 2])
    assert [pool.block_hash[b] for b in blocks] == hashes and pool.block_hash[-1] is None
    assert dict(pool.cached_map) == dict(zip(hashes, blocks))
    with pytest.raises(TypeError):
        pool.cached_map[hashes[0]] = 5          # read-only: only the pool writes its index
    with pytest.raises(TypeError):
        pool.block_hash[blocks[0]] = None
