"""The physical block pool: refcounts, the prefix-cache hash map, free blocks.

Every block is in exactly one state:

* free-uncached   refcount 0, no hash; kept in a LIFO list;
* active          refcount > 0 (held by at least one block table);
* evictable       refcount 0, hash kept; ordered by the eviction policy.

Conservation: active + evictable + free-uncached == num_blocks.

Per-block metadata lives in flat lists indexed by block id (no per-block
objects): the hot paths are a few list stores per block. The lists cover the
blocks handed out so far and grow as allocation first reaches further; the
free-uncached blocks beyond them are a counter, not a list.

Two physical blocks can hold the same hash (two sequences filled the same
content without hitting each other, or a fully cached prompt recomputed its
last block). The first is the *primary*, found by lookups; later ones are
*duplicates*, tracked while active and dropped (to free-uncached) when
released, since the primary already caches that content. If the primary is
evicted while a duplicate is active, the duplicate becomes the primary.
"""

from __future__ import annotations

from itertools import compress, repeat
from typing import Any, Hashable, Iterable, Sequence

import numpy as np

from .checks import integer
from .errors import InvalidArgument, InvariantViolation, OutOfBlocks, PolicyError
from .events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from .hashing import ExtraKeys
from .index import DictIndex, gather


def _materialised(blocks):
    """A batch of blocks as a list or an int64 array (an iterator read once)."""
    return blocks if isinstance(blocks, (list, np.ndarray)) else list(blocks)


def _block_list(blocks) -> list[int]:
    return blocks.tolist() if isinstance(blocks, np.ndarray) else blocks


