"""``prefixkv bench``: block sizes x one trace x one pool, per the design notes' method.

Wire it with ``add_bench_command(subparsers)`` in ``prefixkv.cli.build_parser``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..command import run
from ..argtypes import model_spec, positive_float, positive_int, positive_size, size
from ..sizing import DTYPE_BYTES, KVSpec, format_size

# The real tiny model's KV layout (TinyLlamaConfig defaults) and a pool a CPU can hold.
ENGINE_SPEC = KVSpec(layers=2, kv_heads=2, head_dim=16, dtype="float32")
ENGINE_POOL = 16 * 2**20


def _sizes(text: str) -> tuple[int, ...]:
    try:
        values = tuple(sorted({int(x) for x in text.split(",") if x.strip()}))
    except ValueError:
        raise argparse.ArgumentTypeError(f"block sizes must be comma-separated integers, got {text!r}") from None
    if not values or values[0] <= 0:
        raise argparse.ArgumentTypeError(f"block sizes must be positive, got {text!r}")
    return values


def _reserve(text: str):
    if text in ("max", "request"):
        return text
    try:
        return positive_int(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"expected max, request or a positive token count, got {text!r}") from None


def resolve_spec(args: argparse.Namespace) -> KVSpec:
    from .runner import SEED_SPEC

    base = ENGINE_SPEC if args.executor == "engine" else SEED_SPEC
    fields = dict(layers=base.layers, kv_heads=base.kv_heads, head_dim=base.head_dim, dtype=base.dtype,
                  tensor_parallel=base.tensor_parallel)
    if args.model_spec:
        fields.update(args.model_spec)
    for name in ("layers", "kv_heads", "head_dim", "dtype"):
        value = getattr(args, name)
        if value is not None:
            fields[name] = value
    if args.tp is not None:
        fields["tensor_parallel"] = args.tp
    try:
        return KVSpec(**fields)
    except ValueError as exc:
        given = [flag for flag, value in (("--model-spec", args.model_spec), ("--layers", args.layers),
                                          ("--kv-heads", args.kv_heads), ("--head-dim", args.head_dim),
                                          ("--dtype", args.dtype), ("--tp", args.tp)) if value is not None]
        where = ", ".join(given) if given else "the default model spec"
        raise ValueError(f"{where}: {exc}") from None


def build_config(args: argparse.Namespace):
    from ..costs import load_params
    from .runner import BenchConfig

    spec = resolve_spec(args)
    pool = args.pool if args.pool is not None else (ENGINE_POOL if args.executor == "engine" else 8 * 2**30)
    params = load_params(args.cost_params or ("cpu-tiny" if args.executor == "engine" else "h200"))
    return BenchConfig(block_sizes=args.block_sizes, pool_bytes=pool, spec=spec, policy=args.policy,
                       max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_seqs,
                       max_prefill_chunk=args.max_prefill_chunk, host_pool_bytes=args.host_pool,
                       executor=args.executor, params=params, threads=args.threads)


def load_bench_trace(args: argparse.Namespace):
    """(trace, label): ``--trace`` loaded, or the built-in workload written to a file first."""
    from ..sim.traces import load_trace
    from ..sim.workloads import builtin_trace

    if args.trace == "":     # an empty shell variable: not "no --trace" (nor the current directory)
        raise ValueError("--trace: an empty path (a trace file or a kv-cache-tester folder is expected)")
    if args.trace and args.workload is not None:
        raise ValueError("--workload names the built-in trace used when no --trace is given; give one or the other")
    if args.trace:
        trace = load_trace(args.trace, args.format)
        label = os.path.basename(os.path.normpath(args.trace)) or args.trace
    else:
        workload = args.workload or "default"
        trace = builtin_trace(workload)
        label = f"{workload} (generated, {os.path.basename(str(trace.path))})"
    if args.requests is not None:
        trace.requests = trace.requests[:args.requests]
    if args.rate_scale != 1.0:
        for r in trace.requests:
            r.timestamp = r.timestamp / args.rate_scale
    return trace, label


def check_pool_memory(cfg) -> None:
    """Refuse a pool whose block bookkeeping alone cannot fit in host memory (before any run)."""
    from ..hostmem import require_blocks

    smallest = min(cfg.block_sizes)
    per_block = cfg.spec.bytes_per_block(smallest)
    blocks = cfg.pool_bytes // per_block + cfg.host_pool_bytes // per_block
    require_blocks(blocks, f"a pool of {format_size(cfg.pool_bytes)} at block size {smallest}")


def check_block_sizes(cfg) -> None:
    """Refuse, before any run, a block size of which the pool cannot hold even one block."""
    largest = max(cfg.block_sizes)
    per_block = cfg.spec.bytes_per_block(largest)
    if cfg.pool_bytes < per_block:
        raise ValueError(f"--block-sizes {largest}: one block of {largest} tokens takes {format_size(per_block)}, "
                         f"more than the whole --pool of {format_size(cfg.pool_bytes)}; use smaller block sizes "
                         f"or a larger pool")


def _progress(status, total: int):
    """Spinner text after each block size: how many are done and, from their pace, the time left."""
    start = time.perf_counter()
    done = 0

    def on_done(block_size: int) -> None:
        nonlocal done
        done += 1
        elapsed = time.perf_counter() - start
        left = elapsed / done * (total - done)
        status.update(f"block size {block_size} done ({done} of {total}, about {left:,.0f} s left)")
    return on_done


def cmd_bench(args: argparse.Namespace) -> int:
    from ..console import make_console
    from ..outputs import plot_dir
    from .report import render, to_json, write_plots
    from .runner import run_bench

    if args.reserve_tokens is not None and not args.compare_reserved:
        raise ValueError("--reserve-tokens sets the reserved baseline's reservation: it needs --compare-reserved")
    if args.executor == "engine":
        try:
            import torch  # noqa: F401
        except ImportError:
            raise RuntimeError("prefixkv bench --executor engine needs torch (pip install 'prefixkv[torch]'); "
                               "the default --executor cost-model does not") from None
    cfg = build_config(args)
    check_block_sizes(cfg)
    check_pool_memory(cfg)
    if args.plot == "":      # was ignored; plot_dir("") would be the current directory
        raise ValueError("--plot needs a directory name, got ''")
    plot_target = plot_dir(args.plot) if args.plot is not None else None    # before the run, not after
    trace, label = load_bench_trace(args)
    if not trace.requests:
        raise ValueError("the trace has no requests")
    console = make_console(stderr=True)
    status = None if args.json or not console.is_terminal else console.status("benchmarking")
    if status:
        status.start()
    try:
        result = run_bench(trace, cfg, trace_label=label, vocab=args.vocab, compare_reserved=args.compare_reserved,
                           reserve_tokens=args.reserve_tokens or "max",
                           on_done=_progress(status, len(cfg.block_sizes)) if status else None)
    finally:
        if status:
            status.stop()
    if args.rate_scale != 1.0:
        result.trace["rate_scale"] = args.rate_scale
    # Results first: a plot that fails to write must not take the printed figures with it.
    if args.json:
        print(to_json(result), flush=True)
        if result.reserved_error is not None:
            print(f"prefixkv bench: note: {result.reserved_error} The paged results are complete.",
                  file=sys.stderr)
    else:
        render(result, wide=args.wide)
    if plot_target is not None:
        paths = write_plots(result, plot_target)
        for p in paths:
            print(f"wrote {p}", file=sys.stderr if args.json else sys.stdout)
    return 0


def add_bench_command(subparsers) -> argparse.ArgumentParser:
    from ..sim.workloads import BUILTIN_WORKLOADS

    p = subparsers.add_parser(
        "bench", help="block-size benchmark: one trace, one pool (bytes), one budget, several block sizes",
        description="Replay one trace through the engine's scheduler at several block sizes with the same KV "
                    "pool bytes (num_blocks = pool // bytes_per_block), token budget, concurrency limit and "
                    "precision. Reports tail waste, block-table length, preemptions, P50/P99 TTFT and ITL, "
                    "completed requests/s, prefix hit rate and block usage over time. The cost-model executor "
                    "models step time (profiles: h200, cpu-tiny, or a JSON/TOML file); the engine executor "
                    "runs the real tiny model on CPU.")
    p.add_argument("--trace", help="a trace file (Mooncake, kv-cache-tester, prefixkv tokens); "
                                   "default: the built-in generated workload")
    p.add_argument("--format", default="auto", choices=["auto", "mooncake", "kvcache-tester", "tokens"])
    p.add_argument("--workload", default=None, choices=sorted(BUILTIN_WORKLOADS),
                   help="built-in workload used when no --trace is given (written to a file first; "
                        "default: default)")
    p.add_argument("--requests", type=positive_int, default=None, help="use the first N requests only")
    p.add_argument("--rate-scale", type=positive_float, default=1.0,
                   help="multiply the arrival rate (timestamps / X, X > 0) to load the system harder")
    p.add_argument("--block-sizes", type=_sizes, default=(4, 8, 16, 32, 64, 128))
    p.add_argument("--pool", type=positive_size, default=None,
                   help="KV pool bytes, the same for every block size (default 8GiB; engine: 16MiB)")
    p.add_argument("--host-pool", type=size, default=0, help="host swap space in bytes (default 0: recompute)")
    p.add_argument("--model-spec", type=model_spec, default=None,
                   help="layers,kv_heads,head_dim[,dtype[,tp]] (default: the notes' 32,8,128,bfloat16; "
                        "engine: the tiny model's 2,2,16,float32)")
    p.add_argument("--layers", type=positive_int, default=None)
    p.add_argument("--kv-heads", type=positive_int, default=None)
    p.add_argument("--head-dim", type=positive_int, default=None)
    p.add_argument("--dtype", default=None, choices=sorted(DTYPE_BYTES))
    p.add_argument("--tp", type=positive_int, default=None, help="tensor-parallel degree")
    p.add_argument("--policy", default="lru", help="eviction policy of the prefix cache")
    p.add_argument("--max-batched-tokens", type=positive_int, default=2048, help="scheduler token budget per step")
    p.add_argument("--max-seqs", type=positive_int, default=128, help="concurrency limit")
    p.add_argument("--max-prefill-chunk", type=positive_int, default=None)
    p.add_argument("--executor", default="cost-model", choices=["cost-model", "engine"])
    p.add_argument("--threads", type=positive_int, default=1,
                   help="torch CPU threads for --executor engine (default 1: the model is tiny, more "
                        "threads mostly add waiting on a busy machine)")
    p.add_argument("--cost-params", default=None,
                   help="profile name (h200, cpu-tiny) or a JSON/TOML file of cost parameters "
                        "(default: h200; engine: cpu-tiny)")
    p.add_argument("--vocab", type=positive_int, default=32_000,
                   help="token ids synthesised for hashed traces are drawn below this")
    p.add_argument("--compare-reserved", action="store_true",
                   help="also serve the trace with reserve-max-length allocation on the same memory")
    p.add_argument("--reserve-tokens", type=_reserve, default=None,
                   help="with --compare-reserved, what a reserved request reserves: max (default: the "
                        "trace's longest request), request "
                        "(its own length, an oracle) or a token count N (max(N, its own length): a "
                        "request longer than N still gets its own length)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--wide", action="store_true",
                   help="one table with every column, however wide (default: split to fit the terminal)")
    p.add_argument("--plot", metavar="DIR", help="write latency_cdf.png, block_size.png, pool_usage.png "
                                                 "(and reserved.png) into DIR")
    p.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    """``prefixkv bench ARGS`` (``python -m prefixkv.bench.cli ARGS``)."""
    parser = argparse.ArgumentParser(prog="prefixkv")
    add_bench_command(parser.add_subparsers(dest="command", required=True))
    return run(parser, ["bench", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    raise SystemExit(main())
