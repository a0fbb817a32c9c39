"""A remote block store on Redis or Redis Cluster: what a shared remote tier is made of.

Blocks are identified by their chained hash; a call names a prompt's chain
(``chain[i]`` = hash of block ``i``, from block 0, as the manager's prompt
gives them) and a range of it. Values are ``block_codec`` values under
``redis_keys`` keys, so a value is only ever read by processes with the same
fingerprint, and verified on every read.

API contract (what a tier adapter can rely on):

* ``probe(chain, start=0) -> int``: how many consecutive blocks from ``start``
  the server holds right now (one call per prompt). One round trip per wave
  of groups (the first wave covers ``first_probe_groups`` groups, 64 blocks by
  default, then waves double), server-side Lua that stops at the first missing
  key. Never raises for network trouble: an unreachable node counts as 0.
  A hint: a block can be evicted between ``probe`` and ``fetch``.
* ``fetch(chain, start, stop, contents=None) -> Fetched``: the verified
  payloads of the leading blocks ``start..stop-1`` that could be loaded. MGET in
  batches of about 8 MiB; every value is checked (``block_codec.decode``:
  checksums, fingerprint, hash against the key's, parent against the chain's,
  dims, length, and ``contents[j]`` for block ``start+j`` when given). It stops
  at the first absent, refused or unreachable block: everything it returns is
  verified and complete before it returns (a synchronous read); a refused value's
  key is deleted in the background and the reason counted. Payloads are
  memoryviews into the received values (no copy); ``staging.unpack`` copies them
  into KV pools.
* ``put(chain, start, payloads, contents=None) -> int``: queue blocks
  ``start..start+len(payloads)-1`` for the background writer and return at once
  (asynchronous writes). The store keeps a reference to each payload until it
  is sent: pass buffers nobody rewrites (``staging.pack`` returns fresh bytes).
  The queue is bounded (blocks and bytes): what does not fit is dropped and
  counted, never waited for. The writer asks the server which blocks it lacks
  (EXISTS), sends only those (``SET NX`` with a TTL, so a value is immutable
  once written: a racing writer cannot replace it), drops writes to a node
  whose breaker is open, and counts everything. ``flush(timeout_s)`` waits for
  the queue (tests, shutdown).
* ``exists_each(keys)`` / ``exists_leading(keys)`` / ``get_many(keys, parent, contents, chained)`` /
  ``set_many(keys, payloads, parent, contents, chained)``: the same calls by key as
  ``DiskBlockStore``'s, for independent blocks named by their own hash (``KeySpace.own_keys``):
  an engine's storage interface, which holds keys, not chains (issue 27).
* ``reads_synchronous = True``, ``writes_synchronous = False``.
* ``stats()``: a ``StoreStats`` snapshot; ``capacity_blocks()``, ``server_stats()``
  and ``clear(fingerprint_hex=None)`` are operator calls: they make round trips
  and raise ``RemoteTierError`` where a node cannot be reached.
* After ``close()`` every call above (``stats`` and ``flush`` aside) raises ``StoreClosed``
  (a ``RemoteTierError``) and sends nothing: a closed store never reconnects.

Failure: see ``redis_net`` (0.2 s timeouts, no redis-py retries, a breaker per
node probed every ``probe_interval_s`` by the background thread). A call while
every breaker is open returns at once (a miss, or a drop for ``put``); a call
that meets a hung node costs one socket timeout and opens that node's breaker.
Building a store makes no round trip, except for a cluster URL (it reads the
slot map, each seed bounded by the timeouts; unreachable seeds leave the
breakers open until the background probe finds one; a seed that answers without
cluster support is refused with ``RemoteTierError``). Threads:
one caller thread at a time for probe/fetch/put (foreground calls are
serialised by a lock) plus the store's own background thread.
"""

from __future__ import annotations

import hashlib
import threading
import weakref
from dataclasses import dataclass, field
from typing import Sequence

from redis.exceptions import AskError, MovedError, NoScriptError

