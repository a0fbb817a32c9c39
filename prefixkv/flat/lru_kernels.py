"""Compiled loops (numba) over an LRU order kept as a doubly linked list in two arrays, and the
pool's batch operations that move blocks in and out of it together with their refcounts.

``prev[b]`` / ``nxt[b]`` link the evictable blocks from the least recently released (``ends[0]``)
to the most recent (``ends[1]``); ``ends[2]`` counts them. ``prev[b] == OUT`` marks a block that
is not in the order (active, uncached or never handed out); the ends of the list link to ``NONE``.
Every operation is O(1) per block and touches no Python object: a batch is one call.

The pool operations check every block first and change nothing when one fails the check (they
return False and the caller takes its general path, which reports the problem): refcounts are
``int64`` views of the pool's ``array('q')``, ``has`` is the flat index's flag per block.
"""

from __future__ import annotations

from .kernels import _jit, insert_absent, remove_blocks

OUT = -2
NONE = -1


@_jit(nogil=True, inline="always")
def _append(prev, nxt, ends, b):
    tail = ends[1]
    prev[b] = tail
    nxt[b] = NONE
    if tail == NONE:
        ends[0] = b
    else:
        nxt[tail] = b
    ends[1] = b
    ends[2] += 1


@_jit(nogil=True, inline="always")
def _unlink(prev, nxt, ends, b):
    p = prev[b]
    n = nxt[b]
    if p == NONE:
        ends[0] = n
    else:
        nxt[p] = n
    if n == NONE:
        ends[1] = p
    else:
        prev[n] = p
    prev[b] = OUT
    ends[2] -= 1


@_jit(nogil=True)
def append(prev, nxt, ends, blocks):
    """Each block becomes the most recently released, in order (one already in the order moves to
    the end, as a second release would move it)."""
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if prev[b] != OUT:
            _unlink(prev, nxt, ends, b)
        _append(prev, nxt, ends, b)


@_jit(nogil=True)
def unlink(prev, nxt, ends, blocks):
    """Take each block that is in the order out of it."""
    for i in range(blocks.shape[0]):
        b = blocks[i]
        if prev[b] != OUT:
            _unlink(prev, nxt, ends, b)


@_jit(nogil=True)
def pop_front(prev, nxt, ends, out):
    """The ``len(out)`` least recently released blocks, taken out in order (the caller checks that
    the order holds that many). One walk along ``nxt`` (loads only), then the stores: unlinking
    block by block would chain every step through the stores of the one before."""
    k = out.shape[0]
    if k == 0:
        return
    b = ends[0]
    for i in range(k):
        out[i] = b
        b = nxt[b]
    for i in range(k):
        prev[out[i]] = OUT
    ends[0] = b
    if b == NONE:
        ends[1] = NONE
    else:
        prev[b] = NONE
    ends[2] -= k


@_jit(nogil=True, inline="always")
def _cut_marked(ref, prev, nxt, ends, blocks, mark):
    """Take ``blocks`` (all in the order, each marked ``ref[b] == mark``) out of the order: each run
    of marked blocks is cut out whole, its outside neighbours linked to each other, so no store
    waits for the one before (as unlinking block by block does)."""
    n = blocks.shape[0]
    for i in range(n):
        b = blocks[i]
        p = prev[b]
        if p != NONE and ref[p] == mark:
            continue                # not the first of its run
        e = b
        while True:
            x = nxt[e]
            if x == NONE or ref[x] != mark:
                break
            e = x
        x = nxt[e]
        if p == NONE:
            ends[0] = x
        else:
            nxt[p] = x
        if x == NONE:
            ends[1] = p
        else:
            prev[x] = p
    for i in range(n):
        prev[blocks[i]] = OUT
    ends[2] -= n


@_jit(nogil=True)
def order(prev, nxt, ends, out):
    """The whole order, least recent first, into ``out`` (``ends[2]`` long)."""
    b = ends[0]
    i = 0
    while b != NONE and i < out.shape[0]:
        out[i] = b
        b = nxt[b]
        i += 1
    return i


@_jit(nogil=True)
def _mark_all(ref, blocks, want, extra, prev, need_in):
    """Check every block: in range, ``ref == want``, listed once, and (``need_in`` 1 / 0 / -1) in
    the order / out of it / either; ``extra`` (a flag per block, or an empty array) must be 1 for
    each. Marks the checked blocks with -1 - want; on a failure unmarks them and returns False."""
    n = blocks.shape[0]
    mark = -1 - want
    for i in range(n):
        b = blocks[i]
        ok = 0 <= b < ref.shape[0] and ref[b] == want
        if ok and need_in == 1:
            ok = prev[b] != OUT
        elif ok and need_in == 0:
            ok = prev[b] == OUT
        if ok and extra.shape[0]:
            ok = extra[b] == 1
        if not ok:
            for j in range(i):
                ref[blocks[j]] = want
            return False
        ref[b] = mark
    return True


@_jit(nogil=True)
def acquire_evictable(ref, prev, nxt, ends, blocks, no_flags):
    """A prefix hit on blocks that are all evictable, each listed once: refcount 1, out of the
    order. False (nothing changed) otherwise."""
    if not _mark_all(ref, blocks, 0, no_flags, prev, 1):
        return False
    _cut_marked(ref, prev, nxt, ends, blocks, -1)
    for i in range(blocks.shape[0]):
        ref[blocks[i]] = 1
    return True


