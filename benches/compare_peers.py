#!/usr/bin/env python
"""vLLM, SGLang and prefixkv on the same workloads, in one invocation, interleaved.

    .venv/bin/python benches/compare_peers.py [--runs 3] [--scenarios peers,evict,memory,empty]
        [--sizes 16384,131072,1048576] [--json [PATH]] [-- extra args for the peers' benches]

Scenarios (all by default):

* ``peers``: shared/peers/vllm_blockpool_bench.py and shared/peers/sglang_radix_bench.py
  with their venvs' pythons ($ROOT/vllm-min/bin/python, $ROOT/sglang-min/bin/python;
  ROOT defaults to ${TMPDIR:-/tmp}/prefixkv-peers; VLLM_PY / SGLANG_PY override) and
  benches/peer_workload.py with this python, N times each in the order
  vLLM, SGLang, prefixkv, vLLM, ... so drift on the machine hits all three alike.
  Arguments after ``--`` go to these benches (e.g. ``-- --num-requests 500``).
* ``evict``: issue 17's eviction-heavy admission (benches/peer_evict_heavy.py: every block
  cached and evictable, each fresh 2,048-token prompt evicts 128 blocks, then is freed) at
  each of --sizes, vLLM's KVCacheManager (vLLM's python) and prefixkv's (this python),
  interleaved vLLM, prefixkv, vLLM, ... (one process per run does every size).
* ``memory``: tracemalloc bytes per cached block at --memory-blocks (1M), both, once each,
  in the process that built the pool.
* ``empty``: prefixkv's empty pool at --empty-sizes (10^6, 10^8): construction time and
  bytes per block (10^8 is skipped with a note when it would exceed ~10 GiB).

A peer whose venv is missing is skipped with a note. Prints median [min..max] of each
figure, and for every pairing prefixkv / peer **per run** (run i of prefixkv against run i
of the peer, interleaved) with the min / median / max of those per-run ratios, beside the
ratio of medians. Ratios are speedups (> 1: prefixkv faster): requests/s over requests/s,
evictions/s over evictions/s (= the peer's time per admission over prefixkv's).

``--json [PATH]``: one JSON object: ``rows`` (every run's row, with its ``scenario`` and
``run``), ``ratios`` (per scenario, pairing and size: ``runs``, ``min``, ``median``,
``max``, ``ratio_of_medians``), ``memory``, ``empty_pool`` and ``notes``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import peer_workload  # noqa: E402

KEYS = ["requests_per_s", "block_ops_per_s", "hit_tokens", "long_hash_ms", "long_match_ms",
        "long_hash_plus_match_ms"]
EXTRA_KEYS = ["wall_s", "admit_s", "decode_s", "free_s", "long_hit_tokens"]


def implementations(peers: Path, root: Path) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """(label, argv) of each bench to run, and notes about those skipped."""
    impls, notes = [], []
    for label, env, venv, script in (
        ("vLLM", "VLLM_PY", "vllm-min", "vllm_blockpool_bench.py"),
        ("SGLang", "SGLANG_PY", "sglang-min", "sglang_radix_bench.py"),
    ):
        py = Path(os.environ.get(env) or root / venv / "bin" / "python")
        if not (py.is_file() and os.access(py, os.X_OK)):
            notes.append(f"note: skipping {label}: no venv python at {py} "
                         f"(build it with {peers / 'setup_venvs.sh'}, or set ROOT / {env})")
            continue
        if not (peers / script).is_file():
            notes.append(f"note: skipping {label}: {peers / script} not found")
            continue
        impls.append((label, [str(py), str(peers / script)]))
    impls.append(("prefixkv", [sys.executable, str(HERE / "peer_workload.py")]))
    return impls, notes


EVICT_KEYS = ["hash_admit_free_us", "admit_free_us", "hash_us", "admit_us", "free_us", "evictions_per_s",
              "evictions_per_s_prehashed", "fill_s"]
EVICT_SCRIPT = HERE / "peer_evict_heavy.py"
SCENARIOS = ("peers", "evict", "memory", "empty")


def peer_python(label: str, root: Path) -> Path | None:
    env, venv = {"vLLM": ("VLLM_PY", "vllm-min"), "SGLang": ("SGLANG_PY", "sglang-min")}[label]
    py = Path(os.environ.get(env) or root / venv / "bin" / "python")
    return py if py.is_file() and os.access(py, os.X_OK) else None


def run_one(label: str, argv: list[str], extra: list[str], timeout: float) -> dict:
    env = dict(os.environ)
    env.setdefault(peer_workload.PEERS_ENV, str(peer_workload.peers_dir()))
    t0 = time.perf_counter()
    proc = subprocess.run(argv + ["--json"] + extra, capture_output=True, text=True, timeout=timeout,
                          env=env)
    elapsed = time.perf_counter() - t0
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:] or ["(no output)"]
        raise RuntimeError(f"{label} bench failed (rc {proc.returncode}):\n  " + "\n  ".join(tail))
    row = json.loads(lines[-1])
    row["label"] = label
    row["process_s"] = round(elapsed, 2)
    return row


def cell(xs: list) -> str:
    if not xs:
        return "-"
    med = statistics.median(xs)

    def fmt(v):
        if isinstance(v, int):
            return f"{v:,}"
        return f"{v:,.1f}" if abs(v) >= 100 else f"{v:.3f}"

    return f"{fmt(med)} [{fmt(min(xs))}..{fmt(max(xs))}]"


def spread(ours: list[float], theirs: list[float]) -> dict:
    """prefixkv / peer per interleaved run (run i with run i), their spread, the ratio of medians."""
    runs = [a / b for a, b in zip(ours, theirs)]
    if not runs:
        return {}
    return {"runs": [round(r, 3) for r in runs], "min": round(min(runs), 3),
            "median": round(statistics.median(runs), 3), "max": round(max(runs), 3),
            "ratio_of_medians": round(statistics.median(ours) / statistics.median(theirs), 3)}


def ratio_line(name: str, r: dict) -> str:
    return (f"{name}: per run {', '.join(f'{x:.2f}' for x in r['runs'])}x; "
            f"min / median / max {r['min']:.2f} / {r['median']:.2f} / {r['max']:.2f}x; "
            f"ratio of medians {r['ratio_of_medians']:.2f}x")


def table(rows: list[dict], labels: list[str]) -> str:
    by = {label: [r for r in rows if r["label"] == label] for label in labels}
    width = max(34, *(len(cell([r.get(k) for r in by[lb] if k in r])) + 2
                      for lb in labels for k in KEYS + EXTRA_KEYS))
    lines = [f"{'metric':<26}" + "".join(f"{lb:>{width}}" for lb in labels)]
    for k in KEYS + EXTRA_KEYS:
        lines.append(f"{k:<26}" + "".join(
            f"{cell([r[k] for r in by[lb] if k in r and r[k] is not None]):>{width}}" for lb in labels))
    lines.append("runs: " + ", ".join(f"{lb} {len(by[lb])}" for lb in labels)
                 + "; impl: " + ", ".join(sorted({r['impl'] for r in rows}))
                 + "; workload_digest: " + ", ".join(sorted({r['workload_digest'] for r in rows})))
    return "\n".join(lines)


def peers_ratios(rows: list[dict], labels: list[str]) -> dict:
    ours = [r["requests_per_s"] for r in rows if r["label"] == "prefixkv"]
    return {peer: {"metric": "requests_per_s", **spread(ours, [r["requests_per_s"] for r in rows
                                                                if r["label"] == peer])}
            for peer in ("vLLM", "SGLang") if peer in labels and "prefixkv" in labels}


def evict_table(rows: list[dict]) -> tuple[str, dict]:
    labels = [lb for lb in ("vLLM", "prefixkv") if any(r["label"] == lb for r in rows)]
    by = {lb: [r for r in rows if r["label"] == lb] for lb in labels}
    sizes = list(rows[0]["sizes"]) if rows else []
    lines, ratios = [], {}
    for size in sizes:
        lines.append(f"-- {int(size):,} blocks: fresh {rows[0]['prompt_len']:,}-token prompt, "
                     f"{rows[0]['sizes'][size]['evictions_per_admission']} evictions per admission "
                     f"(checked), medians of {rows[0]['sizes'][size]['rounds']} admissions per run")
        width = 34
        lines.append(f"{'metric':<28}" + "".join(f"{lb:>{width}}" for lb in labels))
        for k in EVICT_KEYS:
            lines.append(f"{k:<28}" + "".join(
                f"{cell([r['sizes'][size][k] for r in by[lb]]):>{width}}" for lb in labels))
        if len(labels) == 2:
            ours = by["prefixkv"]
            theirs = by["vLLM"]
            ratios[size] = {
                "hash_admit_free": {"metric": "evictions_per_s (hashing from raw ids inside the timing)",
                                    **spread([r["sizes"][size]["evictions_per_s"] for r in ours],
                                             [r["sizes"][size]["evictions_per_s"] for r in theirs])},
                "admit_free": {"metric": "evictions_per_s_prehashed (hashing outside the timing)",
                               **spread([r["sizes"][size]["evictions_per_s_prehashed"] for r in ours],
                                        [r["sizes"][size]["evictions_per_s_prehashed"] for r in theirs])},
            }
            lines.append(ratio_line("prefixkv/vLLM evictions/s, hash+admit+free", ratios[size]["hash_admit_free"]))
            lines.append(ratio_line("prefixkv/vLLM evictions/s, admit+free     ", ratios[size]["admit_free"]))
    if rows:
        lines.append("impl: " + ", ".join(sorted({f"{r['impl']} ({r['hash']})" for r in rows})))
    return "\n".join(lines), ratios


def interleave(impls: list[tuple[str, list[str]]], runs: int, extra: list[str], timeout: float,
               scenario: str, progress) -> tuple[list[dict], set[str]]:
    rows: list[dict] = []
    failed: set[str] = set()
    for i in range(runs):
        for label, cmd in impls:
            if label in failed:
                continue
            try:
                row = run_one(label, cmd, extra, timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                if label == "prefixkv":
                    raise
                print(f"note: dropping {label} from the {scenario} comparison: {exc}", file=sys.stderr)
                failed.add(label)
                continue
            row["scenario"] = scenario
            row["run"] = i + 1
            print(f"  {scenario} run {i + 1}/{runs} {label:<8} {progress(row)}  "
                  f"({row['process_s']} s with imports)", file=sys.stderr)
            rows.append(row)
    if failed:  # unpaired runs would pair run i with another run: keep only complete peers
        rows = [r for r in rows if r["label"] not in failed]
    return rows, failed


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs of each bench (default 3)")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS),
                    help=f"comma separated, of {', '.join(SCENARIOS)} (default all)")
    ap.add_argument("--sizes", default="16384,131072,1048576", help="evict: usable blocks per pool")
    ap.add_argument("--evict-rounds", type=int, default=200, help="evict: timed admissions per size and run")
    ap.add_argument("--memory-blocks", type=int, default=1_048_576, help="memory: blocks (default 1M)")
    ap.add_argument("--empty-sizes", default="1000000,100000000", help="empty: prefixkv pool sizes")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH",
                    help="write one JSON object (rows, ratios, memory, empty_pool, notes) to PATH "
                         "(stdout if no PATH)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per bench run")
    ap.add_argument("extra", nargs="*", help="after --: arguments for the peers scenario's benches")
    args = ap.parse_args(argv)
    scenarios = [x.strip() for x in args.scenarios.split(",") if x.strip()]
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        ap.error(f"unknown scenario(s) {', '.join(sorted(unknown))}; choose from {', '.join(SCENARIOS)}")

    peers = peer_workload.peers_dir()
    if peers is None:
        peer_workload.load_workload()  # exits with the message
    root = Path(os.environ.get("ROOT") or Path(os.environ.get("TMPDIR") or "/tmp") / "prefixkv-peers")
    notes: list[str] = []
    rows: list[dict] = []
    ratios: dict = {}
    memory: dict = {}
    empty: list = []
    reports: list[str] = []

    def note(text: str) -> None:
        notes.append(text)
        print("note: " + text, file=sys.stderr)

    if "peers" in scenarios:
        impls, skipped = implementations(peers, root)
        for text in skipped:
            note(text.removeprefix("note: "))
        labels = [label for label, _ in impls]
        print(f"peers: {peers}; ROOT: {root}; runs: {args.runs}; order: {', '.join(labels)} (interleaved)",
              file=sys.stderr)
        prow, failed = interleave(impls, args.runs, args.extra, args.timeout, "peers",
                                  lambda r: f"requests/s {r['requests_per_s']:>10,.1f}")
        labels = [label for label in labels if label not in failed]
        rows += prow
        digests = {r["workload_digest"] for r in prow}
        hits = {r["hit_tokens"] for r in prow}
        text = "== peers' workload ==\n" + table(prow, labels)
        ratios["peers"] = peers_ratios(prow, labels)
        for peer, r in ratios["peers"].items():
            text += "\n" + ratio_line(f"prefixkv/{peer} requests_per_s", r)
        if len(digests) != 1 or len(hits) != 1:
            text += f"\nWARNING: implementations disagree: digests {digests}, hit_tokens {hits}"
        reports.append(text)

    vllm_py = peer_python("vLLM", root)
    if vllm_py is None and {"evict", "memory"} & set(scenarios):
        note(f"vLLM has no venv python under {root} (build it with {peers / 'setup_venvs.sh'} vllm, or set "
             "ROOT / VLLM_PY): the eviction-heavy and memory scenarios run prefixkv alone")
    evict_impls = ([("vLLM", [str(vllm_py), str(EVICT_SCRIPT), "--impl", "vllm"])] if vllm_py else []) + \
        [("prefixkv", [sys.executable, str(EVICT_SCRIPT), "--impl", "prefixkv"])]

    if "evict" in scenarios:
        eargs = ["--sizes", args.sizes, "--rounds", str(args.evict_rounds)]
        print(f"eviction-heavy: sizes {args.sizes}; runs: {args.runs}; order: "
              f"{', '.join(lb for lb, _ in evict_impls)} (interleaved)", file=sys.stderr)
        erow, _ = interleave([(lb, cmd + eargs) for lb, cmd in evict_impls], args.runs, [], args.timeout,
                             "evict", lambda r: "hash+admit+free us " + ", ".join(
                                 f"{int(n):,}: {v['hash_admit_free_us']:.1f}" for n, v in r["sizes"].items()))
        rows += erow
        text, ratios["evict_heavy"] = evict_table(erow)
        reports.append("== eviction-heavy admission ==\n" + text)

    if "memory" in scenarios:
        margs = ["--memory", str(args.memory_blocks)]
        for label, cmd in evict_impls:
            row = run_one(label, cmd + margs, [], args.timeout)
            print(f"  memory {label:<8} {row['bytes_per_cached_block']} B per cached block "
                  f"({row['process_s']} s)", file=sys.stderr)
            memory[label] = row
        reports.append(f"== memory at {args.memory_blocks:,} blocks (tracemalloc, in the process that built "
                       "the pool: construction + every block cached) ==\n" + "\n".join(
                           f"{lb:<9} {m['bytes_per_cached_block']:>7.1f} B per cached block, "
                           f"{m['bytes_per_empty_block']:>7.1f} B per block empty; RSS growth "
                           f"{m['rss_delta_mb']:,.1f} MB ({m['impl']}, {m['hash']})" for lb, m in memory.items()))

    if "empty" in scenarios:
        row = run_one("prefixkv", [sys.executable, str(EVICT_SCRIPT), "--impl", "prefixkv", "--empty-pool",
                                   args.empty_sizes], [], args.timeout)
        empty = row["sizes"]
        lines = []
        for e in empty:
            if e.get("skipped"):
                lines.append(f"{e['blocks']:>12,} blocks: {e['note']}")
                note(f"empty pool of {e['blocks']:,} blocks {e['note']}")
                continue
            traced = (f"{e['bytes_per_block']:.1f} B per block (tracemalloc)" if e["bytes_per_block"] is not None
                      else "no tracemalloc")
            lines.append(f"{e['blocks']:>12,} blocks: built in {e['build_s']:.3f} s; {traced}; "
                         f"RSS {e['rss_bytes_per_block']:.1f} B per block (peak growth "
                         f"{e['peak_rss_delta_mb']:,.0f} MB)")
        reports.append("== prefixkv empty pool ==\n" + "\n".join(lines))

    print("\n\n".join(reports))

    if args.json:
        doc = {"scenarios": scenarios, "runs": args.runs, "rows": rows, "ratios": ratios, "memory": memory,
               "empty_pool": empty, "notes": notes}
        text = json.dumps(doc) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
            print(f"wrote {len(rows)} rows and the ratios to {args.json}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