from ..errors import InvalidArgument
from ..hashing import BlockHasher
from ..checks import integer, seconds
from .block_codec import Reject, decode
from .fetched import Fetched
from .fingerprint import Fingerprint, payload_view
from .redis_keys import DEFAULT_PREFIX, GROUP_MAX_BLOCKS, GROUP_MAX_BYTES, KeySpace, check_prefix
from .redis_net import (HIREDIS, NETWORK_ERRORS, Node, NodeDown, RemoteTierError, StoreClosed, Timeouts, Topology, explain,
                        masked_url, roundtrip, send_all)
from .redis_writer import BackgroundWriter, Pending

__all__ = ["RedisBlockStore", "RedisStoreConfig", "StoreStats", "Fetched", "RemoteTierError", "StoreClosed",
           "PROBE_LUA"]

# Leading keys present, stopping at the first absent one (all KEYS share one slot).
PROBE_LUA = ("local n = 0 "
             "for i = 1, #KEYS do "
             "if redis.call('EXISTS', KEYS[i]) == 0 then return n end "
             "n = n + 1 "
             "end "
             "return n")
_PROBE_SHA = hashlib.sha1(PROBE_LUA.encode()).hexdigest()     # EVALSHA's name for it


@dataclass(frozen=True, slots=True)
class RedisStoreConfig:
    """Knobs of one store. Defaults are the issue's: 0.2 s timeouts, ~8 MiB batches, probe every 2 s."""

    prefix: str = DEFAULT_PREFIX
    ttl_s: float = 24 * 3600.0
    connect_timeout_s: float = 0.2
    socket_timeout_s: float = 0.2
    probe_interval_s: float = 2.0         # breaker recovery probe (and cluster slot-map refresh) period
    batch_bytes: int = GROUP_MAX_BYTES    # MGET / write batch size
    max_group_blocks: int = GROUP_MAX_BLOCKS   # keys per probe / MGET command; keys never depend on it
    first_probe_groups: int = 4           # first probe wave: 4 groups of 16 = 64 blocks in one round trip
    probe_mode: str = "lua"               # "lua" (measured faster) or "exists" (pipelined EXISTS per key)
    queue_blocks: int = 4096
    queue_bytes: int = 256 * 2**20

    def __post_init__(self) -> None:
        if self.probe_mode not in ("lua", "exists"):
            raise InvalidArgument("probe_mode", f"expected 'lua' or 'exists', got {self.probe_mode!r}")
        check_prefix(self.prefix)
        # Finite durations only: an infinite socket timeout is an unbounded wait on a hung server,
        # an infinite TTL overflowed int(ttl_s * 1000). Counts are integers: int(2.5) passed the
        # old check and a fractional group size then indexed the chain with floats.
        values = {name: seconds(name, getattr(self, name))
                  for name in ("ttl_s", "connect_timeout_s", "socket_timeout_s", "probe_interval_s")}
        values.update({name: integer(name, getattr(self, name), low=1)
                       for name in ("batch_bytes", "max_group_blocks", "first_probe_groups", "queue_blocks",
                                    "queue_bytes")})
        for name, value in values.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class StoreStats:
    """Counters since the store was built (a snapshot)."""

    probes: int = 0
    probe_blocks: int = 0             # blocks probes reported present
    fetches: int = 0
    blocks_loaded: int = 0            # verified blocks handed out by fetch
    bytes_loaded: int = 0             # payload bytes of those
    fetch_misses: int = 0             # fetches that stopped at an absent key (evicted since the probe)
    rejected: dict = field(default_factory=dict)   # Reject.value -> count: values refused on read
    bad_keys_deleted: int = 0
    deletes_dropped: int = 0          # refused values not queued for deletion: too many pending
    read_errors: int = 0              # probe/fetch round trips that failed (network or server error)
    short_circuits: int = 0           # calls answered without the network: breaker open
    puts: int = 0                     # blocks offered to put()
    queued: int = 0
    dropped_full: int = 0             # queue over its bound
    dropped_duplicate: int = 0        # already queued
    dropped_down: int = 0             # node unreachable when the writer got to them
    writes: int = 0                   # values stored (SET NX answered OK)
    write_bytes: int = 0
    skipped_present: int = 0          # the server already had them (EXISTS, or a racing SET NX)
    write_errors: int = 0             # server refused (OOM, MOVED, ...) or encoding failed
    probe_errors: int = 0             # breaker probes / slot-map reloads that failed other than by the network
    breaker_opens: int = 0
    breaker_closes: int = 0
    nodes_down: int = 0
    node_errors: dict = field(default_factory=dict)   # node -> why it is down (a timeout, a refused password)
    queue_blocks: int = 0
    queue_bytes: int = 0
    delete_queue: int = 0             # refused keys waiting for their UNLINK


