"""Replay a request trace through the real manager, pool and policy.

Two modes:

* ``cache``: requests in trace order; each is matched (a block hits only if
  every earlier block of the request hit), admitted, and released at once. This
  is the mode published hit-rate-versus-capacity curves use.
* ``concurrent``: requests arrive at their timestamps and hold their blocks
  (prompt plus output slots) for a service time ``input/prefill_rate +
  output/decode_rate``; held blocks cannot be evicted; a request that does not
  fit waits (first come, first served) until enough blocks are released.

With ``host_capacity`` blocks of host tier below the device pool, evicted blocks are
demoted there and hits continue into it (``prefixkv.tiers.host``); the result
splits hits by tier and counts the promotions (loads), demotions and the bytes
and modelled time they move (``transfer_cost``: a ``PreemptionCostModel`` whose
``kv_bytes_per_token`` and link bandwidth price a block; with ``gate`` it also
refuses host hits dearer than recomputing).

Capacity is counted in blocks of the trace's own block size. A hashed trace's
every hash id counts as one block access (its last, partly filled block too,
as the reference simulators count it); a token trace is hashed for real and
its full blocks are the accesses.

Session hints. Every request with a session label is freed with a
``SessionHint`` built from the trace's past only: its session, its own stop
reason (``end``), its turn in the session and the time of the free (cache
mode: its arrival; concurrent mode: when it finished), never the next
request's time. Policies that use hints (``session``) learn from them; the
others ignore them. A policy with ``predict(hint)`` is scored afterwards
against the trace: ``return_auc`` (does the session send another request:
area under the ROC curve of the predicted probability) and
``arrival_log_error`` (mean ``|ln((1 + predicted gap) / (1 + actual gap))|``,
seconds from the free to the session's next arrival, over the requests whose
session does return), both over the measured requests; ``None`` for policies
that predict nothing.
"""

from __future__ import annotations

import heapq
import math
import numbers
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from ..errors import InvalidArgument, SequenceTooLong
from ..manager import KVCacheManager
from ..policies import SessionHint, make_policy


@dataclass
class ReplayResult:
    policy: str
    capacity: int
    mode: str
    block_size: int
    requests: int = 0                  # measured (after warm-up)
    block_accesses: int = 0
    block_hits: int = 0
    input_tokens: int = 0
    hit_tokens: int = 0
    evictions: int = 0
    oversized_requests: int = 0        # more blocks than the whole cache: counted as all misses
    block_insertions: int = 0          # hashes that entered the prefix cache (pool residencies started)
    blocks_never_reused: int = 0       # residencies that ended unused, or were still unused at the end
    waited_admissions: int = 0         # concurrent mode: admissions that had to wait
    total_wait_s: float = 0.0
    warmup_requests: int = 0
    predictions: int = 0               # measured requests the policy forecast (predict(hint))
    return_auc: float | None = None    # of the forecast return probability (None: no forecasts, or one class)
    arrival_log_error: float | None = None  # mean |ln((1+predicted gap)/(1+actual gap))|, returning sessions
    host_capacity: int = 0             # host-tier blocks (0: no host tier)
    host_block_hits: int = 0           # of block_hits, served from the host tier
    remote_block_hits: int = 0         # of block_hits, fetched from the remote tier (through the host tier)
    disk_block_hits: int = 0           # of block_hits, read from the disk tier (through the host tier)
    extra: dict = field(default_factory=dict)
    # Wall seconds of the replay itself (prompts from the loaded trace, or its conversion to arrays,
    # the requests, the final checks); the trace's loading is not in it, nor the loading of the
    # compiled loop (``fastreplay.warm``: once per process, as an import). Not part of the result's value: equality and
    # ``as_dict()`` leave it out (sweeps compare results across backends), ``as_dict(timing=True)``
    # reports it.
    replay_s: float = field(default=0.0, compare=False)
    # Which loop ran it: "compiled" (``prefixkv.sim.fastreplay``) or "general" (the real manager).
    # Both give the same result, so it is left out of equality and of ``as_dict()``.
    engine: str = field(default="general", compare=False)

    @property
    def block_hit_rate(self) -> float:
        return self.block_hits / self.block_accesses if self.block_accesses else 0.0

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.input_tokens if self.input_tokens else 0.0

    def count(self, request, accesses: int, last_block_tokens: int | None, hit_blocks: int) -> None:
        """Add one measured request. A hashed trace's last block may be partly filled
        (``last_block_tokens``): a hit on it is worth only those tokens."""
        size = self.block_size
        self.requests += 1
        self.block_accesses += accesses
        self.block_hits += hit_blocks
        self.input_tokens += request.input_length
        if last_block_tokens is not None and accesses and hit_blocks == accesses:
            self.hit_tokens += (accesses - 1) * size + last_block_tokens
        else:
            self.hit_tokens += min(hit_blocks * size, request.input_length)

    def as_dict(self, *, timing: bool = False) -> dict[str, Any]:
        out = asdict(self)
        replay_s = out.pop("replay_s")
        del out["engine"]
        if timing:
            out["replay_s"] = replay_s
        out.update(block_hit_rate=self.block_hit_rate, token_hit_rate=self.token_hit_rate)
        remote = out.pop("remote_block_hits")
        disk = out.pop("disk_block_hits")
        if self.host_capacity:
            device = self.block_hits - self.host_block_hits - remote - disk
            out["tier_block_hits"] = {"device": device, "host": self.host_block_hits}
            if "disk_capacity" in self.extra:
                out["tier_block_hits"]["disk"] = disk
            if "remote_capacity" in self.extra:
                out["tier_block_hits"]["remote"] = remote
            out["tier_hit_rate"] = {tier: hits / self.block_accesses if self.block_accesses else 0.0
                                    for tier, hits in out["tier_block_hits"].items()}
        else:
            del out["host_capacity"], out["host_block_hits"]
        extra = out.pop("extra")
        out.update(extra)
        return out


