import numpy as np
import pytest

from prefixkv import (AllBlocksCleared, BlockRemoved, BlockStored, CacheBusy, DuplicateSequence,
                      HashMismatch, InvalidTokens, KVCacheManager, KVSpec, OutOfBlocks, PolicyError,
                      SequencePreempted, SequenceTooLong, UnknownSequence)
from prefixkv.policies.lru import LRUPolicy
from prefixkv.sim.slotstore import SlotStore

B = 4


def make(num_blocks=16, **kw):
    kw.setdefault("hash_seed", 0)
    return KVCacheManager(num_blocks, B, **kw)


def assert_unchanged(mgr, fn, error):
    before = mgr.snapshot()
    with pytest.raises(error):
        fn()
    assert mgr.snapshot() == before
    mgr.check_invariants()


# -- admission and prefix hits --------------------------------------------------------------------

def test_shared_prefix_shares_physical_blocks():
    mgr = make()
    assert mgr.admit("a", list(range(10))) == 0
    assert mgr.admit("b", list(range(8)) + [99, 98, 97]) == 8
    assert mgr.block_ids("a")[:2] == mgr.block_ids("b")[:2]
    assert mgr.block_ids("a")[2] != mgr.block_ids("b")[2]
    assert [mgr.pool.ref_count[b] for b in mgr.block_ids("a")] == [2, 2, 1]
    s = mgr.stats()
    assert (s.query_tokens, s.hit_tokens, s.active_blocks) == (21, 8, 4)
    mgr.check_invariants()


def test_match_is_read_only_and_predicts_admit():
    mgr = make()
    mgr.admit("a", list(range(12)))
    mgr.free("a")
    before = mgr.snapshot()
    m = mgr.match(list(range(10)))
    assert mgr.snapshot() == before
    assert (m.hit_tokens, m.hit_blocks, m.total_blocks, m.fits) == (8, 2, 3, True)
    assert m.blocks_needed == 1 + 2        # one fresh block + two evictable hits it would pin
    assert mgr.admit("b", list(range(10))) == m.hit_tokens


def test_fully_cached_aligned_prompt_recomputes_its_last_token():
    mgr = make()
    mgr.admit("a", list(range(8)))
    mgr.free("a")
    assert mgr.match(list(range(8))).hit_tokens == 4
    assert mgr.match(list(range(8)), compute_last_token=False).hit_tokens == 8
    assert mgr.admit("b", list(range(8))) == 4
    mgr.check_invariants()


def test_generated_tokens_are_cached_for_the_next_turn():
    mgr = make()
    mgr.admit("turn1", [1, 2, 3])
    for t in [4, 5, 6, 7, 8]:
        mgr.append_token("turn1", t)
    mgr.free("turn1")
    assert mgr.admit("turn2", [1, 2, 3, 4, 5, 6, 7, 8, 9]) == 8


def test_salted_tenants_never_share_and_adapter_equal_to_salt_does_not_collide():
    mgr = make()
    tokens = list(range(12))
    mgr.admit("a", mgr.prompt(tokens, salt="tenant-a"))
    assert mgr.admit("b", mgr.prompt(tokens, salt="tenant-b")) == 0
    assert mgr.admit("c", mgr.prompt(tokens, adapter="tenant-a")) == 0
    assert mgr.admit("d", mgr.prompt(tokens)) == 0
    assert mgr.admit("e", mgr.prompt(tokens, salt="tenant-a")) == 8
    tables = [set(mgr.block_ids(s)) for s in "abcd"]
    assert all(tables[i].isdisjoint(tables[j]) for i in range(4) for j in range(i + 1, 4))


def test_prompt_hashed_differently_is_refused():
    a, b = make(hash_seed=0), make(hash_seed=1)
    with pytest.raises(ValueError, match="another manager"):
        b.admit("x", a.prompt([1, 2, 3]))


# -- edge cases -----------------------------------------------------------------------------------

