"""Drive SGLang 0.5.23's real HiCacheController with prefixkv's HiCache backend (issue 27).

Run under the SGLang venv (tests/engines/test_sglang.py does, one process per step):

    python sglang_hicache.py write  SPEC.json   # fill host pages, write_storage, wait for the backup
    python sglang_hicache.py read   SPEC.json   # a fresh process: prefetch, compare bytes with `write`'s

SPEC.json: {"store": ..., "layouts": [...], "model": ..., "pages": N, "salt": ..., "out": DIR,
"extra": {...more extra config}, "seed": int, "damage": [{"layout", "page", "how", "from_model"}],
"expect_model": ...}. Each step handles every layout in turn (a controller each) and prints one
JSON line, per layout, as its last line. ``damage`` (read only) damages stored pages first
(``damage.py``).
The controller is the engine's own (a single-rank gloo group, as SGLang builds for TP 1); the
host pool is a real MHATokenToKVPoolHost on CPU tensors; the scheduler's part of a prefetch
(allocating host slots for the hit, handing the operation to the I/O thread) is done here as
SGLang's radix cache does it.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "stubs"))      # the test-only torchvision stub (see stubs/torchvision)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

LAYERS, HEADS, HEAD_DIM, PAGE = 4, 2, 16, 8
DTYPE = torch.bfloat16


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def build(spec: dict):
    from sglang.srt.managers.cache_controller import HiCacheController
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    from sglang.srt.runtime_context import get_parallel

    if not dist.is_initialized():
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    tokens = 64 * PAGE
    device_pool = MHATokenToKVPool(tokens, PAGE, DTYPE, HEADS, HEAD_DIM, LAYERS, "cpu", False,
                                   start_layer=0, end_layer=LAYERS - 1)
    allocator = PagedTokenToKVPoolAllocator(tokens, PAGE, DTYPE, "cpu", device_pool, False)
    host = MHATokenToKVPoolHost(device_pool.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, spec["layout"],
                                pin_memory=False, device="cpu", device_capacity_tokens=device_pool.size,
                                start_layer=device_pool.start_layer, end_layer=device_pool.end_layer,
                                write_back_staging=device_pool.hicache_write_back_staging)
    extra = {"backend_name": "prefixkv", "module_path": "prefixkv.integrations.sglang",
             "class_name": "PrefixKVHiCacheStorage", "interface_v1": spec.get("interface_v1", 1),
             "store": spec["store"], **spec.get("extra", {})}
    group = dist.new_group([0], backend="gloo")
    parallel = get_parallel()
    parallel.override_permanently(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_dcp_size=1, attn_dcp_rank=0)
    cc = HiCacheController(allocator, host, PAGE, group, threading.Event(), io_backend="direct",
                           storage_backend="dynamic", prefetch_threshold=PAGE, model_name=spec["model"],
                           storage_backend_extra_config=extra)
    return cc, host


def keys_for(spec: dict, tokens: list[int]) -> tuple[str | None, list[str]]:
    from sglang.srt.mem_cache.utils import get_storage_hash_str, storage_namespace_seed

    seed = storage_namespace_seed(None, spec.get("salt"))
    return seed, get_storage_hash_str(tokens, seed, page_size=PAGE)


def tokens_for(spec: dict) -> list[int]:
    rng = np.random.default_rng(spec.get("seed", 0))
    return [int(t) for t in rng.integers(0, 32000, spec["pages"] * PAGE)]


def pages_of(host, indices) -> list[bytes]:
    return [host.get_data_page(int(indices[j * PAGE]), flat=True).view(torch.uint8).numpy().tobytes()
            for j in range(len(indices) // PAGE)]


def stats_of(cc) -> dict:
    s = cc.storage_backend.prefixkv_stats()
    st = s.pop("store")
    keep = ("writes", "rejected", "dropped", "dropped_down", "short_circuits", "read_errors", "breaker_opens",
            "skipped_present", "blocks_loaded", "fetch_misses")
    return {**s, "store": {k: st[k] for k in keep if k in st}}


def write_layout(spec: dict, layout: str) -> dict:
    spec = {**spec, "layout": layout}
    cc, host = build(spec)
    tokens = tokens_for(spec)
    _, keys = keys_for(spec, tokens)
    n = spec["pages"] * PAGE
    indices = host.alloc(n)
    gen = torch.Generator().manual_seed(spec.get("seed", 0))
    host.kv_buffer.copy_(torch.randn(host.kv_buffer.shape, generator=gen).to(DTYPE))
    expected = pages_of(host, indices)
    t0 = time.perf_counter()
    cc.write_storage(indices, tokens, hash_value=keys)
    op = cc.ack_backup_queue.get(timeout=60)
    backup_s = time.perf_counter() - t0
    flushed = cc.storage_backend.store.flush(30)
    out = {"completed_tokens": op.completed_tokens, "flushed": flushed, "backup_s": backup_s,
           "stats": stats_of(cc), "fingerprint": cc.storage_backend.store.fingerprint.hex}
    os.makedirs(spec["out"], exist_ok=True)
    np.save(os.path.join(spec["out"], f"pages-{spec['model']}-{layout}.npy"),
            np.frombuffer(b"".join(expected), dtype=np.uint8))
    cc.detach_storage_backend()
    return out


def backend_for(spec: dict, host, model: str):
    """Another PrefixKVHiCacheStorage on the same store, for another model (to read its values)."""
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from prefixkv.integrations.sglang import PrefixKVHiCacheStorage

    extra = {"store": spec["store"], **spec.get("extra", {})}
    cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                               is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=host.layout == "page_first", model_name=model, extra_config=extra)
    backend = PrefixKVHiCacheStorage(cfg, {})
    backend.register_mem_pool_host(host)
    return backend


def read_layout(spec: dict, layout: str) -> dict:
    spec = {**spec, "layout": layout}
    cc, host = build(spec)
    tokens = tokens_for(spec)
    seed, keys = keys_for(spec, tokens)
    for d in spec.get("damage", []):
        if d["layout"] == layout:
            from damage import damage

            other = backend_for(spec, host, d["from_model"]).store if d["how"] == "foreign" else None
            damage(cc.storage_backend.store, keys[d["page"]].encode(), d["how"], other)
            if other is not None:
                other.close()
    t0 = time.perf_counter()
    op = cc.prefetch("req-0", tokens, last_hash=seed)
    hit = cc.prefetch_hit_queue.get(timeout=60)
    assert hit is op
    out = {"hit_tokens": op.storage_hit_count, "query_s": time.perf_counter() - t0, "completed_tokens": 0}
    loaded: list[bytes] = []
    if op.storage_hit_count:
        op.host_indices = host.alloc(op.storage_hit_count)
        cc.prefetch_buffer.put(op)
        completed = 0
        while True:
            ack = cc.ack_prefetch_queue.get(timeout=60)
            if ack.completed_tokens is not None:
                completed = max(completed, ack.completed_tokens)
            if getattr(ack, "completed_req", False):
                break
        out["completed_tokens"] = completed
        loaded = pages_of(host, op.host_indices[:completed])
    out["prefetch_s"] = time.perf_counter() - t0
    path = os.path.join(spec["out"], f"pages-{spec.get('expect_model', spec['model'])}-{layout}.npy")
    if os.path.exists(path):
        expected = np.load(path).tobytes()
        page_bytes = len(expected) // spec["pages"]
        out["bytes_equal"] = [loaded[j] == expected[j * page_bytes:(j + 1) * page_bytes] for j in range(len(loaded))]
    out["stats"] = stats_of(cc)
    out["fingerprint"] = cc.storage_backend.store.fingerprint.hex
    port = getattr(cc.storage_backend, "metrics_port", None)
    if port is not None:          # what Prometheus would scrape from this process
        import urllib.request

        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        out["metrics"] = [line for line in text.splitlines() if line.startswith("prefixkv_engine_")]
    cc.detach_storage_backend()
    return out


def write(spec: dict) -> dict:
    return {layout: write_layout(spec, layout) for layout in spec["layouts"]}


def read(spec: dict):
    """Every layout; with ``runs`` (a list of spec overrides: another model, salt, damage), each run in turn."""
    if "runs" not in spec:
        return {layout: read_layout(spec, layout) for layout in spec["layouts"]}
    out = []
    for run in spec["runs"]:
        each = {**spec, **run}
        out.append({layout: read_layout(each, layout) for layout in each["layouts"]})
    return out


def main() -> None:
    step, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"write": write, "read": read}[step](spec)
    sys.stdout.flush()
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)      # the controller's daemon threads and the gloo group need no orderly teardown


if __name__ == "__main__":
    main()
