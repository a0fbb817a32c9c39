"""The baseline paging replaces: reserve the maximum length per request, contiguously.

The design notes open with it: when each request reserves its maximum length up
front, two requests that use 8 slots can hold 24, and the empty reservations
keep other requests out. ``ReservedAllocator`` is that allocator (first-fit
over contiguous slot ranges, so it also fragments), and ``run_reserved`` serves
a trace with it: the same pool bytes, token budget, concurrency limit and cost
model as the paged runs, FCFS admission when a whole reservation fits, no
prefix cache (there are no blocks to share), no preemption (a reservation never
runs out).

What a request reserves (``reserve_tokens``): ``"max"`` (default) the longest
request of the trace (prompt + output), a stand-in for the model's context
limit, since a server does not know the output length in advance; an int (a
fixed maximum length); or ``"request"``, each request its own exact length (an
oracle: the best a reserving allocator could do).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Hashable, Sequence

from ..engine import SimulatedClock, percentile, time_weighted_mean
from ..sizing import format_size
from .costmodel import CostModel, StepCounts


class ReservedBaselineError(RuntimeError):
    """The reserved baseline cannot serve the trace at all (e.g. one reservation is larger than the
    whole pool). ``run_bench`` reports it next to the paged results instead of discarding them."""


class ReservedAllocator:
    """Contiguous reservations in a pool of ``capacity`` token slots (first fit)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity}")
        self.capacity = capacity
        self._free: list[tuple[int, int]] = [(0, capacity)] if capacity else []   # (start, length), by start
        self._held: dict[Hashable, list[int]] = {}                             # id -> [start, reserved, used]

    def reserve(self, seq_id: Hashable, slots: int) -> int | None:
        """The start slot of a ``slots``-long range for ``seq_id``, or None if no free range is long enough."""
        if seq_id in self._held:
            raise ValueError(f"{seq_id!r} already holds a reservation")
        if slots < 1:
            raise ValueError(f"a reservation takes at least one slot, not {slots}")
        for i, (start, length) in enumerate(self._free):
            if length >= slots:
                if length == slots:
                    del self._free[i]
                else:
                    self._free[i] = (start + slots, length - slots)
                self._held[seq_id] = [start, slots, 0]
                return start
        return None

    def append(self, seq_id: Hashable, n: int = 1) -> None:
        held = self._held[seq_id]
        if held[2] + n > held[1]:
            raise ValueError(f"{seq_id!r} would use {held[2] + n} of its {held[1]} reserved slots")
        held[2] += n

    def release(self, seq_id: Hashable) -> None:
        start, length, _ = self._held.pop(seq_id)
        i = bisect.bisect(self._free, (start, length))
        self._free.insert(i, (start, length))
        # merge with the neighbours
        if i + 1 < len(self._free) and start + length == self._free[i + 1][0]:
            self._free[i] = (start, length + self._free.pop(i + 1)[1])
        if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == start:
            prev = self._free.pop(i - 1)
            self._free[i - 1] = (prev[0], prev[1] + self._free[i - 1][1])

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._held

    @property
    def reserved_slots(self) -> int:
        return sum(h[1] for h in self._held.values())

    @property
    def used_slots(self) -> int:
        return sum(h[2] for h in self._held.values())

    @property
    def free_slots(self) -> int:
        return sum(length for _, length in self._free)

    @property
    def largest_free_range(self) -> int:
        return max((length for _, length in self._free), default=0)

    def stats(self) -> dict:
        return dict(capacity=self.capacity, requests=len(self._held), reserved_slots=self.reserved_slots,
                    used_slots=self.used_slots, empty_reserved_slots=self.reserved_slots - self.used_slots,
                    free_slots=self.free_slots, largest_free_range=self.largest_free_range)


@dataclass
class _Live:
    request_id: int
    arrival: float
    prompt_len: int
    max_new: int
    computed: int = 0
    outputs: int = 0
    token_times: list[float] = field(default_factory=list)
    first_token: float | None = None
    finished: float | None = None

    @property
    def length(self) -> int:           # prompt + sampled tokens
        return self.prompt_len + self.outputs


