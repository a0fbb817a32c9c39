"""A block store (Redis, disk) as a tier below the host tier: the work every such tier does alike.

A ``StoreTier`` is reached *through the host tier*, so the manager never waits on the store:

* **Prefetch** (``prefetch(prompt)``, before the prompt is admitted): walk the prompt's chain
  through the device pool and the host tier (read-only); past their last hit, ask the store how
  far it continues the chain (one probe), fetch those blocks (every value verified: checksums,
  fingerprint, hash against key, parent against chain, dims, length, and the block's token ids),
  copy the verified payloads into free host blocks and only then publish them in the host tier.
  ``admit()`` then finds them as ordinary host hits and records their loads, which run before the
  step's writes: admission only ever counts blocks whose verified bytes are already in host
  memory. A prefetch that stages blocks first runs the demotions pending in the manager
  (``take_demotions``, into ``kv``): the host blocks it takes may be their destinations.
* **Write-back** (``write_back()``, after a step): blocks the device published from KV this process
  computed (``KVCacheManager.take_published``) are packed from the device pool (one gather) and
  handed to the store's bounded background writer. The step never waits on the store; ``flush()``
  waits (tests, shutdown). A block is packed only while the device still caches its hash and,
  when the caller tracks unwritten KV (``manager.unwritten``, as the HF cache does), once it is
  written.
* **Keep** (``keep(staged)``): blocks a tier below this one staged are written here too, so a disk
  tier above a remote one serves them next time.

A tier is built unbound (``DiskTier(path, capacity_bytes)``, ``RemoteTier(url)``), goes in a
manager's stack (``KVCacheManager(tiers=[HostTier(n), tier])``) and is bound to the KV store once
that exists (``manager.tiers.bind(kv, weights=...)``): binding builds the fingerprint (weights
digest, dtype, shapes, block size, TP, layout, hash algorithm and seed) and opens the store, and
refuses a manager whose hash seed is not pinned (``UnpinnedHashSeed``). Prompts of precomputed
integer hashes (traces) are skipped: keys are built from the chained ``bytes`` hashes of token
prompts. Subclasses say how to open their store (``_open_store``), where it is (``_where``) and when
it is down (``_down``).

Threads: one caller thread (the engine's); the store has its own writer thread.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod

from ..checks import integer, seconds
from ..errors import InvalidArgument
from .fingerprint import UnpinnedHashSeed
from .staging import StagingBuffer, fingerprint_for

__all__ = ["StoreTier"]

_COUNTERS = ("prefetches", "prefetch_probes", "probed_blocks", "staged_blocks", "staged_bytes",
             "prefetch_skipped_down", "write_backs", "offered_blocks", "queued_blocks", "stale_blocks",
             "held_unwritten", "dropped_unwritten", "write_back_skipped_down", "kept_from_below")


def _check_options(max_prefetch_blocks, staging_blocks, max_held) -> tuple:
    if max_prefetch_blocks is not None:
        max_prefetch_blocks = integer("max_prefetch_blocks", max_prefetch_blocks, low=1)
    # a negative max_held deleted more held records than there were and counted them as dropped
    return max_prefetch_blocks, integer("staging_blocks", staging_blocks, low=1), integer("max_held", max_held, low=0)


def _check_manager(manager, kv, what: str) -> None:
    host = manager.host
    if host is None or not host.cache:
        raise InvalidArgument("manager", f"a {what} tier stages blocks in the host tier: build the manager with "
                                         "num_host_blocks > 0 and host_cache=True")
    if manager.pool.verify:
        raise InvalidArgument("manager", f"a manager with verify=True takes no host-tier hits, so a {what} tier "
                                         f"could serve nothing; the {what} tier verifies every block's token ids "
                                         "itself: use verify=False")
    if not manager.enable_caching:
        raise InvalidArgument("manager", f"a {what} tier needs prefix caching (enable_caching=True)")
    if kv.host is None or kv.num_host_blocks != manager.num_host_blocks:
        raise InvalidArgument("kv", f"the KV store's host pool ({kv.num_host_blocks} blocks) must match the "
                                    f"manager's num_host_blocks ({manager.num_host_blocks}): "
                                    "kv.allocate_host(num_host_blocks)")


class StoreTier(ABC):
    """A block store below ``manager``'s host tier, staging through ``kv.host`` (see the module docs)."""

    name = "STORE"
    synchronous = False

    def __init__(self, *, max_prefetch_blocks: int | None = None, staging_blocks: int = 64,
                 max_held: int = 4096) -> None:
        """``max_prefetch_blocks``: blocks one prefetch may stage (None: the host tier's capacity);
        ``staging_blocks``: the pack/unpack buffer; ``max_held``: published blocks whose KV is not
        yet written kept for a later write-back (beyond: dropped and counted)."""
        self._options = _check_options(max_prefetch_blocks, staging_blocks, max_held)
        self.store = self.manager = self.kv = self.staging = None
        self._held: list[tuple] = []           # published, KV not yet written (manager.unwritten)
        self._count = dict.fromkeys(_COUNTERS, 0)
        self.slowest_prefetch_s = 0.0
        self.slowest_write_back_s = 0.0
        self.last_staged = None                # (chain, start, payloads, contents) of the last prefetch

    # -- what a subclass says ----------------------------------------------------------
    @abstractmethod
    def _open_store(self, fingerprint):
        """The block store for ``fingerprint`` (the subclass's: a disk directory, a Redis URL)."""

    def _where(self) -> dict:
        return {}

    def _down(self) -> bool:
        return False

    # -- binding -------------------------------------------------------------------------
    def bind(self, manager, kv, *, weights: bytes, tp_rank: int = 0, tp_size: int = 1) -> "StoreTier":
        """Open the store for ``kv``'s blocks under ``manager``'s hashing. ``weights``:
        ``model_weights_digest(model)``. Everything refused is refused before the store opens."""
        if self.store is not None:
            raise InvalidArgument("tier", f"this {self.name.lower()} tier is bound already")
        if not getattr(manager, "hash_seed_pinned", False):
            raise UnpinnedHashSeed()
        _check_manager(manager, kv, self.name.lower())
        hasher = manager.hasher
        fp = fingerprint_for(kv, weights, hash_seed=hasher.seed, hash_algorithm=hasher.algorithm,
                             tp_rank=tp_rank, tp_size=tp_size)
        if fp.block_size != hasher.block_size:
            raise InvalidArgument("kv", f"the KV store's block size {fp.block_size} differs from the manager's "
                                        f"{hasher.block_size}")
        store = self._open_store(fp)
        try:
            self._attach(store, manager, kv)
        except BaseException:
            store.close(flush_timeout_s=0.0)
            raise
        return self

    def _attach(self, store, manager, kv) -> None:
        _check_manager(manager, kv, self.name.lower())
        fp, hasher = store.fingerprint, manager.hasher
        if (fp.block_size, fp.hash_seed, fp.hash_algorithm) != (hasher.block_size, hasher.seed, hasher.algorithm):
            raise InvalidArgument("store", f"its fingerprint hashes blocks of {fp.block_size} with seed "
                                           f"{fp.hash_seed} ({fp.hash_algorithm}); the manager: {hasher.block_size}, "
                                           f"{hasher.seed} ({hasher.algorithm})")
        max_prefetch_blocks, staging_blocks, max_held = self._options
        staging = StagingBuffer(kv, staging_blocks)
        if fp.block_bytes != staging.block_bytes:
            raise InvalidArgument("store", f"its fingerprint has {fp.block_bytes}-byte blocks; the KV store's are "
                                           f"{staging.block_bytes}")
        self.staging = staging
        self.store = store
        self.manager = manager
        self.kv = kv
        self.max_prefetch_blocks = max_prefetch_blocks or manager.host.capacity_blocks
        self.max_held = max_held
        manager.record_published()
        if self not in manager.tiers.lower:
            manager.tiers.attach(self)

    # -- the tier protocol -----------------------------------------------------------
    @property
    def capacity_blocks(self) -> int | None:
        """Blocks the store holds at most (None: unknown, e.g. a server's ``maxmemory`` decides)."""
        return None

    def count_leading(self, hashes, start: int = 0) -> int:
        """Leading blocks of ``hashes[start:]`` the server holds now (one probe; 0 when unreachable
        or for non-``bytes`` hashes). A hint: only ``prefetch`` makes blocks usable."""
        if self.store is None or start >= len(hashes) or not isinstance(hashes[start], bytes):
            return 0
        return self.store.probe(hashes, start)

    def stats(self) -> dict:
        if self.store is None:
            return dict(self._count, bound=False)
        out = dict(self._count, held=len(self._held), slowest_prefetch_s=self.slowest_prefetch_s,
                   slowest_write_back_s=self.slowest_write_back_s, fingerprint=self.store.fingerprint.hex,
                   **self._where())
        store = self.store.stats()
        out.update({f"store_{name}": getattr(store, name) for name in store.__slots__})
        return out

    # -- reads: prefetch into the host tier ------------------------------------------------
    def prefetch(self, prompt, *, compute_last_token: bool = True) -> int:
        """Stage the remote continuation of ``prompt``'s cached chain in the host tier, verified.

        ``prompt``: the manager's ``Prompt`` (``manager.prompt(tokens, ...)``). Returns the blocks
        staged; ``admit`` (with the same ``compute_last_token``) then counts them as host hits.
        Never raises for network trouble (a miss); leaves the device pool untouched.
        """
        mgr = self.manager
        if mgr is None or prompt.tokens is None or not mgr.takes_lower_hits:
            return 0
        size = mgr.block_size
        hashes = prompt.block_hashes()
        limit = min((prompt.num_tokens - 1 if compute_last_token else prompt.num_tokens) // size, len(hashes))
        if limit <= 0:
            return 0
        t0 = time.perf_counter()
        self._count["prefetches"] += 1
        try:
            return self._prefetch(prompt, hashes, limit)
        finally:
            self.slowest_prefetch_s = max(self.slowest_prefetch_s, time.perf_counter() - t0)

    def _prefetch(self, prompt, hashes, limit: int) -> int:
        mgr = self.manager
        host = mgr.host.pool
        # The chain as the device and the host tier hold it now (as admit() will walk it).
        in_device, in_host = mgr.pool.lookup, host.lookup
        start, held = 0, []
        while start < limit:
            h = hashes[start]
            if in_device(h) is None:
                block = in_host(h)
                if block is None:
                    break
                held.append(block)
            start += 1
        if start >= limit:
            return 0
        if self._down():           # e.g. a breaker open: no network, no work
            self._count["prefetch_skipped_down"] += 1
            return 0
        # Hold the chain's host blocks while staging: the allocation below must not evict them.
        host.acquire_hits(held)
        staged: list[int] = []
        try:
            room = min(limit - start, self.max_prefetch_blocks, host.num_free)
            if room <= 0:
                return 0
            chain = hashes[:start + room]
            self._count["prefetch_probes"] += 1
            found = self.store.probe(chain, start)
            self._count["probed_blocks"] += found
            if not found:
                return 0
            contents = [mgr.hasher.block_content(prompt.tokens, i, prompt.extra)
                        for i in range(start, start + found)]
            got = self.store.fetch(chain, start, start + found, contents)
            n = got.count
            if not n:
                return 0
            self.last_staged = (chain, start, got.payloads, contents[:n])
            # Demotions the manager recorded since the caller's last transfer copy device blocks into
            # host blocks that are already evictable; the allocation below may take those blocks,
            # and the copy, run later, would overwrite the staged bytes under their new hashes. Run
            # them now: they come first in a step's transfers anyway (before loads, copies, writes).
            demotions = mgr.take_demotions()
            if demotions:
                self.kv.demote(demotions)
            # Bytes first, then the hashes: a host block is published only holding verified KV.
            staged = host.allocate(n)
            self.staging.unpack_host(staged, got.payloads)
            num_tokens = host.num_tokens
            extra = prompt.extra if host.events is not None else None
            for j, block in enumerate(staged):
                i = start + j
                num_tokens[block] = mgr.block_size
                host.publish(block, hashes[i], hashes[i - 1] if i else None, i, None, extra)
            self._count["staged_blocks"] += n
            self._count["staged_bytes"] += n * self.staging.block_bytes
            return n
        finally:
            # tail first, as the manager releases: the prefix stays the most recently used
            host.release([*reversed(staged), *reversed(held)])

    # -- writes: back to the store after a step -------------------------------------------
    def write_back(self, records: list | None = None) -> int:
        """Queue the blocks published from computed KV since the last call; returns blocks queued.

        Call after a step whose KV writes have run (the engine does, after each step); never waits
        on the store. A block no longer cached under its hash is skipped (``stale_blocks``).
        ``records``: ``manager.take_published()``'s, when a ``TierStack`` hands the same records to
        every tier; None: taken here."""
        if self.store is None:
            return 0
        if records is None:
            records = self.manager.take_published()
        if self._held:
            records, self._held = self._held + records, []
        if not records:
            return 0
        t0 = time.perf_counter()
        self._count["write_backs"] += 1
        try:
            return self._write_back(records)
        finally:
            self.slowest_write_back_s = max(self.slowest_write_back_s, time.perf_counter() - t0)

    def _write_back(self, records: list[tuple]) -> int:
        if self._down():           # e.g. a breaker open: nothing packed, nothing sent
            self._count["write_back_skipped_down"] += len(records)
            return 0
        block_hash = self.manager.pool.block_hash
        unwritten = self.manager.unwritten
        ready, seen = [], set()
        for record in records:
            block, hashes, i, tokens, _ = record
            h = hashes[i]
            if tokens is None or not isinstance(h, bytes) or block_hash[block] != h or h in seen:
                self._count["stale_blocks"] += 1
                continue
            if block in unwritten:
                self._held.append(record)
                continue
            seen.add(h)
            ready.append(record)
        if len(self._held) > self.max_held:
            drop = len(self._held) - self.max_held
            self._count["dropped_unwritten"] += drop
            del self._held[:drop]
        self._count["held_unwritten"] = len(self._held)
        self._count["offered_blocks"] += len(ready)
        queued = 0
        hasher = self.manager.hasher
        for at in range(0, len(ready), self.staging.capacity):
            chunk = ready[at:at + self.staging.capacity]
            payloads = self.staging.pack([r[0] for r in chunk])
            # one put per run of consecutive blocks of one chain (one sequence's hashes list)
            a = 0
            while a < len(chunk):
                b = a + 1
                while b < len(chunk) and chunk[b][1] is chunk[a][1] and chunk[b][2] == chunk[b - 1][2] + 1:
                    b += 1
                _, hashes, first, tokens, extra = chunk[a]
                contents = [hasher.block_content(tokens, first + j, extra) for j in range(b - a)]
                queued += self.store.put(hashes, first, payloads[a:b], contents)
                a = b
        self._count["queued_blocks"] += queued
        return queued

    def keep(self, staged) -> int:
        """Write blocks a tier below this one staged (``last_staged``: chain, start, payloads, contents),
        so this tier serves them next time; returns the blocks queued. Never waits on the store."""
        chain, start, payloads, contents = staged
        if self.store is None or self._down():
            return 0
        queued = self.store.put(chain[:start + len(payloads)], start, payloads, contents)
        self._count["kept_from_below"] += queued
        return queued

    # -- lifetime ------------------------------------------------------------------------
    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued write has been sent (or dropped); False on timeout."""
        return True if self.store is None else self.store.flush(timeout_s)

    def clear(self) -> int:
        """Delete every block of this tier's fingerprint from its store; returns how many."""
        return 0 if self.store is None else self.store.clear()

    def close(self, flush_timeout_s: float = 5.0) -> None:
        """Write what is queued (bounded), stop the store's thread; the last lower tier of the manager
        to close stops its recording of published blocks."""
        seconds("flush_timeout_s", flush_timeout_s, zero=True)
        if self.store is None:
            return
        manager = self.manager
        others = [t for t in manager.tiers.lower if t is not self and getattr(t, "store", None) is not None]
        if not others:
            manager.record_published(False)
        manager.tiers.lower = tuple(t for t in manager.tiers.lower if t is not self)
        self._held.clear()
        self.store.close(flush_timeout_s)

