"""What the flat hash index and ``FlatBlockPool`` (``prefixkv.flat``) refuse, and that a refusal
changes nothing; the dict pool answers the same.

* The kernels import, and the default manager (index ``"auto"``) builds, where numba's on-disk
  cache (``cache=True``) has nowhere to write.
* Hashes whose widths only add up (24 + 8 bytes for a 16-byte index) are refused, not entered as
  keys that are neither.
* ``publish_many`` pairs blocks and hashes as ``zip`` pairs them, as in the dict pool, however many
  hashes come (the compiled insertion never reads past the blocks array).
* ``cache_many`` (host demotions) and ``publish_many``'s per-block path check every hash before
  claiming a block or publishing one.
* ``publish`` of a block past the index's rows, alone or in a batch, raises IndexError before it
  writes anything.
* A bytes-like key that ``bytes.join`` refuses is a miss, never a StopIteration.
* ``admit`` of another manager's hash-only prompt with integer ids changes nothing; pools past
  32-bit slots are refused flat, and ``"auto"`` falls back to the dict index.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# -- numba's cache with no writable place ------------------------------------------------------------


def test_kernels_import_without_a_writable_numba_cache():
    """A read-only install with no writable user cache dir: numba finds no cache locator for
    ``cache=True`` functions and raises at decoration time. The kernels must still import (compiled
    per process) and the default manager must build and work."""
    code = """
import numba.core.caching as caching
caching.CacheImpl._locator_classes = []          # no place to keep a cache (read-only install, no HOME)
import prefixkv.flat as flat
assert flat.available()
from prefixkv import KVCacheManager
m = KVCacheManager(num_blocks=8, block_size=4, hash_seed=0)
assert m.admit("a", list(range(9))) == 0
m.free("a")
assert m.admit("b", list(range(9))) == 8
print(type(m.pool).__name__)
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["FlatBlockPool"]


# -- hashes of other widths whose total is right --------------------------------------------------------

import hashlib  # noqa: E402

from prefixkv.flat.index import FlatIndex  # noqa: E402
from prefixkv.flat.pool import FlatBlockPool  # noqa: E402
from prefixkv.policies import make_policy  # noqa: E402
from prefixkv.pool import BlockPool  # noqa: E402


def _digest(i: int, size: int = 16) -> bytes:
    return hashlib.blake2b(b"flat-review-%d" % i, digest_size=size).digest()


def _pool(cls=FlatBlockPool, num_blocks=16, policy="lru", **kwargs):
    return cls(num_blocks, 4, make_policy(policy), **kwargs)


def test_publish_of_hashes_whose_widths_only_add_up_raises():
    """A 24-byte and an 8-byte hash make 32 bytes, two 16-byte rows: ``column`` told widths by the
    total only, so publishing them entered two keys that are neither (silently: each hash then
    misses, and the table holds digests nobody published). A publish must refuse them (ValueError),
    changing nothing, as it refuses one hash of another width."""
    pool = _pool()
    blocks = pool.allocate(2, 4)
    before = pool.snapshot()
    odd = [_digest(1, 24), _digest(2, 8)]
    with pytest.raises(ValueError):
        pool.publish_many(blocks, odd, [None, odd[0]], [0, 1])
    assert pool.snapshot() == before
    assert pool.num_cached == 0 and list(pool.cached_map) == []
    pool.check([blocks])


def test_index_column_exact_widths():
    index = FlatIndex(16)
    with pytest.raises(ValueError):
        index.column([_digest(1, 24), _digest(2, 8)], exact=True)
    assert index.column([_digest(1), _digest(2)], exact=True).shape == (2, 2)
    assert index.column([], exact=True).shape == (0, 2)


# -- a batch publish with more hashes than blocks ------------------------------------------------------