def reservation_size(requests: Sequence, reserve_tokens: int | str, capacity: int | None = None) -> callable:
    """Tokens a request reserves. ``"max"``: the longest request that fits a pool of ``capacity``
    tokens (a longer one reserves its own length, so it is rejected, as the paged runs reject it)."""
    def own(r) -> int:
        return len(r.prompt) + r.max_new_tokens - 1

    if reserve_tokens == "max":
        longest = max((own(r) for r in requests if capacity is None or own(r) <= capacity), default=1)
        return lambda r: longest if own(r) <= longest else own(r)
    if reserve_tokens == "request":
        return lambda r: len(r.prompt) + r.max_new_tokens - 1
    if isinstance(reserve_tokens, int) and reserve_tokens > 0:
        return lambda r: max(reserve_tokens, len(r.prompt) + r.max_new_tokens - 1)
    raise ValueError(f"reserve_tokens must be 'max', 'request' or a positive int, got {reserve_tokens!r}")


def _pool_flag(num_bytes: int) -> str:
    """A ``--pool`` value of at least ``num_bytes``, rounded up to a whole GiB (MiB below 1 GiB)."""
    unit, scale = ("GiB", 2**30) if num_bytes >= 2**30 else ("MiB", 2**20)
    return f"--pool {-(-num_bytes // scale)}{unit}"


def _nothing_fits(requests: Sequence, size_of, reserve_tokens: int | str, capacity: int, cfg) -> str:
    """Why no request of the trace can be admitted: the reservation, the pool and the fix."""
    need = min(size_of(r) for r in requests)
    kv = f"{need:,} tokens = {format_size(need * cfg.spec.bytes_per_token)} of KV"
    pool = f"the whole {format_size(cfg.pool_bytes)} pool ({capacity:,} tokens)"
    if reserve_tokens in ("request", "max"):   # "max" reserves the longest request that fits: none does
        return (f"reserved baseline not run: even the shortest request needs {kv}, more than {pool}. "
                f"Use {_pool_flag(need * cfg.spec.bytes_per_token)} or more.")
    return (f"reserved baseline not run: with --reserve-tokens {reserve_tokens} every request reserves {kv}, "
            f"more than {pool}. Use --reserve-tokens request (each request reserves its own length) or "
            f"{_pool_flag(need * cfg.spec.bytes_per_token)} or more.")


