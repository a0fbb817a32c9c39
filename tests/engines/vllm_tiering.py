"""Drive vLLM 0.33.0's real TieringOffloadingManager with prefixkv's secondary tier (issue 27).

Run under the vLLM venv (tests/engines/test_vllm.py does, one process per step):

    python vllm_tiering.py store SPEC.json   # GPU->CPU stores into the primary tier, cascaded to prefixkv
    python vllm_tiering.py load  SPEC.json   # a fresh (restarted) manager: lookups until HIT, promoted bytes

SPEC.json: {"tier": {...prefixkv tier options: "store", ...}, "model": ..., "chunks": N, "salt": ...,
"out": DIR, "seed": int, "scheduler": bool}. Each step prints one JSON line as its last line.

The manager is built by vLLM's own ``TieringOffloadingSpec`` (the OffloadingConnector's spec) from
the ``OffloadingConfig`` that vLLM's ``Scheduler`` normalises: with ``"scheduler": true`` the
script builds a real ``Scheduler`` from a local model ``config.json`` (``skip_tokenizer_init``)
with the OffloadingConnector, and drives the manager that scheduler's connector holds. Keys are
vLLM's own block hashes of a real ``Request`` (``cache_salt`` included), one block per chunk;
what the GPU->CPU worker would copy is written into the primary view's rows here.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time

import numpy as np

BLOCK = 16          # tokens per block (= per chunk: blocks_per_chunk 1)
CPU_BYTES = 64 * 2**20


def model_dir() -> str:
    """A tiny local Llama config (no weights, no tokenizer: the scheduler needs neither)."""
    path = os.path.join(tempfile.gettempdir(), "prefixkv-vllm-tiny-llama")
    os.makedirs(path, exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
              "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
              "vocab_size": 1000, "max_position_embeddings": 2048, "torch_dtype": "bfloat16", "rms_norm_eps": 1e-5}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    return path


def extra_config(spec: dict) -> dict:
    tier = {"type": "PrefixKVTier", "module_path": "prefixkv.integrations.vllm", **spec["tier"]}
    return {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES, "secondary_tiers": [tier],
            "tier_poll_interval_s": 0}


def manager_from_config(spec: dict):
    """The OffloadingConfig vLLM's Scheduler would hand the spec, written out (2 layers, bf16)."""
    from vllm.v1.kv_offload.config import (OffloadingCacheConfig, OffloadingConfig, OffloadingGroupConfig,
                                           OffloadingModelConfig, OffloadingParallelConfig)
    from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

    config = OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BLOCK, layer_names=("layers.0.attn", "layers.1.attn"),
                                      group_id=0),),
        worker_kv_bytes_per_block=2 * 2 * BLOCK * 2 * 16 * 2, enable_kv_cache_events=False,
        extra_config=extra_config(spec), engine_id=f"prefixkv-test-{os.getpid()}",
        model=OffloadingModelConfig(name=spec["model"], dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BLOCK, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                          is_parallelism_agnostic=False))
    return TieringOffloadingSpec(config).get_manager(), None


def manager_from_scheduler(spec: dict):
    """A real vLLM Scheduler with the OffloadingConnector; its connector's manager."""
    from vllm.config import (CacheConfig, DeviceConfig, KVTransferConfig, ModelConfig, SchedulerConfig,
                             VllmConfig)
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.structured_output import StructuredOutputManager
    import torch

    model = ModelConfig(model=model_dir(), skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024,
                        served_model_name=spec["model"])
    vllm_config = VllmConfig(
        model_config=model, cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=True),
        scheduler_config=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=1024, max_model_len=1024,
                                         is_encoder_decoder=False),
        device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
                                            kv_connector_extra_config=extra_config(spec)))
    blocks = 64
    layer_spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype=torch.bfloat16)
    kv_cache_config = KVCacheConfig(
        num_blocks=blocks,
        kv_cache_tensors=[KVCacheTensor(size=layer_spec.page_size_bytes * blocks, layers=[f"layers.{i}.attn"],
                                        layer_stride=layer_spec.page_size_bytes * blocks,
                                        block_stride=layer_spec.page_size_bytes) for i in range(2)],
        kv_cache_groups=[KVCacheGroupSpec(["layers.0.attn", "layers.1.attn"], layer_spec)])
    vllm_config.cache_config.num_gpu_blocks = blocks
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kv_cache_config,
                          structured_output_manager=StructuredOutputManager(vllm_config), block_size=BLOCK,
                          log_stats=False)
    connector = scheduler.connector
    manager = connector.connector_scheduler.manager
    return manager, scheduler


def build(spec: dict):
    return (manager_from_scheduler if spec.get("scheduler") else manager_from_config)(spec)


def request_keys(spec: dict) -> list[bytes]:
    """vLLM's block hashes of a real Request (cache_salt in the first block's extra keys)."""
    from vllm import SamplingParams
    from vllm.utils.hashing import sha256_cbor
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.kv_offload.base import make_offload_key
    from vllm.v1.request import Request

    init_none_hash(sha256_cbor)
    rng = np.random.default_rng(spec.get("seed", 0))
    tokens = [int(t) for t in rng.integers(0, 1000, spec["chunks"] * BLOCK)]
    request = Request("req-0", tokens, SamplingParams(max_tokens=1), None, cache_salt=spec.get("salt"),
                      block_hasher=get_request_block_hasher(BLOCK, sha256_cbor))
    return [make_offload_key(bytes(h), 0) for h in request.block_hashes]


