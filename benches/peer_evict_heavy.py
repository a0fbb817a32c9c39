#!/usr/bin/env python
"""Eviction-heavy admission, vLLM 0.33.0's KVCacheManager or prefixkv's, one scenario.

    $ROOT/vllm-min/bin/python benches/peer_evict_heavy.py --impl vllm [--json]
    .venv/bin/python          benches/peer_evict_heavy.py --impl prefixkv [--json]
    <python> benches/peer_evict_heavy.py --impl X --memory 1048576 [--json]
    .venv/bin/python benches/peer_evict_heavy.py --impl prefixkv --empty-pool 1000000,100000000

The scenario (issue 17): a pool whose every usable block is cached and evictable; each
admission of a fresh 2,048-token prompt (block size 16: 128 blocks) evicts exactly 128
blocks, then the request is freed (its blocks become the newest evictable ones). Pools of
16k, 131k and 1M usable blocks (vLLM gets one block more: its block 0 is the null block).

Both sides get the same token ids (one seeded stream: the fill prompts, then the timed
ones) and do the same work per round, each split in three timed parts:

  hash  : vLLM  Request(prompt ids, block_hasher)      (Request construction, 128 hashes)
          prefixkv  mgr.prompt(ids).block_hashes()    (encode, 128 hashes)
  admit : vLLM  get_computed_blocks + allocate_slots   (via vllm_blockpool_bench.VllmAdapter.admit,
                                                        its Request construction subtracted)
          prefixkv  mgr.admit(rid, prompt)             (lookup on the hashes, allocate, publish)
  free  : both adapters' finish (block ids read for the count, then free)

Reported per size: medians of each part and of ``hash+admit+free`` (raw ids in: hashing
inside the timed region, the headline) and ``admit+free`` (hashing outside), and
evictions per second = 128 / the median. Evictions are asserted every round (outside the
timing): before each admission every usable block is cached and free (evictable), so the
128 blocks taken are all evictions, and afterwards the 128 new hashes are cached (vLLM:
``len(cached_block_hash_to_block)``; prefixkv: the pool's eviction counter as well).

The peers' folder (shared/peers, or $PREFIXKV_PEERS_DIR) is imported by path:
vllm_blockpool_bench.VllmAdapter builds and drives vLLM's manager exactly as the
peers' bench does; benches/peer_workload.PrefixKVAdapter drives prefixkv's.

``--memory N``: in one process, tracemalloc from before the pool is built until every
block is cached (fill prompts dropped, gc run): bytes per cached block, and the empty
pool's bytes per block. ``--empty-pool SIZES`` (prefixkv): construction time (median of
3 up to 10^7 blocks, else one; no tracemalloc), resident growth, and tracemalloc bytes per
block of an empty manager up to --trace-max blocks; a size whose estimated peak resident
memory (per block at the first size) exceeds --max-gb (10 GiB) or 80% of MemAvailable is
skipped with a note.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
import peer_workload  # noqa: E402  (standard library only at import)

SIZES = (16_384, 131_072, 1_048_576)
PROMPT_LEN = 2048
BLOCK_SIZE = 16
VOCAB = 32000


def prompt_stream(seed: int, length: int, vocab: int = VOCAB):
    """Fresh prompts from one seeded stream: the same ids in every python."""
    rng = random.Random(seed)
    population = range(vocab)
    while True:
        yield rng.choices(population, k=length)


def _load_peer_module(name: str):
    peers = peer_workload.peers_dir()
    if peers is None:
        peer_workload.load_workload()  # exits with the message
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, peers / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -- the two sides: the same four calls ------------------------------------------------
class VllmSide:
    """vLLM's real KVCacheManager through the peers' VllmAdapter (not copied: imported)."""

    def __init__(self, usable_blocks: int, block_size: int, prompt_len: int, hash_name: str) -> None:
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        bench = _load_peer_module("vllm_blockpool_bench")
        # one more block: vLLM keeps block 0 as its null block, never cached
        self.ad = bench.VllmAdapter(usable_blocks + 1, block_size, prompt_len + block_size, hash_name, 1)
        self.pool = self.ad.mgr.block_pool
        self.usable = usable_blocks
        import vllm

        self.impl = f"vllm-{vllm.__version__}-KVCacheManager"
        self.hash_name = hash_name

    def hash(self, rid, ids):
        return self.ad.new_request(rid, ids)

    def admit_raw(self, rid, ids):
        """Admission from raw ids (Request construction inside), as the peers' bench admits."""
        return self.ad.admit(rid, ids)

    def cached(self) -> int:
        return len(self.pool.cached_block_hash_to_block)

    def free_blocks(self) -> int:
        return self.pool.get_num_free_blocks()

    def evictions(self):
        return None  # no counter: evictions are proven by the cached/free counts

    def step_start(self):
        self.ad.on_step_start()


