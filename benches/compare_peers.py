#!/usr/bin/env python
"""vLLM, SGLang and prefixkv on the same workload, in one invocation, interleaved.

    .venv/bin/python benches/compare_peers.py [--runs 3] [--json [PATH]] [-- extra bench args]

Runs shared/peers/vllm_blockpool_bench.py and shared/peers/sglang_radix_bench.py
with their venvs' pythons ($ROOT/vllm-min/bin/python, $ROOT/sglang-min/bin/python;
ROOT defaults to ${TMPDIR:-/tmp}/prefixkv-peers; VLLM_PY / SGLANG_PY override) and
benches/peer_workload.py with this python, N times each in the order
vLLM, SGLang, prefixkv, vLLM, ... so drift on the machine hits all three alike.
A peer whose venv is missing is skipped with a note. Prints median [min..max]
of each figure and prefixkv's requests/s over each peer's (ratio of medians).
Arguments after ``--`` go to every bench (e.g. ``-- --num-requests 500``).
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
    med = {lb: statistics.median(r["requests_per_s"] for r in by[lb]) for lb in labels if by[lb]}
    for peer in ("vLLM", "SGLang"):
        if peer in med and "prefixkv" in med:
            lines.append(f"prefixkv/{peer} requests_per_s (ratio of medians): "
                         f"{med['prefixkv'] / med[peer]:.2f}x")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="runs of each bench (default 3)")
    ap.add_argument("--json", nargs="?", const="-", metavar="PATH",
                    help="write every run's row as JSON lines to PATH (stdout if no PATH)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per bench run")
    ap.add_argument("extra", nargs="*", help="after --: arguments for every bench")
    args = ap.parse_args(argv)

    peers = peer_workload.peers_dir()
    if peers is None:
        peer_workload.load_workload()  # exits with the message
    root = Path(os.environ.get("ROOT") or Path(os.environ.get("TMPDIR") or "/tmp") / "prefixkv-peers")
    impls, notes = implementations(peers, root)
    for note in notes:
        print(note, file=sys.stderr)
    labels = [label for label, _ in impls]
    print(f"peers: {peers}; ROOT: {root}; runs: {args.runs}; order: {', '.join(labels)} (interleaved)",
          file=sys.stderr)

    rows = []
    failed: set[str] = set()
    for i in range(args.runs):
        for label, cmd in impls:
            if label in failed:
                continue
            try:
                row = run_one(label, cmd, args.extra, args.timeout)
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                if label == "prefixkv":
                    raise
                print(f"note: dropping {label} from this comparison: {exc}", file=sys.stderr)
                failed.add(label)
                continue
            print(f"  run {i + 1}/{args.runs} {label:<8} requests/s {row['requests_per_s']:>10,.1f}  "
                  f"({row['process_s']} s with imports)", file=sys.stderr)
            rows.append(row)

    labels = [label for label in labels if label not in failed]
    digests = {r["workload_digest"] for r in rows}
    hits = {r["hit_tokens"] for r in rows}
    print(table(rows, labels))
    if len(digests) != 1 or len(hits) != 1:
        print(f"WARNING: implementations disagree: digests {digests}, hit_tokens {hits}")

    if args.json:
        text = "\n".join(json.dumps(r) for r in rows) + "\n"
        if args.json == "-":
            sys.stdout.write(text)
        else:
            Path(args.json).write_text(text)
            print(f"wrote {len(rows)} rows to {args.json}", file=sys.stderr)
    return rows


if __name__ == "__main__":
    main()
