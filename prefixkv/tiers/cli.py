"""``prefixkv tier``: operator commands for a lower tier's store: a Redis server (extra ``[redis]``)
or a disk store directory (``disk_store``).

* ``prefixkv tier stats URL [--json]``: per master node, memory used and its limit, the
  eviction policy, evicted keys, keys, keyspace hits and misses.
* ``prefixkv tier clear URL [--fingerprint F] [--prefix P]``: delete every prefixkv block under
  the prefix (all models), or only one fingerprint's (32 hex digits, as ``tier stats`` of a
  running engine's ``RemoteTier.stats()["fingerprint"]`` shows).
* ``prefixkv tier stats PATH [--json]`` / ``prefixkv tier clear PATH [--fingerprint F]``, where
  PATH is ``disk:///abs/path``, ``disk://relative/path`` or a plain directory path (anything
  without ``://``): per fingerprint namespace, block files, bytes, the ledger's count, the
  capacity the last store opened with, leftover temporary files; clear deletes block files only,
  under each namespace's lock (``disk_admin``). Nothing is written by ``stats``.

Wire it with ``add_tier_command(subparsers)`` in ``prefixkv.cli.build_parser``; nothing beyond
the core is imported until a command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

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


DISK_SCHEME = "disk://"
_TARGET_HELP = ("a Redis URL (redis://host:port/db, unix:///path.sock, redis+cluster://host:port[,host:port...]) "
                "or a disk store directory: disk:///abs/path, disk://relative/path, or a plain path (anything "
                "without '://')")


def disk_path(target: str) -> str | None:
    """The directory a ``tier`` target names, or None for a Redis URL (see the module docstring)."""
    from ..errors import InvalidArgument

    if target.startswith(DISK_SCHEME):
        path = target[len(DISK_SCHEME):]
        if not path:
            raise InvalidArgument("url", f"{target!r} names no directory: disk:///abs/path or disk://relative/path")
        return path
    if "://" in target:
        return None
    if not target:
        raise InvalidArgument("url", f"expected {_TARGET_HELP}, got ''")
    return target


def add_tier_command(subparsers) -> None:
    p = subparsers.add_parser("tier", help="inspect or clear a lower tier's store (Redis, or a disk directory)",
                              description="Operator commands for the store under a lower tier: a Redis (or Redis "
                                          "Cluster) server, or a disk store directory. The store is "
                                          f"{_TARGET_HELP}.")
    sub = p.add_subparsers(dest="tier_command", required=True, metavar="{stats,clear}")
    s = sub.add_parser("stats", help="Redis: memory, limit, eviction policy, evictions, keys, hits per node; "
                                     "disk: blocks, bytes, capacity, leftover temporary files per fingerprint")
    s.add_argument("url", metavar="URL|PATH", help=f"the store: {_TARGET_HELP}")
    s.add_argument("--json", action="store_true", help="print one JSON object")
    s.add_argument("--timeout", type=_timeout, default=None,
                   help="Redis only: connect and socket timeout in seconds (default 1)")
    s.set_defaults(func=cmd_tier_stats)
    c = sub.add_parser("clear", help="delete prefixkv blocks (all, or one fingerprint's)")
    c.add_argument("url", metavar="URL|PATH", help=f"the store: {_TARGET_HELP}")
    c.add_argument("--fingerprint", type=_fingerprint_hex, default=None,
                   help="only this fingerprint's blocks (32 hex digits); default: every prefixkv block")
    c.add_argument("--prefix", type=_key_prefix, default=None, help="Redis only: key prefix (default pkv)")
    c.add_argument("--timeout", type=_timeout, default=None,
                   help="Redis only: connect and socket timeout in seconds (default 1)")
    c.set_defaults(func=cmd_tier_clear)


def _redis_only(args: argparse.Namespace, names: tuple[str, ...]) -> None:
    """Options of the Redis form mean nothing for a disk store: refused rather than ignored."""
    given = [f"--{name}" for name in names if getattr(args, name, None) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to a Redis URL, "
                         f"not to a disk store ({args.url})")


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
    timeout = 1.0 if timeout is None else timeout
    if not 0 < timeout <= MAX_TIMEOUT_S:
        raise ValueError(f"--timeout must be above 0 and at most {MAX_TIMEOUT_S:g} seconds, got {timeout}")
    placeholder = Fingerprint(b"prefixkv-operator", "float16", 1, 1, 1, 1, hash_seed=0)
    config = RedisStoreConfig(prefix=DEFAULT_PREFIX if prefix is None else prefix, connect_timeout_s=timeout, socket_timeout_s=timeout)
    return RedisBlockStore(url, placeholder, config)


def cmd_tier_stats(args: argparse.Namespace) -> int:
    path = disk_path(args.url)
    if path is not None:
        _redis_only(args, ("timeout",))
        return _disk_stats(path, args.json)
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
    path = disk_path(args.url)
    if path is not None:
        _redis_only(args, ("prefix", "timeout"))
        return _disk_clear(path, args.fingerprint)
    with _operator_store(args.url, args.timeout, args.prefix) as store:
        deleted = store.clear(args.fingerprint)
    which = f"fingerprint {args.fingerprint}" if args.fingerprint else "every fingerprint"
    print(f"prefixkv tier clear: deleted {deleted:,} block(s) of {which} at {shown_url(args.url)}")
    return 0


def _mib(n: int) -> str:
    """Bytes in binary units, as ``plan`` writes them (``--json`` has the exact count)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:,.1f} {unit}"
    return f"{n:,} B"


