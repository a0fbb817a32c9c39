"""A persistent, verified, bounded block store on a local disk: what a disk tier is made of.

Same calls and semantics as ``redis_store.RedisBlockStore``, so a tier can use either:
blocks are named by their chained hash, a call names a prompt's chain (``chain[i]`` =
hash of block ``i``) and a range of it, every value is a ``block_codec`` value verified
on every read. The batch calls (``exists_leading`` / ``get_many`` / ``set_many``) take
consecutive block hashes and the hash before them: the shape of SGLang HiCache's and
vLLM's storage interfaces (issue 27), which hold keys, not chains.

API contract:

* ``DiskBlockStore(path, fingerprint, capacity_bytes, config=None)``: ``path`` is a
  directory (made when missing); the store uses ``path/<fingerprint hex>/`` only
  (``disk_layout``). Opening rebuilds the index from names and ``stat`` alone (no value
  is read), deletes leftover temporary files of dead writers (``rejected["leftover_temp"]``),
  and sets the shared ledger to the bytes found, under the namespace's lock.
* ``probe(chain, start=0) -> int`` / ``exists_leading(keys) -> int``: consecutive blocks
  present from ``chain[start]`` / ``keys[0]``. The index answers; at the first block it
  lacks, one ``stat`` finds a file another process wrote since (then adopted). A hint:
  a block can be evicted (by any process) between a probe and a fetch.
* ``fetch(chain, start, stop, contents=None) -> Fetched`` /
  ``get_many(keys, parent=None, contents=None) -> Fetched``: the verified payloads of the
  leading loadable blocks (``parent`` is the hash before ``keys[0]``; None: ``keys[0]`` is
  block 0). Each file is opened (``O_NOFOLLOW``), read whole and checked by
  ``block_codec.decode`` against the chain's hash, parent, fingerprint and, when given,
  ``contents[j]``. It stops at the first absent file (``"miss"``), unreadable one
  (``"error"``) or refused value (its ``Reject``: counted, the file deleted in the
  background if it is still the one read). Payloads are memoryviews into the bytes read.
  Each file is one ``open`` and one ``read`` of the size the index knows + 1 (no ``fstat``
  unless a value is refused or the index does not know the size). Where the page cache is
  cold (sampled with ``RWF_NOWAIT``), the next ``read_ahead`` files are opened and their
  reads started while one is verified (``disk_reader``; ``stats().read_ahead_fetches``).
  Synchronous; it never takes the namespace's lock, so it never waits for another process.
* ``exists_each(keys) -> list[bool]``: per key, independent blocks (an engine's lookups).
  ``get_many`` / ``set_many`` take ``chained=False`` for independent blocks: every value's
  parent is ``parent`` (an engine's keys commit to their prefix themselves); ``get_many(...,
  into=f)`` hands each verified payload to ``f(j, payload)`` as it is verified instead of keeping it.
* ``put(chain, start, payloads, contents=None) -> int`` /
  ``set_many(keys, payloads, parent=None, contents=None) -> int``: check everything,
  then queue for the background writer and return how many were queued, at once
  (``disk_writer``: bounded queue, drops counted, never waits on the disk). Pass payload
  buffers nobody rewrites until they are written (``flush``).
* ``flush(timeout_s=10.0) -> bool``; ``stats() -> DiskStoreStats``; ``capacity_blocks()``;
  ``clear(fingerprint_hex=None) -> int`` (block files deleted, every namespace under ``path``
  or one, under each namespace's lock; other files are left: ``disk_admin``); ``close()``.
  Opening records ``capacity_bytes`` beside the ledger for operators (``prefixkv tier stats``).
  After ``close()`` every call but ``stats`` and ``flush`` raises ``StoreClosed``.

Guarantees:

* Atomic: a value is written to a temporary name in its final folder and renamed into
  place, so a block file is always a complete value. Against a process crash (``kill -9``)
  that is all it takes: the page cache keeps what was written. Against a power cut
  ``fsync="file"`` (default) syncs each value before its rename, so a block file that
  survives is complete; a rename not yet on the journal is lost (a miss, never damage).
  ``"file+dir"`` also syncs the folders after each batch, so a flushed block survives;
  ``"none"`` leaves both to the kernel (faster; a torn value after a power cut is
  refused by its checksums and deleted, like any damage). In every mode nothing
  unverified is returned: durability changes what survives, never what is served.
* Shared by processes on one host: renames are atomic, so racing writers of one block
  leave one complete value; a reader holding a file open keeps reading it after another
  process evicts it; a file gone before it is opened is a plain miss. Writes, evictions
  and deletions of refused values take the namespace's ``flock`` and keep one shared
  byte count (``disk_layout.Ledger``), so the namespace never holds more than
  ``capacity_bytes`` of block files (plus each writing process's one temporary file) even
  with several writers. Eviction is least recently used in this process's view (its own
  reads and writes; blocks learnt from another process rank oldest, by modification time),
  and a process whose index runs out recounts the namespace and may evict others' blocks.
* A full, read-only or forbidden disk (ENOSPC, EROFS, EACCES at any write) drops the
  write and counts it by reason (``stats().dropped``); a directory that cannot be opened
  for writing at all serves what it holds and drops every write. Nothing is raised into
  the caller for the disk's state; wrong arguments raise ``InvalidArgument`` before any
  state changes.

Not done (yet): recency is not written to disk (after a restart, the oldest written is evicted
first); no periodic rescan (a process learns other processes' blocks by a stat on a miss, at
open, and when its own index cannot make room).

Threads: one caller thread at a time for probe/fetch/put, plus the writer thread.
"""

