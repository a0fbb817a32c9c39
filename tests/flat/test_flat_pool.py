"""``FlatBlockPool`` (the hash index in flat arrays, ``prefixkv.flat``) against ``BlockPool`` (a dict
and a list): driven by the same calls, the two must give the same answers and end every step in the
same state (snapshots with the policy's order and the KV events, counters, lookups, the evictions
reported to ``on_evict_many``).

* A state machine drives both pools with everything a manager does to a pool (allocate, publish by
  run / batch / block, release with priorities and hints, prefix hits, forks, host-tier takes,
  demotions in, forgets, resets) over a small universe of 16-byte digests chosen so that several
  share a home slot of the flat table (its probe runs, wrap-around and backward-shift deletions
  are exercised, not just its empty slots). Policies: every built-in one that runs without an
  oracle, plus LRU subclasses that take the pool's checked eviction burst (``_evict_batch``) and
  its block-by-block paths, and a PriorityPolicy with pins. ``record_events`` on forces the
  per-element paths, off the batch ones.
* A policy returning bad victims from ``evict_many`` (active, uncached, twice, not an int, the
  wrong count): both pools raise PolicyError, keep the victims before the bad one, and give the
  valid ones after it back to the policy.
* ``KVCacheManager(index="flat" | "dict" | "auto")`` give the same results over a random workload.
"""

import hashlib
import random

import pytest

pytest.importorskip("numba")

from hypothesis import HealthCheck, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule  # noqa: E402

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.errors import (HashMismatch, InvalidArgument, InvariantViolation, OutOfBlocks,  # noqa: E402
                             PolicyError)
import prefixkv.flat.lru as flat_lru_module  # noqa: E402
from prefixkv.flat.lru import CompiledLRU  # noqa: E402
from prefixkv.flat.pool import FlatBlockPool  # noqa: E402
from prefixkv.policies import SessionHint, available_policies, make_policy  # noqa: E402
from prefixkv.policies.lru import LRUPolicy  # noqa: E402
from prefixkv.policies.priority import PriorityPolicy  # noqa: E402
from prefixkv.pool import BlockPool  # noqa: E402

from policy_doubles import SingleEventLRU  # noqa: E402

# -- the hash universe ---------------------------------------------------------------------------


def _digest(i: int) -> bytes:
    return hashlib.blake2b(b"flat-pool-%d" % i, digest_size=16).digest()


_M64 = (1 << 64) - 1


def _home(digest: bytes, mask: int = 1023) -> int:
    """The slot of a ``mask + 1``-slot flat table where ``digest`` starts probing: the kernels' mix
    (``prefixkv.flat.kernels``) of its 64-bit words, in plain Python."""
    words = [int.from_bytes(digest[i:i + 8], "little") for i in range(0, len(digest), 8)]
    h = words[0]
    for w in words[1:]:
        h ^= (w * 0x9E3779B97F4A7C15) & _M64
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _M64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _M64
    h ^= h >> 31
    return h & mask


def _universe() -> list[bytes]:
    """16 digests: runs of keys sharing the home slots 1022, 1023, 0 and 1 of a 1,024-slot table
    (the smallest, all these pools ever use), so probe runs are long and wrap around, and
    deletions shift entries back across the end; and 4 keys elsewhere."""
    want = {1022: 4, 1023: 3, 0: 3, 1: 2}
    chosen: list[bytes] = []
    others: list[bytes] = []
    i = 0
    while any(want.values()) or len(others) < 4:
        d = _digest(i)
        i += 1
        h = _home(d)
        if want.get(h):
            want[h] -= 1
            chosen.append(d)
        elif len(others) < 4 and not 1016 <= (h - 8) % 1024:
            others.append(d)
    return chosen + others


U = _universe()
NOT_KEYS = [_digest(-1), b"short", b"x" * 24, 7, None]   # never cached: a miss, whatever the index

_rng = random.Random(1)
QUERIES = [[U[_rng.randrange(len(U))] for _ in range(_rng.randrange(1, 9))] for _ in range(16)]
QUERIES += [[h] for h in U] + [list(U), U[::-1]]


# -- policies ------------------------------------------------------------------------------------


