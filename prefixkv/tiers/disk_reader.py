"""Reading and verifying a run of block files in chain order, reading ahead only when the page cache is cold.

``RunReader(paths, window, sizes=None)`` hands out, in order, each file's whole contents
(``bytes``) or ``"miss"`` (no such file) / ``"error"`` (a symbolic link, no permission, an I/O
error). The file last handed out stays open until the next ``read`` so that ``identity()`` can
say which file it was (``(inode, size, mtime ns)``: what the writer checks before deleting a
refused value); only a refused value needs it, so a served one costs no ``fstat``.

Each file is read with one ``read`` of its expected size + 1 (``sizes[i]``, the index's; an
unknown size is ``fstat``ed): a shorter result is the whole file (a truncated one is refused by
``decode``), a full one means the file is bigger than the index thought and it is read again
whole at its ``fstat`` size. One descriptor per file and block files are only ever renamed
into place, never written in place, so a value is always one complete file: a file replaced
after it was opened is still read as the old one, whole.

Read-ahead: on a warm page cache every syscall counts (on this VM ``posix_fadvise`` is ~3 us,
``fstat`` ~1.5 us, against ~26 us for the read itself), so the reader starts with one open
file at a time and no advice. Every ``window``-th file it asks the kernel whether the file's
first byte is cached (a 1-byte ``preadv`` with ``RWF_NOWAIT``: ``EAGAIN`` when it is not, and
the kernel starts reading it in). Once one is not, it switches to reading ahead: up to
``window`` files open ahead, each advised ``POSIX_FADV_WILLNEED``, so the disk reads the next
files while the caller verifies this one; it keeps asking every ``window``-th file and goes
back to one file at a time when one is cached. Where ``RWF_NOWAIT`` is not supported (tmpfs,
some network filesystems) it always reads ahead (nothing tells warm from cold there).
``window`` 1 never reads ahead; ``assume_cold`` reads ahead throughout without asking. A file
opened ahead stays readable if another process evicts it meanwhile (an open descriptor keeps
the complete old file); one evicted before it is opened is a miss. Bounded: at most ``window``
+ 1 descriptors are open at once, and ``close()`` (or the ``with`` block) closes them when a
run stops early.

``load(paths, sizes, keys, parents, contents, fingerprint, window)`` reads and decodes
consecutive blocks (``block_codec.decode`` against each block's hash, its parent and its
content), stopping at the first that is not served. On the caller's thread: two reader
threads, measured, were slower than one on this 2-core machine (per-thread malloc arenas
page-fault, the GIL is contended), though the reads and xxh3 release the GIL.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Sequence

from .block_codec import decode
from .fingerprint import Fingerprint

__all__ = ["RunReader", "load", "READ_FLAGS"]

# O_NOFOLLOW: a block name that is a symbolic link could point anywhere; it is an error, never read.
READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_WILLNEED = getattr(os, "POSIX_FADV_WILLNEED", None)
_NOWAIT = getattr(os, "RWF_NOWAIT", None)


class RunReader:
    def __init__(self, paths: Sequence[str], window: int, sizes: Sequence[int | None] | None = None,
                 assume_cold: bool = False) -> None:
        self._paths = paths
        self._sizes = sizes
        self._window = window
        self._ahead: deque = deque()      # (position, descriptor or "miss" / "error") of files opened ahead
        self._next = 0                    # position of the next file to open
        self._fd = -1                     # the file last handed out (for identity()), closed at the next read
        self._advise = window > 1 and _WILLNEED is not None
        self._probe = self._advise and _NOWAIT is not None and not assume_cold
        self.reading_ahead = self._advise and not self._probe    # no way to ask: read ahead throughout
        self.read_ahead = self.reading_ahead  # whether this run read ahead at all (the store counts it)
        self._byte = bytearray(1)

    # -- the page cache -----------------------------------------------------------------
    def _cached(self, fd: int, position: int) -> bool:
        """Whether the file's first byte is in the page cache (False when that cannot be asked)."""
        # The first byte, not the last: a probe that misses starts reading in where it asked, and
        # from the start that is the read the advice and the read itself continue (cold fetches
        # measured slower when the last byte was asked).
        try:
            os.preadv(fd, [self._byte], 0, _NOWAIT)
        except BlockingIOError:
            return False
        except OSError:
            self._probe = False           # EOPNOTSUPP (tmpfs): read ahead from now on
            self.reading_ahead = self.read_ahead = True
            return False
        return True

    def _advise_ahead(self, fd: int, position: int) -> None:
        # Asked every window-th file only, as on the warm path: a probe before every advice made
        # cold fetches measurably slower.
        if self._probe and position % self._window == 0 and self._cached(fd, position):
            self.reading_ahead = False       # warm again: the files already open drain first
            return
        try:
            os.posix_fadvise(fd, 0, 0, _WILLNEED)
        except OSError:
            pass          # advice only

    def _open(self, position: int):
        try:
            return os.open(self._paths[position], READ_FLAGS)
        except FileNotFoundError:
            return "miss"
        except OSError:
            return "error"

    def _fill(self) -> None:
        paths, ahead = self._paths, self._ahead
        while self.reading_ahead and len(ahead) < self._window and self._next < len(paths):
            position = self._next
            self._next += 1
            fd = self._open(position)
            ahead.append((position, fd))        # first: close() closes it whatever happens next
            if not isinstance(fd, str):
                self._advise_ahead(fd, position)

    # -- reads ------------------------------------------------------------------------------
    def read(self):
        """The next file's whole contents (``bytes``), or ``"miss"`` / ``"error"``."""
        # The warm path (no file ahead, no advice): open, one read, and a 1-byte probe every
        # ``window``-th file; the descriptor is closed at the next call (identity() may need it).
        fd = self._fd
        if fd >= 0:
            self._fd = -1
            os.close(fd)
        if self.reading_ahead or self._ahead:
            return self._read_ahead()
        position = self._next
        self._next = position + 1
        try:
            fd = os.open(self._paths[position], READ_FLAGS)
        except FileNotFoundError:
            return "miss"
        except OSError:
            return "error"
        self._fd = fd
        if self._probe and position % self._window == 0 and not self._cached(fd, position):
            self.reading_ahead = self.read_ahead = True     # gone cold: advise the files after this one
            self._fill()
        return _read_whole(fd, None if self._sizes is None else self._sizes[position])

    def _read_ahead(self):
        self._fill()
        position, fd = self._ahead.popleft()
        if isinstance(fd, str):
            return fd
        self._fd = fd
        return _read_whole(fd, None if self._sizes is None else self._sizes[position])

    def identity(self) -> tuple | None:
        """``(inode, size, mtime ns)`` of the file last read (None when it cannot be told)."""
        try:
            st = os.fstat(self._fd)
        except OSError:
            return None
        return st.st_ino, st.st_size, st.st_mtime_ns

    def _release(self) -> None:
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)

    def close(self) -> None:
        self._release()
        while self._ahead:
            _, fd = self._ahead.popleft()
            if not isinstance(fd, str):
                os.close(fd)

    def __enter__(self) -> "RunReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_whole(fd: int, size: int | None):
    """The file's contents in one ``read`` of ``size`` + 1 bytes (``fstat`` when ``size`` is None, or
    when the file proves bigger: then read again whole), or ``"error"``."""
    try:
        if size is None:
            size = os.fstat(fd).st_size
        value = os.read(fd, size + 1)
        if len(value) > size:
            value = os.pread(fd, os.fstat(fd).st_size + 1, 0)
    except OSError:
        return "error"
    return value


