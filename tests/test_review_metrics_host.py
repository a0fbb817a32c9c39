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


# -- metrics ----------------------------------------------------------------------------------------

def _metrics_lines(metrics) -> set[str]:
    from prometheus_client import generate_latest

    return set(generate_latest(metrics.registry).decode().splitlines())


def _watched_manager():
    pytest.importorskip("prometheus_client")
    from prefixkv import KVCacheManager
    from prefixkv.metrics import Metrics

    mgr = KVCacheManager(8, 4, hash_seed=0)
    metrics = Metrics()
    metrics.watch_manager(mgr, worker="w0")
    return mgr, metrics


def test_metrics_one_failing_tier_does_not_lose_every_series():
    """A tier's stats() that raised (a closed store), or held a value that is not a number (a
    RemoteTier's stats() carries its URL and fingerprint), failed the whole scrape: no worker's
    series were served. Now that tier is left out of the scrape and counted; the rest is exported."""
    mgr, metrics = _watched_manager()
    calls = []

    def closed():
        calls.append(1)
        raise RuntimeError("store closed")

    metrics.watch_tier("redis", lambda: {"cached": 3, "url": "redis://h:1", "fingerprint": "ab" * 16}, worker="w0")
    metrics.watch_tier("disk", closed, worker="w0")
    metrics.watch_tier("nvme", lambda: {"active": "many"}, worker="w0")
    lines = _metrics_lines(metrics)
    assert 'prefixkv_blocks{state="free",tier="device",worker="w0"} 8.0' in lines
    assert 'prefixkv_blocks{state="cached",tier="redis",worker="w0"} 3.0' in lines
    assert not any('tier="redis"' in line and 'state="url"' in line for line in lines)
    assert not any("prefixkv_blocks" in line and ('tier="disk"' in line or 'tier="nvme"' in line) for line in lines)
    assert 'prefixkv_tier_stats_errors_total{tier="disk",worker="w0"} 1.0' in lines
    assert 'prefixkv_tier_stats_errors_total{tier="nvme",worker="w0"} 1.0' in lines
    lines = _metrics_lines(metrics)
    assert 'prefixkv_tier_stats_errors_total{tier="disk",worker="w0"} 2.0' in lines and len(calls) == 2


def test_metrics_tier_states_are_block_states_only():
    """Every key of a tier's stats() became a prefixkv_blocks state: a HostTier's stats() added
    capacity, stores, hits, evictions (counters, summed into the blocks) as block gauges; the
    series per tier were as many as the dict's keys. Only active / cached / free are blocks."""
    from prefixkv.tiers.host import HostTier

    _, metrics = _watched_manager()
    metrics.watch_tier("spare", HostTier(16, 4).stats, worker="w1")
    tier_lines = {line for line in _metrics_lines(metrics) if 'tier="spare"' in line}
    assert tier_lines == {f'prefixkv_blocks{{state="{state}",tier="spare",worker="w1"}} {value}'
                          for state, value in (("active", 0.0), ("cached", 0.0), ("free", 16.0))}


@pytest.mark.parametrize("call, argument", [
    (lambda m, mgr: m.watch_manager(mgr, worker=0), "worker"),
    (lambda m, mgr: m.watch_manager(mgr, worker=""), "worker"),
    (lambda m, mgr: m.watch_manager(object(), worker="w9"), "manager"),
    (lambda m, mgr: m.watch_tier("redis", None, worker="w9"), "stats"),
    (lambda m, mgr: m.watch_tier(("redis",), lambda: {}, worker="w9"), "tier"),
    (lambda m, mgr: m.watch_tier("redis", lambda: {}, worker=7), "worker"),
    (lambda m, mgr: m.watch_engine(mgr, worker="w9"), "engine"),
])
def test_metrics_bad_watch_arguments_are_refused_when_watched(call, argument):
    """A non-string label (worker=0) or a stats that is not callable was accepted, and every later
    scrape then failed ('int' object has no attribute 'replace'; 'NoneType' object is not callable)."""
    mgr, metrics = _watched_manager()
    with pytest.raises(InvalidArgument) as info:
        call(metrics, mgr)
    assert info.value.argument == argument
    assert 'prefixkv_blocks{state="free",tier="device",worker="w0"} 8.0' in _metrics_lines(metrics)