class CheckedLRU(LRUPolicy):
    """LRU without its ``valid_victims`` promise: the pool checks each burst (``_evict_batch``)."""
    name = "lru-checked"
    valid_victims = False


EXTRA = {
    "lru-checked": CheckedLRU,
    "lru-single": SingleEventLRU,
    "priority": lambda: PriorityPolicy(make_policy("lru"), min_priority=2),
    "priority-lfu": lambda: PriorityPolicy(make_policy("lfu"), min_priority=2),
}
POLICIES = sorted(n for n in available_policies() if n != "belady") + sorted(EXTRA) + ["lru-compiled"]


def build_policy(name: str, flat: bool = False):
    """``lru-compiled``: the flat pool runs the LRU kept in arrays (``CompiledLRU``, what a manager
    gives a flat pool for "lru"), the dict pool ``LRUPolicy``: same order, same victims."""
    if name == "lru-compiled":
        return CompiledLRU() if flat else LRUPolicy()
    return EXTRA[name]() if name in EXTRA else make_policy(name)


def test_the_universe_crowds_the_flat_table():
    """The digests share home slots (else the machine tests an index without probe runs): checked
    against the kernels' own mix where it can be called (a private function: skipped if renamed)."""
    assert len(set(U)) == len(U) == 16
    assert all(len(h) == 16 for h in U)
    homes = [_home(h) for h in U]
    assert sorted(homes[:12]) == [0] * 3 + [1] * 2 + [1022] * 4 + [1023] * 3
    import numpy as np

    from prefixkv.flat import kernels
    mix = getattr(kernels, "_home", None) or getattr(kernels, "_tag", None)
    if mix is None:
        pytest.skip("the kernels' mix is not a function here")
    args = (1023,) if mix.__name__ == "_home" else ()
    assert [int(mix(np.frombuffer(h, np.uint64), *args)) & 1023 for h in U] == homes


# -- the state machine ---------------------------------------------------------------------------

INDEX = st.integers(0, 10_000)            # which table / block, modulo what there is
HASHES = st.lists(st.integers(0, len(U) - 1), min_size=1, max_size=8)
PARENT = st.one_of(st.none(), st.integers(0, len(U) - 1).map(U.__getitem__))


def _outcome(fn, pool):
    try:
        return ("ok", fn(pool))
    except OutOfBlocks as exc:
        return ("OutOfBlocks", exc.needed, exc.available)
    except (PolicyError, InvariantViolation) as exc:
        return (type(exc).__name__,)


