"""Reading and verifying a run of block files in chain order, the next few already on their way.

``RunReader(paths, window)`` hands out, in order, each file's whole contents and identity
(``(inode, size, mtime ns)``: what the writer checks before deleting a refused value) or
``"miss"`` (no such file) / ``"error"`` (a symbolic link, no permission, an I/O error). It keeps
up to ``window`` files ahead open and tells the kernel to read them (``POSIX_FADV_WILLNEED``),
so on a cold page cache the disk reads the next files while the caller verifies this one;
on a warm cache that costs one syscall a file. A file opened ahead stays readable if another
process evicts it meanwhile (an open descriptor keeps the complete old file). Bounded: at most
``window`` descriptors are open at once, and ``close()`` (or the ``with`` block) closes them
when a run stops early.

``load(paths, keys, parents, contents, fingerprint, window)`` reads and decodes consecutive
blocks (``block_codec.decode`` against each block's hash, its parent and its content), stopping
at the first that is not served. On the caller's thread: two reader threads, measured, were
slower than one on this 2-core machine (per-thread malloc arenas page-fault, the GIL is
contended), though the reads and xxh3 release the GIL.
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


class RunReader:
    def __init__(self, paths: Sequence[str], window: int) -> None:
        self._paths = paths
        self._window = window
        self._ahead: deque = deque()      # descriptors (or "miss" / "error") of the next files, in order
        self._next = 0

    def _open_next(self) -> None:
        path = self._paths[self._next]
        self._next += 1
        try:
            fd = os.open(path, READ_FLAGS)
        except FileNotFoundError:
            self._ahead.append("miss")
            return
        except OSError:
            self._ahead.append("error")
            return
        if _WILLNEED is not None:
            try:
                os.posix_fadvise(fd, 0, 0, _WILLNEED)
            except OSError:
                pass          # advice only
        self._ahead.append(fd)

    def read(self):
        """The next file's ``(bytes, identity)``, or ``"miss"`` / ``"error"``."""
        while len(self._ahead) < self._window and self._next < len(self._paths):
            self._open_next()
        fd = self._ahead.popleft()
        if isinstance(fd, str):
            return fd
        try:
            st = os.fstat(fd)
            value = os.read(fd, st.st_size)
        except OSError:
            return "error"
        finally:
            os.close(fd)
        return value, (st.st_ino, st.st_size, st.st_mtime_ns)

    def close(self) -> None:
        while self._ahead:
            fd = self._ahead.popleft()
            if not isinstance(fd, str):
                os.close(fd)

    def __enter__(self) -> "RunReader":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load(paths: Sequence[str], keys: Sequence[bytes], parents: Sequence[bytes], contents, fingerprint: Fingerprint,
         window: int) -> list:
    """``(payload, identity)`` per block served, then at most one ``(why, identity or None)`` entry
    where it stopped: ``"miss"``, ``"error"`` or the ``Reject``."""
    out = []
    with RunReader(paths, window) as reader:
        for j, key in enumerate(keys):
            read = reader.read()
            if not isinstance(read, tuple):
                out.append((read, None))
                break
            value, identity = read
            result = decode(value, fingerprint, key, parents[j], None if contents is None else contents[j])
            out.append((result, identity))
            if not isinstance(result, memoryview):
                break
    return out

