"""prefixkv's verified store as a vLLM secondary offloading tier (vLLM 0.33.0, issue 27).

Configure it behind vLLM's ``OffloadingConnector`` with the tiering spec::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "PrefixKVTier", "module_path": "prefixkv.integrations.vllm",
                                 "store": "redis://127.0.0.1:6379/0"}]}}'

``store`` and the other options are ``EngineStoreOptions``'s (``disk://PATH`` needs
``capacity_bytes``). vLLM's factory passes every other key of the tier's dict to the
constructor, so a misspelt option is refused by name.

How it serves vLLM: the tier runs in the scheduler process, under the tiering manager's lock,
and must not block. ``lookup`` answers from a cache of verdicts filled by vLLM's own
``AsyncLookupManager`` thread (``RETRY`` while a key's lookup is in flight, then ``HIT`` or
``MISS``); ``submit_store`` / ``submit_load`` queue the job for this tier's worker thread, which
copies chunk rows out of (or verified pages into) the primary CPU view by ``chunk_ids``;
``get_finished_jobs`` hands back what the worker finished; ``drain_jobs`` waits for it. A load
stops at the first page that is absent or fails a check: the pages before it are reported as
``successful_keys``, the rest are marked a miss so vLLM does not retry them in a loop.

A page is one chunk row of the primary view (``strides[0]`` bytes) under the digest of vLLM's
``OffloadKey`` (block hash + group index), the whole key checked on read (``engine_store``). The
fingerprint names the model (``model.name``), KV dtype, tokens per hash and blocks per chunk,
the KV groups and their layers, the parallel sizes and rank, the KV layout and the chunk's bytes;
its geometry fields are folded into one row of ``chunk_bytes`` (the real geometry is in the
hashed facts). vLLM's block hashes include ``cache_salt``, so two salts never share a page.

``import prefixkv.integrations.vllm`` needs vLLM: without it the import fails with an
``ImportError`` that says so.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Iterable
from typing import ClassVar

import numpy as np

try:
    from vllm.v1.kv_offload.base import LookupResult, Medium, OffloadKey, ReqContext, RequestOffloadingContext
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob
except ImportError as exc:     # the one place this module needs the engine
    raise ImportError(f"prefixkv.integrations.vllm needs vLLM (0.33.0) installed: {exc}. It is loaded by vLLM's "
                      "TieringOffloadingSpec from a secondary tier's module_path; see prefixkv's README") from exc

from ..errors import InvalidArgument
from .engine_store import EngineStore, EngineStoreOptions, engine_fingerprint, serve_metrics

__all__ = ["PrefixKVTier"]

logger = logging.getLogger("prefixkv.integrations.vllm")

_VLLM_KEYS = ("locality",)


class _Lookups(AsyncLookupManager):
    """vLLM's async lookup machinery; its thread asks the store which keys it holds."""

    def __init__(self, tier: "PrefixKVTier", tier_type: str) -> None:
        super().__init__(tier_type=tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.store.present([bytes(k) for k in keys])


class PrefixKVTier(SecondaryTierManager):
    """A vLLM secondary tier over prefixkv's disk or Redis block store (see the module docstring)."""

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector=None, **options) -> None:
        parsed = EngineStoreOptions.from_config(options, ignore=_VLLM_KEYS)
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        chunk_bytes = self.block_size_bytes
        rows, rem = divmod(primary_kv_view.nbytes, chunk_bytes) if chunk_bytes else (0, 1)
        if rem or not primary_kv_view.contiguous:
            raise InvalidArgument("primary_kv_view", f"expected contiguous rows of {chunk_bytes} bytes, got "
                                                     f"{primary_kv_view.nbytes} bytes")
        if chunk_bytes % 2:
            raise InvalidArgument("primary_kv_view", f"a chunk of {chunk_bytes} bytes is not K and V halves")
        config = offloading_spec.config
        model = config.model.name or parsed.model
        parallel = config.parallel
        facts = {
            "kv_dtype": str(config.model.dtype), "tokens_per_hash": config.cache.tokens_per_hash,
            "blocks_per_chunk": config.cache.blocks_per_chunk, "chunk_bytes": chunk_bytes,
            "worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "groups": [{"tokens_per_block": g.tokens_per_block, "layers": list(g.layer_names), "id": g.group_id}
                       for g in config.groups],
            "pp_size": parallel.pp_size, "pcp_size": parallel.pcp_size, "dcp_size": parallel.dcp_size,
            "world_size": parallel.world_size, "kv_cache_layout": config.kv_cache_layout,
            "canonical_layout": bool(config.canonical_layout), "replicated_layout": bool(config.replicated_layout),
        }
        # the geometry folded into one row of chunk_bytes (int8, one "token", one head): block_bytes
        # must equal the row; the real geometry is in the facts, which the fingerprint hashes
        fingerprint = engine_fingerprint(
            engine="vllm", model=model or "", dtype="int8", page_tokens=1, layers=1, kv_heads=1,
            head_dim=chunk_bytes // 2, tp_rank=parallel.rank % max(1, parallel.tp_size), tp_size=parallel.tp_size,
            layout=f"chunk/{config.kv_cache_layout or 'direct'}", facts=facts)
        self.store = EngineStore(parsed, fingerprint, engine="vllm")
        if parsed.metrics_port is not None:
            try:
                self.metrics, self.metrics_port = serve_metrics(self.store, parsed.metrics_port)
            except Exception:
                self.store.close()
                raise
        self._rows = np.frombuffer(primary_kv_view, dtype=np.uint8).reshape(rows, chunk_bytes)
        self._lookups = _Lookups(self, tier_type)
        self._jobs: queue.Queue = queue.Queue()
        self._finished: queue.SimpleQueue = queue.SimpleQueue()
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._worker = threading.Thread(target=self._run, name=f"prefixkv-{tier_type}", daemon=True)
        self._worker.start()
        logger.info("prefixkv vLLM tier: %s store %s, fingerprint %s, %d-byte chunks", self.store.kind, parsed.store,
                    fingerprint.hex, chunk_bytes)

    # -- the scheduler's calls (non-blocking) -------------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        result = self._lookups.lookup(key, req_context)
        if result is None:
            return LookupResult.RETRY
        return LookupResult.HIT if result else LookupResult.MISS

    def _submit(self, kind: str, job: TransferJob) -> None:
        keys = [bytes(k) for k in job.keys]
        chunk_ids = [int(c) for c in job.chunk_ids]
        if len(keys) != len(chunk_ids):
            raise InvalidArgument("job", f"{len(keys)} keys for {len(chunk_ids)} chunk ids")
        rows = len(self._rows)
        bad = next((c for c in chunk_ids if not 0 <= c < rows), None)
        if bad is not None:
            raise InvalidArgument("job", f"chunk id {bad} is outside the primary view's {rows} rows")
        with self._count_lock:
            self._in_flight += 1
        self._jobs.put((kind, job.job_id, list(job.keys), keys, chunk_ids))

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out = []
        while True:
            try:
                result, failed = self._finished.get_nowait()
            except queue.Empty:
                break
            if failed:
                self._lookups.mark_miss(failed)
            out.append(result)
        return out

    def has_pending_work(self) -> bool:
        with self._count_lock:
            return self._in_flight > 0

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context) -> None:
        self._lookups.flush()

    def drain_jobs(self) -> None:
        self._jobs.join()

    # -- the worker --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                kind, job_id, offload_keys, keys, chunk_ids = item
                t0 = time.perf_counter()
                try:
                    if kind == "store":
                        result, failed = self._store(job_id, keys, chunk_ids), None
                    else:
                        result, failed = self._load(job_id, offload_keys, keys, chunk_ids)
                except Exception:      # never into the engine: the job failed, the keys are a miss
                    logger.exception("prefixkv vLLM tier: %s job %s failed", kind, job_id)
                    result = JobResult(job_id=job_id, success=False)
                    failed = offload_keys if kind == "load" else None
                result.transfer_time = time.perf_counter() - t0
                with self._count_lock:
                    self._in_flight -= 1
                self._finished.put((result, failed))
            finally:
                self._jobs.task_done()

    def _store(self, job_id, keys, chunk_ids) -> JobResult:
        # copies: the store's writer holds payloads until written, and the rows are reused after the job
        payloads = [self._rows[c].copy() for c in chunk_ids]
        queued = self.store.save(keys, payloads)
        return JobResult(job_id=job_id, success=queued == len(keys), transfer_bytes=queued * self.block_size_bytes)

    def _load(self, job_id, offload_keys, keys, chunk_ids):
        rows = self._rows

        def into(j: int, payload) -> None:     # each chunk as it is verified
            rows[chunk_ids[j]] = np.frombuffer(payload, dtype=np.uint8)

        got = self.store.load(keys, into)
        n = got.count
        nbytes = n * self.block_size_bytes
        if n == len(keys):
            return JobResult(job_id=job_id, success=True, transfer_bytes=nbytes), None
        return (JobResult(job_id=job_id, success=False, successful_keys=tuple(offload_keys[:n]) if n else None,
                          transfer_bytes=nbytes), offload_keys[n:])

    # -- lifetime ----------------------------------------------------------------------------------
    def prefixkv_stats(self) -> dict:
        return self.store.stats()

    def shutdown(self) -> None:
        """Finish queued jobs, stop the threads, write what the store queued (up to 5 s), close it."""
        if self.store.closed:
            return
        self._jobs.put(None)
        self._worker.join()
        self._lookups.shutdown()
        self.store.close()
        self._rows = None      # the primary view's region can be unmapped once no array exports it
