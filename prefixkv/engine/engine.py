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

Ctrl-C: the engine changes its bookkeeping with SIGINT held back (``prefixkv.interrupts.held``), and lets
it through only around the executor's forward (failed as any executor error is). An interrupt
therefore surfaces as ``KeyboardInterrupt`` with the manager and the scheduler whole: the
requests of an interrupted step are failed and released, ``generate`` cancels the rest, and the
engine serves later requests as before.

Prompts are checked when they are added: token ids must be integers in
``[0, vocab_size)`` when the executor knows the model's vocabulary size
(``ModelExecutor.vocab_size``), ``[0, 2**32)`` otherwise. A bad one raises
``InvalidRequestTokens`` naming the request and the id, and the engine is
unchanged (``generate`` checks every prompt before adding any), so one bad
request never fails a step that other requests share.

Sampling: requests whose ``SamplingParams`` give no ``seed`` get their own
stream, ``request_seed(engine.seed, n)`` for the ``n``-th request added
(stored in ``request.sampling``): identical prompts sample differently, and an
engine with the same ``seed`` given the same requests in the same order
reproduces its outputs. An explicit ``seed`` is used as given, so equal
(seed, prompt) pairs draw equal tokens.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Hashable, Iterable, Sequence

from ..manager import KVCacheManager
from ..policies import SessionHint
from ..costs import PreemptionCostModel
from .metrics import RunMetrics, WallClock, summarize
from ..interrupts import held, let_through
from .plan import Executor, StepPlan
from .request import GREEDY, Request, SamplingParams, check_prompt_tokens, request_seed
from .scheduler import Scheduler, SchedulerConfig


@dataclass(frozen=True, slots=True)
class StepResult:
    plan: StepPlan
    elapsed_s: float
    new_tokens: dict              # request id -> token sampled this step
    finished: tuple[Request, ...]


