"""``prefixkv fleet``: N simulated replicas behind a router, beside round robin and one N x manager.

Wire it with ``add_fleet_command(subparsers)`` in ``prefixkv.cli.build_parser``; ``main(argv)``
runs the command alone (tests). Imports nothing beyond the core until it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from ..argtypes import non_negative_int, positive_int
from ..console import counted
from ..errors import InvalidArgument, PrefixKVError

ROUTER_NAMES = ("round-robin", "least-load", "prefix", "kv-aware", "kv-aware+guard")


def _capacity(text: str):
    """Blocks per replica, or a percentage of the trace's distinct blocks ("2%")."""
    text = text.strip()
    try:
        if text.endswith("%"):
            value = float(text[:-1])
            if not 0 < value <= 100:
                raise ValueError
            return ("percent", value)
        value = int(text)
        if value <= 0:
            raise ValueError
        return ("blocks", value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a positive number of blocks per replica or a percentage such as 2%, got {text!r}") from None


def add_fleet_command(subparsers) -> None:
    from ..sim.workloads import BUILTIN_WORKLOADS

    p = subparsers.add_parser(
        "fleet", help="simulate N replicas behind a cache-aware router (hit rate, balance, queue wait)",
        description="Drive N real KVCacheManagers through a router over a trace (requests at the trace's "
                    "timestamps; prefill and decode time from the cost model) and print hit rate, each "
                    "replica's share of requests and p50/p99 queue wait, beside round robin over the same "
                    "replicas and one manager with N x the capacity.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--trace", help="a trace file (Mooncake, kv-cache-tester or prefixkv tokens)")
    source.add_argument("--workload", choices=sorted(BUILTIN_WORKLOADS), default=None,
                        help="a built-in generated workload (default: default)")
    p.add_argument("--format", default="auto", choices=["auto", "mooncake", "kvcache-tester", "tokens"])
    p.add_argument("--replicas", type=positive_int, default=4)
    p.add_argument("--capacity", type=_capacity, default=("percent", 2.0),
                   help="blocks per replica, or a percentage of the trace's distinct blocks, e.g. 2%% (default)")
    p.add_argument("--router", choices=ROUTER_NAMES, default="kv-aware+guard")
    p.add_argument("--event-delay", type=non_negative_int, default=0, metavar="REQUESTS",
                   help="replicas' KV events reach the index this many routed requests late (default 0)")
    p.add_argument("--no-predict", action="store_true",
                   help="no predicted inserts (a routed request's blocks wait for their events)")
    p.add_argument("--cost-params", default=None,
                   help="cost model: a profile (h200, cpu-tiny) or a JSON/TOML file (default h200)")
    p.add_argument("--policy", default="lru", help="eviction policy of every replica (default lru)")
    p.add_argument("--seed", type=int, default=0, help="router tie-break seed")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=cmd_fleet)


# Host bytes of one simulated replica before it caches anything (its manager, policy and
# bookkeeping): 6.2 KB measured with tracemalloc over 2,000 replicas of 112 blocks.
BYTES_PER_REPLICA = 6_500


def cmd_fleet(args: argparse.Namespace) -> int:
    from ..costs import load_params
    from ..sim.traces import load_trace
    from ..sim.workloads import builtin_trace
    from .simulator import FleetConfig, compare

    if args.trace == "":     # an empty shell variable: not "no --trace" (nor the current directory)
        raise InvalidArgument("--trace", "an empty path (a trace file or a kv-cache-tester folder is expected)")
    if args.trace:
        trace = load_trace(args.trace, args.format)
        label = os.path.basename(os.path.normpath(args.trace))     # (a folder given as traces/ too)
    else:
        name = args.workload or "default"
        trace = builtin_trace(name)
        label = f"{name} (generated)"
    if not trace.requests:
        raise ValueError(f"{label}: the trace has no requests")
    if args.replicas > len(trace.requests):
        raise InvalidArgument("--replicas", f"{args.replicas:,} replicas for the trace's "
                                            f"{counted(len(trace.requests), 'request')}: at most "
                                            f"{len(trace.requests):,} (a replica no request reaches measures "
                                            f"nothing, and each costs every routing decision a score)")
    from ..hostmem import require

    require(2 * args.replicas * BYTES_PER_REPLICA, f"{counted(args.replicas, 'replica')} (the fleet and its "
                                                   f"round-robin reference, ~{BYTES_PER_REPLICA:,} B each)")
    kind, value = args.capacity
    distinct = trace.distinct_blocks() if kind == "percent" else None
    capacity = max(1, round(distinct * value / 100)) if kind == "percent" else value
    config = FleetConfig(replicas=args.replicas, capacity=capacity, router=args.router,
                         event_delay=args.event_delay, predict=not args.no_predict,
                         params=load_params(args.cost_params), policy=args.policy, seed=args.seed)
    out = compare(trace, config)
    out.update(trace=label, block_size=trace.block_size, cost_params=config.params.name,
               predict=config.predict, distinct_blocks=distinct)
    if args.json:
        print(json.dumps(out))
        return 0
    _print(out, args, trace)
    return 0


def _print(out: dict, args, trace) -> None:
    cap = f"{out['capacity']:,} blocks of {out['block_size']} tokens per replica"
    if out["distinct_blocks"]:
        cap += f" ({args.capacity[1]:g}% of {out['distinct_blocks']:,} distinct)"
    print(f"{out['trace']}: {counted(len(trace), 'request')}, {counted(out['replicas'], 'replica')} x {cap}, router {out['router']}, "
          f"events {out['event_delay']} request(s) late, predicted inserts {'on' if out['predict'] else 'off'}, "
          f"cost model {out['cost_params']}")
    rows = [
        ("hit rate", f"{100 * out['hit_rate']:.2f} %  (round robin {100 * out['round_robin_hit_rate']:.2f} %, "
                     f"one manager with {out['replicas']}x capacity {100 * out['single_hit_rate']:.2f} %)"),
        ("requests per replica", "  ".join(f"{100 * s:.1f}%" for s in out["shares"])
         + f"  (busiest {100 * out['busiest_share']:.1f} %)"),
        ("queue wait p50 / p99", f"{out['p50_wait_s']:.3f} s / {out['p99_wait_s']:.3f} s  "
                                 f"(round robin p99 {out['round_robin_p99_wait_s']:.3f} s)"),
        ("decisions", ", ".join(f"{k} {v:,}" for k, v in sorted(out["decisions"].items()))),
    ]
    if out["oversized_requests"]:
        rows.append(("too large for a replica", f"{out['oversized_requests']:,} (counted as misses)"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key:>{width}}  {value}")


def main(argv: list[str] | None = None) -> int:
    """``prefixkv fleet`` on its own: ``main(["--workload", "large", "--json"])``."""
    parser = argparse.ArgumentParser(prog="prefixkv")
    sub = parser.add_subparsers(dest="command", required=True)
    add_fleet_command(sub)
    args = parser.parse_args(["fleet", *(argv or [])])
    try:
        return args.func(args)
    except (PrefixKVError, ValueError, OSError, RuntimeError) as exc:
        parser.exit(2, f"prefixkv fleet: error: {exc}\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
