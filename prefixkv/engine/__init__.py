"""A packed generation engine over prefixkv's manager, KV store and paged attention.

Torch-free parts (scheduler, plan, metrics; the cost models are ``prefixkv.costs``) import eagerly; the
model, executor and engine factory need the ``torch`` extra and import on
first use. See ``plan.py`` for the scheduler/executor seam.
"""

from __future__ import annotations

from .capacity import Round, RoundCapacity, round_capacity
from .engine import Engine, StepResult
from .metrics import (RequestMetrics, RunMetrics, SimulatedClock, WallClock, percentile, summarize,
                      time_weighted_mean)
from .plan import BlockOp, Executor, PackedBatch, ScheduledRequest, StepOutput, StepPlan
from .request import GREEDY, InvalidRequestTokens, Request, RequestStatus, SamplingParams, request_seed
from .scheduler import Scheduler, SchedulerConfig

_LAZY = {
    "TinyLlama": "model", "TinyLlamaConfig": "model", "DenseCausalAttention": "model",
    "PagedAttentionBackend": "model", "ModelExecutor": "executor", "sample": "sampling",
}

__all__ = [
    "Engine", "StepResult", "Scheduler", "SchedulerConfig", "Round", "RoundCapacity", "round_capacity",
    "StepPlan", "ScheduledRequest", "BlockOp", "PackedBatch",
    "StepOutput", "Executor", "Request", "RequestStatus", "SamplingParams", "GREEDY", "InvalidRequestTokens",
    "request_seed", "RequestMetrics",
    "RunMetrics", "SimulatedClock", "WallClock", "percentile", "summarize", "time_weighted_mean", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
