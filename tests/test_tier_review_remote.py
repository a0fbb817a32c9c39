"""Review defects of the remote tier (``prefixkv.tiers.remote``), each on a real redis-server."""

from __future__ import annotations

import pytest

from redis_fixtures import needs_redis, redis_server  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("redis")

from prefixkv import KVCacheManager, KVSpec  # noqa: E402
from prefixkv.kv.storage import KVStore  # noqa: E402
from prefixkv.tiers.remote import RemoteTier  # noqa: E402

SPEC = KVSpec(layers=2, kv_heads=2, head_dim=8, dtype="float16")
B = 4
WEIGHTS = b"weights-digest-0"


def with_redis(test):
    for mark in needs_redis:
        test = mark(test)
    return test


def replica(url, *, blocks=16, host=16, seed=5):
    mgr = KVCacheManager(blocks, B, hash_seed=seed, num_host_blocks=host, host_cache=True)
    kv = KVStore(SPEC, blocks, B)
    kv.allocate_host(host)
    return mgr, kv, RemoteTier.connect(url, mgr, kv, weights=WEIGHTS)


def write_kv(mgr, kv, seq, hit, value_seed):
    g = torch.Generator().manual_seed(value_seed)
    for block in mgr.block_ids(seq)[hit // B:]:
        kv.data[:, :, block] = torch.randn(kv.data[:, :, block].shape, generator=g).to(kv.data.dtype)


@with_redis
def test_prefetch_between_an_admission_and_its_transfers_never_stages_into_a_pending_demotion(redis_server):  # noqa: F811
    """prefetch(p1); admit(p1); prefetch(p2); admit(p2); transfer(...) is the documented order of
    calls (prefetch before its admission, transfers before the writes). A prefetch that takes
    host blocks a pending demotion will still copy into must not publish remote bytes there:
    the demotion would overwrite them and the host tier would serve another block's KV."""
    redis_server.command("FLUSHALL")
    remote_tokens = list(range(500, 513))              # 3 full blocks + 1 token
    mgr_w, kv_w, tier_w = replica(redis_server.url)
    mgr, kv, tier = replica(redis_server.url, blocks=4, host=4)
    try:
        hit = mgr_w.admit("w", remote_tokens)
        kv_w.transfer(mgr_w.take_demotions(), mgr_w.take_loads(), mgr_w.take_copies())
        write_kv(mgr_w, kv_w, "w", hit, 7)
        assert tier_w.write_back() == 3 and tier_w.flush()

        hit = mgr.admit("a", list(range(16)))            # fills the device pool
        kv.transfer(mgr.take_demotions(), mgr.take_loads(), mgr.take_copies())
        write_kv(mgr, kv, "a", hit, 1)
        mgr.free("a")
        hit = mgr.admit("b", list(range(100, 116)))      # evicts a's blocks: demoted, copies pending
        assert sum(map(len, mgr._demotions)) == 4     # pairs pending, in batches
        staged = tier.prefetch(mgr.prompt(remote_tokens))
        kv.transfer(mgr.take_demotions(), mgr.take_loads(), mgr.take_copies())
        write_kv(mgr, kv, "b", hit, 2)
        mgr.free("b")

        prompt = mgr.prompt(remote_tokens)
        hit = mgr.admit("c", prompt)
        kv.transfer(mgr.take_demotions(), mgr.take_loads(), mgr.take_copies())
        assert hit == staged * B
        for i in range(hit // B):
            assert torch.equal(kv.data[:, :, mgr.block_ids("c")[i]], kv_w.data[:, :, mgr_w.block_ids("w")[i]]), i
        mgr.check_invariants()
    finally:
        tier.close()
        tier_w.close()