from __future__ import annotations

import os
import time
import weakref
from dataclasses import dataclass, field
from typing import Sequence

from ..checks import integer, seconds
from ..errors import InvalidArgument, PrefixKVError
from ..hashing import BlockHasher
from .block_codec import header_size
from .disk_admin import clear_namespace, is_namespace
from .disk_index import BlockIndex
from .disk_layout import Layout, Ledger, drop_reason, scan
from .disk_reader import load
from .disk_writer import FSYNC_POLICIES, DiskWriter, Pending
from .fetched import Fetched
from .fingerprint import Fingerprint, payload_view

__all__ = ["DiskBlockStore", "DiskStoreConfig", "DiskStoreStats", "Fetched", "StoreClosed"]


class StoreClosed(PrefixKVError):
    """A call on a closed disk store."""


@dataclass(frozen=True, slots=True)
class DiskStoreConfig:
    """Knobs of one store."""

    fsync: str = "file"                  # "none" | "file" | "file+dir" (see the module docstring)
    queue_blocks: int = 4096
    queue_bytes: int = 256 * 2**20
    batch_blocks: int = 64               # blocks per writer round (one folder sync per round with "file+dir")
    read_ahead: int = 16                 # files a fetch keeps open ahead on a cold page cache (disk_reader)
    stale_temp_s: float = 60.0           # a live pid's temporary file older than this is a leftover
    join_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if self.fsync not in FSYNC_POLICIES:
            raise InvalidArgument("fsync", f"expected one of {', '.join(FSYNC_POLICIES)}, got {self.fsync!r}")
        values = {name: integer(name, getattr(self, name), low=1)
                  for name in ("queue_blocks", "queue_bytes", "batch_blocks", "read_ahead")}
        values.update({name: seconds(name, getattr(self, name))
                       for name in ("stale_temp_s", "join_timeout_s")})
        for name, value in values.items():
            object.__setattr__(self, name, value)