def run_reserved(requests: Sequence, cfg, *, reserve_tokens: int | str = "max") -> dict:
    """Serve ``requests`` (``BenchRequest``) with reserve-max-length allocation; a summary dict.

    Requests whose reservation exceeds the pool are rejected (``rejected_too_long``); when that is
    every request, ``ReservedBaselineError`` says so (with the reservation and pool sizes)."""
    bpt = cfg.spec.bytes_per_token
    capacity = cfg.pool_bytes // bpt
    alloc = ReservedAllocator(capacity)
    cost = CostModel(cfg.params, bpt)
    size_of = reservation_size(requests, reserve_tokens, capacity)
    if requests and all(size_of(r) > capacity for r in requests):
        raise ReservedBaselineError(_nothing_fits(requests, size_of, reserve_tokens, capacity, cfg))
    chunk_cap = cfg.max_prefill_chunk or cfg.max_num_batched_tokens
    clock = SimulatedClock()
    pending = sorted(requests, key=lambda r: (r.arrival, r.request_id))
    t0 = pending[0].arrival if pending else 0.0
    clock.advance_to(t0)
    waiting: list = []
    running: list[_Live] = []
    done: list[_Live] = []
    rejected = 0
    i = n = len(pending)
    i = 0
    running_samples: list[int] = []
    running_spans: list[float] = []
    running_values: list[int] = []
    step_starts: list[float] = []
    reserved_samples: list[int] = []
    used_samples: list[int] = []
    steps = 0
    while i < n or waiting or running:
        now = clock.now()
        while i < n and pending[i].arrival <= now:
            r = pending[i]
            i += 1
            if size_of(r) > capacity:
                rejected += 1
            else:
                waiting.append(r)
        budget = cfg.max_num_batched_tokens
        work: list[tuple[_Live, int]] = []
        for live in running:
            if budget <= 0:
                break
            k = min(live.length - live.computed, budget, chunk_cap)
            work.append((live, k))
            budget -= k
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            r = waiting[0]
            if alloc.reserve(r.request_id, size_of(r)) is None:
                break                          # first come, first served: nobody overtakes
            waiting.pop(0)
            live = _Live(r.request_id, r.arrival, len(r.prompt), r.max_new_tokens)
            running.append(live)
            k = min(live.prompt_len, budget, chunk_cap)
            work.append((live, k))
            budget -= k
        if not work:
            if i < n:
                clock.advance_to(pending[i].arrival)
                continue
            if not waiting and not running:
                break                          # the last arrivals were all rejected
            raise ReservedBaselineError(
                f"reserved baseline: nothing can run ({len(waiting)} waiting, {len(running)} running, "
                f"largest free range {alloc.largest_free_range:,} of {capacity:,} tokens)")
        prefill = decode = kv_tokens = 0
        for live, k in work:
            if k == 1 and live.computed >= live.prompt_len:
                decode += 1
            else:
                prefill += k
            live.computed += k
            alloc.append(live.request_id, k)
            kv_tokens += live.computed
        elapsed = cost.step_time(StepCounts(prefill_tokens=prefill, decode_tokens=decode,
                                            kv_bytes_read=kv_tokens * bpt, table_entries=len(work)))
        step_starts.append(clock.now() - t0)
        clock.advance(elapsed)
        steps += 1
        t = clock.now()
        finished_now = 0
        for live, _ in work:
            if live.computed == live.length:          # the last known token's logits: sample one
                live.outputs += 1
                live.token_times.append(t)
                if live.first_token is None:
                    live.first_token = t
                if live.outputs >= live.max_new:
                    live.finished = t
                    alloc.release(live.request_id)
                    running.remove(live)
                    done.append(live)
                    finished_now += 1
        # running during the step (a request that finished in it ran in it), then after it
        running_samples.append(len(running) + finished_now)
        running_spans.extend((step_starts[-1], t - t0))
        running_values.extend((running_samples[-1], len(running)))
        reserved_samples.append(alloc.reserved_slots)
        used_samples.append(alloc.used_slots)
    ttfts = [d.first_token - d.arrival for d in done]
    itls = [b - a for d in done for a, b in zip(d.token_times, d.token_times[1:])]
    makespan = max((d.finished for d in done), default=t0) - t0
    out_tokens = sum(d.outputs for d in done)
    mean = time_weighted_mean(step_starts, clock.now() - t0)
    reserved = max((size_of(r) for r in pending if size_of(r) <= capacity), default=0)
    return dict(
        allocator="reserved-max-length", reserve_tokens=reserve_tokens if reserve_tokens != "max" else
        f"max ({reserved} tokens)", capacity_slots=capacity,
        requests=len(requests), completed=len(done), rejected_too_long=rejected,
        concurrency_mean=time_weighted_mean(running_spans, clock.now() - t0)(running_values),
        concurrency_max=max(running_samples, default=0),
        reserved_fraction_mean=mean(reserved_samples) / capacity if capacity else 0.0,
        used_fraction_mean=mean(used_samples) / capacity if capacity else 0.0,
        ttft_p50_s=percentile(ttfts, 50), ttft_p99_s=percentile(ttfts, 99),
        itl_p50_s=percentile(itls, 50), itl_p99_s=percentile(itls, 99),
        makespan_s=makespan, completed_per_s=len(done) / makespan if makespan else None,
        output_tokens_per_s=out_tokens / makespan if makespan else None,
        prefix_hit_rate=0.0, steps=steps,
        _ttfts=ttfts, _itls=itls, _running=running_samples,
    )
