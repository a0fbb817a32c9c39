"""The disk block store's background thread: bounded write queue, atomic writes, eviction, deletions.

Contract:

* ``offer(items)`` (caller's thread) queues what fits and returns how many were
  queued, at once: an item whose block is already queued is dropped as a
  duplicate, one over the queue's block or byte bound is dropped as full. Nothing
  waits on the disk.
* The thread takes up to ``batch_blocks`` items at a time. For each block it skips
  one already on disk (a ``stat``), encodes the value (``block_codec``), writes it
  to a temporary name in the block's own folder (``O_EXCL``), ``fsync``s it (policy
  ``"file"`` or ``"file+dir"``), then, under the namespace's lock
  (``disk_layout.Ledger``): skips it if another process renamed the same block into
  place meanwhile, evicts least recently used blocks of this process's index until
  the ledger's bytes plus this value fit ``capacity_bytes`` (a full recount with
  ``scan`` when its own index runs out), renames the value into place and adds it
  to the ledger. A reader therefore sees a block's complete value or no file at all.
  With ``"file+dir"`` the folders a batch renamed into are ``fsync``ed after it.
* A write that fails (ENOSPC, EROFS, EACCES, any ``OSError``) removes its temporary
  file and is counted in ``dropped`` by reason (``disk_layout.drop_reason``); a block
  bigger than the capacity is dropped as ``"capacity"``. Nothing is raised: the thread
  never dies of a write.
* ``delete(block_hash, identity)`` (a value a reader refused) is applied at the next
  round, under the lock, only if the file is still the one refused (same inode, size
  and mtime): a good value renamed over it since is kept. Pending deletions are
  bounded by the queue's block bound; one over it is dropped and counted.
* ``flush(timeout_s)`` waits until the queue and the deletions are empty and the
  round in flight is done; ``close()`` drops what is queued (``dropped["closed"]``)
  and stops the thread (bounded join).

Its counters are written by this thread only; ``offer`` and ``delete`` count under
the queue's lock.
"""

from __future__ import annotations

import os
import threading
import time
from collections import deque

from .block_codec import encode
from .disk_index import BlockIndex
from .disk_layout import Layout, Ledger, ScanResult, drop_reason, scan
from .fingerprint import Fingerprint

__all__ = ["DiskWriter", "Pending", "WRITER_COUNTERS", "FSYNC_POLICIES"]

WRITER_COUNTERS = ("queued", "dropped_full", "dropped_duplicate", "writes", "write_bytes", "skipped_present",
                   "evictions", "evicted_bytes", "bad_files_deleted", "deletes_dropped", "write_errors", "rescans",
                   "leftover_temps")
FSYNC_POLICIES = ("none", "file", "file+dir")


class Pending:
    """One block waiting to be written (the payload is referenced, not copied, until it is encoded)."""

    __slots__ = ("key", "parent", "payload", "content", "nbytes")

    def __init__(self, key, parent, payload, content, nbytes):
        self.key, self.parent, self.payload, self.content, self.nbytes = key, parent, payload, content, nbytes


