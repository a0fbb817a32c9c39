"""The compiled LRU, the flat pool's batches and the host path against the dict pool: a prompt keyed
by a flat manager is admitted by a dict manager with a host tier as its own; a pool grows after a
failed long release; the transfers (``BlockCopies``) combine as the lists of pairs they replaced and
serialise through ``tolist``; a host take with misaligned tags does not corrupt the index.

The reference is always the dict pool with ``LRUPolicy`` (``index="dict"``) driven by the same calls.
"""

from __future__ import annotations

import hashlib

import pytest

pytest.importorskip("numba")

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.flat.lru import CompiledLRU  # noqa: E402
from prefixkv.flat.pool import FlatBlockPool  # noqa: E402
from prefixkv.policies.lru import LRUPolicy  # noqa: E402
from prefixkv.pool import BlockPool  # noqa: E402


def _digest(i: int) -> bytes:
    return hashlib.blake2b(b"review2-%d" % i, digest_size=16).digest()


def _pools(num_blocks: int, block_size: int = 4):
    """(dict pool with LRUPolicy, flat pool with CompiledLRU): what index='dict' / 'auto' build."""
    return (BlockPool(num_blocks, block_size, LRUPolicy()),
            FlatBlockPool(num_blocks, block_size, CompiledLRU(), digest_size=16))


def _outcome(fn):
    try:
        return "ok", fn()
    except Exception as exc:       # noqa: BLE001 - the kind of failure is what is compared
        return type(exc).__name__


# -- a prompt prepared by a flat manager, admitted by a dict manager with a host tier ------------------


def _dict_manager_with_prefix_on_both_tiers(tokens):
    """A dict-index manager (4 device blocks, a host tier) holding ``tokens``' first block on the
    device and its next two blocks on the host (evicted there by a second prompt sharing block 0)."""
    mgr = KVCacheManager(4, 4, hash_seed=0, index="dict", num_host_blocks=16, host_cache=True)
    mgr.admit("a", tokens)
    mgr.free("a")
    mgr.admit("b", tokens[:4] + list(range(100, 112)))
    mgr.free("b")
    mgr.take_demotions()
    mgr.take_loads()
    return mgr


def test_dict_host_manager_admits_a_prompt_another_flat_manager_keyed():
    """A Prompt keeps the digest rows the first (flat) manager joined for it (``Prompt.keys``), and any
    manager with the same hasher settings may admit it. A dict-index manager with a host tier then
    saw HashRows with tags and handed the tags to its host pool's ``take_cached`` (a ``BlockPool``,
    which takes none): TypeError, raised after ``acquire_hits`` pinned the device hits, so the failed
    admission left a device block held by no sequence. It must admit as for its own prompt."""
    tokens = list(range(12)) + [5]
    flat = KVCacheManager(64, 4, hash_seed=0, index="flat")
    prompt = flat.prompt(tokens)
    flat.match(prompt)                             # the flat manager keys the prompt (Prompt.keys)
    twin, mgr = _dict_manager_with_prefix_on_both_tiers(tokens), _dict_manager_with_prefix_on_both_tiers(tokens)
    expect = twin.admit("c", twin.prompt(tokens))
    assert expect == 12 and twin.stats().loads == 2
    got = _outcome(lambda: mgr.admit("c", prompt))
    mgr.check_invariants()
    assert got == ("ok", expect)
    assert mgr.snapshot() == twin.snapshot()


# -- a pool that cannot grow after a failed batch ----------------------------------------------------------


def test_a_failed_long_release_does_not_stop_the_pool_growing():
    """A release of 16+ blocks (the compiled path) with a block out of range: the kernel refuses it and
    the base class raises IndexError, as the dict pool does, changing nothing. But the flat pool's
    frame still holds ``np.frombuffer`` views of ``ref_count`` / the LRU's ``array('q')`` storage, and
    the traceback keeps that frame (in the ``except`` block, in a saved exception, a logger's
    record, a future): an ``array`` exporting its buffer cannot be resized, so the next allocation
    that grows the per-block arrays raised BufferError, and it raised after ``_take_fresh`` had
    moved ``_fresh`` on: blocks counted as handed out with no metadata, the pool broken for good."""
    results = []
    for pool in _pools(5000):
        blocks = pool.allocate(40, 4)
        try:
            pool.release(blocks[:20] + [1200])     # 1200: never handed out (metadata covers 1,024)
        except IndexError:
            grown = _outcome(lambda pool=pool: len(pool.allocate(2000)))
        pool.check([blocks, *([list(range(40, 2040))] if grown[0] == "ok" else [])])
        results.append((grown, pool.num_free, pool._fresh))
    assert results[1] == results[0]


