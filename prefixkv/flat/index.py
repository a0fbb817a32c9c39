"""The prefix cache's hash index in flat arrays: digest -> primary block, and block -> digest.

``BlockPool`` keeps a dict (hash object -> block) and a list (block -> hash object): ~160 B per
cached block at 1M blocks, most of it the hash object (49 B for a 16-byte digest), the dict entry
(~42 B) and the block's int object (32 B). Here a cached block costs its digest as ``w`` uint64
words in ``keys`` (16 B for xxh3_128), a flag byte and 16 bytes of table slots (8 B each, at
most half full), and the loops
that probe the table are compiled (``kernels``): a batch of lookups, insertions or deletions is one
call. Keys are ``bytes`` of exactly ``width`` bytes (what ``BlockHasher`` produces); a hash handed
back (``hash_of``) is a fresh ``bytes`` equal to the one stored.

Two structures in one: the table finds a block by key; ``keys[block]`` / ``has[block]`` say which
key a block holds. ``assign`` / ``remove`` work on both, ``set_held`` on the flag only
(``keys[block]`` stays readable until the block takes another key, so an entry is found while its
block's flag is already clear).

``FlatIndex`` is a ``BlockPool``'s index component (``prefixkv.index`` lists the calls a pool
makes): every one is a single compiled call per batch, and with ``CompiledLRU`` it gives the pool
fused batches (``prefixkv.flat.fused``) that move refcounts and the LRU order in the same call.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping
from typing import Hashable, Iterable, Iterator, Sequence

import numpy as np

from ..index import leading
from . import kernels
from .stack import FreeStack

_MIN_TABLE = 1024
_EMPTY = np.empty(0, np.int64)


def as_block_array(blocks: Sequence[int]) -> np.ndarray:
    """Block ids as an int64 array (``array('q')`` converts a list of ints about twice as fast as
    ``np.array``)."""
    if isinstance(blocks, np.ndarray):
        return blocks.astype(np.int64, copy=False)
    if not blocks:
        return _EMPTY
    return np.frombuffer(array("q", blocks), np.int64)


def _joins(h) -> bool:
    try:
        b"".join((h,))
    except TypeError:
        return False
    return True


_warmed: set[int] = set()


def _warm(words: int) -> None:
    """Call every loop once on a tiny index, so that loading them (from numba's cache, or compiling
    them) happens when the first pool of this key width is built, not inside its first batches."""
    if words in _warmed:
        return
    _warmed.add(words)
    index = FlatIndex(8 * words, warm=False)
    index.ensure_blocks(4)
    keys = [bytes([i]) * (8 * words) for i in (1, 2, 3)]
    q = index.column(keys)
    index.setdefault_many(q[:2], [0, 1])
    index.setdefault_one(q[2:], 2)
    index.lookup_run(q)
    index.lookup_run_outside(index, q)
    index.lookup_many(q)
    index.get(keys[0])
    index.count_held([0, 1])
    index.remove_blocks([0], True)
    index.assign(keys[0], 3)
    index.remove(keys[0])
    index.blocks()
    index._reserve(2 * _MIN_TABLE)


class HashRows(Sequence):
    """Digests as rows of a ``[n, words]`` uint64 array, read as ``bytes`` one by one: what an
    eviction burst hands to a tier below, so a flat index there takes the rows as they are
    (``FlatIndex.column``) and nobody makes a ``bytes`` per block unless they read it. ``tags``:
    each row's tag in the table (``kernels._tag``), when known, so an index probing the rows again
    does not mix them again."""

    __slots__ = ("rows", "tags")

    def __init__(self, rows: np.ndarray, tags: np.ndarray | None = None) -> None:
        self.rows = rows
        self.tags = tags

    @classmethod
    def tagged(cls, rows: np.ndarray) -> HashRows:
        """Rows with their tags computed now (rows an index will probe more than once)."""
        tags = np.empty(rows.shape[0], np.int64)
        kernels.tags_of(rows, tags)
        return cls(rows, tags)

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i):
        if isinstance(i, slice):
            return HashRows(self.rows[i], None if self.tags is None else self.tags[i])
        return self.rows[i].tobytes()

    def __iter__(self):
        buf = self.rows.tobytes()
        w = self.rows.shape[1] * 8
        return (buf[i:i + w] for i in range(0, len(buf), w))

    def __eq__(self, other) -> bool:
        """Equal to any list, tuple or HashRows of the same ``bytes`` (as the list it stands for)."""
        if isinstance(other, (list, tuple, HashRows)):
            return list(self) == list(other)
        return NotImplemented

    __hash__ = None       # a mutable sequence's stand-in: not hashable, as a list is not

    def __repr__(self) -> str:
        return f"HashRows({list(self)!r})"


def _tags(hashes, start: int, stop: int) -> np.ndarray | None:
    """The index tags of ``hashes[start:stop]``, when ``hashes`` are rows that carry them."""
    if type(hashes) is HashRows and hashes.tags is not None:
        return hashes.tags[start:stop]
    return None


class KeyMap(Mapping):
    """The index read as ``{hash: primary block}`` (``BlockPool.cached_map``): read-only."""

    __slots__ = ("_index",)

    def __init__(self, index: FlatIndex) -> None:
        self._index = index

    def __getitem__(self, h) -> int:
        block = self._index.get(h)
        if block is None:
            raise KeyError(h)
        return block

    def get(self, h, default=None):
        return self._index.get(h, default)

    def __contains__(self, h) -> bool:
        return self._index.get(h) is not None

    def __len__(self) -> int:
        return len(self._index)

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._index.hashes_of(self._index.blocks()))


class BlockHashes(Sequence):
    """The index read as ``[hash or None]`` by block (``BlockPool.block_hash``, what policies
    read): read-only, covering the blocks that have rows."""

    __slots__ = ("_index",)

    def __init__(self, index: FlatIndex) -> None:
        self._index = index

    def __len__(self) -> int:
        return self._index.has.shape[0]

    def __getitem__(self, block):
        n = self._index.has.shape[0]
        if isinstance(block, slice):
            return [self[b] for b in range(*block.indices(n))]
        if -n <= block < 0:
            block += n
        return self._index.hash_of(block)

    def __iter__(self) -> Iterator:
        hash_of = self._index.hash_of
        return (hash_of(b) for b in range(self._index.has.shape[0]))


class FlatIndex:
    def __init__(self, width: int, *, warm: bool = True) -> None:
        if width <= 0 or width % 8:
            raise ValueError(f"a flat index keys digests of a multiple of 8 bytes, got width {width}")
        if warm:
            _warm(width // 8)
        self.width = self.digest_size = width      # (digest_size: the name the pool's index calls use)
        self.words = width // 8
        self.keys = np.zeros((0, self.words), np.uint64)
        # The flags live in a bytearray that ``has`` views: the compiled loops read and write the
        # array, Python reads ``flags[block]`` at list speed (a pool's per-block release loop).
        self.flags = bytearray()
        self.has = np.frombuffer(self.flags, np.uint8)
        self.slots = np.zeros(_MIN_TABLE, np.int64)
        self.count = 0          # entries in the table
        self.inserted = 0       # keys the last batch insertion entered
        self._scratch = np.zeros(1, np.int64)
        self._no_rows = np.zeros((0, self.words), np.uint64)
        self._no_tags = np.zeros(0, np.int64)
        # True from an owner whose every hash is already known to be a digest of this width (the
        # manager: its hasher's, or precomputed ones it checked; a host tier: the device index's):
        # entering keys then skips the check per hash (~35 ns each; 2,048 in a long prompt).
        self.hashes_checked = False
        self.hashes = BlockHashes(self)
        self.mapping = KeyMap(self)


    # -- sizes ---------------------------------------------------------------
    def ensure_blocks(self, n: int) -> None:
        """Per-block rows for blocks ``[0, n)`` (grown in place of the old arrays, keeping them)."""
        have = self.has.shape[0]
        if n <= have:
            return
        keys = np.zeros((n, self.words), np.uint64)
        keys[:have] = self.keys
        flags = bytearray(n)
        flags[:have] = self.flags
        self.keys, self.flags, self.has = keys, flags, np.frombuffer(flags, np.uint8)

    def _reserve(self, extra: int) -> None:
        """Keep the table at most half full after ``extra`` more entries."""
        need = 2 * (self.count + extra)
        size = self.slots.shape[0]
        if need <= size:
            return
        while size < need:
            size *= 2
        new = np.zeros(size, np.int64)
        kernels.rehash(self.slots, new)
        self.slots = new

    def __len__(self) -> int:
        return self.count

    def nbytes(self) -> int:
        return self.keys.nbytes + self.has.nbytes + self.slots.nbytes

    # -- keys ----------------------------------------------------------------
    def column(self, hashes: Sequence, exact: bool = False) -> np.ndarray:
        """``hashes`` as a ``[n, words]`` uint64 array. Raises TypeError (not bytes) or ValueError
        (not ``width`` bytes each). Without ``exact`` widths are told by the total only (the
        pool's callers pass ``BlockHasher`` digests, whose widths are fixed): hashes of other widths
        that add up to it make rows that are none of them, which only ever miss in a lookup; keys
        entered into the index (``exact``) are checked one by one."""
        if type(hashes) is HashRows and hashes.rows.shape[1] == self.words:
            return hashes.rows          # another flat index's rows: digests of this width already
        try:
            buf = b"".join(hashes)
        except TypeError:
            # the first item join refuses: not bytes-like, or one it cannot read (a strided memoryview)
            bad = next((h for h in hashes if not _joins(h)), None)
            raise TypeError(f"this pool's flat index keys {self.width}-byte digests (bytes); got "
                            f"{type(bad).__name__} {bad!r}: use index='dict' for other hashes") from None
        if len(buf) != len(hashes) * self.width or (exact and hashes and max(map(len, hashes)) != self.width):
            bad = next((h for h in hashes if len(h) != self.width), None)
            raise ValueError(f"this pool's flat index keys {self.width}-byte digests; got one of "
                             f"{len(bad) if bad is not None else '?'} bytes: use index='dict' for other hashes")
        return np.frombuffer(buf, np.uint64).reshape(-1, self.words)

    def key(self, h) -> np.ndarray:
        """One key as a ``[1, words]`` row (a digest of this width without a join)."""
        if type(h) is bytes and len(h) == self.width:
            return np.frombuffer(h, np.uint64).reshape(1, self.words)
        return self.column((h,))

    def hash_of(self, block: int) -> bytes | None:
        """The key ``block`` holds, or None."""
        if 0 <= block < self.has.shape[0]:
            return self.keys[block].tobytes() if self.flags[block] == 1 else None
        raise IndexError(f"block {block} out of range")

    def hashes_of(self, blocks: Sequence[int]) -> HashRows:
        """The key rows of ``blocks`` (whether or not their flags are set), copied: a sequence of
        ``bytes``."""
        return HashRows(self.keys[as_block_array(blocks)])

    def set_held(self, block: int, h) -> None:
        """``block_hash[block] = h``: None clears the flag; a key is written and flagged."""
        if h is None:
            self.has[block] = 0
        else:
            self.keys[block] = self.key(h)[0]
            self.has[block] = 1

    def held(self, block: int) -> bool:
        return self.flags[block] == 1

    def count_held(self, blocks: Sequence[int]) -> int:
        return int(kernels.count_held(self.has, as_block_array(blocks)))

    def count_unheld(self, blocks: Sequence[int]) -> int:
        return len(blocks) - self.count_held(blocks)

    # -- the map -------------------------------------------------------------
    def get(self, h, default=None):
        try:
            q = self.key(h)
        except (TypeError, ValueError):
            return default      # not a key of this index: not in it (as a dict says)
        s = kernels.find_slot(self.slots, self.keys, q, 0)
        return default if s < 0 else (int(self.slots[s]) & 0xFFFFFFFF) - 1

    def __contains__(self, h) -> bool:
        return self.get(h) is not None

    def assign(self, h, block: int) -> None:
        """``map[h] = block``. IndexError (nothing changed) for a block without a row: the kernel
        writes its row unchecked."""
        q = self.key(h)
        if not 0 <= block < self.has.shape[0]:
            raise IndexError(f"block {block} out of range")
        self._reserve(1)
        if kernels.assign(self.slots, self.keys, self.has, q, block) < 0:
            self.count += 1

    def remove(self, h) -> int:
        """``del map[h]``; returns the block (its flag cleared). KeyError if absent."""
        try:
            q = self.key(h)
        except (TypeError, ValueError):
            raise KeyError(h) from None
        block = kernels.remove_key(self.slots, self.keys, self.has, q)
        if block < 0:
            raise KeyError(h)
        self.count -= 1
        return int(block)

    def setdefault_one(self, q: np.ndarray, block: int) -> int:
        """``map.setdefault(q[0], block)`` (a decode step's one new full block)."""
        if not 0 <= block < self.has.shape[0]:
            raise IndexError(f"block {block} has no row in this index (rows for {self.has.shape[0]})")
        self._reserve(1)
        got = int(kernels.insert_one(self.slots, self.keys, self.has, q, block))
        if got == block:
            self.count += 1
        return got

    def setdefault_many(self, q: np.ndarray, blocks: Sequence[int]) -> list[int]:
        """``[map.setdefault(k, b) for k, b in zip(q, blocks)]`` in one call (pairs as ``zip`` does:
        the kernel reads ``blocks[i]`` for every key, unchecked)."""
        return self.insert_array(q, as_block_array(blocks)).tolist()

    def _given(self, tags: np.ndarray | None, n: int) -> np.ndarray:
        return tags[:n] if tags is not None and tags.shape[0] >= n else self._no_tags

    # -- fused kernels outside the index -----------------------------------------
    # A pool's compiled batches (``lru_kernels``) change the table and the LRU links in one call; the
    # index hands them its arrays here and is told what they did, so its entry count is kept here only.
    def kernel_table(self, tags: np.ndarray | None = None, n: int = 0, extra: int = 0) -> tuple:
        """``(slots, keys, has, given tags, scratch)`` for a fused kernel: the tags of the first ``n``
        keys when the caller has them (else none), room made first for ``extra`` more entries (the
        table may be replaced: take the arrays after, never keep them). Report the kernel's changes
        with ``entries_removed`` / ``entries_added``."""
        if extra:
            self._reserve(extra)
        return self.slots, self.keys, self.has, self._given(tags, n), self._scratch

    @property
    def no_rows(self) -> np.ndarray:
        """An empty key-rows array: a kernel's "do not copy the removed keys out"."""
        return self._no_rows

    @property
    def no_tags(self) -> np.ndarray:
        """An empty tags array: a kernel's "no tags given" / "do not copy the tags out"."""
        return self._no_tags

    def entries_removed(self, k: int) -> None:
        """A fused kernel took ``k`` entries out of the table."""
        self.count -= k

    def entries_added(self, k: int) -> None:
        """A fused kernel entered ``k`` keys (``inserted`` says so, as after ``insert_array``)."""
        self.inserted = k
        self.count += k

    def _check_rows(self, blocks: np.ndarray) -> None:
        """IndexError (nothing changed) for a block without a row: the kernels write rows unchecked."""
        if blocks.shape[0] and (int(blocks.min()) < 0 or int(blocks.max()) >= self.has.shape[0]):
            bad = int(blocks.min()) if int(blocks.min()) < 0 else int(blocks.max())
            raise IndexError(f"block {bad} has no row in this index (rows for {self.has.shape[0]})")

    def insert_array(self, q: np.ndarray, blocks: np.ndarray, tags: np.ndarray | None = None, *,
                     rows_known: bool = False) -> np.ndarray:
        """``setdefault_many`` of an int64 array, as one (``tags``: the keys' tags, when known;
        ``rows_known``: the caller's blocks all have rows, a pool's own free blocks). ``inserted``
        then says how many keys went in (all of them: every block is its key's primary)."""
        n = min(q.shape[0], blocks.shape[0])
        if n != q.shape[0] or n != blocks.shape[0]:
            q, blocks = q[:n], blocks[:n]
        if not rows_known:
            self._check_rows(blocks)
        self._reserve(n)
        got = np.empty(n, np.int64)
        self.inserted = int(kernels.insert_many(self.slots, self.keys, self.has, q, self._given(tags, n), blocks, got,
                                                self._scratch))
        self.count += self.inserted
        return got

    def lookup_many(self, q: np.ndarray, tags: np.ndarray | None = None) -> np.ndarray:
        """Per key: its block, or -1."""
        out = np.empty(q.shape[0], np.int64)
        kernels.lookup_many(self.slots, self.keys, q, self._given(tags, q.shape[0]), out, self._scratch)
        return out

    def lookup_run(self, q: np.ndarray, tags: np.ndarray | None = None) -> list[int]:
        """The blocks of the leading run of ``q``'s keys found."""
        return self.lookup_run_array(q, tags).tolist()

    def lookup_run_outside(self, other: FlatIndex, q: np.ndarray,
                           tags: np.ndarray | None = None) -> tuple[np.ndarray, bool]:
        """``lookup_run_array`` here, and whether ``other`` (an index of keys as wide) holds none of
        the run's keys, in one pass."""
        out = np.empty(q.shape[0], np.int64)
        n = int(kernels.lookup_run_outside(self.slots, self.keys, other.slots, other.keys, q,
                                           self._given(tags, q.shape[0]), out, self._scratch))
        return (out[:n], True) if n >= 0 else (out[:-1 - n], False)

    def lookup_run_array(self, q: np.ndarray, tags: np.ndarray | None = None) -> np.ndarray:
        """``lookup_run`` as an int64 array."""
        out = np.empty(q.shape[0], np.int64)
        n = kernels.lookup_run(self.slots, self.keys, q, self._given(tags, q.shape[0]), out, self._scratch)
        return out[:n]

    def remove_blocks(self, blocks: Iterable[int], check: bool, rows: np.ndarray | None = None,
                      tags: np.ndarray | None = None, tags_out: np.ndarray | None = None) -> int:
        """Take the keys of ``blocks`` out; see ``kernels.remove_blocks``. Returns -1, or (check
        failed: nothing changed) the index of the first block that holds no key in the table.
        ``rows`` / ``tags_out``: arrays to copy the keys removed and their tags into; ``tags``: the
        keys' tags, when known."""
        arr = as_block_array(blocks)
        bad = int(kernels.remove_blocks(self.slots, self.keys, self.has, arr, check, self._scratch,
                                        self._no_rows if rows is None else rows, self._given(tags, arr.shape[0]),
                                        self._no_tags if tags_out is None else tags_out))
        if bad < 0:
            self.count -= arr.shape[0] - (-1 - bad)
            bad = -1
        return bad

    def blocks(self) -> list[int]:
        """Every block in the table."""
        return kernels.table_blocks(self.slots).tolist()

    def clear(self) -> None:
        self.slots = np.zeros(_MIN_TABLE, np.int64)
        self.has[:] = 0
        self.count = 0

    # -- a pool's index component (prefixkv.index) ------------------------------
    def block_storage(self) -> tuple:
        # refcounts and token counts in typed arrays: Python indexes them as fast as lists, and the
        # fused batches view them (np.frombuffer, per call: an array exporting its buffer cannot grow)
        return array("i"), array("q"), FreeStack()

    def held_flags(self) -> tuple:
        return self.flags, 0      # (bytearray items are small ints: 0 is CPython's one 0)

    def primaries(self) -> list[int]:
        return self.blocks()

    def run(self, hashes: Sequence[Hashable], start: int, limit: int) -> list[int]:
        if start >= limit or self.get(hashes[start]) is None:
            return []       # a fresh prompt: told by one probe, not a column of its hashes
        try:
            q = self.column(hashes[start:limit])
        except (TypeError, ValueError):     # not all digests of this width: none of those is cached
            return leading(self.get, hashes, start, limit)
        return self.lookup_run(q, _tags(hashes, start, limit))

    def run_array(self, hashes: Sequence[Hashable], start: int, limit: int) -> np.ndarray:
        if start >= limit or self.get(hashes[start]) is None:
            return _EMPTY
        try:
            q = self.column(hashes[start:limit])
        except (TypeError, ValueError):
            return as_block_array(leading(self.get, hashes, start, limit))
        return self.lookup_run_array(q, _tags(hashes, start, limit))

    def holds_none(self, hashes: Iterable[Hashable]) -> bool:
        if type(hashes) is not HashRows:
            hashes = list(hashes)
        if not len(hashes):
            return True
        try:
            q = self.column(hashes)
        except (TypeError, ValueError):
            return all(self.get(h) is None for h in hashes)
        return int(self.lookup_many(q, _tags(hashes, 0, len(hashes))).max()) < 0

    def probe_keys(self, hashes: list[Hashable]) -> Sequence[Hashable]:
        """The hashes' key rows with their tags (``HashRows``), joined once; the list itself for
        one hash, or for hashes that are not digests of this width (none of those is cached)."""
        if len(hashes) > 1:
            try:
                return HashRows.tagged(self.column(hashes))
            except (TypeError, ValueError):
                pass
        return hashes

    def run_outside(self, other, keys, start: int, limit: int) -> tuple:
        if type(keys) is HashRows and keys.tags is not None and isinstance(other, FlatIndex):
            # both indexes flat: the run here and the other index's absence from it in one pass
            return self.lookup_run_outside(other, keys.rows[start:limit], keys.tags[start:limit])
        return self.run_array(keys, start, limit), None

    def key_tags(self, keys, indices) -> np.ndarray | None:
        if type(indices) is range and type(keys) is HashRows and keys.tags is not None:
            return keys.tags[indices.start:indices.stop]
        return None

    def prepare(self, hashes: Sequence[Hashable]) -> np.ndarray:
        """The batch's key rows (one hash: its row, without a join), checked: TypeError or
        ValueError for a hash that is not a digest of this width, before anything changes."""
        if len(hashes) == 1 and type(hashes) is not HashRows:
            return self.key(hashes[0])
        return self.column(hashes, exact=not self.hashes_checked)

    def check_keys(self, hashes: Sequence[Hashable]) -> None:
        if not self.hashes_checked:
            self.column(hashes, exact=True)

    def enter_many(self, keys: np.ndarray, hashes: Sequence[Hashable], blocks: Sequence[int]) -> list[int]:
        """``setdefault`` of ``prepare(hashes)`` and ``blocks``, paired as zip pairs them."""
        if len(blocks) == 1 and keys.shape[0]:      # a decode step's one new full block: no arrays of one
            return [self.setdefault_one(keys if keys.shape[0] == 1 else keys[:1], blocks[0])]
        return self.insert_array(keys, as_block_array(blocks)).tolist()

    def insert(self, h: Hashable, block: int) -> None:
        self.assign(h, block)

    def take_blocks(self, blocks: Sequence[int], want_hashes: bool = True):
        """Drop the keys of primary ``blocks``; their rows stay readable until the blocks take new
        keys, so the hashes handed back (``want_hashes``) are read after."""
        self.remove_blocks(blocks, False)
        return self.hashes_of(blocks) if want_hashes else ()

    def take_blocks_checked(self, blocks: Sequence[int], want_hashes: bool = True):
        try:
            arr = as_block_array(blocks)
        except (TypeError, ValueError, OverflowError):       # not block ids
            return None
        if self.remove_blocks(arr, True) >= 0:
            return None
        return self.hashes_of(blocks) if want_hashes else ()
