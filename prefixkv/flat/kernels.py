"""Compiled loops (numba) over the flat hash index's arrays; ``FlatIndex`` is their only caller.

The table is open addressing with linear probing. ``slots[s]`` is 0 (empty) or
``tag << 32 | (block + 1)``, where ``tag`` is 32 bits of the key's mixed hash and the key's home
slot is ``tag & mask``: a probe compares tags before it reads a key (``keys[block]``, stored once,
with its block), and deleting or rehashing never reads a key at all. Deletion shifts the
following run back (no tombstones), so a table never degrades however many evictions it has seen.
Loops over a batch first compute every home and, in tables past the caches, touch every home slot (independent loads the
CPU overlaps: at 1M blocks each is a cache miss), then probe; the touches' sum goes to
``scratch[0]`` so that the compiler keeps them.
``has[block]`` is 1 while the block holds its key, in the table or not (see ``FlatIndex``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)
_LOW32 = np.uint64(0xFFFFFFFF)
_BLOCK = np.int64(0xFFFFFFFF)


def _jit(**options):
    """``njit`` with numba's on-disk cache where it finds a writable place for one (beside this file,
    or the user's cache dir); else compiled once per process: a read-only install with no writable
    home makes ``cache=True`` raise at decoration, which would fail this import."""
    def wrap(func):
        try:
            return njit(cache=True, **options)(func)
        except RuntimeError:        # "cannot cache function ...: no locator available"
            return njit(**options)(func)
    return wrap


@_jit(nogil=True, inline="always")
def _tag(row):
    """32 bits of the key's mixed hash. Digests are uniform already; the mix keeps keys that are
    not (small integers laid out as bytes) from crowding one probe run."""
    h = row[0]
    for j in range(1, row.shape[0]):
        h ^= row[j] * _GOLDEN
    h ^= h >> _S30
    h *= _MIX1
    h ^= h >> _S27
    h *= _MIX2
    h ^= h >> _S31
    return np.int64(h & _LOW32)


@_jit(nogil=True, inline="always")
def _same(keys, block, q, i):
    for j in range(q.shape[1]):
        if keys[block, j] != q[i, j]:
            return False
    return True


@_jit(nogil=True)
def tags_of(rows, out):
    """Every row's tag into ``out`` (a batch of keys probed more than once keeps them)."""
    for i in range(rows.shape[0]):
        out[i] = _tag(rows[i])


# Tables up to this many slots (256 KiB) stay in the caches between batches: touching their home
# slots first would only add a pass.
_TOUCH_FROM = 1 << 15


@_jit(nogil=True, inline="always")
def _touch(slots, tags, n, mask):
    """Load the home slot of each of the first ``n`` tags (see the module docstring); their sum."""
    touched = np.int64(0)
    if slots.shape[0] >= _TOUCH_FROM:
        for i in range(n):
            touched += slots[tags[i] & mask]
    return touched


@_jit(nogil=True)
def _block_tags(keys, blocks, out):
    """The tag of each block's key into ``out``."""
    for i in range(blocks.shape[0]):
        out[i] = _tag(keys[blocks[i]])


@_jit(nogil=True)
def _tags(rows, given, mask, slots):
    """Every row's tag (``given`` when it has one per row: computed before); touches each home slot
    first (see the module docstring)."""
    n = rows.shape[0]
    if given.shape[0] == n:
        tags = given
    else:
        tags = np.empty(n, np.int64)
        tags_of(rows, tags)     # (a call: mixed in here, the loop compiled four times slower)
    return tags, _touch(slots, tags, n, mask)


@_jit(nogil=True, inline="always")
def _probe(slots, keys, q, i, tag, mask):
    """The slot holding key ``q[i]`` (whose tag is ``tag``), or -(the empty slot ending the run) - 1."""
    s = tag & mask
    while True:
        v = slots[s]
        if v == 0:
            return -s - 1
        if ((v >> 32) & _BLOCK) == tag and _same(keys, (v & _BLOCK) - 1, q, i):
            return s
        s = (s + 1) & mask


@_jit(nogil=True)
def find_slot(slots, keys, q, i):
    """The slot holding key ``q[i]``, or -1."""
    s = _probe(slots, keys, q, i, _tag(q[i]), slots.shape[0] - 1)
    return s if s >= 0 else -1