@dataclass(frozen=True, slots=True)
class DiskStoreStats:
    """Counters since the store was opened (a snapshot). Names shared with ``redis_store.StoreStats``
    mean the same."""

    probes: int = 0
    probe_blocks: int = 0             # blocks probes reported present
    fetches: int = 0
    blocks_loaded: int = 0            # verified blocks handed out by fetch
    bytes_loaded: int = 0             # payload bytes of those
    fetch_misses: int = 0             # fetches that stopped at an absent file
    rejected: dict = field(default_factory=dict)   # Reject.value (and "leftover_temp") -> count
    bad_keys_deleted: int = 0         # refused files deleted
    deletes_dropped: int = 0          # refused files not deleted: too many pending, or the disk refused
    read_errors: int = 0              # files that could not be read (other than absent)
    read_ahead_fetches: int = 0       # fetches that found the page cache cold and read ahead (disk_reader)
    learned: int = 0                  # blocks another process wrote, found by a stat on a miss
    vanished: int = 0                 # blocks the index listed whose file was gone (another process evicted)
    puts: int = 0                     # blocks offered to put()
    queued: int = 0
    dropped_full: int = 0             # queue over its bound
    dropped_duplicate: int = 0        # already queued
    dropped: dict = field(default_factory=dict)    # reason -> writes lost: no_space, read_only, permission,
    #                                                io_error, capacity, closed
    writes: int = 0                   # values renamed into place
    write_bytes: int = 0
    skipped_present: int = 0          # already on disk (this or another process wrote it)
    write_errors: int = 0             # values that could not be encoded, failed folder syncs
    evictions: int = 0
    evicted_bytes: int = 0
    rescans: int = 0                  # recounts of the namespace after open
    unknown_files: int = 0            # names the store never writes, left alone (at open)
    index_blocks: int = 0             # blocks in this process's view
    index_bytes: int = 0
    used_bytes: int = 0               # the shared ledger: bytes of block files of this namespace
    capacity_bytes: int = 0
    open_s: float = 0.0               # index rebuild at open
    queue_blocks: int = 0
    queue_bytes: int = 0
    delete_queue: int = 0


_FG_COUNTERS = ("probes", "probe_blocks", "fetches", "blocks_loaded", "bytes_loaded", "fetch_misses",
                "read_errors", "read_ahead_fetches", "learned", "vanished", "puts")


