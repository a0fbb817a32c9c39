"""KV blocks from one KVStore's pools through the Redis block store into another's, bit for bit.

The staging buffer waits for the last copy out of its pinned buffer before writing it again (the
order of writes and waits, checked on CPU with a recording event) and refuses fractional and
repeated block ids."""

from __future__ import annotations

import pytest

from redis_fixtures import REDIS_SERVER, SKIP_REASON, redis_server  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")

from prefixkv import KVSpec  # noqa: E402
from prefixkv.errors import InvalidArgument  # noqa: E402
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


# -- the pinned buffer is reused only once the copy out of it is done ------------------------------

class _RecordingHost:
    """Stands in for the staging buffer's numpy view: logs every write, stores nothing."""

    def __init__(self, log: list) -> None:
        self.log = log

    def __setitem__(self, i, value) -> None:
        self.log.append(("write", i))


class _FakeEvent:
    """A CUDA event as a log: ``record`` when created, ``synchronize`` when waited on."""

    def __init__(self, log: list, n: int) -> None:
        self.log, self.n = log, n
        log.append(("record", n))

    def synchronize(self) -> None:
        self.log.append(("sync", self.n))


def _staging(capacity=4):
    torch = pytest.importorskip("torch")
    from prefixkv import KVSpec
    from prefixkv.kv.storage import KVStore
    from prefixkv.tiers.staging import StagingBuffer

    store = KVStore(KVSpec(layers=2, kv_heads=1, head_dim=4, dtype="float32"), num_blocks=6, block_size=2)
    return torch, store, StagingBuffer(store, capacity)


def test_staging_waits_for_the_last_unpack_before_writing_the_pinned_buffer_again(monkeypatch):
    """unpack of one block: the permuted staging view is contiguous, so on CUDA the non-blocking
    host->device copy reads the pinned buffer itself after unpack has returned. The next unpack
    (or unpack_host, or a pack on another stream) wrote the buffer at once and could overwrite
    the block still in flight: the first block then held the second's bytes. Now the copy records
    an event and every later write into the buffer waits for it first. (The race itself needs a
    GPU; this checks the order of writes and waits on CPU with a recording event.)"""
    _, store, staging = _staging()
    import prefixkv.tiers.staging as staging_module

    log: list = []
    reads = iter(range(100))
    monkeypatch.setattr(staging_module, "_record_read", lambda device: _FakeEvent(log, next(reads)))
    payload = bytes(staging.block_bytes)
    host = staging._host
    staging._host = _RecordingHost(log)
    staging.unpack([0], [payload])
    staging.unpack([1], [payload])
    assert log == [("write", 0), ("record", 0), ("sync", 0), ("write", 0), ("record", 1)]
    staging._host = host
    log.clear()
    staging.pack([2])                       # the device -> host copy also waits for the last read
    assert log == [("sync", 1)]
    staging.pack([3])
    assert log == [("sync", 1)]             # waited once: nothing is in flight any more
    store.allocate_host(2)
    staging.unpack([4], [payload])
    log.clear()
    staging._host = _RecordingHost(log)
    staging.unpack_host([1], [payload])
    assert log == [("sync", 2), ("write", 0)]


def test_staging_refuses_fractional_and_repeated_block_ids():
    """int(2.7) == 2: a float id wrote block 2; a block listed twice in one unpack kept whichever
    payload index_copy_ happened to apply last (undefined on CUDA). Both are refused, naming the argument."""
    torch, store, staging = _staging()
    payload = b"\1" * staging.block_bytes
    with pytest.raises(InvalidArgument, match="block_ids"):
        staging.unpack([2.7], [payload])
    with pytest.raises(InvalidArgument, match="block_ids.*twice"):
        staging.unpack([1, 1], [payload, bytes(staging.block_bytes)])
    with pytest.raises(InvalidArgument, match="block_ids"):
        staging.pack([True])
    with pytest.raises(InvalidArgument, match="capacity"):
        type(staging)(store, 2.5)
    with pytest.raises(InvalidArgument, match="payloads.*payload 0 is not a contiguous buffer"):
        staging.unpack([0], ["x" * staging.block_bytes])
    assert not store.data.any()
