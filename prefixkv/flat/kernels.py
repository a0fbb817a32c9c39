"""Compiled loops (numba) over the flat hash index's arrays; ``FlatIndex`` is their only caller.

The table is open addressing with linear probing: ``slots[s]`` is 0 (empty) or ``block + 1``;
the key of the entry in a slot is ``keys[block]`` (a digest as ``w`` uint64 words), so a slot costs
4 bytes and a key is stored once, with its block. Deletion shifts the following run back
(no tombstones), so a table never degrades however many evictions it has seen.
``has[block]`` is 1 while the block holds its key, in the table or not (see ``FlatIndex``).
"""

from __future__ import annotations

import numpy as np
from numba import njit

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


@njit(cache=True, nogil=True, inline="always")
def _home(row, mask):
    """The slot a key starts probing at. Digests are uniform already; the mix keeps keys that are
    not (small integers laid out as bytes) from crowding one probe run."""
    h = row[0]
    for j in range(1, row.shape[0]):
        h ^= row[j] * _GOLDEN
    h ^= h >> _S30
    h *= _MIX1
    h ^= h >> _S27
    h *= _MIX2
    h ^= h >> _S31
    return np.int64(h & np.uint64(mask))


@njit(cache=True, nogil=True, inline="always")
def _same(keys, block, q, i):
    for j in range(q.shape[1]):
        if keys[block, j] != q[i, j]:
            return False
    return True


@njit(cache=True, nogil=True)
def find_slot(slots, keys, q, i):
    """The slot holding key ``q[i]``, or -1."""
    mask = slots.shape[0] - 1
    s = _home(q[i], mask)
    while True:
        v = slots[s]
        if v == 0:
            return -1
        if _same(keys, v - 1, q, i):
            return s
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def lookup_many(slots, keys, q, out):
    """``out[i]``: the block holding ``q[i]``, or -1."""
    mask = slots.shape[0] - 1
    for i in range(q.shape[0]):
        s = _home(q[i], mask)
        out[i] = -1
        while True:
            v = slots[s]
            if v == 0:
                break
            if _same(keys, v - 1, q, i):
                out[i] = v - 1
                break
            s = (s + 1) & mask


@njit(cache=True, nogil=True)
def lookup_run(slots, keys, q, out):
    """The blocks of ``q``'s leading run of hits into ``out``; returns the run's length."""
    mask = slots.shape[0] - 1
    for i in range(q.shape[0]):
        s = _home(q[i], mask)
        while True:
            v = slots[s]
            if v == 0:
                return i
            if _same(keys, v - 1, q, i):
                out[i] = v - 1
                break
            s = (s + 1) & mask
    return q.shape[0]


@njit(cache=True, nogil=True)
def insert_many(slots, keys, has, q, blocks, got):
    """``got[i] = setdefault(q[i], blocks[i])`` in order: a key found keeps its block (a later
    duplicate of a key inserted earlier in the batch finds that one); a new key goes in with its
    block, whose ``keys`` row and ``has`` flag are written. Returns the number inserted. The
    caller keeps the table at most half full after the batch."""
    mask = slots.shape[0] - 1
    inserted = 0
    for i in range(q.shape[0]):
        s = _home(q[i], mask)
        while True:
            v = slots[s]
            if v == 0:
                b = blocks[i]
                for j in range(q.shape[1]):
                    keys[b, j] = q[i, j]
                has[b] = 1
                slots[s] = b + 1
                got[i] = b
                inserted += 1
                break
            if _same(keys, v - 1, q, i):
                got[i] = v - 1
                break
            s = (s + 1) & mask
    return inserted


@njit(cache=True, nogil=True)
def _delete_slot(slots, keys, s):
    """Empty slot ``s``, shifting back the entries after it that may move (linear probing)."""
    mask = slots.shape[0] - 1
    j = s
    while True:
        j = (j + 1) & mask
        v = slots[j]
        if v == 0:
            break
        home = _home(keys[v - 1], mask)
        # the entry at j may fill the hole at s unless its home lies in (s, j] (cyclically)
        if ((j - home) & mask) >= ((j - s) & mask):
            slots[s] = v
            s = j
    slots[s] = 0


@njit(cache=True, nogil=True)
def _slot_of_block(slots, keys, block):
    mask = slots.shape[0] - 1
    s = _home(keys[block], mask)
    while True:
        v = slots[s]
        if v == 0:
            return -1
        if v == block + 1:
            return s
        s = (s + 1) & mask


@njit(cache=True, nogil=True)
def remove_blocks(slots, keys, has, blocks, check):
    """Take each block's key out of the table and clear its ``has`` flag. ``check``: first make
    sure every block holds a key in the table and none is listed twice; if one does not, nothing
    changes and its index is returned. Returns -1 once done."""
    n = blocks.shape[0]
    if check:
        for i in range(n):
            b = blocks[i]
            if b < 0 or b >= has.shape[0] or has[b] != 1 or _slot_of_block(slots, keys, b) < 0:
                for k in range(i):
                    has[blocks[k]] = 1
                return i
            has[b] = 2       # seen: a second listing fails the check above
    for i in range(n):
        b = blocks[i]
        _delete_slot(slots, keys, _slot_of_block(slots, keys, b))
        has[b] = 0
    return -1


@njit(cache=True, nogil=True)
def remove_key(slots, keys, has, q):
    """Take key ``q[0]`` out; returns the block that held it (its ``has`` cleared), or -1."""
    s = find_slot(slots, keys, q, 0)
    if s < 0:
        return -1
    b = slots[s] - 1
    _delete_slot(slots, keys, s)
    has[b] = 0
    return b


@njit(cache=True, nogil=True)
def assign(slots, keys, has, q, block):
    """``map[q[0]] = block``: a key found is re-pointed (its old block keeps its row, flag
    cleared), a new one inserted. Returns the block it pointed at before, or -1."""
    s = find_slot(slots, keys, q, 0)
    for j in range(q.shape[1]):
        keys[block, j] = q[0, j]
    has[block] = 1
    if s < 0:
        mask = slots.shape[0] - 1
        s = _home(q[0], mask)
        while slots[s] != 0:
            s = (s + 1) & mask
        slots[s] = block + 1
        return -1
    old = slots[s] - 1
    if old != block:
        has[old] = 0
    slots[s] = block + 1
    return old


@njit(cache=True, nogil=True)
def count_held(has, blocks):
    """How many of ``blocks`` hold a key."""
    n = 0
    for i in range(blocks.shape[0]):
        if has[blocks[i]] == 1:
            n += 1
    return n


@njit(cache=True, nogil=True)
def rehash(old, new, keys):
    """Every entry of table ``old`` into the empty table ``new`` (a growth)."""
    mask = new.shape[0] - 1
    for s in range(old.shape[0]):
        v = old[s]
        if v != 0:
            t = _home(keys[v - 1], mask)
            while new[t] != 0:
                t = (t + 1) & mask
            new[t] = v


@njit(cache=True, nogil=True)
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
            out[n] = slots[s] - 1
            n += 1
    return out
