"""A deterministic simulator of N replicas behind a router (no ZMQ, no msgspec).

Each replica is a real ``KVCacheManager`` (events on). Requests arrive at the trace's
timestamps and are routed one by one; the router sees the KV index (fed by the replicas'
events, ``event_delay`` requests late if asked, with predicted inserts for what it routed)
and each replica's load (queued prefill tokens and running requests, which a router tracks
from its own dispatches).

A replica serves its queue first come, first served: one prefill at a time, costing
``step_overhead_s + uncached tokens x prefill_s_per_token + running x decode_s_per_token``
(a step that also advances the running decodes); then the request decodes alongside the
others for ``output tokens x (step_overhead_s + decode_s_per_token)`` while holding its
blocks (prompt and output), and is freed. A request whose blocks do not fit waits at the
head of its queue until decodes free enough; one larger than the whole replica is counted
as all misses and dropped. Queue wait = prefill start - arrival.

Hit rate counts blocks as ``prefixkv replay`` does: a block hits only if every earlier
block of the request hit; a hashed trace's last, partly filled block counts too.

The two references of ``prefixkv fleet``: round robin with the same replicas, and one
manager with N x the capacity serving the whole trace N x as fast (a pooled cache, the
hit rate a perfect router could approach).
"""

from __future__ import annotations

import heapq
import math
from collections import Counter, deque
from dataclasses import dataclass, field, replace

import numpy as np

from ..checks import integer, real
from ..costs import CostParams, load_params
from ..errors import InvalidArgument
from ..manager import KVCacheManager
from .index import KVIndex
from .router import RouterConfig, WorkerLoad, make_router

HASH_SEED = 0   # the fleet's one pinned hash seed: router and replicas hash alike


@dataclass(frozen=True)
class FleetConfig:
    replicas: int
    capacity: int                    # blocks per replica
    router: str = "kv-aware+guard"
    event_delay: int = 0             # requests routed before a replica's events reach the index
    predict: bool = True             # predicted inserts for routed requests
    predict_ttl_s: float = 30.0
    params: CostParams = field(default_factory=lambda: load_params("h200"))
    policy: str = "lru"
    lower_tier_credit: float = 0.5
    decode_share: float = 0.5
    guard_slack: float = 4.0
    seed: int = 0
    speedup: float = 1.0             # the pooled reference runs this many times faster

    def __post_init__(self) -> None:
        # Every number checked here, naming its field: nan, inf, booleans and fractions were taken
        # as given (speedup 0 divided by zero mid-run, nan or negative speedups gave meaningless costs).
        integer("replicas", self.replicas, low=1)
        integer("capacity", self.capacity, low=1)
        integer("event_delay", self.event_delay, low=0)
        integer("seed", self.seed)
        real("speedup", self.speedup, low=0, low_open=True)
        real("lower_tier_credit", self.lower_tier_credit, low=0, high=1)
        real("decode_share", self.decode_share, low=0)      # (inf x 0 running: nan loads)
        real("predict_ttl_s", self.predict_ttl_s, low=0, low_open=True, finite=False)   # inf: never expire
        real("guard_slack", self.guard_slack, low=0, finite=False)                      # inf: no guard


@dataclass
class FleetResult:
    router: str
    replicas: int
    capacity: int
    event_delay: int
    requests: int = 0
    block_accesses: int = 0
    block_hits: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    oversized_requests: int = 0
    per_replica: list[int] = field(default_factory=list)
    waits: list[float] = field(default_factory=list, repr=False)
    decisions: Counter = field(default_factory=Counter)

    @property
    def hit_rate(self) -> float:
        return self.block_hits / self.block_accesses if self.block_accesses else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    @property
    def shares(self) -> list[float]:
        total = sum(self.per_replica)
        return [n / total if total else 0.0 for n in self.per_replica]

    @property
    def busiest_share(self) -> float:
        return max(self.shares, default=0.0)

    def wait_quantile(self, q: float) -> float:
        return float(np.quantile(self.waits, q)) if self.waits else 0.0

    def as_dict(self) -> dict:
        return dict(router=self.router, replicas=self.replicas, capacity=self.capacity,
                    event_delay=self.event_delay, requests=self.requests, hit_rate=self.hit_rate,
                    token_hit_rate=self.token_hit_rate, shares=self.shares, busiest_share=self.busiest_share,
                    p50_wait_s=self.wait_quantile(0.5), p99_wait_s=self.wait_quantile(0.99),
                    mean_wait_s=float(np.mean(self.waits)) if self.waits else 0.0,
                    oversized_requests=self.oversized_requests, decisions=dict(self.decisions))


