"""Where a disk block store's files live, how a directory is scanned, and the ledger its processes share.

Layout under the store's ``path``::

    path/<fingerprint hex>/                 one namespace per ``Fingerprint.digest``: nothing
                                            outside it is ever opened as this model's
        usage                               the ledger: bytes of block files in this namespace
                                            (u64 + its xxh3-64), then the capacity the last store
                                            opened with (same shape, for operators), and the lock
                                            (``flock``) every process takes to change what is on disk
        <hh>/<block hash hex>.kv            one ``block_codec`` value; ``hh`` is the hash's first
                                            byte in hex (256 fan-out folders: ~400 files each at
                                            100,000 blocks, so a lookup is one short path walk)
        <hh>/<block hash hex>.<pid>.<writer>.tmp  a write in progress (or left by a crash)

A block file is named by its hash, so "is block X here" is one ``stat`` and the
index is rebuilt from names and ``stat`` alone (``scan``): no file is read at open,
every value is verified when it is read.

The ledger counts bytes of ``.kv`` files only. Every change to them (a rename into
place, an eviction, the deletion of a refused value) happens under the lock, together
with the ledger's update, so processes sharing the namespace agree on how full it is.
A process killed between a rename and the ledger's update leaves it one block low;
``scan`` under the lock (at every open, and whenever a writer cannot free space from
its own index) recounts it exactly. ``flock`` is per open file and released by the
kernel when its holder dies, so a killed process never leaves the lock held.
Host-local filesystems only: ``flock`` over NFS is not a lock between hosts.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import struct
import time
from dataclasses import dataclass, field

import fcntl
import xxhash

from .fingerprint import Fingerprint

__all__ = ["Layout", "Ledger", "ScanResult", "scan", "drop_reason", "temp_is_leftover", "BLOCK_SUFFIX", "TEMP_SUFFIX",
           "LEDGER_NAME"]

BLOCK_SUFFIX = ".kv"
TEMP_SUFFIX = ".tmp"
LEDGER_NAME = "usage"
_LEDGER = struct.Struct("<QQ")
_HEX = frozenset("0123456789abcdef")


def drop_reason(exc: OSError) -> str:
    """The stats name of a failed disk write: what an operator would have to fix."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return "no_space"
    if exc.errno == errno.EROFS:
        return "read_only"
    if exc.errno in (errno.EACCES, errno.EPERM):
        return "permission"
    return "io_error"


class Layout:
    """Paths of one fingerprint's namespace under ``root``."""

    def __init__(self, root: str, fingerprint: Fingerprint) -> None:
        self.root = root
        self.namespace = os.path.join(root, fingerprint.hex)
        self.hash_size = fingerprint.hash_size
        self.name_len = 2 * fingerprint.hash_size + len(BLOCK_SUFFIX)
        self._made: set[str] = set()          # fan-out folders known to exist (saves a mkdir per write)

    def block_path(self, block_hash: bytes) -> str:
        name = block_hash.hex()
        return f"{self.namespace}/{name[:2]}/{name}{BLOCK_SUFFIX}"

    def block_paths(self, keys) -> list[str]:
        """``block_path`` of each key (one comprehension: a fetch's 2,048 paths in ~0.5 ms)."""
        namespace = self.namespace
        return [f"{namespace}/{name[:2]}/{name}{BLOCK_SUFFIX}" for name in (key.hex() for key in keys)]

    def temp_path(self, block_hash: bytes, writer: str) -> str:
        """``writer`` names one writer of this process (several stores may share a namespace) and its
        write; the pid lets an open tell a dead writer's leftovers from a live one's write in progress."""
        name = block_hash.hex()
        return f"{self.namespace}/{name[:2]}/{name}.{os.getpid()}.{writer}{TEMP_SUFFIX}"

    def fanout_dir(self, block_hash: bytes) -> str:
        return f"{self.namespace}/{block_hash[:1].hex()}"

    def make_fanout_dir(self, block_hash: bytes) -> str:
        folder = self.fanout_dir(block_hash)
        if folder not in self._made:
            os.makedirs(folder, exist_ok=True)
            self._made.add(folder)
        return folder

    def forget_made(self) -> None:
        """Another process may have removed the folders (``clear``): make them again when needed."""
        self._made.clear()


@dataclass(slots=True)
class ScanResult:
    """What one pass over a namespace found."""

    blocks: list = field(default_factory=list)   # (mtime ns, hash, file bytes) per block file
    total_bytes: int = 0
    leftover_temps: int = 0          # temporary files of dead (or long-stalled) writers, deleted
    live_temps: int = 0              # writes in progress in live processes, left alone
    unknown_files: int = 0           # names this layout never writes (left alone, not counted)
    delete_errors: int = 0           # leftovers that could not be deleted (a read-only disk)
    elapsed_s: float = 0.0


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True        # another store object of this process may be writing it
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True        # exists, owned by another user
    return True


def temp_is_leftover(entry: os.DirEntry, now: float, stale_temp_s: float) -> bool | None:
    """Whether a temporary file is one nobody will rename: its writer's pid is dead (a crash), or it
    is older than ``stale_temp_s`` (a reused pid, a writer stuck for good). None: gone meanwhile."""
    try:
        pid = int(entry.name.split(".")[1])
    except (IndexError, ValueError):
        return True         # not a name this layout writes: nobody will rename it
    if not _pid_alive(pid):
        return True
    try:
        return now - entry.stat(follow_symlinks=False).st_mtime > stale_temp_s
    except FileNotFoundError:
        return None         # renamed into place meanwhile


