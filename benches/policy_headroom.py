"""How much of the LRU -> MIN gap is within reach of an online policy, trace by trace.

MIN (Belady) knows every block's next use. An online policy sees only the past.
This script places the online policies between two bounds that isolate what
MIN's advantage is made of:

* ``reuse oracle``: LRU that knows *whether* a block will ever be used again
  (blocks with no future use are evicted first, LRU otherwise), not when.
  If it is close to MIN, the gap is all about predicting reuse.
* ``hindsight table``: ranks blocks by a reuse probability that was
  calibrated on the *whole* trace (in-sample, so optimistic) from the signals
  an online policy can see: the block's access count, the gap since its
  previous access, whether it is the request's last block, and the number of
  requests its chain's second block has served (the conversation's turn count
  on Mooncake traces). A block released at tick ``t`` with probability ``p``
  ranks as an LRU block released at ``t + tau * logit(p)``; the best ``tau``
  of a grid is kept (optimistic again). No online learner using these signals
  should beat it by much: if it closes little of the gap, the gap is made of
  information the past does not hold.

Usage::

    python benches/policy_headroom.py                       # the three shared traces at 5 %
    python benches/policy_headroom.py --trace T --capacity N --online lrfu,gdsf

Figures of a run are in benches/RESULTS.md ("Policy quality").
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections import OrderedDict, defaultdict
from pathlib import Path

from sortedcontainers import SortedList

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from prefixkv.errors import SequenceTooLong  # noqa: E402
from prefixkv.manager import KVCacheManager  # noqa: E402
from prefixkv.policies.base import PolicyBase  # noqa: E402
from prefixkv.sim.replay import replay  # noqa: E402
from prefixkv.sim.traces import load_trace  # noqa: E402

SHARED = Path(__file__).resolve().parents[2] / "shared" / "traces"
DEFAULT_TRACES = ("conversation_trace.jsonl", "synthetic_trace.jsonl", "weka-kv-cache-tester")
TAUS = (0.1, 0.25, 0.5, 1.0, 2.0, 4.0)   # multiples of the capacity, in releases


class ReuseOraclePolicy(PolicyBase):
    """LRU, except that blocks the trace never uses again go first (replay only)."""

    name = "reuse-oracle"

    def __init__(self) -> None:
        self._reused: set = set()                       # hashes with a future access
        self._dead: OrderedDict[int, None] = OrderedDict()
        self._live: OrderedDict[int, None] = OrderedDict()

    def set_next_use(self, block_hash, next_time: float) -> None:
        if next_time == math.inf:
            self._reused.discard(block_hash)
        else:
            self._reused.add(block_hash)

    def on_released(self, block: int) -> None:
        queue = self._live if self.pool.block_hash[block] in self._reused else self._dead
        queue[block] = None

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            self._dead.pop(block, None) if block in self._dead else self._live.pop(block)

    def evict(self) -> int:
        return (self._dead or self._live).popitem(last=False)[0]

    def clear(self) -> None:
        self._dead.clear()
        self._live.clear()

    def __len__(self) -> int:
        return len(self._dead) + len(self._live)

    def __contains__(self, block: int) -> bool:
        return block in self._dead or block in self._live

    def snapshot(self) -> tuple:
        return tuple(self._dead), tuple(self._live)


class ShiftedLRUPolicy(PolicyBase):
    """LRU with each release shifted by ``tau * logit(p)``; ``p`` per hash is set before admission."""

    name = "shifted-lru"

    def __init__(self, tau: float) -> None:
        self.tau = tau
        self.probability: dict = {}
        self._now = 0
        self._key: dict[int, tuple] = {}
        self._order = SortedList()

    def on_released(self, block: int) -> None:
        self._now += 1
        p = min(max(self.probability[self.pool.block_hash[block]], 1e-4), 1 - 1e-4)
        key = (self._now + self.tau * math.log(p / (1 - p)), block)
        self._key[block] = key
        self._order.add(key)

    def on_hit(self, block: int, was_evictable: bool) -> None:
        if was_evictable:
            self._order.remove(self._key.pop(block))

    def evict(self) -> int:
        _, block = self._order.pop(0)
        del self._key[block]
        return block

    def clear(self) -> None:
        self._key.clear()
        self._order.clear()

    def __len__(self) -> int:
        return len(self._key)

    def __contains__(self, block: int) -> bool:
        return block in self._key

    def snapshot(self) -> tuple:
        return tuple(self._order)


def hindsight_probabilities(requests) -> list[list[float]]:
    """Per request and block: P(the hash is accessed again), calibrated on the whole trace."""
    count: dict = defaultdict(int)
    last: dict = {}
    cells: list[list[tuple]] = []
    for i, request in enumerate(requests):
        hashes = request.block_hashes
        n = len(hashes)
        turn = min(count[hashes[1] if n > 1 else hashes[0]], 6)
        row = []
        for j, h in enumerate(hashes):
            gap = i - last[h] if h in last else -1
            row.append((min(count[h], 4), j == n - 1, gap.bit_length() if gap >= 0 else -1, turn))
        for h in hashes:
            count[h] += 1
            last[h] = i
        cells.append(row)
    reused: dict = defaultdict(lambda: [0, 0])
    seen_later: set = set()
    outcomes: list[list[bool]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        hashes = requests[i].block_hashes
        outcomes[i] = [h in seen_later for h in hashes]
        seen_later.update(hashes)
    for row, outs in zip(cells, outcomes):
        for cell, out in zip(row, outs):
            tally = reused[cell]
            tally[0] += out
            tally[1] += 1
    probs = []
    for row in cells:
        p = [reused[cell][0] / reused[cell][1] for cell in row]
        for j in range(len(p) - 2, -1, -1):  # a parent is reused whenever its child is
            p[j] = max(p[j], p[j + 1])
        probs.append(p)
    return probs


def replay_with_probabilities(trace, policy: ShiftedLRUPolicy, capacity: int, probs) -> float:
    mgr = KVCacheManager(capacity, trace.block_size, policy=policy, hash_seed=0, index="dict")
    hits = accesses = 0
    for i, request in enumerate(trace.requests):
        hashes = request.block_hashes
        policy.probability.update(zip(hashes, probs[i]))
        prompt = mgr.prompt_from_hashes(hashes, len(hashes) * trace.block_size)
        try:
            hit_tokens = mgr.admit(i, prompt, compute_last_token=False)
        except SequenceTooLong:
            hit_tokens = 0
        else:
            mgr.free(i)
        hits += hit_tokens // trace.block_size
        accesses += len(hashes)
    return hits / accesses


def headroom(path: Path, capacity: int | None, online: list[str]) -> dict:
    trace = load_trace(path)
    if trace.has_tokens:
        raise SystemExit(f"{path}: needs a hashed trace (Mooncake or kv-cache-tester)")
    capacity = capacity or max(1, round(0.05 * trace.distinct_blocks()))
    rates = {name: replay(trace, name, capacity).block_hit_rate for name in ["lru", *online, "belady"]}
    rates["reuse oracle"] = replay(trace, ReuseOraclePolicy(), capacity).block_hit_rate
    probs = hindsight_probabilities(trace.requests)
    best_tau, best = None, -1.0
    for tau in TAUS:
        rate = replay_with_probabilities(trace, ShiftedLRUPolicy(tau * capacity), capacity, probs)
        if rate > best:
            best_tau, best = tau, rate
    rates["hindsight table"] = best
    return {"trace": path.name, "capacity": capacity, "rates": rates, "tau": best_tau}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", action="append", type=Path, help="trace file or directory (repeatable)")
    ap.add_argument("--capacity", type=int, help="blocks (default: 5%% of the trace's distinct blocks)")
    ap.add_argument("--online", default="lrfu,gdsf,arc,workload", help="online policies to place")
    args = ap.parse_args(argv)
    paths = args.trace or [SHARED / name for name in DEFAULT_TRACES]
    online = [name for name in args.online.split(",") if name]
    print("| trace (capacity) | LRU | " + " | ".join(online)
          + " | hindsight table (tau) | reuse oracle | MIN |")
    print("|---|---|" + "---|" * (len(online) + 3))
    for path in paths:
        started = time.perf_counter()
        row = headroom(path, args.capacity, online)
        rates = row["rates"]
        lru, best = rates["lru"], rates["belady"]

        def cell(name: str) -> str:
            closed = (rates[name] - lru) / (best - lru) if best > lru else 0.0
            return f"{100 * rates[name]:.2f} ({100 * closed:+.0f}%)"

        cells = [f"{100 * lru:.2f}", *(cell(n) for n in online),
                 f"{cell('hindsight table')} τ={row['tau']}", cell("reuse oracle"), f"{100 * best:.2f}"]
        print(f"| {row['trace']} ({row['capacity']:,}) | " + " | ".join(cells) + " |",
              f"<!-- {time.perf_counter() - started:.0f} s -->", flush=True)


if __name__ == "__main__":
    main()
