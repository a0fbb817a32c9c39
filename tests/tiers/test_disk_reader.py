"""How a disk fetch reads its files: one open and one read per file on a warm page cache, read-ahead
only where the cache is cold, every value whole, no descriptor left open.

The page cache's state is what ``preadv(..., RWF_NOWAIT)`` answers; these tests make it answer
"cached", "not cached" (``EAGAIN``) or "not supported" (``EOPNOTSUPP``, as tmpfs does) so that
each path runs on any filesystem, and one test drops real pages where the filesystem allows it.
"""

from __future__ import annotations

import errno
import os
import time

import numpy as np
import pytest

from redis_fixtures import Blocks

from prefixkv.tiers import disk_reader
from prefixkv.tiers.block_codec import Reject, encode
from prefixkv.tiers.disk_reader import RunReader
from prefixkv.tiers.disk_store import DiskBlockStore, DiskStoreConfig
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)
FAST = DiskStoreConfig(fsync="none", read_ahead=4)


class Syscalls:
    """Counts the reader's ``fstat`` / ``posix_fadvise`` calls and answers its page-cache probes:
    ``cached(position_of_probe)`` -> True (cached), False (EAGAIN) or None (EOPNOTSUPP)."""

    def __init__(self, monkeypatch, cached=lambda n: True):
        self.fstat = self.advised = self.probes = 0
        self.cached = cached
        real_fstat, real_advise = os.fstat, os.posix_fadvise

        def fstat(fd):
            self.fstat += 1
            return real_fstat(fd)

        def advise(fd, offset, length, advice):
            self.advised += 1
            return real_advise(fd, offset, length, advice)

        def preadv(fd, buffers, offset, flags=0):
            assert flags == os.RWF_NOWAIT and len(buffers) == 1 and len(buffers[0]) == 1   # probes only
            answer = self.cached(self.probes)
            self.probes += 1
            if answer is None:
                raise OSError(errno.EOPNOTSUPP, "Operation not supported")
            if not answer:
                raise BlockingIOError(errno.EAGAIN, "Resource temporarily unavailable")
            return 1

        monkeypatch.setattr(disk_reader.os, "fstat", fstat)
        monkeypatch.setattr(disk_reader.os, "posix_fadvise", advise)
        monkeypatch.setattr(disk_reader.os, "preadv", preadv)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.fixture
def stored(tmp_path):
    blocks = Blocks(FP, 12, seed=3)
    store = DiskBlockStore(tmp_path, FP, 10**6, FAST)
    store.put(blocks.chain, 0, blocks.payloads, blocks.contents)
    assert store.flush()
    yield store, blocks
    store.close()


def served(store, blocks, start=0):
    got = store.fetch(blocks.chain, start, len(blocks), blocks.contents[start:])
    assert [p.tobytes() for p in got.payloads] == blocks.payloads[start:start + got.count]
    return got


def test_a_warm_fetch_makes_no_fstat_and_gives_no_advice(stored, monkeypatch):
    store, blocks = stored
    calls = Syscalls(monkeypatch)
    before = _open_fds()
    got = served(store, blocks)
    assert got.count == 12 and got.stop is None
    # one probe every read_ahead-th file (files 0, 4, 8), no fstat (the index knows the sizes), no advice
    assert (calls.fstat, calls.advised, calls.probes) == (0, 0, 3)
    assert store.stats().read_ahead_fetches == 0 and _open_fds() == before


def test_a_cold_cache_switches_to_read_ahead_and_back_when_warm_again(stored, monkeypatch):
    store, blocks = stored
    calls = Syscalls(monkeypatch, cached=lambda n: False)
    before = _open_fds()
    assert served(store, blocks).count == 12
    # every file after the first advised; asked of files 0, 4 and 8
    assert (calls.advised, calls.probes) == (11, 3) and store.stats().read_ahead_fetches == 1
    assert _open_fds() == before
    # cold for the first probe only: files 1-3 advised, file 4 found cached: one file at a time again
    calls = Syscalls(monkeypatch, cached=lambda n: n > 0)
    assert served(store, blocks).count == 12
    assert (calls.advised, calls.probes) == (3, 3) and store.stats().read_ahead_fetches == 2


def test_where_nothing_tells_warm_from_cold_it_always_reads_ahead(stored, monkeypatch):
    store, blocks = stored
    calls = Syscalls(monkeypatch, cached=lambda n: None)      # tmpfs: EOPNOTSUPP
    assert served(store, blocks).count == 12
    assert calls.probes == 1 and calls.advised == 11
    no_read_ahead = DiskBlockStore(store.path, FP, 10**6, DiskStoreConfig(fsync="none", read_ahead=1))
    calls = Syscalls(monkeypatch, cached=lambda n: None)
    assert served(no_read_ahead, blocks).count == 12 and (calls.probes, calls.advised) == (0, 0)
    no_read_ahead.close()


