"""The disk block store against raw reads of the same files, in one run (issue 26's disk benchmarks).

    MALLOC_MMAP_THRESHOLD_=4194304 MALLOC_TRIM_THRESHOLD_=4294967296 \
        .venv/bin/python benches/disk_store_bench.py [--dir DIR] [--blocks 2048] [--repeat 7] [--open 10000,100000]

The two glibc settings keep freed values' memory in the heap: without them each run's 384 MiB
of values is sometimes fresh pages (page faults, for both readers alike) and sometimes not, and
the warm figures swing between 1.5 and 8.5 GiB/s from run to run on this machine.

Prints medians of:

* fetch: ``DiskBlockStore.fetch`` of a 32k-token prefix (2,048 blocks of 16 tokens; by default
  24 layers x 2 KV heads x 64 dims, bf16 = 192 KiB a block, a 0.5B model's, 384 MiB in all), every
  value verified (header checksum, fingerprint, hash, parent, dims, length, token ids, xxh3-128 of
  the payload), against a raw loop over the same files (open, read the known size, close; no
  checks), both holding every value as a tier would (target: store >= 80% of raw). Warm: the page
  cache holds the files. Cold: every file's pages dropped (``posix_fadvise(DONTNEED)``) before
  each timed run, for both readers (``/proc/sys/vm/drop_caches`` needs more than root in a
  container). The raw loop makes the store's own syscalls per file (open with the same flags, one
  ``read`` of the file's size + 1, close); "raw + decode" adds ``block_codec.decode`` of each
  value (the floor of a verified read on one thread), so the store's time above it is its own
  bookkeeping. Where the page cache is cold the store reads ``read_ahead`` (16) files ahead with
  ``POSIX_FADV_WILLNEED`` (the raw loop does not; the line "store without read-ahead",
  ``read_ahead=1``, is printed beside); the count of fetches that did is printed. Runs rotate
  raw / raw + decode / store / store without read-ahead so that other load falls on all alike;
  each line gives the median, [min-max] and the median of the paired raw/x ratios. Also the
  copy into host blocks (one preallocated array) after the verified fetch.
* open: rebuilding the index of a directory of N tiny blocks (names + stat, no reads), per N:
  the target is <= 1 s at 100,000. The inode cache is warm (the files were just written).
* put: the caller's cost of ``put`` (what a step pays) per block, one block per call and 64 per
  call, with the writer thread running.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402

from redis_fixtures import Blocks  # noqa: E402

from prefixkv.tiers.block_codec import decode  # noqa: E402
from prefixkv.tiers.disk_reader import READ_FLAGS  # noqa: E402
from prefixkv.tiers.disk_store import DiskBlockStore, DiskStoreConfig  # noqa: E402
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402

WEIGHTS = weights_digest([("w", np.arange(8, dtype=np.float32))])
TINY_FP = Fingerprint(WEIGHTS, "float16", layers=1, kv_heads=1, head_dim=8, block_size=4, hash_seed=11)


def median_s(fn, repeat: int, before=None) -> float:
    times = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def drop_pages(paths) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def bench_fetch(root: str, fp: Fingerprint, n: int, repeat: int) -> dict:
    blocks = Blocks(fp, n, seed=1)
    capacity = 2 * n * (fp.block_bytes + 4096)
    with DiskBlockStore(root, fp, capacity, DiskStoreConfig(fsync="none", queue_bytes=2**34,
                                                            queue_blocks=n)) as store:
        t0 = time.perf_counter()
        assert store.put(blocks.chain, 0, blocks.payloads, blocks.contents) == n
        assert store.flush(600)
        write_s = time.perf_counter() - t0
        paths = [store.layout.block_path(h) for h in blocks.chain]
        sizes = [os.path.getsize(p) for p in paths]
        total = sum(sizes)
        host = np.empty((n, fp.block_bytes), dtype=np.uint8)

        parents = [blocks.root, *blocks.chain[:-1]]

        def raw():
            # The store's own syscalls for a block (same flags, one read of the known size + 1 into a
            # fresh bytes, close) and nothing else: no checks, no bookkeeping.
            held = []
            for path, size in zip(paths, sizes):
                fd = os.open(path, READ_FLAGS)
                try:
                    held.append(os.read(fd, size + 1))
                finally:
                    os.close(fd)
            assert len(held) == n

        def raw_decode():
            # raw + block_codec.decode of each value: the floor of a verified read on one thread; the
            # store's time above it is its own bookkeeping, this line's above raw is verification.
            held = []
            contents, chain = blocks.contents, blocks.chain
            for j, (path, size) in enumerate(zip(paths, sizes)):
                fd = os.open(path, READ_FLAGS)
                try:
                    value = os.read(fd, size + 1)
                finally:
                    os.close(fd)
                held.append(decode(value, fp, chain[j], parents[j], contents[j]))
            assert len(held) == n

        no_read_ahead = DiskBlockStore(root, fp, capacity, DiskStoreConfig(fsync="none", read_ahead=1))

        def verified():
            got = store.fetch(blocks.chain, 0, n, blocks.contents)
            assert got.count == n and got.stop is None

        def verified_no_read_ahead():
            got = no_read_ahead.fetch(blocks.chain, 0, n, blocks.contents)
            assert got.count == n and got.stop is None

        def verified_into_host():
            got = store.fetch(blocks.chain, 0, n, blocks.contents)
            for j, payload in enumerate(got.payloads):
                host[j] = payload

        for _ in range(2):          # malloc settles (fresh pages vs reused ones) before anything is timed
            raw()
            verified()
        for path in paths:          # written back, so that DONTNEED can drop the pages for the cold runs
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        out = {"blocks": n, "block_bytes": fp.block_bytes, "file_bytes": total, "write_s": write_s}
        runs = {"raw": raw, "raw_decode": raw_decode, "store": verified, "plain": verified_no_read_ahead}
        for name, before in (("warm", None), ("cold", lambda: drop_pages(paths))):
            # interleaved, so load from other processes on the machine falls on every reader alike
            times = {key: [] for key in runs}
            ahead_before = getattr(store.stats(), "read_ahead_fetches", 0)
            for _ in range(repeat):
                for key, fn in runs.items():
                    times[key].append(median_s(fn, 1, before))
            raw_s = statistics.median(times["raw"])
            out[name] = {key: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t),
                               "ratio": raw_s / statistics.median(t),
                               "pair_ratio": statistics.median(r / v for r, v in zip(times["raw"], t))}
                         for key, t in times.items()}
            out[name]["read_ahead_fetches"] = getattr(store.stats(), "read_ahead_fetches", 0) - ahead_before
        out["warm"]["into_host_s"] = median_s(verified_into_host, repeat)
        no_read_ahead.close()
        return out


def bench_open(root: str, counts: list[int], repeat: int) -> dict:
    out = {}
    for count in counts:
        folder = os.path.join(root, f"open{count}")
        keys = [os.urandom(TINY_FP.hash_size) for _ in range(count)]
        payload = bytes(TINY_FP.block_bytes)
        config = DiskStoreConfig(fsync="none", queue_blocks=count, queue_bytes=2**31)
        with DiskBlockStore(folder, TINY_FP, 2**40, config) as store:
            for i in range(0, count, 1000):      # one chain of 1,000 blocks at a time
                store.set_many(keys[i:i + 1000], [payload] * len(keys[i:i + 1000]))
            assert store.flush(3600) and store.stats().writes == count

        opened = []

        def open_once():
            store = DiskBlockStore(folder, TINY_FP, 2**40, config)
            opened.append(store.stats().index_blocks)
            store.close()

        out[count] = median_s(open_once, repeat)
        assert set(opened) == {count}
        shutil.rmtree(folder)
    return out


def bench_put(root: str, repeat: int) -> dict:
    fp = TINY_FP
    n = 2048
    blocks = Blocks(fp, n, seed=2)
    out = {}
    for per_call in (1, 64):
        times = []
        for r in range(repeat):
            folder = os.path.join(root, f"put{per_call}-{r}")
            with DiskBlockStore(folder, fp, 2**30, DiskStoreConfig(fsync="none", queue_blocks=n)) as store:
                t0 = time.perf_counter()
                for i in range(0, n, per_call):
                    store.put(blocks.chain, i, blocks.payloads[i:i + per_call], blocks.contents[i:i + per_call])
                times.append((time.perf_counter() - t0) / n)
                store.flush(600)
            shutil.rmtree(folder)
        out[per_call] = statistics.median(times)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary folder under /tmp)")
    parser.add_argument("--blocks", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--open", default="1000,10000,100000", help="block counts for the open figure")
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="prefixkv-disk-bench-", dir=args.dir)
    try:
        fp = Fingerprint(WEIGHTS, "bfloat16", layers=args.layers, kv_heads=args.kv_heads, head_dim=args.head_dim,
                         block_size=16, hash_seed=11)
        fetch = bench_fetch(os.path.join(root, "fetch"), fp, args.blocks, args.repeat)
        shutil.rmtree(os.path.join(root, "fetch"))
        print(f"fetch of {fetch['blocks']} blocks x {fetch['block_bytes']} B ({fetch['file_bytes'] / 2**20:.0f} MiB "
              f"of files; written in {fetch['write_s']:.2f} s with fsync=none), medians of {args.repeat}:")
        labels = {"raw": "raw read", "raw_decode": "raw read + decode", "store": "verified store",
                  "plain": "store without read-ahead"}
        for name in ("warm", "cold"):
            f = fetch[name]
            print(f"  {name} (store fetches that read ahead: {f['read_ahead_fetches']} of {args.repeat}):")
            for key, label in labels.items():
                r = f[key]
                print(f"    {label:26s} {r['median_s'] * 1e3:7.1f} ms [{r['min_s'] * 1e3:.1f}-{r['max_s'] * 1e3:.1f}] "
                      f"{fetch['file_bytes'] / r['median_s'] / 2**30:5.2f} GiB/s  {100 * r['ratio']:4.0f}% of raw "
                      f"(paired runs {100 * r['pair_ratio']:.0f}%)")
        print(f"  warm, verified + copy into host blocks: {fetch['warm']['into_host_s'] * 1e3:.1f} ms")
        counts = [int(c) for c in args.open.split(",") if c]
        opens = bench_open(root, counts, max(3, args.repeat // 2))
        print("open (index rebuild, warm inode cache): " +
              ", ".join(f"{c:,} blocks {s * 1e3:.0f} ms ({s / c * 1e6:.1f} us/block)" for c, s in opens.items()))
        puts = bench_put(root, max(3, args.repeat // 2))
        print("put on the caller's thread: " +
              ", ".join(f"{k} block(s)/call {v * 1e6:.2f} us/block" for k, v in puts.items()))
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
