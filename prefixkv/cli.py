"""The ``prefixkv`` command line."""

from __future__ import annotations

import argparse
import json
import sys

from .sizing import KVSpec, format_size, parse_size, plan

# The design notes' teaching model: a Llama-3-8B-like KV layout.
SEED_MODEL = dict(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


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
    from .lab import run_lab

    table, checks = run_lab(args.block_size, args.lengths)
    print(f"block_size={args.block_size} lengths={','.join(map(str, args.lengths))}")
    print(" ".join(f"{k}={v}" for k, v in table.items()))
    if args.bytes_per_token:
        print(f"tail_waste_bytes={format_size(table['tail_waste'] * args.bytes_per_token)}"
              f" at {format_size(args.bytes_per_token)} per token")
    for check in checks:
        print(f"{'PASS' if check.passed else 'FAIL'}  {check.name}: {check.detail}")
    return 0 if all(c.passed for c in checks) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="prefixkv", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="KV bytes per token/block and how many requests fit in a pool",
                       description="Size a KV pool. Defaults: the design notes' model (32 layers, "
                                   "8 KV heads x 128, bf16), block 16, 24 GiB, 4,097-token requests.")
    p.add_argument("--layers", type=_positive_int, default=SEED_MODEL["layers"])
    p.add_argument("--kv-heads", type=_positive_int, default=SEED_MODEL["kv_heads"])
    p.add_argument("--head-dim", type=_positive_int, default=SEED_MODEL["head_dim"])
    p.add_argument("--dtype", default=SEED_MODEL["dtype"])
    p.add_argument("--tp", type=_positive_int, default=1, help="tensor-parallel degree")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--pool", type=_size, default=parse_size("24GiB"), help="KV pool bytes, e.g. 24GiB")
    p.add_argument("--prompt-tokens", type=_positive_int, default=4097)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("lab", help="the small-pool lab: tail waste, COW, release and leak checks")
    p.add_argument("--block-size", type=_positive_int, default=16)
    p.add_argument("--lengths", type=_lengths, default=[17, 32, 63])
    p.add_argument("--bytes-per-token", type=_size, default=parse_size("128KiB"),
                   help="to express tail waste in bytes (default: the seed model's 128 KiB)")
    p.set_defaults(func=cmd_lab)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except ValueError as exc:
        parser.exit(2, f"prefixkv {args.command}: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