class PoolPair(RuleBasedStateMachine):
    """A dict-indexed and a flat-indexed pool driven in lockstep, with the block tables a manager
    would keep (``tables``: the references held, a block once per holder)."""

    # small pools half the time: 16 hashes fill them, so bursts of evictions are common; the
    # policies with batch events (the fast paths) drawn more often
    @initialize(num_blocks=st.one_of(st.integers(4, 12), st.integers(13, 40)), block_size=st.integers(1, 4),
                policy=st.sampled_from(POLICIES + ["lru", "lru-checked", "session", "lru-compiled"] * 3),
                track_reuse=st.booleans(), record_events=st.booleans(), keep_chain=st.booleans(),
                record_evictions=st.booleans())
    def setup(self, **params):
        self._setup(**params)

    def _setup(self, num_blocks, block_size, policy, track_reuse, record_events, keep_chain, record_evictions):
        self.policy_name = policy
        kwargs = dict(record_events=record_events, track_reuse=track_reuse)
        self.d = BlockPool(num_blocks, block_size, build_policy(policy), **kwargs)
        self.f = FlatBlockPool(num_blocks, block_size, build_policy(policy, flat=True), digest_size=16, **kwargs)
        assert not isinstance(self.d, FlatBlockPool)
        if keep_chain:
            self.d.keep_chain = self.f.keep_chain = True
        self.pools = (self.d, self.f)
        self.tables: list[list[int]] = []
        self.clock = 0.0
        self.evicted = ([], [])
        if record_evictions:
            for pool, seen in zip(self.pools, self.evicted):
                pool.on_evict_many = lambda blocks, hashes, seen=seen: seen.append((list(blocks), list(hashes)))

    # -- helpers --
    def both(self, fn):
        got = [_outcome(fn, pool) for pool in self.pools]
        assert got[0] == got[1]
        return got[0]

    def table(self, i: int) -> list[int]:
        return self.tables[i % len(self.tables)]

    def publishable(self, table: list[int]) -> list[int]:
        """The table's active blocks that hold no hash and are no duplicate (each once)."""
        d = self.d
        return list(dict.fromkeys(b for b in table if d.block_hash[b] is None and b not in d._duplicate_hash))

    # -- rules --
    @rule(n=st.integers(1, 8), tokens=st.one_of(st.none(), st.integers(0, 4)))
    def allocate(self, n, tokens):
        if tokens is not None:
            tokens = min(tokens, self.d.block_size)
        got = self.both(lambda p: p.allocate(n, tokens))
        if got[0] == "ok":
            self.tables.append(got[1])

    @rule(hashes=HASHES, priority=st.sampled_from([0, 0, 1, 3]), parent=PARENT, depth=st.integers(0, 5))
    def request(self, hashes, priority, parent, depth):
        """A whole request: allocate, publish the run (hits and duplicates likely), release tail first."""
        hs = [U[i] for i in hashes]

        def go(p):
            blocks = p.allocate(len(hs), p.block_size)
            p.publish_run(blocks, hs, parent, depth)
            p.release(blocks[::-1], priority)
            return blocks
        self.both(go)

    @rule(spare=st.integers(0, 2), keep=st.booleans())
    def fill(self, spare, keep):
        """Allocate every free block but ``spare``: one burst evicts (nearly) every evictable block."""
        k = max(0, self.d.num_free - spare)
        got = self.both(lambda p: p.allocate(k, p.block_size))
        if got[0] == "ok" and got[1]:
            if keep:
                self.tables.append(got[1])
            else:
                self.both(lambda p: p.release(got[1]))

    @precondition(lambda self: self.tables)
    @rule(i=INDEX, hashes=HASHES, mode=st.sampled_from(["run", "many", "single"]), parent=PARENT,
          depth=st.integers(0, 5), parents=st.lists(PARENT, min_size=8, max_size=8),
          depths=st.lists(st.integers(0, 9), min_size=8, max_size=8), full=st.booleans())
    def publish(self, i, hashes, mode, parent, depth, parents, depths, full):
        blocks = self.publishable(self.table(i))[:len(hashes)]
        hs = [U[j] for j in hashes[:len(blocks)]]

        def go(p):
            if full:
                for b in blocks:
                    p.num_tokens[b] = p.block_size
            if mode == "run":
                return p.publish_run(blocks, hs, parent, depth)
            if mode == "many":
                return p.publish_many(blocks, hs, parents[:len(blocks)], depths[:len(blocks)])
            return [p.publish(b, h, pa, de) for b, h, pa, de in zip(blocks, hs, parents, depths)]
        self.both(go)

    @precondition(lambda self: self.tables)
    @rule(i=INDEX, priority=st.sampled_from([0, 0, 0, 1, 3, -1]), reverse=st.booleans(),
          hint=st.one_of(st.none(), st.tuples(st.integers(0, 2), st.sampled_from([None, "tool_use", "end_turn"]))),
          claim_cached=st.booleans())
    def release(self, i, priority, reverse, hint, claim_cached):
        table = self.tables.pop(i % len(self.tables))
        order = table[::-1] if reverse else list(table)
        if hint is not None:
            self.clock += 1.0
            hint = SessionHint(hint[0], end=hint[1], time=self.clock)
        # all_cached: the caller's promise, made only when it holds
        all_cached = claim_cached and all(self.d.block_hash[b] is not None for b in table)
        self.both(lambda p: p.release(order, priority, hint, all_cached=all_cached))

    @rule(hashes=HASHES, start=st.integers(0, 3), cut=st.integers(0, 8), acquire=st.booleans(),
          distinct=st.booleans(), done=st.booleans())
    def hit(self, hashes, start, cut, acquire, distinct, done):
        """The manager's prefix match: the leading run of hits, then a reference on each (``done``:
        a request served from the cache alone, released at once: its blocks were reused)."""
        hs = [U[j] for j in hashes]
        limit = max(0, len(hs) - cut % (len(hs) + 1))
        got = self.both(lambda p: p.leading_hits(hs, start, limit))[1]
        assert got == self.d.leading_hits(hs, start, limit)
        if acquire and got:
            flag = distinct and len(set(got)) == len(got)
            self.both(lambda p: p.acquire_hits(list(got), distinct=flag))
            if done:
                self.both(lambda p: p.release(got[::-1]))
            else:
                self.tables.append(list(got))

    @precondition(lambda self: self.tables)
    @rule(priority=st.sampled_from([0, 0, 3]))
    def release_all(self, priority):
        """Every sequence ends (oldest first): nothing active, no duplicate, every fast path open."""
        for table in self.tables:
            self.both(lambda p: p.release(table[::-1], priority))
        self.tables.clear()

    @precondition(lambda self: self.tables)
    @rule(i=INDEX)
    def share(self, i):
        table = list(self.table(i))
        self.both(lambda p: p.share(table))
        self.tables.append(table)

    @rule(hashes=HASHES, active_too=st.booleans(), distinct=st.booleans(), evictable=st.booleans())
    def take(self, hashes, active_too, distinct, evictable):
        """Host-tier take: hold cached blocks and drop their hashes (their content moves up). The
        blocks of some hashes (``evictable``: every evictable one among them, in their order)."""
        d = self.d
        if evictable:
            hashes = sorted(set(hashes), key=hashes.index) + [j for j in range(len(U)) if j not in hashes]
        blocks = [d.lookup(U[j]) for j in hashes]
        blocks = list(dict.fromkeys(b for b in blocks if b is not None))
        if evictable or not active_too:
            blocks = [b for b in blocks if not d.ref_count[b]]
        self.both(lambda p: p.take_cached(list(blocks), distinct=distinct))
        if blocks:
            self.tables.append(blocks)

    @rule(hashes=HASHES, chained=st.booleans())
    def cache_many(self, hashes, chained):
        """Demotions into this pool: cached and evictable at once (OutOfBlocks when it cannot)."""
        hs = [U[j] for j in hashes]
        parents = [None, *hs[:-1]] if chained else [None] * len(hs)
        self.both(lambda p: p.cache_many(hs, parents, list(range(len(hs)))))

    @precondition(lambda self: self.tables)
    @rule(i=INDEX)
    def forget(self, i):
        held = [b for t in self.tables for b in t if self.d.block_hash[b] is not None]
        if held:
            block = held[i % len(held)]
            self.both(lambda p: p.forget(block))

    @rule(keep_active=st.booleans(), go=st.integers(0, 2))
    def clear(self, keep_active, go):
        # (a third of the draws: a reset empties the cache the other rules need)
        # with blocks active and keep_active off, both refuse (InvariantViolation), unchanged
        if not go:
            self.both(lambda p: p.clear_cache(keep_active=keep_active))

    @precondition(lambda self: isinstance(self.d.policy, PriorityPolicy))
    @rule(h=st.integers(0, len(U) - 1), ttl=st.one_of(st.none(), st.integers(1, 20)), unpin=st.booleans())
    def pin(self, h, ttl, unpin):
        if unpin:
            self.both(lambda p: p.policy.unpin(U[h]))
        else:
            self.both(lambda p: p.policy.pin(U[h], ttl=ttl))

    @rule(hashes=st.lists(st.integers(0, len(U) + len(NOT_KEYS) - 1), max_size=10),
          start=st.integers(0, 4), limit=st.integers(0, 12), drain=st.booleans())
    def query(self, hashes, start, limit, drain):
        if drain:
            self.both(lambda p: p.drain_events())
        everything = U + NOT_KEYS[:1]      # 16-byte digests only: what a flat index keys
        hs = [everything[j % len(everything)] for j in hashes]
        limit = min(limit, len(hs))
        self.both(lambda p: p.leading_hits(hs, start, limit))
        self.both(lambda p: p.holds_none(hs))

    # -- after every step --
    @invariant()
    def same_state(self):
        d, f = self.d, self.f
        for pool in self.pools:
            pool.check(self.tables)
        assert f.snapshot() == d.snapshot()
        for name in ("num_free", "num_free_uncached", "num_cached", "num_evictable", "num_active", "evictions",
                     "insertions", "unused_removals", "forgotten", "cleared"):
            assert getattr(f, name) == getattr(d, name), name
        assert f.num_unused_cached() == d.num_unused_cached()
        assert f._reused == d._reused
        assert f._duplicates == d._duplicates
        assert self.evicted[0] == self.evicted[1]
        assert len(f.cached_map) == len(d.cached_map) == f.index.count
        assert set(f.cached_map.items()) == set(d.cached_map.items())
        assert sorted(f.index.blocks()) == sorted(d.cached_map.values())
        for h in U:
            assert f.lookup(h) == d.lookup(h)
            assert (h in f.cached_map) == (h in d.cached_map)
        for h in NOT_KEYS:
            assert f.lookup(h) is None and d.lookup(h) is None
        for b in range(len(d.ref_count)):
            assert f.is_cached(b) == d.is_cached(b)
            assert f.block_hash[b] == d.block_hash[b]
        for q in QUERIES:
            assert f.holds_none(q) == d.holds_none(q)
            for start, limit in ((0, len(q)), (1, len(q)), (0, len(q) - 1), (0, 1)):
                assert f.leading_hits(q, start, limit) == d.leading_hits(q, start, limit)
        assert f.holds_none([]) and d.holds_none([])


