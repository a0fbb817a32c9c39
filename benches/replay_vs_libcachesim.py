#!/usr/bin/env python
"""prefixkv's replay against libCacheSim's ``process_trace`` on the same block references (issue 28).

    .venv/bin/python benches/replay_vs_libcachesim.py [--runs 5] [--policies lru,fifo,...] [--json]

For each shared trace (Mooncake conversation and synthetic, weka-kv-cache-tester-more; a trace
not on this machine is left out) at 5% of its distinct blocks: ``replay(trace, policy, capacity)``'s
``replay_s`` (cache mode; the trace loaded, and converted to arrays, before the runs: loading is
no part of a replay) for LRU and the other policies asked for, and libCacheSim's LRU
``process_trace`` over the same block references, one request's ids after another, written once
to an oracleGeneral file (each id an object of size 1, so the cache holds ``capacity`` objects;
reading the file is inside libCacheSim's time, as it is in its own runs). Interleaved ``--runs``
times; medians reported, with each side's lookups per second.

The two do not count the same hits: libCacheSim looks every block up on its own, a paged prefix
cache stops at a request's first miss and pins its hits (the figures are the hit rates of each,
for the record, not a check). Acceptance in issue 28: prefixkv LRU ``replay_s`` <= libCacheSim's
seconds on every trace, and every compiled policy's ``replay_s`` <= 3x LRU's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "traces"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/traces")
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl",
          "weka-more": "weka-kv-cache-tester-more"}
FRACTION = 0.05
# oracleGeneral: per request uint32 time, uint64 object id, uint32 size, int64 next access (-1: unknown)
ORACLE_GENERAL = np.dtype([("time", "<u4"), ("id", "<u8"), ("size", "<u4"), ("next", "<i8")])


def shared_traces() -> dict[str, Path]:
    return {label: SHARED / name for label, name in TRACES.items() if (SHARED / name).exists()}


def load(path: Path):
    """The trace and its LRU capacity (5% of its distinct blocks), converted to arrays once."""
    from prefixkv.sim.replay import trace_block_arrays
    from prefixkv.sim.traces import load_trace

    trace = load_trace(path)
    trace_block_arrays(trace, 0)            # kept on the loaded trace: no replay pays it
    return trace, max(1, round(FRACTION * trace.distinct_blocks()))


def write_oracle_general(trace, out: Path) -> int:
    """The trace's block references, request after request, as an oracleGeneral file; their count."""
    from prefixkv.sim.replay import trace_block_arrays

    arrays = trace_block_arrays(trace, 0)
    records = np.zeros(arrays.ids.shape[0], ORACLE_GENERAL)
    records["time"] = np.repeat(np.arange(arrays.num_requests, dtype=np.uint32), np.diff(arrays.offsets))
    records["id"] = arrays.ids.astype(np.uint64) + 1          # 0 is no object id
    records["size"] = 1
    records["next"] = -1
    records.tofile(out)
    return records.shape[0]


def libcachesim_lru(path: Path, capacity: int) -> tuple[float, float]:
    """(seconds, object miss ratio) of libCacheSim's LRU over the oracleGeneral file ``path``."""
    import libcachesim as lcs

    reader = lcs.TraceReader(str(path), lcs.TraceType.ORACLE_GENERAL_TRACE)
    cache = lcs.LRU(capacity)
    started = time.perf_counter()
    miss_ratio, _ = cache.process_trace(reader)
    return time.perf_counter() - started, miss_ratio


def prefixkv_replay(trace, policy: str, capacity: int):
    from prefixkv.sim.replay import replay
    return replay(trace, policy, capacity)


def measure(runs: int, policies: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, path in shared_traces().items():
            trace, capacity = load(path)
            stream = Path(tmp) / f"{label}.oracleGeneral.bin"
            lookups = write_oracle_general(trace, stream)
            seconds: dict[str, list[float]] = {p: [] for p in ["libcachesim-lru", *policies]}
            hit_rates: dict[str, float] = {}
            engines: dict[str, str] = {}
            for _ in range(runs):
                s, miss = libcachesim_lru(stream, capacity)
                seconds["libcachesim-lru"].append(s)
                hit_rates["libcachesim-lru"] = 1.0 - miss
                for policy in policies:
                    result = prefixkv_replay(trace, policy, capacity)
                    seconds[policy].append(result.replay_s)
                    hit_rates[policy] = result.block_hit_rate
                    engines[policy] = result.engine
            medians = {p: statistics.median(v) for p, v in seconds.items()}
            rows.append({"trace": label, "capacity": capacity, "lookups": lookups, "runs": runs,
                         "median_s": {p: round(v, 4) for p, v in medians.items()},
                         "lookups_per_s": {p: round(lookups / v) for p, v in medians.items()},
                         "block_hit_rate": {p: round(v, 4) for p, v in hit_rates.items()},
                         "engine": engines,
                         "lru_vs_libcachesim": round(medians["lru"] / medians["libcachesim-lru"], 3)
                         if "lru" in medians else None,
                         "vs_lru": {p: round(medians[p] / medians["lru"], 2) for p in policies} if "lru" in medians else {}})
    return rows


def main(argv=None) -> int:
    from prefixkv.sim.fastreplay import COMPILED

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--policies", default=",".join(COMPILED), help="prefixkv policies to replay (lru first)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    policies = list(dict.fromkeys(["lru", *args.policies.split(",")]))
    rows = measure(args.runs, policies)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    for row in rows:
        print(f"{row['trace']}: capacity {row['capacity']:,}, {row['lookups']:,} lookups, medians of {row['runs']}")
        for policy, s in row["median_s"].items():
            ratio = f"  {row['vs_lru'][policy]}x lru" if policy in row["vs_lru"] else ""
            print(f"  {policy:16s} {s:8.4f} s  {row['lookups_per_s'][policy]:>12,}/s  "
                  f"hit rate {row['block_hit_rate'][policy]:.4f}{ratio}")
        print(f"  prefixkv lru / libCacheSim lru: {row['lru_vs_libcachesim']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
