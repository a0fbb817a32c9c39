"""Routers: which worker should serve a prompt, given the KV index and each worker's load.

Every router answers ``pick(hashes, workers) -> Decision``: ``hashes`` are the prompt's
full-block hashes (hashed with the fleet's one pinned seed, as the workers hash), and
``workers`` the candidates with their load. By name:

* ``round-robin``: in turn, ignoring cache and load.
* ``least-load``: the least loaded, ignoring the cache.
* ``prefix``: the longest cached prefix (ties: least loaded). What users of overlap-only
  routers report: with a prefix every request shares, everything goes to one worker.
* ``kv-aware``: the least cost, cost = blocks to prefill (index overlap; lower-tier
  blocks at ``lower_tier_credit``) + load, load = queued prefill tokens / block size +
  decode load (NVIDIA Dynamo's KV router has this shape). Decode load = running requests x
  ``decode_share`` x the routed prompt's blocks: with no knowledge of the running requests'
  sizes, each weighs a share of a request like this one.
* ``kv-aware+guard``: the best overlap (ties: least cost), with a load guard per
  candidate: when that worker's load is more than ``guard_slack`` requests' worth (x the
  prompt's blocks) above the least loaded worker's, the request goes to the best overlap
  among the workers within that slack of the minimum. Only the overloaded candidate is
  passed over: there is no fleet-wide switch that turns affinity off for everyone.

Misses (no worker holds the first block) go to the least loaded worker. Ties are broken
at random (a seeded ``random.Random``), so no replica is picked again and again by id order.
Workers whose fingerprint, block size or hash seed differs from the router's are refused
(a worker hashing with another seed can never match the router's block hashes).
"""

from __future__ import annotations

import math
import numbers
import random
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Hashable, Sequence

from ..errors import InvalidArgument
from .index import KVIndex

ROUTERS = ("round-robin", "least-load", "prefix", "kv-aware", "kv-aware+guard")

# Decision reasons (the router's Prometheus counter is labelled with them).
REASON_ROUND_ROBIN = "round-robin"
REASON_LEAST_LOAD = "least-load"
REASON_MISS = "miss"            # no candidate holds the prompt's first block
REASON_OVERLAP = "overlap"      # the best-scoring worker by cache overlap (and cost)
REASON_GUARD = "guard"          # the best worker was overloaded: best overlap near the minimum load


class NoWorkerAvailable(RuntimeError):
    """No live worker can take the request (none known, or all refused)."""


@dataclass(frozen=True, slots=True)
class WorkerLoad:
    """A candidate worker and its load, as the caller knows it now."""

    worker_id: Hashable
    queued_prefill_tokens: int = 0
    running_requests: int = 0
    active_blocks: int = 0       # device blocks held by its running requests (capacity - free)
    fingerprint: str = ""
    block_size: int = 0          # 0: not checked
    hash_seed: int | None = None     # checked when the router's config pins one


@dataclass(frozen=True, slots=True)
class Decision:
    worker_id: Hashable
    reason: str
    overlap_blocks: int          # leading blocks on the chosen worker's device (predictions included)
    lower_tier_blocks: int       # further leading blocks on its lower tiers
    cost: float                  # the chosen worker's cost (kv-aware routers; else its load)


