"""What a block store's fetch returns, the same for every store (Redis, disk), so a tier and
an engine's storage backend read any of them alike."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Fetched"]


@dataclass(slots=True)
class Fetched:
    """Verified payloads of consecutive blocks from the first asked for.

    ``stop`` says why it ended early: None (all requested blocks), ``"miss"`` (absent),
    ``"error"`` (network, server, breaker, or an unreadable file), or the ``Reject`` of a
    refused value."""

    payloads: list
    stop: object = None

    @property
    def count(self) -> int:
        return len(self.payloads)
