"""Operator calls on a disk store's directory, without a fingerprint or a running store: what
``prefixkv tier stats|clear`` do for a disk path.

* ``namespaces(root) -> list[str]``: the fingerprint namespaces under ``root`` (folders named by
  32 lower-case hex digits holding a ``usage`` ledger, ``disk_layout``). Refuses, by an
  ``InvalidArgument`` naming ``path``, a path that is missing, not a directory, unreadable, or
  holds no namespace ("not a prefixkv disk store": an operator's typo never reads as an empty store).
* ``survey(root, name) -> Survey``: one namespace's block files and bytes, the ledger's count,
  the capacity the last store opened with, temporary files (leftovers of dead writers, writes
  in progress) and files the store never writes. Reads names and ``stat`` only; changes nothing
  (an open of the store deletes leftovers, this does not).
* ``clear(root, name=None) -> Cleared``: under each namespace's lock (the ledger's ``flock``, the
  one every writer takes), delete its block files and its dead writers' temporary files, and set
  its ledger to what is left. Files the store never writes (an operator's note, a symbolic
  link named like a block), writes in progress, the ledger and the folders are left alone.
  Every namespace's permissions are checked before any file is deleted.

A block file's name is its hash in hex; without the fingerprint the hash length is not known,
so a name counts as a block of any registered hash algorithm's length (8 or 16 bytes).
"""

from __future__ import annotations

import os
import re
import stat
import time
from dataclasses import dataclass

from ..checks import seconds
from ..errors import InvalidArgument
from ..hashing import HASH_ALGORITHMS
from .disk_layout import BLOCK_SUFFIX, LEDGER_NAME, TEMP_SUFFIX, Ledger, temp_is_leftover

__all__ = ["namespaces", "is_namespace", "survey", "clear", "clear_namespace", "Survey", "Cleared", "STALE_TEMP_S"]

_NAMESPACE = re.compile(r"^[0-9a-f]{32}$")
_FANOUT = re.compile(r"^[0-9a-f]{2}$")
_HEX_LENGTHS = frozenset(2 * size for _, size in HASH_ALGORITHMS.values())
STALE_TEMP_S = 60.0      # DiskStoreConfig.stale_temp_s's default: the same rule as a store's open


@dataclass(frozen=True, slots=True)
class Survey:
    """One namespace as found on disk (see the module docstring)."""

    fingerprint: str
    blocks: int
    bytes: int                    # of block files, as ``stat`` says
    ledger_bytes: int | None      # what the shared ledger records (None: missing or damaged)
    capacity_bytes: int | None    # the last opener's ``capacity_bytes`` (None: never recorded)
    leftover_temps: int           # temporary files of dead or stuck writers (an open deletes them)
    live_temps: int               # writes in progress
    unknown_files: int            # names the store never writes

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in self.__slots__}


@dataclass(frozen=True, slots=True)
class Cleared:
    blocks: int = 0               # block files deleted
    bytes: int = 0
    leftover_temps: int = 0       # dead writers' temporary files deleted
    failed: int = 0               # files that could not be deleted (one gone already is not a failure)


def _is_block_name(name: str, folder: str) -> bool:
    digits = name[:-len(BLOCK_SUFFIX)]
    return (name.endswith(BLOCK_SUFFIX) and len(digits) in _HEX_LENGTHS and digits.startswith(folder)
            and _is_hex(digits))


def _is_hex(text: str) -> bool:
    try:
        return bytes.fromhex(text).hex() == text     # lower case, no spaces: only names block_path makes
    except ValueError:
        return False


def _listing_error(root: str, exc: OSError) -> InvalidArgument:
    if isinstance(exc, FileNotFoundError):
        return InvalidArgument("path", f"{root}: no such directory")
    if isinstance(exc, NotADirectoryError):
        return InvalidArgument("path", f"{root}: not a directory")
    if isinstance(exc, PermissionError):
        return InvalidArgument("path", f"{root}: permission denied ({exc.filename or root})")
    return InvalidArgument("path", f"{root}: cannot be read ({exc.strerror or exc})")


