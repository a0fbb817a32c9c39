"""pytest-benchmark faces of benches/redis_tier_bench.py (the one-run ratio report lives there).

    .venv/bin/pytest benches/test_bench_tier_redis.py --benchmark-only --benchmark-columns=min,median
    .venv/bin/python benches/redis_tier_bench.py        # tier vs raw MGET in one run, with targets

Each bench checks what it timed (blocks loaded, blocks counted, breaker open). Skipped, with
the reason, where redis-server is missing.
"""

from __future__ import annotations

import shutil
import socket

import pytest

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None,
                                reason="redis-server is not installed (apt-get install -y redis-server)")
redis = pytest.importorskip("redis")

from redis_tier_bench import READ_FP, SMALL_FP, Blocks, RedisServer  # noqa: E402

from prefixkv.tiers.redis_store import RedisBlockStore, RedisStoreConfig  # noqa: E402

BLOCKS = 64


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = RedisServer(tmp_path_factory.mktemp("bench-redis"), maxmemory="1gb").start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def read_data(server):
    data = Blocks(READ_FP, BLOCKS, seed=1)
    with RedisBlockStore(server.url, READ_FP) as store:
        store.put(data.chain, 0, data.payloads, data.contents)
        assert store.flush(60) and store.probe(data.chain) == BLOCKS
    return data


def test_tier_fetch_64_blocks_verified(benchmark, server, read_data):
    with RedisBlockStore(server.url, READ_FP) as store:
        got = benchmark(store.fetch, read_data.chain, 0, BLOCKS, read_data.contents)
        assert got.count == BLOCKS and got.payloads[7].tobytes() == read_data.payloads[7]


def test_raw_redis_py_mget_same_bytes(benchmark, server, read_data):
    with RedisBlockStore(server.url, READ_FP) as store:
        batches = [store.keys.keys(read_data.chain, a, b) for a, b in store.keys.group_ranges(0, BLOCKS)]
    client = redis.Redis.from_url(server.url)

    def run():       # the values handed out together, as fetch's are
        return [v for keys in batches for v in client.mget(keys)]

    assert sum(len(v) for v in benchmark(run)) > BLOCKS * READ_FP.block_bytes
    client.close()


@pytest.mark.parametrize("mode", ["lua", "exists"])
def test_probe_64_blocks(benchmark, server, mode):
    data = Blocks(SMALL_FP, BLOCKS, seed=2)
    with RedisBlockStore(server.url, SMALL_FP, RedisStoreConfig(probe_mode=mode)) as store:
        store.put(data.chain, 0, data.payloads)
        assert store.flush()
        assert benchmark(store.probe, data.chain) == BLOCKS


def test_probe_while_the_breaker_is_open(benchmark):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]          # nothing listens there once closed
    data = Blocks(SMALL_FP, BLOCKS, seed=3)
    with RedisBlockStore(f"redis://127.0.0.1:{port}/0", SMALL_FP) as store:
        store.probe(data.chain)
        assert benchmark(store.probe, data.chain) == 0
        assert store.stats().nodes_down == 1