@pytest.mark.parametrize("n,blocks,waste", [(0, 0, 0), (1, 1, 3), (B, 1, 0), (B + 1, 2, 3)])
def test_edge_lengths(n, blocks, waste):
    mgr = make()
    assert mgr.admit("s", list(range(n))) == 0
    assert len(mgr.block_ids("s")) == blocks
    assert mgr.stats().tail_waste_slots == waste
    mgr.check_invariants()
    mgr.append("s", [7])
    assert mgr.num_tokens("s") == n + 1
    mgr.check_invariants()
    mgr.free("s")
    assert mgr.stats().active_blocks == 0


def test_prompt_longer_than_the_pool():
    mgr = make(num_blocks=4)
    mgr.admit("small", [1])
    assert_unchanged(mgr, lambda: mgr.admit("huge", list(range(17))), SequenceTooLong)
    with pytest.raises(SequenceTooLong) as exc:
        mgr.admit("huge", list(range(17)))
    assert exc.value.needed == 5 and exc.value.capacity == 4


def test_out_of_blocks_reports_numbers_and_changes_nothing():
    mgr = make(num_blocks=4)
    mgr.admit("a", list(range(10)))       # 3 blocks
    with pytest.raises(OutOfBlocks) as exc:
        mgr.admit("b", list(range(100, 108)))
    assert (exc.value.needed, exc.value.available) == (2, 1)
    assert_unchanged(mgr, lambda: mgr.admit("b", list(range(100, 108))), OutOfBlocks)
    assert "b" not in mgr and mgr.stats().admitted == 1


def test_evictable_hits_count_against_free_space():
    # Pool of 3: "a" leaves 2 cached evictable blocks. A prompt that hits both and needs 2
    # fresh ones cannot fit: pinning the hits leaves only 1 block to allocate.
    mgr = make(num_blocks=3)
    mgr.admit("a", list(range(8)))
    mgr.free("a")
    m = mgr.match(list(range(8)) + [50, 51, 52, 53, 54])
    assert (m.hit_blocks, m.blocks_needed, m.fits) == (2, 4, False)
    assert_unchanged(mgr, lambda: mgr.admit("b", list(range(8)) + [50, 51, 52, 53, 54]), OutOfBlocks)


def test_invalid_tokens_change_nothing():
    mgr = make()
    mgr.admit("a", [1, 2])
    assert_unchanged(mgr, lambda: mgr.admit("b", [1, -2]), InvalidTokens)
    assert_unchanged(mgr, lambda: mgr.append("a", [2**40]), InvalidTokens)
    assert_unchanged(mgr, lambda: mgr.append_token("a", -1), InvalidTokens)


def test_free_twice_and_unknown_ids_are_clear_errors():
    mgr = make()
    mgr.admit("a", [1, 2, 3])
    assert_unchanged(mgr, lambda: mgr.admit("a", [1]), DuplicateSequence)
    mgr.free("a")
    assert_unchanged(mgr, lambda: mgr.free("a"), UnknownSequence)
    with pytest.raises(UnknownSequence, match="already freed"):
        mgr.append("a", [1])
    assert mgr.pool.ref_count.count(0) == 16   # no double decrement


# -- append, copy-on-write, fork ------------------------------------------------------------------

def test_seed_cow_exercise():
    """Two sequences share a partly filled tail P2; A writes; A finishes; B finishes."""
    mgr = make(num_blocks=8)
    mgr.admit("other", list(range(100, 108)))   # occupy two blocks so P2 is not block 0
    mgr.admit("A", [1, 2, 3])
    mgr.fork("A", "B")
    p2 = mgr.block_ids("A")[-1]
    free0 = mgr.num_free_blocks
    mgr.append("A", [1001])
    p3 = mgr.block_ids("A")[-1]
    assert p3 != p2 and mgr.block_ids("B")[-1] == p2
    assert mgr.take_copies() == [(p2, p3)]
    assert mgr.num_free_blocks == free0 - 1
    assert (mgr.pool.ref_count[p2], mgr.pool.ref_count[p3]) == (1, 1)
    mgr.free("A")
    assert mgr.num_free_blocks == free0 and mgr.pool.ref_count[p2] == 1
    mgr.free("B")
    assert mgr.num_free_blocks == free0 + 1
    assert mgr.stats().cow_copies == 1
    mgr.check_invariants()


