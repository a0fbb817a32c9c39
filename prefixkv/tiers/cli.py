"""``prefixkv tier``: operator commands for a remote tier's store (extra ``[redis]``).

* ``prefixkv tier stats URL [--json]``: per master node, memory used and its limit, the
  eviction policy, evicted keys, keys, keyspace hits and misses.
* ``prefixkv tier clear URL [--fingerprint F] [--prefix P]``: delete every prefixkv block under
  the prefix (all models), or only one fingerprint's (32 hex digits, as ``tier stats`` of a
  running engine's ``RemoteTier.stats()["fingerprint"]`` shows).

Wire it with ``add_tier_command(subparsers)`` in ``prefixkv.cli.build_parser``; nothing beyond
the core is imported until a command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import re

_FINGERPRINT = re.compile(r"^[0-9a-f]{32}$")
# Longer than any server answers a ping; past ~1e9 s the socket and thread waits overflow.
MAX_TIMEOUT_S = 3600.0


def _fingerprint_hex(text: str) -> str:
    value = text.strip().lower()
    if not _FINGERPRINT.match(value):
        # what was typed, not its normalised form: ' Z' would otherwise read as 'z'
        raise argparse.ArgumentTypeError(f"a fingerprint is 32 hex digits, got {text!r}")
    return value


def shown_url(url: str) -> str:
    """``url`` with its password masked: what the commands print ends up in terminals and logs."""
    from .redis_net import masked_url     # redis-py is an extra: imported when a command runs

    return masked_url(url)


def _timeout(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and 0 < value <= MAX_TIMEOUT_S):
        raise argparse.ArgumentTypeError(f"expected seconds above 0 and at most {MAX_TIMEOUT_S:g}, got {text!r}")
    return value


def _key_prefix(text: str) -> str:
    from .redis_keys import _PREFIX     # the store's own rule (the prefix goes into SCAN patterns)

    if not _PREFIX.match(text):
        raise argparse.ArgumentTypeError(f"a key prefix is 1-64 of A-Z a-z 0-9 _ . -, got {text!r}")
    return text


def add_tier_command(subparsers) -> None:
    p = subparsers.add_parser("tier", help="inspect or clear a remote tier's Redis store",
                              description="Operator commands for the Redis (or Redis Cluster) store under a "
                                          "remote tier. URLs: redis://host:port/db, unix:///path.sock, "
                                          "redis+cluster://host:port[,host:port...].")
    sub = p.add_subparsers(dest="tier_command", required=True, metavar="{stats,clear}")
    s = sub.add_parser("stats", help="memory, limit, eviction policy, evictions, keys, hits per node")
    s.add_argument("url")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--timeout", type=_timeout, default=1.0, help="connect and socket timeout in seconds (default 1)")
    s.set_defaults(func=cmd_tier_stats)
    c = sub.add_parser("clear", help="delete prefixkv blocks (all, or one fingerprint's)")
    c.add_argument("url")
    c.add_argument("--fingerprint", type=_fingerprint_hex, default=None,
                   help="only this fingerprint's blocks (32 hex digits); default: every prefixkv block")
    c.add_argument("--prefix", type=_key_prefix, default=None, help="key prefix (default pkv)")
    c.add_argument("--timeout", type=_timeout, default=1.0, help="connect and socket timeout in seconds (default 1)")
    c.set_defaults(func=cmd_tier_clear)


def _operator_store(url: str, timeout: float, prefix: str | None = None):
    """A store for operator calls only. Stats and clear do not depend on the fingerprint (clear
    scans by prefix and, when given, by the fingerprint's hex), so a placeholder one is used."""
    from .fingerprint import Fingerprint
    from .redis_keys import DEFAULT_PREFIX

    try:
        from .redis_store import RedisBlockStore, RedisStoreConfig
    except ImportError as exc:
        if (exc.name or "").partition(".")[0] != "redis":
            raise
        raise ValueError("prefixkv tier needs redis-py, which is not installed: pip install 'prefixkv[redis]'") from None
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"--timeout must be above 0 and at most {MAX_TIMEOUT_S:g} seconds, got {timeout}")
    placeholder = Fingerprint(b"prefixkv-operator", "float16", 1, 1, 1, 1, hash_seed=0)
    config = RedisStoreConfig(prefix=DEFAULT_PREFIX if prefix is None else prefix, connect_timeout_s=timeout, socket_timeout_s=timeout)
    return RedisBlockStore(url, placeholder, config)


def cmd_tier_stats(args: argparse.Namespace) -> int:
    with _operator_store(args.url, args.timeout) as store:
        nodes = store.server_stats()
    url = shown_url(args.url)
    if args.json:
        print(json.dumps({"url": url, "nodes": nodes}))
        return 0
    print(f"prefixkv tier stats: {url} ({len(nodes)} node{'s' if len(nodes) != 1 else ''})")
    for n in nodes:
        limit = f"{n['maxmemory'] / 2**20:,.0f} MiB" if n["maxmemory"] else "no limit"
        looked = n["keyspace_hits"] + n["keyspace_misses"]
        rate = f"{100 * n['keyspace_hits'] / looked:.1f}%" if looked else "-"
        print(f"  {n['node']}: {n['used_memory'] / 2**20:,.1f} MiB used of {limit} ({n['maxmemory_policy'] or '?'}), "
              f"{n['keys']:,} keys, {n['evicted_keys']:,} evicted, keyspace hits {n['keyspace_hits']:,} / "
              f"misses {n['keyspace_misses']:,} ({rate})")
        if n["maxmemory"] and n["maxmemory_policy"] != "allkeys-lru":
            print(f"    note: the remote tier expects maxmemory-policy allkeys-lru "
                  f"(with {n['maxmemory_policy']}, a full server refuses writes instead of evicting)")
    return 0


def cmd_tier_clear(args: argparse.Namespace) -> int:
    with _operator_store(args.url, args.timeout, args.prefix) as store:
        deleted = store.clear(args.fingerprint)
    which = f"fingerprint {args.fingerprint}" if args.fingerprint else "every fingerprint"
    print(f"prefixkv tier clear: deleted {deleted:,} block(s) of {which} at {shown_url(args.url)}")
    return 0