@_jit(nogil=True)
def release_cached(ref, has, prev, nxt, ends, blocks):
    """The common release: every block held once (refcount 1), listed once and holding its hash:
    refcount 0, and each becomes the most recently released in order. False (nothing changed)
    otherwise."""
    if not _mark_all(ref, blocks, 1, has, prev, 0):
        return False
    for i in range(blocks.shape[0]):
        b = blocks[i]
        ref[b] = 0
        _append(prev, nxt, ends, b)
    return True


@_jit(nogil=True)
def release_uncached(ref, has, blocks):
    """Every block held once, listed once, holding no hash: refcount 0 (the caller puts them on
    the free list). False (nothing changed) otherwise."""
    n = blocks.shape[0]
    for i in range(n):
        b = blocks[i]
        if not (0 <= b < ref.shape[0] and ref[b] == 1 and has[b] == 0):
            for j in range(i):
                ref[blocks[j]] = 1
            return False
        ref[b] = -2
    for i in range(n):
        ref[blocks[i]] = 0
    return True


# -- a pool's batches fused with their index work (one call each) ------------------------------------


@_jit(nogil=True)
def take_evictable(ref, prev, nxt, ends, blocks, no_flags, slots, keys, has, given, scratch, no_rows, no_tags):
    """``acquire_evictable`` and, when it took the blocks, their keys out of the index (a host take:
    the blocks stay held, their hashes leave this tier). False (nothing changed) otherwise."""
    if not acquire_evictable(ref, prev, nxt, ends, blocks, no_flags):
        return False
    remove_blocks(slots, keys, has, blocks, False, scratch, no_rows, given, no_tags)
    return True


@_jit(nogil=True)
def evict_front(prev, nxt, ends, out, slots, keys, has, scratch, rows, no_tags, tags_out):
    """An eviction burst of ``len(out)`` (the caller checks the order holds them): the least recent
    blocks taken out of the order into ``out`` and their keys out of the index (copied to ``rows``
    and ``tags_out`` when those have rows)."""
    pop_front(prev, nxt, ends, out)
    remove_blocks(slots, keys, has, out, False, scratch, rows, no_tags, tags_out)


@_jit(nogil=True)
def cache_absent(slots, keys, has, q, given, blocks, got, scratch, num_tokens, size, prev, nxt, ends):
    """Demotions in: ``insert_absent`` and, when every key was new here, the blocks full
    (``num_tokens``) and evictable (appended to the order) in the same call. Returns what
    ``insert_absent`` does; when a key listed twice in the batch left a copy out (fewer inserted
    than blocks), nothing past the insertion is done and the caller finishes the batch."""
    done = insert_absent(slots, keys, has, q, given, blocks, got, scratch)
    if done < 0 and -1 - done == blocks.shape[0]:
        fill(num_tokens, blocks, size)
        append(prev, nxt, ends, blocks)
    return done


@_jit(nogil=True)
def fill(values, blocks, value):
    """``values[b] = value`` for each block."""
    for i in range(blocks.shape[0]):
        values[blocks[i]] = value


_warmed = False


def warm() -> None:
    """Call every loop once on tiny arrays, so that loading them (from numba's cache, or compiling
    them) happens when the first pool is built, not inside its first batches."""
    global _warmed
    if _warmed:
        return
    _warmed = True
    import numpy as np
    prev, nxt = np.full(4, OUT, np.int32), np.full(4, NONE, np.int32)     # (the links pools use)
    ends = np.array([NONE, NONE, 0], np.int64)
    ref, has, no_flags = np.zeros(4, np.int32), np.ones(4, np.uint8), np.zeros(0, np.uint8)
    blocks = np.arange(2, dtype=np.int64)
    release_cached(ref, has, prev, nxt, ends, blocks)            # refcounts 0: refused, nothing changed
    ref[:2] = 1
    release_cached(ref, has, prev, nxt, ends, blocks)
    acquire_evictable(ref, prev, nxt, ends, blocks, no_flags)
    release_uncached(ref, has, blocks)
    append(prev, nxt, ends, blocks)
    unlink(prev, nxt, ends, blocks[:1])
    out = np.empty(1, np.int64)
    order(prev, nxt, ends, out)
    pop_front(prev, nxt, ends, out)
    fill(ref, blocks, 0)
    slots, keys, no_tags = np.zeros(1024, np.int64), np.zeros((4, 2), np.uint64), np.zeros(0, np.int64)
    scratch, no_rows = np.zeros(1, np.int64), np.zeros((0, 2), np.uint64)
    take_evictable(ref, prev, nxt, ends, blocks, no_flags, slots, keys, has, no_tags, scratch, no_rows, no_tags)
    none = np.zeros(0, np.int64)
    evict_front(prev, nxt, ends, none, slots, keys, has, scratch, no_rows, no_tags, no_tags)
    cache_absent(slots, keys, has, no_rows, no_tags, none, none, scratch, none, 4, prev, nxt, ends)
    fill(none, blocks[:0], 0)
