"""The design notes' small-pool lab (``prefixkv.sim.lab``): a bad block size is refused naming it."""

from __future__ import annotations

import pytest

from prefixkv.errors import InvalidArgument


# -- the lab -------------------------------------------------------------------------------------

@pytest.mark.parametrize("block_size", [16.0, "16", None, 1, True])
def test_lab_names_a_bad_block_size(block_size):
    # 16.0 was refused as "num_blocks: must be an int, got float 1.0", a name the caller never gave.
    from prefixkv.sim.lab import run_lab

    with pytest.raises(InvalidArgument) as info:
        run_lab(block_size, [3])
    assert info.value.argument == "block_size"
