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
