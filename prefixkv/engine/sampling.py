"""Greedy and seeded temperature sampling (torch).

A temperature sample for output position ``i`` of a request draws from a
generator seeded with ``(seed, i)``: the same token whatever the batch, the
chunking or a preemption in between, and the same as a standalone loop that
calls ``sample`` with the same arguments.

``seed`` is the request's: the engine resolves ``SamplingParams(seed=None)``
to a per-request seed when the request is added (see ``SamplingParams`` and
``Engine``), so ``request.sampling`` is what to pass here to reproduce a
request. A standalone call with ``seed=None`` uses seed 0.
"""

from __future__ import annotations

import torch

from .request import SamplingParams

_MASK = 2**63 - 1


def _seed(seed: int, output_index: int) -> int:
    return (seed * 0x9E3779B97F4A7C15 + (output_index + 1) * 0xBF58476D1CE4E5B9) & _MASK


def sample(logits: torch.Tensor, params: SamplingParams, output_index: int) -> int:
    """The next token from a ``[vocab]`` row of logits: argmax, or a seeded draw at ``params.temperature``."""
    if params.greedy:
        return int(torch.argmax(logits))
    gen = torch.Generator(device="cpu").manual_seed(_seed(0 if params.seed is None else params.seed, output_index))
    logits = logits.detach().to("cpu", torch.float64)
    certain = torch.isposinf(logits)
    if certain.any():
        # A +inf logit (a half-precision overflow) outweighs every finite one at any temperature:
        # the draw is uniform over the +inf entries (softmax would give NaN and fail the step).
        return int(torch.multinomial(certain.to(torch.float64), 1, generator=gen))
    scaled = logits / params.temperature
    finite = torch.isfinite(logits)
    if not torch.isfinite(scaled[finite]).all():
        # A tiny temperature overflows logits / t to +-inf, and softmax to NaN: shift by the max
        # first (every scaled logit <= 0, the max exactly 0), the limit the draw tends to.
        scaled = (logits - logits[finite].max()) / params.temperature
    probs = torch.softmax(scaled, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
