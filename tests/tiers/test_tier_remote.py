"""The remote tier (``prefixkv.tiers.remote``) on a real redis-server: prefetch stages verified
blocks in the host tier so that ``admit`` finds them as host hits; write-back packs what the
device computed; bad values, stale blocks, hash prompts and unpinned seeds are refused."""

from __future__ import annotations

import time

import pytest

from redis_fixtures import needs_redis, own_redis_server, redis_server  # noqa: F401 (fixtures)

torch = pytest.importorskip("torch")
pytest.importorskip("redis")

from prefixkv import KVCacheManager, KVSpec  # noqa: E402
from prefixkv.kv.storage import KVStore  # noqa: E402
from prefixkv.tiers.fingerprint import UnpinnedHashSeed  # noqa: E402
from prefixkv.tiers.redis_store import RedisStoreConfig  # noqa: E402
from prefixkv.tiers.remote import RemoteTier  # noqa: E402

SPEC = KVSpec(layers=2, kv_heads=2, head_dim=8, dtype="float16")
B = 4
WEIGHTS = b"weights-digest-0"
TOKENS = list(range(100, 141))          # 10 full blocks + 1 token


def with_redis(test):
    for mark in needs_redis:
        test = mark(test)
    return test


def replica(url, *, blocks=16, host=16, seed=5, weights=WEIGHTS, config=None):
    mgr = KVCacheManager(blocks, B, hash_seed=seed, num_host_blocks=host, host_cache=True)
    kv = KVStore(SPEC, blocks, B)
    kv.allocate_host(host)
    return mgr, kv, RemoteTier.connect(url, mgr, kv, weights=weights, config=config)