def _prompt_for(mgr: KVCacheManager, request, block_size: int, checked: bool = False):
    """(prompt, block accesses, tokens per accessed block) for one request (``checked``: its
    block ids come from a loader that checked them, ``Trace.checked_hashes``)."""
    if request.tokens is not None:
        prompt = mgr.prompt(request.tokens, salt=getattr(request, "salt", None))
        full = len(request.tokens) // block_size
        return prompt, full, None
    hashes = request.block_hashes
    n = len(hashes)
    prompt = mgr.prompt_from_hashes(hashes, n * block_size, checked=checked)
    # The last id's block holds the rest of the prompt, at most one block: a kv-cache-tester
    # request names its full blocks only, and its tail past them is in no block (never a hit).
    return prompt, n, min(block_size, request.input_length - (n - 1) * block_size) if n else 0


def _hints(requests: Sequence) -> list[SessionHint | None]:
    """Each request's hint at its free, from the past only (time is filled in by the replayer)."""
    turns: dict = {}
    out: list[SessionHint | None] = []
    for r in requests:
        session = r.session
        if session is None:
            out.append(None)
            continue
        turn = turns.get(session, 0)
        turns[session] = turn + 1
        out.append(SessionHint(session, end=r.stop, turn=r.turn if r.turn is not None else turn, parent=r.parent))
    return out


def _at(hint: SessionHint | None, when: float) -> SessionHint | None:
    return None if hint is None else SessionHint(hint.session, hint.end, float(when), None, hint.turn, hint.parent)


def roc_auc(scores: Sequence[float], labels: Sequence[bool]) -> float | None:
    """Area under the ROC curve (ties count half); None without both classes."""
    if len(scores) != len(labels):
        raise InvalidArgument("scores", f"{len(scores)} score(s) for {len(labels)} label(s)")
    # A NaN compares false with everything: the sort would leave the ranks in no order at all.
    for s in scores:
        if isinstance(s, bool) or not isinstance(s, numbers.Real) or math.isnan(s):
            raise InvalidArgument("scores", f"each must be a number, not NaN, got {s!r}")
    pos = sum(1 for y in labels if y)
    neg = len(labels) - pos
    if not pos or not neg:
        return None
    order = sorted(range(len(scores)), key=scores.__getitem__)
    rank_sum = 0.0
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and scores[order[j + 1]] == scores[order[i]]:
            j += 1
        mid = (i + j) / 2.0 + 1.0
        rank_sum += mid * sum(1 for k in range(i, j + 1) if labels[order[k]])
        i = j + 1
    return (rank_sum - pos * (pos + 1) / 2.0) / (pos * neg)


