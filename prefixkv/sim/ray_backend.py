"""Sweep cells on Ray: a cluster at ``RAY_ADDRESS``, or a Ray started here (extra ``[ray]``).

Each trace is loaded once by the driver and put in the object store once; every cell
of that trace reads it from there, so a cluster's workers need no access to the
driver's files. Ray is imported only when this backend runs.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Callable, Sequence


def _remote_cell(cell, trace, options):
    from .cell import replay_cell

    return replay_cell(cell, trace, options)


def run_cells(sources: Sequence, jobs: Sequence[tuple], finish: Callable[[int, dict], None], *,
              num_cpus: int | None = None) -> None:
    """Run ``jobs`` ``(index, Cell, replay options)``, calling ``finish(index, result)`` with each
    result as it arrives. On Ctrl-C or an error the pending tasks are cancelled at once. A Ray started
    here is always shut down before this returns or raises, in order and waiting for its processes
    (``stop_local_ray``): left to the interpreter's exit after an interrupt, its shutdown used to
    crash the process now and then (exit 139) and to leave the raylet's agents running for a minute.
    Ctrl-C during ``ray.init`` is held back until it returns (a half-started Ray cannot be stopped)."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--backend ray needs ray: pip install 'prefixkv[ray]'") from None
    from ..interrupts import held

    started_here = False
    pending: dict = {}
    try:
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS") or None
            with held():
                ray.init(address=address, num_cpus=None if address else num_cpus, include_dashboard=False,
                         log_to_driver=False, logging_level="ERROR")
                started_here = True
        cell = ray.remote(num_cpus=1, max_retries=0)(_remote_cell)
        traces = {s.label: ray.put(s.load()) for s in sources}
        for index, job, options in jobs:
            pending[cell.remote(job, traces[job.source.label], options)] = index, job
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            index, job = pending.pop(done[0])
            try:
                result = ray.get(done[0])
            except Exception as exc:  # noqa: BLE001 - outside replay_cell (a worker died, ...): name the cell
                result = {"error": f"{job.describe()}: {type(exc).__name__}: {exc}"}
            finish(index, result)
    finally:
        with held():        # a second Ctrl-C waits for the shutdown (then surfaces)
            for ref in pending:
                ray.cancel(ref, force=True)
            if started_here:
                stop_local_ray(ray)


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (parent pid, start time in clock ticks, state) of every process (Linux ``/proc``)."""
    out = {}
    try:
        names = os.listdir("/proc")
    except OSError:
        return out
    for name in names:
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                stat = f.read().decode("ascii", "replace")
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()     # after "pid (comm) "
        try:
            out[int(name)] = (int(fields[1]), int(fields[19]), fields[0])
        except (IndexError, ValueError):
            continue
    return out


def _descendants(roots: Sequence[int]) -> dict[int, int]:
    """pid -> start time of every process below ``roots`` (the start time tells a reused pid)."""
    table = _proc_table()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found: dict[int, int] = {}
    todo = list(roots)
    while todo:
        for child in children.get(todo.pop(), ()):
            if child not in found:
                found[child] = table[child][1]
                todo.append(child)
    return found


def _alive(watch: dict[int, int]) -> list[int]:
    table = _proc_table()
    return [pid for pid, start in watch.items()
            if pid in table and table[pid][1] == start and table[pid][2] not in ("Z", "X")]


def stop_local_ray(ray, *, grace_s: float = 5.0) -> list[int]:
    """``ray.shutdown()`` waiting for the processes ``ray.init`` started (the raylet first: it stops
    its workers and agents), then the raylet's descendants that outlive it (its dashboard and
    runtime-env agents, re-parented to init, linger for a minute otherwise) get ``grace_s`` to
    exit and are killed after. Returns the pids it had to kill. Connected to an existing cluster,
    it only disconnects (no process of the cluster is touched)."""
    node = getattr(getattr(ray, "_private", None) and ray._private.worker, "_global_node", None)
    raylets = []
    if node is not None:
        raylets = [info.process.pid for info in node.all_processes.get("raylet", ()) if info.process is not None]
    watch = _descendants(raylets)
    try:
        ray.shutdown(wait_for_processes=True)
    except TypeError:           # a Ray older than the argument
        ray.shutdown()
    deadline = time.monotonic() + grace_s
    while _alive(watch) and time.monotonic() < deadline:
        time.sleep(0.05)
    killed = _alive(watch)
    for pid in killed:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    return killed
