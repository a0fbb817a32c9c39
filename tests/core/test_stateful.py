"""Stateful property test of KVCacheManager against a fake KV store.

A hypothesis RuleBasedStateMachine drives one manager on a tiny pool (so prefix
hits, duplicates, copy-on-write and eviction happen constantly) and mirrors
every call on a ``SlotStore`` that holds the *token id* of each slot. After
every step each running sequence's KV, read back through its block table, must
be exactly its own token history: prefix hits, sharing, COW and eviction may
never expose another sequence's (or a stale) content.

Besides the content check, the machine asserts:

* every failing action (OutOfBlocks / SequenceTooLong / UnknownSequence / SequencePreempted /
  DuplicateSequence / CacheBusy / ValueError) leaves ``snapshot()`` exactly as
  it was, and is only raised when justified;
* ``match`` is read-only and predicts ``admit`` (hit tokens, fits, free blocks
  consumed); ``blocks_needed_to_append`` predicts ``append``;
* swap-out / swap-in round-trips KV through a host ``SlotStore`` (reused device
  blocks plus host copies) and never loses or double-books a host block;
* with the host tier on (``host_cache``), evicted blocks are demoted into that
  host store and host hits loaded back (demotions, then loads, then COW copies,
  as a model runner does): every sequence still reads its own history, every
  block cached on the host holds its hash's KV, and the host pool conserves its
  blocks after every step;
* ``check_invariants``, conservation of blocks, every ``stats()`` counter
  against the test's own count, tail waste, hit_tokens <= query_tokens;
* LRU: a released sequence's blocks enter the eviction order tail first;
* differently salted sequences never share a physical block;
* one hash always names one prefix (same tokens, same salt), and every cached
  block's KV in the store (active or evictable) is the content of its hash;
* the KV event stream replays to exactly the pool's hash map, parents are
  announced before children, removals only name stored hashes;
* no leak (device or host) once every sequence is freed.
"""

from __future__ import annotations

from collections import Counter
from itertools import count

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from prefixkv import (AllBlocksCleared, BlockRemoved, BlockStored, CacheBusy, DuplicateSequence,
                      KVCacheManager, OutOfBlocks, SequencePreempted, SequenceTooLong,
                      UnknownSequence)
from prefixkv.errors import NoHostBlocks
from prefixkv.sim.slotstore import SlotStore

