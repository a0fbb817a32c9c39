"""The disk block store on a real filesystem: round trips, restarts, crashes, damage, sharing, bounds.

Issue 26 point 2 at the store level (the tier wiring is tested where it is built). Everything runs
under ``tmp_path``; the only stand-ins are a tmpfs mount for a full / read-only disk (skipped with the
reason where mounting is not permitted) and, always, a write call patched to raise ENOSPC / EROFS /
EACCES. ``PREFIXKV_HYPOTHESIS_PROFILE=long`` runs 20 kill -9 trials and a longer model check.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from redis_fixtures import Blocks

from prefixkv.errors import InvalidArgument
from prefixkv.tiers.block_codec import Reject, encode
from prefixkv.tiers.disk_reader import RunReader
from prefixkv.tiers.disk_store import DiskBlockStore, DiskStoreConfig, StoreClosed
from prefixkv.tiers.disk_writer import DiskWriter
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest

LONG = os.environ.get("PREFIXKV_HYPOTHESIS_PROFILE") == "long"
REPO = Path(__file__).resolve().parents[2]
TESTS = REPO / "tests"

WEIGHTS = weights_digest([("w", np.arange(8, dtype=np.float32))])
FP = Fingerprint(WEIGHTS, "float16", layers=2, kv_heads=2, head_dim=8, block_size=4, hash_seed=7)
# Same seed and block size, other weights: the same chain hashes, other KV (what a copied-in
# directory of another model looks like).
OTHER_FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32) * 2)]), "float16", 2, 2, 8, 4,
                       hash_seed=7)
FAST = DiskStoreConfig(fsync="none")


def value_size(blocks, i, contents=True):
    return len(encode(FP, blocks.chain[i], blocks.parent(i), blocks.payloads[i],
                      blocks.contents[i] if contents else None))


def written(store, blocks, start=0, stop=None, contents=True):
    stop = len(blocks) if stop is None else stop
    n = store.put(blocks.chain, start, blocks.payloads[start:stop], blocks.contents[start:stop] if contents else None)
    assert store.flush()
    return n


def namespace_bytes(store) -> int:
    """Bytes of every file in the store's namespace but the ledger: block files and temporaries."""
    total = 0
    for folder, _, names in os.walk(store.layout.namespace):
        for name in names:
            if name != "usage":
                total += os.path.getsize(os.path.join(folder, name))
    return total


def assert_served_equal(store, blocks, start=0, stop=None):
    got = store.fetch(blocks.chain, start, len(blocks) if stop is None else stop, blocks.contents[start:])
    assert [p.tobytes() for p in got.payloads] == blocks.payloads[start:start + got.count]
    return got


# -- round trips and restarts ----------------------------------------------------------------------

def test_put_probe_fetch_round_trip_and_the_batch_calls(tmp_path):
    blocks = Blocks(FP, 30, seed=1)
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        assert store.probe(blocks.chain) == 0 and store.fetch(blocks.chain, 0, 30).stop == "miss"
        assert written(store, blocks, 0, 20) == 20
        assert store.probe(blocks.chain) == 20 and store.probe(blocks.chain, 5) == 15
        got = assert_served_equal(store, blocks)
        assert got.count == 20 and got.stop == "miss"
        mid = store.fetch(blocks.chain, 7, 18)
        assert mid.stop is None and [p.tobytes() for p in mid.payloads] == blocks.payloads[7:18]
        # the engine-facing shape: keys and the hash before them
        keys = blocks.chain[20:30]
        assert store.set_many(keys, blocks.payloads[20:30], parent=blocks.chain[19], contents=blocks.contents[20:30]) == 10
        assert store.flush()
        assert store.exists_leading(blocks.chain) == 30 and store.exists_leading(keys) == 10
        many = store.get_many(keys[2:], parent=keys[1], contents=blocks.contents[22:30])
        assert many.stop is None and [p.tobytes() for p in many.payloads] == blocks.payloads[22:30]
        assert store.get_many(blocks.chain[:3]).count == 3      # parent None: block 0 of its chain
        assert store.get_many(keys[:2]).stop == Reject.PARENT    # block 20 is not block 0 of a chain
        assert store.flush()             # the refused block 20 is deleted
        s = store.stats()
        assert s.writes == 30 and s.write_bytes - value_size(blocks, 20) == s.used_bytes == namespace_bytes(store)
        assert s.index_blocks == 29 and s.index_bytes == s.used_bytes
        assert s.rejected == {"parent": 1} and s.bad_keys_deleted == 1 and s.dropped == {}
        written(store, blocks)           # only the deleted one is written again
        assert store.stats().skipped_present == 29 and store.stats().writes == 31
    assert store.stats().queue_blocks == 0


