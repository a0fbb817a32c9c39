"""Blocks between ``KVStore`` pools and the byte payloads a remote store keeps (torch).

A payload is one block of every layer's K and V, ``[layers, 2, block_size,
kv_heads, head_dim]`` in the pools' dtype, C order: the layout
``fingerprint.LAYOUT_L2BHD`` names, i.e. ``KVStore.data[:, :, block]``.

``StagingBuffer`` owns one reusable host buffer of ``capacity`` blocks (pinned
when the pools are on CUDA, so copies are DMA transfers):

* ``pack(block_ids) -> list[bytes]``: one device->host gather of those blocks,
  then a fresh ``bytes`` per block (fresh, so ``RedisBlockStore.put`` can keep
  them while the staging buffer is reused).
* ``unpack(block_ids, payloads)``: payloads (bytes or memoryviews, e.g. what
  ``RedisBlockStore.fetch`` returned, already verified) into the staging buffer,
  then one host->device scatter into those blocks, on the current stream.
  Everything is checked before anything is written: a wrong size or block id
  raises and the pools are unchanged.
* ``unpack_host(host_blocks, payloads)``: the same into the host pool
  (``KVStore.host``), where a remote tier stages fetched blocks for the host tier.

``fingerprint_for(store, weights, ...)`` builds the fingerprint matching a store's
pools, so the payload size always equals ``Fingerprint.block_bytes``.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from ..errors import InvalidArgument
from ..kv.storage import KVStore
from ..checks import integer
from .fingerprint import LAYOUT_L2BHD, Fingerprint, payload_view

__all__ = ["StagingBuffer", "fingerprint_for"]


def _record_read(device: torch.device):
    """An event marking the end of the host -> device copy just queued on ``device``'s current
    stream, or None where copies are synchronous (CPU pools)."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def fingerprint_for(store: KVStore, weights: bytes, *, hash_seed: int | None, hash_algorithm: str = "xxh3_128",
                    tp_rank: int = 0, tp_size: int = 1) -> Fingerprint:
    """The fingerprint of ``store``'s blocks (dims and dtype from the pools)."""
    return Fingerprint(weights, str(store.dtype), store.num_layers, store.kv_heads, store.head_dim,
                       store.block_size, hash_seed, hash_algorithm, tp_rank, tp_size, LAYOUT_L2BHD)