def test_cow_keeps_histories_apart_in_a_real_store():
    mgr = make()
    store = SlotStore(16, B)
    prompt = [5, 6, 7, 8, 9, 10]
    mgr.admit("a", prompt)
    store.write(mgr.slot_mapping("a"), prompt)
    mgr.fork("a", "b")
    for seq, token in [("a", 11), ("b", 22), ("a", 12), ("b", 23)]:
        slot = mgr.append_token(seq, token)
        store.copy_blocks(mgr.take_copies())
        store.write([slot], [token])
    assert store.gather(mgr.block_ids("a"), 8).tolist() == prompt + [11, 12]
    assert store.gather(mgr.block_ids("b"), 8).tolist() == prompt + [22, 23]


def test_full_shared_blocks_are_not_copied():
    mgr = make()
    mgr.admit("a", list(range(8)))
    mgr.fork("a", "b")
    mgr.append("a", [1])
    assert mgr.take_copies() == []
    assert mgr.block_ids("a")[:2] == mgr.block_ids("b")


def test_failed_cow_leaves_the_old_mapping():
    mgr = make(num_blocks=2)
    mgr.admit("a", list(range(5)))
    mgr.fork("a", "b")
    assert mgr.blocks_needed_to_append("a", 1) == 1
    assert_unchanged(mgr, lambda: mgr.append("a", [1]), OutOfBlocks)
    assert_unchanged(mgr, lambda: mgr.append_token("a", 1), OutOfBlocks)


def test_decode_step_checks_the_whole_round_first():
    """The seed's case: 3 free blocks, 4 sequences crossing a block boundary."""
    mgr = make(num_blocks=7)
    for i in range(4):
        mgr.admit(i, [i] * B)              # each full: the next token needs a new block
    assert mgr.num_free_blocks == 3
    assert_unchanged(mgr, lambda: mgr.decode_step([0, 1, 2, 3], [1, 1, 1, 1]), OutOfBlocks)
    slots = mgr.decode_step([0, 1, 2], [1, 1, 1])
    assert slots.dtype == np.int64
    assert slots.tolist() == [mgr.block_ids(i)[-1] * B for i in range(3)]
    mgr.check_invariants()


def test_chunked_prefill_by_appends_publishes_blocks():
    mgr = make()
    mgr.admit("a", list(range(3)))
    mgr.append("a", list(range(3, 11)))
    assert mgr.num_tokens("a") == 11 and len(mgr.block_ids("a")) == 3
    mgr.free("a")
    assert mgr.match(list(range(11))).hit_tokens == 8


# -- preemption, reset --------------------------------------------------------------------------

def test_preempt_and_resume_do_not_count_hits():
    mgr = make()
    mgr.admit("a", list(range(10)))
    assert mgr.preempt("a") == 10
    assert mgr.is_preempted("a") and mgr.stats().active_blocks == 0
    with pytest.raises(SequencePreempted, match="preempted"):
        mgr.append("a", [1])
    assert mgr.resume("a") == 2            # two cached blocks reused, the tail recomputed
    s = mgr.stats()
    assert (s.hit_tokens, s.recomputed_tokens, s.resumed_hit_tokens, s.preemptions) == (0, 2, 8, 1)
    mgr.append("a", [1])
    mgr.check_invariants()


def test_preempting_a_fork_keeps_blocks_others_hold():
    mgr = make()
    mgr.admit("a", list(range(6)))
    mgr.fork("a", "b")
    mgr.preempt("b")
    assert all(mgr.pool.ref_count[b] == 1 for b in mgr.block_ids("a"))
    mgr.check_invariants()


def test_resume_that_does_not_fit_changes_nothing():
    mgr = make(num_blocks=3)
    mgr.admit("a", list(range(10)))
    mgr.preempt("a")
    mgr.admit("b", list(range(50, 58)))
    assert_unchanged(mgr, lambda: mgr.resume("a"), OutOfBlocks)