def _remove_if_leftover(entry: os.DirEntry, now: float, stale_temp_s: float, out: ScanResult) -> None:
    """Delete a leftover temporary file (``temp_is_leftover``); count a live writer's."""
    leftover = temp_is_leftover(entry, now, stale_temp_s)
    if leftover is None:
        return
    if not leftover:
        out.live_temps += 1
        return
    try:
        os.unlink(entry.path)
        out.leftover_temps += 1
    except FileNotFoundError:
        pass
    except OSError:
        out.delete_errors += 1


def scan(layout: Layout, stale_temp_s: float) -> ScanResult:
    """Every block file of the namespace (names and ``stat`` only) and leftover temporary files
    deleted. Bounded: one pass over at most 256 folders. Symbolic links and other non-regular
    files are never taken for blocks (a link could point anywhere)."""
    t0 = time.perf_counter()
    out = ScanResult()
    now = time.time()
    try:
        folders = [e for e in os.scandir(layout.namespace) if len(e.name) == 2 and _HEX.issuperset(e.name)
                   and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        out.elapsed_s = time.perf_counter() - t0
        return out
    name_len, suffix_len = layout.name_len, len(BLOCK_SUFFIX)
    add, total, is_regular, fromhex = out.blocks.append, 0, stat.S_ISREG, bytes.fromhex
    for folder in folders:
        try:
            entries = os.scandir(folder.path)
        except FileNotFoundError:
            continue        # removed by a concurrent clear
        prefix = folder.name
        with entries:
            # The hot loop of an open (100,000 files in well under a second): inline checks, one stat each.
            for entry in entries:
                name = entry.name
                if len(name) == name_len and name.endswith(BLOCK_SUFFIX) and name.startswith(prefix):
                    digits = name[:-suffix_len]
                    try:
                        block_hash = fromhex(digits)
                    except ValueError:
                        block_hash = None
                    # fromhex also takes upper case and spaces: only the names block_path makes count
                    if block_hash is not None and len(block_hash) == layout.hash_size and block_hash.hex() == digits:
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue        # evicted by another process meanwhile
                        if is_regular(st.st_mode):
                            add((st.st_mtime_ns, block_hash, st.st_size))
                            total += st.st_size
                            continue
                elif name.endswith(TEMP_SUFFIX):
                    _remove_if_leftover(entry, now, stale_temp_s, out)
                    continue
                out.unknown_files += 1
    out.total_bytes = total
    out.elapsed_s = time.perf_counter() - t0
    return out


class Ledger:
    """The namespace's shared byte count and lock (see the module docstring).

    ``writable`` is False where the ledger cannot be opened for writing (a read-only
    disk or directory): the store then serves what is there and drops every write."""

    def __init__(self, layout: Layout | str, read_only: bool = False) -> None:
        namespace = layout if isinstance(layout, str) else layout.namespace    # a path: operators (disk_admin)
        self.path = os.path.join(namespace, LEDGER_NAME)
        self.open_error: OSError | None = None
        self.used = 0
        if read_only:       # an operator's look (tier stats): nothing made, nothing locked or written
            self.writable = False
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError as exc:
                self.open_error, self._fd = exc, -1
            return
        try:
            os.makedirs(namespace, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            self.writable = True
        except OSError as exc:
            self.open_error = exc
            self.writable = False
            try:
                self._fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                self._fd = -1

    def read(self) -> int | None:
        """The recorded byte count, or None where the ledger is missing or damaged."""
        return self._read_record(0)

    def read_capacity(self) -> int | None:
        """``capacity_bytes`` of the store that last opened the namespace (None: never recorded)."""
        return self._read_record(_LEDGER.size)

    def write_capacity(self, capacity_bytes: int) -> None:
        """Record this store's capacity for operators (``prefixkv tier stats``): a second record after
        the byte count, which older readers never look at. Processes sharing a namespace may give
        different capacities: each evicts to its own, the record says the last opener's."""
        if self.writable:
            self._write(capacity_bytes, _LEDGER.size)

    def _read_record(self, offset: int) -> int | None:
        if self._fd < 0:
            return None
        try:
            raw = os.pread(self._fd, _LEDGER.size, offset)
        except OSError:
            return None
        if len(raw) != _LEDGER.size:
            return None
        value, check = _LEDGER.unpack(raw)
        return value if check == xxhash.xxh3_64_intdigest(raw[:8]) else None

    @contextlib.contextmanager
    def locked(self):
        """Hold the namespace's lock; ``self.used`` is the recorded count on entry (None: recount
        with ``scan``) and is written back on exit. Only the writer thread, a store's open and
        ``clear`` (``disk_admin``) take it: the read path never waits for another process."""
        if self._fd < 0:
            self.used = None
            yield self
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            self.used = before = self.read()
            try:
                yield self
            finally:
                # also when the body failed midway: the evictions it did are on disk, so on the ledger
                if self.writable and self.used is not None and self.used != before:
                    self._write(self.used)
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)

    def _write(self, used: int, offset: int = 0) -> None:
        head = struct.pack("<Q", max(0, used))
        try:
            os.pwrite(self._fd, head + struct.pack("<Q", xxhash.xxh3_64_intdigest(head)), offset)
        except OSError:
            pass        # a disk gone read-only: the next scan under the lock recounts

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