@dataclass(slots=True)
class _Job:
    index: int                  # request index in the trace
    prompt: object
    accesses: int               # block accesses the request counts
    last_block_tokens: int | None
    expected_prefill_tokens: int   # what the router expected to compute (its queued-load figure)


class _Replica:
    def __init__(self, worker_id: str, capacity: int, block_size: int, policy: str) -> None:
        self.worker_id = worker_id
        self.mgr = KVCacheManager(capacity, block_size, policy=policy, hash_seed=HASH_SEED, record_events=True,
                                   index="dict")     # the trace's integer ids
        self.waiting: deque[_Job] = deque()
        self.prefilling = False
        self.running = 0
        self.queued_prefill_tokens = 0

    def load(self) -> WorkerLoad:
        return WorkerLoad(self.worker_id, self.queued_prefill_tokens, self.running + len(self.waiting),
                          self.mgr.pool.num_active)


def _prompt_for(mgr: KVCacheManager, request, block_size: int):
    """(prompt, block accesses, tokens in the last accessed block or None), as replay counts."""
    if request.tokens is not None:
        return mgr.prompt(request.tokens, salt=request.salt), len(request.tokens) // block_size, None
    hashes = request.block_hashes
    n = len(hashes)
    return mgr.prompt_from_hashes(hashes, n * block_size), n, (request.input_length - (n - 1) * block_size
                                                               if n else 0)


def simulate(trace, config: FleetConfig) -> FleetResult:
    return _Simulation(trace, config).run()


