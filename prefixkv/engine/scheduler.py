"""The scheduler: who runs this step, with how many tokens, and where their KV lives.

One component for every executor (see ``plan.py`` for the seam). Each step:

1. ``propose(now)`` decides a ``Round`` without changing anything:
   running requests first, oldest first (a decode takes 1 token, a prompt
   chunk up to the budget and ``max_prefill_chunk``; a chunk is cut to the
   blocks that are free). When a running request cannot get even one token's
   block: with ``when_full="preempt"`` the newest running request not yet
   scheduled is preempted (possibly this one), by recompute or by swap as the
   ``PreemptionCostModel`` chooses, until it fits; with ``when_full="wait"``
   it sits this step out keeping its blocks (and preemption is used only when
   nothing else could run). Then, if nobody was preempted, waiting requests in
   arrival order, within the token budget and the concurrency limit
   (``max_num_seqs`` requests holding blocks): a swapped request is swapped
   back in; a new or recompute-preempted one is matched against the prefix
   cache and admitted with ``tokens[:hit + chunk]`` only (later chunks are
   appended, and the manager publishes blocks as they fill). Blocks an earlier
   admission of the same round publishes count as hits: requests arriving
   together with one system prompt compute it once.
2. ``commit(round)`` checks the whole round's block capacity
   (``round_capacity``) and raises ``OutOfBlocks`` with nothing changed when
   it does not fit; otherwise it applies it to the manager and returns the
   ``StepPlan``. ``schedule(now)`` is both.
3. ``update(plan, output)`` appends the sampled tokens and releases finished
   requests; ``fail(plan, exc)`` releases every request the plan touched.

Blocks are released on every path (finish, cancel, error, a failing commit).
"""

from __future__ import annotations

import bisect
import itertools
import operator
from dataclasses import dataclass
from typing import Hashable, Literal

import numpy as np

from ..errors import OutOfBlocks, SequenceTooLong
from ..manager import KVCacheManager
from ..prompt import Prompt
from .capacity import (Round, _cdiv, admission_cost, exclusive_blocks, fit_append, hashed_tokens,
                       round_capacity, swap_in_cost, swapped_growth)
from ..costs import PreemptionChoice, PreemptionCostModel
from .plan import BlockOp, ScheduledRequest, StepOutput, StepPlan
from .request import Request, RequestStatus

_ORDER = lambda r: r.order  # noqa: E731
_MAX_TOKEN = 2**32      # the manager's token ids: [0, 2**32)
# The engine's finish reasons in the words session hints use (vLLM's / the traces' stop reasons).
_END_REASONS = {"length": "max_tokens", "stop": "stop", "cancelled": "cancelled"}


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_batched_tokens: int = 512     # token budget per step (prefill chunks + decodes)
    max_num_seqs: int = 64                # concurrency limit: requests holding device blocks
    max_prefill_chunk: int | None = None  # per-request chunk cap (None: the budget)
    when_full: Literal["preempt", "wait"] = "preempt"

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_prefill_chunk"):
            value = getattr(self, name)
            if value is None and name == "max_prefill_chunk":
                continue
            try:
                if isinstance(value, bool):
                    raise TypeError
                object.__setattr__(self, name, operator.index(value))
            except TypeError:
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_prefill_chunk is not None and self.max_prefill_chunk < 1:
            raise ValueError(f"max_prefill_chunk must be >= 1, got {self.max_prefill_chunk}")
        if self.when_full not in ("preempt", "wait"):
            raise ValueError(f"when_full must be 'preempt' or 'wait', got {self.when_full!r}")


@dataclass(slots=True)
class _Entry:
    request: Request
    start: int
    stop: int
    cached: int = 0


