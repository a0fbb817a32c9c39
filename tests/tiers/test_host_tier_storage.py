"""The host tier's byte moves (KVStore.demote / load / transfer) and its sizing (plan --host-pool)."""

from __future__ import annotations

import json
import random

import pytest

torch = pytest.importorskip("torch")

from prefixkv.cli import main  # noqa: E402
from prefixkv.kv import storage  # noqa: E402
from prefixkv.kv.storage import KVStore  # noqa: E402
from prefixkv.sizing import KVSpec  # noqa: E402

SPEC = KVSpec(layers=2, kv_heads=2, head_dim=4, dtype="float32")


def filled(num_blocks=8, host_blocks=6):
    store = KVStore(SPEC, num_blocks, 4)
    store.allocate_host(host_blocks)
    store.data.copy_(torch.arange(store.data.numel(), dtype=torch.float32).view_as(store.data))
    return store


def block(t, b):
    return t[:, :, b].clone()


def test_demote_then_load_round_trips_every_layer_k_and_v():
    store = filled()
    before = {b: block(store.data, b) for b in (1, 2, 5)}
    assert store.demote([(1, 3), (2, 4), (5, 0)]) == 3
    store.data.zero_()
    assert store.load([(3, 7), (4, 6), (0, 0)]) == 3
    for src, dst in ((1, 7), (2, 6), (5, 0)):
        assert torch.equal(block(store.data, dst), before[src])


def test_consecutive_pairs_are_copied_as_runs_with_the_same_result():
    store = filled(num_blocks=16, host_blocks=16)
    before = store.data.clone()
    store.demote([(3, 8), (4, 9), (5, 10), (11, 2), (0, 3)])
    for src, dst in ((3, 8), (4, 9), (5, 10), (11, 2), (0, 3)):
        assert torch.equal(store.host[:, :, dst], before[:, :, src])


def test_transfer_runs_demotions_before_loads_that_reuse_the_device_block():
    store = filled()
    evicted = block(store.data, 2)
    store.host[:, :, 5] = 42.0
    # block 2 is demoted to host 1, then reused for a load from host 5, then copied (COW) to 3
    store.transfer([(2, 1)], [(5, 2)], [(2, 3)])
    assert torch.equal(store.host[:, :, 1], evicted)
    assert bool((store.data[:, :, 2] == 42.0).all()) and bool((store.data[:, :, 3] == 42.0).all())


def test_out_of_range_blocks_are_refused_before_any_copy():
    store = filled()
    snapshot = store.host.clone()
    with pytest.raises(ValueError, match="demotion host block out of range"):
        store.demote([(0, 0), (1, 99)])
    assert torch.equal(store.host, snapshot)


# 32 KiB blocks at block size 16: 160 blocks are 5 MiB, pools big enough to ask for huge pages
BIG = KVSpec(layers=2, kv_heads=2, head_dim=64, dtype="float32")


def random_pairs(rng, num_src, num_dst):
    """Shuffled (src, dst) pairs with runs (s + i -> d + i), runs that overlap one another,
    repeated sources and repeated destinations (the last write wins)."""
    pairs = []
    for _ in range(rng.randrange(0, 12)):
        length = rng.randrange(1, 6)
        s, d = rng.randrange(num_src - length + 1), rng.randrange(num_dst - length + 1)
        pairs += [(s + i, d + i) for i in range(length)]
    pairs += [(rng.randrange(num_src), rng.randrange(num_dst)) for _ in range(rng.randrange(0, 20))]
    if pairs and rng.random() < 0.5:
        pairs += rng.sample(pairs, rng.randrange(1, len(pairs) + 1))   # repeats
    rng.shuffle(pairs)
    return pairs


def one_by_one(dst, src, pairs):
    for s, d in pairs:
        dst[:, :, d] = src[:, :, s]


@pytest.mark.parametrize("spec, blocks, host_blocks, block_size", [(SPEC, 16, 11, 4), (BIG, 160, 136, 16)])
def test_demote_and_load_equal_the_pairs_run_one_by_one(spec, blocks, host_blocks, block_size):
    """Random pair sets, against a reference that runs every pair in order (the run merging, the
    source ordering and the last-write-wins resolution must not change a byte)."""
    rng = random.Random(13)
    gen = torch.Generator().manual_seed(13)
    store = KVStore(spec, blocks, block_size)
    store.allocate_host(host_blocks)
    for _ in range(25):
        store.data.copy_(torch.randn(store.data.shape, generator=gen))
        store.host.copy_(torch.randn(store.host.shape, generator=gen))
        demotions = random_pairs(rng, blocks, host_blocks)
        expect = store.host.clone()
        one_by_one(expect, store.data, demotions)
        assert store.demote(demotions) == len({d for _, d in demotions})
        assert torch.equal(store.host, expect), demotions
        loads = random_pairs(rng, host_blocks, blocks)
        expect = store.data.clone()
        one_by_one(expect, store.host, loads)
        assert store.load(loads) == len({d for _, d in loads})
        assert torch.equal(store.data, expect), loads


@pytest.mark.parametrize("huge_pages", [True, False])
def test_large_cpu_pools_are_plain_zeroed_contiguous_tensors(monkeypatch, huge_pages):
    """Pools of 4 MiB and more ask for transparent huge pages (2 MiB-aligned views of a larger
    allocation); with or without them they are zeroed, contiguous, unpinned, normal tensors."""
    if not huge_pages:
        monkeypatch.setattr(storage, "_madvise", None)
    with torch.inference_mode():
        store = KVStore(BIG, 160, 16)
        store.allocate_host(130)
    for pool, blocks in ((store.data, 160), (store.host, 130)):
        assert pool.shape == (2, 2, blocks, 16, 2, 64) and pool.dtype == torch.float32
        assert pool.is_contiguous() and not pool.is_pinned() and not pool.is_inference()
        assert not pool.any()
        if huge_pages and storage._madvise is not None:
            assert pool.data_ptr() % (2 << 20) == 0
    store.data.copy_(torch.randn(store.data.shape))
    before = store.data.clone()
    assert store.demote([(159, 129), (0, 0)]) == 2
    store.data.zero_()
    assert store.load([(129, 3), (0, 4)]) == 2
    assert torch.equal(store.data[:, :, 3], before[:, :, 159]) and torch.equal(store.data[:, :, 4], before[:, :, 0])
    assert store.bytes == 160 * BIG.bytes_per_block(16) and store.host_bytes == 130 * BIG.bytes_per_block(16)


def test_plan_host_pool_gives_blocks_and_the_time_to_move_one(capsys):
    assert main(["plan", "--host-pool", "64GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["host_blocks"] == 64 * 2**30 // d["bytes_per_block"] == 32768
    assert d["block_transfer_s"] == pytest.approx(2 * 2**20 / (25 * 2**30))    # 2 MiB over 25 GiB/s
    assert d["block_recompute_s"] == pytest.approx(16 / 20_000)
    assert main(["plan", "--host-pool", "64GiB"]) == 0
    assert "32,768 blocks" in capsys.readouterr().out