def test_reset_is_refused_while_blocks_are_held():
    mgr = make()
    mgr.admit("a", list(range(8)))
    assert_unchanged(mgr, mgr.reset_prefix_cache, CacheBusy)
    assert mgr.reset_prefix_cache(preempt_running=True) == ["a"]
    assert mgr.stats().cached_hashes == 0 and mgr.stats().free_uncached_blocks == 16
    assert mgr.resume("a") == 8
    mgr.free("a")
    mgr.reset_prefix_cache()
    assert mgr.match(list(range(8))).hit_tokens == 0


# -- eviction -------------------------------------------------------------------------------------

def test_lru_evicts_a_sequences_tail_before_its_prefix():
    mgr = make(num_blocks=4)
    mgr.admit("a", list(range(16)))        # 4 full blocks, all published
    blocks = mgr.block_ids("a")
    mgr.free("a")                            # released tail first
    assert mgr.pool.policy.snapshot() == tuple(reversed(blocks))
    mgr.admit("b", [900, 901, 902])          # evicts exactly one: a's tail
    assert mgr.block_ids("b") == [blocks[-1]]
    assert mgr.match(list(range(16)), compute_last_token=False).hit_tokens == 12
    assert mgr.stats().evictions == 1


def test_hit_on_an_evictable_block_takes_it_out_of_the_queue():
    mgr = make(num_blocks=4)
    mgr.admit("a", list(range(4)))
    block = mgr.block_ids("a")[0]
    mgr.free("a")
    assert block in mgr.pool.policy
    mgr.admit("b", list(range(5)))
    assert block not in mgr.pool.policy and mgr.pool.ref_count[block] == 1
    mgr.check_invariants()


def test_fifo_and_lru_choose_different_victims():
    victims = {}
    for policy in ("lru", "fifo"):
        mgr = make(num_blocks=3, policy=policy)
        mgr.admit("x", list(range(4)))         # block X cached first
        mgr.admit("y", list(range(10, 14)))    # block Y cached second
        mgr.free("x")
        mgr.free("y")
        mgr.admit("x2", list(range(5)))        # hit X again: LRU now keeps it longer
        mgr.free("x2")
        mgr.admit("z", list(range(20, 28)))    # needs 2: one free, one victim
        victims[policy] = mgr.match(list(range(5))).hit_tokens
    assert victims == {"lru": 4, "fifo": 0}    # LRU evicted Y, FIFO evicted X


# -- precomputed hashes ---------------------------------------------------------------------------

def test_admission_by_precomputed_hashes():
    mgr = make(index="dict")
    p = mgr.prompt_from_hashes([11, 12, 13], num_tokens=10)   # last hash covers a partial block
    assert mgr.admit("a", p) == 0
    mgr.free("a")
    assert mgr.admit("b", mgr.prompt_from_hashes([11, 12, 99], 12)) == 8
    assert mgr.admit("c", mgr.prompt_from_hashes([11, 12], 8), compute_last_token=False) == 8
    mgr.append_slots("b", 4, block_hashes=[77])
    mgr.free("b")
    assert mgr.match(mgr.prompt_from_hashes([11, 12, 99, 77], 16), compute_last_token=False).hit_tokens == 16
    with pytest.raises(TypeError, match="append_slots"):
        mgr.append("c", [1])


def test_a_flat_index_takes_only_its_own_digests_as_precomputed_hashes():
    pytest.importorskip("numba")
    mgr = make(index="flat")
    with pytest.raises(HashMismatch, match="16-byte digests.*index='dict'"):
        mgr.prompt_from_hashes([11, 12], 8)
    with pytest.raises(HashMismatch, match="got bytes b'ab'"):
        mgr.prompt_from_hashes([bytes(16), b"ab"], 8)
    digests = [bytes([i]) * 16 for i in (1, 2, 3)]
    assert mgr.admit("a", mgr.prompt_from_hashes(digests, 12), compute_last_token=False) == 0
    mgr.free("a")
    assert mgr.admit("b", mgr.prompt_from_hashes(digests[:2], 8), compute_last_token=False) == 8
    assert mgr.pool.block_hash[mgr.block_ids("b")[1]] == digests[1]
    before = mgr.snapshot()
    with pytest.raises(HashMismatch, match="16-byte digests"):     # two widths adding up to 32 bytes
        mgr.append_slots("b", 8, block_hashes=[bytes(15) + b"x", bytes(17)][::-1])
    assert mgr.snapshot() == before


