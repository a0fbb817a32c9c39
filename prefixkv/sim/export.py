"""Write a trace's block-reference stream in libCacheSim's formats (``prefixkv trace export``).

libCacheSim (``pip install libcachesim``) simulates ~25 eviction algorithms on a stream of
object references. A KV trace becomes one by taking every block a request names as one
reference, each block one unit of size, so a libCacheSim cache of N bytes holds N blocks.
Block ids are dense (1, 2, ... in the order blocks first appear), whatever the trace's own ids
or token hashes were.

Orders (``order``):

* ``forward``: each request's blocks in prefix order, one reference each: the lookups.
* ``forward-reverse``: the lookups, then the same blocks again tail first: the release, which
  a paged prefix cache does tail first so a request's prefix ends up most recently used. This
  is the stream on which libCacheSim's ``LRU`` hits exactly the blocks ``prefixkv replay
  --policy lru`` hits: after every request a prefix is more recent than its extensions, so
  LRU never keeps a block without its parent and every cached block of a request is a leading
  one. Each release reference hits (the block was just looked up), so ``prefixkv``'s
  ``block_hits`` = libCacheSim's hits - the forward references. Two conditions: every
  request fits in the cache (``prefixkv`` never admits a request larger than the cache, and
  leaves the cache untouched; libCacheSim inserts it), and cache mode (requests one at a
  time, as ``prefixkv replay --mode cache``).

With ``forward`` (or for any algorithm but LRU) per-block hit counts differ from a prefix
cache's: a prefix cache counts only *leading* hits (a block after the first miss is
recomputed even if cached), while a per-object simulator counts every cached block.

oracleGeneral records are little-endian ``<IQIq``: uint32 timestamp (whole seconds since the
first request), uint64 obj_id, uint32 obj_size (1), int64 next_access_vtime (the index in
the stream of the object's next reference, -1 for none: what libCacheSim's Belady reads).
CSV rows carry the same four fields under a header.
"""

from __future__ import annotations

import csv
import os
import struct
from dataclasses import dataclass
from typing import Iterator, Sequence

from ..errors import InvalidArgument

FORMATS = ("oracle-general", "csv")
ORDERS = ("forward", "forward-reverse")
ORACLE_GENERAL = struct.Struct("<IQIq")
CSV_HEADER = ("timestamp", "obj_id", "obj_size", "next_access_vtime")
_UINT32 = 2**32 - 1


@dataclass(frozen=True)
class ExportSummary:
    """What ``export_trace`` wrote."""

    path: str
    format: str
    order: str
    requests: int
    references: int          # records written
    lookups: int             # the forward references (prefixkv's block accesses)
    distinct_blocks: int
    largest_request: int     # blocks: a libCacheSim cache at least this large matches prefixkv's LRU

    def reader_options(self) -> str:
        """How to open the file with libCacheSim: its Python package, and its ``cachesim`` tool."""
        if self.format == "oracle-general":
            return (f"libcachesim.TraceReader({self.path!r}, libcachesim.TraceType.ORACLE_GENERAL_TRACE); "
                    f"cachesim {self.path} oracleGeneral lru <cache size in blocks>")
        return (f"libcachesim.TraceReader({self.path!r}, libcachesim.TraceType.CSV_TRACE, "
                "libcachesim.ReaderInitParam(has_header=True, delimiter=',') with time_field=1, "
                "obj_id_field=2, obj_size_field=3, next_access_vtime_field=4 set on it); "
                f"cachesim {self.path} csv lru <cache size in blocks> -t \"time-col=1, obj-id-col=2, "
                "obj-size-col=3, has-header=true, delimiter=,\"")


def request_block_ids(trace) -> list[list[int]]:
    """Each request's blocks as dense ids (1-based, in first-appearance order): a hashed trace's
    every id, a token trace's full blocks hashed as a replay hashes them (seed 0, salt included)
    -- the block accesses ``prefixkv.sim.replay`` counts."""
    dense: dict = {}
    out: list[list[int]] = []
    hasher = None
    for r in trace.requests:
        if r.block_hashes is not None:
            hashes = r.block_hashes
        elif r.tokens is not None:
            if hasher is None:
                from ..hashing import BlockHasher
                from .traces import _token_hashes

                hasher = BlockHasher(trace.block_size, seed=0)
            hashes = _token_hashes(hasher, r)
        else:
            hashes = ()
        ids = []
        for h in hashes:
            i = dense.get(h)
            if i is None:
                dense[h] = i = len(dense) + 1
            ids.append(i)
        out.append(ids)
    return out


def block_stream(trace, order: str = "forward") -> tuple[list[int], list[int]]:
    """(timestamps, obj_ids): the references of ``trace`` in ``order`` (module doc)."""
    if order not in ORDERS:
        raise InvalidArgument("order", f"must be one of {', '.join(ORDERS)}, got {order!r}")
    times: list[int] = []
    ids: list[int] = []
    first = trace.requests[0].timestamp if trace.requests else 0.0
    for r, blocks in zip(trace.requests, request_block_ids(trace)):
        t = min(_UINT32, max(0, int(r.timestamp - first)))
        refs = blocks + blocks[::-1] if order == "forward-reverse" else blocks
        ids += refs
        times += [t] * len(refs)
    return times, ids