class FastPathPair(PoolPair):
    """The same machine where the pool's batch paths are open: policies with batch events (LRU with
    and without its ``valid_victims`` promise, session), no KV events."""

    @initialize(num_blocks=st.one_of(st.integers(4, 12), st.integers(13, 40)), block_size=st.integers(1, 4),
                policy=st.sampled_from(["lru", "lru-checked", "session", "lru-compiled", "lru-compiled"]),
                track_reuse=st.booleans(),
                record_events=st.just(False), keep_chain=st.booleans(), record_evictions=st.booleans())
    def setup(self, **params):
        self._setup(**params)


class CompiledPathPair(FastPathPair):
    """The fast-path machine with every batch, however short, through the compiled calls (they
    serve batches of ``SMALL`` blocks or more; the machine's batches are shorter)."""

    @initialize(num_blocks=st.one_of(st.integers(4, 12), st.integers(13, 40)), block_size=st.integers(1, 4),
                policy=st.just("lru-compiled"), track_reuse=st.just(False), record_events=st.just(False),
                keep_chain=st.booleans(), record_evictions=st.booleans())
    def setup(self, **params):
        self._small = flat_lru_module.SMALL     # (read when a pool builds its fused batches)
        flat_lru_module.SMALL = 1
        self._setup(**params)

    def teardown(self):
        if hasattr(self, "_small"):
            flat_lru_module.SMALL = self._small