def test_file_names_fanout_and_namespaces(tmp_path):
    blocks = Blocks(FP, 3, seed=2)
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        written(store, blocks)
        name = blocks.chain[1].hex()
        assert (tmp_path / FP.hex / name[:2] / f"{name}.kv").is_file()
        assert store.layout.block_path(blocks.chain[1]) == str(tmp_path / FP.hex / name[:2] / f"{name}.kv")
    # another fingerprint's store never sees this namespace, though the hashes are the same
    with DiskBlockStore(tmp_path, OTHER_FP, 10**6, FAST) as other:
        assert other.probe(blocks.chain) == 0 and other.fetch(blocks.chain, 0, 3).stop == "miss"
        assert other.stats().index_blocks == 0


_CHILD = r"""
import json, sys, time
sys.path[:0] = json.loads(sys.argv[1])
args = json.loads(sys.argv[2])
import numpy as np
from redis_fixtures import Blocks
from prefixkv.tiers.disk_store import DiskBlockStore, DiskStoreConfig
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest
fp = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), **args["dims"], hash_seed=7)
chains = [Blocks(fp, args["blocks"], seed=s) for s in args["seeds"]]
store = DiskBlockStore(args["path"], fp, args["capacity"], DiskStoreConfig(fsync=args["fsync"]))
print("ready", flush=True)
rng = __import__("random").Random(args["rng"])
bad = loaded = 0
for r in range(args["rounds"]):
    b = rng.choice(chains) if args["mode"] == "share" else chains[r % len(chains)]
    store.put(b.chain, 0, b.payloads, b.contents)
    if args["mode"] == "share":
        store.flush()
        start = rng.randrange(len(b))
        got = store.fetch(b.chain, start, len(b), b.contents[start:])
        loaded += got.count
        bad += sum(p.tobytes() != b.payloads[start + j] for j, p in enumerate(got.payloads))
store.flush(60)
s = store.stats()
print(json.dumps({"bad": bad, "loaded": loaded, "rejected": s.rejected, "writes": s.writes,
                  "evictions": s.evictions, "dropped": s.dropped}), flush=True)
store.close()
"""


