"""``prefixkv bench`` output: a rich table, one JSON document, and matplotlib plots."""

from __future__ import annotations

import json
import re
from pathlib import Path

from ..sizing import format_size
from .runner import BenchResult


def to_json(result: BenchResult) -> str:
    """The whole result as one JSON document (deterministic for the cost-model executor)."""
    return json.dumps(result.as_dict(), allow_nan=False)


def _ms(x) -> str:
    return "-" if x is None else f"{1e3 * x:,.1f}"


def _num(x, fmt=",.2f") -> str:
    return "-" if x is None else format(x, fmt)


def _done(r: dict) -> str:
    return f"{r['completed']:,} / {r.get('rejected_too_long', 0):,}"


def rejection_note(result: BenchResult) -> str | None:
    """How many requests each block size rejected as too long for the whole pool (None: none)."""
    runs = [run.summary for run in result.runs]
    if not any(r["rejected_too_long"] for r in runs):
        return None
    total = result.trace["requests"]
    counts = [r["rejected_too_long"] for r in runs]
    if len(set(counts)) == 1:
        which = f"{counts[0]:,} of {total:,} requests rejected at every block size"
    else:
        which = "requests rejected per block size: " + ", ".join(
            f"B={r['block_size']}: {r['rejected_too_long']:,} of {total:,}" for r in runs)
    caps = sorted({r["num_blocks"] * r["block_size"] for r in runs})
    cap = f"{caps[0]:,}" if len(caps) == 1 else f"{caps[0]:,}-{caps[-1]:,}"
    return (f"{which}: too long (prompt + output needs more KV than the whole pool holds, {cap} tokens); "
            f"req/s, out tok/s, TTFT and ITL count completed requests only")


# (header, cell) per column; the first is repeated when the table is split to fit a terminal.
_BLOCK = ("block", lambda r: str(r["block_size"]))
_MEMORY_COLUMNS = (
    ("blocks", lambda r: f"{r['num_blocks']:,}"),
    ("requests\ndone / rejected", _done),
    ("tail waste MiB\nmean / peak", lambda r: f"{r['tail_waste_mib_mean']:,.1f} / {r['tail_waste_mib_peak']:,.1f}"),
    ("table len\nmean / max", lambda r: f"{r['block_table_len_mean']:,.1f} / {r['block_table_len_max']:,}"),
    ("hit %", lambda r: f"{100 * r['prefix_hit_rate']:.1f}"),
    ("active / cached / free\n% of pool (mean)", lambda r: " / ".join(
        f"{100 * r['usage_mean'][k]:.0f}" for k in ("active", "evictable", "free"))),
)
_TIME_COLUMNS = (
    ("preempt", lambda r: f"{r['preemptions']:,}"),
    ("TTFT ms\np50 / p99", lambda r: f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])}"),
    ("ITL ms\np50 / p99", lambda r: f"{_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])}"),
    ("req/s", lambda r: _num(r["completed_per_s"])),
    ("out tok/s", lambda r: _num(r["output_tokens_per_s"], ",.0f")),
    ("running\nmean / max", lambda r: f"{r['concurrency_mean']:.1f} / {r['concurrency_max']}"),
    ("waiting\nmean / max", lambda r: f"{r['waiting_mean']:.1f} / {r['waiting_max']}"),
)


def _table(title: str, columns, runs):
    from rich.table import Table

    table = Table(title=title)
    for name, _ in columns:
        table.add_column(name, justify="right")
    for run in runs:
        table.add_row(*(cell(run.summary) for _, cell in columns))
    return table


def bench_tables(result: BenchResult, title: str, width: int | None, wide: bool = False) -> list:
    """One table with every column, or (when it would not fit ``width``, unless ``wide``) two:
    memory and cache, then time and throughput."""
    from rich.console import Console

    whole = _table(title, (_BLOCK, *_MEMORY_COLUMNS, *_TIME_COLUMNS), result.runs)
    if wide or width is None or Console(width=10**4).measure(whole).maximum <= width:
        return [whole]
    return [_table(f"{title}\n(1/2) memory and prefix cache", (_BLOCK, *_MEMORY_COLUMNS), result.runs),
            _table("(2/2) time and throughput (--wide: one table)", (_BLOCK, *_TIME_COLUMNS), result.runs)]


