"""What a flat-array prefix index would cost, before anyone rebuilds the pool on one.

Issue 17 wants <= 128 B per cached block at 10^6 blocks. The pool's index is a dict of 16-byte
hash ints to block ints: the hash object (48 B), its dict entry (~41 B) and the block int (32 B)
are 121 B before any per-block list. This probe measures, on this machine and in one run, the
alternative: an open-addressing table in one numpy structured array (lo, hi, block per slot, load
0.5) against the dict, at the same size and on the same keys:

* bytes per block of each index (tracemalloc; the dict side counts its key and value objects);
* looking up 2,048 keys (a 32k-token prompt of 16-token blocks) drawn at random;
* an eviction burst: delete 128 keys and insert 128 new ones (tombstones, vectorised rounds);
* turning 2,048 Python 128-bit hash ints into the two uint64 columns the table needs.

Where numba is importable (not a prefixkv dependency: ``pip install numba``), the same table is also
probed through compiled loops (one call per lookup or burst), which is what a flat index would
need to beat the dict at every size: numpy's vectorised rounds cost ~25 calls per operation.

``python benches/flat_index_probe.py [--blocks N] [--repeat R]`` prints medians.
"""

from __future__ import annotations

import argparse
import statistics
import time
import tracemalloc

import numpy as np

SLOT = np.dtype([("lo", "<u8"), ("hi", "<u8"), ("block", "<i4"), ("pad", "<i4")])
EMPTY, TOMBSTONE = -1, -2


class FlatIndex:
    """128-bit key -> block, linear probing, every operation on arrays of keys."""

    def __init__(self, num_blocks: int) -> None:
        size = 1 << (2 * num_blocks - 1).bit_length()
        self.table = np.zeros(size, SLOT)
        self.table["block"] = EMPTY
        self.mask = size - 1
        self.slot_of = np.full(num_blocks, -1, np.int64)

    def lookup(self, hi: np.ndarray, lo: np.ndarray) -> np.ndarray:
        table, mask = self.table, self.mask
        out = np.full(len(lo), -1, np.int64)
        slot = (lo & np.uint64(mask)).astype(np.int64)
        todo = np.arange(len(lo))
        while len(todo):
            rows = table[slot]
            found = (rows["lo"] == lo[todo]) & (rows["hi"] == hi[todo]) & (rows["block"] >= 0)
            out[todo[found]] = rows["block"][found]
            going = ~(found | (rows["block"] == EMPTY))
            todo, slot = todo[going], (slot[going] + 1) & mask
        return out

    def insert(self, blocks: np.ndarray, hi: np.ndarray, lo: np.ndarray) -> None:
        """Keys known absent and distinct (a burst of new primaries)."""
        table, mask = self.table, self.mask
        slot = (lo & np.uint64(mask)).astype(np.int64)
        todo = np.arange(len(blocks))
        while len(todo):
            open_ = np.flatnonzero(table["block"][slot] < 0)
            _, first = np.unique(slot[open_], return_index=True)
            won = open_[first]
            where = slot[won]
            table["lo"][where], table["hi"][where] = lo[todo[won]], hi[todo[won]]
            table["block"][where] = blocks[todo[won]]
            self.slot_of[blocks[todo[won]]] = where
            left = np.ones(len(todo), bool)
            left[won] = False
            todo, slot = todo[left], (slot[left] + 1) & mask

    def delete(self, blocks: np.ndarray) -> None:
        self.table["block"][self.slot_of[blocks]] = TOMBSTONE
        self.slot_of[blocks] = -1


def compiled_index():
    """(lookup, insert, delete) over FlatIndex's arrays compiled by numba, or None without numba."""
    try:
        from numba import njit
    except ImportError:
        return None

    @njit(cache=False)
    def lookup(table_lo, table_hi, table_block, mask, hi, lo, out):
        for i in range(lo.shape[0]):
            slot = np.int64(lo[i] & np.uint64(mask))
            while True:
                block = table_block[slot]
                if block == EMPTY:
                    return i
                if block >= 0 and table_lo[slot] == lo[i] and table_hi[slot] == hi[i]:
                    out[i] = block
                    break
                slot = (slot + 1) & mask
        return lo.shape[0]

    @njit(cache=False)
    def insert(table_lo, table_hi, table_block, mask, slot_of, blocks, hi, lo):
        for i in range(blocks.shape[0]):
            slot = np.int64(lo[i] & np.uint64(mask))
            while table_block[slot] >= 0:
                slot = (slot + 1) & mask
            table_lo[slot], table_hi[slot], table_block[slot] = lo[i], hi[i], blocks[i]
            slot_of[blocks[i]] = slot

    @njit(cache=False)
    def delete(table_block, slot_of, blocks):
        for i in range(blocks.shape[0]):
            table_block[slot_of[blocks[i]]] = TOMBSTONE
            slot_of[blocks[i]] = -1

    return lookup, insert, delete


