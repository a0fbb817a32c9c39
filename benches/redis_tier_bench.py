"""Redis block store on loopback, in one run beside raw redis-py (issue 14, acceptance point 6).

    .venv/bin/python benches/redis_tier_bench.py [--blocks 64] [--repeat 15]

Starts its own redis-server (needs the binary: apt-get install -y redis-server) and prints
medians of:

* reads: ``RedisBlockStore.fetch`` of 64 blocks (MGET in ~8 MiB batches + full verification:
  header checksum, fingerprint, hash, parent, dims, length, token ids, xxh3-128 of every
  payload) against raw redis-py ``mget`` of the same keys in the same batches, no checks,
  its values held by the caller as the tier's are (target: tier >= 80% of raw throughput).
  For reference also a raw loop that drops each batch at once: glibc then reuses the same
  pages, while 32 MiB handed out at once are fresh pages (page faults) for both readers;
* a 64-block probe (4 groups of 16) with the Lua script and with pipelined EXISTS (target <= 0.5 ms);
* the cost of a call while the breaker is open (server killed; target <= 5 us).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

import numpy as np  # noqa: E402

from redis_fixtures import Blocks, RedisServer  # noqa: E402

from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402

# 512 KiB blocks (8 layers x 8 KV heads x 128 dims x 16 tokens, bf16): 16 per group = 8 MiB.
READ_FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "bfloat16", layers=8, kv_heads=8,
                      head_dim=128, block_size=16, hash_seed=11)
# Small blocks for the probe and breaker figures (their cost does not depend on the block size).
SMALL_FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                       head_dim=8, block_size=16, hash_seed=11)


def median_s(fn, repeat: int, number: int = 1) -> float:
    """Median over ``repeat`` timings of ``number`` calls, per call."""
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(number):
            fn()
        times.append((time.perf_counter() - t0) / number)
    return statistics.median(times)


def measure(url: str, *, blocks: int = 64, repeat: int = 15, probe_number: int = 200) -> dict:
    """Every figure against the server at ``url`` (which must be up and may be flushed)."""
    import redis

    from prefixkv.tiers.redis_store import RedisBlockStore, RedisStoreConfig

    out: dict = {}
    data = Blocks(READ_FP, blocks, seed=1)
    with RedisBlockStore(url, READ_FP) as store:
        store.clear()
        store.put(data.chain, 0, data.payloads, data.contents)
        assert store.flush(60) and store.probe(data.chain) == blocks, store.stats()
        nbytes = blocks * READ_FP.block_bytes

        held: list = []

        def tier():
            got = store.fetch(data.chain, 0, blocks, data.contents)
            assert got.count == blocks
            held[:] = [got]           # the caller holds what it fetched until it has staged it

        batches = [store.keys.keys(data.chain, a, b) for a, b in store.keys.group_ranges(0, blocks)]
        raw = redis.Redis.from_url(url)

        def raw_mget():
            values = [v for keys in batches for v in raw.mget(keys)]
            assert sum(len(v) for v in values) >= nbytes
            held[:] = [values]        # the same bytes, handed out the same way

        def raw_mget_dropped():
            # each batch dropped before the next arrives: the allocator reuses its pages, which a
            # reader handing out all the blocks cannot do (shown for reference, not the baseline)
            assert sum(len(v) for keys in batches for v in raw.mget(keys)) >= nbytes

        runs = {"tier": tier, "raw": raw_mget, "raw_dropped": raw_mget_dropped}
        for fn in runs.values():
            fn()                      # warm connections
        # interleaved, so drifting load on a shared machine hits all three alike
        times: dict = {name: [] for name in runs}
        for _ in range(repeat):
            for name, fn in runs.items():
                held.clear()
                times[name].append(median_s(fn, 1))
        held.clear()
        out["read_blocks"] = blocks
        out["read_mib"] = nbytes / 2**20
        out["tier_read_s"] = statistics.median(times["tier"])
        out["raw_mget_s"] = statistics.median(times["raw"])
        out["raw_dropped_s"] = statistics.median(times["raw_dropped"])
        out["tier_gib_s"] = nbytes / out["tier_read_s"] / 2**30
        out["raw_gib_s"] = nbytes / out["raw_mget_s"] / 2**30
        out["raw_dropped_gib_s"] = nbytes / out["raw_dropped_s"] / 2**30
        out["tier_vs_raw"] = out["raw_mget_s"] / out["tier_read_s"]
        out["tier_vs_raw_dropped"] = out["raw_dropped_s"] / out["tier_read_s"]
        raw.close()
        store.clear()

    probe_data = Blocks(SMALL_FP, 64, seed=2)
    for mode in ("lua", "exists"):
        with RedisBlockStore(url, SMALL_FP, RedisStoreConfig(probe_mode=mode)) as store:
            store.put(probe_data.chain, 0, probe_data.payloads)
            assert store.flush() and store.probe(probe_data.chain) == 64
            out[f"probe64_{mode}_s"] = median_s(lambda: store.probe(probe_data.chain), repeat, probe_number)
            store.clear()
    return out


def measure_open_breaker(url: str, *, repeat: int = 15, number: int = 20000) -> dict:
    """Per-call cost while the breaker is open; ``url`` must point at a dead server."""
    from prefixkv.tiers.redis_store import RedisBlockStore

    data = Blocks(SMALL_FP, 64, seed=3)
    with RedisBlockStore(url, SMALL_FP) as store:
        store.probe(data.chain)                       # the failure that opens the breaker
        assert store.stats().nodes_down == 1
        return {"open_probe_s": median_s(lambda: store.probe(data.chain), repeat, number),
                "open_fetch_s": median_s(lambda: store.fetch(data.chain, 0, 64), repeat, number),
                "open_put_s": median_s(lambda: store.put(data.chain, 0, data.payloads[:4]), repeat, number)}


def report(figures: dict) -> str:
    f = figures
    return "\n".join([
        f"reads, {f['read_blocks']} blocks of {READ_FP.block_bytes // 1024} KiB ({f['read_mib']:.0f} MiB), medians:",
        f"  tier fetch (MGET + full verification) {f['tier_read_s'] * 1e3:8.2f} ms  {f['tier_gib_s']:5.2f} GiB/s",
        f"  raw redis-py mget, same batches       {f['raw_mget_s'] * 1e3:8.2f} ms  {f['raw_gib_s']:5.2f} GiB/s",
        f"  tier / raw throughput                 {f['tier_vs_raw'] * 100:7.0f} %   (target >= 80 %)",
        f"  (raw, each batch dropped at once      {f['raw_dropped_s'] * 1e3:8.2f} ms  {f['raw_dropped_gib_s']:5.2f} GiB/s; "
        f"tier / that {f['tier_vs_raw_dropped'] * 100:.0f} %)",
        "probe of 64 blocks (4 groups of 16, one round trip), median:",
        f"  Lua script                            {f['probe64_lua_s'] * 1e3:8.3f} ms  (target <= 0.5 ms)",
        f"  pipelined EXISTS                      {f['probe64_exists_s'] * 1e3:8.3f} ms",
        "breaker open (server down), median cost per call:",
        f"  probe {f['open_probe_s'] * 1e6:.2f} us   fetch {f['open_fetch_s'] * 1e6:.2f} us   "
        f"put {f['open_put_s'] * 1e6:.2f} us  (target <= 5 us)",
    ])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=64)
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args(argv)
    if shutil.which("redis-server") is None:
        print("redis-server is not installed (apt-get install -y redis-server)", file=sys.stderr)
        return 2
    server = RedisServer(Path(tempfile.mkdtemp(prefix="pkv-bench-")), maxmemory="1gb").start()
    try:
        figures = measure(server.url, blocks=args.blocks, repeat=args.repeat)
        url = server.url
    finally:
        server.stop()
    figures.update(measure_open_breaker(url, repeat=args.repeat))
    print(report(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
