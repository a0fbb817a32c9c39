"""Output files of the command line: checked before the work, written whole or not at all.

A sweep or a benchmark can run for minutes; a bad ``--plot`` path or a missing
matplotlib must stop it before the first cell, not discard its results after the
last. Files are written to a temporary name beside the target and renamed into
place, so an interrupt or a failed write never leaves a partial file behind.
"""

from __future__ import annotations

import contextlib
import os
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


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike) -> Iterator[Path]:
    """A temporary path beside ``target``, renamed onto it when the block succeeds and removed
    when it fails or is interrupted."""
    target = Path(target)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=target.suffix or ".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
