"""The sequence-level KV cache manager: block tables over a shared block pool.

Questions and actions come in pairs. ``match`` / ``blocks_needed_to_append``
change nothing; ``admit`` / ``append`` / ``resume`` check capacity first and
mutate after, so a call that raises leaves every table, refcount, queue and
statistic exactly as it was.

Contract with the caller that writes KV: blocks are published to the prefix
cache when they are allocated full (or become full by an append), before their
KV is written. The caller must write the KV of every allocated token in the
same step, before any other sequence's attention reads it (a packed forward
that writes each layer's KV before that layer's attention satisfies this).
Copies returned by ``take_copies`` must run before the writes of that step.
With the host tier (``host_cache=True``), ``take_demotions`` (device -> host copies
of evicted blocks) and then ``take_loads`` (host -> device copies of host hits)
run first, before the copies, and before the next call that changes the
manager: until ``take_loads`` the host blocks those copies read stay held.
Fork a sequence after its step's KV writes: a copy-on-write made later copies
the block as it is in memory, so a token appended but not yet written would be
missing from the copy.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from types import MappingProxyType
from typing import Hashable, Sequence

import numpy as np

from .errors import (CacheBusy, DuplicateSequence, HashMismatch, InvalidArgument, InvariantViolation,
                      NoHostBlocks, OutOfBlocks, PolicyError, SequencePreempted, SequenceTooLong, UnknownSequence)
from .checks import integer
from .copies import BlockCopies
from .events import KVEvent
from .host_tier import HostTier
from .hashing import (NO_EXTRA_KEYS, TOKEN_TYPECODE, BlockHasher, ExtraKeys, as_hash_list, encode_tokens,
                      repeated_hash)
from .policies.base import SessionHint
from .policies.registry import make_policy
from .pool import BlockPool
from .prompt import Prompt
from .stats import CacheStats
from .tier_stack import TierStack

_MAX_TOKEN = 2**32


_NO_LOWER: tuple[Sequence[int], list[int]] = ((), [])   # no lower-tier hits: (indices, host blocks)


@dataclass(slots=True)
class _Sequence:
    table: list[int]
    num_tokens: int
    tokens: array | None          # None: the sequence came with precomputed hashes
    hashes: list[Hashable]        # hashes of its full blocks, in chain order
    extra: ExtraKeys
    priority: int
    publishable: bool = True      # False once a block could not be published
    preempted: bool = False
    host_table: list[int] | None = None   # host blocks holding its KV while swapped out


@dataclass(frozen=True, slots=True)
class PrefixMatch:
    """The answer of ``match``: what ``admit`` would do right now."""

    hit_tokens: int      # leading tokens served from the cache (every tier)
    hit_blocks: int
    total_blocks: int    # blocks the sequence would hold
    blocks_needed: int   # taken from the free pool (fresh, loaded from a lower tier, evictable hits it would pin)
    fits: bool           # blocks_needed <= free blocks now
    lower_hit_blocks: int = 0   # of ``hit_blocks``, those served from the host tier (a load each)


def _handed_over(batches: list[BlockCopies]) -> BlockCopies:
    """Pending batches the manager has just dropped, as one: a single batch is handed over as it is
    (no copy; nothing else holds it: the manager built it from arrays of its own, ``BlockCopies``
    copies what it is given), several are joined."""
    return batches[0] if len(batches) == 1 else BlockCopies.join(batches)


def _make_pool(index: str, digest_size: int, num_blocks: int, block_size: int, policy, **kwargs) -> BlockPool:
    """A pool for ``policy`` (a registry name or a policy object): flat where ``index`` asks for it
    and numba imports; there ``"lru"`` is the LRU kept in arrays (``prefixkv.flat.lru``), the same
    order with compiled batches."""
    if index not in ("auto", "flat", "dict"):
        raise InvalidArgument("index", f"must be 'auto', 'flat' or 'dict', got {index!r}")
    if index != "dict":
        from . import flat
        if index == "flat" and kwargs.get("verify"):
            raise InvalidArgument("index", "verify mode needs index='dict' (it keeps each block's content)")
        if index == "flat" and not flat.available():
            raise InvalidArgument("index", "'flat' needs numba, which does not import here (pip install numba)")
        if flat.available() and not kwargs.get("verify"):
            from .flat.pool import MAX_BLOCKS, FlatBlockPool
            if num_blocks <= MAX_BLOCKS or index == "flat":
                # the manager checks every hash it is given (_check_digests)
                return FlatBlockPool(num_blocks, block_size, flat.make_policy(policy), digest_size=digest_size,
                                     hashes_checked=True, **kwargs)
    return BlockPool(num_blocks, block_size, make_policy(policy) if isinstance(policy, str) else policy, **kwargs)


def _split_tiers(tiers: list, device_policy) -> tuple:
    """``tiers`` as (host tier or None, lower tiers): a HostTier first, at most one, and tiers below
    it only above a host tier that caches (they stage what they serve in its blocks)."""
    hosts = [i for i, t in enumerate(tiers) if isinstance(t, HostTier)]
    if len(hosts) > 1 or hosts and hosts[0] != 0:
        raise InvalidArgument("tiers", "the stack takes one HostTier, first (device -> host -> disk -> remote)")
    host = tiers[0] if hosts else None
    lower = tiers[1:] if hosts else tiers
    if host is not None and not isinstance(device_policy, str) and host.policy is device_policy:
        raise InvalidArgument("host_policy", f"this {type(device_policy).__name__} object already serves the "
                                             "device pool; give the host tier a fresh one or a name")
    for tier in lower:
        if not callable(getattr(tier, "bind", None)) or not isinstance(getattr(tier, "name", None), str):
            raise InvalidArgument("tiers", f"{tier!r} is not a tier (a HostTier, DiskTier or RemoteTier)")
    if lower and (host is None or not host.cache):
        raise InvalidArgument("tiers", f"a {lower[0].name.lower()} tier stages the blocks it serves in the host "
                                       "tier: put a caching HostTier above it (HostTier(n), or num_host_blocks=n "
                                       "with host_cache=True)")
    return host, lower


class KVCacheManager:
    """Paged KV cache bookkeeping with automatic prefix caching.

    >>> mgr = KVCacheManager(num_blocks=64, block_size=4, hash_seed=0)
    >>> mgr.admit("a", list(range(10)))          # 10 tokens, nothing cached yet
    0
    >>> mgr.append("a", [10, 11])                 # decode
    >>> mgr.free("a")
    >>> mgr.admit("b", list(range(10)))          # same prompt: two full blocks hit
    8
    """

    def __init__(self, num_blocks: int, block_size: int, *, policy="lru", hash_seed: int | None = None,
                 hash_algorithm: str = "xxh3_128", verify: bool = False, record_events: bool = False,
                 enable_caching: bool = True, num_host_blocks: int = 0, track_reuse: bool = False,
                 host_cache: bool = False, host_policy="lru", host_inclusive: bool = False,
                 load_gate=None, index: str = "auto", tiers: Sequence = ()) -> None:
        """A pool of ``num_blocks`` blocks of ``block_size`` token slots.

        * ``policy``: an eviction policy name (``prefixkv.policies.available_policies()``:
          ``"lru"`` by default) or a policy object. ``"belady"`` is refused by name: it needs
          the future, which only a trace replayer (``prefixkv.sim.replay``) can feed it.
        * ``hash_seed``: pins the root of the block-hash chain, so hashes are reproducible
          across processes (workers behind one router, replays); ``None`` draws one per process.
        * ``hash_algorithm``: ``"xxh3_128"`` (default) or ``"xxh3_64"``.
        * ``verify``: keep each cached block's tokens and treat a hash collision as a miss.
        * ``record_events``: keep KV events (stored / removed / cleared) for ``drain_events``.
        * ``enable_caching``: ``False`` turns prefix caching off (no hashes, no hits).
        * ``tiers``: the stack below the device pool, top first: a ``HostTier`` (host memory:
          swap space for ``swap_out`` / ``swap_in`` and, with its ``cache`` on, the host tier;
          one pool for both), then tiers that hold bytes below it (``prefixkv.tiers.DiskTier``,
          ``prefixkv.tiers.RemoteTier``), which need the host tier's cache and are opened once the
          KV store exists (``manager.tiers.bind(kv, weights=...)``; ``prefixkv.tiers.stack``
          builds whole stacks). See ``prefixkv.tier_stack``.
        * ``num_host_blocks``, ``host_cache``, ``host_policy``, ``host_inclusive``: shorthand for
          ``tiers=[HostTier(num_host_blocks, cache=host_cache, policy=host_policy,
          inclusive=host_inclusive)]`` (the same stack, the same results): host blocks (0: none);
          demote blocks evicted from the device there instead of letting them vanish, lookups
          continuing there past the device hits; the host pool's policy (any registered one);
          exclusive by default (a promoted block leaves the host tier), inclusive keeps it.
        * ``load_gate``: a ``prefixkv.costs.PreemptionCostModel``; a host hit is taken only when
          moving a block costs less than recomputing its tokens (refusals are counted). None:
          always taken.
        * ``track_reuse``: count cache residencies that end without a single hit
          (``stats().unused_removals``; None when off); costs a store per hit block.
        * ``index``: how the pool keeps its hash index. ``"flat"``: in flat arrays probed by
          compiled loops (``prefixkv.flat``; needs numba): ~98 B per cached block instead of
          ~160 and faster batches, but every hash must be one of this manager's digests (bytes of
          ``hash_algorithm``'s size), so ``prompt_from_hashes`` takes only those. ``"dict"``: a
          dict of hash objects, any hashable (a trace's integer ids), and the one ``verify`` uses.
          ``"auto"`` (default): flat where numba is installed and ``verify`` is off, else dict.
        """
        # InvalidArgument is both a TypeError and a ValueError: what these checks raised before.
        # numpy integers (a config read with numpy) are taken as the equal ints, as BlockHasher,
        # BlockPool and KVStore take them; numpy booleans are not numpy integers.
        # every type first, then every range (the order these checks named a problem in before)
        num_blocks, block_size, num_host_blocks = (integer(name, value) for name, value in (
            ("num_blocks", num_blocks), ("block_size", block_size), ("num_host_blocks", num_host_blocks)))
        integer("num_blocks", num_blocks, low=1)
        integer("block_size", block_size, low=1)
        integer("num_host_blocks", num_host_blocks, low=0)
        if hash_seed is not None:
            hash_seed = integer("hash_seed", hash_seed)
        from .hashing import HASH_ALGORITHMS      # named here, not as BlockHasher's "algorithm"
        if not isinstance(hash_algorithm, str) or hash_algorithm not in HASH_ALGORITHMS:
            raise InvalidArgument("hash_algorithm", f"unknown hash algorithm {hash_algorithm!r}; choose from "
                                                    f"{sorted(HASH_ALGORITHMS)}")
        if isinstance(policy, str):
            if policy == "belady":
                raise InvalidArgument("policy", "the belady policy (MIN) needs every block's next use, which only "
                                                "a trace replay knows: use prefixkv.sim.replay / `prefixkv replay`, "
                                                "or pass a BeladyPolicy object you feed through set_next_use")
            make_policy(policy)     # an unknown name or bad options fail here, before anything is built
        tiers = list(tiers)
        if tiers and (num_host_blocks or host_cache or host_inclusive or host_policy != "lru"):
            raise InvalidArgument("tiers", "give the host tier either in tiers=[HostTier(...), ...] or by "
                                           "num_host_blocks/host_cache/host_policy/host_inclusive, not both")
        if isinstance(host_policy, str) and num_host_blocks:
            if host_policy == "belady":
                raise InvalidArgument("host_policy", "the belady policy (MIN) needs every block's next use: "
                                                     "it cannot order a host tier")
            make_policy(host_policy)   # as the device policy: before the pool binds a policy object
        elif num_host_blocks and (host_policy is policy or getattr(host_policy, "pool", None) is not None):
            # the host tier's pool would refuse it, after the device pool had bound ``policy``
            raise InvalidArgument("host_policy", f"this {type(host_policy).__name__} object already serves "
                                                 f"{'the device pool' if host_policy is policy else 'another pool'}; "
                                                 "give the host tier a fresh one or a name")
        if host_cache and not num_host_blocks:
            # before the pool is built: that binds a policy object passed in, which then could not
            # serve the manager built once the caller fixes this
            raise InvalidArgument("host_cache", "host_cache needs host blocks: pass num_host_blocks > 0")
        if num_host_blocks:
            tiers = [HostTier(num_host_blocks, policy=host_policy, cache=host_cache, inclusive=host_inclusive)]
        host, lower = _split_tiers(tiers, policy)
        if lower and not enable_caching:
            raise InvalidArgument("tiers", f"a {lower[0].name.lower()} tier needs prefix caching (enable_caching=True)")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hasher = BlockHasher(block_size, seed=hash_seed, algorithm=hash_algorithm)
        # A shared (remote) tier needs hashes every replica agrees on: only a pinned seed gives them.
        self.hash_seed_pinned = hash_seed is not None
        self.pool = _make_pool(index, self.hasher.digest_size, num_blocks, block_size, policy, verify=verify,
                               record_events=record_events, track_reuse=track_reuse)
        self._seqs: dict[Hashable, _Sequence] = {}
        self._copies: list[tuple[int, int]] = []
        self.host = host
        self.num_host_blocks = 0 if host is None else host.num_blocks
        if host is not None:
            host.build(block_size, record_events=record_events, digest_size=self.pool.index.digest_size,
                       enable_caching=enable_caching)
            host.pool.events = self.pool.events          # one ordered stream for every tier
            if host.cache:
                self.pool.on_evict_many = self._demote
                if host.keeps_chain:      # a demoted block takes its parent and depth down
                    self.pool.keep_chain = True
        self.tiers = TierStack(self, host, lower)
        # Lower-tier hits are taken unless moving a block costs more than recomputing it.
        self.load_gate = load_gate
        self._take_lower = load_gate is None or load_gate.swap_one_way_s(
            block_size * load_gate.kv_bytes_per_token) < load_gate.recompute_s(block_size)
        # block copies pending, in batches: (device block, host block) demotions run first, then
        # (host block, device block) loads; the host blocks the loads read stay held until then
        self._demotions: list[BlockCopies] = []
        self._loads: list[BlockCopies] = []
        self._load_pins: list[Sequence[int]] = []
        self._host_release: list[int] = []            # swap-in sources, released once copied
        # Evicted device blocks not yet demoted: blocks, hashes, and parents / depths (only when the
        # host tier keeps the chain), as columns.
        self._evicted: tuple[list, list, list, list] = ([], [], [], [])
        # Device blocks whose KV may not be fully written (a caller whose forward can fail midway
        # tracks them, as the HF cache does): never demoted, so no tier below keeps their bytes.
        self.unwritten: set[int] | frozenset = frozenset()
        # Write-back hook of a remote tier (``record_published``): blocks published from KV this
        # process computes (not loaded from a tier below), for ``take_published``. None: off.
        self._published: list[tuple] | None = None
        self._counters = dict(admitted=0, query_tokens=0, hit_tokens=0, cow_copies=0, preemptions=0,
                              recomputed_tokens=0, resumed_hit_tokens=0, swaps_out=0, swaps_in=0,
                              swapped_out_blocks=0, swapped_in_blocks=0, host_hit_tokens=0, loads=0,
                              loads_refused=0, demotions=0)
        # Read-only view for drivers that count per request (replay): cheaper than stats().
        self.counters = MappingProxyType(self._counters)

    # -- preparing input -----------------------------------------------------
    def prompt(self, tokens, *, extra: ExtraKeys | None = None, salt=None, adapter=None,
               multimodal=()) -> Prompt:
        """Encode and (lazily) hash a token prompt once, for ``match`` and ``admit``."""
        if extra is None:
            extra = NO_EXTRA_KEYS if (salt is None and adapter is None and not multimodal) else \
                ExtraKeys(salt=salt, adapter=adapter, multimodal=tuple(multimodal))
        encoded = encode_tokens(tokens, "tokens")
        past = next((item for item in extra.multimodal if item.start + item.length > len(encoded)), None)
        if past is not None:
            # its key would be hashed into whatever blocks later decode over those positions
            raise InvalidArgument("multimodal", f"item {past.identifier!r} covers positions {past.start}.."
                                                f"{past.start + past.length - 1}, past the prompt's {len(encoded)} tokens")
        return Prompt(self.hasher, encoded, len(encoded), extra)

    def prompt_from_hashes(self, block_hashes: Sequence[Hashable], num_tokens: int, *,
                           checked: bool = False) -> Prompt:
        """A prompt known only by precomputed, prefix-chained block hashes (traces).

        Equal hash must mean equal prefix. ``block_hashes`` holds one hash per
        full block, optionally plus one for a partial last block (ignored: only
        full blocks are cached). With a flat index (``index``) they must be this manager's
        digests (bytes of ``hasher.digest_size``). ``checked``: the caller vouches that ``block_hashes`` is a
        list of hashable, non-None values nobody will change (a loaded trace's), so it is
        used as it is.
        """
        if num_tokens < 0:
            raise HashMismatch(f"num_tokens must be >= 0, got {num_tokens}")
        hashes = block_hashes if checked and type(block_hashes) is list else as_hash_list(block_hashes)
        self._check_digests(hashes)
        full, partial = divmod(num_tokens, self.block_size)
        if len(hashes) not in (full, full + (1 if partial else 0)):
            raise HashMismatch(
                f"{len(hashes)} block hash(es) contradict {num_tokens} tokens at block size "
                f"{self.block_size} (expected {full}{' or ' + str(full + 1) if partial else ''})")
        return Prompt(self.hasher, None, num_tokens, NO_EXTRA_KEYS, hashes if len(hashes) == full else hashes[:full])

    def _check_digests(self, hashes: list) -> None:
        """With a flat index, hashes from outside must be digests of this manager's width: the
        pool is then told they are (``checked``) and spares a check per block."""
        if self.pool.index.digest_size is not None:
            width = self.hasher.digest_size
            bad = next((h for h in hashes if type(h) is not bytes or len(h) != width), None)
            if bad is not None:
                raise HashMismatch(f"this manager's pool keeps a flat index of {width}-byte digests (index='flat' "
                                   f"or 'auto' with numba), so precomputed hashes must be such bytes; got "
                                   f"{type(bad).__name__} {bad!r:.60}: build the manager with index='dict' for "
                                   "other hashes (a trace's integer ids)")

    def _as_prompt(self, prompt) -> Prompt:
        if isinstance(prompt, Prompt):
            theirs, ours = prompt.hasher, self.hasher
            if theirs is not ours and (theirs.block_size, theirs.algorithm, theirs.seed) != (
                    ours.block_size, ours.algorithm, ours.seed):
                raise InvalidArgument(
                    "prompt", "this prompt was hashed for another manager: block size / algorithm / seed "
                    f"{theirs.block_size} / {theirs.algorithm} / {theirs.seed} here "
                    f"{ours.block_size} / {ours.algorithm} / {ours.seed}; prepare it with this manager's prompt()")
            if theirs is not ours and prompt.tokens is None:
                self._check_digests(prompt.block_hashes())     # another manager's may hold other hashes
            return prompt
        return Prompt(self.hasher, (encoded := encode_tokens(prompt, "prompt")), len(encoded), NO_EXTRA_KEYS)

    # -- questions -----------------------------------------------------------
    def _keys(self, prompt: Prompt) -> Sequence[Hashable]:
        """The prompt's block hashes in the form the pools probe fastest (``BlockPool.probe_keys``:
        a flat index's rows, joined once per prompt and kept on it; else the list itself)."""
        if self.pool.index.digest_size is None:
            return prompt.block_hashes()    # a dict index probes the hash objects themselves
        keys = prompt.keys
        if keys is None:
            keys = prompt.keys = self.pool.probe_keys(prompt.block_hashes())
        return keys

    def _lookup(self, prompt: Prompt, compute_last_token: bool) -> list[int]:
        n = prompt.num_tokens
        if not self.enable_caching or n == 0:
            return []
        limit = (n - 1 if compute_last_token else n) // self.block_size
        hashes = prompt.block_hashes()
        get = self.pool.lookup
        hits: list[int] = []
        if self.pool.verify and prompt.tokens is not None:
            content = self.pool.content
            parent_hash = self.pool.parent_hash
            for i in range(min(limit, len(hashes))):
                block = get(hashes[i])
                if block is None or content[block] != self.hasher.block_content(
                        prompt.tokens, i, prompt.extra) or parent_hash[block] != (hashes[i - 1] if i else None):
                    break
                hits.append(block)
            return hits
        return self.pool.leading_hits(self._keys(prompt), 0, min(limit, len(hashes)))

    def _lower_hits(self, prompt: Prompt, compute_last_token: bool, hits: list[int]) -> tuple[Sequence[int], list[int]]:
        """Past the device's leading ``hits``: the chain continued through the device and the host
        tier, as (indices, host blocks) for the blocks only the host holds (indices a ``range``
        when they follow each other; the host blocks as its pool keeps them, a list or an int64
        array). Extends ``hits`` with the device blocks found between them and a stand-in at each
        host block's index. Read-only; ``((), [])`` without a host cache."""
        host = self.host
        if host is None or not host.cache or self.pool.verify or not self._take_lower:
            return _NO_LOWER
        hashes = prompt.block_hashes()
        limit = min((prompt.num_tokens - 1 if compute_last_token else prompt.num_tokens) // self.block_size,
                    len(hashes))
        start = len(hits)
        if start >= limit:
            return _NO_LOWER
        # The common shape, told in C: one run on the host right after the device hits, with no
        # device block inside it or right after it.
        keys = self._keys(prompt)
        if host.pool.lookup(hashes[start]) is None:
            return _NO_LOWER
        run, outside = host.pool.leading_run_outside(self.pool, keys, start, limit)
        if not len(run):
            return _NO_LOWER
        end = start + len(run)
        if (end == limit or self.pool.lookup(hashes[end]) is None) and (
                outside if outside is not None else self.pool.holds_none(keys[start:end])):
            hits += [-1] * len(run)      # the loaded blocks' places, filled at admission
            return range(start, end), run
        return self._lower_hits_mixed(hashes, start, limit, hits)

    def _lower_hits_mixed(self, hashes: list, start: int, limit: int, hits: list[int]) -> tuple[list[int], list[int]]:
        """``_lower_hits`` where device and host blocks interleave: block by block."""
        in_device, in_host = self.pool.lookup, self.host.pool.lookup
        indices: list[int] = []
        sources: list[int] = []
        found: list[int] = []
        for i in range(start, limit):
            block = in_device(hashes[i])
            if block is None:
                block = in_host(hashes[i])
                if block is None:
                    break
                indices.append(i)
                sources.append(block)
            found.append(block)
        if not sources:
            return _NO_LOWER
        # Device blocks after the last host block are hits too; keep the chain up to its end.
        hits.extend(found)
        return indices, sources

    def _refused_loads(self, prompt: Prompt, compute_last_token: bool, device_hits: int) -> int:
        """Host hits the load gate turned down (counted, not taken)."""
        host = self.host
        if host is None or not host.cache or self._take_lower:
            return 0
        hashes = prompt.block_hashes()
        limit = min((prompt.num_tokens - 1 if compute_last_token else prompt.num_tokens) // self.block_size,
                    len(hashes))
        return host.count_leading(hashes[:limit], device_hits)

    def _blocks_needed(self, prompt: Prompt, hits: list[int], lower=_NO_LOWER) -> tuple[int, int]:
        total = -(-prompt.num_tokens // self.block_size)
        ref = self.pool.ref_count
        device = _device_hits(hits, lower[0]) if len(lower[1]) else hits
        pool = self.pool
        if not device or not pool.num_evictable:
            pinned = 0
        elif not pool.num_active:      # an idle pool: every hit is evictable
            pinned = len(device)
        elif len(device) == 1:
            pinned = int(not ref[device[0]])
        else:
            pinned = itemgetter(*device)(ref).count(0)
        return total, total - len(device) + pinned

    def match(self, prompt, *, compute_last_token: bool = True) -> PrefixMatch:
        """How many leading tokens are cached, and whether admission fits. Read-only.

        With ``compute_last_token`` (the default) at least one token is left to
        compute, so a fully cached, block-aligned prompt recomputes its last
        block: the model needs the last token's logits.
        """
        prompt = self._as_prompt(prompt)
        hits = self._lookup(prompt, compute_last_token)
        lower = self._lower_hits(prompt, compute_last_token, hits)
        total, needed = self._blocks_needed(prompt, hits, lower)
        return PrefixMatch(len(hits) * self.block_size, len(hits), total, needed,
                           total <= self.pool.num_blocks and needed <= self.pool.num_free, len(lower[1]))

    def blocks_needed_to_append(self, seq_id: Hashable, num_tokens: int) -> int:
        """Free blocks an append of ``num_tokens`` would take (fresh + copy-on-write)."""
        seq = self._running(seq_id)
        return self._append_need(seq, num_tokens)[0]

    def _append_need(self, seq: _Sequence, k: int) -> tuple[int, bool, int]:
        n = seq.num_tokens
        size = self.block_size
        partial = n % size
        cow = bool(partial) and self.pool.ref_count[seq.table[-1]] > 1
        fresh = -(-(n + k) // size) - len(seq.table)
        return fresh + cow, cow, fresh

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    def __contains__(self, seq_id: Hashable) -> bool:
        return seq_id in self._seqs

    def __len__(self) -> int:
        return len(self._seqs)

    def num_tokens(self, seq_id: Hashable) -> int:
        return self._get(seq_id).num_tokens

    def is_preempted(self, seq_id: Hashable) -> bool:
        return self._get(seq_id).preempted

    # -- actions -------------------------------------------------------------
    def admit(self, seq_id: Hashable, prompt, *, compute_last_token: bool = True, priority: int = 0) -> int:
        """Give ``seq_id`` a block table for ``prompt``: cache hits plus fresh blocks.

        All or nothing. Returns the number of leading tokens served from the
        cache; the caller computes (and writes the KV of) the rest.
        """
        _check_seq_id(seq_id, "seq_id")
        if seq_id in self._seqs:
            raise DuplicateSequence(seq_id)
        prompt = self._as_prompt(prompt)
        seq = _Sequence([], 0, None if prompt.tokens is None else array(TOKEN_TYPECODE),
                        [], prompt.extra, priority)
        hit_tokens = self._place(seq, prompt, compute_last_token, "admission")
        self._seqs[seq_id] = seq
        counters = self._counters
        counters["admitted"] += 1
        counters["query_tokens"] += prompt.num_tokens
        counters["hit_tokens"] += hit_tokens
        return hit_tokens

    def _place(self, seq: _Sequence, prompt: Prompt, compute_last_token: bool, what: str) -> int:
        """Allocate ``prompt``'s blocks into the empty ``seq``; raises before mutating."""
        pool = self.pool
        hits = self._lookup(prompt, compute_last_token)
        lower = self._lower_hits(prompt, compute_last_token, hits)
        total, needed = self._blocks_needed(prompt, hits, lower)
        if total > pool.num_blocks:
            raise SequenceTooLong(total, pool.num_blocks, f"{what} of {prompt.num_tokens} tokens")
        if needed > pool.num_free:
            raise OutOfBlocks(needed, pool.num_free, f"{what} of {prompt.num_tokens} tokens")
        # Hashing may still raise on bad input; do it before touching the pool.
        hashes = prompt.block_hashes() if self.enable_caching else []
        refused = self._refused_loads(prompt, compute_last_token, len(hits)) if self.load_gate else 0
        indices, sources = lower
        num_loads = len(sources)
        device = _device_hits(hits, indices) if num_loads else hits
        pool.acquire_hits(device, distinct=True)
        if num_loads:
            # before the device allocates: its demotions must not take them
            self.host.pin(sources, distinct=True, tags=self.host.pool.key_tags(prompt.keys, indices))
        num_hits = len(hits)
        size = self.block_size
        try:
            fresh = pool.allocate_run(total - num_hits + num_loads, size)
        except PolicyError:
            # the policy broke mid-allocation (the pool put back what it took): let the hits go again,
            # so no block stays held without a holder
            if device:
                pool.release(device[::-1], seq.priority)
            if num_loads:
                self.host.unpin(sources)
            if len(self._evicted[0]):
                self._store_evicted()
            raise
        if len(self._evicted[0]):
            self._store_evicted()
        n = prompt.num_tokens
        if n % size:
            pool.num_tokens[fresh[-1]] = n % size
        table = hits
        if num_loads:
            loaded = loaded_run = fresh[:num_loads]
            self._loads.append(BlockCopies(sources, loaded))
            self._load_pins.append(sources)
            fresh = fresh[num_loads:]
            if type(loaded) is not list:
                loaded = loaded.tolist()
            if type(indices) is range:
                table[indices.start:indices.stop] = loaded
            else:
                for i, block in zip(indices, loaded):
                    table[i] = block
        table.extend(fresh if type(fresh) is list else fresh.tolist())
        seq.table = table
        seq.num_tokens = n
        if prompt.tokens is not None:
            seq.tokens = array(TOKEN_TYPECODE, prompt.tokens)
        seq.hashes = list(hashes)
        if self.enable_caching:
            # loaded blocks enter the device cache now (their bytes follow in take_loads), then the
            # fresh ones; a run of loads with no device hit inside is published in one call
            if type(indices) is range:
                self._publish(seq, indices.start, indices.stop, record=False, blocks=loaded_run,
                              keys=self._keys(prompt))
            else:
                for i in indices:
                    self._publish(seq, i, i + 1, record=False)
            self._publish(seq, num_hits, n // size, keys=self._keys(prompt))
        counters = self._counters
        counters["loads"] += num_loads
        counters["loads_refused"] += refused
        if what == "admission":
            counters["host_hit_tokens"] += num_loads * size
        return num_hits * size

    def _publish(self, seq: _Sequence, first: int, stop: int, record: bool = True, blocks=None,
                 keys=None) -> None:
        """Publish the sequence's full blocks ``first .. stop-1`` (their hashes are known).
        ``record=False``: loaded from a lower tier, so not offered for write-back. ``blocks``: those
        blocks as the pool handed them out (``table[first:stop]``), if the caller has them; ``keys``:
        the hashes as ``_keys`` gave them (covering at least those blocks), if the caller has them."""
        if not seq.publishable or first >= stop:
            return
        published = self._published if record else None
        pool = self.pool
        hashes = seq.hashes
        table = seq.table
        if not pool.verify and pool.events is None:
            # nothing to compare or report per block: the pool publishes the run in one pass
            end = min(stop, len(hashes))
            if first < end:
                run = table[first:end] if blocks is None or end != stop else blocks
                keyed = keys if keys is not None and len(keys) >= end else hashes
                pool.publish_run(run, keyed[first:end], hashes[first - 1] if first else None, first)
                if published is not None:
                    published.extend((table[i], hashes, i, seq.tokens, seq.extra) for i in range(first, end))
            if len(hashes) < stop:
                seq.publishable = False
            return
        verify = pool.verify and seq.tokens is not None
        events = pool.events is not None
        extra = seq.extra if events else None
        # routers that rehash tokens (llm-d) need each stored block's ids in its event
        tokens = seq.tokens if events else None
        size = self.block_size
        publish = pool.publish
        for i in range(first, min(stop, len(hashes))):
            content = self.hasher.block_content(seq.tokens, i, seq.extra) if verify else None
            ids = tuple(tokens[i * size:(i + 1) * size]) if tokens is not None else None
            if not publish(table[i], hashes[i], hashes[i - 1] if i else None, i, content, extra, ids):
                seq.publishable = False  # a collision: later blocks would chain from it
                return
            if published is not None:
                published.append((table[i], hashes, i, seq.tokens, seq.extra))
        if len(hashes) < stop:
            seq.publishable = False

    def append(self, seq_id: Hashable, tokens) -> None:
        """Append token ids (decode or a prefill chunk) to a token sequence.

        Allocates a block when the tail is full and copies on write when the
        tail is shared and partly filled (see ``take_copies``). Blocks that
        become full are hashed and published, generated tokens included.
        """
        seq = self._running(seq_id)
        if seq.tokens is None:
            raise TypeError(f"sequence {seq_id!r} was admitted by hashes; use append_slots")
        new = encode_tokens(tokens)
        if not new:
            return
        old_full = seq.num_tokens // self.block_size
        self._grow(seq, len(new))
        seq.tokens.extend(new)
        self._hash_and_publish(seq, old_full)

    def append_token(self, seq_id: Hashable, token: int) -> int:
        """Append one token (the decode fast path); returns its physical slot."""
        seq = self._seqs.get(seq_id)
        if seq is None or seq.preempted:
            self._running(seq_id)
        if seq.tokens is None:
            raise TypeError(f"sequence {seq_id!r} was admitted by hashes; use append_slots")
        if type(token) is not int or not 0 <= token < _MAX_TOKEN:
            token = encode_tokens([token])[0]
        return self._append_one(seq, token)

    def _append_one(self, seq: _Sequence, token: int) -> int:
        size = self.block_size
        n = seq.num_tokens
        offset = n % size
        table = seq.table
        pool = self.pool
        if offset == 0 or pool.ref_count[table[-1]] > 1:
            self._grow(seq, 1)
        else:
            pool.num_tokens[table[-1]] = offset + 1
            seq.num_tokens = n + 1
        seq.tokens.append(token)
        if offset == size - 1 and self.enable_caching and seq.publishable:
            self._hash_and_publish(seq, n // size)
        return table[-1] * size + offset

    def append_slots(self, seq_id: Hashable, num_tokens: int, block_hashes: Sequence[Hashable] = ()) -> None:
        """Grow a sequence admitted by hashes by ``num_tokens`` slots.

        ``block_hashes`` gives the hashes of the blocks this append fills (all
        of them, or none: a block without a hash is not published, and neither
        is anything after it in the chain).
        """
        seq = self._running(seq_id)
        if seq.tokens is not None:
            raise TypeError(f"sequence {seq_id!r} holds token ids; use append")
        if type(num_tokens) is not int or num_tokens < 0:     # (a float would size blocks)
            num_tokens = integer("num_tokens", num_tokens, low=0)
        size = self.block_size
        old_full = seq.num_tokens // size
        newly_full = (seq.num_tokens + num_tokens) // size - old_full
        hashes = as_hash_list(block_hashes)
        self._check_digests(hashes)
        if hashes and len(hashes) != newly_full:
            raise HashMismatch(f"{len(hashes)} hash(es) given but the append fills {newly_full} block(s)")
        if hashes and len(seq.hashes) != old_full:
            raise HashMismatch("the sequence's hash chain is already broken; later hashes cannot follow it")
        if hashes and seq.hashes and not set(hashes).isdisjoint(seq.hashes):
            # a chain never holds one hash twice: resume / swap_in match the sequence by its own
            # hashes and count the blocks as distinct
            raise HashMismatch(repeated_hash(seq.hashes + hashes))
        if not num_tokens:
            return
        self._grow(seq, num_tokens)
        seq.hashes.extend(hashes)
        if self.enable_caching:
            self._publish(seq, old_full, old_full + newly_full)

    def _hash_and_publish(self, seq: _Sequence, old_full: int) -> None:
        new_full = seq.num_tokens // self.block_size
        if new_full <= old_full or not self.enable_caching or not seq.publishable:
            return
        hashes = seq.hashes
        parent = hashes[old_full - 1] if old_full else None
        hashes.extend(self.hasher.hash_blocks(seq.tokens, old_full, new_full, parent, seq.extra))
        self._publish(seq, old_full, new_full)

    def _grow(self, seq: _Sequence, k: int) -> None:
        """Make room for ``k`` more tokens: copy-on-write of a shared partial tail,
        then fresh blocks. Checks capacity before changing anything."""
        pool = self.pool
        needed, cow, fresh = self._append_need(seq, k)
        if needed:
            total = len(seq.table) + fresh
            if total > pool.num_blocks:
                raise SequenceTooLong(total, pool.num_blocks, f"append of {k} token(s)")
            if needed > pool.num_free:
                raise OutOfBlocks(needed, pool.num_free, f"append of {k} token(s)")
        table = seq.table
        blocks = pool.allocate(needed) if needed else []
        if len(self._evicted[0]):
            self._store_evicted()
        size = self.block_size
        n = seq.num_tokens
        if cow:
            old = table[-1]
            new = blocks.pop(0)
            pool.num_tokens[new] = n % size
            self._copies.append((old, new))
            table[-1] = new          # switch the mapping only once the copy target exists
            pool.release((old,))     # still held by the sequence(s) we forked from
            self._counters["cow_copies"] += 1
        table.extend(blocks)
        num_tokens = pool.num_tokens
        end = n + k
        for index in range(n // size, -(-end // size)):
            num_tokens[table[index]] = min(size, end - index * size)
        seq.num_tokens = end

    def decode_step(self, seq_ids: Sequence[Hashable], tokens: Sequence[int]) -> np.ndarray:
        """Append one token to each sequence, all or nothing; returns their slots (int64).

        The capacity of the whole round is checked before any table changes, so
        a batch that does not fit raises OutOfBlocks and nothing was published.
        """
        if len(seq_ids) != len(tokens):
            raise InvalidArgument("tokens", f"{len(seq_ids)} sequences but {len(tokens)} tokens")
        tokens = encode_tokens(tokens)  # validates every token before anything changes
        seqs = [self._seqs.get(s) for s in seq_ids]
        if None in seqs or any(seq.preempted for seq in seqs):
            for s in seq_ids:
                self._running(s)
        if len(set(map(id, seqs))) != len(seqs):
            raise InvalidArgument("seq_ids", "a sequence appears twice in one decode step")
        if any(seq.tokens is None for seq in seqs):
            raise TypeError("decode_step needs token sequences; use append_slots for hashed ones")
        size = self.block_size
        ref = self.pool.ref_count
        # A sequence needs a block when its tail is full (or it has none) or when its partial tail is
        # shared; if every holder of a shared tail is in this batch, the last one writes in place.
        needed = 0
        shared_tails: dict[int, int] = {}
        for seq in seqs:
            if not seq.num_tokens % size:
                needed += 1
            elif ref[seq.table[-1]] > 1:
                shared_tails[seq.table[-1]] = shared_tails.get(seq.table[-1], 0) + 1
        for tail, writers in shared_tails.items():
            needed += writers - (writers == ref[tail])
        if needed > self.pool.num_free:
            raise OutOfBlocks(needed, self.pool.num_free, f"decode step of {len(seqs)} sequence(s)")
        append_one = self._append_one
        return np.array([append_one(seq, token) for seq, token in zip(seqs, tokens)], dtype=np.int64)

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """The child shares every block of the parent; later writes copy on write."""
        parent = self._running(parent_id)
        _check_seq_id(child_id, "child_id")
        if child_id in self._seqs:
            raise DuplicateSequence(child_id)
        child = _Sequence(list(parent.table), parent.num_tokens,
                          None if parent.tokens is None else array(TOKEN_TYPECODE, parent.tokens),
                          list(parent.hashes), parent.extra, parent.priority, parent.publishable)
        self.pool.share(parent.table)
        self._seqs[child_id] = child

    def free(self, seq_id: Hashable, *, hint: SessionHint | None = None) -> None:
        """Release a sequence on finish, cancel or error alike (tail first).

        Cached full blocks stay in the prefix cache as evictable blocks. ``hint``
        (a ``prefixkv.policies.SessionHint``: session id, end reason, expected next
        arrival) goes to the eviction policy with the released blocks; policies that
        do not use hints ignore it. A policy that raises on the hint is reported as
        ``PolicyError`` and the sequence is kept.
        """
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id, "never admitted or already freed")
        if hint is not None and not isinstance(hint, SessionHint):
            raise InvalidArgument("hint", f"must be a prefixkv.policies.SessionHint or None, "
                                          f"got {type(hint).__name__}")
        if seq.table:
            pool = self.pool
            # every block published, none a duplicate: each holds its hash (the pool skips a check)
            cached = (seq.publishable and len(seq.hashes) >= len(seq.table) and self.enable_caching
                      and not pool._duplicate_hash)
            pool.release(reversed(seq.table), seq.priority, hint, all_cached=cached)
        elif hint is not None:
            self.pool.release((), seq.priority, hint)   # the policy still learns the session's arrival
        del self._seqs[seq_id]
        if seq.host_table:
            self.host.release(list(reversed(seq.host_table)))

    cancel = free

    def preempt(self, seq_id: Hashable) -> int:
        """Drop a running sequence's KV (recompute preemption); returns the tokens
        whose KV is gone. Its blocks stay cached; ``resume`` re-admits it."""
        seq = self._running(seq_id)
        self.pool.release(reversed(seq.table), seq.priority)
        seq.table = []
        seq.preempted = True
        self._counters["preemptions"] += 1
        return seq.num_tokens

    def resume(self, seq_id: Hashable, *, compute_last_token: bool = True) -> int:
        """Re-admit a preempted sequence; returns how many tokens must be recomputed.

        Blocks still cached are reused, but they are not prefix-cache hits in
        the statistics (the sequence had computed them itself).
        """
        seq = self._get(seq_id)
        if not seq.preempted:
            raise ValueError(f"sequence {seq_id!r} is running, not preempted")
        if seq.host_table is not None:
            raise ValueError(f"sequence {seq_id!r} is swapped out; use swap_in")
        prompt = Prompt(self.hasher, seq.tokens, seq.num_tokens, seq.extra, seq.hashes)
        trial = _Sequence([], 0, None, [], seq.extra, seq.priority, seq.publishable)
        reused = self._place(trial, prompt, compute_last_token, "resume")
        seq.table = trial.table
        seq.hashes = trial.hashes
        seq.publishable = trial.publishable
        seq.preempted = False
        recompute = seq.num_tokens - reused
        self._counters["recomputed_tokens"] += recompute
        self._counters["resumed_hit_tokens"] += reused
        return recompute

    def swap_out(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Preempt by swapping: move a running sequence's KV to host blocks.

        Returns the (device block, host block) copies, which the caller must run
        before any later write can reuse those device blocks (in practice: at
        once). The device blocks are released tail first and stay cached.
        """
        seq = self._running(seq_id)
        if not self.num_host_blocks:
            raise NoHostBlocks("swap_out needs host blocks, and this manager has none (num_host_blocks=0): "
                               "build it with KVCacheManager(..., num_host_blocks=N), or preempt() to recompute")
        needed = len(seq.table)
        free = self.num_free_host_blocks
        if needed > free:
            if needed > self.num_host_blocks:
                raise SequenceTooLong(needed, self.num_host_blocks, "swap-out to host memory")
            raise OutOfBlocks(needed, free, "swap-out to host memory")
        host = self.host.hold(needed) if needed else []
        if self.host is not None and self.host.cache and seq.publishable:
            # its full, published blocks are cached on the host too: swapping feeds the host tier
            pool = self.pool
            for i, block in enumerate(seq.table[:len(seq.hashes)]):
                if pool.block_hash[block] is None:
                    break
                self.host.publish_held(host[i], seq.hashes[i], seq.hashes[i - 1] if i else None, i,
                                       self.block_size)
        copies = list(zip(seq.table, host))
        self.pool.release(reversed(seq.table), seq.priority)
        seq.table = []
        seq.host_table = host
        seq.preempted = True
        counters = self._counters
        counters["preemptions"] += 1
        counters["swaps_out"] += 1
        counters["swapped_out_blocks"] += needed
        return copies

    def swap_in(self, seq_id: Hashable) -> list[tuple[int, int]]:
        """Bring a swapped-out sequence back, all or nothing.

        Full blocks still in the device prefix cache are reused without a copy;
        the rest get fresh device blocks. Returns the (host block, device block)
        copies to run before the sequence's next step; its host blocks are free
        once they have run.
        """
        seq = self._get(seq_id)
        if seq.host_table is None:
            raise ValueError(f"sequence {seq_id!r} is not swapped out")
        prompt = Prompt(self.hasher, seq.tokens, seq.num_tokens, seq.extra, seq.hashes)
        trial = _Sequence([], 0, None, [], seq.extra, seq.priority, seq.publishable)
        reused = self._place(trial, prompt, False, "swap-in") // self.block_size
        copies = list(zip(seq.host_table[reused:], trial.table[reused:]))
        if self.host is None:
            pass                 # an empty sequence swapped out without host blocks
        elif self.host.cache:
            # demotions may reuse released host blocks: the copies above read them first
            self._host_release.extend(reversed(seq.host_table))
        else:
            self.host.release(list(reversed(seq.host_table)))
        seq.table = trial.table
        seq.hashes = trial.hashes
        seq.publishable = trial.publishable
        seq.host_table = None
        seq.preempted = False
        self._counters["swaps_in"] += 1
        self._counters["swapped_in_blocks"] += len(copies)
        return copies

    @property
    def num_free_host_blocks(self) -> int:
        return 0 if self.host is None else self.host.num_free

    def reset_prefix_cache(self, *, preempt_running: bool = False) -> list[Hashable]:
        """Forget every cached block. Refused while sequences hold blocks, unless
        ``preempt_running``: then they are preempted first. Returns those ids."""
        holders = [s for s, seq in self._seqs.items() if seq.table]
        if holders and not preempt_running:
            raise CacheBusy(f"{self.pool.num_active} block(s) are held by {len(holders)} sequence(s); "
                            "free them or pass preempt_running=True")
        for seq_id in holders:
            self.preempt(seq_id)
        self.pool.clear_cache()
        if self.host is not None and self.host.cache:
            # swapped-out sequences and pending loads keep their host blocks, not their hashes
            self.host.clear()
        return holders

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending (src, dst) block copies from copy-on-write, oldest first; clears them."""
        copies, self._copies = self._copies, []
        return copies

    def record_published(self, on: bool = True) -> None:
        """Start (or stop) recording blocks published from computed KV, for a write-back tier."""
        self._published = [] if on else None

    def take_published(self) -> list[tuple]:
        """Blocks published since the last call (with ``record_published()``), oldest first; clears
        them. Each is ``(device block, hashes, index, tokens, extra)``: ``hashes[index]`` is the
        block's hash and ``hashes[:index + 1]`` its chain (the sequence's own list, only ever
        appended to), ``tokens`` its sequence's token array (None for a prompt of precomputed
        hashes) and ``extra`` its extra keys. Blocks loaded from the host tier are left out.
        A block's KV is written by the end of the step that published it (the manager's
        contract); by the time it is read the block may have been evicted and reused, so a
        reader checks ``pool.block_hash[block] == hashes[index]`` first."""
        if self._published is None:
            return []
        out, self._published = self._published, []
        return out

    @property
    def takes_lower_hits(self) -> bool:
        """Whether admissions take host-tier hits (a host cache, no verify mode, the load gate
        passes): a tier below the host tier is only reachable through them."""
        host = self.host
        return host is not None and host.cache and not self.pool.verify and self._take_lower

    def take_demotions(self) -> BlockCopies:
        """Pending (device block, host block) copies of blocks evicted to the host tier, oldest
        first (a ``BlockCopies``: the list of pairs, kept as two arrays); clears them. Run them
        first: the device blocks they read may already be reallocated."""
        demotions, self._demotions = self._demotions, []
        return _handed_over(demotions)

    def take_loads(self) -> BlockCopies:
        """Pending (host block, device block) copies of host-tier hits (a ``BlockCopies``); clears
        them and releases the host blocks they read (exclusive: their hashes left the host tier at
        the admission, the device holds them). Run them after the demotions and before the
        copy-on-write copies and the step's writes, and before the next call that changes this
        manager."""
        loads, self._loads = self._loads, []
        if self._load_pins:
            pins, self._load_pins = self._load_pins, []
            for batch in pins:
                self.host.unpin(batch)
        if self._host_release:
            release, self._host_release = self._host_release, []
            self.host.release(release)
        return _handed_over(loads)

    def _demote(self, blocks: Sequence[int], hashes: Sequence[Hashable]) -> None:
        """The device pool evicts ``blocks`` (``pool.on_evict_many``): note what the host tier needs
        to keep them, before they are reused; ``_store_evicted`` demotes the batch."""
        if self.unwritten:
            blocks = _block_list(blocks)
            written = [block not in self.unwritten for block in blocks]
            blocks, hashes = list(compress(blocks, written)), list(compress(hashes, written))
        evicted_blocks, evicted_hashes, parents, depths = self._evicted
        if not len(evicted_blocks) and not self.host.keeps_chain:
            # one burst per allocation, as a rule: keep it as given (a flat pool's block array and
            # index rows, which a flat host tier takes as they are)
            self._evicted = (blocks if isinstance(blocks, np.ndarray) else list(blocks), hashes, parents, depths)
            return
        if type(evicted_blocks) is not list or type(evicted_hashes) is not list:
            evicted_blocks, evicted_hashes = _block_list(evicted_blocks), list(evicted_hashes)
            self._evicted = (evicted_blocks, evicted_hashes, parents, depths)
        blocks = _block_list(blocks)
        evicted_blocks += blocks
        evicted_hashes += hashes
        if self.host.keeps_chain:
            pool = self.pool
            parents += map(pool.parent_hash.__getitem__, blocks)
            depths += map(pool.depth.__getitem__, blocks)

    def _store_evicted(self) -> None:
        """Demote the blocks the last allocation evicted, as one batch."""
        blocks, hashes, parents, depths = self._evicted
        self._evicted = ([], [], [], [])
        demotions = self.host.store_many(blocks, hashes, parents or None, depths or None)
        if len(demotions):
            self._demotions.append(demotions)
            self._counters["demotions"] += len(demotions)

    def drain_events(self) -> list[KVEvent]:
        events = self.pool.drain_events()
        if self.host is not None:
            self.host.pool.events = self.pool.events   # drained together: one ordered stream
        return events

    # -- tables for kernels --------------------------------------------------
    def block_ids(self, seq_id: Hashable) -> list[int]:
        return list(self._get(seq_id).table)

    def block_table(self, seq_id: Hashable) -> np.ndarray:
        return np.array(self._get(seq_id).table, dtype=np.int32)

    def block_tables(self, seq_ids: Sequence[Hashable], *, width: int | None = None, pad: int = 0) -> np.ndarray:
        """A [len(seq_ids), width] int32 matrix, padded with ``pad`` (kernels mask by length)."""
        tables = [self._get(s).table for s in seq_ids]
        longest = max((len(t) for t in tables), default=0)
        width = longest if width is None else width
        if width < longest:
            raise InvalidArgument("width", f"{width} is shorter than the longest block table ({longest})")
        out = np.full((len(tables), width), pad, dtype=np.int32)
        for row, table in enumerate(tables):
            out[row, :len(table)] = table
        return out

    def slot_mapping(self, seq_id: Hashable, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Physical slots (block * B + offset, int64) of positions ``start .. stop-1``."""
        seq = self._running(seq_id)
        stop = seq.num_tokens if stop is None else stop
        if not 0 <= start <= stop <= seq.num_tokens:
            raise IndexError(f"positions [{start}, {stop}) outside the sequence's {seq.num_tokens} tokens")
        positions = np.arange(start, stop, dtype=np.int64)
        table = np.asarray(seq.table, dtype=np.int64)
        return table[positions // self.block_size] * self.block_size + positions % self.block_size

    # -- observability -------------------------------------------------------
    def stats(self) -> CacheStats:
        pool = self.pool
        size = self.block_size
        waste = 0
        seen: set[int] = set()
        lengths = []
        # One C-level copy: a metrics scrape calls this from its own thread while a step may add
        # or drop sequences (iterating the dict itself would raise mid-scrape).
        seqs = list(self._seqs.values())
        for seq in seqs:
            if not seq.table:
                continue
            lengths.append(len(seq.table))
            tail = seq.table[-1]
            if tail not in seen:
                seen.add(tail)
                waste += size - pool.num_tokens[tail]
        c = self._counters
        return CacheStats(
            capacity=pool.num_blocks, block_size=size, active_blocks=pool.num_active,
            evictable_blocks=pool.num_evictable, free_uncached_blocks=pool.num_free_uncached,
            cached_hashes=pool.num_cached, sequences=len(seqs),
            preempted_sequences=sum(1 for s in seqs if s.preempted),
            admitted=c["admitted"], query_tokens=c["query_tokens"], hit_tokens=c["hit_tokens"],
            evictions=pool.evictions, insertions=pool.insertions, unused_removals=pool.unused_removals,
            cow_copies=c["cow_copies"], preemptions=c["preemptions"],
            recomputed_tokens=c["recomputed_tokens"], resumed_hit_tokens=c["resumed_hit_tokens"],
            swaps_out=c["swaps_out"], swaps_in=c["swaps_in"], swapped_out_blocks=c["swapped_out_blocks"],
            swapped_in_blocks=c["swapped_in_blocks"],
            tail_waste_slots=waste, block_table_lengths=tuple(lengths),
            host_capacity=self.num_host_blocks,
            host_active_blocks=0 if self.host is None else self.host.pool.num_active,
            host_evictable_blocks=0 if self.host is None else self.host.pool.num_evictable,
            host_free_uncached_blocks=0 if self.host is None else self.host.pool.num_free_uncached,
            host_hit_tokens=c["host_hit_tokens"], loads=c["loads"], loads_refused=c["loads_refused"],
            demotions=c["demotions"],
        )

    def check_invariants(self) -> None:
        """Raise InvariantViolation unless the bookkeeping is consistent.

        Refcount of every block == number of block tables holding it; no free
        or evictable block in a table; the hash map agrees with block hashes;
        active + evictable + free-uncached == capacity; each table has exactly
        the blocks its length needs and each block's valid-token count matches.
        """
        pool = self.pool
        size = self.block_size
        running = [seq for seq in self._seqs.values() if not seq.preempted]
        pool.check(seq.table for seq in running)
        if self.host is not None:
            # host block holders: swapped-out sequences, pending loads' sources, swap-in sources
            # not yet copied; conservation and refcounts as on the device
            self.host.pool.check([*(seq.host_table for seq in self._seqs.values() if seq.host_table),
                                  *map(_block_list, self._load_pins), self._host_release])
        for seq_id, seq in self._seqs.items():
            if seq.preempted:
                if seq.table:
                    raise InvariantViolation(f"preempted sequence {seq_id!r} still holds blocks")
                if seq.host_table is not None and len(seq.host_table) != -(-seq.num_tokens // size):
                    raise InvariantViolation(f"swapped sequence {seq_id!r} has the wrong number of host blocks")
                continue
            if seq.host_table is not None:
                raise InvariantViolation(f"running sequence {seq_id!r} still holds host blocks")
            if len(seq.table) != -(-seq.num_tokens // size):
                raise InvariantViolation(
                    f"sequence {seq_id!r}: {len(seq.table)} blocks for {seq.num_tokens} tokens")
            if seq.tokens is not None and len(seq.tokens) != seq.num_tokens:
                raise InvariantViolation(f"sequence {seq_id!r}: token buffer length disagrees")
            for index, block in enumerate(seq.table):
                expect = min(size, seq.num_tokens - index * size)
                if pool.num_tokens[block] != expect:
                    raise InvariantViolation(
                        f"sequence {seq_id!r} block {index} (physical {block}) holds "
                        f"{pool.num_tokens[block]} valid tokens, expected {expect}")
                cached = pool.block_hash[block]
                if cached is not None and (index >= len(seq.hashes) or seq.hashes[index] != cached):
                    raise InvariantViolation(
                        f"sequence {seq_id!r} block {index} maps to physical {block}, "
                        "which caches a different hash")
            if len(seq.table) and seq.num_tokens % size and pool.ref_count[seq.table[-1]] > 1:
                sharers = [s for s in running if s.table and s.table[-1] == seq.table[-1]]
                if any(s.num_tokens != seq.num_tokens for s in sharers):
                    raise InvariantViolation(f"sequences sharing partial tail {seq.table[-1]} disagree on length")

    def snapshot(self):
        """The manager's full state as a comparable value (tests: a failed call changes nothing)."""
        seqs = tuple(sorted(
            ((repr(k), tuple(s.table), s.num_tokens, None if s.tokens is None else s.tokens.tobytes(),
              tuple(s.hashes), s.publishable, s.preempted, None if s.host_table is None else tuple(s.host_table))
             for k, s in self._seqs.items())))
        host = None if self.host is None else (self.host.pool.snapshot(), self.host.stores, self.host.dropped,
                                                self.host.hits)
        return (seqs, self.pool.snapshot(), tuple(self._copies), tuple(sorted(self._counters.items())), host,
                tuple(BlockCopies.join(self._demotions)), tuple(BlockCopies.join(self._loads)),
                tuple(b for pins in self._load_pins for b in _block_list(pins)), tuple(self._host_release))

    # -- helpers -------------------------------------------------------------
    def _get(self, seq_id: Hashable) -> _Sequence:
        seq = self._seqs.get(seq_id)
        if seq is None:
            raise UnknownSequence(seq_id, "never admitted or already freed")
        return seq

    def _running(self, seq_id: Hashable) -> _Sequence:
        seq = self._get(seq_id)
        if seq.preempted:
            raise SequencePreempted(seq_id)
        return seq


def _block_list(blocks: Sequence[int]) -> list[int]:
    """Block ids as a list of ints (from a list, a tuple or an int64 array)."""
    return blocks.tolist() if isinstance(blocks, np.ndarray) else list(blocks)


def _device_hits(hits: list[int], loaded: Sequence[int]) -> list[int]:
    """The blocks of ``hits`` that are not at the ``loaded`` indices (a range, or a sorted list)."""
    if type(loaded) is range:
        return hits[:loaded.start] + hits[loaded.stop:]
    skip = set(loaded)
    return [block for i, block in enumerate(hits) if i not in skip]


def _check_seq_id(seq_id, argument: str) -> None:
    """A new sequence id must be hashable and not None (None reads as "no sequence" everywhere)."""
    if seq_id is None:
        raise InvalidArgument(argument, "None is not a sequence id")
    try:
        hash(seq_id)
    except TypeError:
        raise InvalidArgument(argument, f"a sequence id must be hashable, got {type(seq_id).__name__}") from None
