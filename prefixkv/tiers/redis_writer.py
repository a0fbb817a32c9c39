"""The Redis block store's background thread: bounded write queue, deletions, breaker probes.

Contract:

* ``offer(items)`` (caller's thread) queues what fits and returns how many were
  queued, at once: an item whose key is already queued is dropped as a
  duplicate, one over the queue's block or byte bound is dropped as full.
  Nothing waits on the network.
* The thread takes up to ``batch_bytes`` of items at a time, asks each node which
  keys it already has (EXISTS, one round trip to all nodes), encodes and sends
  only the missing ones (``SET key value NX PX ttl``, one more round trip):
  ``NX`` keeps a value immutable once written, so a racing writer cannot replace
  it and a failed write leaves nothing half-written (one value, one ``SET``).
  Items for a node whose breaker is open are dropped and counted.
* ``delete(key)`` (a value a reader refused) is sent with the next round (UNLINK). Pending
  deletions are a set bounded by the queue's block bound: a key already pending is not added
  twice, one over the bound is dropped and counted (a later read refuses the value again).
* Every ``probe_interval_s`` it PINGs the nodes whose breaker is open and, for a
  cluster, reloads the slot map after a recovery or a MOVED reply, and while a node
  stays down (a failover hands its slots to a promoted replica). A probe that fails for any
  other reason is counted (``probe_errors``) and retried at the next period: it neither costs
  the round's writes nor makes the thread probe without pause.
* ``flush(timeout_s)`` waits until the queue and the deletions are empty and the
  round in flight is done; ``close()`` stops the thread (bounded join). A round still
  running when the join gives up sends nothing more: it checks ``close()`` before each
  round trip, and the store's closed nodes refuse to reconnect (``redis_net.NodeClosed``).

Its counters (``counts``) are written by this thread only; ``offer`` and
``delete`` count under the queue's lock.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from redis.exceptions import AskError, MovedError

from .block_codec import encode
from .fingerprint import Fingerprint
from .redis_net import Node, Topology, send_all

__all__ = ["BackgroundWriter", "Pending", "WRITER_COUNTERS"]

WRITER_COUNTERS = ("queued", "dropped_full", "dropped_duplicate", "dropped_down", "writes", "write_bytes",
                   "skipped_present", "write_errors", "bad_keys_deleted", "deletes_dropped", "probe_errors")


class Pending:
    """One block waiting to be written (the payload is referenced, not copied, until it is encoded)."""

    __slots__ = ("key", "block_hash", "parent", "payload", "content", "nbytes")

    def __init__(self, key, block_hash, parent, payload, content, nbytes):
        self.key, self.block_hash, self.parent = key, block_hash, parent
        self.payload, self.content, self.nbytes = payload, content, nbytes


class BackgroundWriter:
    def __init__(self, topology: Topology, fingerprint: Fingerprint, *, ttl_ms: int, batch_bytes: int,
                 queue_blocks: int, queue_bytes: int, probe_interval_s: float, join_timeout_s: float) -> None:
        self.topology = topology
        self.fingerprint = fingerprint
        self.ttl_ms = ttl_ms
        self.batch_bytes = batch_bytes
        self.queue_blocks = queue_blocks
        self.queue_bytes = queue_bytes
        self.probe_interval_s = probe_interval_s
        self.join_timeout_s = join_timeout_s
        self.counts = dict.fromkeys(WRITER_COUNTERS, 0)
        self._cv = threading.Condition()
        self._queue: deque[Pending] = deque()
        self._queued_bytes = 0
        self._pending_keys: set[bytes] = set()
        self._deletes: dict[bytes, None] = {}    # an ordered set, at most queue_blocks keys
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="prefixkv-redis-writer", daemon=True)
        self._thread.start()

    # -- caller's thread ------------------------------------------------------------
    def offer(self, items: list[Pending]) -> int:
        queued = 0
        with self._cv:
            if self._closing:
                self.counts["dropped_down"] += len(items)
                return 0
            for item in items:
                if item.key in self._pending_keys:
                    self.counts["dropped_duplicate"] += 1
                elif len(self._queue) >= self.queue_blocks or self._queued_bytes + item.nbytes > self.queue_bytes:
                    self.counts["dropped_full"] += 1
                else:
                    self._queue.append(item)
                    self._pending_keys.add(item.key)
                    self._queued_bytes += item.nbytes
                    queued += 1
            self.counts["queued"] += queued
            if queued:
                self._cv.notify()
        return queued

    def delete(self, key: bytes) -> None:
        with self._cv:
            if self._closing or key in self._deletes:
                return
            if len(self._deletes) >= self.queue_blocks:
                self.counts["deletes_dropped"] += 1
                return
            self._deletes[key] = None
            self._cv.notify()

    def queue_state(self) -> tuple[int, int, int]:
        """Queued blocks, their bytes, and pending deletions."""
        with self._cv:
            return len(self._queue), self._queued_bytes, len(self._deletes)

    def flush(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._deletes or self._busy:
                left = deadline - time.monotonic()
                if left <= 0 or not self._thread.is_alive():
                    return False
                self._cv.wait(left)
        return True

    def close(self) -> None:
        with self._cv:
            self._closing = True
            for item in self._queue:
                self._pending_keys.discard(item.key)
            self.counts["dropped_down"] += len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._deletes.clear()
            self._cv.notify_all()
        self._thread.join(timeout=self.join_timeout_s)

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        next_probe = time.monotonic() + self.probe_interval_s
        while True:
            with self._cv:
                if not (self._queue or self._deletes or self._closing):
                    # bounded wait: wakes for work, or when the next breaker probe is due
                    self._cv.wait(max(0.0, next_probe - time.monotonic()))
                if self._closing:
                    self._cv.notify_all()
                    return
                batch = self._take_batch()
                deletes, self._deletes = list(self._deletes), {}
                self._busy = bool(batch or deletes)
            try:
                now = time.monotonic()
                if now >= next_probe:
                    next_probe = now + self.probe_interval_s      # first: a failing probe waits its period
                    try:
                        self._probe_nodes()
                    except Exception:
                        self.counts["probe_errors"] += 1
                if deletes and not self._closing:
                    self._delete(deletes)
                if batch:
                    self._write(batch)
            except Exception:       # never let the writer die: count and go on (nothing was half-applied)
                self.counts["write_errors"] += len(batch)
            finally:
                with self._cv:
                    for item in batch:
                        self._pending_keys.discard(item.key)
                    self._busy = False
                    self._cv.notify_all()

    def _take_batch(self) -> list[Pending]:
        batch, nbytes = [], 0
        while self._queue and (not batch or nbytes + self._queue[0].nbytes <= self.batch_bytes):
            item = self._queue.popleft()
            self._queued_bytes -= item.nbytes
            nbytes += item.nbytes
            batch.append(item)
        return batch

    def _probe_nodes(self) -> None:
        """Breaker recovery: PING every open node; reload the cluster slot map when needed: after a
        recovery or a MOVED reply, and while a node is down (its replica may have taken its slots)."""
        recovered = still_down = False
        for node in list(self.topology.nodes.values()):
            if self._closing:       # each PING may cost a timeout: close() does not wait for them
                return
            if node.down:
                up = node.ping()
                recovered |= up
                still_down |= not up
        if self.topology.cluster and (recovered or still_down or self.topology.stale) and not self._closing:
            self.topology.refresh()

    def _delete(self, keys: list[bytes]) -> None:
        per_node: dict[str, tuple[Node, list]] = {}
        for key in keys:
            node = self.topology.node_for(key)
            if node is not None:
                per_node.setdefault(node.name, (node, []))[1].append(("UNLINK", key))
        for reply in send_all(per_node.values(), background=True).values():
            if isinstance(reply, list):
                self.counts["bad_keys_deleted"] += sum(1 for r in reply if r == 1)

    def _write(self, batch: list[Pending]) -> None:
        """EXISTS for the batch (one round trip), then SET NX PX for the missing ones (one more).
        Either round trip is skipped once close() has begun: the batch is dropped as the queue was."""
        if self._closing:
            self.counts["dropped_down"] += len(batch)
            return
        per_node: dict[str, tuple[Node, list]] = {}
        for item in batch:
            node = self.topology.node_for(item.key)
            if node is None:
                self.counts["dropped_down"] += 1
                continue
            per_node.setdefault(node.name, (node, []))[1].append(item)
        replies = send_all(((node, [("EXISTS", it.key) for it in items]) for node, items in per_node.values()),
                           background=True)
        missing: dict[str, tuple[Node, list]] = {}
        for name, (node, items) in per_node.items():
            reply = replies[name]
            if isinstance(reply, Exception):
                self.counts["dropped_down"] += len(items)
                continue
            for item, exists in zip(items, reply):
                if exists == 1:
                    self.counts["skipped_present"] += 1
                elif exists == 0:
                    missing.setdefault(name, (node, []))[1].append(item)
                else:
                    self._error(exists)
        if self._closing:
            self.counts["dropped_down"] += sum(len(items) for _, items in missing.values())
            return
        commands: dict[str, tuple[Node, list, list]] = {}
        for name, (node, items) in missing.items():
            for item in items:
                try:
                    value = encode(self.fingerprint, item.block_hash, item.parent, item.payload, item.content)
                except ValueError:
                    self.counts["write_errors"] += 1
                    continue
                entry = commands.setdefault(name, (node, [], []))
                entry[1].append(("SET", item.key, value, "NX", "PX", self.ttl_ms))
                entry[2].append(len(value))
        replies = send_all(((node, cmds) for node, cmds, _ in commands.values()), background=True)
        for name, (node, cmds, sizes) in commands.items():
            reply = replies[name]
            if isinstance(reply, Exception):
                self.counts["dropped_down"] += len(cmds)
                continue
            for answer, size in zip(reply, sizes):
                if answer is None:
                    self.counts["skipped_present"] += 1
                elif isinstance(answer, Exception):
                    self._error(answer)
                else:
                    self.counts["writes"] += 1
                    self.counts["write_bytes"] += size

    def _error(self, reply) -> None:
        self.counts["write_errors"] += 1
        if isinstance(reply, (MovedError, AskError)):
            self.topology.stale = True