def _disk_stats(path: str, as_json: bool) -> int:
    from .disk_admin import namespaces, survey      # checked first: a wrong path is one line, exit 2

    shown = os.path.abspath(path)
    found = [survey(path, name) for name in namespaces(path)]
    if as_json:
        print(json.dumps({"store": "disk", "path": shown, "namespaces": [f.as_dict() for f in found]}))
        return 0
    print(f"prefixkv tier stats: disk store {shown} ({len(found)} fingerprint{'s' if len(found) != 1 else ''})")
    for f in found:
        capacity = (f"of {_mib(f.capacity_bytes)} (the capacity the last store opened with)"
                    if f.capacity_bytes is not None else "(capacity not recorded)")
        line = (f"  {f.fingerprint}: {f.blocks:,} blocks, {_mib(f.bytes)} used {capacity}, "
                f"{f.leftover_temps:,} leftover temporary file{'s' if f.leftover_temps != 1 else ''}")
        if f.live_temps:
            line += f", {f.live_temps:,} write{'s' if f.live_temps != 1 else ''} in progress"
        if f.unknown_files:
            line += f", {f.unknown_files:,} other file{'s' if f.unknown_files != 1 else ''} (not the store's)"
        print(line)
        if f.ledger_bytes != f.bytes:
            recorded = "missing" if f.ledger_bytes is None else _mib(f.ledger_bytes)
            print(f"    note: the ledger records {recorded} (a process killed mid-update, or a write in flight); "
                  f"the next open recounts it")
    return 0


def _disk_clear(path: str, fingerprint: str | None) -> int:
    from .disk_admin import clear

    cleared = clear(path, fingerprint)
    which = f"fingerprint {fingerprint}" if fingerprint else "every fingerprint"
    line = (f"prefixkv tier clear: deleted {cleared.blocks:,} block file(s) ({_mib(cleared.bytes)}) of {which} "
            f"at disk store {os.path.abspath(path)}")
    if cleared.leftover_temps:
        line += f", and {cleared.leftover_temps:,} leftover temporary file(s)"
    print(line)
    if cleared.failed:
        print(f"prefixkv tier clear: error: {cleared.failed:,} file(s) could not be deleted", file=sys.stderr)
        return 1
    return 0
