"""The slot store (``prefixkv.sim.slotstore``, the fake KV store the property tests check contents
with) refuses what a real store could not do, instead of wrapping or broadcasting: negative slots,
count mismatches, blocks or lengths past the table, shapes that are not counts; a batch of copies
runs in order and copies nothing when one pair lies outside the store."""

from __future__ import annotations

import numpy as np
import pytest

from prefixkv.errors import InvalidArgument


# -- the slot store refuses what a real store could not do, instead of wrapping or broadcasting ----

def test_slot_store_refuses_a_negative_slot():
    from prefixkv.sim.slotstore import UNWRITTEN, SlotStore

    store = SlotStore(2, 4)
    with pytest.raises(IndexError):
        store.write([-1], [5])            # numpy wrapped it to the pool's last slot
    assert (store.slots == UNWRITTEN).all()


def test_slot_store_refuses_a_count_mismatch():
    from prefixkv.sim.slotstore import UNWRITTEN, SlotStore

    store = SlotStore(2, 4)
    with pytest.raises(ValueError, match="3 slots.*1 value"):
        store.write([0, 1, 2], [9])       # numpy broadcast the one value into three slots
    assert (store.slots == UNWRITTEN).all()


def test_slot_store_gather_refuses_a_negative_block_and_a_length_past_the_table():
    from prefixkv.sim.slotstore import SlotStore

    store = SlotStore(2, 4)
    with pytest.raises(IndexError):
        store.gather([-1], 4)             # read the pool's last block
    with pytest.raises(ValueError, match="20 tokens.*8 slots"):
        store.gather([0, 1], 20)          # returned 8 values, silently short
    with pytest.raises(IndexError):
        store.copy_blocks([(0, -1)])


# -- copies: all or nothing, in order; shapes that are counts ---------------------------------------

def test_slot_store_copies_nothing_when_one_copy_of_the_batch_is_outside_the_store():
    # The copies ran one by one: a bad pair after good ones left the good ones applied.
    from prefixkv.sim.slotstore import SlotStore

    store = SlotStore(4, 2)
    store.write(np.arange(8), range(8))
    before = store.slots.copy()
    with pytest.raises(IndexError, match="block 9"):
        store.copy_blocks([(0, 1), (2, 9)])
    assert np.array_equal(store.slots, before)


def test_slot_store_copies_run_in_order():
    from prefixkv.sim.slotstore import SlotStore

    store = SlotStore(3, 2)
    store.write(np.arange(6), range(6))
    store.copy_blocks([(0, 1), (1, 2)])        # block 2 gets block 0's tokens, through block 1
    assert store.slots.tolist() == [[0, 1], [0, 1], [0, 1]]


@pytest.mark.parametrize("num_blocks, block_size, argument", [
    (-1, 4, "num_blocks"), (4, 0, "block_size"), (2.5, 4, "num_blocks"), (4, True, "block_size"),
    (4, "4", "block_size")])
def test_slot_store_refuses_a_shape_that_is_not_a_count(num_blocks, block_size, argument):
    from prefixkv.sim.slotstore import SlotStore

    with pytest.raises(InvalidArgument) as info:
        SlotStore(num_blocks, block_size)
    assert info.value.argument == argument
