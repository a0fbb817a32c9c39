"""``prefixkv lab``: the design notes' small-pool exercise as a command.

First the tail-waste table for a set of lengths, then four checks on a small
pool, each printed as PASS or FAIL with what was observed.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral

from ..errors import InvalidArgument, InvariantViolation, OutOfBlocks
from ..manager import KVCacheManager
from ..sizing import tail_waste
from .slotstore import SlotStore


@dataclass
class Check:
    name: str
    passed: bool
    detail: str


def _write(mgr: KVCacheManager, store: SlotStore, seq_id, start: int, tokens: list[int]) -> None:
    store.copy_blocks(mgr.take_copies())
    store.write(mgr.slot_mapping(seq_id, start, start + len(tokens)), tokens)


def check_cow_isolation(block_size: int) -> Check:
    """Two sequences share a partly filled tail; each then writes its own token."""
    mgr = KVCacheManager(num_blocks=8, block_size=block_size, hash_seed=0)
    store = SlotStore(8, block_size)
    prompt = list(range(100, 100 + 2 * block_size - 1))   # ends mid-block
    mgr.admit("A", prompt)
    _write(mgr, store, "A", 0, prompt)
    mgr.fork("A", "B")
    shared_tail = mgr.block_ids("A")[-1]
    mgr.append("A", [1001])
    _write(mgr, store, "A", len(prompt), [1001])
    mgr.append("B", [2002])
    _write(mgr, store, "B", len(prompt), [2002])
    seen_a = store.gather(mgr.block_ids("A"), len(prompt) + 1).tolist()
    seen_b = store.gather(mgr.block_ids("B"), len(prompt) + 1).tolist()
    ok = seen_a == prompt + [1001] and seen_b == prompt + [2002]
    ok = ok and mgr.block_ids("B")[-1] == shared_tail and mgr.block_ids("A")[-1] != shared_tail
    mgr.check_invariants()
    return Check("writes after sharing do not pollute each other (COW)", ok,
                 f"A ends {seen_a[-2:]}, B ends {seen_b[-2:]}, A copied tail {shared_tail} -> "
                 f"{mgr.block_ids('A')[-1]}, B kept it")


def check_last_reference_returns(block_size: int) -> Check:
    """The seed's exercise: A copies the shared tail, then A and B finish."""
    mgr = KVCacheManager(num_blocks=8, block_size=block_size, hash_seed=0)
    mgr.admit("A", list(range(block_size - 1)))      # one partly filled block: P2
    mgr.fork("A", "B")
    start_free = mgr.num_free_blocks
    shared = mgr.block_ids("A")[-1]
    mgr.append("A", [7])                               # copy on write: P3
    fresh = mgr.block_ids("A")[-1]
    ref = mgr.pool.ref_count
    after_cow = (mgr.num_free_blocks, ref[shared], ref[fresh])
    mgr.free("A")
    after_a = (mgr.num_free_blocks, ref[shared])
    mgr.free("B")
    end_free = mgr.num_free_blocks
    ok = (after_cow == (start_free - 1, 1, 1) and after_a == (start_free, 1) and end_free == start_free + 1)
    mgr.check_invariants()
    return Check("the last reference returns a block", ok,
                 f"free {start_free} -> COW {after_cow[0]} (P{shared}={after_cow[1]}, P{fresh}={after_cow[2]})"
                 f" -> A done {after_a[0]} -> B done {end_free}")


def check_failed_cow_keeps_mapping(block_size: int) -> Check:
    """On a full pool a copy-on-write cannot allocate: the old mapping must survive."""
    mgr = KVCacheManager(num_blocks=2, block_size=block_size, hash_seed=0)
    mgr.admit("A", list(range(block_size + 1)))        # both blocks, tail partly filled
    mgr.fork("A", "B")
    before = mgr.snapshot()
    try:
        mgr.append("A", [9])
    except OutOfBlocks as exc:
        unchanged = mgr.snapshot() == before
        mgr.check_invariants()
        return Check("a COW that cannot allocate leaves the old mapping intact", unchanged,
                     f"refused ({exc}); tables, refcounts and queues unchanged: {unchanged}")
    return Check("a COW that cannot allocate leaves the old mapping intact", False,
                 "the append succeeded on a full pool")


def check_leak_detected(block_size: int) -> Check:
    """A reference that is never released must be caught by the invariant check."""
    mgr = KVCacheManager(num_blocks=8, block_size=block_size, hash_seed=0)
    mgr.admit("A", list(range(2 * block_size)))
    leaked = mgr.block_ids("A")
    mgr.pool.share(leaked)      # a caller took references and will never release them
    mgr.free("A")
    try:
        mgr.check_invariants()
    except InvariantViolation as exc:
        return Check("a leaked release is detected by the invariant check", True, str(exc))
    return Check("a leaked release is detected by the invariant check", False, "no violation reported")


def run_lab(block_size: int, lengths: list[int]) -> tuple[dict, list[Check]]:
    if isinstance(block_size, bool) or not isinstance(block_size, Integral) or block_size < 2:
        raise InvalidArgument("block_size", f"the lab needs an integer block_size >= 2 (a partly filled "
                                            f"tail must exist), got {block_size!r}")
    if not isinstance(lengths, (str, bytes)) and hasattr(lengths, "__iter__"):
        lengths = list(lengths)    # (a generator: read once, used twice)
    table = tail_waste(lengths, block_size)     # checks every length before any is admitted
    mgr = KVCacheManager(num_blocks=table["blocks"] or 1, block_size=block_size, hash_seed=0)
    for i, n in enumerate(lengths):    # distinct tokens: nothing is shared
        mgr.admit(i, [i * 100_000 + t for t in range(n)])
    measured = mgr.stats()
    agrees = measured.active_blocks == table["blocks"] and measured.tail_waste_slots == table["tail_waste"]
    checks = [Check("the manager's own block and tail-waste counts agree with the table", agrees,
                    f"manager: {measured.active_blocks} blocks, {measured.tail_waste_slots} empty tail slots")]
    checks += [check(block_size) for check in (check_cow_isolation, check_last_reference_returns,
                                               check_failed_cow_keeps_mapping, check_leak_detected)]
    return table, checks
