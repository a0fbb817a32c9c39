"""Ctrl-C during ``compare --backend ray``: exit 130 with ``interrupted``, never a segmentation fault
(exit 139), and no Ray process (``ray::DashboardAgent``, ``ray::RuntimeEnvAgent``, raylet, workers)
alive 10 s after the command exits. The local Ray used to be shut down by the interpreter's exit
hook after an interrupt, which crashed now and then and left the raylet's agents running for a
minute, re-parented to init.

One trial in the default ``ci`` profile (SIGINT to the process group as the raylet's agents start,
the case that leaked), 12 at random offsets in ``long`` (``PREFIXKV_HYPOTHESIS_PROFILE``). Each trial is
one command of a few seconds, bounded by timeouts."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from interrupt_helpers import trials

pytest.importorskip("ray")
pytestmark = [pytest.mark.ray, pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc (Linux)")]

ARGV = [sys.executable, "-m", "prefixkv", "compare", "--backend", "ray", "--workers", "2",
        "--capacities", "1000,2000,4000,8000,16000,32000"]


def session_processes(sid: int) -> dict[int, str]:
    """Live (not zombie) processes of session ``sid``: pid -> command name."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[3]) == sid and fields[0] not in ("Z", "X") and int(name) != sid:
            out[int(name)] = comm
    return out


def interrupted_run(delay: float | None):
    """Start the command in a session of its own; SIGINT its process group ``delay`` s in (None: as
    soon as the raylet's first agent (``ray::...``) exists, late in ``ray.init``). Returns (rc,
    stderr, session)."""
    proc = subprocess.Popen(ARGV, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        if delay is None:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and proc.poll() is None and \
                    not any(c.startswith("ray::") for c in session_processes(proc.pid).values()):
                time.sleep(0.02)
        else:
            time.sleep(delay)
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    return proc.returncode, err, proc.pid


def left_after(sid: int, seconds: float = 10.0) -> dict[int, str]:
    deadline = time.monotonic() + seconds
    while True:
        left = session_processes(sid)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill(pids):
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


@pytest.mark.parametrize("trial", range(trials(1, quick=1, long=12)))
def test_ctrl_c_during_a_ray_sweep_leaves_no_ray_process(trial):
    delay = None if trial == 0 else random.Random(trial).uniform(0.5, 8.0)
    rc, err, sid = interrupted_run(delay)
    left = left_after(sid)
    kill(left)              # whatever a failing trial left must not outlive the test
    assert rc != -signal.SIGSEGV and "Segmentation fault" not in err, err
    if rc == 0:             # the sweep finished before the signal
        assert delay is not None
    else:
        assert rc == 130 and err.strip().endswith("interrupted") and "Traceback" not in err, (rc, err)
    assert left == {}, f"still running 10 s after exit: {left}"
