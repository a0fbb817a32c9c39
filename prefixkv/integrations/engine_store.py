"""A prefixkv block store under a serving engine's storage interface (issue 27): what
``prefixkv.integrations.sglang`` (SGLang HiCache) and ``prefixkv.integrations.vllm`` (vLLM's
tiering) share. Imports no engine.

* **Stores.** ``store`` in the engine's extra config picks one: ``disk://PATH``
  (``DiskBlockStore``; ``capacity_bytes`` required), ``redis://...``, ``rediss://...``,
  ``unix://...`` or ``redis+cluster://host:port[,host:port...]`` (``RedisBlockStore``). Their
  guarantees hold as under prefixkv's own engine: one self-describing ``block_codec`` value per
  page, verified on every read (a page failing a check is a miss, ends the run of hits, is
  counted by reason and deleted in the background), bounded background writes (a full queue
  drops and counts, never waits), and for Redis the 0.2 s timeouts and a breaker per node (a
  dead or hung server costs at most one timeout, then calls short-circuit to misses).
* **Keys.** An engine names a page by its own key (SGLang: 64 hex digits of a chained
  SHA-256; vLLM: a block hash + a 4-byte group index), longer than a prefixkv block hash. A
  page is stored under ``engine_key_digest(key)`` (16 bytes of xxh3-128) and its value carries
  the whole engine key as its content, which ``block_codec.decode`` compares on every read: two
  engine keys whose digests collide read as ``Reject.CONTENT`` (a miss, counted), never as each
  other's page. Pages are independent blocks (``chained=False``): an engine key commits to its
  whole prefix itself, and the legacy calls pass no chain.
* **Fingerprint.** No engine passes a weights digest, so ``engine_fingerprint`` names the
  model by what the engine passes: engine, model path or name, KV dtype, page size, the page's
  byte layout, tensor-parallel rank and size, and every other fact given (all hashed into
  ``Fingerprint.weights``); two models, dtypes, layouts or ranks never share a value or a disk
  namespace. Name models alike on every replica that should share (the same model path).
* **Failure.** No store call raises into the engine for the store's state (a full disk, an
  unreachable server); an unexpected exception in a store call is logged, counted
  (``errors``) and answered as a miss or a dropped write. Wrong options raise
  ``InvalidArgument`` naming the option when the backend is built.
* **Threads.** Engines call from several threads (SGLang: prefetch, I/O and backup threads;
  vLLM: a lookup thread and a job worker); the stores take one caller at a time, so every call
  holds one lock. Store writes only queue, so a write never waits behind a disk or the network.

``stats()`` is a dict of counters; ``EngineStoreCollector`` turns live stores into Prometheus
series (``prefixkv_engine_*``), served on ``metrics_port`` when the extra config asks.
"""

from __future__ import annotations

import json
import logging
import math
import threading
from dataclasses import dataclass
from typing import Sequence

import xxhash

from ..errors import InvalidArgument
from ..tiers.fetched import Fetched
from ..tiers.fingerprint import Fingerprint, canonical_dtype

__all__ = ["EngineStore", "EngineStoreOptions", "EngineStoreCollector", "engine_fingerprint", "engine_key_digest",
           "serve_metrics", "STORE_SCHEMES"]

logger = logging.getLogger("prefixkv.integrations")

STORE_SCHEMES = ("disk://", "redis://", "rediss://", "unix://", "redis+cluster://")
ENGINE_HASH_SEED = 0x706B765F656E6731     # the root of independent pages; engine keys name pages, not this seed
_KEY_TAG = b"prefixkv/engine-key/v1\0"


def engine_key_digest(key: bytes) -> bytes:
    """The 16-byte name a page is stored under (its value carries ``key`` whole, checked on read)."""
    return xxhash.xxh3_128_digest(_KEY_TAG + key)