@_jit(nogil=True)
def lookup_many(slots, keys, q, given, out, scratch):
    """``out[i]``: the block holding ``q[i]``, or -1."""
    mask = slots.shape[0] - 1
    tags, touched = _tags(q, given, mask, slots)
    for i in range(q.shape[0]):
        s = _probe(slots, keys, q, i, tags[i], mask)
        out[i] = (slots[s] & _BLOCK) - 1 if s >= 0 else -1
    scratch[0] = touched


@_jit(nogil=True)
def lookup_run(slots, keys, q, given, out, scratch):
    """The blocks of ``q``'s leading run of hits into ``out``; returns the run's length."""
    mask = slots.shape[0] - 1
    tags, scratch[0] = _tags(q, given, mask, slots)
    for i in range(q.shape[0]):
        s = _probe(slots, keys, q, i, tags[i], mask)
        if s < 0:
            return i
        out[i] = (slots[s] & _BLOCK) - 1
    return q.shape[0]


@_jit(nogil=True)
def lookup_run_outside(slots, keys, other_slots, other_keys, q, given, out, scratch):
    """``lookup_run`` here, and whether the other table (another tier's index of keys as wide)
    holds none of that run's keys: returns the run's length, or -1 - it when the other table holds
    one. Each key's tag is computed once for both tables."""
    mask = slots.shape[0] - 1
    tags, scratch[0] = _tags(q, given, mask, slots)
    n = q.shape[0]
    for i in range(q.shape[0]):
        s = _probe(slots, keys, q, i, tags[i], mask)
        if s < 0:
            n = i
            break
        out[i] = (slots[s] & _BLOCK) - 1
    other_mask = other_slots.shape[0] - 1
    scratch[0] += _touch(other_slots, tags, n, other_mask)
    for i in range(n):
        if _probe(other_slots, other_keys, q, i, tags[i], other_mask) >= 0:
            return -1 - n
    return n


@_jit(nogil=True)
def insert_many(slots, keys, has, q, given, blocks, got, scratch):
    """``got[i] = setdefault(q[i], blocks[i])`` in order: a key found keeps its block (a later
    duplicate of a key inserted earlier in the batch finds that one); a new key goes in with its
    block, whose ``keys`` row and ``has`` flag are written. Returns the number inserted. The
    caller keeps the table at most half full after the batch."""
    mask = slots.shape[0] - 1
    tags, scratch[0] = _tags(q, given, mask, slots)
    inserted = 0
    for i in range(q.shape[0]):
        s = _probe(slots, keys, q, i, tags[i], mask)
        if s >= 0:
            got[i] = (slots[s] & _BLOCK) - 1
            continue
        b = blocks[i]
        for j in range(q.shape[1]):
            keys[b, j] = q[i, j]
        has[b] = 1
        slots[-s - 1] = (tags[i] << 32) | (b + 1)
        got[i] = b
        inserted += 1
    return inserted


@_jit(nogil=True)
def insert_absent(slots, keys, has, q, given, blocks, got, scratch):
    """``insert_many`` of keys none of which is in the table yet: returns -1 once done, or (one
    is in: nothing changed) the index of the first key found. Each key is mixed once for both."""
    mask = slots.shape[0] - 1
    tags, scratch[0] = _tags(q, given, mask, slots)
    for i in range(q.shape[0]):
        if _probe(slots, keys, q, i, tags[i], mask) >= 0:
            return i
    return -1 - insert_many(slots, keys, has, q, tags, blocks, got, scratch)


@_jit(nogil=True)
def insert_one(slots, keys, has, q, block):
    """``insert_many`` of one key: the block holding ``q[0]`` after a setdefault."""
    mask = slots.shape[0] - 1
    tag = _tag(q[0])
    s = _probe(slots, keys, q, 0, tag, mask)
    if s >= 0:
        return (slots[s] & _BLOCK) - 1
    for j in range(q.shape[1]):
        keys[block, j] = q[0, j]
    has[block] = 1
    slots[-s - 1] = (tag << 32) | (block + 1)
    return block


@_jit(nogil=True)
def _delete_slot(slots, s):
    """Empty slot ``s``, shifting back the entries after it that may move (linear probing)."""
    mask = slots.shape[0] - 1
    j = s
    while True:
        j = (j + 1) & mask
        v = slots[j]
        if v == 0:
            break
        home = (v >> 32) & mask
        # the entry at j may fill the hole at s unless its home lies in (s, j] (cyclically)
        if ((j - home) & mask) >= ((j - s) & mask):
            slots[s] = v
            s = j
    slots[s] = 0


