#!/usr/bin/env python
"""Issue 17 before -> after in one run: an older source tree against this one, interleaved.

    git archive <rev> | tar -x -C /tmp/before        # the "before" tree (not a checkout)
    .venv/bin/python benches/ab_issue17.py --before /tmp/before [--runs 3] [--json PATH]

Each run, in this order: vLLM's eviction-heavy admission (benches/peer_evict_heavy.py with
vLLM's python, skipped when its venv is missing), then prefixkv "before" (this python with
PYTHONPATH=BEFORE, so ``import prefixkv`` is the old code; its ``policies/`` folder is linked
as ``prefixkv/policies`` when missing, as the package maps it), then prefixkv "after" (this
tree). Per side and run: the eviction-heavy scenario at --sizes, and the micro figures below
(median of repeats inside the run):

* ``hash_32k_us``: ``mgr.prompt(ids).block_hashes()`` of a 32,768-token list (encode + hash);
* ``match_32k_us``: ``mgr.match(prompt)`` of that prompt, hashed beforehand, fully cached, in a
  16,384-block pool whose every block is cached (test_bench_issue17's lookup);
* ``replay_s`` / ``loop_s``: ``replay(trace, "lru", 16114)`` on weka-kv-cache-tester-more (the
  call's wall time) and the hand-written OrderedDict loop over the same references
  (benches/replay_vs_loop.py), hits and evictions asserted equal.

Once per side after the runs: bytes per cached block at --memory-blocks (tracemalloc) and the
empty pool at --empty-sizes. Prints medians and per-run ratios (vLLM time / prefixkv time,
before and after; after / before for the micro figures).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_workload  # noqa: E402

EVICT = HERE / "peer_evict_heavy.py"


def micro(args) -> dict:
    """Run inside one side's python: the micro figures."""
    import random
    import time

    from prefixkv import KVCacheManager

    pc = time.perf_counter
    med = statistics.median
    rng = random.Random(0)
    ids = [rng.randrange(32000) for _ in range(32768)]
    mgr = KVCacheManager(4096, 16, hash_seed=0)
    times = []
    for _ in range(15):
        t0 = pc()
        mgr.prompt(ids).block_hashes()
        times.append(pc() - t0)
    out = {"hash_32k_us": round(med(times) * 1e6, 1)}

    mgr = KVCacheManager(16_384, 16, hash_seed=0)
    mgr.admit("long", ids)
    mgr.free("long")
    i = 0
    while mgr.pool.num_cached < mgr.pool.num_blocks:
        mgr.admit(f"f{i}", list(range(i * 2048, (i + 1) * 2048)))
        mgr.free(f"f{i}")
        i += 1
    prompt = mgr.prompt(ids)
    prompt.block_hashes()
    times = []
    for _ in range(200):
        t0 = pc()
        m = mgr.match(prompt)
        times.append(pc() - t0)
    assert m.hit_blocks == 2047, m
    out["match_32k_us"] = round(med(times) * 1e6, 1)

    if args.trace and Path(args.trace).is_dir():
        from prefixkv.sim.replay import replay
        from prefixkv.sim.traces import load_trace
        from replay_vs_loop import lru_loop

        trace = load_trace(args.trace)
        chains = [list(r.block_hashes) for r in trace.requests]
        t0 = pc()
        result = replay(trace, "lru", args.capacity)
        out["replay_s"] = round(pc() - t0, 3)
        t0 = pc()
        hits, evictions = lru_loop(chains, args.capacity)
        out["loop_s"] = round(pc() - t0, 3)
        assert (result.block_hits, result.evictions) == (hits, evictions)
        out["replay_block_hits"] = hits
    return out


