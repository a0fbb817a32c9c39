"""The ``prefixkv`` command line."""

from __future__ import annotations

import argparse
import json
import os
import sys

from .argtypes import fraction, positive_int, positive_size, size
from .errors import PrefixKVError
from .sizing import KVSpec, format_size, parse_size, plan

DESCRIPTION = ("prefixkv: a prefix-caching, paged KV-cache store. Size a pool (plan), check the block "
               "arithmetic (lab), replay request traces under eviction policies (replay, compare, workload), "
               "generate with a paged cache (generate) and benchmark block sizes (bench).")

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
    spec = KVSpec(args.layers, args.kv_heads, args.head_dim, args.dtype, args.tp)
    result = plan(spec, args.block_size, args.pool, args.prompt_tokens)
    if args.json:
        print(json.dumps(result.as_dict()))
        return 0
    d = result.as_dict()
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
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:>{width}}  {value}")
    return 0


def cmd_lab(args: argparse.Namespace) -> int:
    from .sim.lab import run_lab

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
    if not traces:
        trace = builtin_trace(args.workload)
        return [TraceSource(f"{args.workload} (generated)", (str(trace.path),), "tokens")]
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


def cmd_replay(args: argparse.Namespace) -> int:
    from .sim.replay import replay

    source = _trace_sources(args)[0]
    trace = source.load()
    result = replay(trace, args.policy, args.capacity, mode=args.mode, warmup=args.warmup).as_dict()
    result["trace"] = source.label
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"{source.label}: {len(trace):,} requests, blocks of {trace.block_size} tokens, "
          f"policy {args.policy}, capacity {args.capacity:,} blocks, {args.mode} mode")
    where = _where_generated([source])
    if where:
        print(where)
    for key in ("requests", "block_accesses", "block_hits", "block_hit_rate", "token_hit_rate", "evictions",
                "block_insertions", "blocks_never_reused", "oversized_requests", "waited_admissions",
                "mean_wait_s"):
        if key in result:
            value = result[key]
            if key.endswith("_rate"):
                print(f"  {key:>20}  {100 * value:.2f} %")
            elif isinstance(value, float):
                print(f"  {key:>20}  {value:.4f}")
            else:
                print(f"  {key:>20}  {value:,}")
    return 0


def cmd_compare(args: argparse.Namespace) -> int:
    from rich.progress import Progress
    from rich.table import Table

    from .sim.sweep import auto_capacities, gap_summary, plot, sweep
    from .console import make_console
    from .policies import available_policies, make_policy

    # LRU first (the baseline), MIN last (the bound, only where the future is known), the rest by name.
    policies = args.policies or sorted((p for p in available_policies()
                                        if p != "belady" or args.mode == "cache"),
                                       key=lambda p: (p != "lru", p == "belady", p))
    if args.mode != "cache" and "belady" in policies:
        raise ValueError("belady (MIN) needs requests in trace order: it runs in --mode cache only")
    unknown = [p for p in policies if p.partition(":")[0] not in available_policies()]
    if unknown:
        raise ValueError(f"unknown polic{'y' if len(unknown) == 1 else 'ies'} {', '.join(unknown)}; "
                         f"available: {', '.join(available_policies())}")
    for spec in policies:  # bad options stop here, before any worker starts
        make_policy(spec)
    sources = _trace_sources(args)
    capacities = {s.label: (auto_capacities(s.load()) if args.capacities == "auto" else args.capacities)
                  for s in sources}
    console = make_console(stderr=True)
    total = sum(len(policies) * len(capacities[s.label]) for s in sources)
    with Progress(console=console, transient=True, disable=args.json or not console.is_terminal) as bar:
        task = bar.add_task("replaying", total=total)
        results = sweep(sources, policies, capacities, mode=args.mode, warmup=args.warmup,
                        workers=args.workers, on_done=lambda _: bar.advance(task))
    summary = gap_summary(results)
    if args.plot:
        plot(results, args.plot)
    if args.json:
        print(json.dumps({"results": results, "summary": summary}))
        return 0
    out = make_console()
    for source in sources:
        caps = capacities[source.label]
        rows = [r for r in results if r["trace"] == source.label]
        table = Table(title=f"{source.label}: block hit rate (%) by capacity in blocks of "
                            f"{rows[0]['block_size']} tokens, {args.mode} mode")
        table.add_column("policy")
        for c in caps:
            table.add_column(f"{c:,}", justify="right")
        rate = {(r["policy"], r["capacity"]): r["block_hit_rate"] for r in rows}
        online = [p for p in policies if p != "belady"]
        best = {c: max(rate[(p, c)] for p in online) for c in caps} if online else {}
        for p in policies:
            cells = []
            for c in caps:
                text = f"{100 * rate[(p, c)]:.2f}"
                cells.append(f"[bold]{text}[/bold]" if p != "belady" and rate[(p, c)] == best[c] else text)
            table.add_row("MIN (belady)" if p == "belady" else p, *cells)
        gaps = {row["capacity"]: row for row in summary if row["trace"] == source.label}
        if online and all("gap_closed" in gaps[c] for c in caps):
            table.add_section()
            table.add_row("best online", *[gaps[c]["best_policy"] for c in caps])
            table.add_row("LRU->MIN gap closed",
                          *["-" if gaps[c]["gap_closed"] is None else f"{100 * gaps[c]['gap_closed']:.0f}%"
                            for c in caps])
        out.print(table)
        oversized = {r["capacity"]: (r["oversized_requests"], r["requests"]) for r in rows
                     if r["oversized_requests"]}
        if oversized:
            out.print("[yellow]requests larger than the whole cache, counted as all misses: "
                      + ", ".join(f"{n:,} of {total:,} at {c:,} blocks" for c, (n, total) in sorted(oversized.items()))
                      + "[/yellow]")
    where = _where_generated(sources)
    if where:
        out.print(where)
    if args.plot:
        out.print(f"plot written to {args.plot}")
    return 0