class DiskBlockStore:
    """Blocks of one fingerprint in one directory (see the module docstring for the contract)."""

    reads_synchronous = True
    writes_synchronous = False

    def __init__(self, path, fingerprint: Fingerprint, capacity_bytes: int,
                 config: DiskStoreConfig | None = None) -> None:
        config = config or DiskStoreConfig()
        if not isinstance(config, DiskStoreConfig):
            raise InvalidArgument("config", f"expected a DiskStoreConfig, got {type(config).__name__}")
        if not isinstance(fingerprint, Fingerprint):
            raise InvalidArgument("fingerprint", f"expected a Fingerprint, got {type(fingerprint).__name__}")
        if not isinstance(path, (str, os.PathLike)):
            raise InvalidArgument("path", f"expected a directory path, got {type(path).__name__}")
        path = os.path.abspath(os.fspath(path))
        if os.path.exists(path) and not os.path.isdir(path):
            raise InvalidArgument("path", f"{path} exists and is not a directory")
        capacity_bytes = integer("capacity_bytes", capacity_bytes, low=1)
        self.value_bytes = header_size(fingerprint) + fingerprint.block_bytes   # a value without content
        if capacity_bytes < self.value_bytes:
            raise InvalidArgument("capacity_bytes", f"{capacity_bytes} bytes hold no block: one value under this "
                                                    f"fingerprint is at least {self.value_bytes} bytes")
        self.path = path
        self.fingerprint = fingerprint
        self.capacity_bytes = capacity_bytes
        self.config = config
        self.root = BlockHasher(fingerprint.block_size, fingerprint.hash_seed, fingerprint.hash_algorithm).root
        self.closed = False
        self._count = dict.fromkeys(_FG_COUNTERS, 0)
        self._rejected: dict[str, int] = {}
        self.layout = Layout(path, fingerprint)
        self.index = BlockIndex()
        t0 = time.perf_counter()
        try:
            os.makedirs(path, exist_ok=True)
        except OSError:
            pass            # a read-only parent: the ledger below records why writes are refused
        self.ledger = Ledger(self.layout)
        with self.ledger.locked() as ledger:
            found = scan(self.layout, config.stale_temp_s)
            self.index.merge(found.blocks)
            ledger.used = found.total_bytes
            ledger.write_capacity(capacity_bytes)
        self.open_s = time.perf_counter() - t0
        self.unknown_files = found.unknown_files
        if found.leftover_temps:
            self._rejected["leftover_temp"] = found.leftover_temps
        self.writer = DiskWriter(self.layout, self.ledger, self.index, fingerprint, capacity_bytes=capacity_bytes,
                                 queue_blocks=config.queue_blocks, queue_bytes=config.queue_bytes,
                                 batch_blocks=config.batch_blocks, fsync=config.fsync,
                                 stale_temp_s=config.stale_temp_s, join_timeout_s=config.join_timeout_s)
        # Dropped at put time when the namespace cannot be written at all (read-only disk).
        self._unwritable = None if self.ledger.writable else drop_reason(self.ledger.open_error)
        self._shutdown = weakref.finalize(self, _shutdown, self.writer, self.ledger)

    # -- argument checks ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self.closed:
            raise StoreClosed(f"the disk block store at {self.path} is closed; open a new one to use it again")

    def _check_keys(self, name: str, keys: Sequence[bytes], start: int = 0, stop: int | None = None) -> None:
        size = self.fingerprint.hash_size
        for i in range(start, len(keys) if stop is None else stop):
            key = keys[i]
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

    def _check_contents(self, contents, n: int, exact: bool):
        if contents is None:
            return None
        if len(contents) < n or exact and len(contents) != n:
            raise InvalidArgument("contents", f"{len(contents)} entries for {n} blocks")
        for j in range(n):
            # bytes(5) is five zero bytes and bytes([1, 2]) other bytes: only a byte string is its content
            if not isinstance(contents[j], (bytes, bytearray, memoryview)):
                raise InvalidArgument("contents", f"content {j} is {type(contents[j]).__name__}, not bytes")
        return contents

    # -- reads ----------------------------------------------------------------------------
    def probe(self, chain: Sequence[bytes], start: int = 0) -> int:
        """Leading blocks of ``chain[start:]`` on disk (see the module docstring)."""
        self._check_open()
        start = integer("start", start, low=0)
        if start >= len(chain):
            return 0
        self._check_keys("chain", chain, start)
        return self._leading(chain, start)

    def exists_leading(self, keys: Sequence[bytes]) -> int:
        """How many of ``keys`` (consecutive blocks) are on disk, from the first, before one is missing."""
        self._check_open()
        self._check_keys("keys", keys)
        return self._leading(keys, 0) if len(keys) else 0

    def exists_each(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each of ``keys`` (independent blocks, in any order) is on disk: a hint, like ``probe``."""
        self._check_open()
        self._check_keys("keys", keys)
        self._count["probes"] += 1
        index, out = self.index, []
        for key in keys:
            out.append(key in index or self._learn(key))
        self._count["probe_blocks"] += sum(out)
        return out

    def _leading(self, keys: Sequence[bytes], start: int) -> int:
        self._count["probes"] += 1
        index, n = self.index, 0
        for i in range(start, len(keys)):
            key = keys[i]
            if key not in index and not self._learn(key):
                break
            n += 1
        self._count["probe_blocks"] += n
        return n

    def _learn(self, key: bytes) -> bool:
        """Stat-on-miss: a block another process wrote since this index was built."""
        try:
            st = os.stat(self.layout.block_path(key), follow_symlinks=False)
        except OSError:
            return False
        self.index.touch(key, st.st_size)
        self._count["learned"] += 1
        return True

    def fetch(self, chain: Sequence[bytes], start: int, stop: int, contents: Sequence[bytes] | None = None) -> Fetched:
        """Verified payloads of the leading loadable blocks of ``chain[start:stop]``."""
        self._check_open()
        start = integer("start", start, low=0)
        stop = min(integer("stop", stop), len(chain))
        if start >= stop:
            return Fetched([])
        self._check_contents(contents, stop - start, exact=False)
        self._check_keys("chain", chain, max(0, start - 1), stop)     # the parent of block start is read too
        return self._read_run(chain[start:stop], chain[start - 1] if start else self.root, contents)

    def get_many(self, keys: Sequence[bytes], parent: bytes | None = None,
                 contents: Sequence[bytes] | None = None, chained: bool = True, into=None) -> Fetched:
        """Verified payloads of the leading loadable blocks of ``keys`` (consecutive blocks of one chain;
        ``parent`` is the hash before ``keys[0]``, None when ``keys[0]`` is block 0). ``chained=False``:
        the keys are independent blocks, each written with ``parent`` as its parent (``set_many`` with
        ``chained=False``): an engine's own keys, which already commit to their prefix. ``into(j,
        payload)``: each block's verified payload is handed to it as soon as it is verified (valid
        during the call only) instead of kept (``payloads`` then holds None for each): a caller copying
        into its own memory copies while the bytes are still in the CPU's cache."""
        self._check_open()
        self._check_keys("keys", keys)
        parent = self._check_parent(parent)
        self._check_contents(contents, len(keys), exact=False)
        if not isinstance(chained, bool):
            raise InvalidArgument("chained", f"expected True or False, got {chained!r}")
        if into is not None and not callable(into):
            raise InvalidArgument("into", f"expected a callable (index, payload), got {type(into).__name__}")
        if not len(keys):
            return Fetched([])
        return self._read_run(keys, parent, contents, chained, into)

    def _read_run(self, keys: Sequence[bytes], parent: bytes, contents, chained: bool = True,
                  into=None) -> Fetched:
        self._count["fetches"] += 1
        index = self.index
        # One pass over the keys for paths, one lock for the sizes the reader reads without an fstat.
        paths = self.layout.block_paths(keys)
        parents = [parent, *keys[:-1]] if chained else [parent] * len(keys)
        payloads, sizes, stop, identity, read_ahead = load(paths, index.sizes(keys), keys, parents,
                                                           contents, self.fingerprint, self.config.read_ahead,
                                                           into)
        if read_ahead:
            self._count["read_ahead_fetches"] += 1
        n = len(payloads)
        if stop is not None:
            key = keys[n]
            if stop == "miss":
                self._count["fetch_misses"] += 1
                if index.forget(key):
                    self._count["vanished"] += 1
            elif stop == "error":
                self._count["read_errors"] += 1
            else:
                self._rejected[stop.value] = self._rejected.get(stop.value, 0) + 1
                index.forget(key)
                if identity is not None:
                    self.writer.delete(key, identity)     # in the background, only if still this file
        index.touch_many(keys[:n], sizes)     # the served blocks, most recent last: one index update
        self._count["blocks_loaded"] += n
        self._count["bytes_loaded"] += n * self.fingerprint.block_bytes
        return Fetched(payloads, stop)

    # -- writes -----------------------------------------------------------------------------
    def put(self, chain: Sequence[bytes], start: int, payloads: Sequence, contents: Sequence[bytes] | None = None) -> int:
        """Queue blocks ``start..start+len(payloads)-1`` of ``chain`` for writing; returns how many were queued."""
        self._check_open()
        n = len(payloads)
        start = integer("start", start)
        if start < 0 or start + n > len(chain):
            raise InvalidArgument("start", f"blocks {start}..{start + n - 1} are outside a chain of {len(chain)}")
        # the parent of block ``start`` goes into its value: checked like the blocks themselves
        self._check_keys("chain", chain, max(0, start - 1), start + n)
        return self._queue(chain[start:start + n], chain[start - 1] if start else self.root, payloads, contents)

    def set_many(self, keys: Sequence[bytes], payloads: Sequence, parent: bytes | None = None,
                 contents: Sequence[bytes] | None = None, chained: bool = True) -> int:
        """Queue ``payloads[j]`` as block ``keys[j]`` (consecutive blocks; ``parent`` and ``chained`` as in
        ``get_many``)."""
        self._check_open()
        if len(payloads) != len(keys):
            raise InvalidArgument("payloads", f"{len(payloads)} payloads for {len(keys)} keys")
        self._check_keys("keys", keys)
        if not isinstance(chained, bool):
            raise InvalidArgument("chained", f"expected True or False, got {chained!r}")
        return self._queue(keys, self._check_parent(parent), payloads, contents, chained)

    def _queue(self, keys, parent: bytes, payloads, contents, chained: bool = True) -> int:
        n = len(payloads)
        block_bytes = self.fingerprint.block_bytes
        views = [payload_view(payload, j, block_bytes) for j, payload in enumerate(payloads)]
        self._check_contents(contents, n, exact=True)
        self._count["puts"] += n
        if n == 0:
            return 0
        if self._unwritable is not None:
            self.writer.refuse(self._unwritable, n)
            return 0
        items = []
        for j in range(n):
            items.append(Pending(keys[j], keys[j - 1] if j and chained else parent, views[j],
                                 None if contents is None else bytes(contents[j]), block_bytes))
        return self.writer.offer(items)

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write and deletion is on disk (or dropped). False on timeout."""
        return self.writer.flush(seconds("timeout_s", timeout_s, zero=True))

    # -- stats and operators ---------------------------------------------------------------
    def stats(self) -> DiskStoreStats:
        queue_blocks, queue_bytes, delete_queue = self.writer.queue_state()
        counts = dict(self.writer.counts)
        rejected = dict(self._rejected)
        if counts.get("leftover_temps"):
            rejected["leftover_temp"] = rejected.get("leftover_temp", 0) + counts["leftover_temps"]
        used = self.ledger.read()
        return DiskStoreStats(
            **self._count,
            rejected=rejected, bad_keys_deleted=counts["bad_files_deleted"], deletes_dropped=counts["deletes_dropped"],
            queued=counts["queued"], dropped_full=counts["dropped_full"],
            dropped_duplicate=counts["dropped_duplicate"], dropped=dict(self.writer.dropped), writes=counts["writes"],
            write_bytes=counts["write_bytes"], skipped_present=counts["skipped_present"],
            write_errors=counts["write_errors"], evictions=counts["evictions"], evicted_bytes=counts["evicted_bytes"],
            rescans=counts["rescans"], unknown_files=self.unknown_files, index_blocks=len(self.index),
            index_bytes=self.index.bytes, used_bytes=self.index.bytes if used is None else used,
            capacity_bytes=self.capacity_bytes, open_s=self.open_s, queue_blocks=queue_blocks,
            queue_bytes=queue_bytes, delete_queue=delete_queue)

    def capacity_blocks(self) -> int:
        """Blocks ``capacity_bytes`` holds (values without content; with token ids a few bytes fewer fit)."""
        return self.capacity_bytes // self.value_bytes

    def clear(self, fingerprint_hex: str | None = None) -> int:
        """Delete the block files of every namespace under ``path`` (all fingerprints), or of one
        fingerprint's, each under its namespace's lock; files the store never writes, writes in
        progress and the folders are left (``disk_admin.clear_namespace``). Returns block files
        deleted. Another process's store on a cleared namespace sees misses."""
        self._check_open()
        if fingerprint_hex is not None and (not isinstance(fingerprint_hex, str) or len(fingerprint_hex) != 32
                                            or not set(fingerprint_hex) <= set("0123456789abcdef")):
            raise InvalidArgument("fingerprint_hex", f"expected 32 lower-case hex digits, got {fingerprint_hex!r}")
        self.flush()
        names = [fingerprint_hex] if fingerprint_hex is not None else [e.name for e in os.scandir(self.path)]
        deleted = 0
        for name in names:
            namespace = os.path.join(self.path, name)
            if not (name == self.fingerprint.hex and os.path.isdir(namespace) or is_namespace(self.path, name)):
                continue
            # block files and dead writers' temporaries only, under each namespace's lock (disk_admin)
            own = name == self.fingerprint.hex
            deleted += clear_namespace(namespace, self.config.stale_temp_s, self.ledger if own else None).blocks
            if own:
                self.index.clear()
        return deleted

    # -- lifetime ---------------------------------------------------------------------------
    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Write what is queued (up to ``flush_timeout_s``) and stop the writer. Closing twice is a no-op."""
        flush_timeout_s = seconds("flush_timeout_s", flush_timeout_s, zero=True)
        if self.closed:
            return
        self.closed = True
        self.writer.flush(flush_timeout_s)
        self._shutdown()

    def __enter__(self) -> "DiskBlockStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _shutdown(writer: DiskWriter, ledger: Ledger) -> None:
    writer.close()
    if not writer.alive:
        # a writer still stuck in a syscall past its join keeps the ledger: closing the descriptor
        # under it would let a reused descriptor number be locked or written
        ledger.close()
