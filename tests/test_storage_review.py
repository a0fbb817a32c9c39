"""Review of KVStore's block moves and BlockCopies: every case against a plain per-block loop."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prefixkv.copies import BlockCopies  # noqa: E402
from prefixkv.kv.storage import KVStore  # noqa: E402
from prefixkv.sizing import KVSpec  # noqa: E402

SPEC = KVSpec(layers=2, kv_heads=1, head_dim=2, dtype="float32")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def filled(num_blocks=8, host_blocks=6, seed=0, spec=SPEC):
    store = KVStore(spec, num_blocks, 2)
    store.allocate_host(host_blocks)
    gen = torch.Generator().manual_seed(seed)
    store.data.copy_(torch.randn(store.data.shape, generator=gen))
    store.host.copy_(torch.randn(store.host.shape, generator=gen))
    return store


def reference(store, kind, pairs):
    """(data, host) after running ``pairs`` one block at a time, in order."""
    data, host = store.data.clone(), store.host.clone()
    for s, d in pairs:
        if kind == "copy_blocks":
            data[:, :, d] = data[:, :, s].clone()
        elif kind in ("demote", "swap_out"):
            host[:, :, d] = data[:, :, s]
        else:
            data[:, :, d] = host[:, :, s]
    return data, host


def unchanged(store):
    data, host = store.data.clone(), store.host.clone()
    return lambda: torch.equal(store.data, data) and torch.equal(store.host, host)


# -- BlockCopies inputs --------------------------------------------------------------------------
def test_block_copies_refuses_float_arrays_like_the_list_form():
    """``BlockCopies([1.7], [2])`` raised but ``BlockCopies(np.array([1.7]), ...)`` truncated to 1."""
    with pytest.raises(TypeError, match="src"):
        BlockCopies(np.array([1.7]), np.array([2]))
    with pytest.raises(TypeError, match="dst"):
        BlockCopies(np.array([1]), np.array([2.0]))
    with pytest.raises(TypeError, match=r"src.*1\.7"):
        BlockCopies([1.7], [2])
    with pytest.raises(TypeError, match="bool"):
        BlockCopies(np.array([True]), np.array([1]))


def test_block_copies_refuses_arrays_that_are_not_one_dimensional():
    """A 2-D array gave len() 1 for 2 pairs and pairs whose items are arrays; a 0-d array an
    IndexError naming nothing."""
    with pytest.raises(ValueError, match=r"src.*\(1, 2\)"):
        BlockCopies(np.array([[1, 2]]), np.array([[3, 4]]))
    with pytest.raises(ValueError, match=r"dst.*\(\)"):
        BlockCopies(np.array([1]), np.array(3))


def test_block_copies_refuses_ids_past_int64():
    with pytest.raises(ValueError, match=str(2**63)):
        BlockCopies(np.array([2**63], np.uint64), np.array([1]))


def test_block_copies_takes_torch_tensors_and_generators_as_their_values():
    """A tensor of several ids raised 'Boolean value of Tensor ... is ambiguous'."""
    assert BlockCopies(torch.tensor([1, 2]), torch.tensor([3, 4])) == [(1, 3), (2, 4)]
    assert BlockCopies(np.array([1, 2], np.int32), (i for i in (3, 4))) == [(1, 3), (2, 4)]
    assert BlockCopies(range(2), [np.int64(5), 6]) == [(0, 5), (1, 6)]


def test_block_copies_does_not_alias_the_callers_arrays():
    """A list is copied; an int64 array was kept as it was, so changing it later changed pairs
    already handed out."""
    src, dst = np.array([1, 2]), np.array([3, 4])
    copies = BlockCopies(src, dst)
    src[0], dst[1] = 7, 0
    assert copies == [(1, 3), (2, 4)]