def cmd_workload(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from .sim.workloads import BUILTIN_WORKLOADS, generate_trace

    config = BUILTIN_WORKLOADS[args.name]
    changes = {k: v for k, v in (("seed", args.seed), ("num_requests", args.requests)) if v is not None}
    config = replace(config, **changes)
    path = generate_trace(args.out, config)
    print(f"wrote {path}: {config.num_requests:,} requests of workload {config.name!r}, seed {config.seed}")
    return 0


def _add_trace_args(p: argparse.ArgumentParser, many: bool) -> None:
    from .sim.workloads import BUILTIN_WORKLOADS

    p.add_argument("--trace", action="append" if many else None, default=[] if many else None,
                   help="a trace file or kv-cache-tester folder" + (" (repeatable)" if many else "")
                        + "; default: the built-in generated workload")
    p.add_argument("--format", default="auto", choices=["auto", "mooncake", "kvcache-tester", "tokens"])
    p.add_argument("--workload", default="default", choices=sorted(BUILTIN_WORKLOADS),
                   help="built-in workload used when no --trace is given")
    p.add_argument("--mode", default="cache", choices=["cache", "concurrent"])
    p.add_argument("--warmup", type=fraction, default=0.0, help="fraction of requests excluded from measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def _policy_list(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",")]
    if not all(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated policy names, got {text!r}")
    return list(dict.fromkeys(names))


def _capacity_list(text: str):
    if text == "auto":
        return "auto"
    parts = [part.strip() for part in text.split(",")]
    if not all(part.isdigit() and int(part) > 0 for part in parts):
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
    p.add_argument("--plot", metavar="FILE.png", help="write hit rate against capacity")
    p.add_argument("--workers", type=positive_int, default=None, help="processes (default: CPU count)")
    p.set_defaults(func=cmd_compare)

    p = sub.add_parser("workload", help="write a seeded synthetic workload as a token trace file")
    from .sim.workloads import BUILTIN_WORKLOADS
    p.add_argument("--name", default="default", choices=sorted(BUILTIN_WORKLOADS))
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--requests", type=positive_int, default=None)
    p.add_argument("--out", required=True, help="output JSONL path")
    p.set_defaults(func=cmd_workload)

    from .bench.cli import add_bench_command
    add_generate_command(sub)
    add_bench_command(sub)
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
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy (default)")
    p.add_argument("--seed", type=int, default=0, help="weights and sampling seed")
    p.add_argument("--repeat", type=positive_int, default=3, help="runs per setting, alternating; the fastest "
                                                               "is reported (default 3)")
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads (default 1: the model is tiny, more threads mostly add waiting)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=_cmd_generate)


def _cmd_generate(args) -> int:
    from .engine.demo import cmd_generate
    return cmd_generate(args)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except BrokenPipeError:  # `prefixkv ... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except (PrefixKVError, ValueError, OSError, RuntimeError) as exc:
        parser.exit(2, f"prefixkv {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
