#!/usr/bin/env python
"""LRU replay through prefixkv's pool against the hand-written OrderedDict loop, one run.

    .venv/bin/python benches/replay_vs_loop.py [--trace PATH] [--capacity 16114] [--runs 1] [--json]

Loads the trace once (``prefixkv.sim.traces.load_trace``; not timed), then, interleaved
``--runs`` times: ``prefixkv.sim.replay.replay(trace, "lru", capacity)`` (cache mode: the
real manager, pool and LRU policy; timed from the call to its return, so building its
prompts from the hash ids is inside) and ``lru_loop`` below over the same block
references (the lists of hash ids, taken from the loaded trace before timing).

Both count the same way (cache mode): requests in trace order, each request's hash
chain; a block hits only if every earlier block of the request hit; a request with
more blocks than the cache is all misses and changes nothing. The loop reproduces the
pool's LRU exactly: hits are pinned, the misses' blocks are allocated (oldest evictable
first), a missed hash still cached further down the chain is a duplicate that goes
back to the free list, and the request is released tail first. Hits and evictions must
be equal (asserted). Target in issue 17: replay within 1.5x of the loop.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import OrderedDict
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parent.parent / "shared" / "traces" / "weka-kv-cache-tester-more"
TARGET = 1.5


def lru_loop(chains, capacity: int) -> tuple[int, int]:
    """Block hits and evictions of an LRU prefix cache of ``capacity`` blocks, cache mode."""
    lru: OrderedDict = OrderedDict()   # evictable cached hashes, oldest first
    hits = evictions = 0
    for chain in chains:
        n = len(chain)
        if n > capacity:               # too long for the cache: all misses
            continue
        k = 0
        for h in chain:                # leading hits only
            if h not in lru:
                break
            k += 1
        hits += k
        for h in chain[:k]:            # pinned while the request holds them
            del lru[h]
        excess = len(lru) + n - capacity
        for _ in range(excess):        # fresh blocks: uncached free ones first, then the oldest
            lru.popitem(last=False)
        if excess > 0:
            evictions += excess
        kept = chain[:k] + [h for h in chain[k:] if h not in lru]   # the rest are duplicates
        for h in reversed(kept):       # released tail first
            lru[h] = None
    return hits, evictions


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", default=str(DEFAULT_TRACE))
    ap.add_argument("--capacity", type=int, default=16_114)
    ap.add_argument("--runs", type=int, default=1, help="interleaved runs of each (default 1)")
    ap.add_argument("--json", action="store_true", help="print one JSON line only")
    args = ap.parse_args(argv)

    from prefixkv.sim.replay import replay
    from prefixkv.sim.traces import load_trace

    t0 = time.perf_counter()
    trace = load_trace(args.trace)
    load_s = time.perf_counter() - t0
    if any(r.block_hashes is None for r in trace.requests):
        sys.exit("replay_vs_loop: needs a hashed trace (block hash ids per request)")
    chains = [list(r.block_hashes) for r in trace.requests]
    references = sum(map(len, chains))

    replay_t, loop_t, ratios = [], [], []
    result = None
    for _ in range(args.runs):
        t0 = time.perf_counter()
        result = replay(trace, "lru", args.capacity)
        replay_t.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        hits, evictions = lru_loop(chains, args.capacity)
        loop_t.append(time.perf_counter() - t0)
        ratios.append(replay_t[-1] / loop_t[-1])
        assert result.block_accesses == references, (result.block_accesses, references)
        assert result.block_hits == hits, ("hit counts differ", result.block_hits, hits)
        assert result.evictions == evictions, ("eviction counts differ", result.evictions, evictions)

    med = statistics.median
    out = {
        "trace": args.trace,
        "requests": len(trace),
        "block_size": trace.block_size,
        "capacity": args.capacity,
        "block_references": references,
        "block_hits": result.block_hits,
        "block_hit_rate": round(result.block_hit_rate, 5),
        "evictions": result.evictions,
        "load_s": round(load_s, 3),
        "replay_s": round(med(replay_t), 3),
        "loop_s": round(med(loop_t), 3),
        "replay_s_runs": [round(t, 3) for t in replay_t],
        "loop_s_runs": [round(t, 3) for t in loop_t],
        "ratio_runs": [round(r, 2) for r in ratios],
        "ratio": {"min": round(min(ratios), 2), "median": round(med(ratios), 2), "max": round(max(ratios), 2)},
        "target_ratio": TARGET,
        "met": med(ratios) <= TARGET,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print(f"{args.trace}: {len(trace):,} requests, {references:,} block references, "
              f"block size {trace.block_size}; loaded in {load_s:.2f} s (not timed)")
        print(f"LRU at {args.capacity:,} blocks: {result.block_hits:,} block hits "
              f"({100 * result.block_hit_rate:.2f}%), {result.evictions:,} evictions (equal in both)")
        print(f"replay (prefixkv.sim.replay): {out['replay_s']:.3f} s  runs {out['replay_s_runs']}")
        print(f"OrderedDict loop            : {out['loop_s']:.3f} s  runs {out['loop_s_runs']}")
        r = out["ratio"]
        print(f"replay / loop: {r['median']:.2f}x [{r['min']:.2f}..{r['max']:.2f}] per run {out['ratio_runs']} "
              f"(target <= {TARGET}x: {'met' if out['met'] else 'not met'})")
    return out


if __name__ == "__main__":
    main()
