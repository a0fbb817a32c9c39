"""The Redis block store and the remote tier refuse bad arguments with InvalidArgument naming the
argument, before anything is sent, queued, counted or built (a store, its thread); the remote
tier's stats and repr mask the URL's password. On a real redis-server on loopback."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from redis_fixtures import Blocks, needs_redis, redis_server, server  # noqa: F401 (fixtures)

pytestmark = needs_redis
redis = pytest.importorskip("redis")

from prefixkv.errors import InvalidArgument  # noqa: E402
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_store import RedisBlockStore, RedisStoreConfig  # noqa: E402

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)


def stored(store, blocks):
    n = store.put(blocks.chain, 0, blocks.payloads, blocks.contents)
    assert store.flush()
    return n


INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("change, argument", [
    ({"probe_mode": "scan"}, "probe_mode"), ({"prefix": "a b"}, "prefix"), ({"prefix": 5}, "prefix"),
    ({"batch_bytes": 0}, "batch_bytes"), ({"ttl_s": -1}, "ttl_s"),
    # inf timeouts made every socket wait unbounded; an inf TTL crashed the constructor (OverflowError)
    ({"socket_timeout_s": INF}, "socket_timeout_s"), ({"connect_timeout_s": NAN}, "connect_timeout_s"),
    ({"probe_interval_s": INF}, "probe_interval_s"), ({"ttl_s": INF}, "ttl_s"), ({"ttl_s": "60"}, "ttl_s"),
    # a fractional count slipped through int() and broke the key groups (chain[2.5]) or the waves
    ({"max_group_blocks": 2.5}, "max_group_blocks"), ({"first_probe_groups": 1.5}, "first_probe_groups"),
    ({"queue_blocks": True}, "queue_blocks"), ({"queue_bytes": "1"}, "queue_bytes"),
])
def test_bad_store_config_is_refused_naming_the_field(change, argument):
    with pytest.raises(InvalidArgument) as info:
        RedisStoreConfig(**change)
    assert info.value.argument == argument


def test_key_space_refusals_name_the_argument():
    from prefixkv.tiers.redis_keys import KeySpace, group_blocks

    for call, argument in ((lambda: KeySpace(FP, prefix=""), "prefix"),
                           (lambda: KeySpace.pattern("x y"), "prefix"),
                           (lambda: KeySpace.pattern(fingerprint_hex="zz"), "fingerprint_hex"),
                           (lambda: group_blocks(0), "value_bytes"), (lambda: group_blocks(10, 0), "max_blocks"),
                           (lambda: KeySpace(FP).keys([1, 2], 0, 2), "chain")):
        with pytest.raises(InvalidArgument) as info:
            call()
        assert info.value.argument == argument


def test_store_call_refusals_name_the_argument_and_change_nothing(server):  # noqa: F811
    """A chain with a non-bytes hash was found only while building keys, after the call had counted
    itself (and, in a long probe, after earlier waves were sent); now every refusal comes first."""
    blocks = Blocks(FP, 4, seed=7)
    with RedisBlockStore(server.url, FP) as store:
        bad_chain = [*blocks.chain[:3], 3]
        before = store.stats()
        for call, argument in (
                (lambda: store.probe(blocks.chain, -1), "start"), (lambda: store.probe(bad_chain), "chain"),
                (lambda: store.probe(blocks.chain, "0"), "start"),
                (lambda: store.fetch(blocks.chain, -2, 3), "start"), (lambda: store.fetch(bad_chain, 0, 4), "chain"),
                (lambda: store.fetch(blocks.chain, 0, 4, blocks.contents[:2]), "contents"),
                (lambda: store.put(blocks.chain, 2, blocks.payloads), "start"),
                (lambda: store.put(blocks.chain, 0, [b"short"] * 4), "payloads"),
                (lambda: store.put(bad_chain, 3, blocks.payloads[3:]), "chain"),
                (lambda: store.put(bad_chain, 0, blocks.payloads[:3], blocks.contents[:2]), "contents"),
                (lambda: store.flush(NAN), "timeout_s"), (lambda: store.clear("zz"), "fingerprint_hex")):
            with pytest.raises(InvalidArgument) as info:
                call()
            assert info.value.argument == argument
        assert store.stats() == before
        with pytest.raises(InvalidArgument) as info:
            store.close(flush_timeout_s=NAN)
        assert info.value.argument == "flush_timeout_s" and not store.closed
        assert store.probe(blocks.chain) == 0


def test_remote_tier_refusals_name_the_argument_before_a_store_is_built(server):  # noqa: F811
    """A negative max_held was taken (each write-back then 'dropped' more held blocks than it held),
    and every refusal of the tier's own options came after connect() had built the store and
    started its thread."""
    pytest.importorskip("torch")
    from prefixkv import KVCacheManager, KVSpec
    from prefixkv.kv.storage import KVStore
    from prefixkv.tiers.remote import RemoteTier

    kv = KVStore(KVSpec(layers=2, kv_heads=2, head_dim=8, dtype="float16"), 8, 4)
    kv.allocate_host(8)
    mgr = KVCacheManager(8, 4, hash_seed=5, num_host_blocks=8, host_cache=True)
    before = {t.name for t in threading.enumerate()}
    for kwargs, argument in (({"max_held": -1}, "max_held"), ({"max_prefetch_blocks": 0}, "max_prefetch_blocks"),
                             ({"staging_blocks": 2.5}, "staging_blocks")):
        with pytest.raises(InvalidArgument) as info:
            RemoteTier.connect(server.url, mgr, kv, weights=b"weights-digest-0", **kwargs)
        assert info.value.argument == argument
    with pytest.raises(InvalidArgument) as info:
        RemoteTier.connect(server.url, KVCacheManager(8, 4, hash_seed=5), kv, weights=b"weights-digest-0")
    assert info.value.argument == "manager"
    assert {t.name for t in threading.enumerate()} - before == set()
    assert not mgr.take_published() and server.command("DBSIZE") == b":0\r\n"


@pytest.mark.parametrize("bad", [5, [1, 2], "text"])
def test_put_refuses_contents_that_are_not_bytes(server, bad):  # noqa: F811
    """bytes(5) stored five zero bytes as a block's content (and a list other bytes): every later
    fetch that checks contents then rejected and deleted the block."""
    blocks = Blocks(FP, 4, seed=7)
    with RedisBlockStore(server.url, FP) as store:
        before = store.stats()
        with pytest.raises(InvalidArgument) as info:
            store.put(blocks.chain, 0, blocks.payloads, [*blocks.contents[:3], bad])
        assert info.value.argument == "contents" and store.stats() == before
        assert stored(store, blocks) == 4


def test_a_remote_tiers_stats_and_repr_mask_the_urls_password(server):  # noqa: F811
    pytest.importorskip("torch")
    from prefixkv import KVCacheManager, KVSpec
    from prefixkv.kv.storage import KVStore
    from prefixkv.tiers.remote import RemoteTier

    kv = KVStore(KVSpec(layers=2, kv_heads=2, head_dim=8, dtype="float16"), 8, 4)
    kv.allocate_host(8)
    mgr = KVCacheManager(8, 4, hash_seed=5, num_host_blocks=8, host_cache=True)
    url = server.url.replace("redis://", "redis://:hunter2@")
    tier = RemoteTier.connect(url, mgr, kv, weights=b"weights-digest-0")
    try:
        assert "hunter2" not in repr(tier) and "hunter2" not in str(tier.stats()["url"])
    finally:
        tier.close()
