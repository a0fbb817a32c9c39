"""One bench run per block size: same trace, same pool bytes, same budget, same precision.

``prepare_trace`` turns any loaded trace into token requests:

* token traces replay their tokens (and their recorded output tokens: the cost-model
  executor "samples" them, so a chat's next turn finds the previous answer's KV);
* hashed traces (Mooncake, kv-cache-tester) carry no token ids: each hash id ``h``
  becomes ``trace.block_size`` tokens derived from ``h`` alone (a 64-bit mix of
  ``h`` and the position, modulo ``vocab``), so equal hash ids give equal tokens and
  the trace's sharing survives; a last, partly covered block takes the first tokens
  of its id's block, and tokens no id covers are unique to the request. At the
  trace's native block size the cache sees exactly the trace's sharing; at another
  block size the sharing granularity changes (a smaller block can hit part of a
  native block only when whole native blocks match before it; a larger one misses
  a native block's tail whenever the next native block differs). Salts are not
  replayed (the engine's requests carry none).

``run_block_size`` then builds a ``KVCacheManager`` of ``pool_bytes // bytes_per_block``
blocks (so a smaller block never gets more memory), the engine's ``Scheduler`` with
the same token budget and concurrency limit, and an executor (the cost model, or
the real tiny model), replays the arrivals on a clock, and records the design
notes' measurements plus block usage over time.
"""

from __future__ import annotations

import contextlib
import time
import zlib
from dataclasses import dataclass, field, replace
from typing import Literal, Sequence

import numpy as np

from ..costs import PROFILES, CostParams, PreemptionCostModel
from ..engine import Engine, Scheduler, SchedulerConfig, SimulatedClock, time_weighted_mean
from ..errors import SequenceTooLong
from ..manager import KVCacheManager
from ..sizing import KVSpec
from ..sim.traces import Trace
from .costmodel import CostModel, CostModelExecutor
from .reserved import ReservedBaselineError, run_reserved