def child(path, *, mode="write", seeds=(1,), blocks=8, rounds=1, capacity=10**7, fsync="none", dims=None, rng=0):
    args = {"path": str(path), "mode": mode, "seeds": list(seeds), "blocks": blocks, "rounds": rounds,
            "capacity": capacity, "fsync": fsync, "rng": rng,
            "dims": dims or {"layers": 2, "kv_heads": 2, "head_dim": 8, "block_size": 4, "dtype": "float16"}}
    return subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps([str(TESTS), str(REPO)]), json.dumps(args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finished(proc, timeout=60):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def test_restart_a_fresh_process_and_a_second_store_serve_what_was_written(tmp_path):
    report = finished(child(tmp_path, seeds=(1, 2), blocks=12, rounds=2))
    assert report["writes"] == 24
    blocks = [Blocks(FP, 12, seed=s) for s in (1, 2)]
    with DiskBlockStore(tmp_path, FP, 10**6) as store:
        s = store.stats()
        assert s.index_blocks == 24 and s.used_bytes == namespace_bytes(store) and s.open_s < 1
        for b in blocks:
            assert store.probe(b.chain) == 12
            assert assert_served_equal(store, b).count == 12
        more = Blocks(FP, 4, seed=3)
        written(store, more)
    with DiskBlockStore(tmp_path, FP, 10**6) as again:     # a second store object: this process's writes too
        assert assert_served_equal(again, more).count == 4 and again.stats().rejected == {}


# -- crashes -----------------------------------------------------------------------------------------

BIG = {"layers": 4, "kv_heads": 4, "head_dim": 64, "block_size": 16, "dtype": "float16"}   # 64 KiB blocks
BIG_FP = Fingerprint(WEIGHTS, "float16", hash_seed=7, **{k: v for k, v in BIG.items() if k != "dtype"})


@pytest.mark.parametrize("trial", range(20 if LONG else 3))
def test_kill_9_while_writing_leaves_nothing_bad_to_serve(tmp_path, trial):
    rng = random.Random(trial)
    seeds = (1, 2, 3)
    proc = child(tmp_path, seeds=seeds, blocks=16, rounds=30, capacity=40 * 2**16 + 40 * 200, fsync="file",
                 dims=BIG, rng=trial)
    assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
    time.sleep(rng.uniform(0.0, 0.3))
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    chains = [Blocks(BIG_FP, 16, seed=s) for s in seeds]
    with DiskBlockStore(tmp_path, BIG_FP, 40 * 2**16 + 40 * 200) as store:
        s = store.stats()
        discarded = s.rejected.get("leftover_temp", 0)
        assert set(s.rejected) <= {"leftover_temp"}
        assert s.used_bytes == namespace_bytes(store)          # recounted: no temporary file left
        served = 0
        for b in chains:
            got = store.fetch(b.chain, 0, len(b), b.contents)
            assert got.stop in (None, "miss")                 # never a refused (torn) value
            assert [p.tobytes() for p in got.payloads] == b.payloads[:got.count]
            served += got.count
        assert store.stats().rejected == s.rejected
    print(f"trial {trial}: {served} blocks served, {discarded} leftover temporary files deleted")


def test_leftover_temporary_files_of_dead_writers_are_deleted_and_counted(tmp_path):
    blocks = Blocks(FP, 4, seed=4)
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        written(store, blocks)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(dead.stdout)
    folder = tmp_path / FP.hex / blocks.chain[0][:1].hex()
    (folder / f"{blocks.chain[0].hex()}.{dead_pid}.1.tmp").write_bytes(b"half a value")
    (folder / "garbage.tmp").write_bytes(b"x")                 # no pid: nobody will rename it
    live = folder / f"{blocks.chain[0].hex()}.{os.getpid()}.99.tmp"
    live.write_bytes(b"a write in progress")                   # a live writer's (this process): kept
    (folder / "notes.txt").write_text("an operator's file")     # not ours: left alone, not counted
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        s = store.stats()
        assert s.rejected == {"leftover_temp": 2} and s.unknown_files == 1
        assert live.exists() and (folder / "notes.txt").exists()
        assert s.used_bytes == sum(value_size(blocks, i) for i in range(4))
        assert assert_served_equal(store, blocks).count == 4
    os.utime(live, (time.time() - 3600, time.time() - 3600))  # stuck for an hour: a leftover too
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        assert store.stats().rejected == {"leftover_temp": 1} and not live.exists()


# -- damage ----------------------------------------------------------------------------------------

def _flip(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x40
    path.write_bytes(bytes(data))


def _damage(kind, tmp_path, store, blocks):
    path = Path(store.layout.block_path(blocks.chain[2]))
    if kind == "flipped_payload":
        _flip(path, -5)
    elif kind == "flipped_header":
        _flip(path, 30)
    elif kind == "truncated_short":
        path.write_bytes(path.read_bytes()[:20])
    elif kind == "truncated":
        path.write_bytes(path.read_bytes()[:-10])
    elif kind == "padded":
        path.write_bytes(path.read_bytes() + b"\0")
    elif kind == "swapped":
        other = Path(store.layout.block_path(blocks.chain[3]))
        a, b = path.read_bytes(), other.read_bytes()
        path.write_bytes(b)
        other.write_bytes(a)
    elif kind == "other_chain":
        path.write_bytes(encode(FP, blocks.chain[2], blocks.chain[0], blocks.payloads[2], blocks.contents[2]))
    elif kind == "other_tokens":
        path.write_bytes(encode(FP, blocks.chain[2], blocks.chain[1], blocks.payloads[2], b"\1" * 16))
    elif kind == "empty":
        path.write_bytes(b"")
    elif kind == "other_model_dir":
        # another model's whole directory copied over this one's (same chain hashes: same seed)
        with DiskBlockStore(tmp_path / "other", OTHER_FP, 10**6, FAST) as other:
            written(other, blocks)
        shutil.copytree(tmp_path / "other" / OTHER_FP.hex, tmp_path / FP.hex, dirs_exist_ok=True)
        return 0
    return 2


DAMAGE = {"flipped_payload": Reject.PAYLOAD_CHECKSUM, "flipped_header": Reject.HEADER_CHECKSUM,
          "truncated_short": Reject.TRUNCATED, "truncated": Reject.LENGTH, "padded": Reject.LENGTH,
          "swapped": Reject.HASH, "other_chain": Reject.PARENT, "other_tokens": Reject.CONTENT,
          "empty": Reject.TRUNCATED, "other_model_dir": Reject.FINGERPRINT}


@pytest.mark.parametrize("kind", sorted(DAMAGE))
def test_a_damaged_value_is_a_miss_counted_by_reason_and_deleted(tmp_path, kind):
    blocks = Blocks(FP, 6, seed=5)
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        written(store, blocks)
    first_bad = _damage(kind, tmp_path, store, blocks)
    reason = DAMAGE[kind]
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:   # a restart: nothing is read at open
        assert store.stats().rejected == {}
        got = assert_served_equal(store, blocks)
        assert got.count == first_bad and got.stop == reason   # the run ends at the first bad block
        assert store.flush()
        s = store.stats()
        assert s.rejected == {reason.value: 1} and s.bad_keys_deleted == 1
        assert not os.path.exists(store.layout.block_path(blocks.chain[first_bad]))
        assert s.used_bytes == namespace_bytes(store)
        again = store.fetch(blocks.chain, 0, 6, blocks.contents)
        assert again.count == first_bad and again.stop == "miss"
        for _ in range(len(blocks)):                           # each bad block: refused, deleted, rewritten
            written(store, blocks)
            if assert_served_equal(store, blocks).count == len(blocks):
                break
            assert store.flush()
        assert assert_served_equal(store, blocks).count == len(blocks)
        bad = {"swapped": 2, "other_model_dir": 6}.get(kind, 1)
        assert store.stats().rejected == {reason.value: bad} and store.stats().bad_keys_deleted == bad


def test_a_symbolic_link_is_never_followed(tmp_path):
    blocks = Blocks(FP, 3, seed=6)
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        written(store, blocks)
        path = store.layout.block_path(blocks.chain[1])
        real = tmp_path / "elsewhere.kv"
        os.replace(path, real)
        os.symlink(real, path)
        got = store.fetch(blocks.chain, 0, 3)
        assert got.count == 1 and got.stop == "error"
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        assert store.stats().unknown_files == 1 and store.stats().index_blocks == 2


def test_a_refused_file_replaced_since_by_a_good_value_is_kept(tmp_path, monkeypatch):
    blocks = Blocks(FP, 3, seed=7)
    held = []
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        written(store, blocks)
        path = Path(store.layout.block_path(blocks.chain[1]))
        good = path.read_bytes()
        _flip(path, -1)
        apply = DiskWriter._delete_refused
        monkeypatch.setattr(DiskWriter, "_delete_refused", lambda self, deletes: held.append(deletes))
        assert store.fetch(blocks.chain, 0, 3).stop == Reject.PAYLOAD_CHECKSUM and store.flush()
        temp = path.with_suffix(".x")
        temp.write_bytes(good)
        os.replace(temp, path)             # another process renames the good value in meanwhile
        apply(store.writer, held[0])       # the deletion the reader asked for, applied now
        assert path.exists() and store.stats().bad_keys_deleted == 0
        assert assert_served_equal(store, blocks).count == 3


# -- sharing ---------------------------------------------------------------------------------------

def test_another_processes_writes_are_found_and_its_evictions_are_misses(tmp_path):
    blocks = Blocks(FP, 8, seed=8)
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as a, DiskBlockStore(tmp_path, FP, 10**6, FAST) as b:
        written(b, blocks)
        assert a.stats().index_blocks == 0
        assert a.probe(blocks.chain) == 8 and a.stats().learned == 8        # stat on each miss
        assert assert_served_equal(a, blocks).count == 8
        os.unlink(b.layout.block_path(blocks.chain[5]))                     # b (or anyone) evicts
        got = a.fetch(blocks.chain, 0, 8)
        assert got.count == 5 and got.stop == "miss" and a.stats().vanished == 1
        assert a.probe(blocks.chain) == 5


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_file_evicted_while_open_ahead_is_still_read_whole_and_no_descriptor_leaks(tmp_path):
    blocks = Blocks(FP, 10, seed=10)
    with DiskBlockStore(tmp_path, FP, 10**6, DiskStoreConfig(fsync="none", read_ahead=4)) as store:
        written(store, blocks)
        paths = [store.layout.block_path(h) for h in blocks.chain]
        before = _open_fds()
        with RunReader(paths, 4, assume_cold=True) as reader:
            assert reader.reading_ahead           # as on a cold page cache
            first = reader.read()                 # opens files 0-3
            os.unlink(paths[2])                   # another process evicts file 2 meanwhile
            second, third = reader.read(), reader.read()
            assert isinstance(first, bytes) and isinstance(second, bytes)
            assert third == encode(FP, blocks.chain[2], blocks.chain[1], blocks.payloads[2], blocks.contents[2])
        assert _open_fds() == before
        got = store.fetch(blocks.chain, 0, 10, blocks.contents)      # 2 is gone now: a miss
        assert got.count == 2 and got.stop == "miss" and _open_fds() == before
        _flip(Path(paths[5]), -1)
        written(store, blocks)
        assert store.fetch(blocks.chain, 0, 10, blocks.contents).stop == Reject.PAYLOAD_CHECKSUM
        assert _open_fds() == before              # the files opened ahead of the refused one are closed


def test_racing_writers_of_one_block_leave_one_complete_value_and_an_exact_ledger(tmp_path):
    blocks = Blocks(FP, 64, seed=9)
    stores = [DiskBlockStore(tmp_path, FP, 10**6, FAST) for _ in range(3)]
    for store in stores:
        store.put(blocks.chain, 0, blocks.payloads, blocks.contents)
    for store in stores:
        assert store.flush()
    writes = sum(s.stats().writes for s in stores)
    skipped = sum(s.stats().skipped_present for s in stores)
    assert writes == 64 and skipped == 2 * 64
    assert stores[0].stats().used_bytes == namespace_bytes(stores[0]) == sum(value_size(blocks, i) for i in range(64))
    for store in stores:
        assert assert_served_equal(store, blocks).count == 64
        store.close()


def test_two_processes_sharing_one_directory_serve_only_what_was_written(tmp_path):
    capacity = 40 * value_size(Blocks(FP, 1, seed=1), 0)          # 4 chains of 24 blocks: both evict
    procs = [child(tmp_path, mode="share", seeds=(11, 12, 13, 14), blocks=24, rounds=40, capacity=capacity,
                   rng=r) for r in (1, 2)]
    reports = [finished(p, 120) for p in procs]
    for report in reports:
        assert report["bad"] == 0 and report["rejected"] == {} and report["loaded"] > 0, report
    assert sum(r["evictions"] for r in reports) > 0
    with DiskBlockStore(tmp_path, FP, capacity, FAST) as store:
        assert namespace_bytes(store) <= capacity
        for seed in (11, 12, 13, 14):
            got = assert_served_equal(store, Blocks(FP, 24, seed=seed))
            assert got.stop in (None, "miss")


# -- bounds ----------------------------------------------------------------------------------------

def test_capacity_is_never_exceeded_and_eviction_is_least_recently_used(tmp_path):
    chains = [Blocks(FP, 10, seed=20 + i) for i in range(4)]        # 40 distinct blocks
    one = value_size(chains[0], 0)
    capacity = 10 * one + one // 2                                    # 10 blocks fit
    with DiskBlockStore(tmp_path, FP, capacity, FAST) as store:
        for b in chains:
            for start in range(0, 10, 3):
                written(store, b, start, min(10, start + 3))
                assert namespace_bytes(store) <= capacity
                assert store.stats().used_bytes == namespace_bytes(store)
        assert store.stats().evictions == 30 and store.probe(chains[3].chain) == 10
        # LRU: read blocks 0-2 of the newest chain, then write 3 more: blocks 3-5 go first
        assert store.fetch(chains[3].chain, 0, 3).count == 3
        written(store, chains[0], 0, 3)
        last = chains[3].chain
        present = [os.path.exists(store.layout.block_path(h)) for h in last]
        assert present == [True] * 3 + [False] * 3 + [True] * 4
        assert store.index.order()[:4] == last[6:10]
        assert store.capacity_blocks() >= 10


def test_a_restart_keeps_the_bound_and_recounts_the_ledger(tmp_path):
    blocks = Blocks(FP, 20, seed=30)
    one = value_size(blocks, 0)
    with DiskBlockStore(tmp_path, FP, 100 * one, FAST) as store:
        written(store, blocks)
    ledger = tmp_path / FP.hex / "usage"
    ledger.write_bytes(b"garbage")                                  # a damaged ledger is recounted
    with DiskBlockStore(tmp_path, FP, 5 * one, FAST) as small:     # reopened smaller: the next write evicts
        assert small.stats().used_bytes == 20 * one
        written(small, Blocks(FP, 1, seed=31))
        assert namespace_bytes(small) <= 5 * one and small.stats().evictions == 16


def _mount_tmpfs(where: Path, size: str) -> None:
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired) as exc:
        pytest.skip(f"no mount command here ({exc}); test_write_errors_are_dropped_and_counted covers the path")
    if done.returncode:
        pytest.skip(f"mounting a tmpfs is not permitted here ({done.stderr.strip()}); "
                    "test_write_errors_are_dropped_and_counted covers the write path")


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "small"
    _mount_tmpfs(mount, "256k")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_full_disk_drops_writes_counts_them_and_serves_the_rest(small_disk):
    chains = [Blocks(FP, 50, seed=40 + i) for i in range(3)]        # 150 files of 4 KiB pages: > 256 KiB
    with DiskBlockStore(small_disk, FP, 10**7, FAST) as store:
        for b in chains:
            written(store, b)
        s = store.stats()
        assert s.dropped.get("no_space", 0) > 0 and s.writes + s.dropped["no_space"] == 150
        assert s.write_errors == 0
        assert s.used_bytes == namespace_bytes(store)
        got = assert_served_equal(store, chains[0])
        assert got.count > 0
    assert not list(small_disk.rglob("*.tmp"))


def test_a_read_only_disk_drops_writes_and_serves_what_it_holds(small_disk):
    # A store keeps its ledger open for writing, which a remount refuses ("busy"): the store that is
    # open when a disk turns read-only is test_write_errors_are_dropped_and_counted's EROFS case.
    blocks = Blocks(FP, 6, seed=50)
    with DiskBlockStore(small_disk, FP, 10**6, FAST) as store:
        written(store, blocks, 0, 3)
    done = subprocess.run(["mount", "-o", "remount,ro", str(small_disk)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(f"cannot remount read-only: {done.stderr.strip()}")
    try:
        with DiskBlockStore(small_disk, FP, 10**6, FAST) as reader:
            assert reader.put(blocks.chain, 3, blocks.payloads[3:], blocks.contents[3:]) == 0
            assert reader.flush() and reader.stats().dropped == {"read_only": 3}
            assert assert_served_equal(reader, blocks).count == 3
            damaged = reader.fetch(blocks.chain, 0, 3, [b"other"] * 3)       # cannot be deleted: counted
            assert damaged.stop == Reject.CONTENT and reader.flush()
            assert reader.stats().deletes_dropped == 1
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_disk)], capture_output=True)