@pytest.mark.parametrize("cls", [BlockPool, FlatBlockPool])
def test_publish_many_with_more_hashes_than_blocks(cls):
    """``publish_many`` pairs blocks and hashes as ``zip`` does (the dict pool's ``setdefault``
    map): extra hashes are not published. The compiled insertion read ``blocks[i]`` for every hash,
    past the end of the blocks array (no bounds checks in numba): a wild block id, whose key row
    and flag it wrote (a segfault, or a corrupted heap)."""
    pool = _pool(cls, 64)
    blocks = pool.allocate(2, 4)
    hashes = [_digest(i) for i in range(6)]
    pool.publish_many(blocks[:1], hashes, [None] * 6, range(6))
    assert pool.num_cached == 1
    assert [pool.lookup(h) for h in hashes] == [blocks[0]] + [None] * 5
    pool.check([blocks])
    pool.publish_run(blocks[1:], hashes[1:], hashes[0], 1)
    assert [pool.lookup(h) for h in hashes] == blocks + [None] * 4
    pool.check([blocks])


def test_index_setdefault_many_pairs_as_zip():
    index = FlatIndex(16)
    index.ensure_blocks(4)
    keys = index.column([_digest(i) for i in range(3)])
    assert index.setdefault_many(keys, [2]) == [2]
    assert len(index) == 1 and index.get(_digest(0)) == 2 and index.get(_digest(1)) is None
    assert index.setdefault_many(keys[:1], [0, 1, 3]) == [2]
    assert len(index) == 1


# -- demotions into a flat pool with a hash it cannot key ------------------------------------------------


@pytest.mark.parametrize("record_events", [False, True])
@pytest.mark.parametrize("bad", [b"short", 12345, _digest(9, 8)])
def test_cache_many_with_a_bad_hash_changes_nothing(bad, record_events):
    """``cache_many`` raises only OutOfBlocks, changing nothing; a flat pool also refuses a hash
    that is not one of its digests, but it found out only after claiming the blocks (evicting
    victims for them): they were neither free, evictable nor held (``check`` failed), and
    the victims' cached content was gone."""
    from prefixkv.tiers.host import HostTier

    host = HostTier(8, 4, digest_size=16, record_events=record_events)
    host.store_many(list(range(8)), [_digest(i) for i in range(8)])     # full: the next store evicts
    host.pool.drain_events()
    before = host.pool.snapshot(), host.pool.num_free, host.pool.evictions
    with pytest.raises((TypeError, ValueError)):
        host.store_many([100, 101], [_digest(100), bad])
    assert (host.pool.snapshot(), host.pool.num_free, host.pool.evictions) == before
    host.pool.check([])
    assert host.store_many([100], [_digest(100)]) == [(100, 0)]
    host.pool.check([])


@pytest.mark.parametrize("record_events", [False, True])
def test_publish_many_with_a_bad_hash_changes_nothing(record_events):
    """The batch path checks every hash before it enters any; the per-block path (events on, or a
    policy told ``on_cached`` per block) entered the hashes before the bad one and then raised."""
    pool = _pool(record_events=record_events)
    blocks = pool.allocate(3, 4)
    before = pool.snapshot()
    with pytest.raises(ValueError):
        pool.publish_many(blocks, [_digest(0), _digest(1), b"short"], [None, _digest(0), _digest(1)], [0, 1, 2])
    assert pool.snapshot() == before
    pool.check([blocks])


# -- a block id past the index's rows ---------------------------------------------------------------------


@pytest.mark.parametrize("block", [16, 1000, -1])
def test_publish_of_a_block_past_the_rows_raises(block):
    """``publish`` of a block the pool never handed out (past ``len(block_hash)``, or negative):
    the dict pool raises IndexError from ``block_hash[block] = h``. The flat index wrote the key row
    and flag of that block in compiled code with no bounds check (memory past the arrays), and a
    negative block made a slot entry that reads back as block -1. It must raise IndexError before
    anything changes."""
    pool = _pool(num_blocks=16)
    blocks = pool.allocate(16, 4)
    before = pool.snapshot()
    with pytest.raises(IndexError):
        pool.publish(block, _digest(0), None, 0)
    assert pool.snapshot() == before and pool.lookup(_digest(0)) is None
    index = pool.index
    with pytest.raises(IndexError):
        index.assign(_digest(1), block)
    assert len(index) == 0 and index.get(_digest(1)) is None
    pool.check([blocks])


