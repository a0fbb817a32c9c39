"""Sweep cells on Ray: a cluster at ``RAY_ADDRESS``, or a Ray started here (extra ``[ray]``).

Each trace is loaded once by the driver and put in the object store once; every cell
of that trace reads it from there, so a cluster's workers need no access to the
driver's files. Ray is imported only when this backend runs.
"""

from __future__ import annotations

import os
from typing import Callable, Sequence


def _remote_cell(cell, trace, options):
    from .cell import replay_cell

    return replay_cell(cell, trace, options)


def run_cells(sources: Sequence, jobs: Sequence[tuple], finish: Callable[[int, dict], None], *,
              num_cpus: int | None = None) -> None:
    """Run ``jobs`` ``(index, Cell, replay options)``, calling ``finish(index, result)`` with each
    result as it arrives. On Ctrl-C or an error the pending tasks are cancelled at once; a Ray started
    here is shut down on success or error, and at interpreter exit after an interrupt (it can take
    a few seconds, which the user should not wait for before seeing ``interrupted``)."""
    try:
        import ray
    except ImportError:
        raise RuntimeError("--backend ray needs ray: pip install 'prefixkv[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        address = os.environ.get("RAY_ADDRESS") or None
        ray.init(address=address, num_cpus=None if address else num_cpus, include_dashboard=False,
                 log_to_driver=False, logging_level="ERROR")
    pending: dict = {}
    interrupted = False
    try:
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
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)
        if started_here and not interrupted:
            ray.shutdown()