def _score_predictions(result: ReplayResult, requests: Sequence, forecasts: dict) -> None:
    """Forecasts (request index -> (p_return, gap s, time of the free)) against what the trace
    did next. The gap is forecast from the free (the hint's time: the arrival in cache mode, the
    finish in concurrent mode), so it is scored against the next arrival's distance from the free."""
    if not forecasts:
        return
    following: dict[int, float] = {}    # request -> its session's next arrival
    last: dict = {}
    for i in range(len(requests) - 1, -1, -1):
        session = requests[i].session
        if session is None:
            continue
        if session in last:
            following[i] = requests[last[session]].timestamp
        last[session] = i
    scores, labels, errors = [], [], []
    for i, (p, gap, freed) in forecasts.items():
        scores.append(p)
        came = i in following
        labels.append(came)
        if came:
            errors.append(abs(math.log((1.0 + gap) / (1.0 + max(following[i] - freed, 0.0)))))
    result.predictions = len(scores)
    result.return_auc = roc_auc(scores, labels)
    result.arrival_log_error = sum(errors) / len(errors) if errors else None


def _next_uses(prompts: Sequence) -> list[list[float]]:
    """For each request, the index of the next request that accesses each of its blocks."""
    nxt: dict[Any, float] = {}
    out: list[list[float]] = [[] for _ in prompts]
    for i in range(len(prompts) - 1, -1, -1):
        hashes = prompts[i][0].block_hashes()
        out[i] = [nxt.get(h, math.inf) for h in hashes]
        for h in hashes:
            nxt[h] = i
    return out


