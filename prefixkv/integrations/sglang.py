"""prefixkv's verified store as an SGLang HiCache storage backend (SGLang 0.5.23, issue 27).

Load it with SGLang's dynamic backend::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "prefixkv",
        "module_path": "prefixkv.integrations.sglang", "class_name": "PrefixKVHiCacheStorage",
        "interface_v1": 1, "store": "disk:///var/cache/prefixkv", "capacity_bytes": 68719476736}'

``store`` is ``disk://PATH`` (``capacity_bytes`` required), ``redis://host:port/db``,
``unix:///path.sock`` or ``redis+cluster://host:port[,host:port...]``; the other options are
``EngineStoreOptions``'s (``timeout_s``, ``fsync``, ``queue_bytes``, ``prefix``, ``ttl_s``,
``metrics_port``, ``model``). ``interface_v1: 1`` makes the controller call the zero-copy
``batch_exists`` / ``batch_get_v1`` / ``batch_set_v1``; without it the legacy ``batch_get`` /
``batch_set`` (flat page tensors) are called: both read and write the same values.

What a page is: the bytes ``mem_pool_host.get_page_buffer_meta`` points at for it, in its order
(K then V for the ``page_*`` layouts; K and V of each layer in turn for ``layer_first``), as one
``block_codec`` value under the digest of SGLang's page key (``engine_store``). The
fingerprint names the model (``model_name`` as SGLang passes it, tagged with the host pool's
format), the KV dtype, page size, layers, heads, head dim, host layout, TP rank and size, and
the PP / attention-CP ranks: a ``page_first`` pool never reads a ``layer_first`` pool's pages.
Supported pools: ``MHATokenToKVPoolHost`` (K and V of one width) in the layouts ``layer_first``,
``page_first``, ``page_first_direct``, ``page_head``; others are refused when SGLang registers
the pool (an MLA pool, split heads across heterogeneous TP, ``page_unified``).

Results: ``batch_exists`` counts the leading pages present (one round trip, or index look-ups);
``batch_get_v1`` loads the leading verified pages into the host pool and reports the rest False
(a page failing a check ends the run); ``batch_set_v1`` queues copies for the background writer
and returns at once: True for the pages queued (a full queue drops and counts the rest). No call
raises into SGLang for the store's state.

``import prefixkv.integrations.sglang`` needs SGLang (its ``HiCacheStorage`` is the base class):
without it the import fails with an ``ImportError`` that says so.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any, List, Optional

import numpy as np

try:
    import torch
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig
except ImportError as exc:     # the one place this module needs the engine
    raise ImportError(f"prefixkv.integrations.sglang needs SGLang (0.5.23) and torch installed: {exc}. It is "
                      "loaded by SGLang's --hicache-storage-backend dynamic; see prefixkv's README") from exc

from ..errors import InvalidArgument
from .engine_store import EngineStore, EngineStoreOptions, engine_fingerprint, serve_metrics

__all__ = ["PrefixKVHiCacheStorage", "LAYOUTS"]

logger = logging.getLogger("prefixkv.integrations.sglang")

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
# Keys of the extra config that are SGLang's, not prefixkv's.
_SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size")


class PrefixKVHiCacheStorage(HiCacheStorage):
    """A HiCache L3 backend over prefixkv's disk or Redis block store (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None) -> None:
        if storage_config.is_mla_model:
            raise InvalidArgument("storage_config", "prefixkv's HiCache backend stores MHA pages (K and V); this "
                                                    "model's pool is MLA (rank-replicated), which it does not support")
        if storage_config.should_split_heads:
            raise InvalidArgument("tp_lcm_size", "split heads across heterogeneous TP sizes is not supported by "
                                                 "prefixkv's HiCache backend")
        self.options = EngineStoreOptions.from_config(storage_config.extra_config, ignore=_SGLANG_KEYS)
        self.storage_config = storage_config
        self.store: EngineStore | None = None
        self.mem_pool_host = None

    # -- set-up ------------------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        """Check the pool, build the fingerprint from it and open the store (SGLang calls this
        once, right after building the backend)."""
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in LAYOUTS:
            raise InvalidArgument("layout", f"host layout {layout!r} is not supported; choose one of {', '.join(LAYOUTS)}")
        for name in ("layer_num", "head_num", "head_dim", "page_size", "dtype", "get_page_buffer_meta"):
            if not hasattr(mem_pool_host, name):
                raise InvalidArgument("mem_pool_host", f"{type(mem_pool_host).__name__} has no {name}: prefixkv's "
                                                       f"backend supports MHATokenToKVPoolHost")
        v_head_dim = getattr(mem_pool_host, "v_head_dim", mem_pool_host.head_dim)
        if v_head_dim != mem_pool_host.head_dim:
            raise InvalidArgument("mem_pool_host", f"K and V widths differ ({mem_pool_host.head_dim} and {v_head_dim}); "
                                                   "prefixkv's backend stores pages of equal K and V widths")
        cfg = self.storage_config
        model = cfg.model_name or self.options.model
        fingerprint = engine_fingerprint(
            engine="sglang", model=model or "", dtype=mem_pool_host.dtype, page_tokens=mem_pool_host.page_size,
            layers=mem_pool_host.layer_num, kv_heads=mem_pool_host.head_num, head_dim=mem_pool_host.head_dim,
            tp_rank=cfg.tp_rank, tp_size=cfg.tp_size, layout=f"mha/{layout}",
            facts={"pp_rank": cfg.pp_rank, "pp_size": cfg.pp_size, "attn_cp_rank": cfg.attn_cp_rank,
                   "attn_cp_size": cfg.attn_cp_size, "dcp_rank": cfg.dcp_rank, "dcp_size": cfg.dcp_size})
        store = EngineStore(self.options, fingerprint, engine="sglang")
        if self.options.metrics_port is not None:
            try:
                self.metrics, self.metrics_port = serve_metrics(store, self.options.metrics_port)
            except Exception:
                store.close()      # nothing changed: the attach fails with the port's error
                raise
        if self.store is not None:
            self.store.close()
        super().register_mem_pool_host(mem_pool_host)
        self.store = store
        self.page_size = mem_pool_host.page_size
        self.layout = layout
        logger.info("prefixkv HiCache backend: %s store %s, fingerprint %s, %d-byte pages", store.kind,
                    self.options.store, fingerprint.hex, store.page_bytes)

    # -- keys and page bytes -----------------------------------------------------------------------
    @staticmethod
    def _keys(keys) -> list[bytes]:
        out = []
        for i, key in enumerate(keys):
            if not isinstance(key, str) or not key:
                raise InvalidArgument("keys", f"SGLang page key {i} is not a non-empty string: {key!r:.40}")
            out.append(key.encode())
        return out

    def _regions(self, host_indices, pages: int):
        """Per page, its (pointer, size) regions in page order; checks they make one page."""
        ptrs, sizes = self.mem_pool_host.get_page_buffer_meta(host_indices[: pages * self.page_size])
        if pages == 0:
            return []
        per = len(ptrs) // pages
        if per * pages != len(ptrs) or sum(sizes[:per]) != self.store.page_bytes:
            raise InvalidArgument("host_indices", f"the host pool describes {len(ptrs)} regions of "
                                                  f"{sum(sizes)} bytes for {pages} pages of {self.store.page_bytes}")
        return [list(zip(ptrs[j * per:(j + 1) * per], sizes[j * per:(j + 1) * per])) for j in range(pages)]

    def _check_indices(self, keys, host_indices) -> None:
        if len(host_indices) != len(keys) * self.page_size:
            raise InvalidArgument("host_indices", f"{len(host_indices)} host slots for {len(keys)} pages of "
                                                  f"{self.page_size} tokens")

    # -- v1 (zero copy) ----------------------------------------------------------------------------
    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        if self.store is None or not keys:
            return 0
        return self.store.leading(self._keys(keys))

    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        n = len(keys)
        if self.store is None or not n:
            return [False] * n
        names = self._keys(keys)
        self._check_indices(keys, host_indices)
        regions = self._regions(host_indices, n)
        memmove = ctypes.memmove

        def into(j: int, payload) -> None:      # each page as it is verified: its bytes are still cached
            at = np.frombuffer(payload, dtype=np.uint8).ctypes.data
            for ptr, size in regions[j]:
                memmove(ptr, at, size)
                at += size

        got = self.store.load(names, into)
        return [True] * got.count + [False] * (n - got.count)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info=None) -> List[bool]:
        n = len(keys)
        if self.store is None or not n:
            return [False] * n
        names = self._keys(keys)
        self._check_indices(keys, host_indices)
        page_bytes = self.store.page_bytes
        buf = np.empty(n * page_bytes, dtype=np.uint8)      # one copy: the host slots are reused after this call
        base = buf.ctypes.data
        for j, page in enumerate(self._regions(host_indices, n)):
            at = base + j * page_bytes
            for ptr, size in page:
                ctypes.memmove(at, ptr, size)
                at += size
        view = memoryview(buf)
        queued = self.store.save(names, [view[j * page_bytes:(j + 1) * page_bytes] for j in range(n)])
        return [True] * queued + [False] * (n - queued)

    # -- legacy (flat page tensors, as get_data_page(flat=True) gives them) ----------------------------
    def _flat_to_payload(self, value) -> np.ndarray:
        if not isinstance(value, torch.Tensor):
            raise InvalidArgument("value", f"expected a flat page tensor, got {type(value).__name__}")
        t = value.detach().cpu().contiguous().reshape(-1)
        if t.dtype != self.mem_pool_host.dtype or t.numel() * t.element_size() != self.store.page_bytes:
            raise InvalidArgument("value", f"a page is {self.store.page_bytes} bytes of {self.mem_pool_host.dtype}, got "
                                           f"{t.numel()} x {t.dtype}")
        if self.layout == "layer_first":       # flat [2, L, ...] -> the v1 page order [L, 2, ...]
            t = t.view(2, self.mem_pool_host.layer_num, -1).transpose(0, 1).contiguous().reshape(-1)
        return t.view(torch.uint8).numpy().copy()

    def _payload_to_flat(self, payload, target=None):
        t = torch.frombuffer(bytearray(payload), dtype=self.mem_pool_host.dtype)
        if self.layout == "layer_first":
            t = t.view(self.mem_pool_host.layer_num, 2, -1).transpose(0, 1).contiguous().reshape(-1)
        if target is not None:
            target.view(-1).copy_(t)
            return target
        return t

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None):
        out = self.batch_get([key], None if target_location is None else [target_location])
        return out[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None):
        if self.store is None:
            return [None] * len(keys)
        if target_locations is not None and len(target_locations) != len(keys):
            raise InvalidArgument("target_locations", f"{len(target_locations)} targets for {len(keys)} keys")
        got = self.store.load(self._keys(keys))
        out = [self._payload_to_flat(p, None if target_locations is None else target_locations[j])
               for j, p in enumerate(got.payloads)]
        return out + [None] * (len(keys) - got.count)

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        if self.store is None:
            return False
        if values is None or len(values) != len(keys):
            raise InvalidArgument("values", f"{0 if values is None else len(values)} values for {len(keys)} keys")
        names = self._keys(keys)
        payloads = [self._flat_to_payload(v) for v in values]
        return self.store.save(names, payloads) == len(keys)

    def exists(self, key: str) -> bool:
        if self.store is None:
            return False
        return self.store.leading(self._keys([key])) == 1

    # -- operators ---------------------------------------------------------------------------------
    def clear(self) -> None:
        """Delete this fingerprint's pages (other models' are left). A store that cannot be reached
        is logged, not raised."""
        if self.store is None:
            return
        try:
            self.store.flush()
            self.store.store.clear(self.store.fingerprint.hex)
        except Exception:
            logger.exception("prefixkv HiCache backend: clear failed")

    def prefixkv_stats(self) -> dict:
        return {} if self.store is None else self.store.stats()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