VOCAB = 6
TOKENS = st.integers(min_value=0, max_value=VOCAB - 1)
# Shared "system prompts": most prompts start with one of these, so their
# leading blocks hit (or duplicate) each other at every block size.
SYSTEM_PROMPTS = (
    (),
    (0, 1, 2, 3, 4, 5, 0, 1),
    (0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5),
    (5, 4, 3, 2, 1, 0, 5, 4, 3),
    (1, 1, 1, 1),
)
SALTS = (None, None, "tenant-a", "tenant-b")


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.mgr: KVCacheManager | None = None
        self.ids = count()
        self.model: dict[str, list[int]] = {}      # live seq id -> its tokens
        self.salt: dict[str, object] = {}          # live seq id -> salt
        self.preempted: set[str] = set()           # preempted (recompute or swapped)
        self.host: dict[str, list[int]] = {}       # swapped-out id -> its host blocks
        self.dead: list[str] = []                  # ids that were freed
        self.stored: set = set()                   # hashes the event stream says are cached
        self.known: dict = {}                      # hash -> (salt, prefix tokens) ever seen
        self.counters: Counter = Counter()         # what stats() must report
        self.removed = 0                           # BlockRemoved events seen

    # -- set-up ----------------------------------------------------------------
    @initialize(num_blocks=st.integers(4, 24), block_size=st.sampled_from([1, 2, 4]),
                policy=st.sampled_from(["lru", "fifo"]), verify=st.booleans(),
                num_host_blocks=st.sampled_from([0, 2, 8, 16, 32]), host_cache=st.booleans(),
                host_policy=st.sampled_from(["lru", "fifo"]), host_inclusive=st.booleans())
    def setup(self, num_blocks, block_size, policy, verify, num_host_blocks, host_cache, host_policy,
              host_inclusive):
        self.host_cache = host_cache and num_host_blocks > 0
        self.mgr = KVCacheManager(num_blocks=num_blocks, block_size=block_size, policy=policy,
                                  hash_seed=0, record_events=True, verify=verify,
                                  num_host_blocks=num_host_blocks, host_cache=self.host_cache,
                                  host_policy=host_policy, host_inclusive=host_inclusive)
        self.stored_host: set = set()              # hashes the event stream says the host tier holds
        self.B = block_size
        self.policy = policy
        self.store = SlotStore(num_blocks, block_size)
        self.host_store = SlotStore(max(num_host_blocks, 1), block_size)

    # -- helpers ---------------------------------------------------------------
    def new_id(self) -> str:
        return f"s{next(self.ids)}"

    @property
    def running(self) -> list[str]:
        return sorted((s for s in self.model if s not in self.preempted), key=lambda s: int(s[1:]))

    @property
    def parked(self) -> list[str]:
        """Preempted for recompute (not swapped out)."""
        return sorted(self.preempted - set(self.host), key=lambda s: int(s[1:]))

    @property
    def swapped(self) -> list[str]:
        return sorted(self.host, key=lambda s: int(s[1:]))

    @property
    def live(self) -> list[str]:
        return sorted(self.model, key=lambda s: int(s[1:]))

    def run_demotions(self) -> None:
        """Evicted device blocks to the host store: before anything reuses those device blocks."""
        for dev, h in self.mgr.take_demotions():
            self.host_store.slots[h] = self.store.slots[dev]

    def run_loads(self) -> None:
        for h, dev in self.mgr.take_loads():
            self.store.slots[dev] = self.host_store.slots[h]
        assert self.mgr.take_loads() == []

    def run_copies(self) -> None:
        """A step's block moves, in the order a model runner runs them: demotions, loads, COW."""
        self.run_demotions()
        self.run_loads()
        copies = self.mgr.take_copies()
        assert self.mgr.take_copies() == [], "take_copies must clear the pending copies"
        self.counters["cow_copies"] += len(copies)
        self.store.copy_blocks(copies)

    def write(self, seq_id: str, start: int) -> None:
        """What a model runner does after the call: COW copies, then this step's KV writes."""
        self.run_copies()
        tokens = self.model[seq_id]
        if start < len(tokens):
            self.store.write(self.mgr.slot_mapping(seq_id, start, len(tokens)), tokens[start:])

    def make_prompt(self, tokens, salt, as_prompt):
        if salt is not None:
            return self.mgr.prompt(tokens, salt=salt)
        return self.mgr.prompt(tokens) if as_prompt else list(tokens)

    def release_check(self, seq_id: str, call, *args):
        """Run a call that releases ``seq_id``'s blocks; under LRU the blocks that
        become evictable must enter the order tail first (shared prefix evicted last)."""
        pool = self.mgr.pool
        table = self.mgr.block_ids(seq_id)
        ref = list(pool.ref_count)
        result = call(seq_id, *args)
        newly = [b for b in reversed(table) if ref[b] == 1 and pool.block_hash[b] is not None]
        if self.policy == "lru" and newly:
            order = list(pool.policy.snapshot())
            assert order[-len(newly):] == newly, f"LRU order {order} does not end tail first with {newly}"
        for b in table:
            assert pool.ref_count[b] == ref[b] - 1
        return result

    def expect_unchanged(self, before, exc_type, call, *args, **kwargs):
        with pytest.raises(exc_type) as info:
            call(*args, **kwargs)
        assert self.mgr.snapshot() == before, f"{call.__name__} raised {info.value!r} but changed state"
        return info.value

    # -- admission -------------------------------------------------------------
    @rule(prefix=st.sampled_from(SYSTEM_PROMPTS), suffix=st.lists(TOKENS, max_size=28),
          salt=st.sampled_from(SALTS), compute_last_token=st.booleans(), as_prompt=st.booleans(),
          ask_first=st.booleans())
    def admit(self, prefix, suffix, salt, compute_last_token, as_prompt, ask_first):
        self.do_admit(list(prefix) + suffix, salt, compute_last_token, as_prompt, ask_first)

    @precondition(lambda self: self.model)
    @rule(data=st.data(), suffix=st.lists(TOKENS, max_size=8), same_salt=st.booleans(),
          compute_last_token=st.booleans(), ask_first=st.booleans())
    def admit_followup(self, data, suffix, same_salt, compute_last_token, ask_first):
        """Next turn of a conversation: a live sequence's history (generated tokens
        included) plus a few new tokens. Hits its decode-published blocks."""
        seq_id = data.draw(st.sampled_from(self.live), label="history of")
        history = self.model[seq_id]
        cut = data.draw(st.integers(0, len(history)), label="cut")
        salt = self.salt[seq_id] if same_salt else data.draw(st.sampled_from(SALTS), label="salt")
        self.do_admit(history[:cut] + suffix, salt, compute_last_token, True, ask_first)

    def do_admit(self, tokens, salt, compute_last_token, as_prompt, ask_first):
        mgr = self.mgr
        prompt = self.make_prompt(tokens, salt, as_prompt)
        seq_id = self.new_id()
        predicted = mgr.match(prompt, compute_last_token=compute_last_token) if ask_first else None
        before = mgr.snapshot()
        free_before = mgr.num_free_blocks
        try:
            hit = mgr.admit(seq_id, prompt, compute_last_token=compute_last_token)
        except OutOfBlocks as exc:
            assert mgr.snapshot() == before, f"failed admission changed state: {exc}"
            assert seq_id not in mgr
            if predicted is not None:
                assert not predicted.fits, f"match said it fits, admit raised {exc!r}"
            if not isinstance(exc, SequenceTooLong):
                assert exc.needed > exc.available == free_before
            else:
                assert _ceil_div(len(tokens), self.B) > mgr.pool.num_blocks
            return
        n = len(tokens)
        assert hit % self.B == 0 and 0 <= hit <= n
        if compute_last_token and n:
            assert hit < n, "compute_last_token must leave a token to compute"
        if predicted is not None:
            assert predicted.fits
            assert predicted.hit_tokens == hit
            assert predicted.total_blocks == _ceil_div(n, self.B)
            assert free_before - mgr.num_free_blocks == predicted.blocks_needed
        assert mgr.num_tokens(seq_id) == n and not mgr.is_preempted(seq_id)
        self.model[seq_id] = tokens
        self.salt[seq_id] = salt
        self.counters.update(admitted=1, query_tokens=n, hit_tokens=hit)
        self.write(seq_id, hit)

    @precondition(lambda self: self.mgr is not None and self.mgr.pool.num_cached)
    @rule(prefix=st.sampled_from(SYSTEM_PROMPTS), suffix=st.lists(TOKENS, max_size=16),
          salt=st.sampled_from(SALTS), compute_last_token=st.booleans())
    def match(self, prefix, suffix, salt, compute_last_token):
        mgr = self.mgr
        tokens = list(prefix) + suffix
        before = mgr.snapshot()
        m = mgr.match(self.make_prompt(tokens, salt, True), compute_last_token=compute_last_token)
        assert mgr.snapshot() == before, "match changed state"
        assert m.hit_tokens == m.hit_blocks * self.B <= len(tokens)
        assert m.total_blocks == _ceil_div(len(tokens), self.B)
        assert m.hit_blocks <= m.total_blocks and 0 <= m.blocks_needed <= m.total_blocks
        assert m.fits == (m.total_blocks <= mgr.pool.num_blocks and m.blocks_needed <= mgr.num_free_blocks)

    # -- growth ----------------------------------------------------------------
    @precondition(lambda self: self.running)
    @rule(data=st.data(), new=st.lists(TOKENS, min_size=1, max_size=10))
    def append(self, data, new):
        mgr = self.mgr
        seq_id = data.draw(st.sampled_from(self.running), label="seq")
        need = mgr.blocks_needed_to_append(seq_id, len(new))
        free_before = mgr.num_free_blocks
        before = mgr.snapshot()
        n = len(self.model[seq_id])
        try:
            mgr.append(seq_id, new)
        except OutOfBlocks as exc:
            assert mgr.snapshot() == before, f"failed append changed state: {exc}"
            if isinstance(exc, SequenceTooLong):
                assert _ceil_div(n + len(new), self.B) > mgr.pool.num_blocks
            else:
                assert need > free_before, f"append of {len(new)} needs {need} <= {free_before} free, raised"
            return
        assert need <= free_before
        assert free_before - mgr.num_free_blocks == need, "blocks_needed_to_append mispredicted"
        self.model[seq_id].extend(new)
        self.write(seq_id, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), token=TOKENS)
    def append_token(self, data, token):
        mgr = self.mgr
        seq_id = data.draw(st.sampled_from(self.running), label="seq")
        need = mgr.blocks_needed_to_append(seq_id, 1)
        free_before = mgr.num_free_blocks
        before = mgr.snapshot()
        n = len(self.model[seq_id])
        try:
            slot = mgr.append_token(seq_id, token)
        except OutOfBlocks as exc:
            assert mgr.snapshot() == before, f"failed append_token changed state: {exc}"
            assert need > free_before or isinstance(exc, SequenceTooLong)
            return
        assert slot == mgr.slot_mapping(seq_id, n, n + 1)[0]
        assert free_before - mgr.num_free_blocks == need, "blocks_needed_to_append mispredicted"
        self.model[seq_id].append(token)
        self.write(seq_id, n)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def decode_step(self, data):
        mgr = self.mgr
        ids = data.draw(st.lists(st.sampled_from(self.running), min_size=1, unique=True), label="batch")
        tokens = data.draw(st.lists(TOKENS, min_size=len(ids), max_size=len(ids)), label="tokens")
        self.do_decode(ids, tokens)

    def do_decode(self, ids, tokens):
        mgr = self.mgr
        before = mgr.snapshot()
        free_before = mgr.num_free_blocks
        lengths = [len(self.model[s]) for s in ids]
        try:
            slots = mgr.decode_step(ids, tokens)
        except OutOfBlocks as exc:
            assert mgr.snapshot() == before, f"failed decode step changed state: {exc}"
            assert exc.needed > exc.available == free_before
            return
        # Blocks taken: one per sequence whose tail was full, one per copy-on-write.
        fresh = sum(1 for n in lengths if n % self.B == 0)
        assert free_before - mgr.num_free_blocks == fresh + len(mgr._copies)
        assert slots.dtype == np.int64 and slots.shape == (len(ids),)
        for seq_id, n, slot in zip(ids, lengths, slots):
            assert mgr.slot_mapping(seq_id, n, n + 1)[0] == slot
        assert len(set(slots.tolist())) == len(ids), "two sequences write the same slot"
        # One model step: all COW copies first, then every sequence's write.
        self.run_copies()
        self.store.write(slots, tokens)
        for seq_id, token in zip(ids, tokens):
            self.model[seq_id].append(token)

    # -- sharing and lifetime --------------------------------------------------
    @precondition(lambda self: self.running)
    @rule(data=st.data(), diverge=st.booleans())
    def fork(self, data, diverge):
        """Parallel sampling: the child shares the parent's blocks; with ``diverge``
        both then decode a (possibly different) token in one step."""
        mgr = self.mgr
        parent = data.draw(st.sampled_from(self.running), label="parent")
        child = self.new_id()
        mgr.fork(parent, child)
        assert mgr.block_ids(child) == mgr.block_ids(parent)
        self.model[child] = list(self.model[parent])
        self.salt[child] = self.salt[parent]
        assert mgr.take_copies() == []
        if diverge:
            self.do_decode([parent, child], data.draw(st.lists(TOKENS, min_size=2, max_size=2), label="tokens"))

    @precondition(lambda self: self.model)
    @rule(data=st.data(), cancel=st.booleans())
    def free(self, data, cancel):
        seq_id = data.draw(st.sampled_from(self.live), label="seq")
        host_free = self.mgr.num_free_host_blocks
        self.release_check(seq_id, self.mgr.cancel if cancel else self.mgr.free)
        assert seq_id not in self.mgr
        assert self.mgr.num_free_host_blocks == host_free + len(self.host.pop(seq_id, ()))
        del self.model[seq_id], self.salt[seq_id]
        self.preempted.discard(seq_id)
        self.dead.append(seq_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data):
        mgr = self.mgr
        seq_id = data.draw(st.sampled_from(self.running), label="seq")
        assert self.release_check(seq_id, mgr.preempt) == len(self.model[seq_id])
        assert mgr.is_preempted(seq_id) and mgr.block_ids(seq_id) == []
        self.preempted.add(seq_id)
        self.counters["preemptions"] += 1

    @precondition(lambda self: self.parked)
    @rule(data=st.data(), compute_last_token=st.booleans())
    def resume(self, data, compute_last_token):
        mgr = self.mgr
        seq_id = data.draw(st.sampled_from(self.parked), label="seq")
        before = mgr.snapshot()
        n = len(self.model[seq_id])
        try:
            recompute = mgr.resume(seq_id, compute_last_token=compute_last_token)
        except OutOfBlocks as exc:
            assert mgr.snapshot() == before, f"failed resume changed state: {exc}"
            assert mgr.is_preempted(seq_id)
            return
        assert 0 <= recompute <= n and (n - recompute) % self.B == 0
        if compute_last_token and n:
            assert recompute >= 1
        assert not mgr.is_preempted(seq_id)
        self.preempted.discard(seq_id)
        self.counters.update(recomputed_tokens=recompute, resumed_hit_tokens=n - recompute)
        self.write(seq_id, n - recompute)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def swap_out(self, data):
        mgr = self.mgr
        seq_id = data.draw(st.sampled_from(self.running), label="seq")
        table = mgr.block_ids(seq_id)
        host_free = mgr.num_free_host_blocks
        before = mgr.snapshot()
        if not mgr.num_host_blocks:
            self.expect_unchanged(before, NoHostBlocks, mgr.swap_out, seq_id)
            return
        try:
            copies = self.release_check(seq_id, mgr.swap_out)
        except OutOfBlocks as exc:
            assert mgr.snapshot() == before, f"failed swap-out changed state: {exc}"
            assert len(table) > host_free
            assert isinstance(exc, SequenceTooLong) == (len(table) > mgr.num_host_blocks)
            return
        assert [dev for dev, _ in copies] == table
        host = [h for _, h in copies]
        assert len(set(host)) == len(host) and all(0 <= h < mgr.num_host_blocks for h in host)
        assert mgr.num_free_host_blocks == host_free - len(table)
        assert mgr.is_preempted(seq_id) and mgr.block_ids(seq_id) == []
        for dev, h in copies:   # run at once, before anything can reuse the device blocks
            self.host_store.slots[h] = self.store.slots[dev]
        self.preempted.add(seq_id)
        self.host[seq_id] = host
        self.counters.update(preemptions=1, swaps_out=1, swapped_out_blocks=len(copies))

    @precondition(lambda self: self.host)
    @rule(data=st.data())
    def swap_in(self, data):
        mgr = self.mgr
        seq_id = data.draw(st.sampled_from(self.swapped), label="seq")
        host_free = mgr.num_free_host_blocks
        before = mgr.snapshot()
        try:
            copies = mgr.swap_in(seq_id)
        except OutOfBlocks as exc:
            assert mgr.snapshot() == before, f"failed swap-in changed state: {exc}"
            assert mgr.is_preempted(seq_id)
            return
        table = mgr.block_ids(seq_id)
        host = self.host.pop(seq_id)
        n = len(self.model[seq_id])
        assert len(table) == _ceil_div(n, self.B) == len(host)
        reused = len(table) - len(copies)   # leading blocks still cached on the device (or the host tier)
        assert copies == list(zip(host[reused:], table[reused:]))
        assert reused <= n // self.B
        if not self.host_cache:
            assert mgr.num_free_host_blocks == host_free + len(host)
        assert not mgr.is_preempted(seq_id) and mgr.take_copies() == []
        self.run_demotions()       # they read device blocks the swap-in may have reused
        for h, dev in copies:
            self.store.slots[dev] = self.host_store.slots[h]
        self.run_loads()           # host-tier hits; releases the swap-in's host blocks
        if self.host_cache:
            assert mgr.num_free_host_blocks >= host_free
        self.preempted.discard(seq_id)
        self.counters.update(swaps_in=1, swapped_in_blocks=len(copies))

    @rule(data=st.data(), cancel=st.booleans(), salt=st.sampled_from(SALTS))
    def misuse(self, data, cancel, salt):
        """Calls with an id in the wrong state raise their typed error and change nothing:
        a live id cannot be admitted or forked into; a freed (or never admitted) id is
        unknown everywhere; a preempted one cannot grow, be read or be preempted again,
        and comes back only through the path it left by (resume / swap_in)."""
        mgr = self.mgr
        seq_id = data.draw(st.sampled_from(self.live + self.dead[-3:] + ["never-admitted"]), label="id")
        before = mgr.snapshot()

        def refused(exc_type, call, *args):
            self.expect_unchanged(before, exc_type, call, *args)

        if seq_id in self.model:
            refused(DuplicateSequence, mgr.admit, seq_id, self.make_prompt([1, 2, 3], salt, True))
            if self.running:
                refused(DuplicateSequence, mgr.fork, data.draw(st.sampled_from(self.running), label="parent"),
                        seq_id)
            if seq_id not in self.preempted:
                refused(ValueError, mgr.resume, seq_id)
                refused(ValueError, mgr.swap_in, seq_id)
                return
            refused(ValueError, mgr.resume if seq_id in self.host else mgr.swap_in, seq_id)
        else:
            refused(UnknownSequence, mgr.cancel if cancel else mgr.free, seq_id)
            refused(UnknownSequence, mgr.resume, seq_id)
            refused(UnknownSequence, mgr.swap_in, seq_id)
            refused(UnknownSequence, mgr.num_tokens, seq_id)
        not_running = SequencePreempted if seq_id in self.model else UnknownSequence
        refused(not_running, mgr.append, seq_id, [1])
        refused(not_running, mgr.append_token, seq_id, 1)
        refused(not_running, mgr.decode_step, [seq_id], [1])
        refused(not_running, mgr.slot_mapping, seq_id)
        refused(not_running, mgr.blocks_needed_to_append, seq_id, 1)
        refused(not_running, mgr.preempt, seq_id)
        refused(not_running, mgr.swap_out, seq_id)
        refused(not_running, mgr.fork, seq_id, self.new_id())

    @precondition(lambda self: self.mgr is not None and self.mgr.pool.num_cached)
    @rule(preempt_running=st.booleans())
    def reset_prefix_cache(self, preempt_running):
        mgr = self.mgr
        holders = {s for s in self.running if self.model[s]}
        if holders and not preempt_running:
            self.expect_unchanged(mgr.snapshot(), CacheBusy, mgr.reset_prefix_cache)
            return
        got = mgr.reset_prefix_cache(preempt_running=preempt_running)
        assert set(got) == holders and len(got) == len(holders)
        if mgr.host is not None:
            assert mgr.host.pool.num_cached == 0 and mgr.host.count_leading(list(self.known)) == 0
        self.preempted |= holders
        self.counters["preemptions"] += len(holders)
        stats = mgr.stats()
        assert stats.active_blocks == 0 and stats.evictable_blocks == 0 and stats.cached_hashes == 0
        assert stats.free_uncached_blocks == stats.capacity

    # -- checks after every step ------------------------------------------------
    def block_hash_of(self, block: int):
        pool = self.mgr.pool
        h = pool.block_hash[block]
        return h if h is not None else pool._duplicate_hash.get(block)

    @invariant()
    def consistent(self):
        mgr = self.mgr
        if mgr is None:
            return
        B = self.B
        mgr.check_invariants()

        stats = mgr.stats()
        assert stats.active_blocks + stats.evictable_blocks + stats.free_uncached_blocks == stats.capacity
        assert 0 <= stats.hit_tokens <= stats.query_tokens
        assert stats.sequences == len(self.model) == len(mgr)
        assert stats.preempted_sequences == len(self.preempted)
        assert mgr.num_free_blocks == stats.evictable_blocks + stats.free_uncached_blocks
        assert mgr.num_free_host_blocks + sum(map(len, self.host.values())) == mgr.num_host_blocks
        for name in ("admitted", "query_tokens", "hit_tokens", "cow_copies", "preemptions",
                     "recomputed_tokens", "resumed_hit_tokens", "swaps_out", "swaps_in",
                     "swapped_out_blocks", "swapped_in_blocks"):
            assert getattr(stats, name) == self.counters[name], f"stats().{name}"
        tails = {}
        for seq_id in self.running:
            n = len(self.model[seq_id])
            if n:
                tails[mgr.block_ids(seq_id)[-1]] = B - (n - (_ceil_div(n, B) - 1) * B)
        assert stats.tail_waste_slots == sum(tails.values())
        assert sorted(stats.block_table_lengths) == sorted(_ceil_div(len(self.model[s]), B)
                                                           for s in self.running if self.model[s])

        # Every running sequence reads back exactly its own history.
        owner: dict[int, object] = {}
        for seq_id, tokens in self.model.items():
            assert seq_id in mgr and mgr.num_tokens(seq_id) == len(tokens)
            table = mgr.block_ids(seq_id)
            if seq_id in self.preempted:
                assert mgr.is_preempted(seq_id) and table == []
                if seq_id in self.host:   # swapped KV stays intact in host memory
                    assert self.host_store.gather(self.host[seq_id], len(tokens)).tolist() == tokens
                continue
            assert not mgr.is_preempted(seq_id)
            assert len(table) == _ceil_div(len(tokens), B)
            seen = self.store.gather(table, len(tokens)).tolist()
            assert seen == tokens, f"{seq_id} reads {seen}, wrote {tokens} (table {table})"
            salt = self.salt[seq_id]
            for block in table:   # tenants never share a physical block
                assert owner.setdefault(block, salt) == salt, \
                    f"block {block} shared by salts {owner[block]!r} and {salt!r}"
            # One hash is one prefix: same tokens from the start, same salt.
            for i, block in enumerate(table[:len(tokens) // B]):
                h = self.block_hash_of(block)
                assert h is not None, f"{seq_id}'s full block {i} (physical {block}) is not in the cache"
                entry = (salt, tuple(tokens[:(i + 1) * B]))
                assert self.known.setdefault(h, entry) == entry, \
                    f"hash of {seq_id} block {i} also names {self.known[h]}"

        # Replay the KV event stream.
        pool = mgr.pool
        stored_now = []
        for ev in mgr.drain_events():
            if getattr(ev, "medium", None) == "CPU":      # the host tier's own stream
                self.replay_host_event(ev)
                continue
            if isinstance(ev, BlockStored):
                assert ev.block_hash not in self.stored, "BlockStored for a hash already stored"
                assert ev.parent_hash is None or ev.parent_hash in self.stored, \
                    "BlockStored before its parent"
                assert ev.token_count == B
                salt, prefix = self.known[ev.block_hash]
                assert (ev.extra_keys.salt if ev.extra_keys is not None else None) == salt
                if ev.parent_hash is None:
                    assert len(prefix) == B
                else:
                    assert self.known[ev.parent_hash] == (salt, prefix[:-B]), "wrong parent hash"
                self.stored.add(ev.block_hash)
                stored_now.append(ev)
            elif isinstance(ev, BlockRemoved):
                assert ev.block_hash in self.stored, "BlockRemoved for a hash never stored"
                self.stored.remove(ev.block_hash)
                self.removed += 1
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.stored.clear()
        assert self.stored == set(pool.cached_map), "event stream disagrees with the hash map"
        assert stats.evictions >= self.removed, "a hash left the cache without an eviction"
        for ev in stored_now:
            if ev.block_hash in pool.cached_map:
                assert pool.cached_map[ev.block_hash] == ev.block_id

        # Every cached block (active or evictable) still holds its hash's KV, on every tier.
        for h, block in pool.cached_map.items():
            _, prefix = self.known[h]
            assert self.store.slots[block].tolist() == list(prefix[-B:]), \
                f"cached block {block} was overwritten"
        if mgr.host is not None:
            host_pool = mgr.host.pool
            assert self.stored_host == set(host_pool.cached_map), "host events disagree with the host tier"
            assert host_pool.num_active + host_pool.num_evictable + host_pool.num_free_uncached == \
                host_pool.num_blocks
            for h, block in host_pool.cached_map.items():
                _, prefix = self.known[h]
                assert self.host_store.slots[block].tolist() == list(prefix[-B:]), \
                    f"host block {block} does not hold its hash's KV"
            if not self.host_cache:
                assert not host_pool.cached_map and stats.demotions == stats.loads == 0

    def replay_host_event(self, ev) -> None:
        if isinstance(ev, BlockStored):
            assert ev.block_hash not in self.stored_host, "host BlockStored for a hash already there"
            assert ev.block_hash in self.known and ev.token_count == self.B
            self.stored_host.add(ev.block_hash)
        elif isinstance(ev, BlockRemoved):
            assert ev.block_hash in self.stored_host, "host BlockRemoved for a hash never stored there"
            self.stored_host.remove(ev.block_hash)
        else:
            self.stored_host.clear()

    def teardown(self):
        mgr = self.mgr
        if mgr is None:
            return
        for seq_id in list(self.model):
            mgr.free(seq_id)
        mgr.check_invariants()
        assert mgr.num_free_host_blocks == mgr.num_host_blocks
        stats = mgr.stats()
        assert len(mgr) == 0 and stats.sequences == 0
        assert stats.active_blocks == 0, f"{stats.active_blocks} block(s) leaked"
        assert stats.evictable_blocks + stats.free_uncached_blocks == stats.capacity
        assert stats.evictable_blocks == stats.cached_hashes


# Sizes come from the Hypothesis profile (tests/conftest.py: PREFIXKV_HYPOTHESIS_PROFILE).
TestKVCacheManagerStateful = KVCacheMachine.TestCase


# -- deterministic companions ------------------------------------------------------

def _write(mgr, store, seq_id, start, tokens):
    store.copy_blocks(mgr.take_copies())
    store.write(mgr.slot_mapping(seq_id, start, len(tokens)), tokens[start:])


@pytest.mark.parametrize("policy", ["lru", "fifo"])
def test_three_way_fork_decode_step_copies_before_writes(policy):
    """Three sequences share a partial tail; one decode step gives each its own token."""
    mgr = KVCacheManager(num_blocks=8, block_size=4, policy=policy, hash_seed=0)
    store = SlotStore(8, 4)
    tokens = [3, 1, 4, 1, 5, 9]
    mgr.admit("a", tokens)
    _write(mgr, store, "a", 0, tokens)
    mgr.fork("a", "b")
    mgr.fork("a", "c")
    shared = mgr.block_ids("a")[-1]
    slots = mgr.decode_step(["a", "b", "c"], [7, 8, 9])
    copies = mgr.take_copies()
    assert [src for src, _ in copies] == [shared, shared]
    store.copy_blocks(copies)
    store.write(slots, [7, 8, 9])
    for seq_id, last in zip("abc", [7, 8, 9]):
        assert store.gather(mgr.block_ids(seq_id), 7).tolist() == tokens + [last]
    assert mgr.block_ids("c")[-1] == shared    # the last holder writes in place
    mgr.check_invariants()


def test_fifo_orphaned_child_then_readmit_keeps_events_consistent():
    """FIFO evicts a chain's root before its child; re-admitting must not
    announce the child again nor a child before its parent."""
    mgr = KVCacheManager(num_blocks=3, block_size=2, policy="fifo", hash_seed=0, record_events=True)
    mgr.admit("x", [0, 1, 2, 3])          # root R, child C
    mgr.free("x")
    stored = {e.block_hash for e in mgr.drain_events() if isinstance(e, BlockStored)}
    assert len(stored) == 2
    mgr.admit("y", [5, 5, 5])             # 2 blocks: the free one, then evicts R (oldest), not C
    assert len(mgr.pool.cached_map) == 2     # C (orphaned) and y's full block
    mgr.free("y")
    mgr.admit("z", [0, 1, 2, 3])
    live = set(stored)
    for ev in mgr.drain_events():
        if isinstance(ev, BlockStored):
            assert ev.block_hash not in live
            assert ev.parent_hash is None or ev.parent_hash in live
            live.add(ev.block_hash)
        elif isinstance(ev, BlockRemoved):
            live.remove(ev.block_hash)
    assert live == set(mgr.pool.cached_map)
    mgr.check_invariants()


def test_failed_actions_change_nothing():
    mgr = KVCacheManager(num_blocks=4, block_size=2, hash_seed=0, record_events=True)
    mgr.admit("a", [1, 2, 3])
    mgr.fork("a", "b")
    mgr.admit("c", [4, 4, 4])
    before = mgr.snapshot()
    with pytest.raises(OutOfBlocks):
        mgr.decode_step(["a", "b", "c"], [1, 2, 3])     # a and b must copy: 2 > 0 free
    with pytest.raises(SequenceTooLong):
        mgr.admit("d", list(range(9)))
    with pytest.raises(DuplicateSequence):
        mgr.admit("a", [1])
    with pytest.raises(UnknownSequence):
        mgr.free("zzz")
    with pytest.raises(CacheBusy):
        mgr.reset_prefix_cache()
    assert mgr.snapshot() == before
    mgr.check_invariants()
