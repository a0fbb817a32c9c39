"""Ctrl-C held back while the engine changes its bookkeeping.

Python raises ``KeyboardInterrupt`` between any two bytecodes of the main thread. Raised inside the
manager's or the scheduler's bookkeeping (a ``free`` half done, a request queued but not yet
recorded), it leaves state that no cleanup can read back: the error the cleanup then meets (a
``KeyError``, an ``InvariantViolation``) replaces the interrupt. So the engine runs its
state changes under ``held()``: a SIGINT arriving there is recorded and delivered (the handler
that was installed is called, Python's default raising ``KeyboardInterrupt``) when the outermost
``held()`` ends, once the state is whole again. ``let_through()`` inside it opens a window where
an interrupt is delivered at once (and one recorded earlier is delivered on entry): the executor's
forward, whose failure the scheduler already handles as a failed step. The handler held() installs
stays in place across let_through() windows and reads which mode it is in when it runs, so no
signal is lost between the two.

Only the main thread receives signals and may install handlers: in other threads, and when
SIGINT is not handled by a Python function (``SIG_IGN``, ``SIG_DFL``, or a handler installed
outside Python), both are no-ops. An outermost held() costs two ``signal.signal`` calls; nested
ones and let_through() none.
"""

from __future__ import annotations

import contextlib
import signal
import threading


class _Held:
    depth = 0                 # nesting of held() sections in the main thread
    previous = None           # the handler held() replaced
    pending = None            # (signum, frame) of a SIGINT that arrived while held
    open = False              # inside let_through(): deliver at once


_STATE = _Held()


def _on_sigint(signum, frame) -> None:
    """The handler while held: record the signal, or deliver it at once inside ``let_through()``.
    It reads the state when it runs, so switching between the two never calls ``signal.signal``
    (a signal arriving mid-switch is never lost)."""
    state = _STATE
    if state.open:
        state.previous(signum, frame)
    elif state.pending is None:
        state.pending = (signum, frame)


def _take_pending():
    pending, _STATE.pending = _STATE.pending, None
    return pending


@contextlib.contextmanager
def held():
    """Hold SIGINT back for the block; deliver one that arrived when the outermost block ends."""
    state = _STATE
    if state.depth == 0:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        current = signal.getsignal(signal.SIGINT)
        if not callable(current) or current is _on_sigint:
            yield
            return
        state.previous, state.pending, state.open = current, None, False
        signal.signal(signal.SIGINT, _on_sigint)
    was_open, state.open = state.open, False
    state.depth += 1
    try:
        yield
    finally:
        state.depth -= 1
        state.open = was_open
        if state.depth == 0:
            previous = state.previous
            signal.signal(signal.SIGINT, previous)
            state.previous = None
            pending = _take_pending()
            if pending is not None:
                previous(*pending)
        elif was_open and state.pending is not None:     # back in a let_through() window
            state.previous(*_take_pending())


@contextlib.contextmanager
def let_through():
    """Inside ``held()``: interrupts are delivered at once for the block (one already recorded, on
    entry); held back again after it. Outside ``held()``: nothing changes."""
    state = _STATE
    if state.depth == 0 or state.open or threading.current_thread() is not threading.main_thread():
        yield
        return
    try:
        state.open = True
        pending = _take_pending()
        if pending is not None:
            state.previous(*pending)
        yield
    finally:
        state.open = False