def run(cmd: list[str], env: dict) -> dict:
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--before", help="source tree of the older commit")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="16384,131072,1048576")
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--memory-blocks", type=int, default=1_048_576)
    ap.add_argument("--empty-sizes", default="1000000,100000000")
    ap.add_argument("--trace", default=str(HERE.parent.parent / "shared" / "traces" / "weka-kv-cache-tester-more"))
    ap.add_argument("--capacity", type=int, default=16_114)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--micro", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.micro:
        print(json.dumps(micro(args)))
        return
    if not args.before:
        ap.error("--before PATH is needed")
    before = Path(args.before).resolve()
    link = before / "prefixkv" / "policies"
    if not link.exists() and (before / "policies").is_dir():
        link.symlink_to(before / "policies")

    base_env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    sides = {"before": {**base_env, "PYTHONPATH": str(before)}, "after": dict(base_env)}
    vllm_py = os.environ.get("VLLM_PY") or str(Path(os.environ.get("TMPDIR", "/tmp")) / "prefixkv-peers"
                                               / "vllm-min" / "bin" / "python")
    use_vllm = not args.no_vllm and Path(vllm_py).exists() and peer_workload.peers_dir() is not None
    evict_args = ["--json", "--sizes", args.sizes, "--rounds", str(args.rounds)]
    micro_args = ["--micro", "--trace", args.trace, "--capacity", str(args.capacity)]
    rows: list[dict] = []
    for r in range(args.runs):
        if use_vllm:
            rows.append({"side": "vllm", "run": r, "evict": run([vllm_py, str(EVICT), "--impl", "vllm", *evict_args],
                                                                 base_env)["sizes"]})
        for side, env in sides.items():
            row = {"side": side, "run": r,
                   "evict": run([sys.executable, str(EVICT), "--impl", "prefixkv", *evict_args], env)["sizes"]}
            row.update(run([sys.executable, str(Path(__file__).resolve()), *micro_args], env))
            rows.append(row)
            print(f"run {r} {side}: " + ", ".join(
                f"{n}: {v['hash_admit_free_us']} us" for n, v in row["evict"].items())
                + f"; hash {row['hash_32k_us']} us, match {row['match_32k_us']} us"
                + (f", replay {row['replay_s']} s / loop {row['loop_s']} s" if "replay_s" in row else ""),
                file=sys.stderr)
        if use_vllm:
            print(f"run {r} vllm: " + ", ".join(f"{n}: {v['hash_admit_free_us']} us"
                                               for n, v in rows[-3]["evict"].items()), file=sys.stderr)
    once = {}
    for side, env in sides.items():
        once[side] = {
            "memory": run([sys.executable, str(EVICT), "--impl", "prefixkv", "--json", "--memory",
                           str(args.memory_blocks)], env),
            "empty": run([sys.executable, str(EVICT), "--impl", "prefixkv", "--json", "--empty-pool",
                          args.empty_sizes], env)["sizes"],
        }
    if use_vllm:
        once["vllm"] = {"memory": run([vllm_py, str(EVICT), "--impl", "vllm", "--json", "--memory",
                                       str(args.memory_blocks)], base_env)}

    med = statistics.median
    summary: dict = {"evict": {}, "micro": {}}
    by = {side: [row for row in rows if row["side"] == side] for side in ("vllm", "before", "after")}
    for size in args.sizes.split(","):
        entry = {}
        for key in ("hash_admit_free_us", "admit_free_us", "free_us"):
            for side, side_rows in by.items():
                if side_rows:
                    entry[f"{side}_{key}"] = med(x["evict"][size][key] for x in side_rows)
        for side in ("before", "after"):
            if by["vllm"]:
                ratios = [v["evict"][size]["hash_admit_free_us"] / p["evict"][size]["hash_admit_free_us"]
                          for v, p in zip(by["vllm"], by[side])]
                entry[f"vllm_over_{side}"] = {"runs": [round(x, 2) for x in ratios], "min": round(min(ratios), 2),
                                              "median": round(med(ratios), 2), "max": round(max(ratios), 2)}
        summary["evict"][size] = entry
    for key in ("hash_32k_us", "match_32k_us", "replay_s", "loop_s"):
        if key in by["after"][0]:
            summary["micro"][key] = {side: med(x[key] for x in by[side]) for side in ("before", "after")}
    if "replay_s" in by["after"][0]:
        summary["micro"]["replay_over_loop"] = {
            side: {"runs": [round(x["replay_s"] / x["loop_s"], 2) for x in by[side]],
                   "median": round(med(x["replay_s"] / x["loop_s"] for x in by[side]), 2)}
            for side in ("before", "after")}
    summary["memory"] = {side: {k: v["memory"][k] for k in ("bytes_per_cached_block", "bytes_per_empty_block")}
                         for side, v in once.items()}
    summary["empty"] = {side: [{k: e.get(k) for k in ("blocks", "build_s", "bytes_per_block", "rss_bytes_per_block",
                                                      "skipped")} for e in v["empty"]]
                        for side, v in once.items() if "empty" in v}
    out = {"rows": rows, "once": once, "summary": summary}
    print(json.dumps(summary, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out))


if __name__ == "__main__":
    main()
