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


def available_bytes() -> int:
    """Memory the kernel says can be allocated without swapping (``MemAvailable``), or the
    physical memory where /proc is missing."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return 1 << 62


def require(needed: int, what: str, *, fraction: float = 0.8) -> None:
    """Refuse ``what`` (``TooLarge``) when ``needed`` bytes exceed ``fraction`` of the available memory."""
    have = available_bytes()
    if needed > fraction * have:
        raise TooLarge(f"{what} needs about {format_size(needed)} of host memory; "
                       f"{format_size(have)} is available")


def require_blocks(num_blocks: int, what: str) -> None:
    require(num_blocks * MANAGER_BYTES_PER_BLOCK, f"{what} ({num_blocks:,} blocks of bookkeeping at "
                                                  f"~{MANAGER_BYTES_PER_BLOCK} B each)")
