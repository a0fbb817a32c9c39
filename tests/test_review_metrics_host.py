"""Review of metrics, KV events, host memory, the host tier, staging, the block codec and the tier CLI:
each test failed before its fix."""

from __future__ import annotations

import pytest

from prefixkv.errors import InvalidArgument


# -- staging: pinned-buffer reuse on CUDA ---------------------------------------------------------

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


# -- block codec ------------------------------------------------------------------------------------

def _codec():
    import numpy as np

    from prefixkv.hashing import BlockHasher, encode_tokens
    from prefixkv.tiers.fingerprint import Fingerprint, weights_digest

    fp = Fingerprint(weights_digest([("w", np.arange(4, dtype=np.float32))]), "float16", 1, 1, 4, 2, hash_seed=3)
    hasher = BlockHasher(2, seed=3)
    tokens = encode_tokens([5, 6, 7, 8])
    chain = hasher.hash_blocks(tokens, 0, 2, None)
    return fp, hasher, chain, hasher.block_content(tokens, 1), bytes(range(fp.block_bytes))


def test_codec_encode_refuses_content_that_is_not_bytes():
    """bytes(content) turned a count into zero bytes (content=5 stored b'\\0' * 5) and a list of
    small ints into other bytes; hashes given as str or int raised a bare TypeError. All are
    InvalidArgument naming the argument, and nothing is encoded."""
    from prefixkv.tiers.block_codec import encode

    fp, hasher, chain, content, payload = _codec()
    for kwargs, argument in ((dict(content=5), "content"), (dict(content=[1, 2, 3]), "content"),
                             (dict(block_hash=chain[1].hex()[:16]), "block_hash"),
                             (dict(parent_hash=12345), "parent_hash"), (dict(payload="x" * fp.block_bytes), "payload"),
                             (dict(block_hash=chain[1][:8]), "block_hash"), (dict(payload=b"x"), "payload")):
        args = dict(block_hash=chain[1], parent_hash=chain[0], payload=payload, content=content) | kwargs
        with pytest.raises(InvalidArgument) as info:
            encode(fp, args["block_hash"], args["parent_hash"], args["payload"], args["content"])
        assert info.value.argument == argument


def test_codec_decode_refuses_arguments_of_the_wrong_type_instead_of_rejecting_the_value():
    """decode compared the stored bytes with a str / list content or hash: never equal, so every
    value came back Reject.CONTENT / HASH, and RedisBlockStore.fetch deletes what decode rejects:
    a caller's type mistake emptied the shared store. Now InvalidArgument, before any check."""
    from prefixkv.tiers.block_codec import decode, encode

    fp, hasher, chain, content, payload = _codec()
    value = encode(fp, chain[1], chain[0], payload, content)
    assert bytes(decode(value, fp, chain[1], chain[0], content)) == payload
    for args, argument in (((value, fp, chain[1], chain[0], content.hex()), "content"),
                           ((value, fp, chain[1], chain[0], list(content)), "content"),
                           ((value, fp, chain[1].hex(), chain[0], content), "block_hash"),
                           ((value, fp, chain[1], None, content), "parent_hash"),
                           ((None, fp, chain[1], chain[0], content), "value")):
        with pytest.raises(InvalidArgument) as info:
            decode(*args)
        assert info.value.argument == argument


# -- prefixkv tier ----------------------------------------------------------------------------------

class _FakeOperatorStore:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def server_stats(self):
        return [dict(node="h:1", used_memory=2**20, maxmemory=0, maxmemory_policy="noeviction", keys=3,
                     evicted_keys=0, keyspace_hits=1, keyspace_misses=1)]

    def clear(self, fingerprint):
        return 4


@pytest.mark.parametrize("argv", [("stats",), ("stats", "--json"), ("clear",)])
@pytest.mark.parametrize("url, secret", [("redis://default:hunter2@h:1/0", "hunter2"),
                                         ("redis://:p@ss@h:1", "p@ss"),
                                         ("unix:///run/r.sock?db=0&password=hunter2", "hunter2"),
                                         ("redis+cluster://u:hunter2@a:1,b:2", "hunter2")])
def test_tier_commands_do_not_print_the_urls_password(capsys, monkeypatch, argv, url, secret):
    """tier stats / clear echoed the URL as given, password included, to the terminal (and the
    logs of whatever runs them); the password is masked now."""
    import prefixkv.tiers.cli as tier_cli
    from prefixkv.cli import main

    monkeypatch.setattr(tier_cli, "_operator_store", lambda *a, **k: _FakeOperatorStore())
    assert main(["tier", argv[0], url, *argv[1:]]) == 0
    out = capsys.readouterr().out
    assert secret not in out and "***" in out


def test_tier_fingerprint_error_shows_what_was_typed(capsys):
    from cli_helpers import fails

    err = fails(capsys, "tier", "clear", "redis://127.0.0.1:1", "--fingerprint", " XYZ")
    assert "' XYZ'" in err


def test_host_tier_events_store_parents_before_children():
    """The device evicts a chain tail first and the host stored the batch in that order, so a
    child's BlockStored(medium="CPU") came before its parent's; consumers are promised parents first."""
    from prefixkv import KVCacheManager
    from prefixkv.events import BlockStored

    mgr = KVCacheManager(8, 4, hash_seed=0, num_host_blocks=16, host_cache=True, record_events=True)
    a = mgr.admit("a", list(range(24)))         # 6 full blocks, one chain
    mgr.free("a")
    mgr.drain_events()
    mgr.admit("b", list(range(100, 132)))       # 8 blocks: the whole chain of a is evicted to the host
    stored = [e for e in mgr.drain_events() if isinstance(e, BlockStored) and e.medium == "CPU"]
    assert len(stored) == 6
    seen = set()
    for event in stored:
        assert event.parent_hash is None or event.parent_hash in seen, "a child before its parent"
        seen.add(event.block_hash)
    assert a is not None