class StagingBuffer:
    """A host buffer of ``capacity`` blocks for moving blocks in and out of ``store``."""

    def __init__(self, store: KVStore, capacity: int) -> None:
        self.store = store
        self.capacity = integer("capacity", capacity, low=1)
        # The last unpack's host -> device copy may still be reading the pinned buffer when unpack
        # returns (a DMA from page-locked memory runs after the call); whatever writes the buffer
        # next waits for it (``_wait_for_reads``), or it would overwrite blocks still in flight.
        self._reading = None
        shape = (store.num_layers, 2, store.block_size, store.kv_heads, store.head_dim)
        pin = store.device.type == "cuda"
        with torch.inference_mode(False):
            self.buffer = torch.empty((self.capacity, *shape), dtype=store.dtype, pin_memory=pin)
        self.block_bytes = self.buffer[0].numel() * self.buffer.element_size()
        # [capacity, block_bytes] numpy view sharing the buffer's memory: bytes in and out without copies
        # through read-only tensors (torch.frombuffer warns on bytes objects)
        self._host = self.buffer.view(self.capacity, -1).view(torch.uint8).numpy()

    def _wait_for_reads(self) -> None:
        if self._reading is not None:
            self._reading.synchronize()
            self._reading = None

    def _ids(self, block_ids: Sequence[int], name: str = "block_ids", *, distinct: bool = False) -> list[int]:
        # integer(), not int(): int(2.7) would quietly name block 2
        ids = [integer(name, b) for b in block_ids]
        bad = [b for b in ids if not 0 <= b < self.store.num_blocks]
        if bad:
            raise InvalidArgument(name, f"block ids {bad[:5]} out of range [0, {self.store.num_blocks})")
        if distinct and len(set(ids)) != len(ids):
            # index_copy_ with a repeated index keeps either payload (CUDA does not say which)
            raise InvalidArgument(name, "a block is listed twice: which payload it would hold is undefined")
        return ids

    def _index(self, ids: list[int]) -> torch.Tensor:
        if len(ids) > self.capacity:
            raise InvalidArgument("block_ids", f"{len(ids)} blocks do not fit a staging buffer of {self.capacity}")
        return torch.tensor(ids, dtype=torch.int64, device=self.store.device)

    def _views(self, payloads: Sequence, n: int, what: str) -> list[memoryview]:
        if len(payloads) != n:
            raise InvalidArgument("payloads", f"{len(payloads)} payloads for {n} {what}")
        return [payload_view(p, i, self.block_bytes) for i, p in enumerate(payloads)]

    def pack(self, block_ids: Sequence[int]) -> list[bytes]:
        """Payloads of ``block_ids`` (device -> staging -> one fresh ``bytes`` each)."""
        index = self._index(self._ids(block_ids))
        n = index.numel()
        if n == 0:
            return []
        gathered = self.store.data.index_select(2, index).permute(2, 0, 1, 3, 4, 5)   # [n, L, 2, B, H, d]
        # (the copy below may run on another stream than the unpack still reading the buffer)
        self._wait_for_reads()
        self.buffer[:n].copy_(gathered, non_blocking=True)
        if self.store.device.type == "cuda":
            torch.cuda.current_stream(self.store.device).synchronize()   # host reads the buffer next
        return [self._host[i].tobytes() for i in range(n)]

    def unpack(self, block_ids: Sequence[int], payloads: Sequence) -> None:
        """Write verified payloads into ``block_ids`` (staging -> device, one scatter)."""
        index = self._index(self._ids(block_ids, distinct=True))
        n = index.numel()
        views = self._views(payloads, n, "blocks")
        if n == 0:
            return
        self._wait_for_reads()
        for i, view in enumerate(views):
            self._host[i] = np.frombuffer(view, dtype=np.uint8)
        # For n == 1 the permuted view is contiguous (only a size-1 dim moved), so the DMA reads the
        # pinned buffer itself, after this call returns; for n > 1 torch 2.x stages the strided view
        # through a temporary first. The event covers both, whatever a torch version does.
        staged = self.buffer[:n].permute(1, 2, 0, 3, 4, 5).to(self.store.device, non_blocking=True)
        self._reading = _record_read(self.store.device)
        self.store.data.index_copy_(2, index, staged)

    def unpack_host(self, host_blocks: Sequence[int], payloads: Sequence) -> None:
        """Write verified payloads into the store's host pool (``KVStore.host``, the host tier's
        bytes): a remote tier stages blocks there, and the host tier's loads take them to the
        device. Checked before anything is written; chunks of ``capacity`` blocks."""
        host = self.store.host
        if host is None:
            raise RuntimeError("the store has no host pool: call allocate_host(num_host_blocks) first")
        ids = [integer("host_blocks", b) for b in host_blocks]
        bad = [b for b in ids if not 0 <= b < host.shape[2]]
        if bad:
            raise InvalidArgument("host_blocks", f"host block ids {bad[:5]} out of range [0, {host.shape[2]})")
        if len(set(ids)) != len(ids):
            raise InvalidArgument("host_blocks", "a block is listed twice: which payload it would hold is undefined")
        views = self._views(payloads, len(ids), "host blocks")
        self._wait_for_reads()
        for at in range(0, len(ids), self.capacity):
            chunk = ids[at:at + self.capacity]
            for i, view in enumerate(views[at:at + len(chunk)]):
                self._host[i] = np.frombuffer(view, dtype=np.uint8)
            index = torch.tensor(chunk, dtype=torch.int64)
            host.index_copy_(2, index, self.buffer[:len(chunk)].permute(1, 2, 0, 3, 4, 5))
