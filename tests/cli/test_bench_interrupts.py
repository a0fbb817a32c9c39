"""Ctrl-C during ``prefixkv bench``: at any point of the run, exit status 130, ``interrupted`` on
stderr and no traceback (an interrupt inside the scheduler's release path used to end in a
``KeyError`` from ``Scheduler._fail_requests``, exit 1); the engine the run was using is left
consistent. Trials: a few in the default ``ci`` profile, 240 in ``long``
(``PREFIXKV_HYPOTHESIS_PROFILE``)."""

from __future__ import annotations

import _thread
import os
import random
import signal
import subprocess
import sys
import threading
import time

import pytest

import prefixkv.bench.runner as runner
from interrupt_helpers import LineTrigger, check_engine, interrupts_python_may_swallow, trials
from prefixkv.cli import main

TRIALS = trials(8)
ARGS = ["bench", "--requests", "60", "--block-sizes", "8,16", "--json"]


@pytest.fixture
def engines(monkeypatch):
    """Every engine the bench builds, to check it after the interrupt."""
    built = []

    class Recorded(runner.Engine):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            built.append(self)

    monkeypatch.setattr(runner, "Engine", Recorded)
    return built


# The lines counted: the engine's step and the bookkeeping under it, not the trace loading around it.
STEP_CODE = ("engine", "manager.py", "pool.py", "flat", "bench/costmodel.py")


def test_sigint_at_any_line_of_a_bench_run_exits_130(capsys, engines):
    argv = ["bench", "--requests", "12", "--block-sizes", "16", "--json"]
    with LineTrigger(None, STEP_CODE) as counter:
        assert main(argv) == 0
    capsys.readouterr()
    total = counter.count
    points = sorted(random.Random(3029).sample(range(1, total), trials(12)))
    for at in points:
        engines.clear()
        trigger = LineTrigger(at, STEP_CODE)
        with interrupts_python_may_swallow() as lost:
            try:
                with trigger:
                    code = main(argv)
                    time.sleep(0.05)
            except KeyboardInterrupt:       # raised after main had returned
                code = None
        err = capsys.readouterr().err
        assert "Traceback" not in err and "Error" not in err, (at, err)
        if trigger.fired and code is not None and not lost:
            assert code == 130 and err.strip().endswith("interrupted"), (at, trigger.fired, code, err)
        for engine in engines:
            check_engine(engine)


def test_sigint_at_random_offsets_of_a_bench_run_exits_130(capsys, engines):
    start = time.perf_counter()
    assert main(ARGS) == 0
    span = time.perf_counter() - start
    capsys.readouterr()
    rng = random.Random(2029)
    for trial in range(TRIALS):
        engines.clear()
        timer = threading.Timer(rng.uniform(0.0, span), _thread.interrupt_main)
        timer.start()
        try:
            code = main(ARGS)
            timer.join()
            time.sleep(0.05)        # the timer fired as the run ended: the handler runs here
        except KeyboardInterrupt:   # ... or after main returned: not the bench's business
            code = None
        finally:
            timer.cancel()
        err = capsys.readouterr().err
        assert "Traceback" not in err and "KeyError" not in err, err
        if code is None:
            continue
        assert code == 130 or (code == 0 and not timer.is_alive()), (trial, code, err)
        if code == 130:
            assert err.strip().endswith("interrupted"), err
            for engine in engines:
                check_engine(engine)


def test_sigint_to_the_process_group_of_a_bench_command():
    """The issue's recipe, once: a real SIGINT to the command's process group mid-run."""
    argv = ["bench", "--requests", "400", "--block-sizes", "8,16"]      # ~5 s
    proc = subprocess.Popen([sys.executable, "-m", "prefixkv", *argv], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        time.sleep(1.5)              # imports done, the run under way
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, err
    assert err.strip().endswith("interrupted") and "Traceback" not in err, err
