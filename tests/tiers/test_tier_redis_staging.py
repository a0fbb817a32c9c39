"""KV blocks from one KVStore's pools through the Redis block store into another's, bit for bit."""

from __future__ import annotations

import pytest

from redis_fixtures import REDIS_SERVER, SKIP_REASON, redis_server  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")

from prefixkv import KVSpec  # noqa: E402
from prefixkv.hashing import BlockHasher, encode_tokens  # noqa: E402
from prefixkv.kv.storage import KVStore  # noqa: E402
from prefixkv.tiers.fingerprint import weights_digest  # noqa: E402
from prefixkv.tiers.staging import StagingBuffer, fingerprint_for  # noqa: E402

SPEC = KVSpec(layers=3, kv_heads=2, head_dim=8, dtype="bfloat16")


def filled_store(seed: int) -> KVStore:
    store = KVStore(SPEC, num_blocks=12, block_size=4)
    g = torch.Generator().manual_seed(seed)
    store.data.copy_(torch.randn(store.data.shape, generator=g).to(store.data.dtype))
    return store


def test_pack_unpack_round_trip_and_layout():
    a, b = filled_store(0), KVStore(SPEC, num_blocks=12, block_size=4)
    staging = StagingBuffer(a, 4)
    payloads = staging.pack([5, 2, 7])
    assert all(isinstance(p, bytes) and len(p) == staging.block_bytes for p in payloads)
    fp = fingerprint_for(a, weights_digest([("w", torch.ones(2))]), hash_seed=1)
    assert fp.block_bytes == staging.block_bytes and fp.dtype == "bfloat16"
    # layout L2BHD: the payload is data[:, :, block] in C order
    expect = a.data[:, :, 5].contiguous().view(torch.uint8).numpy().tobytes()
    assert payloads[0] == expect
    StagingBuffer(b, 4).unpack([0, 1, 11], [memoryview(p) for p in payloads])
    for src, dst in ((5, 0), (2, 1), (7, 11)):
        assert torch.equal(a.data[:, :, src], b.data[:, :, dst])
    assert not b.data[:, :, 3].any()


def test_unpack_checks_before_writing():
    b = KVStore(SPEC, num_blocks=12, block_size=4)
    staging = StagingBuffer(b, 2)
    good = bytes(staging.block_bytes)
    with pytest.raises(ValueError, match="payload 1"):
        staging.unpack([0, 1], [b"\1" * staging.block_bytes, b"short"])
    with pytest.raises(ValueError, match="out of range"):
        staging.unpack([0, 12], [good, good])
    with pytest.raises(ValueError, match="do not fit"):
        staging.unpack([0, 1, 2], [good] * 3)
    assert not b.data.any()


@pytest.mark.redis
@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
def test_blocks_travel_from_one_store_to_another_through_redis(redis_server):  # noqa: F811
    from prefixkv.tiers.redis_store import RedisBlockStore

    a, b = filled_store(1), KVStore(SPEC, num_blocks=12, block_size=4)
    fp = fingerprint_for(a, weights_digest([("w", torch.ones(2))]), hash_seed=3)
    hasher = BlockHasher(4, seed=3)
    tokens = encode_tokens(range(1000, 1024))
    chain = hasher.hash_blocks(tokens, 0, 6, None)
    contents = [hasher.block_content(tokens, i) for i in range(6)]
    with RedisBlockStore(redis_server.url, fp) as writer, RedisBlockStore(redis_server.url, fp) as reader:
        writer.put(chain, 0, StagingBuffer(a, 6).pack(range(6)), contents)
        assert writer.flush()
        assert reader.probe(chain) == 6
        got = reader.fetch(chain, 0, 6, contents)
        assert got.stop is None
        StagingBuffer(b, 6).unpack([11, 10, 9, 8, 7, 6], got.payloads)
    for i in range(6):
        assert torch.equal(a.data[:, :, i], b.data[:, :, 11 - i])