def _fact(name: str, value: object) -> object:
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float) and math.isfinite(value):
        return value
    if isinstance(value, (list, tuple)):
        return [_fact(name, v) for v in value]
    if isinstance(value, dict):
        return {str(k): _fact(name, v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    raise InvalidArgument(name, f"an identity fact must be a string, number, bool, list or dict, got "
                                f"{type(value).__name__}")


def engine_fingerprint(*, engine: str, model: str, dtype: object, page_tokens: int, layers: int, kv_heads: int,
                       head_dim: int, tp_rank: int, tp_size: int, layout: str, facts: dict | None = None) -> Fingerprint:
    """The fingerprint of one engine's pages: every fact is hashed into ``weights`` (the model's
    name stands for its weights: no engine passes a digest of them), the geometry and layout go
    into the fingerprint's own fields. ``layout`` names the page's byte order (the engine's own
    layout name, prefixed with the engine)."""
    if not isinstance(engine, str) or not engine:
        raise InvalidArgument("engine", f"expected a non-empty engine name, got {engine!r}")
    if not isinstance(model, str) or not model.strip():
        raise InvalidArgument("model", "the engine passed no model name or path, and the extra config names none "
                                       "(\"model\": ...): pages of two models must never share a fingerprint")
    identity = {"engine": engine, "model": model, "dtype": canonical_dtype(dtype), "page_tokens": page_tokens,
                "layout": layout, "tp_rank": tp_rank, "tp_size": tp_size, "facts": _fact("facts", facts or {})}
    text = json.dumps(identity, sort_keys=True, separators=(",", ":")).encode()
    weights = xxhash.xxh3_128_digest(b"prefixkv/engine-model/v1\0" + text)
    return Fingerprint(weights, canonical_dtype(dtype), layers, kv_heads, head_dim, page_tokens, ENGINE_HASH_SEED,
                       "xxh3_128", tp_rank, tp_size, f"{engine}:{layout}")


_OPTION_KEYS = {"store", "capacity_bytes", "timeout_s", "fsync", "queue_bytes", "queue_blocks", "prefix", "ttl_s",
                "metrics_port", "model", "read_ahead"}


@dataclass(frozen=True)
class EngineStoreOptions:
    """The prefixkv part of an engine's extra config (see the README's engine section)."""

    store: str
    capacity_bytes: int | None = None      # disk: bytes of block files the namespace may hold (required)
    timeout_s: float = 0.2                 # Redis: connect and socket timeout
    fsync: str = "file"                    # disk: "none" | "file" | "file+dir"
    queue_bytes: int = 256 * 2**20         # background-write queue bound
    queue_blocks: int = 4096
    prefix: str = "pkv"                    # Redis key prefix
    ttl_s: float = 24 * 3600.0             # Redis: a value's TTL
    read_ahead: int = 16                   # disk: files kept open ahead on a cold page cache
    metrics_port: int | None = None        # serve prefixkv_engine_* on 127.0.0.1:PORT (0: any free port)
    model: str | None = None               # the model's name, where the engine passes none

    @classmethod
    def from_config(cls, config: dict | None, *, ignore: Sequence[str] = ()) -> "EngineStoreOptions":
        """Options from the engine's extra config dict; keys in ``ignore`` are the engine's own."""
        if not isinstance(config, dict):
            raise InvalidArgument("extra_config", f"expected a JSON object naming at least \"store\", got "
                                                  f"{type(config).__name__}")
        unknown = sorted(set(config) - _OPTION_KEYS - set(ignore))
        if unknown:
            raise InvalidArgument("extra_config", f"unknown option(s) {', '.join(map(repr, unknown))}; prefixkv reads "
                                                  f"{', '.join(sorted(_OPTION_KEYS))}")
        store = config.get("store")
        if not isinstance(store, str) or not store.startswith(STORE_SCHEMES):
            raise InvalidArgument("store", f"expected disk://PATH, redis://..., rediss://..., unix://... or "
                                           f"redis+cluster://host:port[,...], got {store!r}")
        values = {k: config[k] for k in _OPTION_KEYS if k in config}
        options = cls(**values)
        options._check()
        return options

    def _check(self) -> None:
        from ..checks import integer, seconds

        if self.is_disk:
            if not self.store[len("disk://"):]:
                raise InvalidArgument("store", f"{self.store!r} names no directory: disk:///abs/path")
            if self.capacity_bytes is None:
                raise InvalidArgument("capacity_bytes", "a disk store needs \"capacity_bytes\": the bytes of pages the "
                                                        "directory may hold")
            integer("capacity_bytes", self.capacity_bytes, low=1)
        seconds("timeout_s", self.timeout_s)
        seconds("ttl_s", self.ttl_s)
        for name in ("queue_bytes", "queue_blocks", "read_ahead"):
            integer(name, getattr(self, name), low=1)
        if self.metrics_port is not None:
            integer("metrics_port", self.metrics_port, low=0, high=65535)
        if self.model is not None and (not isinstance(self.model, str) or not self.model.strip()):
            raise InvalidArgument("model", f"expected a model name, got {self.model!r}")

    @property
    def is_disk(self) -> bool:
        return self.store.startswith("disk://")

    @property
    def path(self) -> str:
        return self.store[len("disk://"):]


_COUNTERS = ("lookups", "lookup_pages", "hit_pages", "loads", "load_pages", "loaded_pages", "load_stops",
             "saves", "save_pages", "queued_pages", "dropped_pages", "errors")


class EngineStore:
    """One store (disk or Redis) addressed by engine keys (bytes); see the module docstring."""

    def __init__(self, options: EngineStoreOptions, fingerprint: Fingerprint, *, engine: str) -> None:
        if not isinstance(options, EngineStoreOptions):
            raise InvalidArgument("options", f"expected EngineStoreOptions, got {type(options).__name__}")
        self.options = options
        self.fingerprint = fingerprint
        self.engine = engine
        self.page_bytes = fingerprint.block_bytes
        if options.is_disk:
            from ..tiers.disk_store import DiskBlockStore, DiskStoreConfig

            self.store = DiskBlockStore(options.path, fingerprint, options.capacity_bytes,
                                        DiskStoreConfig(fsync=options.fsync, queue_blocks=options.queue_blocks,
                                                        queue_bytes=options.queue_bytes,
                                                        read_ahead=options.read_ahead))
        else:
            from ..tiers.redis_store import RedisBlockStore, RedisStoreConfig

            self.store = RedisBlockStore(options.store, fingerprint,
                                         RedisStoreConfig(prefix=options.prefix, ttl_s=options.ttl_s,
                                                          connect_timeout_s=options.timeout_s,
                                                          socket_timeout_s=options.timeout_s,
                                                          queue_blocks=options.queue_blocks,
                                                          queue_bytes=options.queue_bytes))
        self.kind = "disk" if options.is_disk else "redis"
        self._lock = threading.Lock()
        self._count = dict.fromkeys(_COUNTERS, 0)
        self._stops: dict[str, int] = {}
        self.closed = False

    # -- keys ---------------------------------------------------------------------------
    @staticmethod
    def _names(keys: Sequence[bytes]) -> list[bytes]:
        out = []
        for i, key in enumerate(keys):
            if not isinstance(key, bytes) or not key:
                raise InvalidArgument("keys", f"engine key {i} is not a non-empty byte string: {key!r:.40}")
            out.append(engine_key_digest(key))
        return out

    def _failed(self, what: str) -> None:
        self._count["errors"] += 1
        logger.exception("prefixkv %s store (%s): %s failed; answered as a miss", self.kind, self.engine, what)

    # -- reads ---------------------------------------------------------------------------
    def leading(self, keys: Sequence[bytes]) -> int:
        """Pages present from ``keys[0]`` before the first absent one (a hint)."""
        names = self._names(keys)
        with self._lock:
            self._count["lookups"] += 1
            self._count["lookup_pages"] += len(names)
            try:
                n = self.store.exists_leading(names) if names else 0
            except Exception:
                self._failed("exists")
                return 0
            self._count["hit_pages"] += n
            return n

    def present(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key, whether its page is present (a hint)."""
        names = self._names(keys)
        with self._lock:
            self._count["lookups"] += 1
            self._count["lookup_pages"] += len(names)
            try:
                out = self.store.exists_each(names) if names else []
            except Exception:
                self._failed("exists")
                return [False] * len(names)
            self._count["hit_pages"] += sum(out)
            return out

    def load(self, keys: Sequence[bytes], into=None) -> Fetched:
        """Verified payloads of the leading loadable pages of ``keys`` (memoryviews, ``page_bytes``
        each); ``stop`` says why it ended early. ``into(j, payload)``: each payload handed over as
        it is verified (valid during the call), not kept."""
        names = self._names(keys)
        with self._lock:
            self._count["loads"] += 1
            self._count["load_pages"] += len(names)
            try:
                got = self.store.get_many(names, None, keys, chained=False, into=into) if names else Fetched([])
            except Exception:
                self._failed("load")
                got = Fetched([], "error")
            self._count["loaded_pages"] += got.count
            if got.stop is not None:
                reason = getattr(got.stop, "value", got.stop)
                self._count["load_stops"] += 1
                self._stops[reason] = self._stops.get(reason, 0) + 1
            return got

    # -- writes --------------------------------------------------------------------------
    def save(self, keys: Sequence[bytes], payloads: Sequence) -> int:
        """Queue ``payloads[j]`` (``page_bytes`` each, not rewritten until written: pass copies)
        as the page of ``keys[j]``; returns how many were queued (the rest were dropped, counted)."""
        names = self._names(keys)
        if len(payloads) != len(names):
            raise InvalidArgument("payloads", f"{len(payloads)} payloads for {len(names)} keys")
        with self._lock:
            self._count["saves"] += 1
            self._count["save_pages"] += len(names)
            try:
                queued = self.store.set_many(names, payloads, None, list(keys), chained=False) if names else 0
            except Exception:
                self._failed("save")
                queued = 0
            self._count["queued_pages"] += queued
            self._count["dropped_pages"] += len(names) - queued
            return queued

    def flush(self, timeout_s: float = 10.0) -> bool:
        return self.store.flush(timeout_s)

    # -- stats and lifetime -----------------------------------------------------------------
    def stats(self) -> dict:
        """This adapter's counters and the store's own (``store``: its stats as a dict)."""
        from dataclasses import asdict

        with self._lock:
            out = dict(self._count)
            out["stops"] = dict(self._stops)
        store = asdict(self.store.stats())
        out.update(kind=self.kind, engine=self.engine, fingerprint=self.fingerprint.hex, page_bytes=self.page_bytes,
                   store=store)
        return out

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        with self._lock:
            self.store.close()


# -- Prometheus -----------------------------------------------------------------------------------
_SERIES = (
    ("prefixkv_engine_lookup_pages", "Pages an engine asked about (exists / lookup)", "lookup_pages"),
    ("prefixkv_engine_hit_pages", "Pages found present by those lookups", "hit_pages"),
    ("prefixkv_engine_load_pages", "Pages an engine asked to load", "load_pages"),
    ("prefixkv_engine_loaded_pages", "Verified pages loaded into the engine", "loaded_pages"),
    ("prefixkv_engine_save_pages", "Pages an engine offered to save", "save_pages"),
    ("prefixkv_engine_queued_pages", "Pages queued for the background writer", "queued_pages"),
    ("prefixkv_engine_dropped_pages", "Pages dropped at save (queue full, store unreachable)", "dropped_pages"),
    ("prefixkv_engine_errors", "Store calls that raised (logged, answered as a miss)", "errors"),
)


class EngineStoreCollector:
    """Prometheus collector over live ``EngineStore`` objects, read at scrape time:
    ``prefixkv_engine_*{engine, store, fingerprint}`` counters, ``..._rejected{reason}`` (pages
    refused on read), ``..._written_pages`` and ``..._store_bytes`` (bytes the store holds: disk
    ledger; absent for Redis)."""

    def __init__(self) -> None:
        self._stores: list[EngineStore] = []
        self._lock = threading.Lock()

    def add(self, store: EngineStore) -> None:
        with self._lock:
            self._stores.append(store)

    def remove(self, store: EngineStore) -> None:
        with self._lock:
            if store in self._stores:
                self._stores.remove(store)

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        labels = ["engine", "store", "fingerprint"]
        families = {name: CounterMetricFamily(name, text, labels=labels) for name, text, _ in _SERIES}
        rejected = CounterMetricFamily("prefixkv_engine_rejected_pages", "Stored pages refused on read, by reason",
                                       labels=[*labels, "reason"])
        written = CounterMetricFamily("prefixkv_engine_written_pages", "Pages the background writer stored",
                                      labels=labels)
        used = GaugeMetricFamily("prefixkv_engine_store_bytes", "Bytes of pages in the store (disk)", labels=labels)
        with self._lock:
            stores = list(self._stores)
        for store in stores:
            try:
                s = store.stats()
            except Exception:
                continue
            values = [s["engine"], s["kind"], s["fingerprint"]]
            for name, _, field in _SERIES:
                families[name].add_metric(values, s[field])
            for reason, n in s["store"]["rejected"].items():
                rejected.add_metric([*values, reason], n)
            written.add_metric(values, s["store"]["writes"])
            if "used_bytes" in s["store"]:
                used.add_metric(values, s["store"]["used_bytes"])
        yield from families.values()
        yield rejected
        yield written
        yield used


_METRICS: dict[int, tuple[object, EngineStoreCollector, object]] = {}
_METRICS_LOCK = threading.Lock()


def serve_metrics(store: EngineStore, port: int):
    """Serve ``store``'s series on 127.0.0.1:``port`` (one server per port per process: stores
    asking for the same port share it). Returns the collector."""
    from prometheus_client import CollectorRegistry, start_http_server

    with _METRICS_LOCK:
        entry = _METRICS.get(port)
        if entry is None:
            registry = CollectorRegistry()
            collector = EngineStoreCollector()
            registry.register(collector)
            server, _thread = start_http_server(port, addr="127.0.0.1", registry=registry)
            entry = (server, collector, registry)
            _METRICS[port if port else server.server_port] = entry
        entry[1].add(store)
        return entry[1], entry[0].server_port

