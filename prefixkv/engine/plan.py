"""The seam between the scheduler and an executor (no torch needed).

One scheduler, several executors. Each step::

    plan = scheduler.schedule(now)        # decides; changes the manager (tables, refcounts)
    out = executor.execute(plan)          # runs it (or models it): sampled tokens + elapsed_s
    scheduler.update(plan, out)           # appends tokens, finishes requests, frees blocks

The scheduler owns every decision and every call to the ``KVCacheManager``; an
executor never touches the manager. The plan carries everything an executor
needs, already checked to fit the pool:

* ``block_ops``: block copies to run *first*, in order: ``swap_out``
  (device -> host), ``demote`` (evicted blocks to the host tier), ``swap_in``
  (host -> device), ``load`` (host-tier hits), ``copy`` (copy-on-write);
* ``requests``: per scheduled request, the token ids it computes this step,
  the position of the first one (``start``: tokens already in the cache), one
  physical slot per token, and whether the last one's logits are sampled;
* ``block_tables`` (one row per request, padded with 0) and, through
  ``packed()``, the flat row: token ids, per-token positions, slot mapping,
  ``seq_lens`` and ``query_start_loc`` for paged attention's extend path.

An executor returns a ``StepOutput``: one sampled token per request with
``sample=True`` and the step's duration in seconds (measured, or modelled: the
engine advances a ``SimulatedClock`` by it). A cost-model executor reads the
same plan (``num_prefill_tokens``, ``num_decode_tokens``, ``kv_tokens_read``,
``swap_blocks``, the block tables) and returns modelled time plus placeholder
tokens. On an exception the engine hands the plan to ``scheduler.fail`` which
releases every block the plan touched.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Hashable, Literal, Mapping, Protocol, runtime_checkable

import numpy as np

from .request import SamplingParams

BlockOpKind = Literal["swap_out", "demote", "swap_in", "load", "copy"]


@dataclass(frozen=True, slots=True, eq=False)
class ScheduledRequest:
    request_id: Hashable
    token_ids: tuple[int, ...]      # the tokens computed this step
    start: int                      # position of token_ids[0]; tokens before it are cached
    slot_mapping: np.ndarray        # int64 physical slot (block * block_size + offset) per token
    sample: bool                    # the last token's logits give the request's next token
    output_index: int               # tokens generated so far (the index of the token sampled now)
    sampling: SamplingParams
    is_decode: bool                 # one generated token fed back (not a prompt or re-prefill chunk)
    cached_tokens: int = 0          # leading tokens found in the prefix cache when admitted this step

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def seq_len(self) -> int:
        """Tokens in the cache once this step has written its KV."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True, slots=True)
class BlockOp:
    kind: BlockOpKind
    pairs: tuple[tuple[int, int], ...]   # (src, dst): device->host, host->device, or device->device


@dataclass(frozen=True, slots=True, eq=False)
class PackedBatch:
    """The flat token row of one step (numpy, host memory)."""

    token_ids: np.ndarray        # int64 [T]
    positions: np.ndarray        # int64 [T]
    slot_mapping: np.ndarray     # int64 [T]
    seq_lens: np.ndarray         # int32 [S]
    query_start_loc: np.ndarray  # int32 [S + 1]
    sample_rows: np.ndarray      # int64: row of the last token of each request that samples
    sample_requests: tuple[int, ...]   # index into plan.requests of each sample row


@dataclass(frozen=True, eq=False)
class StepPlan:
    step: int
    block_size: int
    requests: tuple[ScheduledRequest, ...] = ()
    block_tables: np.ndarray = field(default_factory=lambda: np.zeros((0, 0), dtype=np.int32))
    block_ops: tuple[BlockOp, ...] = ()
    preempted: tuple[tuple[Hashable, str], ...] = ()   # (request id, "recompute" | "swap") this step

    @property
    def is_empty(self) -> bool:
        """Nothing happened: no request ran, no block moved, nobody was preempted."""
        return not self.requests and not self.block_ops and not self.preempted

    @property
    def num_seqs(self) -> int:
        return len(self.requests)

    @cached_property
    def num_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests)

    @cached_property
    def num_decode_tokens(self) -> int:
        return sum(len(r.token_ids) for r in self.requests if r.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    @cached_property
    def kv_tokens_read(self) -> int:
        """Cached + new tokens attention reads this step (sum of sequence lengths)."""
        return sum(r.seq_len for r in self.requests)

    def blocks_moved(self, kind: BlockOpKind) -> int:
        return sum(len(op.pairs) for op in self.block_ops if op.kind == kind)

    @property
    def swap_blocks(self) -> int:
        """Blocks crossing the device-host link: swaps and the host tier's demotions and loads."""
        return sum(self.blocks_moved(kind) for kind in ("swap_out", "demote", "swap_in", "load"))

    def packed(self) -> PackedBatch:
        reqs = self.requests
        lens = np.fromiter((len(r.token_ids) for r in reqs), dtype=np.int64, count=len(reqs))
        starts = np.zeros(len(reqs) + 1, dtype=np.int64)
        np.cumsum(lens, out=starts[1:])
        total = int(starts[-1])
        token_ids = np.fromiter((t for r in reqs for t in r.token_ids), dtype=np.int64, count=total)
        positions = np.concatenate([np.arange(r.start, r.seq_len, dtype=np.int64) for r in reqs]) \
            if reqs else np.zeros(0, dtype=np.int64)
        slots = np.concatenate([np.asarray(r.slot_mapping, dtype=np.int64) for r in reqs]) \
            if reqs else np.zeros(0, dtype=np.int64)
        sampling = [i for i, r in enumerate(reqs) if r.sample]
        return PackedBatch(
            token_ids=token_ids, positions=positions, slot_mapping=slots,
            seq_lens=np.array([r.seq_len for r in reqs], dtype=np.int32),
            query_start_loc=starts.astype(np.int32),
            sample_rows=np.array([starts[i + 1] - 1 for i in sampling], dtype=np.int64),
            sample_requests=tuple(sampling))


@dataclass(frozen=True, slots=True)
class StepOutput:
    sampled: Mapping[Hashable, int]   # request id -> token, for every request with sample=True
    elapsed_s: float


@runtime_checkable
class Executor(Protocol):
    """Runs (or models) a ``StepPlan``. Must not call the manager.

    Optional: a ``vocab_size`` attribute (int, or None when unknown); when present the
    engine refuses prompts with token ids outside ``[0, vocab_size)`` as they are added,
    rather than letting one bad id fail a whole step (``ModelExecutor`` has the model's).
    """

    def execute(self, plan: StepPlan) -> StepOutput: ...
