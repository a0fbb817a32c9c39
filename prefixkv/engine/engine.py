"""The engine loop: scheduler -> executor -> scheduler, with a clock and metrics.

>>> from prefixkv.engine import Engine, TinyLlama
>>> engine = Engine.from_model(TinyLlama(), num_blocks=64, block_size=4)
>>> outputs = engine.generate([[1, 2, 3, 4, 5], [1, 2, 3, 9]], max_new_tokens=3)
>>> [len(o) for o in outputs]
[3, 3]

Requests join (``add_request``) and leave (finish, ``cancel``) between any two
steps. ``step()`` runs one scheduler round and one executor call; when the
executor raises, the requests of that step are failed, their blocks released,
and the exception propagates. ``generate`` cancels its unfinished requests on
the way out, whatever the reason.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from ..manager import KVCacheManager
from .cost import PreemptionCostModel
from .metrics import RunMetrics, WallClock, summarize
from .plan import Executor, StepPlan
from .request import GREEDY, Request, SamplingParams
from .scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True, slots=True)
class StepResult:
    plan: StepPlan
    elapsed_s: float
    new_tokens: dict              # request id -> token sampled this step
    finished: tuple[Request, ...]


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, *, clock=None) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock or WallClock()
        self.requests: dict[Hashable, Request] = {}     # every request added, finished ones included
        self.run_metrics = RunMetrics()
        self._ids = itertools.count()
        self._stepping = False
        self._deferred_cancels: list[Hashable] = []

    @classmethod
    def from_model(cls, model, *, num_blocks: int, block_size: int = 16, num_host_blocks: int = 0,
                   enable_caching: bool = True, policy="lru", hash_seed: int | None = 0,
                   config: SchedulerConfig | None = None, cost_model: PreemptionCostModel | None = None,
                   clock=None, impl: str = "auto") -> "Engine":
        """Manager, KV store (on the model's device), scheduler and model executor for ``model``
        (anything with ``config.kv_spec()``, ``device``, ``forward(ids, positions, attention)``
        and ``logits(hidden)``, like ``TinyLlama``)."""
        from ..storage import KVStore
        from .executor import ModelExecutor

        spec = model.config.kv_spec()
        mgr = KVCacheManager(num_blocks, block_size, policy=policy, hash_seed=hash_seed,
                             enable_caching=enable_caching, num_host_blocks=num_host_blocks)
        store = KVStore(spec, num_blocks, block_size, device=model.device)
        if num_host_blocks:
            store.allocate_host(num_host_blocks)
        cost_model = cost_model or PreemptionCostModel.for_spec(spec)
        scheduler = Scheduler(mgr, config, cost_model)
        return cls(scheduler, ModelExecutor(model, store, impl=impl), clock=clock)

    @property
    def manager(self) -> KVCacheManager:
        return self.scheduler.mgr

    # -- requests ----------------------------------------------------------------
    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int = 16, request_id: Hashable = None,
                    sampling: SamplingParams | None = None, eos_token_id: int | None = None,
                    arrival_time: float | None = None) -> Hashable:
        if request_id is None:
            request_id = f"req-{next(self._ids)}"
            while request_id in self.requests:
                request_id = f"req-{next(self._ids)}"
        elif request_id in self.requests and not self.requests[request_id].status.done:
            raise ValueError(f"request {request_id!r} is already live")
        request = Request(request_id, tuple(int(t) for t in prompt), max_new_tokens, sampling or GREEDY,
                          eos_token_id, self.clock.now() if arrival_time is None else float(arrival_time))
        self.scheduler.add(request)
        self.requests[request_id] = request
        return request_id

    def cancel(self, request_id: Hashable) -> bool:
        """Cancel a live request and release its blocks (after the current step, if one is running)."""
        if self._stepping:
            self._deferred_cancels.append(request_id)
            return request_id in self.scheduler.requests
        cancelled = self.scheduler.cancel(request_id)
        if cancelled:
            self.requests[request_id].metrics.finished = self.clock.now()
        return cancelled

    def request(self, request_id: Hashable) -> Request:
        return self.requests[request_id]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- stepping ----------------------------------------------------------------
    def step(self) -> StepResult:
        clock = self.clock
        now = clock.now()
        plan = self.scheduler.schedule(now)
        if plan.is_empty:
            upcoming = self.scheduler.next_arrival(now)
            if upcoming is not None and hasattr(clock, "advance_to"):
                clock.advance_to(upcoming)
            return StepResult(plan, 0.0, {}, ())
        for s in plan.requests:
            metrics = self.requests[s.request_id].metrics
            if metrics.first_scheduled is None:
                metrics.first_scheduled = now
        self._stepping = True
        try:
            try:
                output = self.executor.execute(plan)
                getattr(clock, "on_step", lambda _: None)(output.elapsed_s)
                finished = self.scheduler.update(plan, output)
            except BaseException as exc:
                failed = self.scheduler.fail(plan, exc)
                t = clock.now()
                for r in failed:
                    r.metrics.finished = t
                raise
        finally:
            self._stepping = False
            deferred, self._deferred_cancels = self._deferred_cancels, []
            for request_id in deferred:
                self.cancel(request_id)
        t = clock.now()
        new_tokens = {}
        for s in plan.requests:
            if s.sample:
                r = self.requests[s.request_id]
                new_tokens[s.request_id] = r.tokens[len(r.prompt) + s.output_index]
                r.metrics.token_times.append(t)
                if r.metrics.first_token is None:
                    r.metrics.first_token = t
        for r in finished:
            r.metrics.finished = t
        run = self.run_metrics
        run.steps += 1
        run.prefill_tokens += plan.num_prefill_tokens
        run.decode_tokens += plan.num_decode_tokens
        run.busy_s += output.elapsed_s
        run.max_batch_tokens = max(run.max_batch_tokens, plan.num_tokens)
        run.mixed_steps += bool(plan.num_prefill_tokens and plan.num_decode_tokens)
        return StepResult(plan, output.elapsed_s, new_tokens, tuple(finished))

    def run(self, max_steps: int | None = None) -> int:
        """Step until every request is done (or ``max_steps``); returns the steps taken."""
        steps = 0
        while self.has_unfinished and (max_steps is None or steps < max_steps):
            result = self.step()
            steps += 1
            if result.plan.is_empty:
                upcoming = self.scheduler.next_arrival(self.clock.now())
                if upcoming is None:
                    raise RuntimeError(f"no request can be scheduled: {list(self.scheduler.requests.values())}")
                if not hasattr(self.clock, "advance_to"):
                    time.sleep(max(0.0, min(upcoming - self.clock.now(), 0.01)))
        return steps

    def generate(self, prompts: Iterable[Sequence[int]], *, max_new_tokens: int = 16,
                 sampling: SamplingParams | None = None, eos_token_id: int | None = None) -> list[list[int]]:
        """Add the prompts, run to completion, return their outputs in order."""
        ids = []
        try:
            for prompt in prompts:
                ids.append(self.add_request(prompt, max_new_tokens=max_new_tokens, sampling=sampling,
                                            eos_token_id=eos_token_id))
            while any(not self.requests[i].status.done for i in ids):
                self.step()
        finally:
            for request_id in ids:
                if not self.requests[request_id].status.done:
                    self.cancel(request_id)
        return [self.requests[i].output for i in ids]

    def close(self) -> None:
        """Cancel every live request (their blocks go back to the pool)."""
        t = self.clock.now()
        for r in self.scheduler.abort_all():
            r.metrics.finished = t

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reporting ---------------------------------------------------------------
    def summary(self, wall_s: float | None = None) -> dict:
        return summarize(self.requests.values(), self.run_metrics, wall_s)
