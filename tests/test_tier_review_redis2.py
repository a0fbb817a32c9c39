"""Second review of the Redis block store and the remote tier, each defect on a real redis-server
on loopback. Every wait is bounded; nothing asserts on timing."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from redis_fixtures import Blocks, needs_redis, own_redis_server, raw, redis_server, server  # noqa: F401 (fixtures)

pytestmark = needs_redis
redis = pytest.importorskip("redis")

from prefixkv.errors import InvalidArgument  # noqa: E402
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest  # noqa: E402
from prefixkv.tiers.redis_net import RemoteTierError  # noqa: E402
from prefixkv.tiers.redis_store import RedisBlockStore, RedisStoreConfig  # noqa: E402

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)
BOUND_S = 10.0


def stored(store, blocks):
    n = store.put(blocks.chain, 0, blocks.payloads, blocks.contents)
    assert store.flush()
    return n


def sockets_open(store) -> list[str]:
    """The store's connections that hold a socket."""
    return [f"{node.name}/{which}" for node in store.topology.nodes.values()
            for which, conn in (("fg", node.fg), ("bg", node.bg)) if conn._sock is not None]


def test_a_writer_round_that_outlives_close_opens_no_socket(server, raw):  # noqa: F811
    """close() joins the writer for a bounded time; a round still running then (a slow node) went on
    after the store had closed its sockets, and its EXISTS / SET reopened them: the late write
    reached the server and the socket stayed open for the life of the process."""
    blocks = Blocks(FP, 3, seed=1)
    store = RedisBlockStore(server.url, FP)
    writer = store.writer
    entered, gate = threading.Event(), threading.Event()
    real_write = writer._write

    def held_write(batch):          # the round is in flight when close() gives up on the join
        entered.set()
        gate.wait(BOUND_S)
        real_write(batch)

    writer._write = held_write
    writer.join_timeout_s = 0.05
    assert store.put(blocks.chain, 0, blocks.payloads) == 3
    assert entered.wait(BOUND_S)
    store.close(flush_timeout_s=0.0)
    assert writer._thread.is_alive()       # the join timed out: the round is still running
    gate.set()
    writer._thread.join(BOUND_S)
    assert not writer._thread.is_alive()
    assert raw.exists(*store.keys.keys(blocks.chain, 0, 3)) == 0
    assert sockets_open(store) == []


def test_a_breaker_probe_after_close_opens_no_socket(own_redis_server):  # noqa: F811
    """The writer's breaker probe (PING) of a node, run after close() by a round that outlived the
    join, reconnected the node's background socket."""
    blocks = Blocks(FP, 2, seed=2)
    store = RedisBlockStore(own_redis_server.url, FP)
    stored(store, blocks)
    node = store.topology.single
    store.close()
    assert node.ping() is False
    assert sockets_open(store) == []


def test_probe_fetch_put_after_close_are_refused_and_open_no_socket(server):  # noqa: F811
    """After close(), probe and fetch reconnected (a fresh socket the store never closes again) and
    answered as if the store were open; put dropped silently. Each is refused with StoreClosed."""
    from prefixkv.tiers.redis_net import StoreClosed

    blocks = Blocks(FP, 2, seed=3)
    store = RedisBlockStore(server.url, FP)
    stored(store, blocks)
    assert store.probe(blocks.chain) == 2
    store.close()
    before = store.stats()
    for call in (lambda: store.probe(blocks.chain), lambda: store.fetch(blocks.chain, 0, 2),
                 lambda: store.put(blocks.chain, 0, blocks.payloads), store.server_stats, store.clear,
                 store.capacity_blocks):
        with pytest.raises(StoreClosed, match="closed"):
            call()
    assert isinstance(StoreClosed("x"), RemoteTierError)
    assert sockets_open(store) == []
    assert store.stats() == before
    store.close()                           # twice: a no-op


def test_a_cluster_url_naming_a_server_without_cluster_support_is_refused(server):  # noqa: F811
    """``redis+cluster://`` pointed at a plain server: CLUSTER SLOTS answered 'cluster support
    disabled', the slot map stayed empty and every probe missed and every write was dropped, with
    nothing saying why. Building the store now fails, naming the node and the problem."""
    before = {t.name for t in threading.enumerate()}
    url = f"redis+cluster://127.0.0.1:{server.port}"
    with pytest.raises(RemoteTierError, match=rf"127\.0\.0\.1:{server.port}.*not a Redis Cluster node.*redis://"):
        RedisBlockStore(url, FP)
    assert {t.name for t in threading.enumerate()} - before == set()      # no writer thread left


