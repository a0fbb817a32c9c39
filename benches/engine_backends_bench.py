"""SGLang's batch_get_v1 through prefixkv's HiCache backend against raw reads of the same bytes (issue 27).

    bash .ci/install_engines.sh sglang        # the SGLang venv (once)
    MALLOC_MMAP_THRESHOLD_=4194304 MALLOC_TRIM_THRESHOLD_=4294967296 \\
        /tmp/prefixkv-engines/sglang/bin/python benches/engine_backends_bench.py [--pages 128] [--repeat 15]

The glibc settings keep freed values in the heap (as for disk_store_bench.py): without them
every read's 32 MiB of values is fresh mmapped pages, and the page faults (about 20 ms of 25 here)
swamp what is measured, for every reader alike.

A real MHATokenToKVPoolHost (page_first, CPU tensors; 8 layers x 4 KV heads x 128 dims x 16
tokens, bf16 = 256 KiB a page, 32 MiB for 128 pages) and a PrefixKVHiCacheStorage registered on
it, as SGLang builds them. 128 pages are written once (through ``batch_set_v1``), then timed,
runs rotating so other load falls on all alike, medians [min-max] printed:

* Redis (its own redis-server on loopback, started and stopped here): ``batch_get_v1`` of the
  128 pages (an exists-free load: MGETs, every value verified, the engine key compared, the
  bytes copied into the host pool's page regions) against a raw ``MGET`` of the same 128 keys
  through redis-py + hiredis (no checks, no copy). Target: v1 >= 80% of raw throughput.
* Disk (warm page cache): ``batch_get_v1`` against a raw loop opening and reading the same files
  (one ``read`` each, no checks, no copy). Target: v1 >= 80% of raw.
* Engine overhead: ``batch_get_v1`` against prefixkv's own fetch of the same pages: the store's
  ``get_many`` (verified) plus one copy of each payload into a preallocated host array, what
  prefixkv's engine does when it stages blocks in. Target: v1 adds <= 10%.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests", "engines", "stubs"))   # SGLang's torchvision import

import numpy as np  # noqa: E402
import torch  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 8, 4, 128, 16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_pool(pages: int):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    tokens = pages * PAGE
    device = MHATokenToKVPool(tokens, PAGE, torch.bfloat16, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                              start_layer=0, end_layer=LAYERS - 1)
    return MHATokenToKVPoolHost(device.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, "page_first",
                                pin_memory=False, device="cpu", device_capacity_tokens=device.size,
                                start_layer=0, end_layer=LAYERS - 1)


def backend(store: str, host, extra: dict):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from prefixkv.integrations.sglang import PrefixKVHiCacheStorage

    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                               model_name="bench/model", extra_config={"store": store, **extra})
    b = PrefixKVHiCacheStorage(cfg, {})
    b.register_mem_pool_host(host)
    return b


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def summary(name: str, times: list[float], nbytes: int) -> dict:
    med = statistics.median(times)
    return {"name": name, "median_ms": med * 1e3, "min_ms": min(times) * 1e3, "max_ms": max(times) * 1e3,
            "gib_s": nbytes / med / 2**30}


def line(s: dict) -> str:
    return (f"  {s['name']:<44} {s['median_ms']:8.2f} ms [{s['min_ms']:.2f}-{s['max_ms']:.2f}]"
            f"  {s['gib_s']:6.2f} GiB/s")


def rotate(cases: dict, repeat: int) -> dict:
    times = {name: [] for name in cases}
    for name, fn in cases.items():       # one warm-up each
        fn()
    for _ in range(repeat):
        for name, fn in cases.items():
            times[name].append(timed(fn))
    return times


def run(store_url: str, extra: dict, pages: int, repeat: int, raw_case) -> dict:
    host = host_pool(2 * pages)
    b = backend(store_url, host, extra)
    page_bytes = b.store.page_bytes
    keys = [f"{i:064x}" for i in range(1, pages + 1)]
    src = host.alloc(pages * PAGE)
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=torch.Generator().manual_seed(0))
                         .to(torch.bfloat16))
    assert all(b.batch_set_v1(keys, src)) and b.store.flush(60)
    dst = host.alloc(pages * PAGE)
    names = [k.encode() for k in keys]
    # prefixkv's own fetch copies each verified payload into its KV pool: here a torch CPU tensor
    # allocated and touched as the host pool's is, so both write the same kind of memory
    staged = torch.zeros(pages * page_bytes, dtype=torch.uint8).numpy()

    def own():
        got = b.store.load(names)
        assert got.count == pages
        for j, p in enumerate(got.payloads):
            staged[j * page_bytes:(j + 1) * page_bytes] = np.frombuffer(p, dtype=np.uint8)

    def v1():
        assert all(b.batch_get_v1(keys, dst))

    cases = {"raw": raw_case(b, names)}
    if b.store.kind == "disk":
        cases["raw read into the host pool (preadv)"] = disk_raw_into(b, names, dst)
    cases.update({"prefixkv own fetch (get_many + copy)": own, "batch_get_v1": v1})
    times = rotate(cases, repeat)
    for j in range(pages):        # the bench read what it wrote
        assert torch.equal(host.get_data_page(int(src[j * PAGE])), host.get_data_page(int(dst[j * PAGE])))
    nbytes = pages * page_bytes
    out = {name: summary(name, t, nbytes) for name, t in times.items()}
    out["ratio_v1_vs_raw"] = statistics.median(r / v for r, v in zip(times["raw"], times["batch_get_v1"]))
    if "raw read into the host pool (preadv)" in times:
        out["ratio_v1_vs_raw_into_pool"] = statistics.median(
            r / v for r, v in zip(times["raw read into the host pool (preadv)"], times["batch_get_v1"]))
    own_t = times["prefixkv own fetch (get_many + copy)"]
    out["v1_over_own"] = statistics.median(v / o for v, o in zip(times["batch_get_v1"], own_t)) - 1
    b.close()
    return out


def redis_raw(server_url):
    import redis

    client = redis.Redis.from_url(server_url)

    def make(b, names):
        from prefixkv.integrations.engine_store import engine_key_digest

        redis_keys = b.store.store.keys.own_keys([engine_key_digest(n) for n in names])

        def raw():
            values = client.mget(redis_keys)
            assert all(v is not None for v in values)
        return raw
    return make


def disk_raw(b, names):
    from prefixkv.integrations.engine_store import engine_key_digest

    layout = b.store.store.layout
    paths = [layout.block_path(engine_key_digest(n)) for n in names]
    size = os.path.getsize(paths[0])

    def raw():
        values = []
        for p in paths:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                values.append(os.read(fd, size + 1))
            finally:
                os.close(fd)
    return raw


def disk_raw_into(b, names, dst):
    """The least a disk backend can do: each file's payload read (preadv, past its header) straight
    into the page's regions of the host pool; no checks."""
    from prefixkv.integrations.engine_store import engine_key_digest

    layout = b.store.store.layout
    paths = [layout.block_path(engine_key_digest(n)) for n in names]
    size = os.path.getsize(paths[0])
    header = size - b.store.page_bytes
    regions = b._regions(dst, len(names))
    views = [[memoryview((ctypes.c_char * n).from_address(ptr)).cast("B") for ptr, n in page] for page in regions]

    def raw():
        for p, page in zip(paths, views):
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
            try:
                os.preadv(fd, page, header)
            finally:
                os.close(fd)
    return raw


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pages", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--dir", default=None, help="disk store directory (default: a temporary one)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    results = {}
    tmp = tempfile.mkdtemp(prefix="pkv-engine-bench-")
    try:
        disk = args.dir or os.path.join(tmp, "disk")
        results["disk"] = run(f"disk://{disk}", {"capacity_bytes": 4 * 2**30, "fsync": "none"}, args.pages,
                              args.repeat, disk_raw)
        if shutil.which("redis-server"):
            port = free_port()
            proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--maxmemory", "1gb", "--maxmemory-policy", "allkeys-lru",
                                     "--dir", tmp], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                url = f"redis://127.0.0.1:{port}/0"
                deadline = time.monotonic() + 10
                while True:
                    try:
                        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                        break
                    except OSError:
                        if time.monotonic() > deadline:
                            raise
                        time.sleep(0.05)
                results["redis"] = run(url, {}, args.pages, args.repeat, redis_raw(url))
            finally:
                proc.kill()
                proc.wait()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        print(json.dumps(results))
        return
    for store, out in results.items():
        print(f"{store}: {args.pages} pages of {out['raw']['gib_s'] and LAYERS * HEADS * HEAD_DIM * PAGE * 4 // 1024} KiB, "
              f"median of {args.repeat}")
        for name in ("raw", "raw read into the host pool (preadv)", "prefixkv own fetch (get_many + copy)",
                     "batch_get_v1"):
            if name in out:
                print(line(out[name]))
        if "ratio_v1_vs_raw_into_pool" in out:
            print(f"  batch_get_v1 / raw read into the host pool: {out['ratio_v1_vs_raw_into_pool']:.1%}")
        print(f"  batch_get_v1 / raw throughput: {out['ratio_v1_vs_raw']:.1%} (target >= 80%); "
              f"batch_get_v1 over prefixkv's own fetch: {out['v1_over_own']:+.1%} (target <= +10%)")


if __name__ == "__main__":
    main()