# -- BlockCopies as the list of pairs it replaced ---------------------------------------------------------------


def _demotions_and_loads(index):
    """A manager, and the demotions and loads of a prompt evicted to the host tier and loaded back."""
    mgr = KVCacheManager(4, 4, hash_seed=0, index=index, num_host_blocks=8, host_cache=True)
    mgr.admit("a", list(range(16)), compute_last_token=False)
    mgr.free("a")
    mgr.admit("b", list(range(100, 116)), compute_last_token=False)     # evicts a's blocks to the host
    mgr.free("b")
    demotions = mgr.take_demotions()
    mgr.admit("a2", list(range(16)), compute_last_token=False)         # loads them back
    return mgr, demotions, mgr.take_loads()


@pytest.mark.parametrize("index", ["flat", "dict"])
def test_transfers_combine_as_the_lists_they_were(index):
    """``take_demotions()`` / ``take_loads()`` returned ``list[tuple[int, int]]`` and now return
    ``BlockCopies`` (whatever the index), documented to read as that list. A caller that runs a step's
    moves as one list (``mgr.take_demotions() + mgr.take_loads()``), accumulates them (``+=``) or
    sends them to a worker as JSON got TypeError (``+`` works as on lists; JSON below)."""
    mgr, demotions, loads = _demotions_and_loads(index)
    pairs = [*map(tuple, demotions)], [*map(tuple, loads)]
    assert len(pairs[0]) == 4 and len(pairs[1]) == 4
    assert _outcome(lambda: list(demotions + loads)) == ("ok", pairs[0] + pairs[1])
    assert _outcome(lambda: list([] + demotions)) == ("ok", pairs[0])
    moves = mgr.take_demotions()                    # (b's blocks, evicted by a2's admission)
    expect = [*map(tuple, moves)] + pairs[1]
    moves += loads
    assert list(moves) == expect


@pytest.mark.parametrize("index", ["flat", "dict"])
def test_transfers_serialise_through_tolist(index):
    """``BlockCopies`` is a sequence of pairs kept as two arrays, not a list (README: host tier), so
    ``json.dumps`` refuses it as it refuses any non-list sequence, with a TypeError before writing
    anything; ``tolist()`` gives the list of pairs a caller ships as JSON (by design: building a tuple
    per pair is what the host path no longer pays)."""
    import json

    _, demotions, loads = _demotions_and_loads(index)
    with pytest.raises(TypeError):
        json.dumps(loads)
    assert json.loads(json.dumps(demotions.tolist())) == [list(p) for p in demotions]
    assert json.loads(json.dumps({"loads": loads.tolist()})) == {"loads": [list(p) for p in loads]}


# -- a host take with tags that are not its blocks' ------------------------------------------------------------


def test_a_take_with_misaligned_tags_does_not_corrupt_the_index():
    """``take_cached(blocks, tags=...)`` (``HostTier.pin``) takes the tags of the blocks' keys so the
    index need not mix them again. Tags in another order than the blocks (or of other keys) are a
    caller's mistake, but the kernel did not notice one: ``_slot_of_block`` found no slot and the
    deletion ran at slot -1 (the last one, wrapped), so the taken blocks' keys stayed in the table
    (lookups return those now active, uncached blocks: a later prefix hit on them) while some other
    entry vanished; ``count`` and ``check`` disagree. It must raise changing nothing, or fall back
    to the keys' own tags (the same state as a take without tags)."""
    from prefixkv.flat.index import HashRows

    hashes = [_digest(i) for i in range(40)]

    def evictable_pool():
        pool = FlatBlockPool(64, 4, CompiledLRU(), digest_size=16)
        blocks = pool.allocate(40, 4)
        pool.publish_run(blocks, hashes, None, 0)
        pool.release(blocks[::-1])
        return pool

    ref, pool = evictable_pool(), evictable_pool()
    taken = [pool.lookup(h) for h in hashes[:20]]
    ref.take_cached(list(taken), distinct=True)
    tags = HashRows.tagged(pool.index.column(hashes[:20])).tags[::-1].copy()      # reversed: misaligned
    before = pool.snapshot()
    got = _outcome(lambda: pool.take_cached(list(taken), distinct=True, tags=tags))
    if got == "ok" or got[0] == "ok":
        assert pool.snapshot() == ref.snapshot()
        pool.check([taken])
    else:
        assert pool.snapshot() == before
        pool.check([])
    assert len(pool.index) == pool.num_cached == len(set(pool.index.blocks()))