MiB = 2**20
SEED_SPEC = KVSpec(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")   # the notes' teaching model


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: int
    arrival: float
    prompt: tuple[int, ...]
    max_new_tokens: int
    output: tuple[int, ...] | None      # recorded output tokens, when the trace has them
    salt: str | int | None = None       # token traces: the request's cache isolation key
    session: str | None = None          # the trace's session (conversation, agent loop), for session hints
    end: str | None = None              # why the trace's request ended ("tool_use", "end_turn", ...)


@dataclass(frozen=True)
class BenchConfig:
    block_sizes: tuple[int, ...] = (4, 8, 16, 32, 64, 128)
    pool_bytes: int = 8 * 2**30
    spec: KVSpec = SEED_SPEC
    policy: str = "lru"
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_prefill_chunk: int | None = None
    host_pool_bytes: int = 0            # swap space; 0: preemption recomputes
    executor: Literal["cost-model", "engine"] = "cost-model"
    params: CostParams = PROFILES["h200"]
    threads: int = 1                    # torch CPU threads of the engine executor (pinned while it runs)
    hash_seed: int = 0
    enable_caching: bool = True
    timeline_points: int = 200

    def as_dict(self) -> dict:
        s = self.spec
        return dict(block_sizes=list(self.block_sizes), pool_bytes=self.pool_bytes,
                    model_spec=dict(layers=s.layers, kv_heads=s.kv_heads, head_dim=s.head_dim, dtype=s.dtype,
                                    tensor_parallel=s.tensor_parallel, bytes_per_token=s.bytes_per_token),
                    policy=self.policy, max_num_batched_tokens=self.max_num_batched_tokens,
                    max_num_seqs=self.max_num_seqs, max_prefill_chunk=self.max_prefill_chunk,
                    host_pool_bytes=self.host_pool_bytes, executor=self.executor,
                    cost_params=self.params.as_dict() if self.executor == "cost-model" else None,
                    threads=self.threads if self.executor == "engine" else None,
                    hash_seed=self.hash_seed, enable_caching=self.enable_caching)


# -- traces ---------------------------------------------------------------------------

_M1, _M2, _M3 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, vectorised (uint64 arithmetic wraps)."""
    with np.errstate(over="ignore"):
        x = x + _M1
        x = (x ^ (x >> np.uint64(30))) * _M2
        x = (x ^ (x >> np.uint64(27))) * _M3
        return x ^ (x >> np.uint64(31))


# Ids made for a request's own tail live above every trace id: kv-cache-tester files take
# ``k << 40`` namespaces (traces.NAMESPACE_BITS), which ``1 << 40 | crc`` used to fall into.
_OWN_IDS = 1 << 63


def _id64(h) -> int:
    if isinstance(h, (int, np.integer)):
        return int(h) & (2**64 - 1)
    return zlib.crc32(repr(h).encode()) | _OWN_IDS


def tokens_for_hash(h, n: int, vocab: int) -> np.ndarray:
    """``n`` token ids derived from hash id ``h`` alone (equal ids, equal tokens)."""
    with np.errstate(over="ignore"):
        base = np.uint64(_id64(h)) * np.uint64(0x100000001B3)
        return (_mix(base + np.arange(n, dtype=np.uint64)) % np.uint64(vocab)).astype(np.int64)


def prepare_trace(trace: Trace, *, vocab: int = 32_000, limit: int | None = None) -> list[BenchRequest]:
    """Token requests for a bench run (see the module doc for hashed traces)."""
    out = []
    native = trace.block_size
    for i, r in enumerate(trace.requests[:limit]):
        if r.tokens is not None:
            prompt = tuple(int(t) for t in r.tokens)
            output = tuple(int(t) for t in r.output_tokens) if r.output_tokens is not None else None
        else:
            parts = [tokens_for_hash(h, native, vocab) for h in r.block_hashes]
            covered = sum(len(p) for p in parts)
            if covered < r.input_length:      # ids for full blocks only: the rest is this request's own
                parts.append(tokens_for_hash(("tail", i), r.input_length - covered, vocab))
            prompt = tuple(int(t) for t in np.concatenate(parts)[:r.input_length]) if parts else ()
            output = None
        if not prompt:
            continue
        out.append(BenchRequest(i, float(r.timestamp), prompt, max(1, r.output_length), output, r.salt,
                                r.session, r.stop))
    return out


# -- clocks and executors ------------------------------------------------------------------

class JumpClock:
    """Wall time that jumps over idle gaps instead of sleeping (real runs of a trace)."""

    def __init__(self) -> None:
        self._start = time.perf_counter()
        self._skipped = 0.0

    def now(self) -> float:
        return time.perf_counter() - self._start + self._skipped

    def advance_to(self, t: float) -> None:
        self._skipped += max(0.0, t - self.now())

    def on_step(self, elapsed_s: float) -> None:
        pass


def tiny_model_config(spec: KVSpec, vocab: int = 256, seed: int = 0):
    """A ``TinyLlamaConfig`` whose KV layout is ``spec`` (2 query heads per KV head)."""
    from ..engine import TinyLlamaConfig

    heads = 2 * spec.kv_heads
    hidden = heads * spec.head_dim
    return TinyLlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                           num_layers=spec.layers, num_heads=heads, num_kv_heads=spec.kv_heads,
                           head_dim=spec.head_dim, dtype=spec.dtype, seed=seed)


def make_engine_executor(spec: KVSpec, num_blocks: int, block_size: int, outputs, num_host_blocks: int = 0):
    """The real tiny model (torch, CPU) behind the same scheduler. Token ids are fed to the
    model modulo its vocabulary, and the trace's recorded output tokens replace the model's
    picks (teacher forcing), so the run schedules exactly as the cost-model run would."""
    import torch

    from ..engine import TinyLlama
    from ..engine.executor import ModelExecutor
    from ..engine.model import PagedAttentionBackend
    from ..engine.plan import StepOutput
    from ..kv.storage import KVStore

    from .costmodel import placeholder_token

    model = TinyLlama(tiny_model_config(spec))
    vocab = model.config.vocab_size
    store = KVStore(spec, num_blocks, block_size, device=model.device)
    if num_host_blocks:
        store.allocate_host(num_host_blocks)

    class TraceModelExecutor(ModelExecutor):
        @property
        def vocab_size(self):  # trace ids are any ints: forward() reduces them modulo the vocabulary
            return None

        def forward(self, plan):
            batch = plan.packed()
            backend = PagedAttentionBackend(
                self.kv_store, torch.from_numpy(batch.slot_mapping), torch.from_numpy(plan.block_tables),
                torch.from_numpy(batch.seq_lens), torch.from_numpy(batch.query_start_loc), impl=self.impl)
            with torch.inference_mode():
                hidden = self.model(torch.from_numpy(batch.token_ids % vocab), torch.from_numpy(batch.positions),
                                    backend)
                return self.model.logits(hidden[torch.from_numpy(batch.sample_rows)])

        def execute(self, plan):
            out = super().execute(plan)
            forced = {}
            for r in plan.requests:
                if r.sample:
                    rec = outputs.get(r.request_id)
                    i = r.output_index
                    forced[r.request_id] = rec[i] if rec is not None and i < len(rec) else \
                        placeholder_token(r.request_id, i)
            return StepOutput(forced, out.elapsed_s)

    return TraceModelExecutor(model, store)


# -- one run ----------------------------------------------------------------------------

@dataclass
class BlockSizeRun:
    summary: dict                                   # JSON-ready
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    timeline: dict = field(default_factory=dict)    # full resolution: t, active, evictable, free, running


def _downsample(timeline: dict, points: int) -> dict:
    n = len(timeline["t"])
    if n <= points:
        return {k: list(v) for k, v in timeline.items()}
    idx = np.unique(np.linspace(0, n - 1, points).round().astype(int))
    return {k: [v[i] for i in idx] for k, v in timeline.items()}


def run_block_size(requests: Sequence[BenchRequest], block_size: int, cfg: BenchConfig) -> BlockSizeRun:
    spec = cfg.spec
    bpt = spec.bytes_per_token
    bytes_per_block = spec.bytes_per_block(block_size)
    num_blocks = cfg.pool_bytes // bytes_per_block
    if num_blocks < 1:
        raise ValueError(f"a pool of {cfg.pool_bytes} B holds no block of {block_size} tokens "
                         f"({bytes_per_block} B per block)")
    host_blocks = cfg.host_pool_bytes // bytes_per_block
    mgr = KVCacheManager(num_blocks, block_size, policy=cfg.policy, hash_seed=cfg.hash_seed,
                         num_host_blocks=host_blocks, enable_caching=cfg.enable_caching)
    preempt_cost = PreemptionCostModel.from_params(cfg.params, bpt)
    scheduler = Scheduler(mgr, SchedulerConfig(max_num_batched_tokens=cfg.max_num_batched_tokens,
                                               max_num_seqs=cfg.max_num_seqs,
                                               max_prefill_chunk=cfg.max_prefill_chunk), preempt_cost)
    outputs = {r.request_id: r.output for r in requests if r.output is not None}
    if cfg.executor == "engine":
        executor = make_engine_executor(spec, num_blocks, block_size, outputs, host_blocks)
        clock = JumpClock()
    elif cfg.executor == "cost-model":
        executor = CostModelExecutor(CostModel(cfg.params, bpt), outputs)
        clock = SimulatedClock()
    else:
        raise ValueError(f"executor must be 'cost-model' or 'engine', got {cfg.executor!r}")
    engine = Engine(scheduler, executor, clock=clock)

    timeline: dict = {k: [] for k in ("t", "active", "evictable", "free", "running", "waiting", "tail_waste_slots")}
    table_len_sum = table_len_n = table_len_max = 0
    step_starts: list[float] = []
    running_during: list[int] = []
    running_spans: list[float] = []
    running_values: list[int] = []
    rejected = 0
    pending = sorted(requests, key=lambda r: (r.arrival, r.request_id))
    i, n = 0, len(pending)
    t0 = pending[0].arrival if pending else 0.0
    clock.advance_to(t0)
    while i < n or engine.has_unfinished:
        now = clock.now()
        while i < n and pending[i].arrival <= now:
            r = pending[i]
            i += 1
            try:
                engine.add_request(r.prompt, max_new_tokens=r.max_new_tokens, request_id=r.request_id,
                                   arrival_time=r.arrival, salt=r.salt, session=r.session, end=r.end)
            except SequenceTooLong:
                rejected += 1
        if not engine.has_unfinished:
            if i < n:
                clock.advance_to(pending[i].arrival)
            continue
        result = engine.step()
        if result.plan.is_empty:
            if i < n:
                clock.advance_to(pending[i].arrival)
                continue
            raise RuntimeError(f"block size {block_size}: no request can be scheduled")
        st = mgr.stats()
        start = clock.now() - t0 - result.elapsed_s
        # running during the step (a request that finished in it ran in it), then after it, each
        # for the time it lasts
        running_during.append(len(scheduler.running) + len(result.finished))
        running_spans.extend((start, clock.now() - t0))
        running_values.extend((running_during[-1], len(scheduler.running)))
        step_starts.append(start)
        timeline["t"].append(clock.now() - t0)
        timeline["active"].append(st.active_blocks)
        timeline["evictable"].append(st.evictable_blocks)
        timeline["free"].append(st.free_uncached_blocks)
        timeline["running"].append(len(scheduler.running))
        timeline["waiting"].append(len(scheduler.waiting))
        timeline["tail_waste_slots"].append(st.tail_waste_slots)
        lens = st.block_table_lengths
        if lens:
            table_len_sum += sum(lens)
            table_len_n += len(lens)
            table_len_max = max(table_len_max, max(lens))
    mgr.check_invariants()

    summary = engine.summary()
    reqs = list(engine.requests.values())
    finishes = [r.metrics.finished for r in reqs if r.metrics.finished is not None and
                r.finish_reason in ("length", "stop")]
    makespan = (max(finishes) - t0) if finishes else 0.0
    ttfts = [r.metrics.ttft for r in reqs if r.metrics.ttft is not None]
    itls = [x for r in reqs for x in r.metrics.itl]
    waste = np.array(timeline["tail_waste_slots"], dtype=np.float64) * bpt / MiB
    mean = time_weighted_mean(step_starts, timeline["t"][-1] if timeline["t"] else 0.0)

    out = dict(
        block_size=block_size, num_blocks=num_blocks, bytes_per_block=bytes_per_block,
        capacity_bytes=num_blocks * bytes_per_block, unallocated_bytes=cfg.pool_bytes - num_blocks * bytes_per_block,
        requests=len(requests), completed=summary["finished"], rejected_too_long=rejected,
        tail_waste_mib_mean=mean(waste),
        tail_waste_mib_peak=float(waste.max()) if waste.size else 0.0,
        block_table_len_mean=table_len_sum / table_len_n if table_len_n else 0.0,
        block_table_len_max=table_len_max,
        preemptions=summary["preemptions"], swaps=summary["swaps"], recomputed_tokens=summary["recomputed_tokens"],
        ttft_p50_s=summary["ttft_p50_s"], ttft_p99_s=summary["ttft_p99_s"],
        itl_p50_s=summary["itl_p50_s"], itl_p99_s=summary["itl_p99_s"],
        makespan_s=makespan, completed_per_s=summary["finished"] / makespan if makespan else None,
        output_tokens_per_s=summary["output_tokens"] / makespan if makespan else None,
        prefix_hit_rate=summary["prefix_hit_rate"], prompt_tokens=summary["prompt_tokens"],
        prefix_hit_tokens=summary["prefix_hit_tokens"], prefill_tokens_computed=summary["prefill_tokens_computed"],
        steps=summary["steps"], busy_s=summary["seconds"],
        concurrency_mean=time_weighted_mean(running_spans, timeline["t"][-1] if timeline["t"] else 0.0)(
            running_values),
        concurrency_max=max(running_during, default=0),
        # Requests that had arrived but were not running: what "the pool is 70% used, why does
        # nobody get in?" needs beside the usage figures.
        waiting_mean=mean(timeline["waiting"]), waiting_max=max(timeline["waiting"], default=0),
        usage_mean=dict(active=mean(timeline["active"]) / num_blocks,
                        evictable=mean(timeline["evictable"]) / num_blocks,
                        free=mean(timeline["free"]) / num_blocks),
        peak_active_fraction=max(timeline["active"], default=0) / num_blocks,
        timeline=_downsample({k: timeline[k] for k in ("t", "active", "evictable", "free", "running", "waiting")},
                             cfg.timeline_points),
    )
    return BlockSizeRun(out, ttfts, itls, timeline)


@dataclass
class BenchResult:
    config: BenchConfig
    trace: dict
    runs: list[BlockSizeRun]
    reserved: dict | None = None
    reserved_run: object = None
    reserved_error: str | None = None     # why the reserved baseline could not run (the paged runs stand)

    def as_dict(self) -> dict:
        out = dict(trace=self.trace, config=self.config.as_dict(), runs=[r.summary for r in self.runs])
        if self.reserved is not None:
            out["reserved"] = self.reserved
        if self.reserved_error is not None:
            out["reserved_error"] = self.reserved_error
        return out


_KEYS = ("concurrency_mean", "concurrency_max", "completed_per_s", "output_tokens_per_s", "ttft_p50_s",
         "ttft_p99_s", "itl_p50_s", "itl_p99_s", "makespan_s", "prefix_hit_rate", "completed",
         "rejected_too_long")


def compare_reserved_baseline(requests: Sequence, cfg, runs, *, reserve_tokens: int | str = "max") -> tuple[dict, dict]:
    """(JSON summary, raw reserved run): the reserved baseline next to every paged run, and a paged
    run without the prefix cache (at the middle block size) to separate paging from sharing."""
    raw = run_reserved(requests, cfg, reserve_tokens=reserve_tokens)
    reserved = {k: v for k, v in raw.items() if not k.startswith("_")}
    keys = (*_KEYS, "preemptions", "recomputed_tokens")   # a paged run can thrash: show what it recomputed
    paged = [dict(allocator="paged", block_size=r.summary["block_size"], **{k: r.summary[k] for k in keys})
             for r in runs]
    mid = sorted(cfg.block_sizes)[len(cfg.block_sizes) // 2]
    nocache_cfg = replace(cfg, enable_caching=False)
    if cfg.executor == "engine":
        run_block_size(requests, mid, nocache_cfg)      # warm-up, discarded, as for the paged runs
    nocache = run_block_size(requests, mid, nocache_cfg).summary
    paged_nocache = dict(allocator="paged, no prefix cache", block_size=mid, **{k: nocache[k] for k in keys})
    return dict(reserved=reserved, paged=paged, paged_no_cache=paged_nocache), raw


@contextlib.contextmanager
def _torch_threads(threads: int | None):
    """Torch on ``threads`` CPU threads for the block, restored after (None: leave torch alone).
    The tiny model gains nothing from more threads, and on a busy machine loses a lot to them."""
    if threads is None:
        yield
        return
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def run_bench(trace: Trace, cfg: BenchConfig, *, trace_label: str | None = None, vocab: int = 32_000,
              compare_reserved: bool = False, reserve_tokens: int | str = "max",
              on_done=None) -> BenchResult:
    """Every block size of ``cfg`` on ``trace``; optionally the reserved-max-length baseline.

    When the baseline cannot serve the trace at all (``ReservedBaselineError``: e.g. a reservation
    larger than the pool), the paged runs are kept and ``reserved_error`` says why."""
    requests = prepare_trace(trace, vocab=vocab)
    if not requests:
        raise ValueError(f"nothing to benchmark: every one of the trace's {len(trace.requests):,} request(s) "
                         f"has an empty prompt")
    info = dict(name=trace_label or trace.name, format=trace.format, native_block_size=trace.block_size,
                requests=len(requests), prompt_tokens=sum(len(r.prompt) for r in requests),
                output_tokens=sum(r.max_new_tokens for r in requests),
                synthesised_tokens=not trace.has_tokens, path=trace.path,
                vocab=None if trace.has_tokens else vocab,            # of the synthesised ids
                empty_prompts_skipped=len(trace.requests) - len(requests))
    runs = []
    with _torch_threads(cfg.threads if cfg.executor == "engine" else None):
        for size in cfg.block_sizes:
            if cfg.executor == "engine":
                # torch on CPU is slow the first time it meets each tensor shape (seconds over a
                # small trace): run once to warm up, discard it, keep the second run
                run_block_size(requests, size, cfg)
            runs.append(run_block_size(requests, size, cfg))
            if on_done:
                on_done(size)
        result = BenchResult(cfg, info, runs)
        if compare_reserved:        # its paged no-cache row runs on the same threads as the runs above
            try:
                result.reserved, result.reserved_run = compare_reserved_baseline(requests, cfg, runs,
                                                                                 reserve_tokens=reserve_tokens)
            except ReservedBaselineError as exc:
                result.reserved_error = str(exc)
    return result


_COMPARED = ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "makespan_s", "busy_s")


def compare_executors(trace: Trace, cfg: BenchConfig, *, vocab: int = 256) -> dict:
    """Run ``trace`` with the real engine (tiny model, CPU) and with the cost model, same
    scheduler, pool and budget; per block size, each latency from both and cost / engine.

    Needs torch. The engine's outputs are teacher-forced to the trace's (see
    ``make_engine_executor``), so both runs compute the same tokens.
    """
    real = run_bench(trace, replace(cfg, executor="engine"), vocab=vocab)
    model = run_bench(trace, replace(cfg, executor="cost-model"), vocab=vocab)
    out = dict(cost_params=cfg.params.name, rows=[])
    for e, c in zip(real.runs, model.runs):
        row = dict(block_size=e.summary["block_size"], steps_engine=e.summary["steps"], steps_cost=c.summary["steps"])
        for key in _COMPARED:
            a, b = e.summary[key], c.summary[key]
            row[key] = dict(engine=a, cost_model=b, ratio=(b / a) if a and b is not None else None)
        out["rows"].append(row)
    return out


def format_comparison(cmp: dict) -> str:
    lines = [f"cost model ({cmp['cost_params']}) vs real engine: value in ms, cost/engine ratio"]
    for row in cmp["rows"]:
        cells = []
        for key in _COMPARED:
            v = row[key]
            if v["engine"] is None or v["cost_model"] is None:
                cells.append(f"{key[:-2]} -")
            else:
                cells.append(f"{key[:-2]} {1e3 * v['engine']:.2f}/{1e3 * v['cost_model']:.2f} "
                             f"(x{v['ratio']:.2f})")
        lines.append(f"  B={row['block_size']}: " + "; ".join(cells))
    return "\n".join(lines)