def probe_compiled(n: int, hi: np.ndarray, lo: np.ndarray, q: np.ndarray, draws: list, repeat: int) -> str:
    kernels = compiled_index()
    if kernels is None:
        return "  compiled loops: numba is not installed (pip install numba) - skipped"
    lookup, insert, delete = kernels
    size = 1 << (2 * n - 1).bit_length()
    mask = size - 1
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    table_lo, table_hi = np.zeros(size, np.uint64), np.zeros(size, np.uint64)
    table_block = np.full(size, EMPTY, np.int32)
    slot_of = np.full(n, -1, np.int64)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    insert(table_lo, table_hi, table_block, mask, slot_of, np.arange(n, dtype=np.int32), hi, lo)
    out = np.empty(len(q), np.int64)
    qh, ql = hi[q].copy(), lo[q].copy()
    assert lookup(table_lo, table_hi, table_block, mask, qh, ql, out) == len(q) and (out == q).all()
    found = median_us(lambda: lookup(table_lo, table_hi, table_block, mask, qh, ql, out), repeat)
    bursts = iter([(v.astype(np.int32), h, l) for v, h, l in draws])

    def burst():
        victims, new_hi, new_lo = next(bursts)
        delete(table_block, slot_of, victims)
        insert(table_lo, table_hi, table_block, mask, slot_of, victims, new_hi, new_lo)

    return (f"  compiled loops (numba, same layout in three arrays): {used / n:.1f} B per block; lookup of 2,048 "
            f"{found} us; burst of 128 deletes + 128 inserts {median_us(burst, repeat)} us")


def median_us(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(statistics.median(times) * 1e6, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--blocks", type=int, default=1 << 20)
    ap.add_argument("--repeat", type=int, default=21)
    args = ap.parse_args()
    n = args.blocks
    rng = np.random.default_rng(0)
    hi = rng.integers(1, 2**63, n, dtype=np.uint64)
    lo = rng.integers(1, 2**63, n, dtype=np.uint64)
    keys = [(a << 64) | b for a, b in zip(hi.tolist(), lo.tolist())]

    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    flat = FlatIndex(n)
    for start in range(0, n, 1 << 16):
        part = np.arange(start, min(n, start + (1 << 16)))
        flat.insert(part, hi[part], lo[part])
    flat_bytes = tracemalloc.get_traced_memory()[0] - base
    base = tracemalloc.get_traced_memory()[0]
    index = dict(zip([(a << 64) | b for a, b in zip(hi.tolist(), lo.tolist())], range(n)))
    dict_bytes = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()

    q = rng.integers(0, n, 2048)
    qh, ql, qk = hi[q].copy(), lo[q].copy(), [keys[i] for i in q.tolist()]
    assert (flat.lookup(qh, ql) == q).all() and list(map(index.get, qk)) == q.tolist()
    flat_lookup = median_us(lambda: flat.lookup(qh, ql), args.repeat)
    dict_lookup = median_us(lambda: list(map(index.get, qk)), args.repeat)

    # victims and new keys drawn before timing: each burst evicts 128 distinct blocks
    draws = [(rng.choice(n, 128, replace=False), rng.integers(1, 2**63, 128, dtype=np.uint64),
              rng.integers(1, 2**63, 128, dtype=np.uint64)) for _ in range(3 * args.repeat)]
    flat_draws, dict_draws = iter(draws[:args.repeat]), iter(
        [(v.tolist(), [(a << 64) | b for a, b in zip(h.tolist(), l.tolist())]) for v, h, l in draws[args.repeat:]])

    def flat_burst():
        victims, new_hi, new_lo = next(flat_draws)
        flat.delete(victims)
        flat.insert(victims, new_hi, new_lo)

    owner = dict(zip(range(n), keys))

    def dict_burst():
        victims, fresh = next(dict_draws)
        for block, key in zip(victims, fresh):
            del index[owner[block]]
            owner[block] = key
            index[key] = block

    flat_evict = median_us(flat_burst, args.repeat)
    dict_evict = median_us(dict_burst, args.repeat)
    to_columns = median_us(lambda: np.frombuffer(b"".join([h.to_bytes(16, "little") for h in qk]), np.uint64),
                           args.repeat)
    print(f"{n:,} blocks, medians of {args.repeat}")
    print(f"  bytes per block: flat {flat_bytes / n:.1f}, dict of hash ints -> block ints {dict_bytes / n:.1f}")
    print(f"  lookup of 2,048 random keys: flat {flat_lookup} us, dict {dict_lookup} us")
    print(f"  burst of 128 deletes + 128 inserts: flat {flat_evict} us, dict {dict_evict} us")
    print(f"  2,048 Python hash ints -> uint64 columns: {to_columns} us")
    print(probe_compiled(n, hi, lo, q, draws[2 * args.repeat:], args.repeat))


if __name__ == "__main__":
    main()