class DiskWriter:
    def __init__(self, layout: Layout, ledger: Ledger, index: BlockIndex, fingerprint: Fingerprint, *,
                 capacity_bytes: int, queue_blocks: int, queue_bytes: int, batch_blocks: int, fsync: str,
                 stale_temp_s: float, join_timeout_s: float) -> None:
        self.layout, self.ledger, self.index, self.fingerprint = layout, ledger, index, fingerprint
        self.capacity_bytes = capacity_bytes
        self.queue_blocks, self.queue_bytes, self.batch_blocks = queue_blocks, queue_bytes, batch_blocks
        self.fsync = fsync
        self.stale_temp_s = stale_temp_s
        self.join_timeout_s = join_timeout_s
        self.counts = dict.fromkeys(WRITER_COUNTERS, 0)
        self.dropped: dict[str, int] = {}       # reason -> writes lost to it
        self._serial = 0
        self._name = os.urandom(4).hex()        # temporary names of two stores in one process never collide
        self._cv = threading.Condition()
        self._queue: deque[Pending] = deque()
        self._queued_bytes = 0
        self._pending_keys: set[bytes] = set()
        self._deletes: dict[bytes, tuple] = {}  # hash -> identity of the refused file, at most queue_blocks
        self._busy = False
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="prefixkv-disk-writer", daemon=True)
        self._thread.start()

    # -- caller's thread ------------------------------------------------------------
    def offer(self, items: list[Pending]) -> int:
        queued = 0
        with self._cv:
            if self._closing:
                self._drop("closed", len(items))
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

    def delete(self, block_hash: bytes, identity: tuple) -> None:
        with self._cv:
            if self._closing or block_hash in self._deletes:
                return
            if len(self._deletes) >= self.queue_blocks:
                self.counts["deletes_dropped"] += 1
                return
            self._deletes[block_hash] = identity
            self._cv.notify()

    def refuse(self, reason: str, n: int) -> None:
        """Count ``n`` writes the store dropped before offering them (the namespace is not writable)."""
        self._drop(reason, n)

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
            self._drop("closed", len(self._queue))
            self._queue.clear()
            self._queued_bytes = 0
            self._deletes.clear()
            self._cv.notify_all()
        self._thread.join(timeout=self.join_timeout_s)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _drop(self, reason: str, n: int = 1) -> None:
        # both threads drop: under the queue's (re-entrant) lock, as offer counts
        if n:
            with self._cv:
                self.dropped[reason] = self.dropped.get(reason, 0) + n

    # -- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cv:
                while not (self._queue or self._deletes or self._closing):
                    self._cv.wait(1.0)
                if self._closing:
                    self._cv.notify_all()
                    return
                batch = [self._queue.popleft() for _ in range(min(self.batch_blocks, len(self._queue)))]
                self._queued_bytes -= sum(item.nbytes for item in batch)
                deletes, self._deletes = self._deletes, {}
                self._busy = True
            try:
                if deletes:
                    self._delete_refused(deletes)
                folders = set()
                for item in batch:
                    if self._closing:
                        self._drop("closed")
                        continue
                    folder = self._write_one(item)
                    if folder is not None:
                        folders.add(folder)
                if folders and self.fsync == "file+dir":
                    self._sync_dirs(folders)
            except Exception:       # never let the writer die: count and go on
                self.counts["write_errors"] += 1
            finally:
                with self._cv:
                    for item in batch:
                        self._pending_keys.discard(item.key)
                    self._busy = False
                    self._cv.notify_all()

    def _write_one(self, item: Pending) -> str | None:
        """Write one block (see the module docstring); the folder it was renamed into, or None."""
        path = self.layout.block_path(item.key)
        try:
            size = os.stat(path).st_size
        except FileNotFoundError:
            pass
        except OSError as exc:
            self._drop(drop_reason(exc))
            return None
        else:
            self.counts["skipped_present"] += 1
            self.index.touch(item.key, size)    # computed again just now: recently used
            return None
        try:
            value = encode(self.fingerprint, item.key, item.parent, item.payload, item.content)
        except ValueError:
            self.counts["write_errors"] += 1
            return None
        size = len(value)
        if size > self.capacity_bytes:
            self._drop("capacity")
            return None
        try:
            temp = self._write_temp(item.key, value)
        except OSError as exc:
            self._drop(drop_reason(exc))
            return None
        try:
            committed = self._commit(item.key, temp, path, size)
        except OSError as exc:
            self._drop(drop_reason(exc))
            committed = False
        if not committed:
            _unlink_quietly(temp)
            return None
        self.counts["writes"] += 1
        self.counts["write_bytes"] += size
        return os.path.dirname(path)

    def _write_temp(self, key: bytes, value: bytes) -> str:
        self._serial += 1
        temp = self.layout.temp_path(key, f"{self._name}-{self._serial}")
        self.layout.make_fanout_dir(key)
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        except FileNotFoundError:       # the folder was removed by another process's clear: once more
            self.layout.forget_made()
            self.layout.make_fanout_dir(key)
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            self._write_all(fd, value)
            if self.fsync != "none":
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            _unlink_quietly(temp)
            raise
        os.close(fd)
        return temp

    @staticmethod
    def _write_all(fd: int, data: bytes) -> None:
        view = memoryview(data)
        while view:          # each round writes at least one byte or raises: at most len(data) rounds
            view = view[os.write(fd, view):]

    def _commit(self, key: bytes, temp: str, path: str, size: int) -> bool:
        """Under the lock: rename ``temp`` into place once there is room; False when skipped or dropped."""
        with self.ledger.locked() as ledger:
            if ledger.used is None:
                self._resync(ledger)
            try:
                present = os.stat(path).st_size
            except FileNotFoundError:
                present = None
            if present is not None:       # another process won the race with the same block
                self.counts["skipped_present"] += 1
                self.index.touch(key, present)
                return False
            if not self._make_room(ledger, size):
                self._drop("capacity")
                return False
            os.rename(temp, path)
            ledger.used += size
        self.index.touch(key, size)
        return True

    def _make_room(self, ledger: Ledger, size: int) -> bool:
        """Evict this process's least recently used blocks until ``size`` more bytes fit; when its
        index runs out first, recount the namespace once (other processes' files become known)."""
        for attempt in range(2):
            while ledger.used + size > self.capacity_bytes:
                victim = self.index.pop_oldest()
                if victim is None:
                    break
                self._evict(ledger, victim[0])
            if ledger.used + size <= self.capacity_bytes:
                return True
            if attempt == 0:
                self._resync(ledger)
        return False

    def _evict(self, ledger: Ledger, key: bytes) -> None:
        path = self.layout.block_path(key)
        try:
            size = os.stat(path).st_size
            os.unlink(path)
        except FileNotFoundError:
            return            # evicted by another process, which took it off the ledger
        ledger.used -= size
        self.counts["evictions"] += 1
        self.counts["evicted_bytes"] += size

    def _resync(self, ledger: Ledger) -> ScanResult:
        """Recount the namespace (under the lock): the index adopts it, the ledger is set to it."""
        found = scan(self.layout, self.stale_temp_s)
        self.index.merge(found.blocks)
        ledger.used = found.total_bytes
        self.counts["rescans"] += 1
        self.counts["leftover_temps"] += found.leftover_temps
        return found

    def _delete_refused(self, deletes: dict[bytes, tuple]) -> None:
        with self.ledger.locked() as ledger:
            for key, identity in deletes.items():
                path = self.layout.block_path(key)
                try:
                    st = os.stat(path)
                    if (st.st_ino, st.st_size, st.st_mtime_ns) != identity:
                        continue      # a fresh value was renamed over the refused one: keep it
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                except OSError:
                    self.counts["deletes_dropped"] += 1
                    continue
                if ledger.used is not None:
                    ledger.used -= st.st_size
                self.index.forget(key)
                self.counts["bad_files_deleted"] += 1

    def _sync_dirs(self, folders: set[str]) -> None:
        """Make a batch's renames durable: each folder renamed into, then the namespace (new folders)."""
        for folder in (*sorted(folders), self.layout.namespace):
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
            except OSError:
                self.counts["write_errors"] += 1


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