@pytest.mark.parametrize("cache", ["warm", "cold"])
@pytest.mark.parametrize("stop", ["miss", "error", "refused"])
def test_a_run_that_stops_early_closes_every_descriptor(stored, monkeypatch, cache, stop):
    store, blocks = stored
    path = store.layout.block_path(blocks.chain[5])
    if stop == "miss":
        os.unlink(path)
    elif stop == "error":
        os.replace(path, path + ".elsewhere")
        os.symlink(path + ".elsewhere", path)
    else:
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 1
        with open(path, "wb") as f:
            f.write(data)
    calls = Syscalls(monkeypatch, cached=lambda n: cache == "warm")
    before = _open_fds()
    got = served(store, blocks)
    assert got.count == 5 and got.stop == {"miss": "miss", "error": "error", "refused": Reject.PAYLOAD_CHECKSUM}[stop]
    assert _open_fds() == before
    # only a refused value is fstat-ed (its identity, for the deletion)
    assert calls.fstat == (1 if stop == "refused" else 0)
    assert store.flush()
    if stop == "refused":
        assert not os.path.exists(path) and store.stats().bad_keys_deleted == 1


def test_files_of_another_size_than_the_index_knows_are_read_whole(stored, monkeypatch):
    store, blocks = stored
    key = blocks.chain[3]
    size = os.path.getsize(store.layout.block_path(key))
    calls = Syscalls(monkeypatch)
    store.index.touch(key, size - 40)         # a stale size: the file proves bigger, read again whole
    store.index.touch(blocks.chain[4], size + 40)     # bigger than the file: the read says where it ends
    got = served(store, blocks, 3)
    assert got.count == 9 and got.stop is None and calls.fstat == 1
    assert store.index.sizes([key, blocks.chain[4]]) == [size, size]     # the index learnt the real sizes
    # a value rewritten since with its content (a longer file) under a size the index took without it
    path = store.layout.block_path(blocks.chain[6])
    without = encode(FP, blocks.chain[6], blocks.chain[5], blocks.payloads[6], None)
    store.index.touch(blocks.chain[6], len(without))
    assert served(store, blocks, 6).count == 6 and os.path.getsize(path) > len(without)


def test_a_block_the_index_does_not_know_is_sized_by_fstat(stored, monkeypatch):
    store, blocks = stored
    with DiskBlockStore(store.path, FP, 10**6, FAST) as other:
        written = Blocks(FP, 3, seed=4)
        other.put(written.chain, 0, written.payloads, written.contents)
        assert other.flush()
    calls = Syscalls(monkeypatch)
    got = served(store, written)             # no probe first: the index has never heard of them
    assert got.count == 3 and calls.fstat == 3


def test_a_file_replaced_after_it_was_opened_is_read_as_the_old_one_whole(stored):
    store, blocks = stored
    paths = store.layout.block_paths(blocks.chain)
    sizes = store.index.sizes(blocks.chain)
    with RunReader(paths, 4, sizes, assume_cold=True) as reader:
        assert reader.reading_ahead          # as on a cold page cache: files 0-3 open ahead
        assert reader.read() == open(paths[0], "rb").read()
        other = encode(FP, blocks.chain[2], blocks.chain[1], bytes(FP.block_bytes), blocks.contents[2])
        with open(paths[2] + ".new", "wb") as f:
            f.write(other)
        os.replace(paths[2] + ".new", paths[2])     # another writer renames a new value into place
        assert reader.read() == open(paths[1], "rb").read()
        assert reader.read() == encode(FP, blocks.chain[2], blocks.chain[1], blocks.payloads[2], blocks.contents[2])


def test_a_real_cold_cache_is_read_ahead_where_the_filesystem_can_tell(stored):
    store, blocks = stored
    paths = store.layout.block_paths(blocks.chain)
    for attempt in range(5):                 # DONTNEED is advice: a page under writeback may stay
        for path in paths:                   # written back, then dropped from the page cache
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        # Asked of the last file only: a RWF_NOWAIT read that finds no page starts reading it in,
        # so asking of file 0 here would warm the very file the fetch probes first.
        fd = os.open(paths[-1], os.O_RDONLY)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            break
        except OSError as exc:
            pytest.skip(f"this filesystem cannot tell cached pages (RWF_NOWAIT: {exc.strerror})")
        finally:
            os.close(fd)
        time.sleep(0.05)
    else:
        pytest.skip("the kernel kept the pages through 5 tries (DONTNEED is advice)")
    assert served(store, blocks).count == 12 and store.stats().read_ahead_fetches == 1
    assert served(store, blocks).count == 12 and store.stats().read_ahead_fetches == 1   # warm now