@pytest.mark.parametrize("hashes,n", [([1, 2], 3), ([1], 9), ([1, None], 8), ([[1], 2], 8)])
def test_hash_counts_that_contradict_the_length(hashes, n):
    mgr = make(index="dict")
    with pytest.raises((HashMismatch, ValueError)):
        mgr.prompt_from_hashes(hashes, n)


def test_precomputed_hashes_that_repeat_are_refused_before_they_can_share_a_block_twice():
    """A prefix chain never repeats a hash; a list that does would map one block twice into a
    table on a single reference (the pool counts a match's blocks as distinct)."""
    mgr = make(index="dict")
    mgr.admit("a", mgr.prompt_from_hashes([1, 2, 3, 4], 16))
    mgr.free("a")
    before = mgr.pool.snapshot()
    with pytest.raises(HashMismatch, match=r"block hash 2 \(1\) repeats block hash 0"):
        mgr.prompt_from_hashes([1, 2, 1, 3], 16)
    with pytest.raises(HashMismatch, match="repeats"):
        mgr.prompt_from_hashes((b"x", b"y", b"x"), 12)
    assert mgr.pool.snapshot() == before
    mgr.check_invariants()


# -- verification mode ----------------------------------------------------------------------------

def _colliding(mgr):
    """Make every block of every chain hash alike: a worst-case hash collision."""
    mgr.hasher._digest = lambda data: b"\x00" * 16
    return mgr


def test_verify_turns_collisions_into_misses():
    unsafe = _colliding(make())
    unsafe.admit("a", [1, 2, 3, 4, 5])
    assert unsafe.admit("b", [9, 9, 9, 9, 9]) == 4     # wrong output waiting to happen
    safe = _colliding(make(verify=True))
    safe.admit("a", [1, 2, 3, 4, 5])
    assert safe.admit("b", [9, 9, 9, 9, 9]) == 0
    assert safe.admit("c", [1, 2, 3, 4, 6]) == 4       # genuine hits still hit
    safe.check_invariants()


# -- duplicates and events ------------------------------------------------------------------------

def test_duplicate_copies_and_removal_events():
    mgr = make(num_blocks=6, record_events=True)
    mgr.admit("a", list(range(8)))
    stored = mgr.drain_events()
    assert [type(e) for e in stored] == [BlockStored, BlockStored]
    assert stored[0].parent_hash is None and stored[1].parent_hash == stored[0].block_hash
    assert stored[1].token_count == B
    mgr.admit("b", list(range(8)))          # hits block 0, recomputes block 1 into a duplicate
    assert mgr.drain_events() == []         # no new hash, no event
    mgr.free("a")                            # a's copy of block 1 becomes evictable
    mgr.admit("c", list(range(100, 116)))   # evicts: the duplicate in b keeps the hash alive
    events = mgr.drain_events()
    assert not any(isinstance(e, BlockRemoved) and e.block_hash == stored[1].block_hash for e in events)
    assert mgr.match(list(range(8)), compute_last_token=False).hit_tokens == 8
    mgr.check_invariants()
    mgr.free("b")
    mgr.free("c")
    mgr.reset_prefix_cache()
    assert isinstance(mgr.drain_events()[-1], AllBlocksCleared)


# -- kernel-facing arrays and stats ---------------------------------------------------------------