class _Simulation:
    def __init__(self, trace, config: FleetConfig) -> None:
        last = -math.inf
        for i, request in enumerate(trace.requests):
            if request.timestamp < last:
                raise InvalidArgument("trace", f"request {i}: timestamp {request.timestamp} is earlier than the "
                                               f"previous request's {last}: the simulator takes requests in "
                                               "arrival order")
            last = request.timestamp
        self.trace = trace
        self.cfg = config
        size = trace.block_size
        self.size = size
        self.params = _faster(config.params, config.speedup)
        self.replicas = [_Replica(f"replica-{i}", config.capacity, size, config.policy)
                         for i in range(config.replicas)]
        self.by_id = {r.worker_id: r for r in self.replicas}
        self.index = KVIndex(predict_ttl=config.predict_ttl_s)
        for r in self.replicas:
            self.index.add_worker(r.worker_id)
        self.router = make_router(config.router, self.index, RouterConfig(
            block_size=size, lower_tier_credit=config.lower_tier_credit, decode_share=config.decode_share,
            guard_slack=config.guard_slack, seed=config.seed))
        self.result = FleetResult(config.router, config.replicas, config.capacity, config.event_delay,
                                  per_replica=[0] * config.replicas)
        self.timeline: list[tuple[float, int, str, str, object]] = []   # (time, order, kind, replica, job)
        self.order = 0
        self.routed = 0
        self.mail: deque[tuple[int, str, list]] = deque()   # (deliver once routed >= this, replica, events)
        # Simulated time starts at the first request: a request arrives at its timestamp - start.
        self.start = trace.requests[0].timestamp if trace.requests else 0.0

    # -- events to the index -------------------------------------------------
    def _emit(self, replica: _Replica) -> None:
        events = replica.mgr.drain_events()
        if events:
            self.mail.append((self.routed + self.cfg.event_delay, replica.worker_id, events))

    def _deliver(self) -> None:
        mail = self.mail
        while mail and mail[0][0] <= self.routed:
            _, worker_id, events = mail.popleft()
            self.index.apply(worker_id, events)

    # -- the replicas ----------------------------------------------------------
    def _schedule(self, t: float, kind: str, replica: _Replica, job) -> None:
        self.order += 1
        heapq.heappush(self.timeline, (t, self.order, kind, replica.worker_id, job))

    def _try_start(self, replica: _Replica, now: float) -> None:
        mgr = replica.mgr
        size = self.size
        while not replica.prefilling and replica.waiting:
            job = replica.waiting[0]
            request = self.trace.requests[job.index]
            out_blocks = -(-(job.prompt.num_tokens + request.output_length) // size) - (-(-job.prompt.num_tokens // size))
            m = mgr.match(job.prompt, compute_last_token=False)
            if m.total_blocks + out_blocks > mgr.pool.num_blocks:
                replica.waiting.popleft()
                replica.queued_prefill_tokens -= job.expected_prefill_tokens
                self.result.oversized_requests += 1
                self._count(job, request, 0)
                self.result.waits.append(now - (request.timestamp - self.start))
                continue
            if m.blocks_needed + out_blocks > mgr.num_free_blocks:
                return   # head of line waits for decodes to free blocks
            replica.waiting.popleft()
            hit_tokens = mgr.admit(job.index, job.prompt, compute_last_token=False)
            self._emit(replica)
            self._count(job, request, hit_tokens // size)
            self.result.waits.append(now - (request.timestamp - self.start))
            p = self.params
            computed = max(job.prompt.num_tokens - hit_tokens, 0)
            prefill_s = p.step_overhead_s + computed * p.prefill_s_per_token + replica.running * p.decode_s_per_token
            replica.prefilling = True
            self._schedule(now + prefill_s, "prefilled", replica, job)

    def _prefilled(self, replica: _Replica, job: _Job, now: float) -> None:
        request = self.trace.requests[job.index]
        replica.prefilling = False
        replica.queued_prefill_tokens -= job.expected_prefill_tokens
        replica.running += 1
        if request.output_length:
            if request.tokens is not None:
                # generated tokens are cached too: the next turn of a chat can hit them
                replica.mgr.append(job.index, request.output_tokens or [0] * request.output_length)
            else:
                replica.mgr.append_slots(job.index, request.output_length)
            self._emit(replica)
        p = self.params
        decode_s = request.output_length * (p.step_overhead_s + p.decode_s_per_token)
        self._schedule(now + decode_s, "finished", replica, job)
        self._try_start(replica, now)

    def _finished(self, replica: _Replica, job: _Job, now: float) -> None:
        replica.running -= 1
        replica.mgr.free(job.index)
        self._emit(replica)
        self._try_start(replica, now)

    def _count(self, job: _Job, request, hit_blocks: int) -> None:
        res = self.result
        res.requests += 1
        res.block_accesses += job.accesses
        res.block_hits += hit_blocks
        res.input_tokens += request.input_length
        if job.last_block_tokens is not None and job.accesses and hit_blocks == job.accesses:
            res.hit_tokens += (job.accesses - 1) * self.size + job.last_block_tokens
        else:
            res.hit_tokens += min(hit_blocks * self.size, request.input_length)

    # -- routing -----------------------------------------------------------------
    def _arrive(self, i: int, now: float) -> None:
        self._deliver()
        if self.cfg.predict:
            self.index.expire(now)
        request = self.trace.requests[i]
        prompt, accesses, last_tokens = _prompt_for(self.replicas[0].mgr, request, self.size)
        hashes = prompt.block_hashes()
        decision = self.router.pick(hashes, [r.load() for r in self.replicas])
        self.routed += 1
        replica = self.by_id[decision.worker_id]
        self.result.per_replica[self.replicas.index(replica)] += 1
        self.result.decisions[decision.reason] += 1
        if self.cfg.predict:
            self.index.predict(replica.worker_id, hashes, now)
        expected = max(prompt.num_tokens - decision.overlap_blocks * self.size, 0)
        replica.waiting.append(_Job(i, prompt, accesses, last_tokens, expected))
        replica.queued_prefill_tokens += expected
        self._try_start(replica, now)

    def run(self) -> FleetResult:
        requests = self.trace.requests
        start = self.start
        next_arrival = 0
        timeline = self.timeline
        while next_arrival < len(requests) or timeline:
            arrival_t = (requests[next_arrival].timestamp - start) if next_arrival < len(requests) else math.inf
            if timeline and timeline[0][0] <= arrival_t:
                t, _, kind, worker_id, job = heapq.heappop(timeline)
                replica = self.by_id[worker_id]
                (self._prefilled if kind == "prefilled" else self._finished)(replica, job, t)
            else:
                self._arrive(next_arrival, arrival_t)
                next_arrival += 1
        for r in self.replicas:
            r.mgr.check_invariants()
        return self.result


def _faster(params: CostParams, speedup: float) -> CostParams:
    if speedup == 1.0:
        return params
    return replace(params, name=f"{params.name} x{speedup:g}", step_overhead_s=params.step_overhead_s / speedup,
                   prefill_s_per_token=params.prefill_s_per_token / speedup,
                   decode_s_per_token=params.decode_s_per_token / speedup)


def compare(trace, config: FleetConfig) -> dict:
    """The router's run beside round robin and one N x manager: the ``prefixkv fleet`` figures."""
    routed = simulate(trace, config)
    round_robin = simulate(trace, replace(config, router="round-robin"))
    single = simulate(trace, replace(config, replicas=1, capacity=config.capacity * config.replicas,
                                      router="round-robin", speedup=config.replicas))
    out = routed.as_dict()
    out.update(single_hit_rate=single.hit_rate, round_robin_hit_rate=round_robin.hit_rate,
               round_robin_p99_wait_s=round_robin.wait_quantile(0.99),
               round_robin_busiest_share=round_robin.busiest_share)
    return out