def load(paths: Sequence[str], sizes: Sequence[int | None] | None, keys: Sequence[bytes],
         parents: Sequence[bytes], contents, fingerprint: Fingerprint,
         window: int, into=None) -> tuple[list, list, object, object, bool]:
    """``(payloads, file sizes, stop, identity, read ahead)``: the verified payloads of the leading
    served blocks, the sizes of their files, where it stopped (None: every block served;
    ``"miss"``, ``"error"``, or the ``Reject`` with the refused file's identity), and whether the
    run read ahead (found the page cache cold). ``into(j, payload)``: each verified payload is
    handed over as soon as it is verified (while its bytes are still in the CPU's cache) and not
    kept: ``payloads`` then holds None for each."""
    payloads: list = []
    served: list = []
    append, served_size = payloads.append, served.append
    with RunReader(paths, window, sizes) as reader:
        read = reader.read
        for j, key in enumerate(keys):
            value = read()
            if value.__class__ is str:           # "miss" / "error"
                return payloads, served, value, None, reader.read_ahead
            result = decode(value, fingerprint, key, parents[j], None if contents is None else contents[j])
            if result.__class__ is not memoryview:
                return payloads, served, result, reader.identity(), reader.read_ahead
            if into is not None:
                into(j, result)
                result = None
            append(result)
            served_size(len(value))
        return payloads, served, None, None, reader.read_ahead