def _batch_method(policy, single: str, batch: str):
    """The policy's bound ``batch`` method, if the class that defines ``single`` defines it too
    (a subclass that overrides only ``evict`` must not be bypassed by its parent's ``evict_many``)."""
    for cls in type(policy).__mro__:
        if single in cls.__dict__:
            return getattr(policy, batch) if batch in cls.__dict__ else None
    return getattr(policy, batch, None)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, policy, *, verify: bool = False,
                 record_events: bool = False, track_reuse: bool = False, medium: str | None = None,
                 index=None, fused=None) -> None:
        """``index``: the hash index (``prefixkv.index``): a ``DictIndex`` unless given (the flat
        index, ``prefixkv.flat``, is one a ``FlatBlockPool`` gives). ``fused``: called with the
        pool once it is built, returns the index's fused batches for it (or None)."""
        num_blocks, block_size = integer("num_blocks", num_blocks, low=1), integer("block_size", block_size, low=1)
        if getattr(policy, "pool", None) is not None:
            # (before anything is built) InvalidArgument is the ValueError this raised before
            raise InvalidArgument("policy", f"this {type(policy).__name__} object already serves another pool; a "
                                  "policy keeps per-pool state, so give each pool (each replay) a fresh one or a name")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.verify = verify
        # Per-block metadata exists for blocks [0, len(ref_count)) only: the lists grow (in place)
        # as allocation first reaches further, so an empty pool of 10^8 blocks costs nothing.
        # Every block a caller or a policy is ever given is inside them.
        self.index = index = DictIndex() if index is None else index
        # refcounts, valid token slots, and the free-uncached stack, in the types the index's batch
        # paths read (lists for a dict index)
        self.ref_count, self.num_tokens, self._free = index.block_storage()
        self.block_hash: Sequence[Hashable | None] = index.hashes   # primaries only; read-only here
        self.cached_map = index.mapping                 # hash -> primary block; read-only to callers
        self.lookup = index.get                         # lookup(hash) -> primary block or None
        # The index answers these itself: bound once (the methods below say what they do), so the
        # hot paths make one call, not two.
        self.leading_hits = index.run
        self.leading_run = index.run_array
        self.holds_none = index.holds_none
        self.is_cached = index.held
        self._uncached_among = index.count_unheld
        # parent hash and index in its prefix chain: kept only while ``keep_chain`` (else empty)
        self.parent_hash: list[Hashable | None] = []
        self.depth: list[int] = []
        # ``priority`` (of the last sequence releasing each block) is made on first use: by a release
        # with a priority other than 0, or by a reader (a policy). Until then every block's is 0 and
        # the pool saves the list (8 B per block).
        self._priority: list[int] | None = None
        self.content: list[bytes | None] = []              # verify mode only
        self._duplicate_hash: dict[int, Hashable] = {}     # active duplicate -> its hash
        self._duplicates: dict[Hashable, list[int]] = {}   # hash -> active duplicates
        # Free-uncached blocks: the released ones (the LIFO stack ``_free``) and every block from
        # ``_fresh`` on, never handed out (taken in ascending order once the stack is empty).
        self._fresh = 0
        self.evictions = 0
        # Residencies: a hash cached in a physical block, from publish (or a duplicate's promotion)
        # to eviction or reset. ``insertions`` is derived (nothing is counted per publish, a hot
        # path); whether each residency served a hit is tracked only on request (``track_reuse``,
        # as trace replays do): it costs a store per hit block.
        self.cleared = 0                                   # residencies ended by clear_cache
        self.forgotten = 0                                 # residencies ended by forget (moved up a tier)
        self.unused_removals: int | None = 0 if track_reuse else None  # ended without a single hit
        self._reused: list[bool] | None = [] if track_reuse else None
        self.events: list[KVEvent] | None = [] if record_events else None
        # The SessionHint of the release in progress (None outside a hinted release): policies read it
        # in on_released, as they read ``priority`` (see policies/base.py).
        self.hint = None
        # The number of blocks handed to the hinted release in progress (the whole block table of the
        # request being freed): what a policy reading the hint can take as the request's length.
        self.release_size = 0
        self.medium = medium            # in this pool's KV events (None: the device pool)
        self.promoting = False          # an on_cached in progress is a duplicate taking a hash over
        # Called as on_evict_many(blocks, hashes) once per eviction burst, before any of those blocks
        # is reused: the manager demotes them to the host tier there (None: they are simply gone).
        self.on_evict_many = None
        self.policy = policy
        policy.bind(self)
        self._on_grow = getattr(policy, "on_grow", None)
        # Optional batch events (policies/base.py), looked up once: the hot paths call them per batch.
        self._evict_many = _batch_method(policy, "evict", "evict_many")
        self._released_batch = _batch_method(policy, "on_released", "on_released_batch")
        self._hit_batch = _batch_method(policy, "on_hit", "on_hit_batch")
        # A class that declares ``valid_victims = True`` itself promises evict_many returns k
        # distinct evictable blocks: the pool skips re-checking them (policies/base.py).
        self._valid_victims = type(policy).__dict__.get("valid_victims", False) is True
        # parent_hash / depth of published blocks are kept for policies that read them, for a
        # tier below (demotion copies them; the manager sets keep_chain) and in verify mode.
        # A policy class that declares ``reads_chain = False`` itself (not inherited) saves the
        # stores and the two lists (16 B per block).
        self._keep_chain = verify or type(policy).__dict__.get("reads_chain", True) is not False
        from .policies.base import PolicyBase

        # (from the class that defines on_cached only: a subclass overriding on_cached is told per block)
        self._cached_batch = _batch_method(policy, "on_cached", "on_cached_batch")
        # None: on_cached is the base class's no-op, so a batch publish need not call it at all
        self._on_cached = None if getattr(type(policy), "on_cached", None) is PolicyBase.on_cached \
            else policy.on_cached
        # The index's fused batches (refcounts and eviction order in one compiled call), if any.
        self._fused = None if fused is None else fused(self)

    def _fused_for(self, n: int, *, publishes: bool = False):
        """The fused batches, for a batch of ``n`` blocks that a compiled call pays for, when
        nothing needs a per-block step: no KV events, no reuse tracking, no active duplicates
        (and, for a batch that enters hashes, no chain to keep, nothing to verify, no per-block
        ``on_cached``). None: the general paths serve the batch. The one eligibility rule."""
        fused = self._fused
        if fused is None or n < fused.min_batch or self.events is not None or self._reused is not None \
                or self._duplicate_hash:
            return None
        if publishes and (self.verify or self._keep_chain or self._on_cached is not None):
            return None
        return fused

    @property
    def priority(self) -> list[int]:
        """Per block: the priority of the sequence that released it last (0 until one is given)."""
        if self._priority is None:
            self._priority = [0] * len(self.ref_count)
        return self._priority

    @property
    def keep_chain(self) -> bool:
        """Whether ``parent_hash`` / ``depth`` are kept (per block) for published blocks."""
        return self._keep_chain

    @keep_chain.setter
    def keep_chain(self, keep: bool) -> None:
        if keep and not self._keep_chain:
            if len(self.index):
                raise InvariantViolation("keep_chain must be turned on before anything is published")
            grow = len(self.ref_count) - len(self.parent_hash)
            self.parent_hash.extend([None] * grow)
            self.depth.extend([0] * grow)
        elif not keep and self._keep_chain:
            if self.verify:
                raise InvariantViolation("verify mode reads the chain: keep_chain stays on")
            del self.parent_hash[:], self.depth[:]
        self._keep_chain = bool(keep)

    # -- questions -----------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: uncached free plus evictable cached."""
        return len(self._free) + self.num_blocks - self._fresh + len(self.policy)

    @property
    def num_free_uncached(self) -> int:
        return len(self._free) + self.num_blocks - self._fresh

    @property
    def num_evictable(self) -> int:
        return len(self.policy)

    @property
    def num_active(self) -> int:
        return self._fresh - len(self._free) - len(self.policy)

    def _take_fresh(self, k: int) -> list[int]:
        """The next ``k`` never-used blocks (ascending), their metadata made first."""
        start = self._fresh
        stop = start + k
        have = len(self.ref_count)
        if stop > have:
            # grow geometrically: amortised O(1) per block, in place (policies keep the lists)
            new = min(self.num_blocks, max(stop, 2 * have, 1024))
            grow = new - have
            self.ref_count.extend([0] * grow)
            self.num_tokens.extend([0] * grow)
            self.index.ensure_blocks(new)
            if self._keep_chain:
                self.parent_hash.extend([None] * grow)
                self.depth.extend([0] * grow)
            if self._priority is not None:
                self._priority.extend([0] * grow)
            if self.verify:
                self.content.extend([None] * grow)
            if self._reused is not None:
                self._reused.extend([False] * grow)
            if self._on_grow is not None:
                self._on_grow(new)
        self._fresh = stop          # (after the growth: one that fails hands nothing out)
        return list(range(start, stop))

    @property
    def num_cached(self) -> int:
        """Distinct hashes in the prefix cache (active or evictable)."""
        return len(self.index)

    @property
    def insertions(self) -> int:
        """Residencies started: every one ended by an eviction or a reset, or is cached now."""
        return self.evictions + self.cleared + self.forgotten + len(self.index)

    def num_unused_cached(self) -> int | None:
        """Cached blocks whose current residency has not been hit yet (O(cached); None untracked)."""
        reused = self._reused
        if reused is None:
            return None
        return sum(1 for block in self.index.primaries() if not reused[block])

    def is_cached(self, block: int) -> bool:
        return self.index.held(block)

    def leading_hits(self, hashes: Sequence[Hashable], start: int, limit: int) -> list[int]:
        """The blocks holding ``hashes[start:limit]`` up to the first one not cached (a prompt's
        run of hits)."""
        return self.index.run(hashes, start, limit)

    # Batch answers in the form this pool keeps block ids, for a caller that hands them back to a
    # pool: lists from a dict index, int64 arrays from a flat one, which then converts nothing.
    # Either reads as a sequence of block ids (``len``, indexing, iteration).
    def leading_run(self, hashes: Sequence[Hashable], start: int, limit: int) -> Sequence[int]:
        return self.index.run_array(hashes, start, limit)

    def allocate_run(self, n: int, num_tokens: int | None = None) -> Sequence[int]:
        """``allocate``, as the fused batches hand blocks out (an int64 array) where they serve."""
        fused = self._fused_for(n) if self._fused is not None else None
        if fused is None:
            return self._allocate(n, num_tokens)
        return fused.allocate(n, num_tokens)

    def cache_run(self, hashes: list[Hashable], parents: list[Hashable | None], depths: list[int]) -> Sequence[int]:
        """``cache_many``, as the fused batches hand blocks out where they serve."""
        fused = self._fused_for(len(hashes), publishes=True)
        if fused is None:
            return self.cache_many(hashes, parents, depths)
        return fused.cache_run(hashes)

    def cache_new_run(self, hashes: list[Hashable]) -> Sequence[int] | None:
        """``cache_run`` of hashes none of which is cached here, taking free-uncached blocks, in one
        fused check-and-insert: None (nothing changed) when one is cached here, when the batch
        would evict or keep more than hashes and blocks, or where no fused batch serves (the
        caller takes the general way: ``holds_none``, then ``cache_run``)."""
        fused = self._fused_for(len(hashes), publishes=True)
        if fused is None or self._priority is not None or not hashes or len(hashes) > len(self._free):
            return None
        return fused.cache_new_run(hashes)

    def probe_keys(self, hashes: list[Hashable]) -> Sequence[Hashable]:
        """``hashes`` in the form this pool's index probes fastest, for a caller that probes the
        same prompt again and again (the manager keeps it on the prompt)."""
        return self.index.probe_keys(hashes)

    def leading_run_outside(self, other: BlockPool, keys: Sequence[Hashable], start: int,
                            limit: int) -> tuple[Sequence[int], bool | None]:
        """``leading_run(keys, start, limit)``, and whether ``other`` holds none of that run's
        hashes where the two indexes can tell it in the same pass (None: not told; the caller
        asks ``other.holds_none``)."""
        return self.index.run_outside(other.index, keys, start, limit)

    def key_tags(self, keys: Sequence[Hashable], indices: Sequence[int]):
        """What ``take_cached`` can reuse of ``probe_keys`` for the blocks found by
        ``keys[indices]`` (a flat index's tags), or None."""
        return self.index.key_tags(keys, indices)

    def holds_none(self, hashes: Iterable[Hashable]) -> bool:
        """No hash of ``hashes`` is cached here."""
        return self.index.holds_none(hashes)

    def _uncached_among(self, blocks: Sequence[int]) -> int:
        """How many of ``blocks`` hold no hash."""
        return self.index.count_unheld(blocks)

    # -- actions -------------------------------------------------------------
    def acquire_hits(self, blocks: Iterable[int], *, distinct: bool = False) -> None:
        """Take one more reference on each cache-hit block (pins evictable ones). ``distinct``:
        the caller knows no block is listed twice (a prefix match's blocks)."""
        if self._fused is not None:
            blocks = _materialised(blocks)
            fused = self._fused_for(len(blocks))
            if fused is not None and fused.acquire(blocks):
                return
            blocks = _block_list(blocks)
        ref = self.ref_count
        on_hit = self.policy.on_hit
        reused = self._reused
        hit_batch = self._hit_batch
        if hit_batch is not None:
            blocks = list(blocks)
            if len(blocks) > 1 and gather(ref, blocks).count(0) == len(blocks) and \
                    (distinct or len(set(blocks)) == len(blocks)):
                # every block was evictable, each once: on_hit(b, True) for each, in one call
                hit_batch(blocks)
                if reused is None:
                    for block in blocks:
                        ref[block] = 1
                else:
                    for block in blocks:
                        ref[block] = 1
                        reused[block] = True
                return
        if reused is None:
            for block in blocks:
                count = ref[block]
                on_hit(block, count == 0)
                ref[block] = count + 1
            return
        for block in blocks:
            count = ref[block]
            on_hit(block, count == 0)
            ref[block] = count + 1
            reused[block] = True

    def share(self, blocks: Iterable[int]) -> None:
        """One more reference on blocks that are already active (fork)."""
        ref = self.ref_count
        for block in blocks:
            ref[block] += 1

    def take_cached(self, blocks: list[int], *, distinct: bool = False, tags=None) -> None:
        """``acquire_hits(blocks)``, then ``forget`` each block that was evictable: the blocks stay
        held and their hashes leave this pool (their content moves up a tier). One pass when
        every block was evictable, each listed once (``distinct``: the caller knows no block is
        listed twice). ``tags``: ``key_tags`` of the keys the blocks were found by, if the caller
        has them."""
        if self._fused is not None:
            blocks = _materialised(blocks)
            fused = self._fused_for(len(blocks))
            if fused is not None and fused.take(blocks, tags):
                self.forgotten += len(blocks)
                return
            blocks = _block_list(blocks)
        ref = self.ref_count
        counts = gather(ref, blocks)
        if (self._hit_batch is not None and len(blocks) > 1 and counts.count(0) == len(blocks)
                and not self._duplicates and self.events is None
                and (distinct or len(set(blocks)) == len(blocks)) and not self._uncached_among(blocks)):
            self._hit_batch(blocks)
            self.index.take_blocks(blocks, False)
            for block in blocks:
                ref[block] = 1
            self.forgotten += len(blocks)
            if self._reused is not None:        # the residency ends with its hit
                reused = self._reused
                for block in blocks:
                    reused[block] = False
            return
        self.acquire_hits(blocks, distinct=distinct)
        forgotten = set()
        for block, count in zip(blocks, counts):
            if not count and block not in forgotten:
                forgotten.add(block)
                self.forget(block)

    def cache_many(self, hashes: list[Hashable], parents: list[Hashable | None], depths: list[int]) -> list[int]:
        """Blocks holding ``hashes``, cached and evictable at once (demotions into this tier): the
        result of ``allocate(n)``, full ``num_tokens``, ``publish_many`` and ``release``, in one
        pass when there are no events to report and nothing to verify. Raises OutOfBlocks
        (changing nothing) when ``n`` blocks cannot be freed."""
        n = len(hashes)
        size = self.block_size
        # a hash this index cannot key raises here, before a block is claimed (or a victim evicted)
        keys = self.index.prepare(hashes)
        if self.verify or self.events is not None or self._released_batch is None or (
                self._on_cached is not None and self._cached_batch is None) or self._duplicate_hash:
            blocks = self.allocate(n)
            num_tokens = self.num_tokens
            for block in blocks:
                num_tokens[block] = size
            self.publish_many(blocks, hashes, parents, depths)
            self.release(blocks)
            return blocks
        blocks = self._claim(n)
        got = self.index.enter_many(keys, hashes, blocks)
        if got == blocks:
            primaries = blocks
        else:     # a hash cached already: this copy is a duplicate, dropped again at once
            primaries = [block for block, primary in zip(blocks, got) if primary == block]
            self._free.extend(block for block, primary in zip(blocks, got) if primary != block)
            keep = [primary == block for block, primary in zip(blocks, got)]
            hashes, parents, depths = (list(compress(values, keep)) for values in (hashes, parents, depths))
        num_tokens = self.num_tokens
        if self.keep_chain:
            parent_list, depth_list = self.parent_hash, self.depth
            for block, parent, depth in zip(primaries, parents, depths):
                parent_list[block] = parent
                depth_list[block] = depth
        for block in blocks:
            num_tokens[block] = size
        prio = self._priority
        if prio is not None:
            for block in primaries:
                prio[block] = 0
        if primaries:
            if self._on_cached is not None:
                self._cached_batch(primaries)
            self._released_batch(primaries)
        return blocks

    def allocate(self, n: int, num_tokens: int | None = None) -> list[int]:
        """``n`` fresh blocks with refcount 1, uncached ones first, then victims (and
        ``num_tokens`` valid slots each, when given).

        Raises OutOfBlocks (changing nothing) if fewer than ``n`` can be freed.
        """
        if self._fused is None:
            return self._allocate(n, num_tokens)
        return _block_list(self.allocate_run(n, num_tokens))

    def _allocate(self, n: int, num_tokens: int | None) -> list[int]:
        out = self._claim(n)
        ref = self.ref_count
        if num_tokens is None:
            for block in out:
                ref[block] = 1
        else:
            tokens = self.num_tokens
            for block in out:
                ref[block] = 1
                tokens[block] = num_tokens
        return out

    def _claim(self, n: int) -> list[int]:
        """``n`` free-uncached blocks (refcount still 0), evicting as needed; see ``allocate``."""
        free = self._free
        if n <= len(free):
            if not n:
                return []
            out = free[:-n - 1:-1]
            del free[-n:]
        else:
            fresh = self.num_blocks - self._fresh
            if n > len(free) + fresh:
                available = len(free) + fresh + len(self.policy)
                if n > available:
                    raise OutOfBlocks(n, available)
            out = free[::-1]
            free.clear()
            if fresh:
                out += self._take_fresh(min(fresh, n - len(out)))
            if len(out) < n:
                try:
                    if self._evict_many is not None and self.events is None and not self._duplicates:
                        if self._valid_victims:
                            self._evict_valid(n - len(out), out)
                        else:
                            self._evict_batch(n - len(out), out)
                    else:
                        evict = self._evict_one
                        out.extend(evict() for _ in range(n - len(out)))
                except PolicyError:
                    free.extend(reversed(out))  # the free blocks, and the victims taken so far (now uncached)
                    raise
        return out

    def _evict_one(self) -> int:
        try:
            block = self.policy.evict()
        except Exception as exc:
            raise PolicyError(f"eviction policy {getattr(self.policy, 'name', type(self.policy).__name__)!r} "
                              f"raised in evict(): {type(exc).__name__}: {exc}") from exc
        try:
            block_hash = self.block_hash[block] if block >= 0 else None
        except (IndexError, TypeError):  # not a block id
            block_hash = None
        if block_hash is None or self.ref_count[block]:
            raise PolicyError(f"eviction policy {getattr(self.policy, 'name', type(self.policy).__name__)!r} "
                              f"returned {block!r} from evict(), which is not an evictable cached block")
        if self.on_evict_many is not None:
            self.on_evict_many((block,), (block_hash,))
        self.evictions += 1
        reused = self._reused
        if reused is not None:
            if reused[block]:
                reused[block] = False
            else:
                self.unused_removals += 1
        self._drop_hash(block, block_hash)
        return block

    def _victims(self, k: int) -> list:
        """The policy's ``evict_many(k)``; whatever it raises comes out as PolicyError."""
        try:
            return self._evict_many(k)
        except Exception as exc:
            name = getattr(self.policy, "name", type(self.policy).__name__)
            raise PolicyError(f"eviction policy {name!r} raised in evict_many(): {type(exc).__name__}: {exc}") from exc

    def _evict_valid(self, k: int, out: list[int]) -> None:
        """``_evict_batch`` for a policy whose victims need no checking (``valid_victims``)."""
        victims = self._victims(k)
        hashes = self.index.take_blocks(victims, self.on_evict_many is not None)
        self._took(victims, out)
        if self.on_evict_many is not None:
            self.on_evict_many(victims, hashes)

    def _evict_batch(self, k: int, out: list[int]) -> None:
        """``k`` victims from the policy's ``evict_many``, uncached and appended to ``out``: the
        work of ``k`` ``_evict_one`` calls (no events, no duplicates) in one pass; ``on_evict_many``
        sees the burst before any victim is reused. A policy returning a block it must not (not
        a block id, active, uncached, listed twice, or the wrong number of blocks) gets
        PolicyError: the victims before that one are taken (uncached, in ``out``) and the valid
        ones after it go back to the policy (none is taken when the count is wrong)."""
        name = getattr(self.policy, "name", type(self.policy).__name__)
        victims = self._victims(k)
        hashes = self._uncache_checked(victims, k)
        if hashes is not None:
            self._took(victims, out)
            if self.on_evict_many is not None:
                self.on_evict_many(victims, hashes)
            return
        ref = self.ref_count
        is_cached = self.is_cached

        def evictable(block) -> bool:
            return type(block) is int and 0 <= block < len(ref) and not ref[block] and is_cached(block)

        seen: set[int] = set()
        bad = len(victims)
        for i, block in enumerate(victims):
            if not evictable(block) or block in seen:
                bad = i
                break
            seen.add(block)
        taken = victims[:bad] if len(victims) == k else []
        self.index.take_blocks(taken, False)
        self._took(taken, out)
        on_released = self.policy.on_released
        for block in victims[len(taken):]:
            if evictable(block) and block not in self.policy:
                on_released(block)
        if len(victims) != k:
            raise PolicyError(f"eviction policy {name!r} returned {len(victims)} blocks from evict_many({k})")
        raise PolicyError(f"eviction policy {name!r} returned {victims[bad]!r} from evict_many(), "
                          "which is not an evictable cached block")

    def _uncache_checked(self, victims: list, k: int) -> Sequence | None:
        """Uncache ``victims`` if they are ``k`` distinct evictable cached blocks, returning their
        hashes (for ``on_evict_many``); else None, changing nothing."""
        ref = self.ref_count
        try:
            if len(victims) != k or (k and (min(victims) < 0 or max(victims) >= len(ref))):
                return None
            if any(map(ref.__getitem__, victims)):
                return None
        except (IndexError, TypeError, ValueError, OverflowError):      # not block ids
            return None
        return self.index.take_blocks_checked(victims, self.on_evict_many is not None)

    def _took(self, taken: list[int], out: list[int]) -> None:
        """Count ``taken`` (uncached victims) as evicted and hand them out."""
        out.extend(taken)
        self.evictions += len(taken)
        reused = self._reused
        if reused is not None:
            self.unused_removals += gather(reused, taken).count(False) if taken else 0
            for block in taken:
                reused[block] = False

    def _drop_hash(self, block: int, block_hash: Hashable) -> None:
        """``block`` no longer holds ``block_hash``: an active duplicate takes the hash over, or
        the hash leaves the cache (a ``BlockRemoved``)."""
        self.index.remove(block_hash)
        duplicates = self._duplicates.get(block_hash)
        if duplicates:
            self._promote(duplicates.pop(), block_hash, block)
            if not duplicates:
                del self._duplicates[block_hash]
        elif self.events is not None:
            self.events.append(BlockRemoved(block_hash, block, self.medium))

    def forget(self, block: int) -> None:
        """Drop the hash of an active cached block: it stays held, uncached (a host block whose
        content moved up to the device). An active duplicate takes over the hash, if any."""
        block_hash = self.block_hash[block]
        if block_hash is None or not self.ref_count[block]:
            raise InvariantViolation(f"forget({block}): not an active cached block")
        self.forgotten += 1
        if self._reused is not None:
            self._reused[block] = False
        self._drop_hash(block, block_hash)

    def _promote(self, duplicate: int, block_hash: Hashable, evicted: int) -> None:
        del self._duplicate_hash[duplicate]
        self.index.insert(block_hash, duplicate)
        if self._keep_chain:
            self.parent_hash[duplicate] = self.parent_hash[evicted]
            self.depth[duplicate] = self.depth[evicted]
        if self.verify:
            self.content[duplicate] = self.content[evicted]
        self.promoting = True       # policies/base.py: this on_cached continues a residency
        try:
            self.policy.on_cached(duplicate)
        finally:
            self.promoting = False

    def publish(self, block: int, block_hash: Hashable, parent_hash: Hashable | None, depth: int,
                content: bytes | None = None, extra: ExtraKeys | None = None,
                token_ids: tuple[int, ...] | None = None) -> bool:
        """Enter an active, full block into the prefix cache.

        Returns False (and publishes nothing) only in verify mode when the hash
        is already cached for different content: a collision, kept as a miss.
        """
        primary = self.index.get(block_hash)
        if primary is not None:
            if self.verify and content is not None and (
                    self.content[primary] != content or self.parent_hash[primary] != parent_hash):
                return False
            self._duplicate_hash[block] = block_hash
            self._duplicates.setdefault(block_hash, []).append(block)
            return True
        self.index.insert(block_hash, block)
        if self._keep_chain:
            self.parent_hash[block] = parent_hash
            self.depth[block] = depth
        if self.verify:
            self.content[block] = content
        self.policy.on_cached(block)
        if self.events is not None:
            self.events.append(BlockStored(block_hash, parent_hash, self.num_tokens[block], extra, block,
                                           self.medium, token_ids))
        return True

    def publish_run(self, blocks: list[int], hashes: list[Hashable], parent_hash: Hashable | None,
                    depth: int) -> None:
        """``publish(blocks[i], hashes[i], hashes[i - 1] (parent_hash for i = 0), depth + i)`` for
        each ``i`` in order: a chain's run of blocks, through ``publish_many``."""
        if len(blocks):
            # the parents are read only to keep the chain or to report it
            parents = [parent_hash, *hashes[:len(blocks) - 1]] if self._keep_chain or self.events is not None \
                else repeat(None)
            self.publish_many(blocks, hashes, parents, range(depth, depth + len(blocks)))

    def publish_many(self, blocks: list[int], hashes: list[Hashable], parents: Sequence[Hashable | None],
                     depths: Sequence[int]) -> None:
        """``publish(blocks[i], hashes[i], parents[i], depths[i])`` for each ``i`` in order. Same
        results and policy events in one pass: the index enters the batch at once (``enter_many``
        tells the hashes already cached, which become duplicates) when there are no events to
        report, nothing to verify and no per-block ``on_cached`` (which may look at the hash map).
        A hash the index cannot key raises before the first is entered."""
        if self._fused is not None:
            fused = self._fused_for(len(blocks), publishes=True)
            if fused is not None:
                for block, h in fused.publish(blocks, hashes):     # already cached: duplicates of their primaries
                    self._duplicate_hash[block] = h
                    self._duplicates.setdefault(h, []).append(block)
                return
            blocks = _block_list(blocks)
        on_cached = self._on_cached
        if self.verify or self.events is not None or (on_cached is not None and self._cached_batch is None):
            self.index.check_keys(hashes[:len(blocks)])
            publish = self.publish
            for block, h, parent, depth in zip(blocks, hashes, parents, depths):
                publish(block, h, parent, depth)
            return
        got = self.index.enter_many(self.index.prepare(hashes), hashes, blocks)
        parent_list, depth_list = self.parent_hash, self.depth
        if got == blocks:     # every block is a new primary
            if self._keep_chain:
                for block, parent, depth in zip(blocks, parents, depths):
                    parent_list[block] = parent
                    depth_list[block] = depth
            primaries = blocks
        else:
            primaries = []
            keep_chain = self._keep_chain
            for block, h, parent, depth, primary in zip(blocks, hashes, parents, depths, got):
                if primary != block:     # already cached: a duplicate of its primary
                    self._duplicate_hash[block] = h
                    self._duplicates.setdefault(h, []).append(block)
                else:
                    if keep_chain:
                        parent_list[block] = parent
                        depth_list[block] = depth
                    primaries.append(block)
        if on_cached is not None and primaries:
            self._cached_batch(primaries)

    def release(self, blocks_in_order: Iterable[int], priority: int = 0, hint=None, *,
                all_cached: bool = False) -> None:
        """Drop one reference from each block, in the order given (tail first).

        A block whose count reaches 0 becomes evictable if it is a cached
        primary, else goes back to the uncached free list. A ``hint``
        (``SessionHint``) goes to the policy's ``on_hint`` first and is
        ``self.hint`` while the blocks are released. ``all_cached``: the caller knows that
        every block holds a hash (a check of the fast path is skipped).
        """
        if hint is not None:
            on_hint = getattr(self.policy, "on_hint", None)
            if on_hint is not None:
                try:
                    on_hint(hint)
                except Exception as exc:  # nothing released yet: the caller's state is intact
                    raise PolicyError(f"eviction policy {getattr(self.policy, 'name', type(self.policy).__name__)!r} "
                                      f"raised in on_hint(): {type(exc).__name__}: {exc}") from exc
            self.hint = hint
            blocks_in_order = list(blocks_in_order)
            self.release_size = len(blocks_in_order)
            try:
                self._release(blocks_in_order, priority, all_cached)
            finally:
                self.hint = None
            return
        self._release(blocks_in_order, priority, all_cached)

    def _release(self, blocks_in_order: Iterable[int], priority: int, all_cached: bool = False) -> None:
        if self._fused is not None:
            blocks_in_order = _materialised(blocks_in_order)
            fused = self._fused_for(len(blocks_in_order))
            if fused is not None and fused.release(blocks_in_order, priority):
                return
            blocks_in_order = _block_list(blocks_in_order)
        ref = self.ref_count
        free_append = self._free.append
        batch = self._released_batch
        prio = self._priority if priority == 0 else self.priority
        if not self._duplicate_hash:
            blocks = list(blocks_in_order)
            if not blocks:      # no event at all (an empty batch is no batch: policies need not expect one)
                return
            if gather(ref, blocks).count(1) == len(blocks):
                # every block drops to 0 (C-speed checks; a block listed twice would have had a count of 2)
                uncached = 0 if all_cached else self._uncached_among(blocks)
                if batch is not None and not uncached:
                    # the common release: every block stays cached
                    for block in blocks:
                        ref[block] = 0
                    if prio is not None:
                        for block in blocks:
                            prio[block] = priority
                    batch(blocks)
                    return
                if uncached == len(blocks):
                    # none is cached: all go back to the free list, in order
                    for block in blocks:
                        ref[block] = 0
                    self._free.extend(blocks)
                    return
            blocks_in_order = blocks
        released: list[int] = []
        on_released = self.policy.on_released if batch is None else released.append
        duplicates = self._duplicate_hash
        held, no_hash = self.index.held_flags()
        for block in blocks_in_order:
            count = ref[block] - 1
            ref[block] = count
            if count:
                continue
            if held[block] is not no_hash:
                if prio is not None:
                    prio[block] = priority
                on_released(block)
            else:
                if duplicates:
                    self._drop_duplicate(block)
                free_append(block)
        if released:
            batch(released)   # the same events, in the same order, in one call

    def _drop_duplicate(self, block: int) -> None:
        block_hash = self._duplicate_hash.pop(block, None)
        if block_hash is None:
            return
        duplicates = self._duplicates[block_hash]
        duplicates.remove(block)
        if not duplicates:
            del self._duplicates[block_hash]

    def clear_cache(self, *, keep_active: bool = False) -> None:
        """Forget every hash; evictable blocks become free-uncached.

        The caller guarantees no block is active (the manager checks), unless
        ``keep_active``: active blocks then stay held and only lose their hashes
        (host blocks of swapped-out sequences across a reset).
        """
        if self.num_active and not keep_active:
            raise InvariantViolation("clear_cache called while blocks are active")
        held = {b for b, c in enumerate(self.ref_count) if c} if self.num_active else set()
        for block in held:
            if self.block_hash[block] is not None:
                self.forget(block)
        if self._reused is not None:
            self.unused_removals += self.num_unused_cached()
            self._reused[:] = [False] * len(self._reused)
        self.cleared += len(self.index)
        self.index.clear()
        self._duplicates.clear()
        self._duplicate_hash.clear()
        # Refill in place: policies may keep references to these lists across a reset.
        n = len(self.ref_count)
        if self._keep_chain:
            self.parent_hash[:] = [None] * n
            self.depth[:] = [0] * n
        if self.verify:
            self.content[:] = [None] * n
        self.policy.clear()
        # every block handed out so far and not held: free again, lowest first (as after a build)
        self._free[:] = (b for b in range(self._fresh - 1, -1, -1) if b not in held)
        if self.events is not None:
            self.events.append(AllBlocksCleared(self.medium))

    def drain_events(self) -> list[KVEvent]:
        if self.events is None:
            return []
        out, self.events = self.events, []
        return out

    # -- checks --------------------------------------------------------------
    def check(self, tables: Iterable[list[int]]) -> None:
        """Verify the pool against the block tables that hold its blocks."""
        n = self.num_blocks
        made = len(self.ref_count)     # blocks with metadata; every one from _fresh on is free
        per_block = (self.num_tokens, self.block_hash) + ((self._priority,) if self._priority is not None else ()) + (
            (self.parent_hash, self.depth) if self._keep_chain else ())
        if not self._fresh <= made <= n or any(len(values) != made for values in per_block) or (
                not self._keep_chain and (self.parent_hash or self.depth)):
            raise InvariantViolation(f"per-block metadata covers {made} blocks, {self._fresh} handed out")
        holders = [0] * made
        for table in tables:
            for block in table:
                if not 0 <= block < self._fresh:
                    raise InvariantViolation(f"block table holds out-of-range or never-allocated block {block}")
                holders[block] += 1
        free = set(self._free)
        if len(free) != len(self._free):
            raise InvariantViolation("a block appears twice in the free list")
        if free and not 0 <= min(free) <= max(free) < self._fresh:
            raise InvariantViolation("the free list holds a block never handed out")
        free.update(range(self._fresh, made))
        for block in range(made):
            count = self.ref_count[block]
            if count != holders[block]:
                raise InvariantViolation(
                    f"block {block}: refcount {count} but held by {holders[block]} block table(s)")
            evictable = block in self.policy
            if count and (block in free or evictable):
                raise InvariantViolation(f"active block {block} is also free or evictable")
            if not count and (block in free) == evictable:
                raise InvariantViolation(
                    f"released block {block} must be exactly one of free-uncached / evictable")
            if evictable and self.block_hash[block] is None:
                raise InvariantViolation(f"evictable block {block} has no hash")
            if block in free and (self.block_hash[block] is not None or block in self._duplicate_hash):
                raise InvariantViolation(f"free-uncached block {block} still has a hash")
            if block in self._duplicate_hash and not count:
                raise InvariantViolation(f"duplicate block {block} is not active")
        mapping = self.index.mapping
        for block_hash, block in mapping.items():
            if self.block_hash[block] != block_hash:
                raise InvariantViolation(f"hash map points at block {block}, which holds another hash")
        if sum(h is not None for h in self.block_hash) != len(self.index):
            raise InvariantViolation("a block holds a hash that the hash map does not know")
        for block, block_hash in self._duplicate_hash.items():
            if block_hash not in mapping or block not in self._duplicates.get(block_hash, ()):
                raise InvariantViolation(f"duplicate block {block} is not tracked consistently")
        active = sum(1 for c in self.ref_count if c)
        if active + len(self.policy) + self.num_free_uncached != n:
            raise InvariantViolation(
                f"conservation: active {active} + evictable {len(self.policy)} + "
                f"free {self.num_free_uncached} != capacity {n}")

    def snapshot(self) -> Any:
        """Everything that defines the pool's state, for before/after comparisons."""
        return (
            tuple(self.ref_count), tuple(self.num_tokens), tuple(self.block_hash),
            tuple(self.parent_hash), tuple(self.depth),
            tuple(self._priority) if self._priority is not None else (0,) * len(self.ref_count),
            tuple(sorted(self.index.mapping.items(), key=repr)),
            tuple(sorted(self._duplicate_hash.items())), tuple(self._free), self._fresh, self.evictions,
            self.policy.snapshot(), None if self.events is None else tuple(self.events),
        )