def test_a_cluster_url_whose_seeds_are_all_down_still_builds(tmp_path):
    """Unreachable seeds stay what they were: the store builds with every breaker open (the
    background probe finds the cluster later); only a seed that answers 'no cluster' is refused."""
    from redis_fixtures import free_port

    url = f"redis+cluster://127.0.0.1:{free_port()}"
    with RedisBlockStore(url, FP) as store:
        assert store.topology.all_down() and store.probe(Blocks(FP, 1, seed=4).chain) == 0


@pytest.mark.parametrize("writer_group,reader_group", [(16, 4), (4, 16), (5, 16)])
def test_replicas_with_different_max_group_blocks_share_blocks(server, writer_group, reader_group):  # noqa: F811
    """The Cluster hash tag of a block came from the first block of its group, and the group was
    ``max_group_blocks``: a replica with another setting named every block past its first group
    differently, and the two shared only that group, silently. The tag group now depends only on
    the fingerprint (what every replica agrees on); ``max_group_blocks`` only caps the keys per
    command."""
    blocks = Blocks(FP, 40, seed=5)
    with RedisBlockStore(server.url, FP, RedisStoreConfig(max_group_blocks=writer_group)) as writer:
        stored(writer, blocks)
        assert writer.probe(blocks.chain) == 40
    with RedisBlockStore(server.url, FP, RedisStoreConfig(max_group_blocks=reader_group)) as reader:
        assert reader.probe(blocks.chain) == 40 and reader.probe(blocks.chain, 7) == 33
        got = reader.fetch(blocks.chain, 3, 40, blocks.contents[3:])
        assert got.stop is None and [p.tobytes() for p in got.payloads] == blocks.payloads[3:]


def test_a_command_never_spans_two_tag_groups():
    """Every probe / MGET range keeps to one hash tag (one Cluster slot), whatever the cap."""
    from redis.crc import key_slot

    from prefixkv.tiers.redis_keys import KeySpace

    chain = Blocks(FP, 70, seed=6).chain
    for cap in (1, 3, 5, 16, 40):
        keys = KeySpace(FP, max_group_blocks=cap)
        for start in (0, 2, 15, 16, 33):
            ranges = keys.group_ranges(start, 70)
            assert ranges[0][0] == start and ranges[-1][1] == 70
            assert all(a < b <= a + min(cap, keys.tag_blocks) for a, b in ranges)
            assert all(b == c for (_, b), (c, _) in zip(ranges, ranges[1:]))
            for a, b in ranges:
                assert len({key_slot(k) for k in keys.keys(chain, a, b)}) == 1
                assert keys.keys(chain, a, b) == KeySpace(FP).keys(chain, a, b)


# -- bad arguments: InvalidArgument naming the argument ----------------------------------------------

FP_ARGS = dict(weights=FP.weights, dtype="float16", layers=2, kv_heads=2, head_dim=8, block_size=4, hash_seed=7)
INF, NAN = float("inf"), float("nan")


@pytest.mark.parametrize("change, argument", [
    ({"hash_algorithm": "md5"}, "hash_algorithm"), ({"dtype": "int4"}, "dtype"), ({"weights": b"x"}, "weights"),
    ({"layout": ""}, "layout"), ({"layout": 5}, "layout"), ({"layers": 0}, "layers"),
    # a float or a boolean dimension was taken (int(2.5) passed the check) and went into the digest as
    # written: layers=2.0 and layers=2 named different fingerprints, so the replicas shared nothing
    ({"layers": 2.0}, "layers"), ({"layers": 2.5}, "layers"), ({"kv_heads": True}, "kv_heads"),
    ({"block_size": "4"}, "block_size"), ({"tp_size": 1.5}, "tp_size"), ({"tp_rank": 2}, "tp_rank"),
    ({"tp_rank": 0.0}, "tp_rank"), ({"hash_seed": "7"}, "hash_seed"), ({"hash_seed": 7.0}, "hash_seed"),
    ({"hash_seed": True}, "hash_seed"),
])
def test_bad_fingerprint_fields_are_refused_naming_them(change, argument):
    with pytest.raises(InvalidArgument) as info:
        Fingerprint(**{**FP_ARGS, **change})
    assert info.value.argument == argument


