"""Clocks and per-request / per-run metrics (no torch needed).

The engine reads time only through a clock, so tests and simulations are
deterministic: ``WallClock`` for real runs, ``SimulatedClock`` for tests and for
executors that model time instead of spending it (the engine advances a
simulated clock by each step's reported ``elapsed_s``).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Iterable, Protocol

import numpy as np


class Clock(Protocol):
    def now(self) -> float: ...


class WallClock:
    """``time.perf_counter``; steps take the time they take."""

    def now(self) -> float:
        return time.perf_counter()

    def on_step(self, elapsed_s: float) -> None:
        pass


class SimulatedClock:
    """Time moves only when told: by ``advance``/``advance_to``, or by the engine
    after every step (``on_step``: the executor's ``elapsed_s``)."""

    def __init__(self, start: float = 0.0) -> None:
        self.t = float(start)

    def now(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        if not math.isfinite(seconds) or seconds < 0:    # NaN would poison every later time
            raise ValueError(f"a step lasts a finite, non-negative time, not {seconds} s")
        self.t += seconds

    def advance_to(self, t: float) -> None:
        self.t = max(self.t, float(t))

    def on_step(self, elapsed_s: float) -> None:
        self.advance(elapsed_s)


@dataclass
class RequestMetrics:
    arrival: float = 0.0
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    prefix_hit_tokens: int = 0      # prompt tokens served by the prefix cache at first admission
    computed_tokens: int = 0        # every token this request put through the model, recompute included
    recomputed_tokens: int = 0      # of those, tokens computed again after a recompute preemption
    reused_on_resume: int = 0       # tokens a recompute-resume found still cached
    preemptions: int = 0
    swaps: int = 0                  # preemptions done by swapping to host memory

    @property
    def ttft(self) -> float | None:
        return None if self.first_token is None else self.first_token - self.arrival

    @property
    def itl(self) -> list[float]:
        """Inter-token latencies: gaps between consecutive output tokens."""
        t = self.token_times
        return [b - a for a, b in zip(t, t[1:])]

    @property
    def latency(self) -> float | None:
        return None if self.finished is None else self.finished - self.arrival


def percentile(values: Iterable[float], q: float) -> float | None:
    """Linear-interpolation percentile (numpy's default), None for no values."""
    data = sorted(values)
    if not data:
        return None
    rank = (len(data) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(data) - 1)
    return data[low] + (data[high] - data[low]) * (rank - low)


@dataclass
class RunMetrics:
    """Totals the engine keeps across steps."""

    steps: int = 0
    prefill_tokens: int = 0     # tokens computed that were prompt (or re-prefill) tokens
    decode_tokens: int = 0      # tokens computed that were the last sampled token
    busy_s: float = 0.0         # sum of the executor's elapsed_s
    max_batch_tokens: int = 0
    mixed_steps: int = 0        # steps that packed prefill chunks and decodes together

    def as_dict(self) -> dict:
        return dict(steps=self.steps, prefill_tokens=self.prefill_tokens, decode_tokens=self.decode_tokens,
                    busy_s=self.busy_s, max_batch_tokens=self.max_batch_tokens, mixed_steps=self.mixed_steps)


def summarize(requests: Iterable, run: RunMetrics, wall_s: float | None = None) -> dict:
    """One dict for a finished run: cache savings, preemptions, latency percentiles, speed."""
    reqs = list(requests)
    ms = [r.metrics for r in reqs]
    prompt = sum(m.prompt_tokens for m in ms)
    hits = sum(m.prefix_hit_tokens for m in ms)
    output = sum(r.num_output for r in reqs)
    ttfts = [m.ttft for m in ms if m.ttft is not None]
    itls = [x for m in ms for x in m.itl]
    seconds = run.busy_s if wall_s is None else wall_s
    return {
        "requests": len(reqs),
        "finished": sum(1 for r in reqs if r.finish_reason in ("length", "stop")),
        "prompt_tokens": prompt,
        "prefix_hit_tokens": hits,
        "prefix_hit_rate": hits / prompt if prompt else 0.0,
        "prefill_tokens_computed": run.prefill_tokens,
        "decode_tokens_computed": run.decode_tokens,
        "output_tokens": output,
        "preemptions": sum(m.preemptions for m in ms),
        "swaps": sum(m.swaps for m in ms),
        "recomputed_tokens": sum(m.recomputed_tokens for m in ms),
        "steps": run.steps,
        "mixed_steps": run.mixed_steps,
        "seconds": seconds,
        "output_tokens_per_s": output / seconds if seconds else None,
        "tokens_per_s": (prompt + output) / seconds if seconds else None,
        "ttft_p50_s": percentile(ttfts, 50), "ttft_p99_s": percentile(ttfts, 99),
        "itl_p50_s": percentile(itls, 50), "itl_p99_s": percentile(itls, 99),
    }


def time_weighted_mean(step_starts: list[float], last_end: float):
    """``mean(values)`` over time for per-step samples: the state a step leaves holds through the
    step and any idle wait until the next one starts, so long prefill steps and quiet spells count
    for what they last (a plain mean over steps would not)."""
    if not step_starts:
        return lambda values: 0.0
    starts = np.asarray(step_starts, dtype=np.float64)
    weights = np.maximum(np.append(starts[1:], last_end) - starts, 0.0)
    weights = weights / weights.sum() if weights.sum() > 0 else np.full(len(starts), 1.0 / len(starts))
    return lambda values: float(np.dot(weights, np.asarray(values, dtype=np.float64)))