# -- a bytes-like key that bytes.join refuses ---------------------------------------------------------------


def test_a_key_join_refuses_is_a_miss_not_stopiteration():
    """A strided memoryview is bytes-like (hashable: the dict pool answers a miss) but ``bytes.join``
    refuses it; ``column`` looked for the offending non-bytes item to name it, found none, and let
    StopIteration out of every lookup (``lookup``, ``in``, ``holds_none``, ``leading_hits``)."""
    strided = memoryview(_digest(0, 32))[::2]
    pool = _pool()
    assert pool.lookup(strided) is None
    assert strided not in pool.cached_map
    assert pool.holds_none([strided])
    assert pool.leading_hits([strided], 0, 1) == []
    with pytest.raises(TypeError):
        pool.index.column([strided])


# -- outside prefixkv/flat: a foreign prompt's hashes reach a flat pool unchecked --------------------------


def test_admit_of_a_foreign_prompt_with_non_digest_hashes_changes_nothing():
    from prefixkv import KVCacheManager
    from prefixkv.errors import HashMismatch

    other = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0, index="dict")
    mgr = KVCacheManager(num_blocks=16, block_size=4, hash_seed=0, index="flat")
    prompt = other.prompt_from_hashes([1, 2, 3], 12)
    free = mgr.pool.num_free
    with pytest.raises((HashMismatch, TypeError)):
        mgr.admit("a", prompt)
    assert mgr.pool.num_free == free
    mgr.check_invariants()


def test_pools_past_32_bit_slots_are_refused_flat_and_auto_falls_back_to_the_dict():
    from prefixkv import BlockPool, KVCacheManager
    from prefixkv.flat.pool import MAX_BLOCKS, FlatBlockPool
    from prefixkv.policies import make_policy

    with pytest.raises(ValueError, match="32-bit"):
        FlatBlockPool(MAX_BLOCKS + 1, 16, make_policy("lru"))
    assert type(KVCacheManager(MAX_BLOCKS + 1, 16).pool) is BlockPool       # empty: costs nothing
    assert type(KVCacheManager(MAX_BLOCKS, 16).pool) is FlatBlockPool


# -- a batch publish of a block past the index's rows -------------------------------------------------------

_PUBLISH_PAST_ROWS = r"""
import hashlib, sys
from prefixkv.flat.lru import CompiledLRU
from prefixkv.flat.pool import FlatBlockPool
n = int(sys.argv[1])
pool = FlatBlockPool(2000, 4, CompiledLRU(), digest_size=16)
blocks = pool.allocate(40, 4)                       # per-block rows for blocks 0..1023
run = blocks[:n - 1] + [1500]                       # 1500: never handed out, past the rows
hashes = [hashlib.blake2b(b"past-%d" % i, digest_size=16).digest() for i in range(n)]
try:
    pool.publish_run(run, hashes, None, 0)
    print("published", pool.lookup(hashes[-1]))
except IndexError as exc:
    print("IndexError")
pool.allocate(1900)                                  # touch the heap again
print("alive")
"""


@pytest.mark.parametrize("n", [4, 20], ids=["list-path", "compiled-path"])
def test_a_batch_publish_of_a_block_past_the_rows_raises(n):
    """``publish`` of a block past the rows raises IndexError (above), and so must the batch
    publish, as the dict pool's does (``block_hash[1500] = h`` on a 1,024-long list). An insertion
    kernel that wrote the key row and flag of block 1500 past the ends of its arrays (no bounds
    checks in numba) would report success and corrupt the heap (glibc aborts the process later:
    "free(): invalid next size"). Run in a subprocess for that reason."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, PYTHONPATH=str(root) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    done = subprocess.run([sys.executable, "-c", _PUBLISH_PAST_ROWS, str(n)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-500:]
    assert done.stdout.split() == ["IndexError", "alive"]