@_jit(nogil=True, inline="always")
def _slot_of_block(slots, block, tag, mask):
    s = tag & mask
    want = (tag << 32) | (block + 1)
    while True:
        v = slots[s]
        if v == 0:
            return -1
        if v == want:
            return s
        s = (s + 1) & mask


@_jit(nogil=True)
def remove_blocks(slots, keys, has, blocks, check, scratch, rows, given, tags_out):
    """Take each block's key out of the table and clear its ``has`` flag, copying it to ``rows[i]``
    and its tag to ``tags_out[i]`` when those have rows (an eviction burst's keys for the tier
    below). ``given``: the keys' tags, when known (one per block), so the keys are not read.
    ``check``: first make sure every block holds a key in the table and none is listed twice; if
    one does not, nothing changes and its index is returned. Returns -1 - (blocks whose key was
    not in the table) once done."""
    n = blocks.shape[0]
    mask = slots.shape[0] - 1
    if check:
        for i in range(n):
            b = blocks[i]
            if b < 0 or b >= has.shape[0] or has[b] != 1 or _slot_of_block(slots, b, _tag(keys[b]), mask) < 0:
                for k in range(i):
                    has[blocks[k]] = 1
                return i
            has[b] = 2       # seen: a second listing fails the check above
    if given.shape[0] == n:
        tags = given
    else:
        tags = np.empty(n, np.int64)
        _block_tags(keys, blocks, tags)
    if tags_out.shape[0]:
        for i in range(n):
            tags_out[i] = tags[i]
    if rows.shape[0]:
        for i in range(n):
            for j in range(keys.shape[1]):
                rows[i, j] = keys[blocks[i], j]
    touched = _touch(slots, tags, n, mask)
    missing = 0
    for i in range(n):
        b = blocks[i]
        s = _slot_of_block(slots, b, tags[i], mask)
        if s < 0 and given.shape[0] == n:
            s = _slot_of_block(slots, b, _tag(keys[b]), mask)     # a tag given that is not its key's
        if s >= 0:
            _delete_slot(slots, s)
        else:
            missing += 1        # not in the table (unchecked): nothing to delete, nothing wrongly deleted
        has[b] = 0
    scratch[0] = touched       # observable, so the touching pass is not optimised away
    return -1 - missing


@_jit(nogil=True)
def remove_key(slots, keys, has, q):
    """Take key ``q[0]`` out; returns the block that held it (its ``has`` cleared), or -1."""
    s = find_slot(slots, keys, q, 0)
    if s < 0:
        return -1
    b = (slots[s] & _BLOCK) - 1
    _delete_slot(slots, s)
    has[b] = 0
    return b


@_jit(nogil=True)
def assign(slots, keys, has, q, block):
    """``map[q[0]] = block``: a key found is re-pointed (its old block keeps its row, flag
    cleared), a new one inserted. Returns the block it pointed at before, or -1."""
    mask = slots.shape[0] - 1
    tag = _tag(q[0])
    s = _probe(slots, keys, q, 0, tag, mask)
    for j in range(q.shape[1]):
        keys[block, j] = q[0, j]
    has[block] = 1
    entry = (tag << 32) | (block + 1)
    if s < 0:
        slots[-s - 1] = entry
        return -1
    old = (slots[s] & _BLOCK) - 1
    if old != block:
        has[old] = 0
    slots[s] = entry
    return old


@_jit(nogil=True)
def count_held(has, blocks):
    """How many of ``blocks`` hold a key."""
    n = 0
    for i in range(blocks.shape[0]):
        if has[blocks[i]] == 1:
            n += 1
    return n


@_jit(nogil=True)
def rehash(old, new):
    """Every entry of table ``old`` into the empty table ``new`` (a growth)."""
    mask = new.shape[0] - 1
    for s in range(old.shape[0]):
        v = old[s]
        if v != 0:
            t = (v >> 32) & mask
            while new[t] != 0:
                t = (t + 1) & mask
            new[t] = v


@_jit(nogil=True)
def table_blocks(slots):
    """The blocks in the table, in slot order."""
    n = 0
    for s in range(slots.shape[0]):
        if slots[s] != 0:
            n += 1
    out = np.empty(n, np.int64)
    n = 0
    for s in range(slots.shape[0]):
        if slots[s] != 0:
            out[n] = (slots[s] & _BLOCK) - 1
            n += 1
    return out
