"""Typed errors. Every operation that raises one of these has changed nothing."""

from __future__ import annotations


class PrefixKVError(Exception):
    """Base class for every error prefixkv raises on purpose."""


class OutOfBlocks(PrefixKVError):
    """An allocation cannot be satisfied right now; the pool is unchanged.

    ``needed`` counts the blocks the operation would take out of the free pool
    (fresh blocks plus evictable cache hits it would pin); ``available`` is what
    the pool can hand out (uncached free blocks plus evictable cached blocks).
    """

    def __init__(self, needed: int, available: int, what: str = "allocation") -> None:
        self.needed = needed
        self.available = available
        self.what = what
        super().__init__(
            f"{what} needs {needed} free block(s) but only {available} can be freed "
            f"(uncached free + evictable cached)"
        )

    def __reduce__(self):
        # Rebuild from the constructor's arguments, so the error crosses process boundaries
        # (a worker's exception is pickled back to the parent) with its message and fields.
        return type(self), (self.needed, self.available, self.what)


class SequenceTooLong(OutOfBlocks):
    """The sequence needs more blocks than the whole pool holds: it can never fit."""

    def __init__(self, needed: int, capacity: int, what: str = "sequence") -> None:
        super().__init__(needed, capacity, what)
        self.capacity = capacity
        self.args = (
            f"{what} needs {needed} block(s) but the pool only has {capacity} in total",
        )

    def __reduce__(self):
        return type(self), (self.needed, self.capacity, self.what)


class UnknownSequence(PrefixKVError, KeyError):
    """The sequence id is not held by the manager (never admitted, or already freed)."""

    def __init__(self, seq_id: object, hint: str = "") -> None:
        self.seq_id = seq_id
        self.hint = hint
        super().__init__(f"unknown sequence {seq_id!r}{': ' + hint if hint else ''}")

    def __reduce__(self):
        return type(self), (self.seq_id, self.hint)

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0])


class SequencePreempted(PrefixKVError, ValueError):
    """The sequence is preempted (its blocks were given back): resume it before using it."""

    def __init__(self, seq_id: object) -> None:
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id!r} is preempted; resume it first")

    def __reduce__(self):
        return type(self), (self.seq_id,)


class DuplicateSequence(PrefixKVError, ValueError):
    """A sequence id that is already live was admitted or forked into again."""

    def __init__(self, seq_id: object) -> None:
        self.seq_id = seq_id
        super().__init__(f"sequence {seq_id!r} already exists; free it first or pick another id")

    def __reduce__(self):
        return type(self), (self.seq_id,)


class InvalidTokens(PrefixKVError, ValueError):
    """Token ids that cannot be encoded (negative, too large, not integers)."""


class PolicyError(PrefixKVError):
    """The eviction policy broke its contract (raised in ``evict()``, or returned a block that is
    not an evictable candidate). The pool stays consistent; the victims taken so far are freed."""


class CacheBusy(PrefixKVError):
    """The prefix cache cannot be reset while sequences hold blocks."""


class InvariantViolation(PrefixKVError, AssertionError):
    """``check_invariants`` found the pool's bookkeeping inconsistent (a bug or a leak)."""


class HashMismatch(PrefixKVError, ValueError):
    """Precomputed block hashes do not agree with the stated token count."""


class InvalidArgument(PrefixKVError, TypeError, ValueError):
    """An argument of the wrong type or value (a dict as a prompt, ``None`` as a sequence id,
    a string as a hash seed). ``argument`` names it; nothing was changed."""

    def __init__(self, argument: str, problem: str) -> None:
        self.argument = argument
        self.problem = problem
        super().__init__(f"{argument}: {problem}")

    def __reduce__(self):
        return type(self), (self.argument, self.problem)


class NoHostBlocks(PrefixKVError, ValueError):
    """``swap_out`` / ``swap_in`` on a manager built without host blocks (``num_host_blocks=0``)."""
