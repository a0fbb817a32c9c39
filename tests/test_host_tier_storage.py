"""The host tier's byte moves (KVStore.demote / load / transfer) and its sizing (plan --host-pool)."""

from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from prefixkv.cli import main  # noqa: E402
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


def test_plan_host_pool_gives_blocks_and_the_time_to_move_one(capsys):
    assert main(["plan", "--host-pool", "64GiB", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["host_blocks"] == 64 * 2**30 // d["bytes_per_block"] == 32768
    assert d["block_transfer_s"] == pytest.approx(2 * 2**20 / (25 * 2**30))    # 2 MiB over 25 GiB/s
    assert d["block_recompute_s"] == pytest.approx(16 / 20_000)
    assert main(["plan", "--host-pool", "64GiB"]) == 0
    assert "32,768 blocks" in capsys.readouterr().out
