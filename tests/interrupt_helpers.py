"""Helpers of the interrupt tests: SIGINT delivered for real at chosen points, trial counts per
Hypothesis profile, and the consistency an interrupted engine must keep."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import sys
import threading

import prefixkv

PROFILE = os.environ.get("PREFIXKV_HYPOTHESIS_PROFILE", "ci")
PKG = os.path.dirname(prefixkv.__file__)


def trials(ci: int, *, quick: int = 3, long: int = 240) -> int:
    """The number of trials for the profile ``PREFIXKV_HYPOTHESIS_PROFILE`` names (as conftest reads it)."""
    return {"quick": quick, "ci": ci, "long": long}.get(PROFILE, ci)


class LineTrigger:
    """Raise SIGINT (``signal.raise_signal``: the installed handler runs as for a real Ctrl-C) at
    the ``at``-th line event executed in prefixkv's own code (in the files or folders ``within``
    names, relative to the package); ``at=None`` only counts them."""

    def __init__(self, at: int | None, within: tuple[str, ...] = ("",)) -> None:
        self.at = at
        self.within = tuple(os.path.join(PKG, part) for part in within)   # counted files, under prefixkv/
        self.count = 0
        self.fired = ""      # where it fired: file:line (thread)

    def _local(self, frame, event, arg):
        if event == "line":
            self.count += 1
            if self.count == self.at and not self.fired:
                self.fired = f"{frame.f_code.co_filename}:{frame.f_lineno} ({threading.current_thread().name})"
                signal.raise_signal(signal.SIGINT)
        return self._local

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename.startswith(self.within):
            return self._local
        return None

    def __enter__(self):
        sys.settrace(self._global)
        threading.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(None)
        threading.settrace(None)


@contextlib.contextmanager
def interrupts_python_may_swallow():
    """Python runs a signal handler at the next bytecode of the main thread, which may be inside a
    garbage-collector callback (Hypothesis registers one) or a finalizer; a ``KeyboardInterrupt``
    raised there is reported as unraisable and lost, whatever the engine does. For the block: no
    gc callbacks, and a list of the interrupts lost that way (a trial that lost one cannot raise)."""
    lost: list = []
    callbacks, gc.callbacks[:] = gc.callbacks[:], []
    previous_hook = sys.unraisablehook

    def hook(unraisable):
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            lost.append(unraisable)
        else:
            previous_hook(unraisable)

    sys.unraisablehook = hook
    try:
        yield lost
    finally:
        sys.unraisablehook = previous_hook
        gc.callbacks[:] = callbacks + gc.callbacks


def check_engine(engine, *, idle: bool = False) -> None:
    """The manager's own invariants, and a scheduler that names only what it holds (``idle``: and
    holds nothing, every block released)."""
    mgr, sch = engine.manager, engine.scheduler
    mgr.check_invariants()
    queued = sch.running + sch.waiting
    assert len(queued) == len({id(r) for r in queued})
    assert {r.request_id for r in queued} == set(sch.requests)
    for r in sch.running:
        assert r.request_id in mgr, r
    for r in sch.waiting:
        assert r.request_id not in mgr or r.status.value in ("swapped", "preempted"), r
    for seq_id in mgr._seqs:        # no sequence the scheduler lost track of
        assert seq_id in sch.requests, seq_id
    if idle:
        assert not sch.requests
        assert mgr.stats().active_blocks == 0
        assert not mgr.take_copies() and not mgr.take_loads() and not mgr.take_demotions()
