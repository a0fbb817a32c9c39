"""The stores' by-key faces and the engine adapter under the SGLang / vLLM backends (issue 27),
without the engines: DiskBlockStore's ``chained=False`` and ``exists_each``, RedisBlockStore's
``exists_each`` / ``exists_leading`` / ``get_many`` / ``set_many`` (a single server and a
cluster), ``EngineStore``'s key digests with the whole engine key checked on read, its options'
errors, and its Prometheus series. The engines' own code drives them in tests/engines.
"""

from __future__ import annotations

import os
import urllib.request

import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.integrations.engine_store import (EngineStore, EngineStoreOptions, engine_fingerprint,
                                                engine_key_digest, serve_metrics)
from prefixkv.tiers.block_codec import Reject
from redis_fixtures import (cluster_url, needs_redis, redis_cluster, redis_server, server)  # noqa: F401

FP = dict(engine="test", model="org/model-a", dtype="bfloat16", page_tokens=4, layers=2, kv_heads=2, head_dim=8,
          tp_rank=0, tp_size=1, layout="mha/page_first")


def redis_only(test):
    for mark in needs_redis:
        test = mark(test)
    return test


def fingerprint(**more):
    return engine_fingerprint(**{**FP, **more})


def pages(n: int, size: int, seed: int = 0) -> list[bytes]:
    import random

    rng = random.Random(seed)
    return [rng.randbytes(size) for _ in range(n)]


def keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}-{i:04d}-{'ab' * 30}".encode() for i in range(n)]     # engine keys: longer than a digest


def disk_store(tmp_path, **more) -> EngineStore:
    options = EngineStoreOptions.from_config({"store": f"disk://{tmp_path / 'disk'}", "capacity_bytes": 2**24, **more})
    return EngineStore(options, fingerprint(), engine="test")


@pytest.fixture(params=["disk", pytest.param("redis", marks=needs_redis)])
def store(request, tmp_path):
    if request.param == "disk":
        s = disk_store(tmp_path)
    else:
        srv = request.getfixturevalue("server")
        s = EngineStore(EngineStoreOptions.from_config({"store": srv.url}), fingerprint(), engine="test")
    yield s
    s.close()


def test_fingerprints_name_everything_the_engine_passes():
    base = fingerprint()
    for change in ({"model": "org/model-b"}, {"dtype": "float16"}, {"page_tokens": 8}, {"layout": "mha/page_head"},
                   {"tp_rank": 1, "tp_size": 2}, {"tp_size": 2}, {"engine": "other"}, {"facts": {"pp_rank": 1}}):
        assert fingerprint(**change).digest != base.digest, change
    assert fingerprint().digest == base.digest        # deterministic: every replica computes it alike
    with pytest.raises(InvalidArgument, match="model"):
        fingerprint(model="  ")


def test_pages_round_trip_and_the_leading_run_ends_at_the_first_absent(store):
    k = keys(8)
    data = pages(8, store.page_bytes)
    assert store.leading(k) == 0 and store.present(k) == [False] * 8
    assert store.save(k[:3] + k[4:], data[:3] + data[4:]) == 7
    assert store.flush(10)
    assert store.leading(k) == 3 and store.present(k) == [True] * 3 + [False] + [True] * 4
    got = store.load(k)
    assert got.count == 3 and got.stop == "miss" and [bytes(p) for p in got.payloads] == data[:3]
    got = store.load(k[4:])
    assert got.count == 4 and got.stop is None and [bytes(p) for p in got.payloads] == data[4:]
    s = store.stats()
    assert s["loaded_pages"] == 7 and s["stops"] == {"miss": 1} and s["store"]["writes"] == 7
    # into: each verified page handed over as it is verified, none kept
    seen = []
    got = store.load(k, lambda j, payload: seen.append((j, bytes(payload))))
    assert got.count == 3 and got.payloads == [None] * 3 and seen == list(enumerate(data[:3]))