def render(result: BenchResult, console=None, wide: bool = False) -> None:
    from rich.text import Text

    from ..console import counted, make_console

    console = console or make_console()
    cfg = result.config
    tr = result.trace
    s = cfg.spec
    title = (f"{tr['name']}: {counted(tr['requests'], 'request')}, pool {format_size(cfg.pool_bytes)}, "
             f"{s.layers}x{s.kv_heads}x{s.head_dim} {s.dtype} ({s.bytes_per_token:,} B/token), "
             f"budget {cfg.max_num_batched_tokens} tokens, {counted(cfg.max_num_seqs, 'seq')}, policy {cfg.policy}, "
             f"executor {cfg.executor}" + (f" ({cfg.params.name})" if cfg.executor == "cost-model" else ""))
    for table in bench_tables(result, title, console.width, wide):
        console.print(table)
    note = rejection_note(result)
    if note:
        console.print(Text(note, style="yellow"))
    if tr.get("empty_prompts_skipped"):
        console.print(Text(f"{tr['empty_prompts_skipped']:,} request(s) of the trace have an empty prompt "
                           "and were skipped", style="yellow"))
    if tr.get("synthesised_tokens"):
        console.print(f"[dim]hashed trace: token ids synthesised from hash ids (native block "
                      f"{tr['native_block_size']}); other block sizes change the sharing granularity[/dim]")
    if result.reserved is not None:
        render_reserved(result.reserved, console)
    if result.reserved_error is not None:
        # one sentence a line, so that a wrapped line does not split a flag from its value
        for sentence in re.split(r"(?<=\.) ", result.reserved_error):
            console.print(Text(sentence, style="yellow"))
        console.print(Text("The paged results above are complete (exit status 0); only the reserved "
                           "comparison is missing.", style="yellow"))


def render_reserved(cmp: dict, console) -> None:
    from rich.table import Table

    res = cmp["reserved"]
    table = Table(title=f"paged vs reserved-max-length (reserve {res['reserve_tokens']}), same trace and memory")
    for name in ("allocator", "block", "done / rejected", "running mean / max", "preempt / recomputed tok",
                 "req/s", "out tok/s", "TTFT ms p50 / p99", "ITL ms p50 / p99", "hit %"):
        table.add_column(name, justify="right")
    rows = [*cmp["paged"], cmp["paged_no_cache"], {**res, "block_size": None}]
    for r in rows:
        table.add_row(r["allocator"], "-" if r["block_size"] is None else str(r["block_size"]), _done(r),
                      f"{r['concurrency_mean']:.1f} / {r['concurrency_max']}",
                      f"{r['preemptions']:,} / {r['recomputed_tokens']:,}" if "preemptions" in r else "- (none)",
                      _num(r["completed_per_s"]),
                      _num(r["output_tokens_per_s"], ",.0f"), f"{_ms(r['ttft_p50_s'])} / {_ms(r['ttft_p99_s'])}",
                      f"{_ms(r['itl_p50_s'])} / {_ms(r['itl_p99_s'])}", f"{100 * r['prefix_hit_rate']:.1f}")
    console.print(table)
    console.print(f"[dim]reserved: {100 * res['reserved_fraction_mean']:.0f}% of the pool reserved on average, "
                  f"{100 * res['used_fraction_mean']:.0f}% holding KV[/dim]")


