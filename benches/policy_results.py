#!/usr/bin/env python
"""Every built-in policy on the four shared traces at 2 / 5 / 10 % of their distinct blocks:
block hit rates, as a section of ``benches/RESULTS.md`` (issue 28).

    .venv/bin/python benches/policy_results.py [--workers 2] [--out benches/RESULTS.md]

Cache mode, no tiers, no warm-up exclusion; the traces are the shared ones (Mooncake
conversation and synthetic, weka-kv-cache-tester, weka-kv-cache-tester-more; a trace not on this
machine is left out). Each trace runs as one ``prefixkv.sim.sweep`` (``prefixkv compare``'s): all
policies x three capacities, ``--workers`` processes. ``belady`` is the offline bound, listed last.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import date
from pathlib import Path

HERE = Path(__file__).resolve().parent
SHARED = HERE.parent.parent / "shared" / "traces"
if not SHARED.is_dir():
    SHARED = Path("/work/shared/traces")
TRACES = {"conversation": "conversation_trace.jsonl", "synthetic": "synthetic_trace.jsonl",
          "weka": "weka-kv-cache-tester", "weka-more": "weka-kv-cache-tester-more"}
FRACTIONS = (0.02, 0.05, 0.10)
SECTION = "## Every policy on the four shared traces at 2 / 5 / 10%"


def run(workers: int) -> tuple[dict, dict, list[str]]:
    from prefixkv.policies import BUILTIN_POLICIES
    from prefixkv.sim.sweep import TraceSource, sweep
    from prefixkv.sim.traces import load_trace

    policies = sorted(p for p in BUILTIN_POLICIES if p != "belady") + ["belady"]
    table, meta = {}, {}
    for label, name in TRACES.items():
        path = SHARED / name
        if not path.exists():
            continue
        distinct = load_trace(path).distinct_blocks()
        capacities = [max(1, round(f * distinct)) for f in FRACTIONS]
        started = time.perf_counter()
        results = sweep([TraceSource(label, (str(path),))], policies, {label: capacities}, workers=workers)
        meta[label] = (name, distinct, capacities, time.perf_counter() - started)
        table[label] = {(r["policy"], r["capacity"]): r for r in results}
    return table, meta, policies


def markdown(table: dict, meta: dict, policies: list[str], workers: int) -> str:
    out = [SECTION + f" — {date.today().isoformat()}", "",
           f"Written by `benches/policy_results.py` on {date.today().isoformat()} ({platform.machine()}, "
           f"{workers} workers; the shared 2-core machine, so seconds are indicative). Block hit rate (%) in "
           "cache mode at 2 / 5 / 10 % of each trace's distinct blocks (each policy's replay time: "
           "`benches/replay_vs_libcachesim.py`). "
           "`belady` is the offline bound (MIN). Best online policy per column in bold.", ""]
    for label, (name, distinct, capacities, seconds) in meta.items():
        rows = table[label]
        out += [f"### {label} (`{name}`: {distinct:,} distinct blocks; sweep {seconds:.1f} s)", "",
                "| policy | " + " | ".join(f"{c:,} blocks" for c in capacities) + " |",
                "|---|" + "---:|" * len(capacities)]
        best = {c: max((rows[(p, c)]["block_hit_rate"] for p in policies if p != "belady")) for c in capacities}
        for p in policies:
            cells = []
            for c in capacities:
                rate = rows[(p, c)]["block_hit_rate"]
                text = f"{100 * rate:.2f}"
                cells.append(f"**{text}**" if p != "belady" and rate == best[c] else text)
            out.append(f"| `{p}` | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--out", type=Path, default=HERE / "RESULTS.md")
    args = ap.parse_args(argv)
    table, meta, policies = run(args.workers)
    section = markdown(table, meta, policies, args.workers) + "\n"
    old = args.out.read_text(encoding="utf-8") if args.out.exists() else "# Benchmark results\n"
    at = old.find(SECTION)
    if at >= 0:         # this section again: replaced where it is, up to the next section
        end = old.find("\n## ", at + len(SECTION))
        new = old[:at] + section + (old[end + 1:] if end >= 0 else "")
    else:
        new = old.rstrip("\n") + "\n\n" + section
    args.out.write_text(new, encoding="utf-8")
    print(f"wrote {args.out}: {', '.join(f'{k} {v[3]:.1f} s' for k, v in meta.items())}")


if __name__ == "__main__":
    main()