@pytest.mark.parametrize("code, reason", [(errno.ENOSPC, "no_space"), (errno.EDQUOT, "no_space"),
                                          (errno.EROFS, "read_only"), (errno.EACCES, "permission"),
                                          (errno.EIO, "io_error")])
def test_write_errors_are_dropped_and_counted(tmp_path, monkeypatch, code, reason):
    blocks = Blocks(FP, 5, seed=60)

    def refuse(fd, data):
        raise OSError(code, os.strerror(code))

    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store:
        written(store, blocks, 0, 2)
        monkeypatch.setattr(DiskWriter, "_write_all", staticmethod(refuse))
        assert store.put(blocks.chain, 2, blocks.payloads[2:], blocks.contents[2:]) == 3   # queued: no raise
        assert store.flush()
        s = store.stats()
        assert s.dropped == {reason: 3} and s.writes == 2 and s.write_errors == 0
        assert not list(tmp_path.rglob("*.tmp")) and s.used_bytes == namespace_bytes(store)
        assert store.probe(blocks.chain) == 2


def test_a_full_queue_drops_and_put_never_waits_on_a_stuck_disk(tmp_path, monkeypatch):
    import threading

    blocks = Blocks(FP, 40, seed=61)
    release = threading.Event()
    write_one = DiskWriter._write_one
    monkeypatch.setattr(DiskWriter, "_write_one", lambda self, item: release.wait(30) and write_one(self, item))
    with DiskBlockStore(tmp_path, FP, 10**6, DiskStoreConfig(fsync="none", queue_blocks=8, batch_blocks=1)) as store:
        t0 = time.perf_counter()
        assert store.put(blocks.chain, 0, blocks.payloads, blocks.contents) == 8       # the rest: dropped
        assert store.put(blocks.chain, 0, blocks.payloads[:2], blocks.contents[:2]) == 0   # still pending
        assert time.perf_counter() - t0 < 1.0
        assert not store.flush(0.05)                                                   # the disk is stuck
        s = store.stats()
        assert s.dropped_full == 32 and s.dropped_duplicate == 2 and s.queued == 8
        release.set()
        assert store.flush() and store.stats().writes == 8 and store.probe(blocks.chain) == 8


