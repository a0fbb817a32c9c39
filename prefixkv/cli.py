"""The ``prefixkv`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .command import run
from .argtypes import (fraction, model_spec, non_negative_float, non_negative_int, positive_int, positive_size, seed,
                       size)
from .console import counted
from .sizing import KVSpec, format_size, parse_size, plan

DESCRIPTION = ("prefixkv: a prefix-caching, paged KV-cache store. Size a pool (plan), check the block "
               "arithmetic (lab), replay request traces under eviction policies (replay, compare, workload), "
               "generate with a paged cache (generate), benchmark block sizes (bench) and simulate a routed fleet "
               "of replicas (fleet), and inspect or clear a remote tier's Redis store (tier).")

# The design notes' teaching model: a Llama-3-8B-like KV layout.
SEED_MODEL = dict(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")


def _lengths(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"lengths must be comma-separated integers, got {text!r}") from None
    if not values or any(v < 0 for v in values):
        raise argparse.ArgumentTypeError(f"lengths must be non-negative integers, got {text!r}")
    return values


def cmd_plan(args: argparse.Namespace) -> int:
    from .costs import PreemptionCostModel, load_params

    if args.cost_params is not None and not (args.host_pool or args.disk_pool):
        raise ValueError("--cost-params prices moving blocks to and from the host pool or the disk; give "
                         "--host-pool or --disk-pool too")
    spec = KVSpec(args.layers, args.kv_heads, args.head_dim, args.dtype, args.tp)
    result = plan(spec, args.block_size, args.pool, args.prompt_tokens, args.host_pool)
    d = result.as_dict()
    if args.host_pool:
        params = load_params(args.cost_params)
        cost = PreemptionCostModel.from_params(params, spec.bytes_per_token)
        # one link, both ways: demotion (device -> host) and load (host -> device) take the same time
        d.update(cost_params=params.name, block_transfer_s=cost.swap_one_way_s(d["bytes_per_block"]),
                 block_recompute_s=cost.recompute_s(args.block_size))
    if args.disk_pool:
        from .tiers.block_codec import value_size

        params = load_params(args.cost_params)
        cost = PreemptionCostModel.from_params(params, spec.bytes_per_token)
        value = value_size(d["bytes_per_block"], args.block_size)
        d.update(disk_pool_bytes=args.disk_pool, disk_value_bytes=value, disk_blocks=args.disk_pool // value,
                 cost_params=params.name, disk_block_read_s=value / params.disk_read_bytes_per_s,
                 disk_block_write_s=value / params.disk_write_bytes_per_s,
                 block_recompute_s=cost.recompute_s(args.block_size))
    if args.json:
        print(json.dumps(d))
        return 0
    tp = f", TP {spec.tensor_parallel} -> {spec.kv_heads_per_gpu} KV head(s) per GPU" if spec.tensor_parallel > 1 else ""
    rows = [
        ("model", f"{spec.layers} layers x {spec.kv_heads} KV heads x {spec.head_dim}, {spec.dtype}{tp}"),
        ("bytes per token", f"{d['bytes_per_token']:,} B ({format_size(d['bytes_per_token'])})"
                            f" = 2 x {spec.layers} x {spec.kv_heads_per_gpu} x {spec.head_dim} x {spec.dtype_bytes}"),
        ("bytes per block", f"{d['bytes_per_block']:,} B ({format_size(d['bytes_per_block'])}),"
                            f" {args.block_size} tokens"),
        ("pool", f"{format_size(args.pool)} -> {d['num_blocks']:,} blocks"),
        ("per request", f"{args.prompt_tokens:,} tokens -> {d['blocks_per_request']:,} blocks"
                        f" ({d['tail_waste_slots_per_request']} empty tail slots,"
                        f" {format_size(d['tail_waste_bytes_per_request'])})"),
        ("requests that fit", f"{d['max_requests']:,}"),
        ("left over", f"{d['leftover_blocks']:,} blocks + {format_size(d['unallocated_bytes'])} unallocated"),
    ]
    if args.host_pool:
        rows += [
            ("host pool", f"{format_size(args.host_pool)} -> {d['host_blocks']:,} blocks "
                          f"({d['host_blocks'] * args.block_size:,} tokens)"),
            ("move one block", f"{1e6 * d['block_transfer_s']:,.1f} us each way (device -> host, host -> device) "
                               f"against {1e6 * d['block_recompute_s']:,.1f} us to recompute its "
                               f"{args.block_size} tokens ({d['cost_params']} profile)"),
        ]
    if args.disk_pool:
        rows += [
            ("disk tier", f"{format_size(args.disk_pool)} -> {d['disk_blocks']:,} blocks "
                          f"({d['disk_blocks'] * args.block_size:,} tokens; {d['disk_value_bytes']:,} B a block "
                          f"with its header and token ids)"),
            ("disk one block", f"{1e6 * d['disk_block_read_s']:,.1f} us to read, {1e6 * d['disk_block_write_s']:,.1f} "
                               f"us to write, against {1e6 * d['block_recompute_s']:,.1f} us to recompute "
                               f"({d['cost_params']} profile)"),
        ]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:>{width}}  {value}")
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from .hostmem import MANAGER_BYTES_PER_BLOCK, require
    from .sim.lab import run_lab

    # The lab holds every token of --lengths (as Python ints and hashed arrays, ~64 B each), a
    # manager of their blocks, and small pools of slots whose checks take ~512 B per token of a block.
    tokens, blocks = sum(args.lengths), sum(-(-n // args.block_size) for n in args.lengths)
    require(64 * tokens + MANAGER_BYTES_PER_BLOCK * blocks + 512 * args.block_size,
            f"the lab at --block-size {args.block_size:,} with --lengths of {tokens:,} tokens")
    table, checks = run_lab(args.block_size, args.lengths)
    print(f"block_size={args.block_size} lengths={','.join(map(str, args.lengths))}")
    print(" ".join(f"{k}={v}" for k, v in table.items()))
    if args.bytes_per_token:
        print(f"tail_waste_bytes={format_size(table['tail_waste'] * args.bytes_per_token)}"
              f" at {format_size(args.bytes_per_token)} per token")
    for check in checks:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
    return 0 if all(c.passed for c in checks) else 1


def _trace_sources(args: argparse.Namespace):
    """The traces named on the command line, or the built-in workload written to a file first."""
    from .sim.sweep import TraceSource
    from .sim.workloads import builtin_trace

    traces = [args.trace] if isinstance(args.trace, str) else list(args.trace or [])
    if "" in traces:
        raise ValueError("--trace: an empty path (a trace file or a kv-cache-tester folder is expected)")
    if traces and args.workload is not None:
        raise ValueError("--workload names the built-in trace used when no --trace is given; give one or the other")
    if not traces and args.format != "auto":
        raise ValueError(f"--format {args.format} says how to read --trace; give --trace too")
    if not traces:
        workload = args.workload or "default"
        trace = builtin_trace(workload)
        return [TraceSource(f"{workload} (generated)", (str(trace.path),), "tokens")]
    paths = [os.path.normpath(item) for item in traces]
    if len(set(paths)) < len(paths):
        raise ValueError("the same trace is given twice")
    labels = [os.path.basename(path) or path for path in paths]
    # Results are keyed by label: two files of the same name keep their paths to stay apart.
    labels = [path if labels.count(label) > 1 else label for label, path in zip(labels, paths)]
    return [TraceSource(label, (item,), args.format) for label, item in zip(labels, traces)]


def _where_generated(sources) -> str | None:
    """The file a built-in workload was written to (None for traces named on the command line)."""
    generated = [s for s in sources if s.format == "tokens" and s.label.endswith("(generated)")]
    return f"{generated[0].label}: trace file {generated[0].paths[0]}" if generated else None


def _check_belady_mode(policies, mode: str) -> None:
    if mode != "cache" and any(p.partition(":")[0] == "belady" for p in policies):
        raise ValueError("belady (MIN) needs requests in trace order: it runs with --mode cache only")


def _effective_capacity(trace, requested: int, mode: str) -> tuple[int, str | None]:
    """``requested`` clamped to what the trace can ever fill (a larger cache replays identically),
    refused when even that would not fit in memory; and a note when clamped."""
    from .hostmem import require_blocks
    from .sim.sweep import capacity_bound

    bound = capacity_bound(trace, mode)
    capacity = min(requested, bound)
    require_blocks(capacity, f"a cache of {capacity:,} blocks")
    if capacity == requested:
        return capacity, None
    return capacity, (f"capacity {requested:,} is more than this trace can ever fill; replayed at {capacity:,} "
                      f"blocks, which gives the same result (capacities are in blocks of {trace.block_size} "
                      f"tokens, not tokens)")


def _tier_options(args: argparse.Namespace) -> dict:
    """``replay`` arguments for the host tier: its policy, what a block costs to move (the model
    spec and cost parameters, as ``bench``), and the load gate when cost parameters are given."""
    from .costs import PreemptionCostModel, load_params

    try:
        spec = KVSpec(**{**SEED_MODEL, **(args.model_spec or {})})
    except ValueError as exc:       # a spec of positive fields whose heads do not split over its tp
        raise ValueError(f"--model-spec: {exc}") from None
    params = load_params(args.cost_params)
    cost = PreemptionCostModel.from_params(params, spec.bytes_per_token)
    out = dict(host_policy=args.host_policy or "lru", transfer_cost=cost, gate=args.cost_params is not None)
    if args.remote_capacity:
        out.update(remote_capacity=args.remote_capacity, remote_bytes_per_s=params.remote_bytes_per_s)
    if args.disk_capacity:
        out.update(disk_capacity=args.disk_capacity, disk_mode=args.disk_mode,
                   disk_read_bytes_per_s=params.disk_read_bytes_per_s,
                   disk_write_bytes_per_s=params.disk_write_bytes_per_s)
    return out


def _check_tier_flags(args: argparse.Namespace, tiered: bool) -> None:
    """Options of a lower tier mean nothing without one: refused rather than ignored (a wrong
    --cost-params file would otherwise go unnoticed)."""
    if args.disk_mode != "write-through" and not args.disk_capacity:
        raise ValueError("--disk-mode applies to a disk tier; give --disk-capacity too")
    if tiered:
        return
    given = [flag for flag, value in (("--host-policy", args.host_policy), ("--model-spec", args.model_spec),
                                      ("--cost-params", args.cost_params)) if value is not None]
    if given:
        raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a lower tier; "
                         "give --host-capacity (or --disk-capacity, --remote-capacity) too")


def cmd_replay(args: argparse.Namespace) -> int:
    from .sim.replay import replay

    _check_belady_mode([args.policy], args.mode)
    _check_tier_flags(args, bool(args.host_capacity or args.remote_capacity or args.disk_capacity))
    source = _trace_sources(args)[0]
    trace = source.load()
    capacity, note = _effective_capacity(trace, args.capacity, args.mode)
    tiers = _tier_options(args) if args.host_capacity or args.remote_capacity or args.disk_capacity else {}
    if args.host_capacity:
        require_blocks_for_host(args.host_capacity)
    result = replay(trace, args.policy, capacity, mode=args.mode, warmup=args.warmup,
                    host_capacity=args.host_capacity, **tiers).as_dict(timing=True)
    result["trace"] = source.label
    result["requested_capacity"] = args.capacity
    result["effective_capacity"] = capacity
    oversized = _oversized_note(trace, result, capacity, args.mode)
    staging = None
    if (args.remote_capacity or args.disk_capacity) and not args.host_capacity:
        lower = " and ".join(t for t, on in (("disk", args.disk_capacity), ("remote", args.remote_capacity)) if on)
        staging = (f"no --host-capacity: a host tier of {counted(result['host_capacity'], 'block')} (the largest "
                   f"request) stages the {lower} tier's blocks (give --host-capacity "
                   f"to size it)")
    if args.json:
        print(json.dumps(result))
        for text in (note, oversized, staging):
            if text:
                print(f"prefixkv replay: note: {text}", file=sys.stderr)
        return 0
    host = (f", host tier {args.host_capacity:,} blocks ({args.host_policy or 'lru'})" if args.host_capacity else "")
    print(f"{source.label}: {counted(len(trace), 'request')}, blocks of {trace.block_size} tokens, "
          f"policy {args.policy}, capacity {counted(capacity, 'block')}{host}, {args.mode} mode")
    for text in (note, oversized, staging):
        if text:
            print(f"note: {text}")
    where = _where_generated([source])
    if where:
        print(where)
    for key in ("requests", "block_accesses", "block_hits", "block_hit_rate", "token_hit_rate", "evictions",
                "block_insertions", "blocks_never_reused", "oversized_requests", "waited_admissions",
                "mean_wait_s", "replay_s", "promotions", "demotions", "loads_refused", "transfer_bytes", "transfer_s",
                "disk_fetches", "disk_writes", "disk_evictions", "disk_transfer_s",
                "remote_fetches", "remote_writes", "remote_evictions", "remote_transfer_s"):
        if key in result:
            value = result[key]
            if key.endswith("_rate"):
                print(f"  {key:>20}  {100 * value:.2f} %")
            elif isinstance(value, float):
                print(f"  {key:>20}  {value:.4f}")
            else:
                print(f"  {key:>20}  {value:,}")
    if "tier_block_hits" in result:
        print("  " + ", ".join(f"{tier} {hits:,} hits ({100 * result['tier_hit_rate'][tier]:.2f} %)"
                               for tier, hits in result["tier_block_hits"].items()))
    return 0


def _oversized_note(trace, result: dict, capacity: int, mode: str) -> str | None:
    """Adds ``largest_request_blocks`` and ``fitting_requests`` to a replay's ``result``; returns a
    note when requests were larger than the whole cache (never admitted, all misses): a hit rate
    of 0 % then says more about the capacity than about the policy."""
    from .sim.sweep import request_blocks

    largest = max(request_blocks(trace, mode), default=0)
    n, total = result.get("oversized_requests", 0), result.get("requests", 0)
    result["largest_request_blocks"] = largest
    result["fitting_requests"] = total - n
    if not n:
        return None
    return (f"{n:,} of {counted(total, 'measured request')} did not fit: larger than the whole "
            f"cache of {counted(capacity, 'block')} (the largest takes {largest:,}), "
            f"never admitted and counted as all misses; --capacity {largest:,} or more fits every request")


def require_blocks_for_host(blocks: int) -> None:
    from .hostmem import require_blocks

    require_blocks(blocks, f"a host tier of {blocks:,} blocks")


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.progress import Progress

    from .console import make_console
    from .hostmem import require_blocks
    from .outputs import atomic_path, plot_file
    from .policies import available_policies, make_policy
    from .sim.sweep import SweepInterrupted, auto_capacities, gap_summary, plot, plot_host_capacity, sweep

    # LRU first (the baseline), MIN last (the bound, only where the future is known), the rest by name.
    policies = args.policies or sorted((p for p in available_policies()
                                        if p != "belady" or args.mode == "cache"),
                                       key=lambda p: (p != "lru", p == "belady", p))
    _check_belady_mode(policies, args.mode)
    _check_tier_flags(args, bool(any(args.host_capacity or [0]) or args.remote_capacity or args.disk_capacity))
    unknown = [p for p in policies if p.partition(":")[0] not in available_policies()]
    if unknown:
        raise ValueError(f"unknown polic{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                         f"available: {', '.join(available_policies())}")
    for spec in policies:  # bad options stop here, before any worker starts
        make_policy(spec)
    plot_path = plot_file(args.plot) if args.plot is not None else None    # before any cell runs
    sources = _trace_sources(args)
    capacities, notes = {}, []
    for s in sources:
        if args.capacities == "auto":
            capacities[s.label], note = auto_capacities(s.load(), mode=args.mode)
            if note:
                notes.append(f"{s.label}: {note}")
        else:
            capacities[s.label] = args.capacities
    require_blocks(max(max(c) for c in capacities.values()), "the largest capacity")
    host_caps = args.host_capacity or [0]
    tiers = _tier_options(args) if any(host_caps) or args.remote_capacity or args.disk_capacity else {}
    if any(host_caps):
        require_blocks_for_host(max(host_caps))
    console = make_console(stderr=True)
    total = sum(len(policies) * len(capacities[s.label]) for s in sources) * len(host_caps)
    workers = min(args.workers, total) if args.workers else None      # more processes than cells cannot help
    interrupted = None
    with Progress(console=console, transient=True, disable=args.json or not console.is_terminal) as bar:
        task = bar.add_task("replaying", total=total)
        try:
            results = sweep(sources, policies, capacities, mode=args.mode, warmup=args.warmup,
                            workers=workers, backend=args.backend, host_capacities=host_caps,
                            **tiers, on_done=lambda _: bar.advance(task))
        except SweepInterrupted as exc:
            results, interrupted = exc.finished, exc
    summary = gap_summary(results)
    if args.json:
        doc = {"results": results, "summary": summary}
        if interrupted:
            doc["complete"] = False
        print(json.dumps(doc))
    else:
        # (without --host-capacity, rows of a remote tier carry the staging host tier replay chose)
        for host_capacity in args.host_capacity or [None]:
            _print_compare_tables(sources, policies, capacities, results, summary, args.mode, interrupted,
                                  host_capacity)
        for note in notes:
            make_console().print(f"note: {note}", markup=False)     # trace names and paths are text
        where = _where_generated(sources)
        if where:
            make_console().print(where, markup=False)
    if interrupted:
        raise KeyboardInterrupt          # no plot from a partial sweep; main says "interrupted"
    if plot_path:
        with atomic_path(plot_path) as tmp:
            if len(host_caps) > 1:
                plot_host_capacity(results, tmp)
            else:
                plot(results, tmp)
        print(f"plot written to {plot_path}", file=sys.stderr if args.json else sys.stdout)
    return 0


def _print_compare_tables(sources, policies, capacities, results, summary, mode, interrupted,
                          host_capacity: int | None = None) -> None:
    """One table per trace; ``host_capacity`` picks the rows of one host tier size (None: every row,
    when no host tier was asked for)."""
    from rich.markup import escape
    from rich.table import Table

    from .console import make_console

    out = make_console()
    for source in sources:
        caps = capacities[source.label]
        rows = [r for r in results if r["trace"] == source.label
                and (host_capacity is None or r.get("host_capacity", 0) == host_capacity)]
        if not rows:
            continue
        incomplete = (f" [INCOMPLETE: interrupted after {len(interrupted.finished)} of {interrupted.total} "
                      "cells]") if interrupted else ""
        host = f", host tier {host_capacity:,} blocks (all tiers)" if host_capacity else ""
        table = Table(title=f"{escape(source.label)}: block hit rate (%) by capacity in blocks of "
                            f"{rows[0]['block_size']} tokens{host}, {mode} mode{incomplete}")
        table.add_column("policy")
        for c in caps:
            table.add_column(f"{c:,}", justify="right")
        rate = {(r["policy"], r["capacity"]): r["block_hit_rate"] for r in rows}
        online = [p for p in policies if p != "belady"]
        best = {c: max((rate[(p, c)] for p in online if (p, c) in rate), default=None) for c in caps}
        for p in policies:
            cells = []
            for c in caps:
                if (p, c) not in rate:
                    cells.append("-")
                    continue
                text = f"{100 * rate[(p, c)]:.2f}"
                cells.append(f"[bold]{text}[/bold]" if p != "belady" and rate[(p, c)] == best[c] else text)
            table.add_row("MIN (belady)" if p == "belady" else escape(p), *cells)
        gaps = {row["capacity"]: row for row in summary
                if row["trace"] == source.label and (host_capacity is None or row.get("host_capacity", 0) == host_capacity)}
        if online and not interrupted and all("gap_closed" in gaps[c] for c in caps):
            table.add_section()
            table.add_row("best online", *[escape(gaps[c]["best_policy"]) for c in caps])
            table.add_row("LRU->MIN gap closed",
                          *["-" if gaps[c]["gap_closed"] is None else f"{100 * gaps[c]['gap_closed']:.0f}%"
                            for c in caps])
        _add_predictor_rows(table, rows, policies, caps)
        out.print(table)
        oversized = {r["capacity"]: (r["oversized_requests"], r["requests"]) for r in rows
                     if r["oversized_requests"]}
        if oversized:
            out.print("[yellow]requests larger than the whole cache, counted as all misses: "
                      + ", ".join(f"{n:,} of {total:,} at {c:,} blocks" for c, (n, total) in sorted(oversized.items()))
                      + "[/yellow]")


def _add_predictor_rows(table, rows, policies, caps) -> None:
    """For policies that forecast sessions (``predict``): how good the forecasts were, so a gain
    in hit rate can be traced to better prediction (return AUC; mean |log| error of the gap)."""
    from rich.markup import escape

    by_cell = {(r["policy"], r["capacity"]): r for r in rows}
    forecasters = [p for p in policies if any(by_cell.get((p, c), {}).get("return_auc") is not None
                                              or by_cell.get((p, c), {}).get("arrival_log_error") is not None
                                              for c in caps)]
    if not forecasters:
        return
    table.add_section()

    def cell(p, c, key):
        value = by_cell.get((p, c), {}).get(key)
        return "-" if value is None else f"{value:.3f}"

    for p in forecasters:
        table.add_row(f"{escape(p)}: return AUC", *[cell(p, c, "return_auc") for c in caps])
        table.add_row(f"{escape(p)}: arrival log error", *[cell(p, c, "arrival_log_error") for c in caps])


def cmd_workload(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .sim.workloads import BUILTIN_WORKLOADS, generate_trace

    from .hostmem import require
    from .outputs import atomic_path, data_file
    from .sim.workloads import estimated_bytes

    config = BUILTIN_WORKLOADS[args.name]
    changes = {k: v for k, v in (("seed", args.seed), ("num_requests", args.requests)) if v is not None}
    config = replace(config, **changes)
    require(estimated_bytes(config), f"generating {counted(config.num_requests, 'request')} of workload "
                                     f"{config.name!r}")
    target = data_file(args.out, force=args.force)
    with atomic_path(target) as tmp:
        generate_trace(tmp, config)
    print(f"wrote {target}: {counted(config.num_requests, 'request')} of workload {config.name!r}, seed {config.seed}")
    return 0


def _add_trace_args(p: argparse.ArgumentParser, many: bool) -> None:
    from .sim.workloads import BUILTIN_WORKLOADS

    p.add_argument("--trace", action="append" if many else None, default=[] if many else None,
                   help="a trace file or kv-cache-tester folder" + (" (repeatable)" if many else "")
                        + "; default: the built-in generated workload")
    p.add_argument("--format", default="auto", choices=["auto", "mooncake", "kvcache-tester", "tokens"])
    p.add_argument("--workload", default=None, choices=sorted(BUILTIN_WORKLOADS),
                   help="built-in workload used when no --trace is given (default: default)")
    p.add_argument("--mode", default="cache", choices=["cache", "concurrent"])
    p.add_argument("--warmup", type=fraction, default=0.0, help="fraction of requests excluded from measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _add_tier_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host-policy", default=None, help="eviction policy of the host tier (default lru)")
    p.add_argument("--disk-capacity", type=non_negative_int, default=0,
                   help="blocks of a local disk tier below the host tier (above --remote-capacity), cache mode "
                        "(default 0: none); without --host-capacity, a host tier the size of the largest "
                        "request stages its blocks")
    p.add_argument("--disk-mode", default="write-through", choices=["write-through", "exclusive"],
                   help="write-through (default, what the disk tier does: every computed block written once) "
                        "or exclusive (a victim tier of the host tier: exclusive LRU tiers are one LRU stack)")
    p.add_argument("--remote-capacity", type=non_negative_int, default=0,
                   help="blocks of a shared remote tier (a Redis server) below the host tier, cache mode "
                        "(default 0: none); without --host-capacity, a host tier the size of the largest "
                        "request stages its blocks")
    p.add_argument("--model-spec", type=model_spec, default=None,
                   help="layers,kv_heads,head_dim[,dtype[,tp]] pricing a block's transfer (default: the "
                        "design notes' 32,8,128,bfloat16)")
    p.add_argument("--cost-params", default=None,
                   help="link and prefill figures (h200, cpu-tiny or a file): gives transfer_s, and applies "
                        "the load gate (a host hit is taken only when moving it beats recomputing it)")


def _host_capacity_list(text: str) -> list[int]:
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() for part in parts):
        raise argparse.ArgumentTypeError(f"expected comma-separated block counts, got {text!r}")
    return sorted({int(part) for part in parts})


def _policy_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated policy names, got {text!r}")
    return list(dict.fromkeys(names))


def _capacity_list(text: str):
    if text == "auto":
        return "auto"
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isascii() and part.isdigit() and int(part) > 0 for part in parts):
        raise argparse.ArgumentTypeError(
            f"expected 'auto' or comma-separated positive block counts, got {text!r}")
    return sorted({int(part) for part in parts})


def _policy_help() -> str:
    # The built-in names only: loading plug-ins (entry points) for a help text would slow down,
    # and let a broken plug-in warn on, every command.
    from .policies import BUILTIN_POLICIES

    return ", ".join(sorted(BUILTIN_POLICIES)) + " (and plug-ins registered through the prefixkv.policies entry point)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixkv", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"prefixkv {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="KV bytes per token/block and how many requests fit in a pool",
                       description="Size a KV pool. Defaults: the design notes' model (32 layers, "
                                   "8 KV heads x 128, bf16), block 16, 24 GiB, 4,097-token requests.")
    p.add_argument("--layers", type=positive_int, default=SEED_MODEL["layers"])
    p.add_argument("--kv-heads", type=positive_int, default=SEED_MODEL["kv_heads"])
    p.add_argument("--head-dim", type=positive_int, default=SEED_MODEL["head_dim"])
    p.add_argument("--dtype", default=SEED_MODEL["dtype"])
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel degree")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--pool", type=positive_size, default=parse_size("24GiB"), help="KV pool bytes, e.g. 24GiB")
    p.add_argument("--prompt-tokens", type=positive_int, default=4097)
    p.add_argument("--disk-pool", type=size, default=0,
                   help="bytes of a local disk tier (e.g. 2TiB): the blocks it holds and the time to read and "
                        "write one (default 0: none)")
    p.add_argument("--host-pool", type=size, default=0,
                   help="host memory for the host tier and swap space, e.g. 64GiB: adds its blocks and the "
                        "time to move one block each way")
    p.add_argument("--cost-params", default=None,
                   help="link bandwidth and prefill rate for --host-pool: a profile (h200, cpu-tiny) or a file")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("lab", help="the small-pool lab: tail waste, COW, release and leak checks",
                       description="Place sequences of the given lengths in a small pool and print the block "
                                   "table arithmetic (blocks, slots, useful slots, tail waste), then run the "
                                   "copy-on-write, release, failed-COW and leak checks against the real manager.")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--lengths", type=_lengths, default=[17, 32, 63],
                   help="comma-separated sequence lengths in tokens (default 17,32,63)")
    p.add_argument("--bytes-per-token", type=size, default=parse_size("128KiB"),
                   help="to express tail waste in bytes (default: the seed model's 128 KiB)")
    p.set_defaults(func=cmd_lab)

    p = sub.add_parser("replay", help="replay a trace through the real manager with one policy and capacity")
    _add_trace_args(p, many=False)
    p.add_argument("--policy", default="lru",
                   help=f"eviction policy (default lru): {_policy_help()}; options after colons, "
                        "e.g. lrfu:half_life=4:ghost=1")
    p.add_argument("--capacity", type=positive_int, required=True, help="cache capacity in blocks")
    p.add_argument("--host-capacity", type=non_negative_int, default=0,
                   help="blocks of host tier below the device cache (default 0: none)")
    _add_tier_args(p)
    p.set_defaults(func=cmd_replay)

    p = sub.add_parser("compare", help="sweep policies x capacities against the offline optimum (MIN)",
                       description="With no arguments: every registered policy on the built-in generated "
                                   "workload at capacities of 1-50% of its distinct blocks.")
    _add_trace_args(p, many=True)
    p.add_argument("--policies", type=_policy_list, default=None,
                   help=f"comma-separated; default: all of {_policy_help()}. A policy can carry options, "
                        "so one sweep compares settings: lru,lrfu,lrfu:half_life=4:ghost=1")
    p.add_argument("--capacities", type=_capacity_list, default="auto",
                   help="comma-separated block counts, or 'auto' (1-50%% of the distinct blocks)")
    p.add_argument("--plot", metavar="FILE.png", help="write hit rate against capacity (against host capacity "
                                                      "when several --host-capacity values are given)")
    p.add_argument("--host-capacity", type=_host_capacity_list, default=None,
                   help="comma-separated host-tier sizes in blocks, swept below every capacity (0: none)")
    _add_tier_args(p)
    p.add_argument("--workers", type=positive_int, default=None,
                   help="processes (default: CPU count); with --backend ray, the CPUs of a local Ray")
    p.add_argument("--backend", default="process", choices=["process", "ray"],
                   help="process: a local process pool (default); ray: a Ray cluster at RAY_ADDRESS, or a "
                        "local Ray (extra [ray]); each trace goes to the object store once")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("workload", help="write a seeded synthetic workload as a token trace file")
    from .sim.workloads import BUILTIN_WORKLOADS
    p.add_argument("--name", default="default", choices=sorted(BUILTIN_WORKLOADS))
    p.add_argument("--seed", type=non_negative_int, default=None)
    p.add_argument("--requests", type=positive_int, default=None)
    p.add_argument("--out", required=True, help="output JSONL path (an existing file is kept unless --force)")
    p.add_argument("--force", action="store_true", help="replace an existing --out file")
    p.set_defaults(func=cmd_workload)

    from .bench.cli import add_bench_command
    from .fleet.cli import add_fleet_command
    from .tiers.cli import add_tier_command
    from .sim.export import add_trace_command
    add_generate_command(sub)
    add_trace_command(sub)
    add_bench_command(sub)
    add_fleet_command(sub)
    add_tier_command(sub)
    return parser


def add_generate_command(subparsers) -> None:
    """Register ``prefixkv generate`` (the engine demo, ``prefixkv.engine.demo``: torch when run)."""
    p = subparsers.add_parser(
        "generate", help="run a tiny random-weight Llama through the packed engine, prefix cache on vs off",
        description="Generate with a tiny random-weight Llama-style model (no download) through prefixkv's "
                    "packed engine, on built-in prompts that share a system prompt; print prefill tokens "
                    "saved by the prefix cache, hit rate and tokens/s, with the same run without the cache "
                    "beside it.")
    p.add_argument("--requests", type=positive_int, default=8, help="number of prompts (default 8)")
    p.add_argument("--max-new-tokens", type=positive_int, default=32)
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--num-blocks", type=positive_int, default=512, help="KV pool size in blocks")
    p.add_argument("--budget", type=positive_int, default=256, help="token budget per step")
    p.add_argument("--max-seqs", type=positive_int, default=16, help="concurrency limit")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--hidden-size", type=positive_int, default=256)
    p.add_argument("--heads", type=positive_int, default=8)
    p.add_argument("--kv-heads", type=positive_int, default=2)
    p.add_argument("--temperature", type=non_negative_float, default=0.0, help="0: greedy (default)")
    p.add_argument("--seed", type=seed, default=0, help="weights and sampling seed")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per setting, alternating; the fastest "
                                                               "is reported (default 3)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1: the model is tiny, more threads mostly add waiting)")
    p.add_argument("--remote", metavar="URL", default=None,
                   help="a shared remote tier for the cache-on runs (redis://host:port/db, unix:///path.sock, "
                        "redis+cluster://host:port,...): prefixes other runs or replicas computed are loaded "
                        "from it, verified; implies a host tier of 2 x --num-blocks")
    p.add_argument("--disk", metavar="PATH", default=None,
                   help="a persistent disk tier for the cache-on runs (a directory, made when missing): a later "
                        "run on the same directory loads what this one wrote, verified; implies a host tier of "
                        "2 x --num-blocks; above --remote when both are given")
    p.add_argument("--disk-bytes", metavar="SIZE", type=positive_size, default=None,
                   help="bytes of blocks the disk tier keeps at most (e.g. 2GiB; default 4GiB): least recently "
                        "used evicted beyond")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from .engine.demo import cmd_generate
    return cmd_generate(args)


def main(argv: list[str] | None = None) -> int:
    return run(build_parser(), sys.argv[1:] if argv is None else list(argv))


if __name__ == "__main__":
    sys.exit(main())