def is_namespace(root: str, name: str) -> bool:
    """Whether ``root/name`` is a fingerprint namespace: 32 hex digits, a folder, a ``usage`` ledger."""
    if not _NAMESPACE.match(name):
        return False
    try:
        folder = os.stat(os.path.join(root, name), follow_symlinks=False)
        ledger = os.stat(os.path.join(root, name, LEDGER_NAME), follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISDIR(folder.st_mode) and stat.S_ISREG(ledger.st_mode)


def namespaces(root: str) -> list[str]:
    """The fingerprint namespaces under ``root``, sorted (see the module docstring)."""
    try:
        found = [entry.name for entry in os.scandir(root) if is_namespace(root, entry.name)]
    except OSError as exc:
        raise _listing_error(root, exc) from None
    if not found:
        raise InvalidArgument("path", f"{root}: not a prefixkv disk store (no fingerprint namespace: a folder "
                                      f"named by 32 hex digits holding a '{LEDGER_NAME}' ledger)")
    return sorted(found)


def _fanout_folders(namespace: str) -> list[os.DirEntry]:
    return [e for e in os.scandir(namespace) if _FANOUT.match(e.name) and e.is_dir(follow_symlinks=False)]


def _checked_name(name):
    if not isinstance(name, str) or not _NAMESPACE.match(name):
        raise InvalidArgument("name", f"expected a fingerprint's 32 lower-case hex digits, got {name!r}")
    return name


def survey(root: str, name: str, stale_temp_s: float = STALE_TEMP_S) -> Survey:
    stale_temp_s = seconds("stale_temp_s", stale_temp_s)
    namespace = os.path.join(root, _checked_name(name))
    blocks = total = leftover = live = unknown = 0
    now = time.time()
    try:
        for folder in _fanout_folders(namespace):
            with os.scandir(folder.path) as entries:
                for entry in entries:
                    if _is_block_name(entry.name, folder.name):
                        try:
                            st = entry.stat(follow_symlinks=False)
                        except FileNotFoundError:
                            continue            # evicted meanwhile
                        if stat.S_ISREG(st.st_mode):
                            blocks += 1
                            total += st.st_size
                            continue
                    elif entry.name.endswith(TEMP_SUFFIX):
                        state = temp_is_leftover(entry, now, stale_temp_s)
                        leftover += state is True
                        live += state is False
                        continue
                    unknown += 1
        ledger = Ledger(namespace, read_only=True)
        try:
            used, capacity = ledger.read(), ledger.read_capacity()
        finally:
            ledger.close()
    except OSError as exc:
        raise _listing_error(root, exc) from None
    return Survey(name, blocks, total, used, capacity, leftover, live, unknown)


def _check_writable(root: str, namespace: str) -> None:
    """Deleting needs write and search permission on every fan-out folder and the ledger's read-write
    open (for its lock): all checked before any namespace is touched."""
    folders = [namespace, *(f.path for f in _fanout_folders(namespace))]
    for folder in folders:
        if not os.access(folder, os.W_OK | os.X_OK):
            raise InvalidArgument("path", f"{root}: permission denied (cannot delete files in {folder})")
    ledger = os.path.join(namespace, LEDGER_NAME)
    if not os.access(ledger, os.R_OK | os.W_OK):
        raise InvalidArgument("path", f"{root}: permission denied (cannot lock the ledger {ledger})")


def clear(root: str, name: str | None = None, stale_temp_s: float = STALE_TEMP_S) -> Cleared:
    """Delete the block files of every namespace under ``root``, or of namespace ``name`` only (none
    deleted where it does not exist); see the module docstring."""
    stale_temp_s = seconds("stale_temp_s", stale_temp_s)
    if name is not None:
        _checked_name(name)
    names = namespaces(root)
    if name is not None:
        names = [n for n in names if n == name]
    try:
        for n in names:
            _check_writable(root, os.path.join(root, n))
    except OSError as exc:
        raise _listing_error(root, exc) from None
    cleared = [clear_namespace(os.path.join(root, n), stale_temp_s) for n in names]
    return Cleared(*(sum(getattr(c, f) for c in cleared) for f in Cleared.__slots__))


def clear_namespace(namespace: str, stale_temp_s: float = STALE_TEMP_S, ledger: Ledger | None = None) -> Cleared:
    """Under the namespace's lock, delete its block files and dead writers' temporary files and set
    the ledger to the bytes left. ``ledger``: a running store's own (``DiskBlockStore.clear``), used
    instead of a second descriptor on the same file; otherwise one is opened (a namespace whose
    ledger cannot be opened is cleared without the lock, as far as permissions allow)."""
    stale_temp_s = seconds("stale_temp_s", stale_temp_s)
    held = ledger if ledger is not None else Ledger(namespace)
    try:
        with held.locked() as locked:
            blocks, total, leftover, failed, left = _delete_blocks(namespace, stale_temp_s)
            locked.used = left         # bytes of block files left: none unless a deletion failed
    finally:
        if held is not ledger:
            held.close()
    return Cleared(blocks, total, leftover, failed)


def _delete_blocks(namespace: str, stale_temp_s: float) -> tuple[int, int, int, int, int]:
    """(blocks deleted, their bytes, leftover temporaries deleted, failures, bytes of blocks left)."""
    blocks = total = leftover = failed = left = 0
    now = time.time()
    for folder in _fanout_folders(namespace):
        with os.scandir(folder.path) as entries:
            for entry in entries:
                is_block = _is_block_name(entry.name, folder.name)
                if is_block:
                    try:
                        st = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    if not stat.S_ISREG(st.st_mode):
                        continue          # a link named like a block: not the store's, left alone
                elif not (entry.name.endswith(TEMP_SUFFIX) and temp_is_leftover(entry, now, stale_temp_s)):
                    continue              # an operator's file, a write in progress
                try:
                    os.unlink(entry.path)
                except FileNotFoundError:
                    continue              # another process evicted or deleted it first
                except OSError:
                    failed += 1
                    if is_block:
                        left += st.st_size
                    continue
                if is_block:
                    blocks += 1
                    total += st.st_size
                else:
                    leftover += 1
    return blocks, total, leftover, failed, left
