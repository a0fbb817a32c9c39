"""vLLM's KV event wire format, mirrored with msgspec (extra ``[fleet]``).

The classes below copy ``vllm.distributed.kv_events`` of vLLM 0.33.0 field for field, in
the same order and with the same msgspec options, so a batch encodes to the same bytes as
vLLM's and existing consumers of vLLM's stream (llm-d's indexer, Dynamo's KV router) read
prefixkv workers. ``tests/data/vllm_kv_events.json`` holds frames made by vLLM itself
(``benches/fleet_golden_frames.py``); the wire tests decode and re-encode them byte for byte.

On the wire (PUB socket), one batch is three frames: topic, the batch's sequence number as 8
bytes big-endian, and the msgpack ``KVEventBatch`` (an array ``[ts, events, dp_rank]``; each
event a map tagged ``{"type": "BlockStored", ...}``). The replay socket (ROUTER) takes an
8-byte start sequence and answers every buffered batch from there, then an end marker whose
sequence is ``-1``.

prefixkv adds, outside vLLM's stream: ``Heartbeat`` (on its own PUB socket, so consumers of
the event socket only ever see vLLM batches) and a snapshot request on the replay socket.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import msgspec

from ..errors import InvalidArgument
from ..events import AllBlocksCleared as CoreCleared
from ..events import BlockRemoved as CoreRemoved
from ..events import BlockStored as CoreStored

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"

END_SEQ = (-1).to_bytes(8, "big", signed=True)      # the replay socket's end-of-replay marker
SNAPSHOT_REQUEST = b"prefixkv-snapshot"             # replay-socket request: not 8 bytes, so never a seq
HEARTBEAT_TOPIC = b"prefixkv-heartbeat"

ExternalBlockHash = bytes | int    # vLLM's type: prefixkv's digests are bytes, trace ids ints


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the KV cache events (a map tagged with ``type`` on the wire)."""


class BlockStored(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    parent_block_hash: ExternalBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[ExternalBlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class Heartbeat(msgspec.Struct, array_like=True, gc=False):
    """prefixkv's liveness and load report (not part of vLLM's stream).

    ``incarnation`` changes whenever the worker process (or its cache) starts afresh;
    ``next_seq`` is the sequence number its next batch will carry, so a subscriber also
    notices a lost *last* batch; ``fingerprint`` says whose KV bytes are interchangeable.
    """

    worker_id: str
    incarnation: str
    fingerprint: str
    block_size: int
    hash_seed: int | None
    free_blocks: int
    queued_prefill_tokens: int
    running_requests: int
    next_seq: int
    interval_s: float
    ts: float


_batch_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_heartbeat_decoder = msgspec.msgpack.Decoder(Heartbeat)


class WireError(ValueError):
    """A frame that is not a valid KV event batch or heartbeat (says which and why)."""


def encode(message: KVEventBatch | Heartbeat) -> bytes:
    return _batch_encoder.encode(message)


def decode_batch(payload: bytes) -> KVEventBatch:
    try:
        return _batch_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a KVEventBatch: {exc}") from None


def decode_heartbeat(payload: bytes) -> Heartbeat:
    try:
        return _heartbeat_decoder.decode(payload)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a prefixkv heartbeat: {exc}") from None


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def seq_from(frame: bytes) -> int:
    if len(frame) != 8:
        raise WireError(f"a sequence number is 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=frame == END_SEQ)


def _hash(value) -> ExternalBlockHash:
    """prefixkv's block hashes are bytes (digests) or ints (trace ids): both go on the wire as they are."""
    if isinstance(value, bytes):
        return value
    if isinstance(value, int) and not isinstance(value, bool):
        if -2**63 <= value < 2**64:
            return value
        raise WireError(f"block hash {value!r} cannot go on the wire: an int hash must fit msgpack's 64-bit "
                        "integers (-2**63 to 2**64 - 1)")
    raise WireError(f"block hash {value!r} ({type(value).__name__}) cannot go on the wire: vLLM's "
                    "ExternalBlockHash is bytes or int")


def to_wire(events: Iterable, *, block_size: int, medium: str = MEDIUM_GPU,
            tokens: Mapping[Any, Sequence[int]] | None = None) -> list[KVCacheEvent]:
    """prefixkv's core events (``prefixkv.events``) as vLLM events, consecutive ones merged.

    A run of ``BlockStored`` whose each block's parent is the previous block becomes one
    event (vLLM's shape: a chain under one parent); consecutive removals become one.
    ``tokens`` maps a block hash to its token ids where the caller knows them
    (``block_tokens(prompt)``); a chain with a block of unknown tokens is sent with
    ``token_ids=[]``. Core events carry their block's ids when the manager knew them (token
    prompts); ``tokens`` fills in the others.
    Each event keeps its tier: a core event's own ``medium`` (``"CPU"`` for the host tier)
    wins, and the device pool's (``None``) becomes ``medium``.
    """
    out: list[KVCacheEvent] = []
    run: list[CoreStored] = []
    removed: list = []
    removed_medium = [medium]

    def medium_of(event) -> str:
        return getattr(event, "medium", None) or medium

    def flush_run() -> None:
        if not run:
            return
        hashes = [_hash(e.block_hash) for e in run]
        ids: list[int] = []
        for event, h in zip(run, hashes):
            block = getattr(event, "token_ids", None)
            if block is None and tokens is not None:
                block = tokens.get(h)
            if block is None:
                ids = []
                break
            ids.extend(block)
        extra = run[0].extra_keys
        lora = None if extra is None or extra.adapter is None else str(extra.adapter)
        parent = run[0].parent_hash
        out.append(BlockStored(block_hashes=hashes, parent_block_hash=None if parent is None else _hash(parent),
                               token_ids=ids, block_size=block_size, lora_id=None, medium=medium_of(run[0]),
                               lora_name=lora))
        run.clear()

    def flush_removed() -> None:
        if removed:
            out.append(BlockRemoved(block_hashes=list(removed), medium=removed_medium[0]))
            removed.clear()

    for event in events:
        if isinstance(event, CoreStored):
            flush_removed()
            if run and (event.parent_hash != run[-1].block_hash or event.extra_keys != run[-1].extra_keys
                        or medium_of(event) != medium_of(run[-1])):
                flush_run()
            run.append(event)
        elif isinstance(event, CoreRemoved):
            flush_run()
            if removed and medium_of(event) != removed_medium[0]:
                flush_removed()
            removed_medium[0] = medium_of(event)
            removed.append(_hash(event.block_hash))
        elif isinstance(event, CoreCleared):
            flush_run()
            flush_removed()
            out.append(AllBlocksCleared())
        else:
            raise InvalidArgument("events", f"not a prefixkv KV event: {type(event).__name__}")
    flush_run()
    flush_removed()
    return out


def block_tokens(prompt) -> dict:
    """Hash -> token ids of each full block of a token ``Prompt`` (for ``to_wire``'s ``tokens``)."""
    if prompt.tokens is None:
        return {}
    size = prompt.hasher.block_size
    ids = prompt.tokens
    return {h: ids[i * size:(i + 1) * size].tolist() for i, h in enumerate(prompt.block_hashes())}