class PrefixKVSide:
    def __init__(self, usable_blocks: int, block_size: int, prompt_len: int, hash_name: str) -> None:
        import prefixkv

        self.ad = peer_workload.PrefixKVAdapter(usable_blocks, block_size, hash_name)
        self.mgr = self.ad.mgr
        self.pool = self.mgr.pool
        self.usable = usable_blocks
        self.impl = f"prefixkv-{prefixkv.__version__}-KVCacheManager"
        self.hash_name = hash_name

    def hash(self, rid, ids):
        prompt = self.mgr.prompt(ids)
        prompt.block_hashes()
        return prompt

    def admit_raw(self, rid, ids):
        return self.ad.admit(rid, ids)

    def cached(self) -> int:
        return self.pool.num_cached

    def free_blocks(self) -> int:
        return self.pool.num_free

    def evictions(self):
        return self.pool.evictions

    def step_start(self):
        pass


def make_side(impl: str, usable: int, args):
    if impl == "vllm":
        return VllmSide(usable, args.block_size, args.prompt_len, args.hash or "sha256")
    return PrefixKVSide(usable, args.block_size, args.prompt_len, args.hash or "xxh3_128")


def fill(side, prompts, block_size: int, prompt_len: int) -> float:
    """Cache every usable block (fresh prompts, admitted and freed); returns seconds."""
    per = prompt_len // block_size
    n = -(-side.usable // per)
    t0 = time.perf_counter()
    for i in range(n):
        handle, hit = side.admit_raw(f"fill-{i}", next(prompts))
        assert hit == 0, hit
        side.ad.finish(handle)
    elapsed = time.perf_counter() - t0
    assert side.cached() == side.usable and side.free_blocks() == side.usable, (
        side.cached(), side.free_blocks(), side.usable)
    return elapsed


def run_size(impl: str, usable: int, args, prompts) -> dict:
    side = make_side(impl, usable, args)
    per = args.prompt_len // args.block_size
    fill_s = fill(side, prompts, args.block_size, args.prompt_len)
    timed = [next(prompts) for _ in range(args.warmup + args.rounds)]
    gc.collect()
    ev0 = side.evictions()
    pc = time.perf_counter
    is_vllm = impl == "vllm"
    ad = side.ad
    hash_t, admit_t, free_t = [], [], []
    for i, ids in enumerate(timed):
        side.step_start()
        assert side.cached() == usable and side.free_blocks() == usable
        rid = f"r{i}"
        if is_vllm:
            # VllmAdapter.admit constructs the Request (hashing) and times it in create_s
            c0 = ad.create_s
            t0 = pc()
            handle, hit = ad.admit(rid, ids)
            t1 = pc()
            h = ad.create_s - c0
            a = t1 - t0 - h
        else:
            t0 = pc()
            prompt = side.hash(rid, ids)
            t1 = pc()
            handle, hit = ad.admit(rid, prompt)
            t2 = pc()
            h, a = t1 - t0, t2 - t1
        assert hit == 0, hit
        # the 128 new hashes are cached, so 128 cached blocks were evicted
        assert side.cached() == usable and side.free_blocks() == usable - per, (side.cached(), side.free_blocks())
        t0 = pc()
        ad.finish(handle)
        f = pc() - t0
        if i >= args.warmup:
            hash_t.append(h)
            admit_t.append(a)
            free_t.append(f)
    assert side.cached() == usable and side.free_blocks() == usable
    evictions = per * len(timed)
    if ev0 is not None:
        assert side.evictions() - ev0 == evictions, (side.evictions() - ev0, evictions)
    med = statistics.median
    both = [a + f for a, f in zip(admit_t, free_t)]
    allin = [h + a + f for h, a, f in zip(hash_t, admit_t, free_t)]
    out = {
        "blocks": usable,
        "rounds": len(allin),
        "evictions_per_admission": per,
        "evictions_checked": evictions,
        "fill_s": round(fill_s, 3),
        "hash_us": round(med(hash_t) * 1e6, 2),
        "admit_us": round(med(admit_t) * 1e6, 2),
        "free_us": round(med(free_t) * 1e6, 2),
        "admit_free_us": round(med(both) * 1e6, 2),
        "hash_admit_free_us": round(med(allin) * 1e6, 2),
        "evictions_per_s": round(per / med(allin), 1),
        "evictions_per_s_prehashed": round(per / med(both), 1),
    }
    del side, timed
    gc.collect()
    return out


# -- memory --------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory(impl: str, usable: int, args) -> dict:
    """tracemalloc, in this process: build the pool, then cache every block."""
    import tracemalloc

    prompts = prompt_stream(args.seed, args.prompt_len)
    if impl == "vllm":
        _load_peer_module("vllm_blockpool_bench")
    else:
        import prefixkv  # noqa: F401
    # One small pool first, untraced, on both sides: what is loaded once per process (modules,
    # prefixkv's compiled index loops from numba's cache) is not a cost per block.
    fill(make_side(impl, 2 * (args.prompt_len // args.block_size), args), prompts, args.block_size, args.prompt_len)
    gc.collect()
    rss0 = rss_bytes()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    side = make_side(impl, usable, args)
    build_s = time.perf_counter() - t0
    gc.collect()
    empty = tracemalloc.get_traced_memory()[0] - base
    fill(side, prompts, args.block_size, args.prompt_len)
    gc.collect()
    cached = tracemalloc.get_traced_memory()[0] - base
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    rss = rss_bytes() - rss0
    return {
        "blocks": usable,
        "impl": side.impl,
        "hash": side.hash_name,
        "bytes_per_cached_block": round(cached / usable, 1),
        "bytes_per_empty_block": round(empty / usable, 1),
        "traced_cached_mb": round(cached / 2**20, 1),
        "traced_peak_mb": round(peak / 2**20, 1),
        "rss_delta_mb": round(rss / 2**20, 1),
        "build_s_under_tracemalloc": round(build_s, 3),
        "note": "tracemalloc from before the pool is built to every block cached (fill prompts dropped; "
                "a small pool filled first, untraced); "
                + ("vLLM: usable+1 blocks (null block)" if impl == "vllm" else "prefixkv KVCacheManager"),
    }


def empty_pool(sizes: list[int], args) -> list[dict]:
    """prefixkv: construction time and bytes per block of an empty manager.

    Sizes up to --trace-max blocks: tracemalloc bytes per block as well (above it tracemalloc
    would trace each of the free list's int objects, multiplying time and memory); every size:
    resident growth (RSS) and peak (VmHWM) growth of the first construction."""
    import tracemalloc

    from prefixkv import KVCacheManager

    out = []
    rss_per_block = None
    for n in sizes:
        if rss_per_block is not None:
            estimate = rss_per_block * n
            avail = _mem_available()
            if estimate > args.max_gb * 2**30 or (avail is not None and estimate > 0.8 * avail):
                out.append({"blocks": n, "skipped": True,
                            "note": f"skipped: estimated {estimate / 2**30:.1f} GiB peak resident "
                                    f"({rss_per_block:.0f} B/block at {sizes[0]:,}) > limit "
                                    f"{args.max_gb:g} GiB"
                                    + (f" or 80% of MemAvailable {avail / 2**30:.1f} GiB" if avail else "")})
                continue
        gc.collect()
        times = []
        rss = hwm = None
        for rep in range(args.build_reps if n <= 10**7 else 1):
            r0, h0 = rss_bytes(), _vm_hwm()
            t0 = time.perf_counter()
            mgr = KVCacheManager(n, args.block_size, hash_seed=0)
            times.append(time.perf_counter() - t0)
            if rss is None:
                rss, hwm = rss_bytes() - r0, _vm_hwm() - h0
            del mgr
            gc.collect()
        if rss_per_block is None:
            rss_per_block = max(rss, hwm, 1) / n
        row = {"blocks": n, "build_s": round(statistics.median(times), 4),
               "build_s_all": [round(t, 4) for t in times],
               "rss_bytes_per_block": round(rss / n, 2), "rss_delta_mb": round(rss / 2**20, 1),
               "peak_rss_delta_mb": round(hwm / 2**20, 1)}
        if n <= args.trace_max:
            tracemalloc.start()
            base = tracemalloc.get_traced_memory()[0]
            mgr = KVCacheManager(n, args.block_size, hash_seed=0)
            row["bytes_per_block"] = round((tracemalloc.get_traced_memory()[0] - base) / n, 2)
            tracemalloc.stop()
            del mgr
            gc.collect()
        else:
            row["bytes_per_block"] = None
            row["note"] = f"no tracemalloc above {args.trace_max:,} blocks (see rss_bytes_per_block)"
        out.append(row)
    return out


def _vm_hwm() -> int:
    """Peak resident bytes of this process so far (VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("vllm", "prefixkv"), required=True)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)),
                    help="usable blocks, comma separated (default 16384,131072,1048576)")
    ap.add_argument("--rounds", type=int, default=200, help="timed admissions per size (default 200)")
    ap.add_argument("--warmup", type=int, default=10, help="untimed admissions first (default 10)")
    ap.add_argument("--prompt-len", type=int, default=PROMPT_LEN)
    ap.add_argument("--block-size", type=int, default=BLOCK_SIZE)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hash", default=None,
                    help="hash algorithm (vLLM default sha256, as the peers' bench; prefixkv xxh3_128)")
    ap.add_argument("--memory", type=int, metavar="BLOCKS", help="tracemalloc bytes per cached block instead")
    ap.add_argument("--empty-pool", metavar="SIZES", help="prefixkv: empty-pool bytes and construction time")
    ap.add_argument("--build-reps", type=int, default=3)
    ap.add_argument("--max-gb", type=float, default=10.0, help="skip empty pools estimated above this (GiB)")
    ap.add_argument("--trace-max", type=int, default=10**7,
                    help="--empty-pool: tracemalloc only up to this many blocks (default 10^7)")
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    args = ap.parse_args(argv)
    if args.prompt_len % args.block_size:
        ap.error("--prompt-len must be a multiple of --block-size")

    if args.empty_pool:
        if args.impl != "prefixkv":
            ap.error("--empty-pool measures prefixkv only")
        out = {"kind": "empty_pool", "impl": "prefixkv",
               "sizes": empty_pool([int(s) for s in args.empty_pool.split(",")], args)}
    elif args.memory:
        out = {"kind": "memory", **memory(args.impl, args.memory, args)}
    else:
        sizes = {}
        for n in (int(s) for s in args.sizes.split(",")):
            # every size starts from the same stream position: same ids on both sides
            prompts = prompt_stream(args.seed + n, args.prompt_len)
            sizes[str(n)] = run_size(args.impl, n, args, prompts)
        probe = make_side(args.impl, args.prompt_len // args.block_size, args)
        impl_name, hash_name = probe.impl, probe.hash_name
        out = {"kind": "evict_heavy", "impl": impl_name, "label": args.impl, "hash": hash_name,
               "prompt_len": args.prompt_len, "block_size": args.block_size,
               "timing": "per admission: hash (raw ids -> hashed request), admit (lookup + allocate "
                         "with 128 evictions + publish), free; medians",
               "sizes": sizes}
    if args.json:
        print(json.dumps(out))
    else:
        print(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