# -- arguments -------------------------------------------------------------------------------------

def test_bad_arguments_are_refused_naming_the_argument_before_any_state_changes(tmp_path):
    blocks = Blocks(FP, 4, seed=70)
    a_file = tmp_path / "file"
    a_file.write_text("x")
    fresh = tmp_path / "fresh"
    cases = [(lambda: DiskBlockStore(a_file, FP, 10**6), "path"),
             (lambda: DiskBlockStore(fresh, FP, 0), "capacity_bytes"),
             (lambda: DiskBlockStore(fresh, FP, 100), "capacity_bytes"),
             (lambda: DiskBlockStore(fresh, FP, 10**6 + 0.5), "capacity_bytes"),
             (lambda: DiskBlockStore(fresh, FP, True), "capacity_bytes"),
             (lambda: DiskBlockStore(fresh, "fp", 10**6), "fingerprint"),
             (lambda: DiskBlockStore(fresh, FP, 10**6, DiskStoreConfig(fsync="always")), "fsync"),
             (lambda: DiskBlockStore(fresh, FP, 10**6, DiskStoreConfig(queue_blocks=0)), "queue_blocks")]
    for build, name in cases:
        with pytest.raises(InvalidArgument, match=name):
            build()
    assert not fresh.exists()
    with DiskBlockStore(tmp_path / "ok", FP, 10**6, FAST) as store:
        calls = [(lambda: store.put(blocks.chain, 0, [b"short"]), "payloads"),
                 (lambda: store.put(blocks.chain, 0, blocks.payloads[:2] + [b"x" * 10]), "payloads"),
                 (lambda: store.put(blocks.chain, 3, blocks.payloads[:2]), "start"),
                 (lambda: store.put(blocks.chain, -1, blocks.payloads[:1]), "start"),
                 (lambda: store.put(blocks.chain[:1] + [b"short"], 0, blocks.payloads[:2]), "chain"),
                 (lambda: store.put(blocks.chain, 0, blocks.payloads[:2], blocks.contents[:1]), "contents"),
                 (lambda: store.put(blocks.chain, 0, blocks.payloads[:1], [[1, 2]]), "contents"),
                 (lambda: store.set_many(blocks.chain[:2], blocks.payloads[:1]), "payloads"),
                 (lambda: store.set_many(blocks.chain[:1], blocks.payloads[:1], parent=b"x"), "parent"),
                 (lambda: store.fetch(blocks.chain, 0, 4, blocks.contents[:1]), "contents"),
                 (lambda: store.fetch(blocks.chain, 1.0, 4), "start"),
                 (lambda: store.probe([b"x"] * 3), "chain"),
                 (lambda: store.exists_leading(["a"]), "keys"),
                 (lambda: store.get_many(blocks.chain[:2], parent="x"), "parent"),
                 (lambda: store.flush(-1), "timeout_s"),
                 (lambda: store.clear("nothex"), "fingerprint_hex")]
        for call, name in calls:
            with pytest.raises(InvalidArgument, match=name):
                call()
        assert store.flush()
        s = store.stats()
        assert s.puts == s.queued == s.writes == 0 and s.index_blocks == 0 and namespace_bytes(store) == 0
    with pytest.raises(StoreClosed):
        store.probe(blocks.chain)
    with pytest.raises(StoreClosed):
        store.put(blocks.chain, 0, blocks.payloads)
    store.close()                                                      # twice: a no-op


