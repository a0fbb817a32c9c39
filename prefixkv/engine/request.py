"""A generation request and its life cycle (no torch needed).

Token bookkeeping follows one rule: ``tokens`` is the prompt followed by every
generated token, and ``num_computed`` of them have their KV in the cache. A
step computes ``tokens[num_computed : num_computed + n]``; when that reaches
the end of ``tokens`` the last position's logits give the next token. So a
prompt chunk, a decode (the last sampled token, n = 1) and the re-prefill of a
request preempted by recompute (prompt + output so far) are the same thing.
The last sampled token of a finished request is never stored in the cache.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Hashable

from .metrics import RequestMetrics


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy (``temperature == 0``, the default) or temperature sampling.

    Temperature sampling is seeded per request and per output position
    (``seed``, ``output_index``), so a request draws the same tokens however it
    is batched, chunked or preempted.
    """

    temperature: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


class RequestStatus(enum.Enum):
    WAITING = "waiting"        # never admitted (or not arrived yet)
    RUNNING = "running"        # holds device blocks
    PREEMPTED = "preempted"    # KV dropped (recompute); waits to be re-prefilled
    SWAPPED = "swapped"        # KV in host blocks; waits to be swapped back in
    FINISHED = "finished"
    CANCELLED = "cancelled"
    FAILED = "failed"

    @property
    def done(self) -> bool:
        return self in (RequestStatus.FINISHED, RequestStatus.CANCELLED, RequestStatus.FAILED)


@dataclass(eq=False)
class Request:
    request_id: Hashable
    prompt: tuple[int, ...]
    max_new_tokens: int
    sampling: SamplingParams = GREEDY
    eos_token_id: int | None = None
    arrival_time: float = 0.0
    order: int = 0                                  # FCFS priority: smaller runs first
    tokens: list[int] = field(default_factory=list)  # prompt + output
    num_computed: int = 0
    computed_high: int = 0                          # most tokens ever computed (recompute accounting)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None                # "length", "stop", "cancelled", "error"
    error: BaseException | None = None
    admitted_before: bool = False
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    hashed: object = field(default=None, repr=False)   # the manager's Prompt of ``tokens`` (see capacity)

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not self.tokens:
            self.tokens = list(self.prompt)
        self.metrics.arrival = self.arrival_time
        self.metrics.prompt_tokens = len(self.prompt)

    @property
    def output(self) -> list[int]:
        return self.tokens[len(self.prompt):]

    @property
    def num_output(self) -> int:
        return len(self.tokens) - len(self.prompt)

    @property
    def remaining(self) -> int:
        """Tokens still to compute before the next token can be sampled."""
        return len(self.tokens) - self.num_computed

    @property
    def max_tokens(self) -> int:
        """The longest the cached sequence can get (the last sampled token is never stored)."""
        return len(self.prompt) + self.max_new_tokens - 1

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, prompt={len(self.prompt)}, "
                f"output={self.num_output}/{self.max_new_tokens}, computed={self.num_computed})")
