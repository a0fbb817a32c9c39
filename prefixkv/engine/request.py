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
import math
import numbers
import operator
from dataclasses import dataclass, field
from typing import Hashable

from ..errors import InvalidTokens
from .metrics import RequestMetrics

_MASK64 = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Greedy (``temperature == 0``, the default) or temperature sampling.

    Temperature sampling is seeded per request and per output position
    (the request's seed, ``output_index``), so a request draws the same tokens
    however it is batched, chunked or preempted.

    ``seed=None`` (the default): the engine gives every request its own random
    stream, derived from the engine's ``seed`` and the request's arrival number
    (``Engine.add_request`` stores the derived seed in ``request.sampling``).
    Identical prompts sent together then sample differently, and the same
    engine seed with the same requests added in the same order reproduces a
    run. An explicit ``seed`` is used as given: the same (seed, prompt,
    temperature) always draws the same tokens, even for two requests of one
    batch (pass distinct seeds for distinct samples). A standalone
    ``sampling.sample`` call treats ``seed=None`` as 0.
    """

    temperature: float = 0.0
    seed: int | None = None

    def __post_init__(self) -> None:
        t = self.temperature
        if isinstance(t, bool) or not isinstance(t, numbers.Real):
            raise TypeError(f"temperature must be a number, got {type(t).__name__} {t!r}")
        if not (math.isfinite(t) and t >= 0):     # inf would sample uniformly, whatever the logits
            raise ValueError(f"temperature must be a finite number >= 0, got {t}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise TypeError(f"seed must be an int or None, got {type(self.seed).__name__} {self.seed!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


GREEDY = SamplingParams()


def request_seed(engine_seed: int, arrival_number: int) -> int:
    """The sampling seed of the ``arrival_number``-th request (0-based) added to an engine seeded
    with ``engine_seed``, for requests that give no seed of their own (a splitmix64 mix, so
    neighbouring numbers and seeds give unrelated streams)."""
    z = (int(engine_seed) * 0xD1B54A32D192ED03 + (int(arrival_number) + 1) * 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) >> 1      # 63 bits: a valid torch.Generator seed as it is


class InvalidRequestTokens(InvalidTokens):
    """A request's prompt holds a token id the engine cannot run: not an integer, negative, or
    not below the model's vocabulary size. Raised by ``Engine.add_request`` (and ``generate``,
    before it adds anything): the engine is unchanged and its other requests keep running.

    ``request_id`` names the request (``None`` for ``generate``, which names the prompt by its
    ``prompt_index`` in the batch); ``token`` is the bad value, at ``position`` in the prompt;
    ``vocab_size`` is the model's (``None`` when the model does not say).
    """

    def __init__(self, request_id, token, position: int | None, vocab_size: int | None,
                 prompt_index: int | None = None, problem: str | None = None) -> None:
        self.request_id = request_id
        self.token = token
        self.position = position
        self.vocab_size = vocab_size
        self.prompt_index = prompt_index
        self.problem = problem          # what is wrong with the prompt as a whole (no one token)
        who = f"request {request_id!r}" if request_id is not None else f"prompt {prompt_index} of the batch"
        if problem is not None:
            super().__init__(f"{who}: {problem}")
            return
        if isinstance(token, bool) or not isinstance(token, int):
            # a tensor or numpy scalar is named by its dtype: "(Tensor)" did not say it was a bool
            dtype = getattr(token, "dtype", None)
            kind = type(token).__name__ if dtype is None else f"{type(token).__name__} of dtype {dtype}"
            why = f"is not an integer ({kind})"
        elif vocab_size is not None:
            why = f"is outside the model's vocabulary [0, {vocab_size})"
        else:
            why = "is outside [0, 2**32)"
        super().__init__(f"{who}: token id {token!r} at position {position} {why}")

    def __reduce__(self):
        return type(self), (self.request_id, self.token, self.position, self.vocab_size, self.prompt_index,
                            self.problem)


def check_prompt_tokens(prompt, vocab_size: int | None, request_id=None,
                        prompt_index: int | None = None) -> tuple[int, ...]:
    """``prompt`` as a non-empty tuple of ints, every one in ``[0, vocab_size)`` (``[0, 2**32)`` when
    the vocabulary size is unknown); ``InvalidRequestTokens`` naming the first bad one otherwise,
    ``ValueError`` for an empty prompt.
    Integers of any kind (numpy, 0-d torch) are accepted; floats, strings and booleans
    (``True`` is not token id 1) are not."""
    limit = 2**32 if vocab_size is None else min(int(vocab_size), 2**32)
    shape = getattr(prompt, "shape", None)
    if shape is not None and len(shape) != 1:
        # an [N, 1] tensor iterates as N one-element rows, each of which converts to an int
        raise InvalidRequestTokens(request_id, None, None, vocab_size, prompt_index,
                                   problem=f"the prompt must be one-dimensional (token ids), got a "
                                           f"{type(prompt).__name__} of shape {tuple(shape)}")
    try:
        values = iter(prompt)
    except TypeError:
        raise InvalidRequestTokens(request_id, None, None, vocab_size, prompt_index,
                                   problem=f"the prompt must be a sequence of token ids, got "
                                           f"{type(prompt).__name__}") from None
    tokens = []
    for position, value in enumerate(values):
        try:
            if type(value) is int:      # the common case; True/False (type bool) go the long way
                token = value
            elif isinstance(value, bool) or str(getattr(value, "dtype", "")) == "torch.bool":
                raise TypeError("a boolean is not a token id")
            else:
                token = operator.index(value)
        except TypeError:
            raise InvalidRequestTokens(request_id, value, position, vocab_size, prompt_index) from None
        if not 0 <= token < limit:
            raise InvalidRequestTokens(request_id, token, position, vocab_size, prompt_index)
        tokens.append(token)
    if not tokens:
        # Refused here, before ``generate`` adds any prompt (``Request`` refuses it too, later).
        who = f"request {request_id!r}" if request_id is not None else f"prompt {prompt_index} of the batch"
        raise ValueError(f"{who} has an empty prompt")
    return tuple(tokens)


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
    salt: str | int | None = None                   # cache isolation key: shares blocks only with equal salts
    # Session hints for the eviction policy (``prefixkv.policies.SessionHint``), given when it finishes:
    session: Hashable | None = None                 # the conversation / agent loop it belongs to
    end: str | None = None                          # why it ended, when the caller knows better
                                                    # ("tool_use"); else the engine's reason
    next_arrival: float | None = None               # the caller's estimate of the session's next request, s

    def __post_init__(self) -> None:
        if not self.prompt:
            raise ValueError(f"request {self.request_id!r} has an empty prompt")
        try:
            if isinstance(self.max_new_tokens, bool):
                raise TypeError
            self.max_new_tokens = operator.index(self.max_new_tokens)
        except TypeError:
            raise TypeError(f"max_new_tokens must be an int, got {type(self.max_new_tokens).__name__} "
                            f"{self.max_new_tokens!r}") from None
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.eos_token_id is not None:
            # A value no sampled token can equal ("2", [2, 3], -1) would never stop the request.
            try:
                if isinstance(self.eos_token_id, bool):
                    raise TypeError
                self.eos_token_id = operator.index(self.eos_token_id)
            except TypeError:
                raise TypeError(f"eos_token_id must be an int token id or None, got "
                                f"{type(self.eos_token_id).__name__} {self.eos_token_id!r}") from None
            if self.eos_token_id < 0:
                raise ValueError(f"eos_token_id must be >= 0, got {self.eos_token_id}")
        if self.arrival_time != self.arrival_time:      # NaN: never before nor after any clock
            raise ValueError(f"request {self.request_id!r}: arrival_time is NaN")
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