class Scheduler:
    def __init__(self, manager: KVCacheManager, config: SchedulerConfig | None = None,
                 cost_model: PreemptionCostModel | None = None) -> None:
        self.mgr = manager
        self.config = config or SchedulerConfig()
        self.cost_model = cost_model or PreemptionCostModel()
        self.requests: dict[Hashable, Request] = {}   # live requests (not finished/cancelled/failed)
        self.running: list[Request] = []               # holding device blocks, oldest first
        self.waiting: list[Request] = []               # waiting / preempted / swapped, oldest first
        self.step_count = 0
        self.preemption_log: list[tuple[int, Hashable, PreemptionChoice]] = []
        self._order = itertools.count()
        self._proposed: tuple[Round | None, dict, dict] = (None, {}, {})

    # -- life cycle ------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request {request.request_id!r} is already live")
        blocks = _cdiv(request.max_tokens, self.mgr.block_size)
        if blocks > self.mgr.pool.num_blocks:
            raise SequenceTooLong(blocks, self.mgr.pool.num_blocks,
                                  f"request {request.request_id!r} of up to {request.max_tokens} tokens")
        request.order = next(self._order)
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        bisect.insort(self.waiting, request, key=_ORDER)

    def cancel(self, request_id: Hashable) -> bool:
        """Cancel a live request, whatever its state; False if it is not live."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self._release(request, RequestStatus.CANCELLED, "cancelled")
        return True

    def abort_all(self, status: RequestStatus = RequestStatus.CANCELLED) -> list[Request]:
        """Release every live request; returns them. A release that raises (a bad session hint)
        still frees its request, the others are released all the same, then the first error is raised."""
        live = list(self.requests.values())
        first: BaseException | None = None
        for request in live:
            try:
                self._release(request, status, "cancelled" if status is RequestStatus.CANCELLED else "error")
            except Exception as exc:
                first = first or exc
        if first is not None:
            raise first
        return live

    @property
    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def next_arrival(self, now: float) -> float | None:
        future = [r.arrival_time for r in self.waiting if r.arrival_time > now]
        return min(future) if future else None

    def _release(self, request: Request, status: RequestStatus, reason: str,
                 error: BaseException | None = None, now: float | None = None) -> None:
        rid = request.request_id
        try:
            if rid in self.mgr:
                try:
                    self.mgr.free(rid, hint=self._hint(request, status, reason, now))
                except Exception:
                    # The hint could not be built (a bad session field) or the policy raised on it:
                    # the manager kept the sequence. The blocks go back all the same, then the
                    # error is reported (the request is dropped below, so they would leak).
                    if rid in self.mgr:
                        self.mgr.free(rid)
                    raise
        finally:
            for queue in (self.running, self.waiting):
                if request in queue:
                    queue.remove(request)
            self.requests.pop(rid, None)
            request.status = status
            request.finish_reason = reason
            request.error = error

    @staticmethod
    def _hint(request: Request, status: RequestStatus, reason: str, now: float | None):
        """The session hint a finished request gives the eviction policy (None: no session, or a
        failure, whose blocks say nothing about the session's future)."""
        if request.session is None or status is RequestStatus.FAILED:
            return None
        from ..policies import SessionHint

        end = request.end or _END_REASONS.get(reason, reason)
        return SessionHint(request.session, end=end, time=now, next_arrival=request.next_arrival)

    # -- deciding ----------------------------------------------------------------
    def _choose_preemption(self, victim: Request, host_free: int) -> PreemptionChoice:
        mgr = self.mgr
        return self.cost_model.choose(tokens=mgr.num_tokens(victim.request_id),
                                      blocks=len(mgr.block_ids(victim.request_id)),
                                      block_size=mgr.block_size, host_blocks_free=host_free)

    def propose(self, now: float = 0.0) -> Round:
        """This step's round, within the budget, the concurrency limit and the free blocks. Read-only."""
        mgr, cfg = self.mgr, self.config
        size = mgr.block_size
        budget = cfg.max_num_batched_tokens
        chunk_cap = cfg.max_prefill_chunk or budget
        free = mgr.num_free_blocks
        host_free = mgr.num_free_host_blocks
        grow: list[tuple[Hashable, int]] = []
        preempt: list[tuple[Hashable, str]] = []
        choices: dict[Hashable, PreemptionChoice] = {}
        planned_hits: dict[Hashable, int] = {}   # admission -> the prefix hit its blocks were counted for

        pending = list(self.running)
        while pending and budget > 0:
            r = pending.pop(0)
            rid = r.request_id
            n = min(r.remaining, budget, chunk_cap)
            k = fit_append(mgr, rid, n, free)
            while k == 0:
                if cfg.when_full == "wait" and (grow or any(
                        fit_append(mgr, p.request_id, min(p.remaining, budget, chunk_cap), free)
                        for p in pending)):
                    break                      # sits this step out, keeps its blocks: another runs
                victim = pending.pop() if pending else r
                choice = self._choose_preemption(victim, host_free)
                choices[victim.request_id] = choice
                preempt.append((victim.request_id, choice.mode))
                if choice.mode == "swap":
                    host_free -= len(mgr.block_ids(victim.request_id))
                free += exclusive_blocks(mgr, victim.request_id)
                if victim is r:
                    break
                k = fit_append(mgr, rid, n, free)
            if k:
                grow.append((rid, k))
                free -= mgr.blocks_needed_to_append(rid, k)
                budget -= k

        swap_in: list[tuple[Hashable, int]] = []
        admit: list[tuple[Hashable, int]] = []
        seats = cfg.max_num_seqs - len(self.running)
        published: set = set()      # block hashes this round's admissions will publish
        if not preempt:
            for r in self.waiting:
                if budget <= 0 or seats <= 0:
                    break
                if r.arrival_time > now:
                    continue
                rid = r.request_id
                if r.status is RequestStatus.SWAPPED:
                    base = swap_in_cost(mgr, r)
                    room = _cdiv(r.num_computed, size) * size - r.num_computed
                    k = min(r.remaining, budget, chunk_cap, room + max(free - base, 0) * size)
                    if k < 1 or base > free:
                        break                  # first come, first served: nobody overtakes
                    swap_in.append((rid, k))
                    free -= base + swapped_growth(r.num_computed, k, size)
                else:
                    prompt = hashed_tokens(mgr, r)
                    hit, pinned = admission_cost(mgr, prompt)
                    hit, also_pinned = self._hit_with(prompt, hit, published)
                    pinned += also_pinned
                    k = min(len(r.tokens) - hit, budget, chunk_cap, max(free - pinned, 0) * size)
                    if k < 1:
                        break
                    admit.append((rid, k))
                    planned_hits[rid] = hit
                    free -= pinned + _cdiv(k, size)
                    if mgr.enable_caching:
                        published.update(prompt.block_hashes()[:(hit + k) // size])
                budget -= k
                seats -= 1
        rnd = Round(preempt=tuple(preempt), swap_in=tuple(swap_in), grow=tuple(grow), admit=tuple(admit))
        self._proposed = (rnd, choices, planned_hits)
        return rnd

    def _hit_with(self, prompt, hit: int, published: set) -> tuple[int, int]:
        """(the prefix hit once this round's earlier admissions have published their blocks, the
        evictable blocks that extension pins).

        A block an earlier admission publishes is usually a free hit (it is active), but when
        its hash is still cached in an evictable block cut off from its prefix, the new block
        is a duplicate and the lookup finds the old one: pinning it takes a free block."""
        if not published:
            return hit, 0
        pool = self.mgr.pool
        size = self.mgr.block_size
        hashes = prompt.block_hashes()
        limit = (prompt.num_tokens - 1) // size        # the last token is always computed
        blocks = hit // size
        pinned = 0
        while blocks < limit and hashes[blocks] in published:
            cached = pool.lookup(hashes[blocks])
            if cached is not None and not pool.ref_count[cached]:
                pinned += 1
            blocks += 1
        return blocks * size, pinned

    # -- applying ----------------------------------------------------------------
    def schedule(self, now: float = 0.0) -> StepPlan:
        return self.commit(self.propose(now))

    def commit(self, rnd: Round) -> StepPlan:
        """Apply a round and return its plan; ``OutOfBlocks`` (nothing changed) if it does not fit."""
        mgr = self.mgr
        self._check_round(rnd)
        capacity = round_capacity(mgr, rnd, self.requests)
        if capacity.host_needed > capacity.host_available:
            raise OutOfBlocks(capacity.host_needed, capacity.host_available, "swap-out of this round to host memory")
        if not capacity.fits:
            raise OutOfBlocks(capacity.needed, capacity.available,
                              f"round of {len(rnd.grow)} running, {len(rnd.swap_in)} swap-in and "
                              f"{len(rnd.admit)} new request(s)")
        self.step_count += 1
        proposed, choices, planned_hits = self._proposed
        if proposed is not rnd:
            # A round built elsewhere was checked (round_capacity) for the hits admissions have now.
            choices = {}
            planned_hits = {rid: admission_cost(mgr, hashed_tokens(mgr, self.requests[rid]))[0]
                            for rid, _ in rnd.admit}
        ops: list[BlockOp] = []
        entries: list[_Entry] = []
        touched: list[Request] = []
        try:
            for seq_id, mode in rnd.preempt:
                r = self.requests[seq_id]
                touched.append(r)
                self._preempt(r, mode, ops)
                choice = choices.get(seq_id) or PreemptionChoice(mode, 0.0, 0.0, "given")
                self.preemption_log.append((self.step_count, seq_id, choice))
            for seq_id, k in rnd.swap_in:
                r = self.requests[seq_id]
                touched.append(r)
                pairs = mgr.swap_in(seq_id)
                if pairs:
                    ops.append(BlockOp("swap_in", tuple(pairs)))
                self._to_running(r)
                entries.append(self._grow(r, k))
            for seq_id, k in rnd.grow:
                r = self.requests[seq_id]
                touched.append(r)
                entries.append(self._grow(r, k))
            for seq_id, k in rnd.admit:
                r = self.requests[seq_id]
                touched.append(r)
                entries.append(self._admit(r, k, planned_hits[seq_id]))
            return self._plan(entries, self._ordered_ops(ops), rnd.preempt)
        except BaseException as exc:
            # Whatever part of the round was applied, its KV will never be written.
            self._fail_requests(touched, exc, published=True)
            raise

    def _check_round(self, rnd: Round) -> None:
        """``ValueError`` unless every part of the round can be applied to its request as it is
        now: checked before anything changes, so a bad round (hand-built, or a proposal committed
        twice) fails nobody and leaves the cache alone."""
        ok_modes = ("recompute", "swap")
        parts = ((rnd.preempt, "preempted", (RequestStatus.RUNNING,)),
                 (rnd.swap_in, "swapped in", (RequestStatus.SWAPPED,)),
                 (rnd.grow, "grown", (RequestStatus.RUNNING,)),
                 (rnd.admit, "admitted", (RequestStatus.WAITING, RequestStatus.PREEMPTED)))
        for entries, what, statuses in parts:
            for seq_id, arg in entries:
                r = self.requests.get(seq_id)
                if r is None:
                    raise ValueError(f"request {seq_id!r} is not live")
                if r.status not in statuses:
                    raise ValueError(f"request {seq_id!r} is {r.status.value}: it cannot be {what}")
                if entries is rnd.preempt:
                    if arg not in ok_modes:
                        raise ValueError(f"request {seq_id!r}: preemption mode must be 'recompute' or "
                                         f"'swap', not {arg!r}")
                    continue
                try:
                    if isinstance(arg, bool):
                        raise TypeError
                    arg = operator.index(arg)
                except TypeError:
                    raise ValueError(f"request {seq_id!r}: a token count must be an int, not {arg!r}") from None
                if not 1 <= arg <= r.remaining:
                    raise ValueError(f"request {seq_id!r} has {r.remaining} token(s) to compute, not {arg}")

    def _ordered_ops(self, ops: list[BlockOp]) -> list[BlockOp]:
        """The round's block moves in the order they must run: swap-outs and the host tier's
        demotions read device blocks the round may reuse; swap-ins and loads then write reused
        blocks; copy-on-write last. (Host blocks that loads and swap-ins read stay held until
        ``take_loads``, so no demotion of this round overwrites them.)"""
        mgr = self.mgr
        demotions, loads, copies = mgr.take_demotions(), mgr.take_loads(), mgr.take_copies()
        by_kind = {kind: [op for op in ops if op.kind == kind] for kind in ("swap_out", "swap_in")}
        out = list(by_kind["swap_out"])
        if demotions:
            out.append(BlockOp("demote", tuple(demotions)))
        out += by_kind["swap_in"]
        if loads:
            out.append(BlockOp("load", tuple(loads)))
        if copies:
            out.append(BlockOp("copy", tuple(copies)))
        return out

    def _preempt(self, r: Request, mode: str, ops: list[BlockOp]) -> None:
        if mode == "swap":
            pairs = self.mgr.swap_out(r.request_id)
            if pairs:
                ops.append(BlockOp("swap_out", tuple(pairs)))
            r.status = RequestStatus.SWAPPED
            r.metrics.swaps += 1
        else:
            self.mgr.preempt(r.request_id)
            r.status = RequestStatus.PREEMPTED
            r.num_computed = 0
        r.metrics.preemptions += 1
        self.running.remove(r)
        bisect.insort(self.waiting, r, key=_ORDER)

    def _to_running(self, r: Request) -> None:
        self.waiting.remove(r)
        bisect.insort(self.running, r, key=_ORDER)
        r.status = RequestStatus.RUNNING

    def _grow(self, r: Request, k: int) -> _Entry:
        start = r.num_computed
        if not 1 <= k <= r.remaining:
            raise ValueError(f"request {r.request_id!r} has {r.remaining} token(s) to compute, not {k}")
        self.mgr.append(r.request_id, r.tokens[start:start + k])
        return _Entry(r, start, start + k)

    def _admit(self, r: Request, k: int, planned_hit: int) -> _Entry:
        """Admit ``tokens[:min(hit, planned_hit) + k]`` for the prefix hit it has now (the rest is
        appended later).

        Capped at the planned hit, or further while the hit runs through active blocks (free
        of charge: e.g. a running request's chunk appended earlier in this round): an earlier
        admission can publish blocks that reconnect cached blocks cut off from their prefix
        (their parent was evicted), and hits past that would pin evictable blocks the round
        never counted. Within the cap each extra hit replaces a fresh block, so the admission
        never takes more blocks than planned, and it never computes more than ``k`` tokens (a
        hit lost to an eviction ends it earlier).
        """
        mgr = self.mgr
        prompt = hashed_tokens(mgr, r)
        live = mgr.match(prompt).hit_tokens
        size = mgr.block_size
        if live > planned_hit:
            pool, hashes = mgr.pool, prompt.block_hashes()
            active = 0
            while active < live // size:
                block = pool.lookup(hashes[active])     # None: a host-tier hit, loaded at admission
                if block is None or not pool.ref_count[block]:
                    break
                active += 1
            live = min(live, max(planned_hit, active * size))
        upto = min(live + k, len(r.tokens))
        head = Prompt(prompt.hasher, prompt.tokens[:upto], upto, prompt.extra,
                      prompt.block_hashes()[:upto // size] if mgr.enable_caching else None)
        if r.request_id in mgr:           # preempted by recompute: its cached blocks come back as hits
            mgr.free(r.request_id)
        hit = mgr.admit(r.request_id, head)
        if r.admitted_before:
            r.metrics.reused_on_resume += hit
        else:
            r.metrics.prefix_hit_tokens = hit
            r.admitted_before = True
        r.num_computed = hit
        self._to_running(r)
        return _Entry(r, hit, upto, cached=hit)

    def _plan(self, entries: list[_Entry], ops: list[BlockOp], preempted) -> StepPlan:
        mgr = self.mgr
        scheduled = []
        for e in entries:
            r = e.request
            k = e.stop - e.start
            m = r.metrics
            m.computed_tokens += k
            m.recomputed_tokens += max(0, min(e.stop, r.computed_high) - e.start)
            r.computed_high = max(r.computed_high, e.stop)
            scheduled.append(ScheduledRequest(
                request_id=r.request_id, token_ids=tuple(r.tokens[e.start:e.stop]), start=e.start,
                slot_mapping=mgr.slot_mapping(r.request_id, e.start, e.stop), sample=e.stop == len(r.tokens),
                output_index=r.num_output, sampling=r.sampling,
                is_decode=k == 1 and e.start >= len(r.prompt) and e.stop == len(r.tokens),
                cached_tokens=e.cached))
        ids = [s.request_id for s in scheduled]
        tables = mgr.block_tables(ids) if ids else np.zeros((0, 0), dtype=np.int32)
        return StepPlan(step=self.step_count, block_size=mgr.block_size, requests=tuple(scheduled),
                        block_tables=tables, block_ops=tuple(ops), preempted=tuple(preempted))

    # -- after the executor ---------------------------------------------------------
    def update(self, plan: StepPlan, output: StepOutput, now: float | None = None) -> list[Request]:
        """Record a step's results; returns the requests that finished. Checks first, then changes.
        ``now``: the clock at the end of the step (the time in finished requests' session hints)."""
        tokens = {}
        for s in plan.requests:
            r = self.requests.get(s.request_id)
            if r is not None and (r.num_computed != s.start or len(r.tokens) < s.seq_len):
                raise ValueError(f"the plan of step {plan.step} does not match request {s.request_id!r} "
                                 f"({r.num_computed} token(s) computed, the plan starts at {s.start}): "
                                 "it was already applied, or is not the latest")
            if not s.sample:
                continue
            if s.request_id not in output.sampled:
                raise ValueError(f"the executor sampled no token for request {s.request_id!r}")
            value = output.sampled[s.request_id]
            try:
                if isinstance(value, (bool, str)):
                    raise TypeError
                token = operator.index(value)
            except TypeError:
                raise ValueError(f"the executor sampled {value!r} for request {s.request_id!r}, "
                                 "not an integer token id") from None
            if not 0 <= token < _MAX_TOKEN:
                raise ValueError(f"the executor sampled token id {token} for request {s.request_id!r}, "
                                 f"outside [0, 2**32)")
            tokens[s.request_id] = token
        finished = []
        for s in plan.requests:
            r = self.requests.get(s.request_id)
            if r is None:
                continue
            r.num_computed = s.seq_len
            if not s.sample:
                continue
            token = tokens[s.request_id]
            r.tokens.append(token)
            if r.eos_token_id is not None and token == r.eos_token_id:
                self._release(r, RequestStatus.FINISHED, "stop", now=now)
            elif r.num_output >= r.max_new_tokens:
                self._release(r, RequestStatus.FINISHED, "length", now=now)
            else:
                continue
            finished.append(r)
        return finished

    def fail(self, plan: StepPlan, exc: BaseException) -> list[Request]:
        """The executor raised on ``plan``: fail the requests it ran (and those it was
        swapping out), release their blocks, and drop cache entries it may have poisoned."""
        size = plan.block_size
        ids = [s.request_id for s in plan.requests] + [i for i, mode in plan.preempted if mode == "swap"]
        # Hashes this step gave blocks whose bytes its copies or writes were to bring: full blocks
        # computed, blocks swapped in or loaded (device), blocks demoted or swapped out (host tier).
        host = self.mgr.host
        moved = {"swap_in", "load", "demote"} | ({"swap_out"} if host is not None and host.cache else set())
        published = any(s.seq_len // size > s.start // size for s in plan.requests) or \
            any(op.kind in moved for op in plan.block_ops)
        requests = [self.requests[i] for i in ids if i in self.requests]
        self._fail_requests(requests, exc, published)
        return requests

    def _fail_requests(self, requests: list[Request], exc: BaseException, published: bool) -> None:
        for r in requests:
            if r.request_id in self.requests:
                self._release(r, RequestStatus.FAILED, "error", exc)
        # Block moves of a round that will not run: dropped (the host blocks loads read are freed).
        self.mgr.take_demotions()
        self.mgr.take_loads()
        self.mgr.take_copies()      # its targets were released with the failed requests
        if published and self.mgr.enable_caching:
            # Blocks published this step hold KV that was never (fully) written. The manager
            # cannot forget single hashes, so forget them all; requests holding blocks go back
            # to waiting and recompute (their cached blocks are gone with the hashes).
            for seq_id in self.mgr.reset_prefix_cache(preempt_running=True):
                r = self.requests.get(seq_id)
                if r is None:
                    # Not the scheduler's (its request was dropped while the manager kept it, or it
                    # was admitted to the manager directly): nothing of the scheduler to requeue.
                    continue
                self.running.remove(r)
                r.status = RequestStatus.PREEMPTED
                r.num_computed = 0
                r.metrics.preemptions += 1
                bisect.insort(self.waiting, r, key=_ORDER)