class Engine:
    def __init__(self, scheduler: Scheduler, executor: Executor, *, clock=None, seed: int = 0,
                 remote=None) -> None:
        """``seed``: the base of the per-request sampling seeds of requests that give none.
        The tiers below the host tier in the manager's stack (``manager.tiers``: a disk tier, a
        remote tier, bound to the executor's KV store) are prefetched before each step's
        admissions and written back after each step; ``close()`` flushes and closes them.
        ``remote``: a bound ``prefixkv.tiers.remote.RemoteTier`` on the scheduler's manager, added
        at the bottom of its stack if it is not there yet."""
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise TypeError(f"seed must be an int, got {type(seed).__name__} {seed!r}")
        if remote is not None and remote.manager is not scheduler.mgr:
            raise ValueError("the remote tier was built for another manager than the scheduler's")
        tiers = scheduler.mgr.tiers
        if remote is not None and remote not in tiers.lower:
            tiers.attach(remote)
        self.tiers = tiers
        self._remote_step = None
        if tiers.lower:
            from .remote import RemoteStep
            self._remote_step = RemoteStep(tiers)
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock or WallClock()
        self.seed = seed
        self.requests: dict[Hashable, Request] = {}     # every request added, finished ones included
        self.run_metrics = RunMetrics()
        self._next_id = 0           # of the automatic ids "req-N"
        self._num_added = 0         # requests added so far: the arrival number of per-request seeds
        self._stepping = False
        self._deferred_cancels: list[Hashable] = []

    @classmethod
    def from_model(cls, model, *, num_blocks: int, block_size: int = 16, num_host_blocks: int = 0,
                   host_cache: bool = False, host_policy="lru",
                   enable_caching: bool = True, policy="lru", hash_seed: int | None = 0,
                   config: SchedulerConfig | None = None, cost_model: PreemptionCostModel | None = None,
                   clock=None, impl: str = "auto", seed: int = 0, remote: str | None = None,
                   remote_config=None, disk=None, disk_bytes: int | None = None, disk_config=None) -> "Engine":
        """Manager, KV store (on the model's device), scheduler and model executor for ``model``
        (anything with ``config.kv_spec()``, ``device``, ``forward(ids, positions, attention)``
        and ``logits(hidden)``, like ``TinyLlama``; see ``prefixkv.engine.model.EngineModel``).
        A model that tells its ``vocab_size`` (or ``config.vocab_size``) gets its prompts checked
        against it. ``seed``: the base of the per-request sampling seeds (see the module docs).
        ``num_host_blocks``: pinned host memory for swapping and, with ``host_cache``, the host
        tier: blocks evicted from the device pool are kept there and loaded back on a later hit.
        ``disk``: a directory for a persistent disk tier below the host tier, at most
        ``disk_bytes`` of blocks (default ``prefixkv.tiers.stack.DEFAULT_DISK_BYTES``; see
        ``prefixkv.tiers.disk_tier``): an engine built again on it serves what this one wrote.
        ``remote``: a shared block store below the host (and disk) tier (``redis://host:port/db``,
        ``unix:///path.sock``, ``redis+cluster://host:port,...``; extra ``[redis]``), see
        ``prefixkv.tiers.remote``. Either implies the host tier (``host_cache=True``), sized
        ``2 * num_blocks`` when ``num_host_blocks`` is 0, and a pinned hash seed: with
        ``hash_seed=None`` the seed is derived from the weights digest, dtype and block size
        (``derived_hash_seed``), so every process of the same model agrees.
        ``remote_config``: a ``RedisStoreConfig`` (timeouts, queue bounds, TTL); ``disk_config``:
        a ``DiskStoreConfig`` (fsync policy, queue bounds). The stack is built by
        ``prefixkv.tiers.stack``, as every face builds it."""
        from ..kv.storage import KVStore
        from ..tiers.stack import bind_stack, plan_stack
        from .executor import ModelExecutor

        spec = model.config.kv_spec()
        plan = plan_stack(num_blocks=num_blocks, block_size=block_size, dtype=spec.dtype,
                          num_host_blocks=num_host_blocks, host_cache=host_cache, host_policy=host_policy,
                          hash_seed=hash_seed, enable_caching=enable_caching, model=model, disk=disk,
                          disk_bytes=disk_bytes, disk_config=disk_config, remote=remote, remote_config=remote_config)
        mgr = KVCacheManager(num_blocks, block_size, policy=policy, hash_seed=plan.hash_seed,
                             enable_caching=enable_caching, tiers=plan.tiers)
        store = KVStore(spec, num_blocks, block_size, device=model.device)
        cost_model = cost_model or PreemptionCostModel.for_spec(spec)
        scheduler = Scheduler(mgr, config, cost_model)
        bind_stack(mgr, store, plan)
        try:
            return cls(scheduler, ModelExecutor(model, store, impl=impl), clock=clock, seed=seed)
        except BaseException:
            mgr.tiers.close(flush_timeout_s=0.0)
            raise

    @property
    def remote(self):
        """The remote tier of the manager's stack (None: none)."""
        return self.tiers.tier("REMOTE")

    @property
    def disk(self):
        """The disk tier of the manager's stack (None: none)."""
        return self.tiers.tier("DISK")

    @property
    def manager(self) -> KVCacheManager:
        return self.scheduler.mgr

    # -- requests ----------------------------------------------------------------
    @property
    def vocab_size(self) -> int | None:
        """The model's vocabulary size as the executor reports it (None: unknown)."""
        return getattr(self.executor, "vocab_size", None)

    def add_request(self, prompt: Sequence[int], *, max_new_tokens: int = 16, request_id: Hashable = None,
                    sampling: SamplingParams | None = None, eos_token_id: int | None = None,
                    arrival_time: float | None = None, salt: str | int | None = None,
                    session: Hashable | None = None, end: str | None = None,
                    next_arrival: float | None = None) -> Hashable:
        """Queue a request; returns its id. ``InvalidRequestTokens`` (engine unchanged) when the
        prompt holds an id that is not an integer in ``[0, vocab_size)``. ``salt`` isolates its
        cache blocks (a tenant): only requests with an equal salt share them. ``session`` (and
        optionally ``end``, e.g. ``"tool_use"`` when the caller knows the answer ends in a tool
        call, and ``next_arrival`` seconds) become the session hint its blocks are released with
        (``prefixkv.policies.SessionHint``), for policies such as ``session``; they are checked here
        (``InvalidArgument``, engine unchanged), not when the request finishes."""
        if session is not None:
            SessionHint(session, end=end, time=0.0, next_arrival=next_arrival)      # raises on a bad field
        with held():
            request_id = self._add(prompt, max_new_tokens=max_new_tokens, request_id=request_id,
                                   sampling=sampling, eos_token_id=eos_token_id, arrival_time=arrival_time,
                                   salt=salt)
            request = self.requests[request_id]
            request.session, request.end, request.next_arrival = session, end, next_arrival
        return request_id

    def _add(self, prompt, *, max_new_tokens, request_id, sampling, eos_token_id, arrival_time,
             tokens: tuple[int, ...] | None = None, salt: str | int | None = None) -> Hashable:
        next_id = None
        if request_id is None:
            n = self._next_id
            while f"req-{n}" in self.requests:
                n += 1
            request_id, next_id = f"req-{n}", n + 1
        elif request_id in self.requests and not self.requests[request_id].status.done:
            raise ValueError(f"request {request_id!r} is already live")
        if tokens is None:
            tokens = check_prompt_tokens(prompt, self.vocab_size, request_id)
        sampling = sampling or GREEDY
        if not sampling.greedy and sampling.seed is None:
            sampling = dataclasses.replace(sampling, seed=request_seed(self.seed, self._num_added))
        request = Request(request_id, tokens, max_new_tokens, sampling,
                          eos_token_id, self.clock.now() if arrival_time is None else float(arrival_time),
                          salt=salt)
        self.scheduler.add(request)
        # Only now that the request is in: nothing above changed the engine if it raised.
        self.requests[request_id] = request
        self._num_added += 1
        if next_id is not None:
            self._next_id = next_id
        return request_id

    def cancel(self, request_id: Hashable) -> bool:
        """Cancel a live request and release its blocks (after the current step, if one is running)."""
        if self._stepping:
            self._deferred_cancels.append(request_id)
            return request_id in self.scheduler.requests
        with held():
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
        """One scheduler round and one executor call. Ctrl-C is held back except during the
        executor's call: it surfaces as ``KeyboardInterrupt`` once the step's bookkeeping is whole
        (the step's requests failed when it interrupted the executor)."""
        with held():
            return self._step()

    def _step(self) -> StepResult:
        clock = self.clock
        now = clock.now()
        if self._remote_step is not None:
            self._remote_step.before(self.scheduler, now)     # staged in the host tier, verified
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
                with let_through():
                    output = self.executor.execute(plan)
                getattr(clock, "on_step", lambda _: None)(output.elapsed_s)
                finished = self.scheduler.update(plan, output, clock.now())
            except BaseException as exc:
                if self._remote_step is not None:
                    self._remote_step.discard()      # published this step, never written
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
        if self._remote_step is not None:
            self._remote_step.after()        # this step's KV is written: queue it (never waits)
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
            start = self.clock.now()
            result = self.step()
            steps += 1
            if result.plan.is_empty:
                # Arrivals after the step's start: an empty step may already have moved a
                # simulated clock to the next one, which then runs in the next step.
                upcoming = self.scheduler.next_arrival(start)
                if upcoming is None:
                    raise RuntimeError(f"no request can be scheduled: {list(self.scheduler.requests.values())}")
                if not hasattr(self.clock, "advance_to"):
                    time.sleep(max(0.0, min(upcoming - self.clock.now(), 0.01)))
        return steps

    def generate(self, prompts: Iterable[Sequence[int]], *, max_new_tokens: int = 16,
                 sampling: SamplingParams | None = None, eos_token_id: int | None = None) -> list[list[int]]:
        """Add the prompts, run to completion, return their outputs in order.

        Every prompt is checked before any is added: a bad token id raises
        ``InvalidRequestTokens`` (naming the prompt by its index) with nothing added."""
        vocab_size = self.vocab_size
        checked = [check_prompt_tokens(prompt, vocab_size, prompt_index=i) for i, prompt in enumerate(prompts)]
        ids = []
        try:
            for tokens in checked:
                with held():          # added and recorded in ids, or neither
                    ids.append(self._add(tokens, max_new_tokens=max_new_tokens, request_id=None,
                                         sampling=sampling, eos_token_id=eos_token_id, arrival_time=None,
                                         tokens=tokens))
            while any(not self.requests[i].status.done for i in ids):
                self.step()
        finally:
            with held():
                for request_id in ids:
                    if not self.requests[request_id].status.done:
                        self.cancel(request_id)
        return [self.requests[i].output for i in ids]

    def close(self) -> None:
        """Cancel every live request (their blocks go back to the pool); close the tiers below the host
        tier (what they queued is written, bounded)."""
        try:
            with held():
                t = self.clock.now()
                live = [r for r in self.requests.values() if not r.status.done]
                try:
                    self.scheduler.abort_all()   # releases every request even when one release raises
                finally:
                    for r in live:
                        r.metrics.finished = t
        finally:
            if self.tiers.lower:
                self.tiers.close()           # writes what is queued (bounded), stops their threads
            self._remote_step = None

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- reporting ---------------------------------------------------------------
    def summary(self, wall_s: float | None = None) -> dict:
        return summarize(self.requests.values(), self.run_metrics, wall_s)
