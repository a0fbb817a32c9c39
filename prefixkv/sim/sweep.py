"""``prefixkv compare``: sweep policies x capacities over traces, against MIN.

Every cell is one ``replay`` of the same trace file through the real manager.
Cells run in parallel worker processes; each worker loads a trace once (from
its file: generated workloads are written to a file before any replay).
"""

from __future__ import annotations

import os
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Sequence

from .replay import replay
from .traces import Trace, load_trace

AUTO_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


@dataclass(frozen=True)
class TraceSource:
    """A trace as a worker can reload it: a path (or paths) plus the format."""

    label: str
    paths: tuple[str, ...]
    format: str = "auto"

    def load(self) -> Trace:
        return _load_cached(self.paths, self.format)


@lru_cache(maxsize=4)
def _load_cached(paths: tuple[str, ...], format: str) -> Trace:
    return load_trace(list(paths) if len(paths) > 1 else paths[0], format=format)


def auto_capacities(trace: Trace, fractions: Sequence[float] = AUTO_FRACTIONS) -> list[int]:
    """Capacities as fractions of the trace's distinct blocks (deduplicated, at least 1)."""
    distinct = trace.distinct_blocks()
    return sorted({max(1, round(distinct * f)) for f in fractions})


def _run_cell(source: TraceSource, policy: str, capacity: int, mode: str, warmup: float) -> dict:
    result = replay(source.load(), policy, capacity, mode=mode, warmup=warmup).as_dict()
    result["trace"] = source.label
    return result


def sweep(sources: Sequence[TraceSource], policies: Sequence[str], capacities: dict[str, list[int]], *,
          mode: str = "cache", warmup: float = 0.0, workers: int | None = None,
          on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Replay every (trace, policy, capacity); returns result dicts in a stable order.

    ``policies`` are names or specs (``"lrfu:half_life=4"``), not objects: every cell builds its
    own policy, in a worker process (register your class, see ``prefixkv.policies.register``)."""
    bad = [p for p in policies if not isinstance(p, str)]
    if bad:
        raise TypeError(f"sweep takes policy names, not {type(bad[0]).__name__} objects: a policy keeps per-pool "
                        "state, so each cell builds its own; register the class under a name")
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two traces share the label {next(l for l in labels if labels.count(l) > 1)!r}: "
                         "results are keyed by label")
    jobs = [(s, p, c) for s in sources for p in policies for c in capacities[s.label]]
    # Biggest capacities first: they take longest, and the pool drains evenly.
    jobs.sort(key=lambda j: -j[2])
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    results: list[dict] = []
    if workers <= 1:
        for s, p, c in jobs:
            results.append(_run_cell(s, p, c, mode, warmup))
            if on_done:
                on_done(results[-1])
    else:
        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(_run_cell, s, p, c, mode, warmup) for s, p, c in jobs]
            for future in as_completed(futures):
                results.append(future.result())
                if on_done:
                    on_done(results[-1])
    order = {(s.label, p, c): i for i, (s, p, c) in
             enumerate((s, p, c) for s in sources for p in policies for c in capacities[s.label])}
    results.sort(key=lambda r: order[(r["trace"], r["policy"], r["capacity"])])
    return results


def gap_summary(results: Sequence[dict], bound: str = "belady", baseline: str = "lru") -> list[dict]:
    """Per (trace, capacity): the best online policy and the share of the baseline->MIN gap it closes."""
    cells: dict[tuple[str, int], dict[str, float]] = {}
    for r in results:
        cells.setdefault((r["trace"], r["capacity"]), {})[r["policy"]] = r["block_hit_rate"]
    out = []
    for (trace, capacity), rates in cells.items():
        online = {p: v for p, v in rates.items() if p != bound}
        if not online:
            continue
        best = max(online, key=lambda p: (online[p], p == baseline))
        row = {"trace": trace, "capacity": capacity, "best_policy": best, "best_hit_rate": online[best]}
        if bound in rates and baseline in rates:
            gap = rates[bound] - rates[baseline]
            row["min_hit_rate"] = rates[bound]
            row["baseline_hit_rate"] = rates[baseline]
            row["gap_closed"] = (online[best] - rates[baseline]) / gap if gap > 1e-12 else None
        out.append(row)
    return out


def plot(results: Sequence[dict], path: str, bound: str = "belady") -> None:
    """Hit rate against capacity, one line per policy, MIN dashed; one panel per trace."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise RuntimeError("plotting needs matplotlib: pip install 'prefixkv[plot]'") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in results))
    online = [p for p in dict.fromkeys(r["policy"] for r in results) if p != bound]
    # One look per policy, the same in every panel: ten colours, then markers and dashes change.
    colours = plt.get_cmap("tab10").colors
    markers, dashes = "osD^v", ["-", "-.", ":"]
    look = {p: dict(color=colours[i % 10], marker=markers[i // 10 % len(markers)], markersize=3,
                    linestyle=dashes[i // 10 % len(dashes)], label=p) for i, p in enumerate(online)}
    look[bound] = dict(color="black", linestyle="--", linewidth=2, label="MIN (Belady)")
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        rows = [r for r in results if r["trace"] == trace]
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["capacity"], 100 * r["block_hit_rate"]) for r in rows if r["policy"] == policy)
            xs, ys = zip(*pts)
            ax.plot(xs, ys, **look[policy])
        ax.set_xscale("log")
        ax.set_xlabel(f"capacity (blocks of {rows[0]['block_size']} tokens)")
        ax.set_ylabel("block hit rate (%)")
        ax.set_title(trace)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