def test_metrics_router_reasons_are_bounded():
    """Each reason became a label value kept for the life of the process: a router (or wrapper)
    whose reasons carry an id made series without bound. Reasons other than the router's own are
    counted as 'other'; the set matches prefixkv.fleet.router's REASON_* constants."""
    from prefixkv.fleet import router as fleet_router
    from prefixkv.fleet.router import Decision
    from prefixkv.metrics import REASONS

    assert REASONS == {v for k, v in vars(fleet_router).items() if k.startswith("REASON_")}
    _, metrics = _watched_manager()
    for i in range(50):
        metrics.router_decision(Decision("w0", f"sticky-session-{i}", 0, 0, 0.0))
    metrics.router_decision(Decision("w0", ["unhashable"], 0, 0, 0.0))
    metrics.router_decision(Decision("w0", "guard", 0, 0, 0.0))
    lines = [line for line in _metrics_lines(metrics) if line.startswith("prefixkv_router_decisions_total")]
    assert sorted(lines) == ['prefixkv_router_decisions_total{reason="guard",router="kv-aware+guard"} 1.0',
                             'prefixkv_router_decisions_total{reason="other",router="kv-aware+guard"} 51.0']
    with pytest.raises(InvalidArgument, match="router"):
        metrics.router_decision(Decision("w0", "guard", 0, 0, 0.0), router=None)


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


# -- host memory ------------------------------------------------------------------------------------

def _fake_proc(tmp_path, monkeypatch, files: dict[str, str], available_kib=256 * 2**20):
    from prefixkv import hostmem

    meminfo = tmp_path / "meminfo"
    meminfo.write_text(f"MemTotal: {2 * available_kib} kB\nMemAvailable: {available_kib} kB\n")
    root = tmp_path / "cgroup"
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    monkeypatch.setattr(hostmem, "MEMINFO", str(meminfo))
    monkeypatch.setattr(hostmem, "CGROUP_ROOT", str(root))
    return hostmem


@pytest.mark.parametrize("files", [
    {"memory.max": f"{8 << 30}\n", "memory.current": f"{3 << 30}\n", "memory.stat": f"anon 1\ninactive_file {1 << 30}\n"},
    {"memory/memory.limit_in_bytes": f"{8 << 30}\n", "memory/memory.usage_in_bytes": f"{3 << 30}\n",
     "memory/memory.stat": f"cache 5\ntotal_inactive_file {1 << 30}\n"},
])
def test_hostmem_counts_a_containers_memory_limit(tmp_path, monkeypatch, files):
    """MemAvailable is the host's: in a container limited to 8 GiB on a 256 GiB host, a size
    needing 100 GiB passed the check and the OOM killer ended the process, which this module
    exists to prevent. The cgroup's limit less its usage (reclaimable file cache aside) caps it."""
    hostmem = _fake_proc(tmp_path, monkeypatch, files)
    assert hostmem.available_bytes() == (8 << 30) - (2 << 30)
    with pytest.raises(hostmem.TooLarge, match="; 6 GiB is available"):
        hostmem.require(100 << 30, "a cache")
    hostmem.require(4 << 30, "a cache")


@pytest.mark.parametrize("files", [{}, {"memory.max": "max\n", "memory.current": "1\n"},
                                   {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                                    "memory/memory.usage_in_bytes": "5\n"}])
def test_hostmem_without_a_cgroup_limit_uses_memavailable(tmp_path, monkeypatch, files):
    hostmem = _fake_proc(tmp_path, monkeypatch, files, available_kib=1024)
    assert hostmem.available_bytes() == 1024 * 1024


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
