"""A conformance check for eviction policies, built in or third party.

``check_policy(factory)`` drives fresh policies through the real manager on
seeded workloads made to stress a policy: shared system prompts, multi-turn
continuations, frees with session hints (a session per prompt lineage, end
reasons, a clock; some frees without a hint), exact repeats (duplicate blocks whose primary is evicted while
they are in use), decodes, forks, preemption and resumption, prefix-cache
resets, and admissions refused for lack of blocks. After every operation the
manager's invariants are checked, which include the policy's side: exactly
the released cached blocks are candidates (``len`` and ``in``), conservation
of blocks, refcounts equal to table holders. It also checks that a policy is
deterministic (the same workload twice gives the same evictions: replays must
be reproducible) and reports whether it ever chose differently from LRU (a
policy that never does is usually a policy that is not wired in).

Raises :class:`PolicyCheckFailed` naming the seed, step and operation.

    >>> from prefixkv.policies import check_policy, make_policy
    >>> report = check_policy(lambda: make_policy("lrfu"))
    >>> report.differs_from_lru
    True
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Callable

from .base import EvictionPolicy


class PolicyCheckFailed(AssertionError):
    """The policy broke the protocol; the message says where."""


@dataclass(frozen=True)
class PolicyReport:
    workloads: int
    operations: int
    evictions: int
    hit_tokens: int
    differs_from_lru: bool


_SYSTEMS = ([], [1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 13, 14, 15, 16])


def _workload(seed: int, steps: int, max_tokens: int) -> list[tuple]:
    """A seeded list of operations on sequence ids (ops on ids that are gone are skipped)."""
    rng = random.Random(seed)
    history: list[list[int]] = []
    lineage: list[int] = []          # session of each history entry
    session_of: dict[int, int] = {}  # sequence -> session
    ops: list[tuple] = []
    live: list[int] = []
    next_id = 0
    for step in range(steps):
        r = rng.random()
        if live and (len(live) >= 5 or r < 0.3):
            seq = live.pop(rng.randrange(len(live)))
            hint = None
            if rng.random() < 0.8:  # (session, end reason, time): the clock is the step
                hint = (session_of[seq], rng.choice(("tool_use", "tool_use", "end_turn", None)), float(step))
            ops.append(("free", seq, hint))
        elif live and r < 0.42:
            ops.append(("append", rng.choice(live), rng.randrange(1, 6)))
        elif live and r < 0.47:
            parent = rng.choice(live)
            ops.append(("fork", parent, next_id))
            session_of[next_id] = session_of[parent]
            live.append(next_id)
            next_id += 1
        elif live and r < 0.52:
            ops.append(("preempt", rng.choice(live)))
        elif r < 0.54:
            ops.append(("reset",))
        else:
            if history and rng.random() < 0.5:
                k = rng.randrange(len(history))
                prompt = list(history[k])  # a repeat, or a continuation of an earlier prompt
                session = lineage[k]
                if rng.random() < 0.6:
                    prompt += [rng.randrange(4) for _ in range(rng.randrange(1, 6))]
            else:
                prompt = rng.choice(_SYSTEMS) + [rng.randrange(20, 40) for _ in range(rng.randrange(1, 9))]
                session = next_id
            prompt = prompt[:max_tokens]
            history.append(prompt)
            lineage.append(session)
            session_of[next_id] = session
            ops.append(("admit", next_id, prompt, rng.randrange(3)))
            live.append(next_id)
            next_id += 1
    return ops


def _run(policy: EvictionPolicy, ops: list[tuple], num_blocks: int, block_size: int, where: str):
    from prefixkv.errors import OutOfBlocks, PrefixKVError
    from prefixkv.manager import KVCacheManager

    from .base import SessionHint

    evicted: list = []
    evict = policy.evict
    evict_many = getattr(policy, "evict_many", None)

    def recording_evict():
        block = evict()
        evicted.append(mgr.pool.block_hash[block])
        return block

    def recording_evict_many(k):
        blocks = evict_many(k)
        evicted.extend(mgr.pool.block_hash[block] for block in blocks)
        return blocks

    # patched before the pool binds the policy: the pool looks its batch methods up once
    policy.evict = recording_evict  # type: ignore[method-assign]
    if evict_many is not None:
        policy.evict_many = recording_evict_many  # type: ignore[method-assign]
    mgr = KVCacheManager(num_blocks, block_size, policy=policy, hash_seed=0)
    for step, op in enumerate(ops):
        kind, *args = op
        try:
            if kind == "admit":
                seq_id, tokens, priority = args
                try:
                    mgr.admit(seq_id, tokens, priority=priority)
                except OutOfBlocks:
                    pass
            elif args and args[0] not in mgr:
                continue
            elif kind == "free":
                seq_id, hint = args
                mgr.free(seq_id, hint=None if hint is None else SessionHint(hint[0], end=hint[1], time=hint[2]))
            elif kind == "append":
                seq_id, n = args
                if mgr.is_preempted(seq_id):
                    mgr.resume(seq_id)
                else:
                    mgr.append(seq_id, [(mgr.num_tokens(seq_id) + i) % 3 for i in range(n)])
            elif kind == "fork":
                if not mgr.is_preempted(args[0]):
                    mgr.fork(args[0], args[1])
            elif kind == "preempt":
                if not mgr.is_preempted(args[0]):
                    mgr.preempt(args[0])
            elif kind == "reset":
                mgr.reset_prefix_cache(preempt_running=True)
        except OutOfBlocks:
            pass  # refused for lack of blocks; the invariant check below still runs
        except PrefixKVError as exc:
            raise PolicyCheckFailed(f"{where}, step {step} {op!r}: {type(exc).__name__}: {exc}") from exc
        except Exception as exc:  # the policy itself raised
            raise PolicyCheckFailed(f"{where}, step {step} {op!r}: the policy raised "
                                    f"{type(exc).__name__}: {exc}") from exc
        try:
            mgr.check_invariants()
        except PrefixKVError as exc:
            raise PolicyCheckFailed(f"{where}, after step {step} {op!r}: {exc}") from exc
    return mgr, evicted


def check_policy(factory: Callable[[], EvictionPolicy], *, seeds: int = 6, steps: int = 300,
                 num_blocks: int = 16, block_size: int = 4) -> PolicyReport:
    """Check the policies ``factory()`` builds (one per workload); see the module doc."""
    from .lru import LRUPolicy

    probe = factory()
    if not isinstance(probe, EvictionPolicy):
        missing = [m for m in ("bind", "on_cached", "on_released", "on_hit", "evict", "clear", "__len__",
                               "__contains__", "snapshot") if not hasattr(probe, m)]
        raise PolicyCheckFailed(f"{type(probe).__name__} does not follow the EvictionPolicy protocol; "
                                f"missing: {', '.join(missing) or 'the name attribute'}")
    operations = evictions = hit_tokens = 0
    differs = False
    for seed in range(seeds):
        ops = _workload(seed, steps, (num_blocks // 3) * block_size)
        where = f"seed {seed}"
        mgr, evicted = _run(factory(), ops, num_blocks, block_size, where)
        _, again = _run(factory(), ops, num_blocks, block_size, where + " (second run)")
        if again != evicted:
            raise PolicyCheckFailed(f"{where}: two runs of the same workload evicted different blocks "
                                    "(a policy must be deterministic for replays to be reproducible)")
        _, by_lru = _run(LRUPolicy(), ops, num_blocks, block_size, where + " (LRU)")
        differs = differs or evicted != by_lru
        operations += len(ops)
        evictions += len(evicted)
        hit_tokens += mgr.stats().hit_tokens
    return PolicyReport(seeds, operations, evictions, hit_tokens, differs)
