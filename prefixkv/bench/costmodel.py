"""The cost-model executor: charge each engine step from a calibrated model (no torch needed).

One step's modelled time is a sum of terms, each read off the ``StepPlan``::

    step_overhead_s                                   weights read, launches, per-step Python
  + prefill_s_per_token * prefill tokens              (prompt chunks and re-prefills)
  + decode_s_per_token  * decode tokens
  + KV bytes attention reads / kv_read_bytes_per_s    (whole blocks when read_whole_blocks:
                                                       a kernel loads the tail block's empty slots too)
  + swap bytes / link_bytes_per_s                     (swap_out + swap_in block copies)
  + 2 * copy-on-write bytes / kv_read_bytes_per_s     (read + write)
  + block_alloc_s       * blocks started this step    } per-block bookkeeping, measured from
  + block_table_entry_s * block-table entries          } prefixkv's own KVCacheManager
  + hit_block_s         * prefix-cache blocks matched  } (``measure_bookkeeping``)
  + hash_s_per_token    * prefill tokens              }

The bookkeeping terms are what a small block really pays: more blocks to
allocate, hash and free, longer block tables to build and ship.

Parameters (``CostParams``: a profile or a JSON/TOML file, ``load_params``) live in
``prefixkv.costs``, shared with the scheduler's preemption choice, replay and the tiers.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Mapping, Sequence

import xxhash

from ..costs import CostParams
from ..engine.plan import StepOutput, StepPlan


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class StepCounts:
    """What a step does, in the units the cost model charges."""

    prefill_tokens: int = 0
    decode_tokens: int = 0
    kv_bytes_read: int = 0
    swap_bytes: int = 0
    copy_bytes: int = 0
    new_blocks: int = 0
    table_entries: int = 0
    hit_blocks: int = 0

    @classmethod
    def from_plan(cls, plan: StepPlan, bytes_per_token: int, read_whole_blocks: bool = True) -> "StepCounts":
        size = plan.block_size
        kv_tokens = new_blocks = entries = hits = 0
        for r in plan.requests:
            blocks = _cdiv(r.seq_len, size)
            kv_tokens += blocks * size if read_whole_blocks else r.seq_len
            new_blocks += blocks - _cdiv(r.start, size)
            entries += blocks
            hits += r.cached_tokens // size
        block_bytes = size * bytes_per_token
        return cls(plan.num_prefill_tokens, plan.num_decode_tokens, kv_tokens * bytes_per_token,
                   plan.swap_blocks * block_bytes, plan.blocks_moved("copy") * block_bytes,
                   new_blocks, entries, hits)


class CostModel:
    """Step time from ``CostParams`` and the KV bytes per token."""

    def __init__(self, params: CostParams, bytes_per_token: int) -> None:
        self.params = params
        self.bytes_per_token = bytes_per_token

    def step_time(self, c: StepCounts) -> float:
        p = self.params
        if not (c.prefill_tokens or c.decode_tokens or c.swap_bytes or c.copy_bytes):
            return 0.0
        compute = (p.step_overhead_s if (c.prefill_tokens or c.decode_tokens) else 0.0) \
            + c.prefill_tokens * (p.prefill_s_per_token + p.hash_s_per_token) \
            + c.decode_tokens * p.decode_s_per_token
        memory = c.kv_bytes_read / p.kv_read_bytes_per_s + c.swap_bytes / p.link_bytes_per_s \
            + 2 * c.copy_bytes / p.kv_read_bytes_per_s
        books = c.new_blocks * p.block_alloc_s + c.table_entries * p.block_table_entry_s \
            + c.hit_blocks * p.hit_block_s
        return compute + memory + books

    def plan_time(self, plan: StepPlan) -> float:
        return self.step_time(StepCounts.from_plan(plan, self.bytes_per_token, self.params.read_whole_blocks))


def placeholder_token(request_id: Hashable, index: int, vocab: int = 32_000) -> int:
    """A deterministic stand-in output token (no model): a mix of the request id and position. The
    same in every process (no ``hash()``, which is salted per process for strings), and different for
    ids that share a prefix ("request-1", "request-2")."""
    if isinstance(request_id, int):
        h = request_id
    else:
        text = request_id if isinstance(request_id, str) else repr(request_id)
        h = xxhash.xxh3_64_intdigest(text.encode())
    x = (h * 0x9E3779B97F4A7C15 + index * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & (2**64 - 1)
    x ^= x >> 31
    return int(x % vocab)


class CostModelExecutor:
    """An ``Executor`` that runs nothing: modelled ``elapsed_s``, and as the sampled token the
    trace's recorded output token (``outputs[request_id][index]``) when known, else a
    deterministic placeholder; so a multi-turn trace's later prompts hit the earlier outputs' KV."""

    def __init__(self, model: CostModel, outputs: Mapping[Hashable, Sequence[int]] | None = None,
                 fallback: Callable[[Hashable, int], int] = placeholder_token) -> None:
        self.model = model
        self.outputs = outputs or {}
        self.fallback = fallback
        self.steps = 0

    def execute(self, plan: StepPlan) -> StepOutput:
        self.steps += 1
        sampled = {}
        for r in plan.requests:
            if r.sample:
                out = self.outputs.get(r.request_id)
                i = r.output_index
                sampled[r.request_id] = out[i] if out is not None and i < len(out) else self.fallback(r.request_id, i)
        return StepOutput(sampled, self.model.plan_time(plan))


# -- calibration ---------------------------------------------------------------------

def _best(fn: Callable[[], None], repeat: int) -> float:
    best = math.inf
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_bookkeeping(tokens: int = 16_384, repeat: int = 5, seed: int = 0) -> dict:
    """Per-block and per-token costs of prefixkv's ``KVCacheManager`` on this machine.

    Times the same ``tokens`` at block sizes 4 and 64 (so ``t = a * tokens + b * blocks``
    separates per-token hashing ``a`` from per-block work ``b``): admit+free of a fresh
    prompt (hash, allocate, publish, release), ``match`` of a cached one, and
    ``block_tables`` + ``slot_mapping`` of 32 sequences.
    """
    import random

    from ..manager import KVCacheManager

    rng = random.Random(seed)
    toks = [rng.randrange(32_000) for _ in range(tokens)]
    out: dict = {}
    per_size = {}
    for size in (4, 64):
        blocks = tokens // size
        mgr = KVCacheManager(4 * blocks + 64, size, hash_seed=0)
        counter = iter(range(10**9))

        def admit_free():
            rid = next(counter)
            prompt = mgr.prompt([rid] + toks[1:])        # fresh first token: nothing hits
            mgr.admit(rid, prompt, compute_last_token=False)
            mgr.free(rid)

        alloc = _best(admit_free, repeat)
        mgr.admit("warm", toks, compute_last_token=False)
        mgr.free("warm")
        cached = mgr.prompt(toks)
        cached.block_hashes()
        match = _best(lambda: mgr.match(cached), repeat)
        n = 32
        per = tokens // n
        mgr2 = KVCacheManager(blocks + 64, size, hash_seed=0, enable_caching=False)
        ids = list(range(n))
        for i in ids:
            mgr2.admit(i, toks[i * per:(i + 1) * per], compute_last_token=False)
        tables = _best(lambda: (mgr2.block_tables(ids), [mgr2.slot_mapping(i, per - 1, per) for i in ids]), repeat)
        per_size[size] = (alloc, match, tables, blocks)
    (a4, m4, t4, b4), (a64, m64, t64, b64) = per_size[4], per_size[64]
    out["block_alloc_s"] = max((a4 - a64) / (b4 - b64), 0.0)
    out["hash_s_per_token"] = max((a64 - out["block_alloc_s"] * b64) / tokens, 0.0)
    out["hit_block_s"] = max(m4 / b4, 0.0)
    out["block_table_entry_s"] = max((t4 - t64) / (b4 - b64), 0.0)
    return out


def calibrate_engine(config=None, *, block_size: int = 16, repeat: int = 3, threads: int = 1) -> dict:
    """Fit ``step_overhead_s``, ``prefill_s_per_token``, ``decode_s_per_token`` and
    ``kv_read_bytes_per_s`` to measured steps of the real engine (TinyLlama, torch, CPU).

    Times whole ``engine.step()`` calls (scheduler included, as the engine executor's
    runs count them). Runs prefill-only steps of several sizes and decode steps at several batch sizes and
    context lengths, and solves least squares for ``t = c0 + c1 * prefill + c2 * decode
    + c3 * kv_bytes``. Needs torch.
    """
    import numpy as np
    import torch

    from ..engine import Engine, SchedulerConfig, SimulatedClock, TinyLlama, TinyLlamaConfig

    torch.set_num_threads(threads)
    config = config or TinyLlamaConfig()
    model = TinyLlama(config)
    bpt = config.kv_spec().bytes_per_token
    rows, times = [], []
    rng = np.random.default_rng(0)
    for prompt_len, batch in ((32, 1), (128, 1), (512, 1), (256, 4), (64, 16), (1024, 2), (200, 32)):
        for _ in range(repeat):
            engine = Engine.from_model(model, num_blocks=8192, block_size=block_size, enable_caching=False,
                                       config=SchedulerConfig(max_num_batched_tokens=1 << 16, max_num_seqs=256),
                                       clock=SimulatedClock())
            for _b in range(batch):
                engine.add_request(rng.integers(0, config.vocab_size, prompt_len).tolist(), max_new_tokens=8,
                                   arrival_time=0.0)
            while engine.has_unfinished:
                t0 = time.perf_counter()
                res = engine.step()              # the whole step: schedule, execute, update
                elapsed = time.perf_counter() - t0
                c = StepCounts.from_plan(res.plan, bpt)
                rows.append([1.0, c.prefill_tokens, c.decode_tokens, c.kv_bytes_read])
                times.append(elapsed)
    A, y = np.array(rows, dtype=np.float64), np.array(times)
    coef, *_ = np.linalg.lstsq(A, y, rcond=None)
    coef = np.maximum(coef, 1e-12)
    return dict(step_overhead_s=float(coef[0]), prefill_s_per_token=float(coef[1]),
                decode_s_per_token=float(coef[2]), kv_read_bytes_per_s=float(1 / coef[3]), samples=len(y))