def test_slot_mapping_and_block_tables():
    mgr = make()
    mgr.admit("other", [7])
    mgr.admit("a", list(range(6)))
    table = mgr.block_ids("a")
    expect = [table[p // B] * B + p % B for p in range(6)]
    assert mgr.slot_mapping("a").tolist() == expect
    assert mgr.slot_mapping("a", 4, 6).tolist() == expect[4:]
    with pytest.raises(IndexError):
        mgr.slot_mapping("a", 0, 7)
    bt = mgr.block_tables(["a", "other"], pad=-1)
    assert bt.dtype == np.int32 and bt.tolist() == [table, [mgr.block_ids("other")[0], -1]]
    assert mgr.block_table("a").dtype == np.int32


def test_stats_conservation_and_tail_waste_bytes():
    mgr = make(num_blocks=40)
    for i, n in enumerate([17, 32, 63]):
        mgr.admit(i, [i * 1000 + t for t in range(n)])
    s = mgr.stats()
    assert s.active_blocks + s.evictable_blocks + s.free_uncached_blocks == s.capacity
    assert s.block_table_lengths == (5, 8, 16)
    assert s.tail_waste_slots == 3 + 0 + 1
    assert s.tail_waste_bytes(KVSpec(32, 8, 128)) == 4 * 131072
    assert s.as_dict(KVSpec(32, 8, 128))["tail_waste_bytes"] == 4 * 131072


def test_forked_shared_tail_counts_its_waste_once():
    mgr = make()
    mgr.admit("a", [1, 2, 3, 4, 5])
    mgr.fork("a", "b")
    assert mgr.stats().tail_waste_slots == 3


def test_caching_can_be_disabled():
    mgr = make(enable_caching=False)
    mgr.admit("a", list(range(8)))
    mgr.free("a")
    assert mgr.admit("b", list(range(8))) == 0
    assert mgr.stats().cached_hashes == 0 and mgr.stats().evictable_blocks == 0


# -- swap preemption ------------------------------------------------------------------------------

def test_swap_out_and_in_round_trip_through_a_store():
    mgr = make(num_blocks=4, num_host_blocks=4)
    device, host = SlotStore(4, B), SlotStore(4, B)
    tokens = list(range(10))
    mgr.admit("a", tokens)
    device.write(mgr.slot_mapping("a"), tokens)
    copies = mgr.swap_out("a")
    assert len(copies) == 3 and mgr.stats().active_blocks == 0 and mgr.num_free_host_blocks == 1
    for dev, hb in copies:
        host.slots[hb] = device.slots[dev]
    mgr.admit("b", list(range(50, 66)))      # takes every device block: the cache is gone
    device.write(mgr.slot_mapping("b"), list(range(50, 66)))
    assert_unchanged(mgr, lambda: mgr.swap_in("a"), OutOfBlocks)
    mgr.free("b")
    back = mgr.swap_in("a")
    assert mgr.num_free_host_blocks == 4
    for hb, dev in back:
        device.slots[dev] = host.slots[hb]
    assert device.gather(mgr.block_ids("a"), 10).tolist() == tokens
    s = mgr.stats()
    assert (s.swaps_out, s.swaps_in, s.swapped_out_blocks, s.preemptions) == (1, 1, 3, 1)
    mgr.check_invariants()


def test_swap_in_reuses_blocks_still_cached_on_the_device():
    mgr = make(num_blocks=8, num_host_blocks=4)
    mgr.admit("a", list(range(10)))
    mgr.swap_out("a")
    back = mgr.swap_in("a")
    assert len(back) == 1                    # only the partial tail is copied back
    assert mgr.stats().swapped_in_blocks == 1


def test_swap_errors():
    mgr = make(num_blocks=8, num_host_blocks=2)
    mgr.admit("a", list(range(10)))
    assert_unchanged(mgr, lambda: mgr.swap_out("a"), SequenceTooLong)
    mgr.admit("b", [1, 2])
    mgr.preempt("b")
    with pytest.raises(ValueError, match="not swapped out"):
        mgr.swap_in("b")
    mgr.free("a")
    mgr.admit("c", [1])
    mgr.swap_out("c")
    with pytest.raises(ValueError, match="swap_in"):
        mgr.resume("c")
    mgr.free("c")                            # a swapped sequence returns its host blocks
    assert mgr.num_free_host_blocks == 2
    mgr.check_invariants()


def test_decode_step_lets_the_last_sharer_write_in_place():
    mgr = make(num_blocks=3)
    mgr.admit("a", [1, 2, 3, 4, 5])
    mgr.fork("a", "b")                       # shared partial tail, one free block
    slots = mgr.decode_step(["a", "b"], [7, 8])
    assert mgr.stats().cow_copies == 1 and len(set(slots.tolist())) == 2
    mgr.check_invariants()


def test_stats_reads_the_sequences_once_so_a_concurrent_step_cannot_break_a_scrape():
    """A Prometheus scrape calls stats() from the server's thread; a step that admits or frees a
    sequence meanwhile made the iteration over the sequence dict raise mid-scrape."""
    mgr = make()
    mgr.admit("a", list(range(10)))

    class Racing:
        """A sequence whose table, when read, lets a step admit another sequence."""
        preempted = False

        @property
        def table(self):
            if "b" not in mgr:
                mgr.admit("b", list(range(20, 26)))
            return []

    mgr._seqs["racer"] = Racing()
    try:
        stats = mgr.stats()
    finally:
        del mgr._seqs["racer"]
    assert stats.sequences == 2 and "b" in mgr


# -- append_slots refuses a hash the sequence's chain already holds -----------------------------------
def test_append_slots_refuses_a_hash_the_sequence_already_holds():
    """resume / swap_in match a sequence by its own hashes, counting the blocks as distinct: a
    repeated hash held block 0 twice on one reference ('refcount 1 but held by 2 block tables')."""
    mgr = KVCacheManager(num_blocks=8, block_size=4, hash_seed=0, index="dict")
    mgr.admit("a", mgr.prompt_from_hashes([1, 2], 8))
    before = mgr.snapshot()
    with pytest.raises(HashMismatch, match="repeats"):
        mgr.append_slots("a", 5, [1])
    assert mgr.snapshot() == before
    mgr.append_slots("a", 5, [3])
    mgr.preempt("a")
    assert mgr.resume("a") == 1
    mgr.check_invariants()


# -- a PolicyError in an admission with prefix or host hits releases them --------------------------------
class _Armed(LRUPolicy):
    name = "armed"
    armed = False

    def evict(self):
        if self.armed:
            raise RuntimeError("boom")
        return super().evict()

    def evict_many(self, k):
        if self.armed:
            raise RuntimeError("boom")
        return super().evict_many(k)


def test_a_policy_error_after_prefix_hits_releases_them():
    policy = _Armed()
    mgr = KVCacheManager(num_blocks=4, block_size=4, hash_seed=0, policy=policy)
    mgr.admit("a", list(range(16)), compute_last_token=False)
    mgr.free("a")
    policy.armed = True
    with pytest.raises(PolicyError, match="boom"):
        mgr.admit("b", list(range(8)) + [99] * 8, compute_last_token=False)   # 2 hits, 2 to evict
    mgr.check_invariants()
    s = mgr.stats()
    assert s.active_blocks == 0 and s.evictable_blocks + s.free_uncached_blocks == 4
    policy.armed = False
    assert mgr.admit("b", list(range(8)) + [99] * 8, compute_last_token=False) == 8
    mgr.check_invariants()


@pytest.mark.parametrize("inclusive", [False, True])
def test_a_policy_error_after_host_hits_unpins_them(inclusive):
    policy = _Armed()
    mgr = KVCacheManager(num_blocks=4, block_size=4, hash_seed=0, policy=policy, num_host_blocks=8,
                         host_cache=True, host_inclusive=inclusive)
    a, c = list(range(16)), list(range(100, 116))
    mgr.admit("a", a, compute_last_token=False)
    mgr.free("a")
    mgr.admit("c", c, compute_last_token=False)          # evicts a's blocks to the host
    mgr.take_demotions()
    mgr.free("c")
    assert mgr.match(a, compute_last_token=False).lower_hit_blocks == 4
    policy.armed = True
    with pytest.raises(PolicyError, match="boom"):
        mgr.admit("a2", a, compute_last_token=False)       # 4 loads, 4 device blocks to evict
    mgr.check_invariants()
    assert mgr.stats().host_active_blocks == 0
    policy.armed = False
    mgr.admit("a3", c, compute_last_token=False)
    mgr.check_invariants()
