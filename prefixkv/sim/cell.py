"""One cell of a policy x capacity sweep, run where a worker runs it (this process, a pool
worker or a Ray task): its own module so the sweep and its Ray backend both use it and neither
imports the other."""

from __future__ import annotations

from .replay import replay
from .traces import Trace


def replay_cell(cell, trace: Trace, options: dict) -> dict:
    """One cell's result dict, or ``{"error": message}`` naming the cell: an error record travels
    back from any worker (process or Ray) as plain data. ``options``: the other ``replay``
    arguments, the same for every cell."""
    try:
        result = replay(trace, cell.policy, cell.capacity, host_capacity=cell.host_capacity, **options).as_dict()
    except Exception as exc:  # noqa: BLE001 - reported with the cell it belongs to
        return {"error": f"{cell.describe()}: {type(exc).__name__}: {exc}"}
    result["trace"] = cell.source.label
    return result
