"""``prefixkv compare``: sweep policies x capacities over traces, against MIN.

Every cell is one ``replay`` of the same trace file through the real manager.
Cells run in parallel worker processes, one trace after another (a trace's cells
together, its biggest capacities first); a process holds one trace at a time and loads
it from its file once (generated workloads are written to a file before any replay), so
a sweep over N traces loads each at most once per worker, whatever N. The held trace
keeps its conversion to arrays (``blockarrays``: dense ids, token requests hashed) for
the compiled replay, so that too is made once per worker and trace.

Two backends run the cells: ``process`` (the default: a local process pool) and
``ray`` (``prefixkv.sim.ray_backend``: a Ray cluster at ``RAY_ADDRESS``, or a local
Ray; extra ``[ray]``). Both give the same results. An interrupt (Ctrl-C) or a failing
cell stops the sweep at once instead of waiting for the queued cells;
``SweepInterrupted`` carries the finished cells, ``SweepCellError`` names the cell
that failed.
"""

from __future__ import annotations

import math
import multiprocessing
import numbers
import os
import signal
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from ..errors import InvalidArgument, PrefixKVError
from .cell import replay_cell
from .traces import Trace, load_trace

BACKENDS = ("process", "ray")

AUTO_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.5)


@dataclass(frozen=True)
class TraceSource:
    """A trace as a worker can reload it: a path (or paths) plus the format."""

    label: str
    paths: tuple[str, ...]
    format: str = "auto"

    def load(self) -> Trace:
        return _load_cached(self.paths, self.format, _signature(self.paths))


def _signature(paths: tuple[str, ...]) -> tuple:
    """What the files behind ``paths`` are now (name, size, modification time; a folder's files
    too): a cached trace is reused only while its files are unchanged."""
    out = []
    for path in paths:
        if os.path.isdir(path):
            for root, dirs, files in os.walk(path):
                dirs.sort()
                out.extend(_stat(os.path.join(root, name)) for name in sorted(files))
        else:
            out.append(_stat(path))
    return tuple(out)


def _stat(path: str) -> tuple:
    try:
        st = os.stat(path)
    except OSError:
        return path, None           # the loader says what is wrong with it
    return path, st.st_size, st.st_mtime_ns, st.st_ino


# The one trace this process holds: ((paths, format, signature), trace). Cells run trace by trace
# (see ``sweep``), so a process never needs an earlier trace again; keeping more only costs memory.
_held: tuple | None = None


def _load_cached(paths: tuple[str, ...], format: str, signature: tuple) -> Trace:
    global _held
    key = (paths, format, signature)
    held = _held
    if held is not None and held[0] == key:
        return held[1]
    _held = held = None     # let the old trace go before the next one is built: one in memory, not two
    trace = load_trace(list(paths) if len(paths) > 1 else paths[0], format=format)
    # This process's own copy, which no caller changes: its conversion to arrays for the compiled
    # replay (a token trace's hashing included) is made by the first cell and kept for the others.
    trace.frozen = True
    _held = key, trace
    return trace


def _forget_trace() -> None:
    """Drop the trace this process holds (its memory, once nothing else refers to it)."""
    global _held
    _held = None


class SweepInterrupted(KeyboardInterrupt):
    """Ctrl-C during a sweep; ``finished`` holds the cells completed before it, in sweep order."""

    def __init__(self, finished: list[dict], total: int) -> None:
        super().__init__(f"interrupted after {len(finished)} of {total} cells")
        self.finished = finished
        self.total = total