@dataclass(frozen=True)
class RouterConfig:
    block_size: int
    fingerprint: str = ""
    lower_tier_credit: float = 0.5   # a lower-tier hit saves this share of a block's prefill
    decode_share: float = 0.5        # one running request weighs this share of the routed prompt's blocks
    guard_slack: float = 4.0         # guard: load allowed above the minimum, in requests like the routed one
    seed: int = 0
    hash_seed: int | None = None     # the fleet's pinned hash seed; None: workers' seeds not checked

    def __post_init__(self) -> None:
        # A wrong type failed later in a comparison or mid-pick ('<=' not supported, a str
        # block size dividing the queued tokens): each is refused here, naming the field.
        for name in ("block_size", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise InvalidArgument(name, f"must be an int, got {type(value).__name__} {value!r}")
        if self.block_size <= 0:
            raise InvalidArgument("block_size", f"must be positive, got {self.block_size}")
        if not isinstance(self.fingerprint, str):
            raise InvalidArgument("fingerprint", f"must be a str, got {type(self.fingerprint).__name__} "
                                                 f"{self.fingerprint!r}")
        if self.hash_seed is not None and (isinstance(self.hash_seed, bool)
                                           or not isinstance(self.hash_seed, numbers.Integral)):
            raise InvalidArgument("hash_seed", f"must be an int or None, got {type(self.hash_seed).__name__} "
                                               f"{self.hash_seed!r}")
        for name in ("lower_tier_credit", "decode_share", "guard_slack"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise InvalidArgument(name, f"must be a number, got {type(value).__name__} {value!r}")
        if not 0.0 <= self.lower_tier_credit <= 1.0:
            raise InvalidArgument("lower_tier_credit", f"must be in [0, 1], got {self.lower_tier_credit}")
        if not (math.isfinite(self.decode_share) and self.decode_share >= 0):   # inf x 0 running: nan loads
            raise InvalidArgument("decode_share", f"must be a finite number >= 0, got {self.decode_share}")
        if not self.guard_slack >= 0:           # inf: no guard
            raise InvalidArgument("guard_slack", f"must be >= 0, got {self.guard_slack}")


class Router(ABC):
    """Base: candidate filtering, loads and random tie-breaks; subclasses choose."""

    name = "?"

    def __init__(self, index: KVIndex, config: RouterConfig) -> None:
        self.index = index
        self.config = config
        self.rng = random.Random(config.seed)

    def candidates(self, workers: Sequence[WorkerLoad]) -> list[WorkerLoad]:
        cfg = self.config
        ok = [w for w in workers if w.fingerprint == cfg.fingerprint and w.block_size in (0, cfg.block_size)
              and (cfg.hash_seed is None or w.hash_seed == cfg.hash_seed)]
        if not ok:
            if workers and cfg.hash_seed is not None:
                seen = sorted({(w.fingerprint, w.block_size, w.hash_seed) for w in workers}, key=repr)
                raise NoWorkerAvailable(f"no worker matches fingerprint {cfg.fingerprint!r}, block size "
                                        f"{cfg.block_size} and hash seed {cfg.hash_seed}; workers have "
                                        f"(fingerprint, block size, hash seed) {seen}")
            if workers:
                seen = sorted({(w.fingerprint, w.block_size) for w in workers})
                raise NoWorkerAvailable(f"no worker matches fingerprint {cfg.fingerprint!r} and block size "
                                        f"{cfg.block_size}; workers have (fingerprint, block size) {seen}")
            raise NoWorkerAvailable("no live worker")
        return ok

    def load(self, w: WorkerLoad, blocks: int = 1) -> float:
        """Queued prefill blocks + decode load, for a prompt of ``blocks`` blocks."""
        cfg = self.config
        return w.queued_prefill_tokens / cfg.block_size + cfg.decode_share * max(blocks, 1) * w.running_requests

    def _lowest(self, items: list, key) -> object:
        """The item with the lowest key; equal keys broken at random."""
        best = min(key(i) for i in items)
        tied = [i for i in items if key(i) == best]
        return tied[0] if len(tied) == 1 else self.rng.choice(tied)

    @abstractmethod
    def pick(self, hashes: Sequence[Hashable], workers: Sequence[WorkerLoad]) -> Decision:
        """The worker for a prompt of block ``hashes`` among the live ``workers``."""


class RoundRobinRouter(Router):
    name = "round-robin"

    def __init__(self, index: KVIndex, config: RouterConfig) -> None:
        super().__init__(index, config)
        self._turn = 0

    def pick(self, hashes, workers):
        ws = sorted(self.candidates(workers), key=lambda w: str(w.worker_id))
        w = ws[self._turn % len(ws)]
        self._turn += 1
        return Decision(w.worker_id, REASON_ROUND_ROBIN, 0, 0, self.load(w, len(hashes)))


class LeastLoadRouter(Router):
    name = "least-load"

    def pick(self, hashes, workers):
        n = len(hashes)
        w = self._lowest(self.candidates(workers), lambda w: self.load(w, n))
        return Decision(w.worker_id, REASON_LEAST_LOAD, 0, 0, self.load(w, n))


class _OverlapRouter(Router):
    """Scores every candidate from the index: overlap, lower-tier blocks, load, cost."""

    def _scores(self, hashes, workers) -> list[tuple[WorkerLoad, int, int, float, float]]:
        ws = self.candidates(workers)
        overlaps = self.index.overlaps(hashes, [w.worker_id for w in ws])
        total = len(hashes)
        credit = self.config.lower_tier_credit
        out = []
        for w, (dev, anytier) in zip(ws, overlaps):
            load = self.load(w, total)
            prefill = total - dev - credit * (anytier - dev)
            out.append((w, dev, anytier - dev, load, prefill + load))
        return out

    def _miss(self, scores) -> Decision:
        w, dev, low, load, cost = self._lowest(scores, lambda s: s[3])
        return Decision(w.worker_id, REASON_MISS, dev, low, cost)


class PrefixRouter(_OverlapRouter):
    name = "prefix"

    def pick(self, hashes, workers):
        scores = self._scores(hashes, workers)
        if all(s[1] == 0 for s in scores):
            return self._miss(scores)
        w, dev, low, load, cost = self._lowest(scores, lambda s: (-s[1], s[3]))
        return Decision(w.worker_id, REASON_OVERLAP, dev, low, cost)


class KVAwareRouter(_OverlapRouter):
    name = "kv-aware"

    def pick(self, hashes, workers):
        scores = self._scores(hashes, workers)
        if all(s[1] == 0 and s[2] == 0 for s in scores):
            return self._miss(scores)
        w, dev, low, load, cost = self._lowest(scores, lambda s: s[4])
        return Decision(w.worker_id, REASON_OVERLAP, dev, low, cost)


class GuardedKVAwareRouter(_OverlapRouter):
    name = "kv-aware+guard"

    def pick(self, hashes, workers):
        scores = self._scores(hashes, workers)
        if all(s[1] == 0 and s[2] == 0 for s in scores):
            return self._miss(scores)
        credit = self.config.lower_tier_credit
        best_overlap = lambda s: (-(s[1] + credit * s[2]), s[4])   # noqa: E731
        w, dev, low, load, cost = self._lowest(scores, best_overlap)
        # Guard this candidate only: is it too far above the least loaded worker?
        limit = min(s[3] for s in scores) + self.config.guard_slack * max(len(hashes), 1)
        if load <= limit:
            return Decision(w.worker_id, REASON_OVERLAP, dev, low, cost)
        w, dev, low, load, cost = self._lowest([s for s in scores if s[3] <= limit], best_overlap)
        return Decision(w.worker_id, REASON_GUARD, dev, low, cost)


_BY_NAME = {cls.name: cls for cls in (RoundRobinRouter, LeastLoadRouter, PrefixRouter, KVAwareRouter,
                                      GuardedKVAwareRouter)}


def make_router(name: str, index: KVIndex, config: RouterConfig) -> Router:
    try:
        cls = _BY_NAME[name]
    except (KeyError, TypeError):     # TypeError: an unhashable name (a list)
        raise InvalidArgument("router", f"unknown router {name!r}; choose from {', '.join(ROUTERS)}") from None
    return cls(index, config)