def test_a_digest_collision_reads_as_a_content_reject_never_as_the_other_page(tmp_path):
    """Two engine keys whose digests collided: the value names its whole engine key, so the
    other key's read refuses it (Reject.CONTENT), counts it and deletes it."""
    store = disk_store(tmp_path)
    a, b = keys(2)
    store.save([a], pages(1, store.page_bytes))
    assert store.flush(10)
    layout = store.store.layout
    os.makedirs(os.path.dirname(layout.block_path(engine_key_digest(b))), exist_ok=True)
    with open(layout.block_path(engine_key_digest(a)), "rb") as f:
        value = f.read()
    # the same bytes under b's name: exactly what a collision of the two digests would leave
    import prefixkv.tiers.block_codec as codec
    fixed = codec._FIXED.size
    size = store.fingerprint.hash_size
    forged = bytearray(value)
    forged[fixed:fixed + size] = engine_key_digest(b)      # the header's block hash says b
    head_end = fixed + 2 * size + len(a)
    forged[head_end:head_end + 8] = codec._CHECK.pack(codec._xxh3_64(bytes(forged[:head_end])))
    with open(layout.block_path(engine_key_digest(b)), "wb") as f:
        f.write(forged)
    got = store.load([b])
    assert got.count == 0 and got.stop == Reject.CONTENT
    assert store.stats()["store"]["rejected"] == {"content": 1}
    store.close()


def test_disk_chained_false_and_exists_each(tmp_path):
    from prefixkv.tiers.disk_store import DiskBlockStore

    fp = fingerprint()
    names = [engine_key_digest(k) for k in keys(4)]
    data = pages(4, fp.block_bytes)
    with DiskBlockStore(tmp_path / "d", fp, 2**24) as store:
        assert store.set_many(names, data, chained=False) == 4 and store.flush()
        assert store.exists_each(names[::-1]) == [True] * 4
        assert store.get_many(names[2:], chained=False).count == 2         # any key alone: parent is the root
        assert store.get_many(names[2:]).stop == Reject.PARENT            # read as a chain: refused
        with pytest.raises(InvalidArgument, match="chained"):
            store.get_many(names, chained=1)


@redis_only
def test_redis_by_key_faces_on_a_cluster(redis_cluster):  # noqa: F811
    from prefixkv.tiers.redis_store import RedisBlockStore

    fp = fingerprint()
    names = [engine_key_digest(k) for k in keys(40)]
    data = pages(40, fp.block_bytes)
    with RedisBlockStore(cluster_url(redis_cluster), fp) as store:
        assert store.set_many(names, data, chained=False) == 40 and store.flush()
        assert store.exists_leading(names) == 40 and store.exists_each(names[::-1]) == [True] * 40
        got = store.get_many(names, chained=False)
        assert got.count == 40 and [bytes(p) for p in got.payloads] == data
        assert store.clear(fp.hex) == 40


@redis_only
def test_redis_chained_keys_read_back_as_a_chain(server):  # noqa: F811
    from prefixkv.tiers.redis_store import RedisBlockStore

    fp = fingerprint()
    names = [engine_key_digest(k) for k in keys(5)]
    data = pages(5, fp.block_bytes)
    with RedisBlockStore(server.url, fp) as store:
        assert store.set_many(names, data) == 5 and store.flush()
        assert store.get_many(names).count == 5
        assert store.get_many(names[1:], parent=names[0]).count == 4
        assert store.get_many(names[1:]).stop == Reject.PARENT      # block 1 is not block 0 of a chain


@pytest.mark.parametrize("config, name", [
    ({}, "store"), ({"store": "s3://bucket"}, "store"), ({"store": "disk://"}, "store"),
    ({"store": "disk:///tmp/x"}, "capacity_bytes"), ({"store": "redis://h", "timeout_s": 0}, "timeout_s"),
    ({"store": "redis://h", "queue_bytes": 0}, "queue_bytes"), ({"store": "redis://h", "colour": 1}, "extra_config"),
    ({"store": "redis://h", "metrics_port": 70000}, "metrics_port"),
])
def test_bad_options_are_refused_by_name(config, name):
    with pytest.raises(InvalidArgument) as info:
        EngineStoreOptions.from_config(config)
    assert info.value.argument == name


def test_prometheus_series(tmp_path):
    store = disk_store(tmp_path)
    store.save(keys(3), pages(3, store.page_bytes))
    store.flush()
    store.load(keys(4))
    _collector, port = serve_metrics(store, 0)
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = f'engine="test",fingerprint="{store.fingerprint.hex}",store="disk"'
    assert f"prefixkv_engine_loaded_pages_total{{{labels}}} 3.0" in text
    assert f"prefixkv_engine_written_pages_total{{{labels}}} 3.0" in text
    assert f"prefixkv_engine_queued_pages_total{{{labels}}} 3.0" in text
    store.close()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_the_engine_modules_say_what_they_need_where_the_engine_is_absent(engine):
    """prefixkv's own venv has neither engine: importing the backend is one clear ImportError."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec(engine) is not None:
        pytest.skip(f"{engine} is installed here")
    proc = subprocess.run([sys.executable, "-c", f"import prefixkv.integrations.{engine}"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: prefixkv.integrations.") and "needs" in last and "README" in last, last