def test_integer_like_fingerprint_fields_name_the_same_fingerprint():
    assert Fingerprint(**{**FP_ARGS, "layers": np.int64(2), "hash_seed": np.uint32(7)}).digest == FP.digest
    assert type(Fingerprint(**{**FP_ARGS, "layers": np.int64(2)}).layers) is int


def test_weights_digest_and_dtype_refusals_name_the_argument():
    from prefixkv.tiers.fingerprint import canonical_dtype

    with pytest.raises(InvalidArgument) as info:
        weights_digest([("w", np.zeros(2)), ("w", np.ones(2))])
    assert info.value.argument == "named_tensors" and "twice" in str(info.value)
    with pytest.raises(InvalidArgument, match="at least one") as info:
        weights_digest([])
    assert info.value.argument == "named_tensors"
    with pytest.raises(InvalidArgument) as info:
        canonical_dtype("int4")
    assert info.value.argument == "dtype"


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


def test_model_weights_digest_of_a_model_without_weights_names_model():
    pytest.importorskip("torch")
    from prefixkv.tiers.remote import model_weights_digest

    with pytest.raises(InvalidArgument) as info:
        model_weights_digest(object())
    assert info.value.argument == "model"


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


@pytest.mark.parametrize("url, words", [
    ("redis+cluster://127.0.0.1:99999", "out of range"), ("redis+cluster://127.0.0.1:abc", "integer"),
    ("redis+cluster://127.0.0.1:7000/3", "database 0"), ("redis://127.0.0.1:6379/x", "database"),
])
def test_unusable_urls_are_refused_with_remote_tier_error(url, words):
    """A cluster seed's bad port escaped as a plain ValueError from urllib; a database in a cluster URL
    (a cluster has only database 0) and a database that is not a number in a redis:// URL were
    ignored, so the store silently used database 0 (and clear() emptied database 0)."""
    with pytest.raises(RemoteTierError, match=words):
        RedisBlockStore(url, FP)


def test_clear_spares_other_applications_keys_that_pass_the_scan_pattern(server, raw):  # noqa: F811
    """SCAN's glob cannot say 'digits only' (``v[0-9]*`` is one digit and then anything), so another
    application's ``pkv:v2:sessions:<32 hex digits>:{u}:x`` matched and clear() deleted it. Keys are
    now checked against the exact block-key shape before the UNLINK."""
    fp_hex = "0123456789abcdef0123456789abcdef"
    others = [f"pkv:v2:sessions:{fp_hex}:{{u}}:x", f"pkv:v1:{fp_hex}:{{user-7}}:profile",
              f"pkv:v1:{FP.hex}:{{0123456789abcdef}}:notes"]
    for key in others:
        raw.set(key, b"keep")
    blocks = Blocks(FP, 3, seed=8)
    with RedisBlockStore(server.url, FP) as store:
        stored(store, blocks)
        assert store.clear() == 3
        stored(store, blocks)
        assert store.clear(FP.hex) == 3
    assert [raw.get(k) for k in others] == [b"keep"] * 3


@pytest.mark.parametrize("url", ["redis+cluster://:hunter2@127.0.0.1:abc", "redis://:hunter2@127.0.0.1:6379/x",
                                 "redis+cluster://u:hunter2@127.0.0.1:7000/3"])
def test_an_unusable_urls_error_does_not_show_its_password(url):
    """The errors quoted the URL as given: a password went into terminals and logs."""
    with pytest.raises(RemoteTierError) as info:
        RedisBlockStore(url, FP)
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


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


@pytest.mark.parametrize("url", ["redis+cluster://127.0.0.1:7000?password=hunter2",
                                 "redis+cluster://127.0.0.1:7000/0?ssl=true", "redis+cluster://127.0.0.1:7000/?x=1"])
def test_a_cluster_urls_query_options_are_refused_not_dropped(url):
    """A query after the nodes was read as part of the database ('database 0 only, got 0?ssl=true')
    or, with no database, dropped without a word (a password given there was never sent)."""
    with pytest.raises(RemoteTierError, match="query options") as info:
        RedisBlockStore(url, FP)
    assert "hunter2" not in str(info.value)


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