def test_clear_deletes_one_namespace_or_all(tmp_path):
    blocks = Blocks(FP, 5, seed=80)
    with DiskBlockStore(tmp_path, FP, 10**6, FAST) as store, \
            DiskBlockStore(tmp_path, OTHER_FP, 10**6, FAST) as other:
        written(store, blocks)
        written(other, blocks)
        assert store.clear(OTHER_FP.hex) == 5
        assert store.probe(blocks.chain) == 5
        assert other.fetch(blocks.chain, 0, 5).stop == "miss" and other.probe(blocks.chain) == 0
        assert store.clear() == 5
        assert store.probe(blocks.chain) == 0 and store.stats().used_bytes == 0
        written(store, blocks)                                         # the folders are made again
        assert assert_served_equal(store, blocks).count == 5


# -- the index against a model -----------------------------------------------------------------------

_MODEL_BLOCKS = Blocks(FP, 12, seed=90)
_OPS = st.lists(st.one_of(st.tuples(st.just("put"), st.integers(0, 11)),
                          st.tuples(st.just("fetch"), st.integers(0, 11)),
                          st.tuples(st.just("reopen"), st.just(0))), max_size=40)


@settings(max_examples=1000 if LONG else 100, deadline=None)
@given(_OPS)
def test_the_index_follows_a_model_lru_through_puts_fetches_and_restarts(ops):
    blocks = _MODEL_BLOCKS
    one = value_size(blocks, 0, contents=False)
    capacity = 5 * one
    with tempfile.TemporaryDirectory() as path:
        store = DiskBlockStore(path, FP, capacity, FAST)
        model: OrderedDict[int, None] = OrderedDict()
        try:
            for op, i in ops:
                if op == "put":
                    store.put(blocks.chain, i, [blocks.payloads[i]])
                    assert store.flush()
                    if i not in model:
                        while len(model) >= 5:
                            model.popitem(last=False)
                    model[i] = None
                    model.move_to_end(i)
                elif op == "fetch":
                    got = store.fetch(blocks.chain, i, i + 1)
                    assert got.count == (i in model)
                    if got.count:
                        assert got.payloads[0].tobytes() == blocks.payloads[i]
                        model.move_to_end(i)
                else:
                    store.close()
                    store = DiskBlockStore(path, FP, capacity, FAST)
                    order = [blocks.chain.index(h) for h in store.index.order()]
                    assert set(order) == set(model)
                    model = OrderedDict.fromkeys(order)     # restart order is write time: adopt it
                on_disk = {j for j in range(12) if os.path.exists(store.layout.block_path(blocks.chain[j]))}
                assert on_disk == set(model)
                assert [blocks.chain.index(h) for h in store.index.order()] == list(model)
                assert store.stats().used_bytes == len(model) * one <= capacity
        finally:
            store.close()
