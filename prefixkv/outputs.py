"""Output files of the command line: checked before the work, written whole or not at all.

A sweep or a benchmark can run for minutes; a bad ``--plot`` path or a missing
matplotlib must stop it before the first cell, not discard its results after the
last. Files are written to a temporary name beside the target and renamed into
place, so an interrupt or a failed write never leaves a partial file behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import tempfile
from pathlib import Path
from typing import Iterator

IMAGE_SUFFIXES = (".png", ".svg", ".pdf", ".jpg", ".jpeg")


class OutputError(ValueError):
    """An output path or an optional dependency that cannot serve the command."""


def require_matplotlib(option: str) -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise OutputError(f"{option} needs matplotlib, which is not installed: pip install 'prefixkv[plot]'") from None


def _check_writable_dir(directory: Path, option: str) -> None:
    if not directory.exists():
        raise OutputError(f"{option}: directory {directory} does not exist")
    if not directory.is_dir():
        raise OutputError(f"{option}: {str(directory)!r} is not a directory")
    try:  # a real write: permission bits say nothing for root, or on read-only mounts
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".prefixkv-probe-"):
            pass
    except OSError as exc:
        raise OutputError(f"{option}: cannot write into {str(directory)!r} ({exc.strerror or exc})") from None


def plot_file(path: str | os.PathLike, option: str = "--plot") -> Path:
    """The image file ``--plot PATH`` will write (``.png`` added when PATH has no image suffix),
    after checking matplotlib and that the file can be written there."""
    if not os.fspath(path):
        raise OutputError(f"{option} needs a file name, got ''")
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{option} {str(path)!r} is a directory; give a file name, e.g. {str(target / 'plot.png')!r}")
    if target.suffix.lower() not in IMAGE_SUFFIXES:
        target = target.with_name(target.name + ".png")
        if target.is_dir():
            raise OutputError(f"{option}: {str(target)!r} is a directory")
    require_matplotlib(option)
    _check_writable_dir(target.parent, option)
    return target


def plot_dir(path: str | os.PathLike, option: str = "--plot") -> Path:
    """A directory ``--plot DIR`` will write images into (created when its parent exists)."""
    if not os.fspath(path):       # Path('') is the current directory: an empty variable, not a choice
        raise OutputError(f"{option} needs a directory name, got ''")
    target = Path(path)
    if target.exists() and not target.is_dir():
        raise OutputError(f"{option} {str(path)!r}: it exists and is not a directory")
    require_matplotlib(option)
    _check_writable_dir(target if target.exists() else target.parent, option)
    return target


def data_file(path: str | os.PathLike, *, force: bool, option: str = "--out") -> Path:
    """A data file (a trace) to create: never replaces an existing file unless ``force``."""
    target = Path(path)
    if target.is_dir():
        raise OutputError(f"{option} {str(path)!r} is a directory")
    if target.exists() and not force:
        raise OutputError(f"{option} {str(path)!r} exists; pass --force to replace it")
    _check_writable_dir(target.parent, option)
    return target


def _create_beside(target: Path) -> tuple[str, int]:
    """An empty new file beside ``target``, and the mode the finished file gets: the target's own
    when it exists, else what a plain ``open(target, "w")`` gives (0666 less the umask; mkstemp's
    0600 renamed into place left plots and traces unreadable to anyone else)."""
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode)
    except OSError:
        mode = None
    suffix = target.suffix or ".tmp"
    for _ in range(100):
        tmp = os.path.join(target.parent, f".{target.name}.{secrets.token_hex(6)}{suffix}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue
        try:
            if mode is None:     # the kernel applied the umask: read it back rather than set it to read it
                mode = stat.S_IMODE(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        return tmp, mode
    raise FileExistsError(f"no free temporary name beside {target}")


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``target``, renamed onto it when the block succeeds and removed
    when it fails or is interrupted."""
    target = Path(target)
    tmp, mode = _create_beside(target)
    try:
        yield Path(tmp)
        os.chmod(tmp, mode)      # also when the writer put its own file at ``tmp``
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