_SETTINGS = dict(stateful_step_count=40, deadline=None,
                 suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
PoolPair.TestCase.settings = settings(max_examples=150, **_SETTINGS)
FastPathPair.TestCase.settings = settings(max_examples=120, **_SETTINGS)
TestFlatPoolEqualsDictPool = PoolPair.TestCase
TestFlatPoolEqualsDictPoolFastPaths = FastPathPair.TestCase
CompiledPathPair.TestCase.settings = settings(max_examples=120, **_SETTINGS)
TestFlatPoolEqualsDictPoolCompiledPaths = CompiledPathPair.TestCase


# -- bad victims from evict_many -------------------------------------------------------------------


V = "v"      # a placeholder in a victim template: the next valid victim (the LRU order's)


class BadVictims(CheckedLRU):
    """A checked LRU whose next ``evict_many`` answers with ``template`` (one shot): each ``V`` is
    the next valid victim (taken from LRU), anything else is returned as it is."""
    name = "lru-bad"

    def __init__(self):
        super().__init__()
        self.template = None

    def evict_many(self, k):
        template, self.template = self.template, None
        if template is None:
            return LRUPolicy.evict_many(self, k)
        if template == "raise":
            raise RuntimeError("broken policy")
        valid = iter(LRUPolicy.evict_many(self, template.count(V)))
        return [next(valid) if v is V else v for v in template]


def _bad_history(pool_cls, track_reuse):
    """10 blocks of 2 tokens: 0-5 evictable (LRU order 0..5), 6 active cached, 7 active uncached
    (forgotten), 8 free uncached (forgotten, released), 9 active cached."""
    pool = pool_cls(10, 2, BadVictims(), track_reuse=track_reuse)
    blocks = pool.allocate(10, 2)
    pool.publish_run(blocks, U[:10], None, 0)
    pool.release(blocks[:6])
    pool.forget(7)
    pool.forget(8)
    pool.release([8])
    held = [6, 7, 9]
    pool.check([held])
    return pool, held


# allocate(5) takes block 8 from the free list and asks the policy for 4 victims
# (name, template, victims taken, valid victims given back to the policy)
BAD = [
    ("active", [V, 6, V, V], [0], [1, 2]),
    ("active-first", [9, V, V, V], [], [0, 1, 2]),
    ("uncached-free", [V, V, 8, V], [0, 1], [2]),          # 8: in the allocation's hands, no hash
    ("uncached-active", [V, 7, V, V], [0], [1, 2]),
    ("twice", [V, V, 0, V], [0, 1], [2]),
    ("twice-adjacent", [V, 0, V, V], [0], [1, 2]),
    ("string", [V, "x", V, V], [0], [1, 2]),
    ("float", [V, V, 1.5, V], [0, 1], [2]),
    ("none", [V, None, V, V], [0], [1, 2]),
    ("negative", [V, -1, V, V], [0], [1, 2]),
    ("out-of-range", [V, V, 99, V], [0, 1], [2]),
    ("too-few", [V, V, V], [], [0, 1, 2]),
    ("too-many", [V, V, V, V, V], [], [0, 1, 2, 3, 4]),
    ("none-at-all", [], [], []),
    ("uncached-then-active", [V, 8, 6, V], [0], [1]),
    ("active-then-uncached", [V, 6, 8, V], [0], [1]),
    ("string-first", ["x", V, V, V], [], [0, 1, 2]),
]


def _after_bad_burst(pool_cls, template, track_reuse=False):
    """The pool after ``allocate(5)`` met ``template`` (PolicyError raised), and the blocks held."""
    pool, held = _bad_history(pool_cls, track_reuse)
    pool.policy.template = template if template == "raise" else list(template)
    with pytest.raises(PolicyError):
        pool.allocate(5)
    return pool, held


def _as_documented(pool, held, taken, back, track_reuse):
    """The victims before the bad one are taken (free, uncached, counted as evictions), the valid ones
    after it are back in the policy, the ones the policy never handed out stay where they were."""
    pool.check([held])
    assert pool.evictions == len(taken)
    assert pool._free[-1] == 8 and sorted(pool._free) == sorted([8, *taken])
    for b in taken:
        assert not pool.is_cached(b) and b not in pool.policy
    for b in back:
        assert pool.is_cached(b) and b in pool.policy and pool.ref_count[b] == 0
    assert set(pool.policy.snapshot()) == set(range(6)) - set(taken)
    assert sorted(pool.cached_map.values()) == sorted(set(range(10)) - set(taken) - {7, 8})
    if track_reuse:
        assert pool.unused_removals == len(taken)


BAD_IDS = [b[0] for b in BAD]


@pytest.mark.parametrize("track_reuse", [False, True])
@pytest.mark.parametrize("name,template,taken,back", BAD + [("raise", "raise", [], [])], ids=BAD_IDS + ["raise"])
def test_bad_victims_flat_pool_as_documented(name, template, taken, back, track_reuse):
    pool, held = _after_bad_burst(FlatBlockPool, template, track_reuse)
    _as_documented(pool, held, taken, back, track_reuse)
    more = pool.allocate(pool.num_free)        # and it goes on: the next burst evicts normally
    pool.check([held, more])


@pytest.mark.parametrize("name,template,taken,back", BAD + [("raise", "raise", [], [])], ids=BAD_IDS + ["raise"])
def test_bad_victims_dict_pool_as_documented(name, template, taken, back):
    """The reference pool under the same contract (``BlockPool._evict_batch``'s docstring).

    The shapes that need care: a bad victim that the pool's deletion loop does not reach first (the
    wrong count, a negative or out-of-range id, a non-int after the first victim): the valid
    victims before it are still taken and the first one is not lost (left cached, neither evictable
    nor free); and an uncached block before an active one is not taken as a victim (free twice)."""
    pool, held = _after_bad_burst(BlockPool, template, True)
    _as_documented(pool, held, taken, back, True)


@pytest.mark.parametrize("name,template,taken,back", BAD + [("raise", "raise", [], [])], ids=BAD_IDS + ["raise"])
def test_bad_victims_leave_both_pools_in_one_state(name, template, taken, back):
    """Both pools raise PolicyError and end in the same state (the policy's order included)."""
    d, _ = _after_bad_burst(BlockPool, template, True)
    f, _ = _after_bad_burst(FlatBlockPool, template, True)
    assert f.snapshot() == d.snapshot()
    assert (f.evictions, f.unused_removals, f._reused) == (d.evictions, d.unused_removals, d._reused)


@pytest.mark.parametrize("policy", ["lru", "lru-checked", "session", "fifo"])
def test_take_cached_of_reused_blocks(policy):
    """track_reuse: blocks hit, released, then taken up a tier (the fast path where the policy has
    batch events) end their residencies as the dict pool's do, and are evicted alike later."""
    pools = [cls(8, 4, build_policy(policy), track_reuse=True) for cls in (BlockPool, FlatBlockPool)]
    for pool in pools:
        blocks = pool.allocate(4, 4)
        pool.publish_run(blocks, U[:4], None, 0)
        pool.release(blocks[::-1])
        pool.acquire_hits(blocks[:3], distinct=True)
        pool.release(blocks[2::-1])
        pool.take_cached(blocks[1:], distinct=True)
        pool.check([blocks[1:]])
        pool.release(blocks[:0:-1])
        pool.allocate(8)
    d, f = pools
    assert f.snapshot() == d.snapshot()
    assert (f._reused, f.unused_removals, f.forgotten, f.evictions) == \
        (d._reused, d.unused_removals, d.forgotten, d.evictions)


def test_a_good_checked_burst_and_its_report():
    """The checked burst (``_evict_batch``) when the policy behaves: same victims, same report."""
    seen = {}
    for pool_cls in (BlockPool, FlatBlockPool):
        pool, held = _bad_history(pool_cls, True)
        seen[pool_cls] = []
        pool.on_evict_many = lambda blocks, hashes, s=seen[pool_cls]: s.append((list(blocks), list(hashes)))
        assert pool.allocate(5) == [8, 0, 1, 2, 3]
        pool.check([held, [8, 0, 1, 2, 3]])
        assert pool.evictions == 4 and pool.unused_removals == 4
    assert seen[BlockPool] == seen[FlatBlockPool] == [([0, 1, 2, 3], U[:4])]


# -- a table past its first size: growth and rehashes ---------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "lru-checked", "fifo"])
def test_a_pool_past_the_first_table(policy):
    """3,000 blocks: the flat table grows (rehash) several times, with evictions all along."""
    rng = random.Random(5)
    d = BlockPool(3000, 1, build_policy(policy), track_reuse=True)
    f = FlatBlockPool(3000, 1, build_policy(policy), track_reuse=True)
    keys = [_digest(10_000 + i) for i in range(5000)]
    for step in range(40):
        n = rng.randrange(50, 400)
        hs = rng.sample(keys, n)
        assert f.leading_hits(hs, 0, n) == d.leading_hits(hs, 0, n)
        assert f.holds_none(hs) == d.holds_none(hs)
        for pool in (d, f):
            blocks = pool.allocate(n, 1)
            pool.publish_run(blocks, hs, None, 0)
            pool.release(blocks[::-1])
        assert f.snapshot() == d.snapshot()
        assert f.num_cached == d.num_cached == f.index.count
        probe = rng.sample(keys, 300)
        assert [f.lookup(h) for h in probe] == [d.lookup(h) for h in probe]
        assert f.holds_none(probe) == d.holds_none(probe)
    assert f.index.slots.shape[0] > 1024
    f.check([])


# -- the manager's index choice -------------------------------------------------------------------


def _workload(index, seed, policy, host, algorithm="xxh3_128"):
    kwargs = dict(num_host_blocks=12, host_cache=True) if host else {}
    m = KVCacheManager(40, 4, policy=policy, hash_seed=0, index=index, track_reuse=True, hash_algorithm=algorithm,
                       **kwargs)
    rng = random.Random(seed)
    prefixes = [[rng.randrange(40) for _ in range(rng.randrange(0, 24))] for _ in range(5)]
    live: list[int] = []
    log: list = []
    for step in range(150):
        r = rng.random()
        if r < 0.5 or not live:
            tokens = rng.choice(prefixes) + [rng.randrange(40) for _ in range(rng.randrange(0, 10))]
            if not tokens:
                tokens = [1]
            log.append(("match", m.match(tokens)))
            try:
                log.append(("admit", m.admit(step, tokens), m.block_ids(step)))
                live.append(step)
            except OutOfBlocks as exc:
                log.append(("oob", exc.needed, exc.available))
        elif r < 0.62:
            seq = rng.choice(live)
            try:
                m.append(seq, [rng.randrange(40) for _ in range(rng.randrange(1, 6))])
                log.append(("append", m.block_ids(seq)))
            except OutOfBlocks as exc:
                log.append(("oob", exc.needed, exc.available))
        elif r < 0.68:
            child = ("fork", step)
            m.fork(rng.choice(live), child)
            live.append(child)
            log.append(("fork", m.block_ids(child)))
        elif r < 0.70:
            for seq in live:
                m.free(seq)
            live.clear()
            m.reset_prefix_cache()
        else:
            seq = live.pop(rng.randrange(len(live)))
            m.free(seq)
        log.append(m.stats())
        log.append(sorted((repr(s), m.block_ids(s)) for s in live))
        m.take_copies()
        m.take_demotions()
        m.take_loads()
        m.check_invariants()
    return m, log


@pytest.mark.parametrize("policy,host,algorithm", [("lru", False, "xxh3_128"), ("lru", True, "xxh3_128"),
                                                   ("s3fifo", False, "xxh3_128"), ("leaf-lru", True, "xxh3_128"),
                                                   ("lru", False, "xxh3_64")])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_manager_index_choice_changes_nothing(seed, policy, host, algorithm):
    runs = {index: _workload(index, seed, policy, host, algorithm) for index in ("flat", "dict", "auto")}
    assert isinstance(runs["flat"][0].pool, FlatBlockPool)
    assert isinstance(runs["auto"][0].pool, FlatBlockPool)          # numba imports here
    assert not isinstance(runs["dict"][0].pool, FlatBlockPool)
    assert runs["flat"][1] == runs["dict"][1] == runs["auto"][1]
    assert runs["flat"][0].snapshot() == runs["dict"][0].snapshot() == runs["auto"][0].snapshot()
    assert runs["flat"][0].stats().hit_tokens > 0


def test_manager_index_arguments():
    with pytest.raises(InvalidArgument):
        KVCacheManager(8, 4, hash_seed=0, index="flat", verify=True)
    with pytest.raises(InvalidArgument):
        KVCacheManager(8, 4, hash_seed=0, index="bogus")
    # auto with verify falls back to the dict (verify keeps each block's content)
    m = KVCacheManager(8, 4, hash_seed=0, index="auto", verify=True)
    assert not isinstance(m.pool, FlatBlockPool)
    with pytest.raises(ValueError):
        FlatBlockPool(8, 4, make_policy("lru"), verify=True)


def test_manager_flat_index_takes_only_its_digests():
    """Precomputed hashes: the flat index keys this manager's digests only (HashMismatch otherwise,
    before anything changes); the dict index takes any hashable (a trace's integer ids)."""
    flat = KVCacheManager(8, 4, hash_seed=0, index="flat")
    with pytest.raises(HashMismatch):
        flat.prompt_from_hashes([1, 2], 8)
    with pytest.raises(HashMismatch):
        flat.prompt_from_hashes([b"x" * 8, b"y" * 8], 8)        # xxh3_128 digests are 16 bytes
    assert flat.admit("a", flat.prompt_from_hashes(U[:2], 8)) == 0
    assert flat.match(flat.prompt_from_hashes(U[:2] + [U[5]], 12)).hit_blocks == 2
    KVCacheManager(8, 4, hash_seed=0, index="dict").prompt_from_hashes([1, 2], 8)
