"""Host memory a size would need, refused up front instead of found out by the OOM killer.

A user who types tokens where blocks are meant (``--capacity 1000000000``) or a pool
in the wrong unit asks the manager to track billions of blocks; the process then dies
after a minute with nothing said. Commands estimate the bookkeeping first and say
what it would take.
"""

from __future__ import annotations

import os

from .sizing import format_size

# Host bytes the manager keeps per pool block, measured with tracemalloc at 10^6 blocks:
# 88 B for an empty pool, about 258 B once every block is cached. The bound uses the latter.
MANAGER_BYTES_PER_BLOCK = 260


class TooLarge(ValueError):
    """A size whose bookkeeping cannot fit in this machine's memory."""


# Where the kernel reports memory; module attributes so tests can point them at fixtures.
MEMINFO = "/proc/meminfo"
CGROUP_ROOT = "/sys/fs/cgroup"      # inside a container: the container's own cgroup
# (limit, usage, memory.stat, inactive file cache's key) for cgroup v2, then v1
_CGROUP_FILES = (("memory.max", "memory.current", "memory.stat", "inactive_file"),
                 ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes", "memory/memory.stat",
                  "total_inactive_file"))


def _read(path: str) -> str:
    with open(path, encoding="ascii") as f:
        return f.read()


def _cgroup_room() -> int | None:
    """Bytes this process's memory cgroup can still take, or None without a limit. A container's
    limit is what its OOM killer enforces, while MemAvailable reports the whole host's memory."""
    for limit_file, usage_file, stat_file, inactive_key in _CGROUP_FILES:
        try:
            text = _read(os.path.join(CGROUP_ROOT, limit_file)).strip()
            if text == "max":
                return None
            limit = int(text)
            usage = int(_read(os.path.join(CGROUP_ROOT, usage_file)))
        except (OSError, ValueError):
            continue
        if limit >= 1 << 60:            # v1 writes "no limit" as a page-rounded 2^63 - 1
            return None
        inactive = 0
        try:
            for line in _read(os.path.join(CGROUP_ROOT, stat_file)).splitlines():
                key, _, value = line.partition(" ")
                if key == inactive_key:
                    inactive = int(value)
        except (OSError, ValueError):
            pass
        # usage counts page cache the kernel reclaims before it kills anything (as docker stats does)
        return max(limit - max(usage - inactive, 0), 0)
    return None


def available_bytes() -> int:
    """Memory that can be allocated without swapping or the OOM killer: the kernel's
    ``MemAvailable`` (or the physical memory where /proc is missing), capped by what this
    process's memory cgroup (a container's limit) has left."""
    have = None
    try:
        with open(MEMINFO, encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if have is None:
        try:
            have = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (OSError, ValueError, AttributeError):
            have = 1 << 62
    room = _cgroup_room()
    return have if room is None else min(have, room)


def require(needed: int, what: str, *, fraction: float = 0.8) -> None:
    """Refuse ``what`` (``TooLarge``) when ``needed`` bytes exceed ``fraction`` of the available memory."""
    have = available_bytes()
    if needed > fraction * have:
        raise TooLarge(f"{what} needs about {format_size(needed)} of host memory; "
                       f"{format_size(have)} is available")


def require_blocks(num_blocks: int, what: str) -> None:
    require(num_blocks * MANAGER_BYTES_PER_BLOCK, f"{what} ({num_blocks:,} blocks of bookkeeping at "
                                                  f"~{MANAGER_BYTES_PER_BLOCK} B each)")