def step_until(manager, done, timeout_s: float = 30.0) -> bool:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
        if done():
            return True
        time.sleep(0.005)
    return False


def tier_of(manager):
    return manager.secondary_tiers[0]


def rows(manager) -> np.ndarray:
    view = manager.primary_tier.get_kv_memoryview()
    return np.frombuffer(view, dtype=np.uint8).reshape(-1, view.strides[0])


def stats_of(manager) -> dict:
    s = tier_of(manager).prefixkv_stats()
    st = s.pop("store")
    keep = ("writes", "rejected", "dropped", "dropped_down", "short_circuits", "read_errors", "breaker_opens",
            "blocks_loaded", "fetch_misses", "skipped_present")
    return {**s, "store": {k: st[k] for k in keep if k in st}}


def store(spec: dict) -> dict:
    manager, _scheduler = build(spec)
    try:
        return store_into(spec, manager)
    finally:
        manager.shutdown()


def store_into(spec: dict, manager) -> dict:
    from vllm.v1.kv_offload.base import ReqContext

    keys = request_keys(spec)
    ctx = ReqContext(req_id="req-0")
    manager.on_new_request(ctx)
    out = manager.prepare_store(keys, ctx)
    ids = [int(c) for c in out.store_spec.chunk_ids]
    data = rows(manager)
    rng = np.random.default_rng(spec.get("seed", 0) + 1)
    expected = rng.integers(0, 256, (len(keys), data.shape[1]), dtype=np.uint8)
    data[ids] = expected                          # what the GPU->CPU worker copies
    del data
    manager.complete_store(keys, ctx)
    cascaded = step_until(manager, lambda: not manager.has_pending_work() and tier_of(manager).store.flush(1))
    manager.on_request_finished(ctx)
    result = {"chunks": len(keys), "cascaded": cascaded, "stats": stats_of(manager),
              "fingerprint": tier_of(manager).store.fingerprint.hex}
    os.makedirs(spec["out"], exist_ok=True)
    np.save(os.path.join(spec["out"], f"chunks-{spec['model']}.npy"), expected)
    return result


def load_once(spec: dict) -> dict:
    from vllm.v1.kv_offload.base import ReqContext

    manager, _scheduler = build(spec)
    try:
        keys = request_keys(spec)
        tier = tier_of(manager)
        for d in spec.get("damage", []):
            from damage import damage

            other = None
            if d["how"] == "foreign":
                other_manager, _ = build({**spec, "model": d["from_model"]})
                other = tier_of(other_manager).store
            damage(tier.store, bytes(keys[d["chunk"]]), d["how"], other)
            if other is not None:
                other_manager.shutdown()
        ctx = ReqContext(req_id="req-1")
        manager.on_new_request(ctx)
        t0 = time.perf_counter()
        first = [manager.lookup(k, ctx).name for k in keys]
        verdicts: dict[int, str] = {}

        def resolved() -> bool:
            # as the connector does: chunk by chunk, stopping at the first that is not a hit
            for i, k in enumerate(keys):
                if verdicts.get(i) not in ("HIT", "MISS"):
                    verdicts[i] = manager.lookup(k, ctx).name
                if verdicts[i] != "HIT":
                    return verdicts[i] == "MISS"
            return True

        settled = step_until(manager, resolved, 30.0)
        result = {"first": first, "final": [verdicts.get(i) for i in range(len(keys))], "settled": settled,
                  "settle_s": time.perf_counter() - t0}
        hits = []
        for i, k in enumerate(keys):
            if verdicts.get(i) != "HIT":
                break
            hits.append(k)
        result["hits"] = len(hits)
        expected_path = os.path.join(spec["out"], f"chunks-{spec.get('expect_model', spec['model'])}.npy")
        if hits and os.path.exists(expected_path):
            spec_out = manager.prepare_load(hits, ctx)
            ids = [int(c) for c in spec_out.chunk_ids]
            expected = np.load(expected_path)
            got = rows(manager)[ids]
            result["bytes_equal"] = [bool(np.array_equal(got[i], expected[i])) for i in range(len(ids))]
            del got
            manager.complete_load(hits, ctx)
        manager.on_request_finished(ctx)
        result["stats"] = stats_of(manager)
        result["fingerprint"] = tier.store.fingerprint.hex
        return result
    finally:
        manager.shutdown()


def load(spec: dict):
    """One restarted manager, or with ``runs`` (spec overrides: another model, salt, damage) one per run."""
    if "runs" not in spec:
        return load_once(spec)
    return [load_once({**spec, **run}) for run in spec["runs"]]


def main() -> None:
    step, spec_path = sys.argv[1], sys.argv[2]
    with open(spec_path) as f:
        spec = json.load(f)
    result = {"store": store, "load": load}[step](spec)
    print(json.dumps(result))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
