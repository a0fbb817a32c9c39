"""Rich consoles for the command line that never cut a table short.

On a terminal rich wraps to its width. Written to a pipe, a file or a CI log
it would assume 80 columns and truncate cells (digits included), so off a
terminal the width is large enough for any of our tables (``COLUMNS`` can
still ask for more).
"""

from __future__ import annotations

import os

OFF_TERMINAL_WIDTH = 240


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun`` as a sentence says it: "1 request", "2 requests", "1,000 requests"."""
    return f"{n:,} {noun if n == 1 else (plural or noun + 's')}"


def make_console(stderr: bool = False):
    from rich.console import Console

    console = Console(stderr=stderr)
    if not console.is_terminal:
        wanted = os.environ.get("COLUMNS", "")
        width = max(OFF_TERMINAL_WIDTH, int(wanted) if wanted.isdigit() else 0)
        console = Console(stderr=stderr, width=width)
    return console