def compute(mgr, kv, seq, tokens, value_seed):
    """Admit and 'compute': random KV into the blocks it does not hit (the step's writes)."""
    hit = mgr.admit(seq, tokens)
    kv.transfer(mgr.take_demotions(), mgr.take_loads(), mgr.take_copies())
    g = torch.Generator().manual_seed(value_seed)
    table = mgr.block_ids(seq)
    for block in table[hit // B:]:
        kv.data[:, :, block] = torch.randn(kv.data[:, :, block].shape, generator=g).to(kv.data.dtype)
    return hit


def test_the_manager_records_computed_blocks_and_not_loaded_ones():
    mgr = KVCacheManager(6, B, hash_seed=1, num_host_blocks=8, host_cache=True)
    assert mgr.hash_seed_pinned and mgr.takes_lower_hits
    assert not KVCacheManager(4, B).hash_seed_pinned
    assert mgr.take_published() == []                 # off until a tier asks
    mgr.record_published()
    mgr.admit("a", list(range(18)))                    # 4 full blocks published
    got = mgr.take_published()
    assert [r[2] for r in got] == [0, 1, 2, 3] and mgr.take_published() == []
    block, hashes, i, tokens, extra = got[2]
    assert mgr.pool.block_hash[block] == hashes[i] and list(tokens) == list(range(18))
    mgr.free("a")
    mgr.admit("b", list(range(1000, 1018)))            # evicts (demotes) a's blocks to the host tier
    mgr.take_demotions()
    mgr.take_published()
    mgr.free("b")
    mgr.admit("c", list(range(18)))                    # a's prefix: loaded from the host, not recorded
    assert mgr.take_loads() and mgr.take_published() == []
    mgr.check_invariants()


@with_redis
def test_a_replica_loads_what_another_computed_bit_for_bit(redis_server):  # noqa: F811
    redis_server.command("FLUSHALL")
    mgr_a, kv_a, tier_a = replica(redis_server.url)
    mgr_b, kv_b, tier_b = replica(redis_server.url)
    try:
        assert compute(mgr_a, kv_a, "a", TOKENS, 0) == 0
        assert tier_a.write_back() == 10 and tier_a.flush()
        prompt = mgr_b.prompt(TOKENS)
        assert mgr_b.match(prompt).hit_blocks == 0
        snapshot = mgr_b.pool.snapshot()
        assert tier_b.prefetch(prompt) == 10
        assert mgr_b.pool.snapshot() == snapshot      # the device pool is untouched by a prefetch
        m = mgr_b.match(prompt)
        assert m.hit_blocks == 10 and m.lower_hit_blocks == 10
        assert mgr_b.admit("b", prompt) == 40
        loads = mgr_b.take_loads()
        kv_b.load(loads)
        for i, (a_block, b_block) in enumerate(zip(mgr_a.block_ids("a")[:10], mgr_b.block_ids("b")[:10])):
            assert torch.equal(kv_a.data[:, :, a_block], kv_b.data[:, :, b_block]), i
        assert tier_b.write_back() == 0               # loaded blocks are not written back
        assert tier_b.prefetch(mgr_b.prompt(TOKENS)) == 0   # all on the device now: no round trip
        s = tier_b.stats()
        assert s["staged_blocks"] == 10 and s["store_rejected"] == {} and s["prefetch_probes"] == 1
        mgr_a.check_invariants()
        mgr_b.check_invariants()
    finally:
        tier_a.close()
        tier_b.close()


@with_redis
def test_a_corrupted_value_is_never_staged(redis_server):  # noqa: F811
    import redis

    redis_server.command("FLUSHALL")
    mgr_a, kv_a, tier_a = replica(redis_server.url)
    mgr_b, kv_b, tier_b = replica(redis_server.url)
    client = redis.Redis(port=redis_server.port)
    try:
        compute(mgr_a, kv_a, "a", TOKENS, 1)
        tier_a.write_back()
        assert tier_a.flush()
        prompt = mgr_b.prompt(TOKENS)
        key = tier_b.store.keys.key(prompt.block_hashes(), 6)
        value = bytearray(client.get(key))
        value[-5] ^= 0xFF                                  # one payload byte
        client.set(key, bytes(value))
        assert tier_b.prefetch(prompt) == 6                # blocks 0-5; block 6 refused, the rest not read
        assert tier_b.stats()["store_rejected"] == {"payload_checksum": 1}
        assert mgr_b.match(prompt).hit_blocks == 6
        assert tier_b.flush() and client.exists(key) == 0  # the bad value was deleted
        # another replica's model (weights digest) never reads these values
        mgr_c, kv_c, tier_c = replica(redis_server.url, weights=b"weights-digest-1")
        assert tier_c.prefetch(mgr_c.prompt(TOKENS)) == 0
        tier_c.close()
    finally:
        client.close()
        tier_a.close()
        tier_b.close()


@with_redis
def test_write_back_skips_blocks_no_longer_cached_and_hash_prompts(redis_server):  # noqa: F811
    redis_server.command("FLUSHALL")
    mgr, kv, tier = replica(redis_server.url)
    try:
        compute(mgr, kv, "a", TOKENS, 2)
        mgr.free("a")
        mgr.reset_prefix_cache()                          # every block forgets its hash
        assert tier.write_back() == 0 and tier.stats()["stale_blocks"] == 10
        hashed = mgr.prompt_from_hashes([i.to_bytes(16, "little") for i in range(1, 11)], 40)
        assert tier.prefetch(hashed) == 0                 # precomputed hashes: not a token prompt
        mgr.admit("h", hashed)
        assert tier.write_back() == 0
        # KV not known written (the HF cache's pending blocks) waits for a later write-back
        mgr.free("h")
        mgr.unwritten = pending = set()
        compute(mgr, kv, "b", TOKENS, 3)
        pending.update(mgr.block_ids("b"))
        assert tier.write_back() == 0 and tier.stats()["held"] == 10
        pending.clear()
        assert tier.write_back() == 10 and tier.flush()
        assert tier.count_leading(mgr.prompt(TOKENS).block_hashes()) == 10
    finally:
        tier.close()


def test_a_remote_tier_needs_a_pinned_seed_and_a_host_cache():
    url = "redis://127.0.0.1:1/0"                          # never contacted: refused before
    mgr = KVCacheManager(8, B, num_host_blocks=8, host_cache=True)
    kv = KVStore(SPEC, 8, B)
    kv.allocate_host(8)
    with pytest.raises(UnpinnedHashSeed, match="pinned hash seed"):
        RemoteTier.connect(url, mgr, kv, weights=WEIGHTS)
    with pytest.raises(ValueError, match="host_cache=True"):
        RemoteTier.connect(url, KVCacheManager(8, B, hash_seed=0), kv, weights=WEIGHTS)
    with pytest.raises(ValueError, match="verify"):
        RemoteTier.connect(url, KVCacheManager(8, B, hash_seed=0, verify=True, num_host_blocks=8, host_cache=True),
                           kv, weights=WEIGHTS)
    with pytest.raises(ValueError, match="host pool"):
        RemoteTier.connect(url, KVCacheManager(8, B, hash_seed=0, num_host_blocks=4, host_cache=True), kv,
                           weights=WEIGHTS)


@with_redis
def test_hung_and_killed_server_tier_calls_stay_bounded(own_redis_server):  # noqa: F811
    server = own_redis_server
    bound = 5 * 0.25
    mgr_a, kv_a, tier_a = replica(server.url, config=RedisStoreConfig(probe_interval_s=0.5))
    mgr_b, kv_b, tier_b = replica(server.url, config=RedisStoreConfig(probe_interval_s=0.5))
    try:
        compute(mgr_a, kv_a, "a", TOKENS, 4)
        tier_a.write_back()
        assert tier_a.flush()
        mgr_a.free("a")
        server.pause()
        try:
            t0 = time.perf_counter()
            assert tier_b.prefetch(mgr_b.prompt(TOKENS)) == 0
            compute(mgr_b, kv_b, "b", TOKENS, 5)
            tier_b.write_back()
            assert time.perf_counter() - t0 < bound
            assert tier_b.stats()["slowest_prefetch_s"] < bound
        finally:
            server.resume()
        server.stop()
        mgr_b.free("b")
        t0 = time.perf_counter()
        tier_b.prefetch(mgr_b.prompt(list(range(500, 541))))
        compute(mgr_b, kv_b, "c", list(range(500, 541)), 6)
        tier_b.write_back()
        assert time.perf_counter() - t0 < bound
        mgr_b.check_invariants()
    finally:
        tier_a.close(flush_timeout_s=0.5)
        tier_b.close(flush_timeout_s=0.5)


@with_redis
def test_unix_socket_and_cluster_urls(tmp_path):
    """The same write-back / prefetch round through ``unix://`` and ``redis+cluster://`` URLs."""
    from redis_fixtures import RedisServer, cluster_url, running_cluster

    sock = tmp_path / "redis.sock"
    server = RedisServer(tmp_path / "unix", extra=("--unixsocket", str(sock), "--unixsocketperm", "700")).start()
    try:
        round_trip(f"unix://{sock}")
    finally:
        server.stop()
    with running_cluster(tmp_path) as nodes:
        round_trip(cluster_url(nodes), tokens=list(range(2000, 2000 + 40 * B + 1)), blocks=48, host=48)


def round_trip(url, tokens=TOKENS, blocks=16, host=16):
    mgr_a, kv_a, tier_a = replica(url, blocks=blocks, host=host)
    mgr_b, kv_b, tier_b = replica(url, blocks=blocks, host=host)
    try:
        compute(mgr_a, kv_a, "a", tokens, 7)
        n = (len(tokens) - 1) // B
        assert tier_a.write_back() == len(tokens) // B and tier_a.flush()
        prompt = mgr_b.prompt(tokens)
        assert tier_b.prefetch(prompt) == n
        assert mgr_b.admit("b", prompt) == n * B
        kv_b.load(mgr_b.take_loads())
        for a_block, b_block in zip(mgr_a.block_ids("a")[:n], mgr_b.block_ids("b")[:n]):
            assert torch.equal(kv_a.data[:, :, a_block], kv_b.data[:, :, b_block])
        assert tier_b.stats()["store_rejected"] == {}
    finally:
        tier_a.close()
        tier_b.close()


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