def write_plots(result: BenchResult, directory: str | Path) -> list[Path]:
    """latency_cdf.png, block_size.png, pool_usage.png (and reserved.png with --compare-reserved).

    Each file is written whole or not at all (``prefixkv.outputs.atomic_path``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from ..outputs import atomic_path

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    def save(fig, name: str) -> None:
        paths.append(out / name)
        with atomic_path(paths[-1]) as tmp:
            fig.savefig(tmp, dpi=110)
        plt.close(fig)
    runs = result.runs
    label = result.trace["name"]

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for run in runs:
        for ax, values in zip(axes, (run.ttfts, run.itls)):
            if values:
                x = np.sort(np.asarray(values)) * 1e3
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), label=f"B={run.summary['block_size']}")
    if result.reserved_run is not None:
        raw = result.reserved_run
        for ax, values in zip(axes, (raw["_ttfts"], raw["_itls"])):
            if values:
                x = np.sort(np.asarray(values)) * 1e3
                ax.plot(x, np.arange(1, len(x) + 1) / len(x), "k--", label="reserved")
    for ax, name in zip(axes, ("TTFT", "inter-token latency")):
        ax.set_xscale("log")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of samples")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"{label}: latency CDF per block size")
    fig.tight_layout()
    save(fig, "latency_cdf.png")

    sizes = [r.summary["block_size"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(sizes, [100 * r.summary["prefix_hit_rate"] for r in runs], "o-", color="tab:blue", label="prefix hit rate")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("block size (tokens)")
    ax.set_ylabel("prefix hit rate (%)", color="tab:blue")
    ax.set_ylim(0, 100)         # from zero: a 1.5-point difference should look like one
    ax2 = ax.twinx()
    ax2.plot(sizes, [r.summary["tail_waste_mib_mean"] for r in runs], "s-", color="tab:red", label="tail waste (mean)")
    ax2.plot(sizes, [r.summary["tail_waste_mib_peak"] for r in runs], "s:", color="tab:red", label="tail waste (peak)")
    ax2.set_ylabel("tail waste (MiB)", color="tab:red")
    ax2.set_ylim(0, None)
    ax.grid(True, alpha=0.3)
    fig.legend(loc="lower center", ncol=3, fontsize=8)
    fig.suptitle(f"{label}:\nhit rate and tail waste against block size", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    save(fig, "block_size.png")

    cols = min(3, len(runs))
    rows = -(-len(runs) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.2 * cols, 3.0 * rows), squeeze=False, sharey=True)
    for ax, run in zip(axes.flat, runs):
        tl = run.timeline
        n = run.summary["num_blocks"]
        t = np.asarray(tl["t"])
        ax.stackplot(t, np.asarray(tl["active"]) / n * 100, np.asarray(tl["evictable"]) / n * 100,
                     np.asarray(tl["free"]) / n * 100, labels=("active", "cached (evictable)", "free"),
                     colors=("tab:red", "tab:orange", "tab:green"), alpha=0.8)
        ax.set_title(f"B={run.summary['block_size']} ({n:,} blocks)", fontsize=9)
        ax.set_xlabel("time (s)")
        ax.set_ylim(0, 100)
    for ax in axes.flat[len(runs):]:
        ax.axis("off")
    axes[0][0].set_ylabel("% of pool")
    axes[0][0].legend(loc="lower right", fontsize=7)
    fig.suptitle(f"{label}: block usage over time")
    fig.tight_layout()
    save(fig, "pool_usage.png")

    if result.reserved is not None:
        cmp = result.reserved
        rows = [*cmp["paged"], cmp["paged_no_cache"], {**cmp["reserved"], "block_size": None}]
        names = [f"paged B={r['block_size']}" if r["allocator"] == "paged" else
                 (f"paged B={r['block_size']}\nno cache" if r["block_size"] else "reserved") for r in rows]
        fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
        axes[0].bar(names, [r["concurrency_mean"] for r in rows], color="tab:blue")
        axes[0].set_ylabel("running requests (time-weighted mean)")
        axes[1].bar(names, [r["completed_per_s"] or 0 for r in rows], color="tab:green")
        axes[1].set_ylabel("completed requests/s")
        for ax in axes:
            ax.tick_params(axis="x", labelsize=7, rotation=45)
        fig.suptitle(f"{label}: paged vs reserved-max-length, same trace and memory")
        fig.tight_layout()
        save(fig, "reserved.png")
    return paths