def replay(trace, policy: str | Any, capacity: int, *, mode: str = "cache", warmup: float = 0.0,
           prefill_rate: float = 20_000.0, decode_rate: float = 50.0, hash_seed: int = 0,
           host_capacity: int = 0, host_policy: str | Any = "lru", host_inclusive: bool = False,
           transfer_cost=None, gate: bool = False, remote_capacity: int = 0,
           remote_bytes_per_s: float | None = None, disk_capacity: int = 0, disk_mode: str = "write-through",
           disk_read_bytes_per_s: float | None = None, disk_write_bytes_per_s: float | None = None,
           engine: str = "auto", block_arrays=None) -> ReplayResult:
    """Replay ``trace`` with ``policy`` at ``capacity`` blocks; see the module doc.

    ``disk_capacity`` models a local disk tier below the host tier and above the remote one (cache
    mode; ``prefixkv.sim.disk_model``: ``disk_mode`` ``"write-through"`` as ``DiskTier`` does, or
    ``"exclusive"``, a victim tier of the host), staged through the host tier like the remote
    tier; ``disk_read_bytes_per_s`` / ``disk_write_bytes_per_s`` price its reads and writes
    (``disk_transfer_s``, with a ``transfer_cost`` for the bytes of a block).

    ``remote_capacity`` models a shared remote tier below the host tier (cache mode;
    ``prefixkv.sim.remote_model``): a host tier is needed to stage its blocks (when none is
    given, one the size of the largest request stages them). ``remote_bytes_per_s`` prices its
    reads and writes (``remote_transfer_s``).

    ``engine``: ``"auto"`` runs a built-in policy named by a string, in cache mode without tiers,
    in the compiled loop (``prefixkv.sim.fastreplay``, where numba is installed) and everything
    else through the real manager; ``"general"`` always takes the manager, ``"compiled"`` refuses
    (ValueError) what the compiled loop cannot run. Both give the same result. ``block_arrays``:
    ``trace`` already converted (``blockarrays.block_arrays(trace, hash_seed)``; a sweep converts
    each trace once per worker)."""
    started = time.perf_counter()
    # Everything is checked before the policy is made or bound: a policy object serves one pool,
    # so a replay refused after building its manager would have used the caller's object up.
    _check_arguments(mode, warmup, capacity, prefill_rate, decode_rate, host_capacity, remote_capacity,
                     remote_bytes_per_s)
    disk = None
    if disk_capacity:
        from .disk_model import DiskModel
        disk = DiskModel(disk_capacity, disk_mode)      # checks both
        for name, rate in (("disk_read_bytes_per_s", disk_read_bytes_per_s),
                           ("disk_write_bytes_per_s", disk_write_bytes_per_s)):
            if rate is not None and not _is_rate(rate):
                raise InvalidArgument(name, f"must be None or a finite number of bytes per second > 0, got {rate!r}")
        if mode != "cache":
            raise ValueError("a disk tier is modelled in cache mode only")
    if gate and transfer_cost is None:
        raise ValueError("the load gate needs a transfer_cost (a PreemptionCostModel)")
    if remote_capacity and mode != "cache":
        raise ValueError("a remote tier is modelled in cache mode only")
    if engine not in ENGINES:
        raise InvalidArgument("engine", f"must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine != "general":
        why_not = _why_not_compiled(policy, mode, host_capacity, remote_capacity or disk_capacity, gate)
        plan = None
        if why_not is None:
            plan = fastreplay_plan(policy)
            if plan is None:
                why_not = f"policy {policy!r} has no compiled version"
        if plan is not None:
            from .fastreplay import warm

            # Loading the compiled loop is once per process, as an import is: not this replay's time.
            warming = time.perf_counter()
            warm((plan[0],))
            started += time.perf_counter() - warming
            arrays = block_arrays if block_arrays is not None else trace_block_arrays(trace, hash_seed)
            return _replay_compiled(trace, arrays, policy, plan, capacity, warmup, started)
        if engine == "compiled":
            raise ValueError(f"the compiled replay cannot run this: {why_not}")
    name = policy if isinstance(policy, str) else getattr(policy, "name", type(policy).__name__)
    policy_obj = make_policy(policy) if isinstance(policy, str) else policy
    oracle = getattr(policy_obj, "set_next_use", None)
    if name == "belady" and oracle is None:
        raise ValueError("the belady policy needs set_next_use(hash, next_time)")
    if oracle is not None and mode != "cache":
        raise ValueError("belady needs the future in trace order; use mode='cache'")
    if isinstance(host_policy, str) and (host_capacity or remote_capacity or disk):
        make_policy(host_policy)    # the manager binds the device policy before it reads this name
    block_size = trace.block_size
    requests = trace.requests
    remote = None
    if remote_capacity:
        from .remote_model import RemoteModel

        remote = RemoteModel(remote_capacity)
    if remote is not None or disk is not None:
        staging = max((-(-r.input_length // block_size) for r in requests), default=1)
        host_capacity = host_capacity or staging
    mgr = KVCacheManager(capacity, block_size, policy=policy_obj, hash_seed=hash_seed, track_reuse=True,
                         num_host_blocks=host_capacity, host_cache=bool(host_capacity), host_policy=host_policy,
                         host_inclusive=host_inclusive, load_gate=transfer_cost if gate else None,
                         index="dict")     # a trace's hashes are integer ids
    if disk is not None and disk.exclusive:
        mgr.host.pool.on_evict_many = lambda blocks, hashes: disk.demote(hashes)    # host victims fall to disk
    lower = [model for model in (disk, remote) if model is not None]
    checked = getattr(trace, "checked_hashes", False)
    prompts = [_prompt_for(mgr, request, block_size, checked) for request in requests]
    next_uses = _next_uses(prompts) if oracle is not None else None
    result = ReplayResult(policy=name, capacity=capacity, mode=mode, block_size=block_size,
                          host_capacity=host_capacity)
    result.warmup_requests = int(len(requests) * warmup)
    hints = _hints(requests)
    predict = getattr(policy_obj, "predict", None)
    forecasts: dict[int, tuple[float, float, float]] | None = {} if predict is not None else None
    if mode == "cache":
        _replay_cache(mgr, requests, prompts, result, next_uses, oracle, hints, forecasts, lower)
    else:
        _replay_concurrent(mgr, requests, prompts, result, prefill_rate, decode_rate, hints, forecasts)
    mgr.check_invariants()
    if forecasts:
        _score_predictions(result, requests, forecasts)
    if host_capacity:
        _count_transfers(result, mgr, transfer_cost)
    if remote is not None:
        # over the measured window, as the tier hits, promotions and demotions beside them
        fetched0, written0, evictions0 = result.extra.pop("_remote_at_warmup", (0, 0, 0))
        fetched, written = remote.fetched - fetched0, remote.written - written0
        moved = (fetched + written) * block_size * (transfer_cost.kv_bytes_per_token
                                                    if transfer_cost is not None else 0)
        result.extra.update(remote_capacity=remote_capacity, remote_fetches=fetched,
                            remote_writes=written, remote_evictions=remote.evictions - evictions0)
        if transfer_cost is not None and remote_bytes_per_s:
            result.extra.update(remote_transfer_bytes=moved, remote_transfer_s=moved / remote_bytes_per_s)
    if disk is not None:
        fetched0, written0, evictions0 = result.extra.pop("_disk_at_warmup", (0, 0, 0))
        fetched, written = disk.fetched - fetched0, disk.written - written0
        block_bytes = block_size * (transfer_cost.kv_bytes_per_token if transfer_cost is not None else 0)
        result.extra.update(disk_capacity=disk_capacity, disk_mode=disk_mode, disk_fetches=fetched,
                            disk_writes=written, disk_evictions=disk.evictions - evictions0)
        if transfer_cost is not None and disk_read_bytes_per_s and disk_write_bytes_per_s:
            result.extra.update(disk_transfer_bytes=(fetched + written) * block_bytes,
                                disk_transfer_s=block_bytes * (fetched / disk_read_bytes_per_s
                                                               + written / disk_write_bytes_per_s))
    result.replay_s = time.perf_counter() - started
    return result


ENGINES = ("auto", "general", "compiled")


def _why_not_compiled(policy, mode, host_capacity, remote_capacity, gate) -> str | None:
    """Why the compiled loop cannot run this replay (None: it may, if the policy has a compiled version)."""
    if not isinstance(policy, str):
        return "a policy object keeps the general path"
    if mode != "cache":
        return f"mode {mode!r} (the compiled loop is cache mode)"
    if host_capacity or remote_capacity or gate:
        return "tiers below the device"
    from ..flat import available
    if not available():
        return "numba is not installed"
    return None


def fastreplay_plan(policy: str):
    """(kind, options) of a built-in policy spec the compiled loop runs, else None (numba loaded)."""
    from .fastreplay import policy_kind
    return policy_kind(policy)


def trace_block_arrays(trace, hash_seed):
    """``trace`` as ``BlockArrays``: kept on a trace whose lists nobody changes (a loaded hashed
    trace, ``Trace.checked_hashes``; a sweep worker's, ``Trace.frozen``) after the first
    conversion, else converted for this replay."""
    from .blockarrays import block_arrays
    cache = getattr(trace, "block_arrays_cache", None)
    if cache is None or not (getattr(trace, "checked_hashes", False) or getattr(trace, "frozen", False)):
        return block_arrays(trace, hash_seed)
    key = None if not trace.has_tokens else hash_seed     # a hashed trace's ids do not depend on the seed
    arrays = cache.get(key)
    if arrays is None:
        arrays = cache[key] = block_arrays(trace, hash_seed)
    return arrays


def _replay_compiled(trace, arrays, policy: str, plan, capacity: int, warmup: float, started: float) -> ReplayResult:
    """``replay`` of a built-in policy in cache mode without tiers, in the compiled loop: the same
    result as the manager's, every figure (``fastreplay``)."""
    import numpy as np

    from . import fastreplay as fr

    kind, options = plan
    n = arrays.num_requests
    warm = int(n * warmup)
    hits, counters = fr.run(arrays, kind, options, capacity, warm, trace.block_size)
    result = ReplayResult(policy=policy, capacity=capacity, mode="cache", block_size=trace.block_size)
    result.warmup_requests = warm
    size = trace.block_size
    hits, accesses = hits[warm:], arrays.accesses[warm:]
    input_length, last = arrays.input_length[warm:], arrays.last_block_tokens[warm:]
    # ReplayResult.count, request by request: a hashed request's last block may be partly filled
    whole = (last >= 0) & (accesses > 0) & (hits == accesses)
    hit_tokens = np.where(whole, (accesses - 1) * size + last, np.minimum(hits * size, input_length))
    result.requests = n - warm
    result.block_accesses = int(accesses.sum())
    result.block_hits = int(hits.sum())
    result.input_tokens = int(input_length.sum())
    result.hit_tokens = int(hit_tokens.sum())
    result.oversized_requests = int(np.count_nonzero(arrays.total_blocks[warm:] > capacity))
    if n:
        evictions, cached, unused = (int(counters[c]) for c in (fr.C_EVICTIONS, fr.C_CACHED, fr.C_UNUSED))
        evictions_w, cached_w, unused_w = (int(counters[c]) for c in (fr.C_EVICTIONS_W, fr.C_CACHED_W, fr.C_UNUSED_W))
        result.evictions = evictions - evictions_w
        result.block_insertions = (evictions + cached) - (evictions_w + cached_w)
        result.blocks_never_reused = unused - unused_w + int(counters[fr.C_UNUSED_CACHED])
    result.engine = "compiled"
    result.replay_s = time.perf_counter() - started
    return result


def _is_count(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_rate(value) -> bool:
    return (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)
            and value > 0)


def _check_arguments(mode, warmup, capacity, prefill_rate, decode_rate, host_capacity, remote_capacity,
                     remote_bytes_per_s) -> None:
    if mode not in ("cache", "concurrent"):
        raise InvalidArgument("mode", f"mode must be 'cache' or 'concurrent', got {mode!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, numbers.Real) or not 0.0 <= warmup < 1.0:
        raise InvalidArgument("warmup", f"warmup must be in [0, 1), got {warmup!r}")
    if not _is_count(capacity) or capacity <= 0:
        raise InvalidArgument("capacity", f"capacity must be a positive number of blocks, got {capacity!r}")
    if not _is_count(host_capacity) or host_capacity < 0:
        raise InvalidArgument("host_capacity", f"host_capacity must be >= 0 blocks, got {host_capacity!r}")
    # A remote model of NaN blocks never evicts (nothing is larger than NaN): it would grow without bound.
    if not _is_count(remote_capacity) or remote_capacity < 0:
        raise InvalidArgument("remote_capacity", f"must be >= 0 blocks (0: no remote tier), got {remote_capacity!r}")
    # Rates divide token counts into seconds: 0 divides by zero, a negative or NaN one runs the
    # concurrent replay's clock backwards or out of order.
    for what, rate in (("prefill_rate", prefill_rate), ("decode_rate", decode_rate)):
        if not _is_rate(rate):
            raise InvalidArgument(what, f"must be a finite number of tokens per second > 0, got {rate!r}")
    if remote_bytes_per_s is not None and not _is_rate(remote_bytes_per_s):
        raise InvalidArgument("remote_bytes_per_s", f"must be None or a finite number of bytes per second > 0, "
                                                    f"got {remote_bytes_per_s!r}")


def _count_transfers(result: ReplayResult, mgr: KVCacheManager, cost) -> None:
    """Promotions, demotions and what they move, over the measured window (after the warm-up)."""
    at_warmup = result.extra.pop("_tiers_at_warmup", (0, 0, 0))
    stats = mgr.stats()
    promotions = stats.loads - at_warmup[0]
    demotions = stats.demotions - at_warmup[1]
    result.extra.update(promotions=promotions, demotions=demotions,
                        loads_refused=stats.loads_refused - at_warmup[2])
    if cost is not None:
        moved = (promotions + demotions) * result.block_size * cost.kv_bytes_per_token
        result.extra.update(transfer_bytes=moved, transfer_s=cost.swap_one_way_s(moved))


def _tiers_now(mgr: KVCacheManager) -> tuple[int, int, int]:
    c = mgr.counters
    return c["loads"], c["demotions"], c["loads_refused"]


def _pool_counters(pool) -> tuple[int, int, int]:
    return pool.evictions, pool.insertions, pool.unused_removals


def _count_cache_traffic(result: ReplayResult, pool, at_warmup: tuple[int, int, int] | None) -> None:
    """Evictions, insertions and unused residencies of the measured window (after the warm-up)."""
    evictions, insertions, unused = at_warmup or _pool_counters(pool)
    result.evictions = pool.evictions - evictions
    result.block_insertions = pool.insertions - insertions
    result.blocks_never_reused = pool.unused_removals - unused + pool.num_unused_cached()


def _tell_oracle(oracle, prompt, uses: list[float]) -> None:
    for h, when in zip(prompt.block_hashes(), uses):
        oracle(h, when)


def _free(mgr: KVCacheManager, i, hint: SessionHint | None, forecasts: dict | None, measured: bool,
          admitted: bool = True) -> None:
    if admitted:
        mgr.free(i, hint=hint)
    elif hint is not None:
        mgr.pool.release((), 0, hint)    # never admitted (too long): the session still came
    if forecasts is not None and hint is not None and measured:
        forecast = mgr.pool.policy.predict(hint)
        if forecast is not None:
            forecasts[i] = (forecast[0], forecast[1], hint.time)


def _stage_lower(mgr: KVCacheManager, lower: Sequence, prompt) -> list[int]:
    """Fetch the blocks that continue ``prompt``'s chain past the device and host hits from the
    modelled tiers below the host (disk, then remote: each past the one above) into the host tier,
    where ``admit`` finds them; returns how many each staged."""
    hashes = prompt.block_hashes()
    start = mgr.match(prompt, compute_last_token=False).hit_blocks
    counts = [0] * len(lower)
    found = [0] * len(lower)
    at = start
    for k, model in enumerate(lower):
        found[k] = model.leading(hashes, at)     # a tier that misses leaves the chain to the next
        at += found[k]
    if at == start:
        return counts
    host = mgr.host
    # As the real tier does, hold the chain's host hits while staging: a staged block must not
    # evict a block of the chain it continues (admit would then find neither).
    device, pool = mgr.pool.lookup, host.pool
    held = [b for b in map(pool.lookup, (h for h in hashes[:start] if device(h) is None)) if b is not None]
    pool.acquire_hits(held)
    at = start
    try:
        for k, model in enumerate(lower):
            staged = []
            for i in range(at, at + found[k]):
                # (an exclusive disk takes the host's victims while this stages: it may have lost
                # the rest of the chain to them)
                if not model.leading(hashes, i):
                    break
                model.read((hashes[i],))
                if host.store(hashes[i], hashes[i - 1] if i else None, i) is None:
                    model.unread(hashes[i])
                    break          # the host tier is full of blocks held for loads: stop the chain
                staged.append(hashes[i])
            for above in lower[:k]:
                above.write(staged)     # a write-through disk keeps what the remote tier served
            counts[k] = len(staged)
            at += len(staged)
            if len(staged) < found[k]:
                break
    finally:
        pool.release(held[::-1])   # tail first, as the manager releases
    return counts


def _replay_cache(mgr: KVCacheManager, requests: Sequence, prompts: Sequence, result: ReplayResult,
                  next_uses, oracle, hints: Sequence, forecasts: dict | None, lower: Sequence = ()) -> None:
    size = mgr.block_size
    capacity = mgr.pool.num_blocks
    warm = result.warmup_requests
    at_warmup = None
    tiers = mgr.host is not None
    for i, request in enumerate(requests):
        if i == warm:
            at_warmup = _pool_counters(mgr.pool)
            if tiers:
                result.extra["_tiers_at_warmup"] = _tiers_now(mgr)
            for model in lower:
                result.extra[f"_{model.name}_at_warmup"] = (model.fetched, model.written, model.evictions)
        prompt, accesses, last_tokens = prompts[i]
        if oracle is not None:
            _tell_oracle(oracle, prompt, next_uses[i])
        hint = _at(hints[i], request.timestamp)
        loads_before = mgr.counters["loads"] if tiers else 0
        # A request longer than the whole pool is never admitted: staging its chain would fetch
        # bytes no hit uses and push host blocks out for them.
        staged = _stage_lower(mgr, lower, prompt) \
            if lower and -(-prompt.num_tokens // size) <= capacity else ()
        try:
            hit_tokens = mgr.admit(i, prompt, compute_last_token=False)
        except SequenceTooLong:
            hit_tokens = 0
            _free(mgr, i, hint, forecasts, i >= warm, admitted=False)
            if i >= warm:
                result.oversized_requests += 1
        else:
            if tiers:      # a replay moves no bytes: the transfers are only counted
                mgr.take_demotions()
                mgr.take_loads()
            if lower:      # write-through: the server (and a write-through disk) gets every block it lacks
                published = prompt.block_hashes()[:prompt.num_tokens // size]
                for model in lower:
                    model.write(published)
            _free(mgr, i, hint, forecasts, i >= warm)
        if i >= warm:
            result.count(request, accesses, last_tokens, hit_tokens // size)
            if tiers:
                loaded = mgr.counters["loads"] - loads_before
                # staged blocks come right after the device and host hits: the last loads are theirs
                for model, n in zip(reversed(lower), reversed(staged)):
                    taken = min(n, loaded)
                    loaded -= taken
                    if model.name == "disk":
                        result.disk_block_hits += taken
                    else:
                        result.remote_block_hits += taken
                result.host_block_hits += loaded
    _count_cache_traffic(result, mgr.pool, at_warmup)


def _replay_concurrent(mgr: KVCacheManager, requests: Sequence, prompts: Sequence, result: ReplayResult,
                       prefill_rate: float, decode_rate: float, hints: Sequence, forecasts: dict | None) -> None:
    size = mgr.block_size
    warm = result.warmup_requests
    running: list[tuple[float, int]] = []   # (finish time, request index)
    waiting: list[int] = []                 # FIFO of request indices that did not fit
    head = 0
    clock = 0.0
    at_warmup = None
    arrivals = iter(range(len(requests)))
    pending = next(arrivals, None)

    def try_start(i: int, now: float) -> bool:
        nonlocal at_warmup
        if at_warmup is None and i >= warm:
            at_warmup = _pool_counters(mgr.pool)
            if mgr.host is not None:
                result.extra["_tiers_at_warmup"] = _tiers_now(mgr)
        request = requests[i]
        prompt, accesses, last_tokens = prompts[i]
        out_blocks = -(-(prompt.num_tokens + request.output_length) // size) - (-(-prompt.num_tokens // size))
        m = mgr.match(prompt, compute_last_token=False)
        if m.total_blocks + out_blocks > mgr.pool.num_blocks:
            _free(mgr, i, _at(hints[i], now), forecasts, i >= warm, admitted=False)
            if i >= warm:
                result.oversized_requests += 1
                result.count(request, accesses, last_tokens, 0)
            return True   # can never run: counted as all misses, dropped
        if m.blocks_needed + out_blocks > mgr.num_free_blocks:
            return False
        loads_before = mgr.counters["loads"]
        hit_tokens = mgr.admit(i, prompt, compute_last_token=False)
        if mgr.host is not None:
            mgr.take_demotions()
            mgr.take_loads()
            if i >= warm:
                result.host_block_hits += mgr.counters["loads"] - loads_before
        if request.output_length:
            if request.tokens is not None:
                # Generated tokens are cached too: the next turn of a chat can hit them.
                output = getattr(request, "output_tokens", None) or [0] * request.output_length
                mgr.append(i, output)
            else:
                mgr.append_slots(i, request.output_length)
        service = request.input_length / prefill_rate + request.output_length / decode_rate
        heapq.heappush(running, (now + service, i))
        if i >= warm:
            result.count(request, accesses, last_tokens, hit_tokens // size)
            wait = now - request.timestamp
            if wait > 0:
                result.waited_admissions += 1
                result.total_wait_s += wait
        return True

    while pending is not None or running or head < len(waiting):
        next_arrival = requests[pending].timestamp if pending is not None else math.inf
        next_finish = running[0][0] if running else math.inf
        if next_finish <= next_arrival:
            clock, done = heapq.heappop(running)
            _free(mgr, done, _at(hints[done], clock), forecasts, done >= warm)
        else:
            clock = max(clock, next_arrival)
            waiting.append(pending)
            pending = next(arrivals, None)
        while head < len(waiting) and try_start(waiting[head], clock):
            head += 1
        if not running and head < len(waiting) and pending is None:
            raise RuntimeError("concurrent replay cannot make progress (a request never fits)")
    _count_cache_traffic(result, mgr.pool, at_warmup)
    result.extra["mean_wait_s"] = result.total_wait_s / result.waited_admissions if result.waited_admissions else 0.0