def next_access(ids: Sequence[int]) -> list[int]:
    """Per reference, the index of the next reference to the same object (-1: none)."""
    out = [-1] * len(ids)
    seen: dict[int, int] = {}
    for i in range(len(ids) - 1, -1, -1):
        obj = ids[i]
        out[i] = seen.get(obj, -1)
        seen[obj] = i
    return out


def _records(times, ids, nexts) -> Iterator[tuple[int, int, int, int]]:
    return zip(times, ids, [1] * len(ids), nexts)


def export_trace(trace, path: str | os.PathLike, format: str = "oracle-general",
                 order: str = "forward-reverse") -> ExportSummary:
    """Write ``trace``'s block references to ``path`` (atomically); see the module doc."""
    from ..outputs import atomic_path

    if format not in FORMATS:
        raise InvalidArgument("format", f"must be one of {', '.join(FORMATS)}, got {format!r}")
    times, ids = block_stream(trace, order)
    nexts = next_access(ids)
    with atomic_path(path) as tmp:
        if format == "oracle-general":
            pack = ORACLE_GENERAL.pack
            with open(tmp, "wb") as f:
                f.write(b"".join(pack(*rec) for rec in _records(times, ids, nexts)))
        else:
            with open(tmp, "w", newline="") as f:
                writer = csv.writer(f)
                writer.writerow(CSV_HEADER)
                writer.writerows(_records(times, ids, nexts))
    per_request = request_block_ids(trace)
    lookups = sum(map(len, per_request))
    return ExportSummary(path=str(path), format=format, order=order, requests=len(trace.requests),
                         references=len(ids), lookups=lookups, distinct_blocks=len(set(ids)),
                         largest_request=max(map(len, per_request), default=0))


def read_oracle_general(path: str | os.PathLike) -> list[tuple[int, int, int, int]]:
    """The records of an oracleGeneral file (for tests and checks)."""
    data = open(path, "rb").read()
    if len(data) % ORACLE_GENERAL.size:
        raise InvalidArgument("path", f"{os.fspath(path)!r} is {len(data)} bytes, not a whole number of "
                                      f"{ORACLE_GENERAL.size}-byte oracleGeneral records")
    return list(ORACLE_GENERAL.iter_unpack(data))


# -- the command line ------------------------------------------------------------------------------
def add_trace_command(subparsers) -> None:
    """Register ``prefixkv trace export``."""
    p = subparsers.add_parser("trace", help="trace utilities: export a trace's block references for libCacheSim",
                              description="Trace utilities.")
    sub = p.add_subparsers(dest="trace_command", required=True)
    e = sub.add_parser("export", help="write a trace's block-reference stream in libCacheSim's formats",
                       description="Write every block reference of TRACE (one per block of each request, dense "
                                   "ids, size 1) to OUT as libCacheSim oracleGeneral binary or CSV. "
                                   "--order forward-reverse (the default) adds each request's release, tail "
                                   "first: on it libCacheSim's LRU hits the blocks prefixkv replay --policy lru "
                                   "hits, plus one hit per lookup (see the README).")
    e.add_argument("trace", metavar="TRACE", help="a trace file or kv-cache-tester folder")
    e.add_argument("out", metavar="OUT", help="the file to write (an existing file is kept unless --force)")
    e.add_argument("--format", dest="out_format", default="oracle-general", choices=FORMATS)
    e.add_argument("--order", default="forward-reverse", choices=ORDERS)
    e.add_argument("--trace-format", default="auto", choices=["auto", "mooncake", "kvcache-tester", "tokens"],
                   help="how to read TRACE (default: detected)")
    e.add_argument("--force", action="store_true", help="replace an existing OUT")
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.set_defaults(func=cmd_trace_export, command="trace export")


def cmd_trace_export(args) -> int:
    import json

    from .traces import load_trace

    if not args.trace:
        raise ValueError("TRACE: an empty path (a trace file or a kv-cache-tester folder is expected)")
    if os.path.isdir(args.out):
        raise ValueError(f"OUT {args.out!r} is a directory; name the file to write")
    if os.path.exists(args.out) and not args.force:
        raise ValueError(f"OUT {args.out!r} exists; give --force to replace it")
    trace = load_trace(args.trace, args.trace_format)
    summary = export_trace(trace, args.out, args.out_format, args.order)
    if args.json:
        doc = dict(vars(summary))
        doc["reader_options"] = summary.reader_options()
        print(json.dumps(doc))
        return 0
    print(f"{summary.path}: {summary.references:,} references ({summary.order}) of {summary.distinct_blocks:,} "
          f"blocks from {summary.requests:,} requests, {summary.format}")
    print(f"read it with: {summary.reader_options()}")
    if summary.order == "forward-reverse":
        print(f"libCacheSim LRU hits - {summary.lookups:,} = prefixkv replay --policy lru block_hits, at any "
              f"cache of at least {summary.largest_request:,} blocks (the largest request)")
    return 0