def request_blocks(trace: Trace, mode: str = "cache") -> list[int]:
    """Blocks each request holds while it runs: its prompt (cache mode), plus its output
    slots (concurrent mode). A hashed request's prompt is its hash ids' blocks, the last one
    whole, so its output starts a block of its own (as ``replay`` allocates it)."""
    size = trace.block_size
    if mode != "concurrent":
        return [-(-r.input_length // size) for r in trace.requests]
    out = []
    for r in trace.requests:
        prompt = r.input_length if r.block_hashes is None else len(r.block_hashes) * size
        out.append(max(-(-(r.input_length + r.output_length) // size), -(-(prompt + r.output_length) // size)))
    return out


def capacity_bound(trace: Trace, mode: str = "cache") -> int:
    """A capacity the trace can never fill: above it nothing is evicted and nothing waits, so a
    larger cache replays identically. Cache mode: every distinct block cached plus the largest
    request; concurrent mode: every block any request ever holds."""
    blocks = request_blocks(trace, mode)
    if mode == "concurrent":
        return max(1, sum(blocks))
    return max(1, trace.distinct_blocks(include_partial=True) + max(blocks, default=0))


def auto_capacities(trace: Trace, fractions: Sequence[float] = AUTO_FRACTIONS,
                    mode: str = "cache") -> tuple[list[int], str | None]:
    """Capacities as fractions of the trace's distinct blocks (deduplicated, at least 1), starting
    where the largest request fits (in concurrent mode with its output slots); and a note saying
    so when that moved the start.

    A capacity below the largest request counts that request as all misses, which measures the
    trace's request sizes rather than the policies. ``fractions``: positive numbers, in any order."""
    fractions = _fractions(fractions)
    distinct = trace.distinct_blocks()
    largest = max(request_blocks(trace, mode), default=1)
    low, high = distinct * fractions[0], distinct * fractions[-1]
    if largest <= low:
        return sorted({max(1, round(distinct * f)) for f in fractions}), None
    high = max(high, largest)
    steps = len(fractions) - 1
    caps = sorted({round(largest * (high / largest) ** (i / steps if steps else 0)) for i in range(steps + 1)})
    share = (f"{100 * largest / distinct:.1f}% of the {distinct:,} distinct blocks" if distinct
             else "the trace has no full block to share")
    note = (f"auto capacities start at {largest:,} block{'s' if largest != 1 else ''}, the largest request "
            f"({share}), so every request fits")
    return caps, note


def _fractions(fractions) -> list[float]:
    """``fractions`` sorted: the first is the low end, the last the high one."""
    out = list(fractions)
    # numbers.Real: numpy floats and ints too (a fractions array read with numpy), as before
    bad = next((f for f in out if isinstance(f, (bool, np.bool_)) or not isinstance(f, numbers.Real)
                or not math.isfinite(f) or f <= 0), None)
    if not out or bad is not None:
        # 0 or a negative fraction rounded to the 1-block floor; none at all failed with IndexError
        raise InvalidArgument("fractions", "must be one or more finite numbers > 0 (shares of the trace's "
                                           f"distinct blocks), got {out!r}")
    return sorted(out)


class SweepCellError(PrefixKVError):
    """One cell of a sweep failed; the message names its trace, policy and capacity."""


@dataclass(frozen=True)
class Cell:
    """One replay of a sweep: a trace, a policy, a device capacity and a host-tier capacity."""

    source: TraceSource
    policy: str
    capacity: int
    host_capacity: int = 0

    @property
    def key(self) -> tuple:
        return self.source.label, self.policy, self.capacity, self.host_capacity

    def describe(self) -> str:
        host = f", host capacity {self.host_capacity:,}" if self.host_capacity else ""
        return f"{self.source.label}, policy {self.policy}, capacity {self.capacity:,}{host}"


def result_key(result: dict) -> tuple:
    return result["trace"], result["policy"], result["capacity"], result.get("host_capacity", 0)


# In a pool worker: cell index -> pid of the worker that started it (shared with the parent),
# so that a worker which dies without a result (killed for memory, a crashing extension) is
# noticed, and its cell named, instead of the pool waiting for that result forever.
_started = None


def _run_cell(job: tuple) -> tuple[int, dict]:
    """``job``: (the cell's index in the sweep, the cell, the replay options); returns the index
    with the result, which is filed under it (a result's own fields need not repeat the cell's:
    a remote tier without a host tier reports the staging host tier replay chose)."""
    index, cell, options = job
    if _started is not None:
        _started[index] = os.getpid()
    return index, replay_cell(cell, cell.source.load(), options)


def _ignore_sigint() -> None:
    # Ctrl-C reaches the whole process group; the parent alone decides, and terminates the workers.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _init_worker(started) -> None:
    global _started
    _started = started
    _ignore_sigint()


def _gone(pid: int) -> bool:
    """The process has exited (reaped, or a zombie not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except OSError:
        return False


def _lost_cells(started, done) -> list[int]:
    """Cells a worker started and died in (no result has come, and its process is gone)."""
    return [i for i, pid in enumerate(started) if pid and i not in done and _gone(pid)]


_POLL_S = 0.2


def _repeated(values) -> object:
    seen = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


def _check_axes(sources, policies, capacities, host_capacities) -> None:
    """Every cell once, and only cells that can run: refused before any worker starts."""
    twice = _repeated(policies)
    if twice is not None:
        raise ValueError(f"policy {twice!r} twice: every cell would run and be listed twice")
    for s in sources:
        if s.label not in capacities:
            raise ValueError(f"no capacities for trace {s.label!r} (capacities name {sorted(capacities)})")
        caps = capacities[s.label]
        if not all(isinstance(c, int) and not isinstance(c, bool) and c > 0 for c in caps):
            raise ValueError(f"capacities must be positive block counts, got {list(caps)} for {s.label}")
        twice = _repeated(caps)
        if twice is not None:
            raise ValueError(f"capacity {twice} twice for {s.label}: every cell would run and be listed twice")
    if not all(isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in host_capacities):
        raise ValueError(f"host capacities must be >= 0 blocks, got {list(host_capacities)}")
    twice = _repeated(host_capacities)
    if twice is not None:
        raise ValueError(f"host capacity {twice} twice: every cell would run and be listed twice")


def sweep(sources: Sequence[TraceSource], policies: Sequence[str], capacities: dict[str, list[int]], *,
          mode: str = "cache", warmup: float = 0.0, workers: int | None = None, backend: str = "process",
          host_capacities: Sequence[int] = (0,), host_policy: str = "lru", transfer_cost=None, gate: bool = False,
          remote_capacity: int = 0, remote_bytes_per_s: float | None = None, disk_capacity: int = 0,
          disk_mode: str = "write-through", disk_read_bytes_per_s: float | None = None,
          disk_write_bytes_per_s: float | None = None,
          on_done: Callable[[dict], None] | None = None) -> list[dict]:
    """Replay every (trace, policy, capacity, host capacity); returns result dicts in a stable order.

    ``policies`` are names or specs (``"lrfu:half_life=4"``), not objects: every cell builds its
    own policy, in a worker process (register your class, see ``prefixkv.policies.register``;
    Ray workers do not fork, so plug-ins reach them as entry points). ``workers``: processes of
    the local pool, or the CPUs of a local Ray (a Ray cluster brings its own). ``host_capacities``
    sweeps the host tier below each device capacity (0: none); ``transfer_cost``, ``gate``,
    ``remote_capacity``, ``remote_bytes_per_s`` and the ``disk_*`` options as in ``replay``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
    bad = [p for p in policies if not isinstance(p, str)]
    if bad:
        raise TypeError(f"sweep takes policy names, not {type(bad[0]).__name__} objects: a policy keeps per-pool "
                        "state, so each cell builds its own; register the class under a name")
    _check_axes(sources, policies, capacities, host_capacities)
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers must be positive, got {workers!r}")
    labels = [s.label for s in sources]
    if len(set(labels)) < len(labels):
        raise ValueError(f"two traces share the label {next(l for l in labels if labels.count(l) > 1)!r}: "
                         "results are keyed by label")
    cells = [Cell(s, p, c, h) for s in sources for p in policies for c in capacities[s.label] for h in host_capacities]
    options = dict(mode=mode, warmup=warmup, host_policy=host_policy, transfer_cost=transfer_cost, gate=gate)
    if remote_capacity:
        options.update(remote_capacity=remote_capacity, remote_bytes_per_s=remote_bytes_per_s)
    if disk_capacity:
        options.update(disk_capacity=disk_capacity, disk_mode=disk_mode, disk_read_bytes_per_s=disk_read_bytes_per_s,
                       disk_write_bytes_per_s=disk_write_bytes_per_s)
    # Trace by trace, so that a process loads each trace once and holds one at a time (ordering all
    # cells by capacity alone cycled every process through every trace once per capacity: with more
    # traces than it kept, each cell reloaded its trace). Within a trace, biggest caches first: they
    # take longest, and the pool drains evenly.
    order = {s.label: k for k, s in enumerate(sources)}
    jobs = sorted(((i, cell, options) for i, cell in enumerate(cells)),
                  key=lambda j: (order[j[1].source.label], -(j[1].capacity + j[1].host_capacity)))
    # An explicit count is capped too: a pool larger than the sweep forks idle copies of this process
    # (a local Ray starts a worker per CPU it is given).
    if workers is not None:
        workers = max(1, min(workers, len(jobs)))
    elif backend == "process":
        workers = max(1, min(os.cpu_count() or 1, len(jobs)))
    done: dict[int, dict] = {}     # cell index -> result

    def finish(index: int, result: dict) -> None:
        if "error" in result:
            raise SweepCellError(result["error"])
        done[index] = result
        if on_done:
            on_done(result)

    def in_order() -> list[dict]:
        return [done[i] for i in sorted(done)]

    _warm_compiled_replay(cells, mode, options)
    try:
        if backend == "ray":
            from .ray_backend import run_cells
            run_cells(sources, jobs, finish, num_cpus=workers)
        elif workers <= 1:
            for job in jobs:
                finish(*_run_cell(job))
        else:
            context = multiprocessing.get_context()
            started = context.RawArray("q", len(cells))
            pool = context.Pool(workers, initializer=_init_worker, initargs=(started,))
            try:
                arriving = pool.imap_unordered(_run_cell, jobs)
                suspects: set[int] = set()
                while len(done) < len(jobs):
                    try:
                        index, result = arriving.next(timeout=_POLL_S)
                    except multiprocessing.TimeoutError:
                        # Lost twice in a row: a result still on its way has arrived by then.
                        lost = [i for i in _lost_cells(started, done) if i in suspects]
                        if lost:
                            raise SweepCellError(f"{cells[lost[0]].describe()}: the worker process replaying it "
                                                 f"died without a result (pid {started[lost[0]]})") from None
                        suspects = set(_lost_cells(started, done))
                        continue
                    finish(index, result)
                pool.close()
            finally:
                pool.terminate()      # at once: a failed or interrupted sweep does not wait for queued cells
                pool.join()
    except KeyboardInterrupt:
        raise SweepInterrupted(in_order(), len(jobs)) from None
    return in_order()


def _warm_compiled_replay(cells: Sequence[Cell], mode: str, options: dict) -> None:
    """Load the compiled replay loops of the cells' policies here, before the workers fork (they
    inherit them instead of each loading them), for the cells that will run in one (``replay``'s
    ``engine="auto"``)."""
    if mode != "cache" or options.get("gate") or options.get("remote_capacity"):
        return
    compiled = _compiled_names()
    kinds = [compiled[name] for name in (cell.policy.partition(":")[0].strip() for cell in cells
                                         if not cell.host_capacity) if name in compiled]
    if not kinds:
        return
    from ..flat import available
    if available():
        from .fastreplay import warm
        warm(kinds)


def _compiled_names():
    from ..flat.replay_layout import COMPILED
    return COMPILED


def gap_summary(results: Sequence[dict], bound: str = "belady", baseline: str = "lru") -> list[dict]:
    """Per (trace, capacity[, host capacity]): the best online policy and the share of the
    baseline->MIN gap it closes."""
    cells: dict[tuple[str, int, int], dict[str, float]] = {}
    for r in results:
        cells.setdefault((r["trace"], r["capacity"], r.get("host_capacity", 0)), {})[r["policy"]] = r["block_hit_rate"]
    out = []
    for (trace, capacity, host_capacity), rates in cells.items():
        online = {p: v for p, v in rates.items() if p != bound}
        if not online:
            continue
        best = max(online, key=lambda p: (online[p], p == baseline))
        row = {"trace": trace, "capacity": capacity, "best_policy": best, "best_hit_rate": online[best]}
        if host_capacity:
            row["host_capacity"] = host_capacity
        if bound in rates and baseline in rates:
            gap = rates[bound] - rates[baseline]
            row["min_hit_rate"] = rates[bound]
            row["baseline_hit_rate"] = rates[baseline]
            row["gap_closed"] = (online[best] - rates[baseline]) / gap if gap > 1e-12 else None
        out.append(row)
    return out


def plot(results: Sequence[dict], path, bound: str = "belady") -> None:
    """Hit rate against capacity, one line per policy, MIN dashed; one panel per trace.

    Writes exactly ``path`` (its suffix picks the format; check it with ``prefixkv.outputs.plot_file``)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in results))
    online = [p for p in dict.fromkeys(r["policy"] for r in results) if p != bound]
    # One look per policy, the same in every panel: ten colours, then markers and dashes change.
    colours = plt.get_cmap("tab10").colors
    markers, dashes = "osD^v", ["-", "-.", ":"]
    look = {p: dict(color=colours[i % 10], marker=markers[i // 10 % len(markers)], markersize=3,
                    linestyle=dashes[i // 10 % len(dashes)], label=p) for i, p in enumerate(online)}
    look[bound] = dict(color="black", linestyle="--", linewidth=2, label="MIN (Belady)")
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        rows = [r for r in results if r["trace"] == trace]
        for policy in dict.fromkeys(r["policy"] for r in rows):
            pts = sorted((r["capacity"], 100 * r["block_hit_rate"]) for r in rows if r["policy"] == policy)
            xs, ys = zip(*pts)
            ax.plot(xs, ys, **look[policy])
        ax.set_xscale("log")
        ax.set_xlabel(f"capacity (blocks of {rows[0]['block_size']} tokens)")
        ax.set_ylabel("block hit rate (%)")
        ax.set_title(trace)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_host_capacity(results: Sequence[dict], path) -> None:
    """Hit rate (all tiers) against host-tier capacity, one line per (policy, device capacity);
    one panel per trace."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    traces = list(dict.fromkeys(r["trace"] for r in results))
    fig, axes = plt.subplots(1, len(traces), figsize=(6.5 * len(traces), 4.5), squeeze=False)
    for ax, trace in zip(axes[0], traces):
        rows = [r for r in results if r["trace"] == trace]
        for policy, capacity in dict.fromkeys((r["policy"], r["capacity"]) for r in rows):
            pts = sorted((r.get("host_capacity", 0), 100 * r["block_hit_rate"]) for r in rows
                         if r["policy"] == policy and r["capacity"] == capacity)
            ax.plot(*zip(*pts), marker="o", markersize=3, label=f"{policy}, device {capacity:,}")
        ax.set_xlabel(f"host-tier capacity (blocks of {rows[0]['block_size']} tokens)")
        ax.set_ylabel("block hit rate, all tiers (%)")
        ax.set_ylim(0, 100)
        ax.set_title(trace)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