# Counters the caller's thread keeps (the writer keeps its own: no counter has two writers).
_FG_COUNTERS = ("probes", "probe_blocks", "fetches", "blocks_loaded", "bytes_loaded", "fetch_misses", "read_errors",
                "short_circuits", "puts", "dropped_down")


class RedisBlockStore:
    """Blocks of one fingerprint in one Redis deployment (see the module docstring for the contract)."""

    reads_synchronous = True
    writes_synchronous = False

    def __init__(self, url: str, fingerprint: Fingerprint, config: RedisStoreConfig | None = None) -> None:
        self.config = config = config or RedisStoreConfig()
        self.fingerprint = fingerprint
        self.url = url
        self.keys = KeySpace(fingerprint, config.prefix, config.max_group_blocks)
        # Parent of block 0: the hasher's root for this block size, seed and algorithm (all in the fingerprint).
        self.root = BlockHasher(fingerprint.block_size, fingerprint.hash_seed, fingerprint.hash_algorithm).root
        self.hiredis = HIREDIS
        self.topology = Topology(url, Timeouts(config.connect_timeout_s, config.socket_timeout_s))
        self._batch_keys = max(1, config.batch_bytes // self.keys.value_bytes)
        self._count = dict.fromkeys(_FG_COUNTERS, 0)
        self._rejected: dict[str, int] = {}
        self._fg = threading.Lock()
        self.closed = False
        self.writer = BackgroundWriter(self.topology, fingerprint, ttl_ms=max(1, int(config.ttl_s * 1000)),
                                       batch_bytes=config.batch_bytes, queue_blocks=config.queue_blocks,
                                       queue_bytes=config.queue_bytes, probe_interval_s=config.probe_interval_s,
                                       join_timeout_s=max(1.0, 8 * config.socket_timeout_s))
        # A store garbage-collected without close() stops its thread and drops its sockets all the
        # same (the thread holds the writer and the topology, never the store).
        self._shutdown = weakref.finalize(self, _shutdown, self.writer, self.topology)

    # -- reads -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosed(f"the block store at {masked_url(self.url)} is closed; build a new one to use it again")

    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """Leading blocks of ``chain[start:]`` present on the server (0 when unreachable)."""
        self._check_open()
        stop = len(chain)
        start = integer("start", start, low=0)
        if start >= stop:
            return 0
        self.keys.check_chain(chain, start, stop)
        if self.topology.all_down():
            self._count["short_circuits"] += 1
            return 0
        self._count["probes"] += 1
        ranges = self.keys.group_ranges(start, stop)
        total, i, wave = 0, 0, self.config.first_probe_groups
        with self._fg:
            while i < len(ranges):
                part = ranges[i:i + wave]
                counts = self._probe_wave(chain, part)
                for (a, b), n in zip(part, counts):
                    total += n
                    if n < b - a:
                        self._count["probe_blocks"] += total
                        return total
                i += len(part)
                wave *= 2
        self._count["probe_blocks"] += total
        return total

    def _probe_wave(self, chain, ranges) -> list[int]:
        """Leading present count per group range, in one round trip (0 for unreachable nodes)."""
        lua = self.config.probe_mode == "lua"
        per_node: dict[str, tuple[Node, list, list]] = {}
        slots = []
        for a, b in ranges:
            keys = self.keys.keys(chain, a, b)
            node = self.topology.node_for(keys[0])
            if node is None:
                slots.append(None)
                continue
            entry = per_node.setdefault(node.name, (node, [], []))
            slots.append((node.name, len(entry[2]), len(keys)))
            if lua:
                entry[1].append(("EVALSHA", _PROBE_SHA, len(keys), *keys))
                entry[2].append(1)
            else:
                entry[1].extend(("EXISTS", k) for k in keys)
                entry[2].append(len(keys))
        replies = send_all((node, cmds) for node, cmds, _ in per_node.values())
        if lua:
            replies = self._load_script_where_missing(per_node, replies)
        offsets = {name: _offsets(sizes) for name, (_, _, sizes) in per_node.items()}
        out = []
        for slot in slots:
            if slot is None:
                out.append(0)
                continue
            name, index, nkeys = slot
            reply = replies[name]
            if isinstance(reply, Exception):
                self._count["read_errors"] += not isinstance(reply, NodeDown)
                out.append(0)
                continue
            at = offsets[name][index]
            if lua:
                value = reply[at]
                out.append(value if isinstance(value, int) else self._server_error(value))
            else:
                n = 0
                for value in reply[at:at + nkeys]:
                    if value != 1:
                        if not isinstance(value, int):
                            self._server_error(value)
                        break
                    n += 1
                out.append(n)
        return out

    def _load_script_where_missing(self, per_node, replies):
        """NOSCRIPT (a fresh or restarted server): load the script and resend that node's wave once."""
        for name, (node, cmds, _) in per_node.items():
            reply = replies[name]
            if isinstance(reply, list) and any(_is_noscript(r) for r in reply):
                try:
                    replies[name] = roundtrip(node, node.fg, [("SCRIPT", "LOAD", PROBE_LUA)] + cmds)[1:]
                except NETWORK_ERRORS as exc:
                    replies[name] = exc
        return replies

    def _server_error(self, reply) -> int:
        self._count["read_errors"] += 1
        if isinstance(reply, (MovedError, AskError)):
            self.topology.stale = True      # the background thread reloads the slot map
        return 0

    def fetch(self, chain: Sequence[bytes], start: int, stop: int, contents: Sequence[bytes] | None = None) -> Fetched:
        """Verified payloads of the leading loadable blocks of ``chain[start:stop]`` (see the module docstring)."""
        self._check_open()
        start = integer("start", start, low=0)
        stop = min(integer("stop", stop), len(chain))
        out = Fetched([])
        if start >= stop:
            return out
        if contents is not None and len(contents) < stop - start:
            raise InvalidArgument("contents", f"{len(contents)} entries for {stop - start} blocks")
        self.keys.check_chain(chain, start, stop)
        if self.topology.all_down():
            self._count["short_circuits"] += 1
            out.stop = "error"
            return out
        self._count["fetches"] += 1
        ranges = self.keys.group_ranges(start, stop)
        with self._fg:
            i = 0
            while i < len(ranges):
                batch, n = [], 0          # consecutive groups up to ~batch_bytes of values (at least one)
                while i < len(ranges) and (not batch or n + ranges[i][1] - ranges[i][0] <= self._batch_keys):
                    batch.append(ranges[i])
                    n += ranges[i][1] - ranges[i][0]
                    i += 1
                if not self._fetch_batch(chain, start, batch, contents, out):
                    break
        self._count["blocks_loaded"] += out.count
        self._count["bytes_loaded"] += out.count * self.fingerprint.block_bytes
        return out

    def _fetch_batch(self, chain, start, ranges, contents, out: Fetched) -> bool:
        """MGET every group of the batch in one round trip, verify in chain order; False stops the fetch."""
        per_node: dict[str, tuple[Node, list]] = {}
        plan = []
        for a, b in ranges:
            keys = self.keys.keys(chain, a, b)
            node = self.topology.node_for(keys[0])
            if node is None:
                plan.append((a, keys, None, 0))
                continue
            entry = per_node.setdefault(node.name, (node, []))
            plan.append((a, keys, node.name, len(entry[1])))
            entry[1].append(("MGET", *keys))
        replies = send_all(per_node.values())
        fp, root = self.fingerprint, self.root
        for a, keys, name, index in plan:
            reply = replies[name] if name is not None else None
            if reply is None or isinstance(reply, Exception):
                self._count["read_errors"] += not isinstance(reply, NodeDown)
                out.stop = "error"
                return False
            values = reply[index]
            if isinstance(values, Exception):
                self._server_error(values)
                out.stop = "error"
                return False
            for j, value in enumerate(values):
                i = a + j
                if value is None:
                    self._count["fetch_misses"] += 1
                    out.stop = "miss"
                    return False
                result = decode(value, fp, chain[i], chain[i - 1] if i else root,
                                None if contents is None else contents[i - start])
                if isinstance(result, Reject):
                    self._rejected[result.value] = self._rejected.get(result.value, 0) + 1
                    self.writer.delete(keys[j])     # in the background: the read is not slowed
                    out.stop = result
                    return False
                out.payloads.append(result)
        return True

    # -- by key: an engine's storage interface (issue 27) -----------------------------
    # Independent blocks named by their own hash (``KeySpace.own_keys``), the faces of
    # ``DiskBlockStore``: ``exists_leading`` / ``exists_each`` / ``get_many`` / ``set_many``.
    # One round trip per node for each call; a standalone server answers a fetch with MGETs of
    # about ``batch_bytes``, a cluster with pipelined GETs (every key has a slot of its own).
    def _check_hashes(self, name: str, keys: Sequence[bytes]) -> None:
        size = self.fingerprint.hash_size
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or len(key) != size:
                raise InvalidArgument(name, f"block hash {i} is not {size} bytes "
                                            f"({self.fingerprint.hash_algorithm}): {key!r:.40}")

    def _check_parent(self, parent) -> bytes:
        if parent is None:
            return self.root
        if not isinstance(parent, bytes) or len(parent) != self.fingerprint.hash_size:
            raise InvalidArgument("parent", f"expected the {self.fingerprint.hash_size}-byte hash before the "
                                            f"first key (or None for block 0), got {parent!r:.40}")
        return parent

    def exists_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` (independent blocks) is on the server now: a hint. Every key
        of an unreachable node (or with every breaker open) reads as absent."""
        self._check_open()
        self._check_hashes("keys", keys)
        if not len(keys):
            return []
        if self.topology.all_down():
            self._count["short_circuits"] += 1
            return [False] * len(keys)
        self._count["probes"] += 1
        names = self.keys.own_keys(keys)
        per_node: dict[str, tuple[Node, list]] = {}
        where = []
        with self._fg:
            for name in names:
                node = self.topology.node_for(name)
                if node is None:
                    where.append(None)
                    continue
                entry = per_node.setdefault(node.name, (node, []))
                where.append((node.name, len(entry[1])))
                entry[1].append(("EXISTS", name))
            replies = send_all(per_node.values())
        # a failed node is counted once per call, not once per key
        self._count["read_errors"] += sum(1 for r in replies.values()
                                          if isinstance(r, Exception) and not isinstance(r, NodeDown))
        out = []
        for slot in where:
            reply = None if slot is None else replies[slot[0]]
            if reply is None or isinstance(reply, Exception):
                out.append(False)
                continue
            value = reply[slot[1]]
            if not isinstance(value, int):
                self._server_error(value)
            out.append(value == 1)
        self._count["probe_blocks"] += sum(out)
        return out

    def exists_leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (independent blocks) are on the server, from the first, before one is missing."""
        present = self.exists_each(keys)
        return present.index(False) if False in present else len(present)

    def get_many(self, keys: Sequence[bytes], parent: bytes | None = None,
                 contents: Sequence[bytes] | None = None, chained: bool = True, into=None) -> Fetched:
        """Verified payloads of the leading loadable blocks of ``keys``, named by ``own_keys``
        (``into(j, payload)``: each handed over as it is verified, not kept, as ``DiskBlockStore``'s).
        As ``DiskBlockStore.get_many``: ``keys`` are consecutive blocks of one chain after
        ``parent`` (None: the root), or with ``chained=False`` independent blocks whose every
        value has ``parent`` as its parent. Stops at the first absent, refused or unreachable
        block, as ``fetch`` does."""
        self._check_open()
        self._check_hashes("keys", keys)
        parent = self._check_parent(parent)
        if not isinstance(chained, bool):
            raise InvalidArgument("chained", f"expected True or False, got {chained!r}")
        if into is not None and not callable(into):
            raise InvalidArgument("into", f"expected a callable (index, payload), got {type(into).__name__}")
        if contents is not None:
            if len(contents) < len(keys):
                raise InvalidArgument("contents", f"{len(contents)} entries for {len(keys)} blocks")
            for j in range(len(keys)):
                if not isinstance(contents[j], (bytes, bytearray, memoryview)):
                    raise InvalidArgument("contents", f"content {j} is {type(contents[j]).__name__}, not bytes")
        out = Fetched([])
        if not len(keys):
            return out
        if self.topology.all_down():
            self._count["short_circuits"] += 1
            out.stop = "error"
            return out
        self._count["fetches"] += 1
        names = self.keys.own_keys(keys)
        fp = self.fingerprint
        batch = self._batch_keys
        with self._fg:
            for at in range(0, len(names), batch):
                part = names[at:at + batch]
                values = self._get_values(part)
                if isinstance(values, str):
                    out.stop = values
                    break
                stopped = False
                for j, value in enumerate(values):
                    i = at + j
                    if value is None:
                        self._count["fetch_misses"] += 1
                        out.stop, stopped = "miss", True
                        break
                    result = decode(value, fp, keys[i], keys[i - 1] if chained and i else parent,
                                    None if contents is None else contents[i])
                    if isinstance(result, Reject):
                        self._rejected[result.value] = self._rejected.get(result.value, 0) + 1
                        self.writer.delete(part[j])
                        out.stop, stopped = result, True
                        break
                    if into is not None:
                        into(i, result)
                        result = None
                    out.payloads.append(result)
                if stopped:
                    break
        self._count["blocks_loaded"] += out.count
        self._count["bytes_loaded"] += out.count * fp.block_bytes
        return out

    def _get_values(self, names: list[bytes]):
        """The values of ``names`` in order (None where absent), or ``"error"`` when one could not be read."""
        per_node: dict[str, tuple[Node, list, list]] = {}
        where = []
        for name in names:
            node = self.topology.node_for(name)
            if node is None:
                return "error"
            entry = per_node.setdefault(node.name, (node, [], []))
            where.append((node.name, len(entry[2])))
            entry[2].append(name)
        commands = []
        for node, cmds, node_names in per_node.values():
            if self.topology.cluster:
                cmds.extend(("GET", name) for name in node_names)
            else:
                cmds.append(("MGET", *node_names))
            commands.append((node, cmds))
        replies = send_all(commands)
        values = {}
        for name, (node, cmds, node_names) in per_node.items():
            reply = replies[name]
            if isinstance(reply, Exception):
                self._count["read_errors"] += not isinstance(reply, NodeDown)
                return "error"
            flat = reply if self.topology.cluster else reply[0]
            if isinstance(flat, Exception) or any(isinstance(v, Exception) for v in flat):
                self._server_error(flat if isinstance(flat, Exception) else next(v for v in flat if isinstance(v, Exception)))
                return "error"
            values[name] = flat
        return [values[name][index] for name, index in where]

    def set_many(self, keys: Sequence[bytes], payloads: Sequence, parent: bytes | None = None,
                 contents: Sequence[bytes] | None = None, chained: bool = True) -> int:
        """Queue ``payloads[j]`` as block ``keys[j]`` (named by ``own_keys``; ``parent`` and ``chained``
        as in ``get_many``) for the background writer; returns how many were queued."""
        self._check_open()
        if len(payloads) != len(keys):
            raise InvalidArgument("payloads", f"{len(payloads)} payloads for {len(keys)} keys")
        self._check_hashes("keys", keys)
        parent = self._check_parent(parent)
        if not isinstance(chained, bool):
            raise InvalidArgument("chained", f"expected True or False, got {chained!r}")
        block_bytes = self.fingerprint.block_bytes
        views = [payload_view(payload, j, block_bytes) for j, payload in enumerate(payloads)]
        if contents is not None:
            if len(contents) != len(keys):
                raise InvalidArgument("contents", f"{len(contents)} entries for {len(keys)} payloads")
            for j, content in enumerate(contents):
                if not isinstance(content, (bytes, bytearray, memoryview)):
                    raise InvalidArgument("contents", f"content {j} is {type(content).__name__}, not bytes")
        n = len(keys)
        self._count["puts"] += n
        if n == 0:
            return 0
        if self.topology.all_down():
            self._count["short_circuits"] += 1
            self._count["dropped_down"] += n
            return 0
        names = self.keys.own_keys(keys)
        items = [Pending(names[j], keys[j], keys[j - 1] if chained and j else parent, views[j],
                         None if contents is None else bytes(contents[j]), block_bytes) for j in range(n)]
        return self.writer.offer(items)

    # -- writes ----------------------------------------------------------------
    def put(self, chain: Sequence[bytes], start: int, payloads: Sequence, contents: Sequence[bytes] | None = None) -> int:
        """Queue blocks ``start..start+len(payloads)-1`` of ``chain`` for writing; returns how many were queued."""
        self._check_open()
        n = len(payloads)
        start = integer("start", start)
        if start < 0 or start + n > len(chain):
            raise InvalidArgument("start", f"blocks {start}..{start + n - 1} are outside a chain of {len(chain)}")
        if contents is not None and len(contents) != n:
            raise InvalidArgument("contents", f"{len(contents)} entries for {n} payloads")
        size, block_bytes = self.fingerprint.hash_size, self.fingerprint.block_bytes
        # check everything first: a bad call queues nothing. The key of a block mid-group names its
        # group's first hash, and a block's value its parent's: both are read, so both are checked.
        self.keys.check_chain(chain, start, start + n)
        if start and n and (not isinstance(chain[start - 1], bytes) or len(chain[start - 1]) != size):
            raise InvalidArgument("chain", f"block hash {start - 1} (the parent of block {start}) is not "
                                           f"{size} bytes ({self.fingerprint.hash_algorithm})")
        views = []
        for j, payload in enumerate(payloads):
            view = payload_view(payload, j, block_bytes)
            if len(chain[start + j]) != size:
                raise InvalidArgument("chain", f"block hash {start + j} is not {size} bytes "
                                               f"({self.fingerprint.hash_algorithm})")
            views.append(view)
        if contents is not None:
            for j, content in enumerate(contents):
                # bytes(5) is five zero bytes and bytes([1, 2]) other bytes: only a byte string is its content
                if not isinstance(content, (bytes, bytearray, memoryview)):
                    raise InvalidArgument("contents", f"content {j} is {type(content).__name__}, not bytes")
        self._count["puts"] += n
        if n == 0:
            return 0
        if self.topology.all_down():
            self._count["short_circuits"] += 1
            self._count["dropped_down"] += n
            return 0
        keys = self.keys.keys(chain, start, start + n)
        items = [Pending(key, chain[start + j], chain[start + j - 1] if start + j else self.root, views[j],
                          None if contents is None else bytes(contents[j]), block_bytes)
                 for j, key in enumerate(keys)]
        return self.writer.offer(items)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and deletion has been sent (or dropped). False on timeout."""
        return self.writer.flush(seconds("timeout_s", timeout_s, zero=True))

    # -- stats and operators ---------------------------------------------------------
    def stats(self) -> StoreStats:
        nodes = list(self.topology.nodes.values())
        queue_blocks, queue_bytes, delete_queue = self.writer.queue_state()
        counts = dict(self.writer.counts)
        for name, value in self._count.items():
            counts[name] = counts.get(name, 0) + value
        return StoreStats(**counts, rejected=dict(self._rejected),
                          breaker_opens=sum(n.opens for n in nodes), breaker_closes=sum(n.closes for n in nodes),
                          nodes_down=sum(n.down for n in nodes),
                          node_errors={n.name: n.error or "unknown" for n in nodes if n.down}, queue_blocks=queue_blocks, queue_bytes=queue_bytes,
                          delete_queue=delete_queue)

    def _operator(self, commands_for) -> dict[str, list]:
        """One round trip per master for an operator call; raises where a node cannot be reached."""
        self._check_open()
        out = {}
        with self._fg:
            for node in self.topology.masters():
                try:
                    out[node.name] = roundtrip(node, node.fg, commands_for(node))
                except NETWORK_ERRORS as exc:
                    raise RemoteTierError(f"{node.name}: {explain(exc, node.timeouts)}") from None
        return out

    def ping(self) -> dict[str, str | None]:
        """One PING to every master node, now, in the caller's thread: per node, None when it
        answered, else why not (as ``explain`` words it: a password wanted or refused, not a Redis
        server, a timeout, a refused connection). A node that fails has its breaker opened, as
        any call would; one whose breaker is open is tried all the same. For start-up checks: the
        store itself never needs it (its calls skip a down node and count it)."""
        self._check_open()
        out: dict[str, str | None] = {}
        with self._fg:
            for node in self.topology.masters():
                try:
                    roundtrip(node, node.fg, [("PING",)])
                    out[node.name] = None           # an error reply is an answer (an ACL refusing PING)
                except NETWORK_ERRORS as exc:
                    out[node.name] = explain(exc, node.timeouts)
        return out

    def server_stats(self) -> list[dict]:
        """Per master node: memory, limit, policy, evictions, keys, hits and misses (INFO + DBSIZE)."""
        out = []
        for name, (memory, stats, dbsize) in self._operator(
                lambda node: [("INFO", "memory"), ("INFO", "stats"), ("DBSIZE",)]).items():
            for reply in (memory, stats, dbsize):
                if isinstance(reply, Exception):
                    raise RemoteTierError(f"{name}: {reply}")
            info = {**_parse_info(memory), **_parse_info(stats)}
            out.append({"node": name, "used_memory": int(info.get("used_memory", 0)),
                        "maxmemory": int(info.get("maxmemory", 0)),
                        "maxmemory_policy": str(info.get("maxmemory_policy", "")),
                        "evicted_keys": int(info.get("evicted_keys", 0)), "keys": int(dbsize),
                        "keyspace_hits": int(info.get("keyspace_hits", 0)),
                        "keyspace_misses": int(info.get("keyspace_misses", 0))})
        return out

    def capacity_blocks(self) -> int | None:
        """Blocks the deployment's ``maxmemory`` holds (None: no limit set on some node)."""
        stats = self.server_stats()
        if any(s["maxmemory"] == 0 for s in stats):
            return None
        return sum(s["maxmemory"] for s in stats) // self.keys.value_bytes

    def clear(self, fingerprint_hex: str | None = None, *, max_rounds: int = 1_000_000) -> int:
        """Delete every block under this store's prefix (all fingerprints), or one fingerprint's. Returns keys deleted.

        SCAN + UNLINK on every master; each SCAN step is one round trip. ``max_rounds`` bounds the loop
        per node (SCAN always terminates; the bound only guards against a server that misbehaves)."""
        self._check_open()
        pattern = KeySpace.pattern(self.config.prefix, fingerprint_hex)
        shape = KeySpace.block_key_shape(self.config.prefix, fingerprint_hex)
        max_rounds = integer("max_rounds", max_rounds, low=1)
        deleted = 0
        with self._fg:
            for node in self.topology.masters():
                cursor = b"0"
                for _ in range(max_rounds):
                    try:
                        reply = roundtrip(node, node.fg, [("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)])[0]
                        if isinstance(reply, Exception):
                            raise RemoteTierError(f"{node.name}: {reply}")
                        cursor, keys = reply
                        keys = [key for key in keys if shape.fullmatch(key)]
                        if keys:      # one UNLINK per key, pipelined: a cluster refuses multi-slot UNLINK
                            replies = roundtrip(node, node.fg, [("UNLINK", key) for key in keys])
                            errors = [r for r in replies if isinstance(r, Exception)]
                            if errors:
                                raise RemoteTierError(f"{node.name}: {errors[0]}")
                            deleted += sum(replies)
                    except NETWORK_ERRORS as exc:
                        raise RemoteTierError(f"{node.name}: {explain(exc, node.timeouts)}") from None
                    if cursor in (b"0", 0, "0"):
                        break
        return deleted

    # -- lifetime ---------------------------------------------------------------------
    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Send what is queued (up to ``flush_timeout_s``), stop the background thread, disconnect.
        Closing twice is a no-op; every later call but ``stats`` and ``flush`` raises ``StoreClosed``."""
        flush_timeout_s = seconds("flush_timeout_s", flush_timeout_s, zero=True)
        if self.closed:
            return
        self.closed = True
        self.writer.flush(flush_timeout_s)
        self._shutdown()

    def __enter__(self) -> "RedisBlockStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(writer: BackgroundWriter, topology: Topology) -> None:
    writer.close()
    topology.close()


def _offsets(sizes: list[int]) -> list[int]:
    out, at = [], 0
    for size in sizes:
        out.append(at)
        at += size
    return out


def _is_noscript(reply) -> bool:
    return isinstance(reply, NoScriptError)


def _parse_info(reply) -> dict[str, str]:
    """``INFO`` text (raw bulk reply) as a dict of its ``key:value`` lines."""
    text = reply.decode() if isinstance(reply, bytes) else str(reply)
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#") and ":" in line:
            key, _, value = line.partition(":")
            out[key] = value
    return out
