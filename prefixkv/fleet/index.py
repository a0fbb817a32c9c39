"""KVIndex: which workers hold which block hash, on which tier (no ZMQ, no msgspec).

One dict per tier maps a block hash to a bit mask of workers (bit ``i`` = the worker in
slot ``i``), so a prompt's overlap with every worker costs one dict lookup per block, all
workers at once. Each worker also keeps the set of hashes it holds per medium, so
forgetting a worker (``AllBlocksCleared``, a new incarnation, silence) costs its own
blocks only.

Tiers: ``GPU`` (or no medium) is the device tier; any other medium (``CPU``, ``STORAGE``)
is a lower tier, credited partly by the router.

Predicted inserts: a routed request's blocks count as held by its worker from the moment
it is routed (``predict``) until a ``BlockStored`` confirms them, a ``BlockRemoved`` or
clear drops them, or ``ttl`` passes. Times are whatever clock the caller passes as
``now`` (seconds in a live router, simulated seconds in the simulator).
"""

from __future__ import annotations

import numbers
from collections import deque
from itertools import repeat
from typing import Hashable, Iterable, Sequence

from ..errors import InvalidArgument
from ..events import AllBlocksCleared, BlockRemoved, BlockStored

DEVICE_MEDIA = (None, "GPU")


class UnknownWorker(KeyError):
    def __init__(self, worker_id) -> None:
        super().__init__(worker_id)
        self.worker_id = worker_id

    def __str__(self) -> str:
        return f"worker {self.worker_id!r} is not in the index (never added, or removed)"


class KVIndex:
    def __init__(self, *, predict_ttl: float = 30.0) -> None:
        if isinstance(predict_ttl, bool) or not isinstance(predict_ttl, numbers.Real):
            raise InvalidArgument("predict_ttl", f"must be a number of seconds, got {predict_ttl!r}")
        if not predict_ttl > 0:
            raise InvalidArgument("predict_ttl", f"must be > 0, got {predict_ttl}")
        self.predict_ttl = predict_ttl
        self._slot: dict[Hashable, int] = {}          # worker id -> bit index
        self._free_slots: list[int] = []
        self._device: dict[Hashable, int] = {}        # hash -> workers (bits) holding it on the device
        self._lower: dict[Hashable, int] = {}         # hash -> workers holding it on a lower tier
        self._predicted: dict[Hashable, int] = {}     # hash -> workers it was routed to, unconfirmed
        self._held: dict[int, dict[str | None, set]] = {}    # slot -> medium -> hashes
        self._prediction_deadline: dict[tuple[int, Hashable], float] = {}
        self._prediction_queue: deque[tuple[float, int, tuple]] = deque()

    # -- workers -------------------------------------------------------------
    @property
    def workers(self) -> list[Hashable]:
        return list(self._slot)

    def __contains__(self, worker_id) -> bool:
        return worker_id in self._slot

    def add_worker(self, worker_id: Hashable) -> int:
        """Give ``worker_id`` a slot (idempotent); returns its bit index."""
        slot = self._slot.get(worker_id)
        if slot is None:
            slot = self._free_slots.pop() if self._free_slots else len(self._slot)
            self._slot[worker_id] = slot
            self._held[slot] = {}
        return slot

    def remove_worker(self, worker_id: Hashable) -> None:
        """Forget the worker and every block it held or was predicted to hold."""
        self.cleared(worker_id)
        slot = self._slot.pop(worker_id)
        del self._held[slot]
        self._free_slots.append(slot)

    def slot(self, worker_id: Hashable) -> int:
        try:
            return self._slot[worker_id]
        except KeyError:
            raise UnknownWorker(worker_id) from None

    # -- events --------------------------------------------------------------
    def stored(self, worker_id: Hashable, hashes: Iterable[Hashable], medium: str | None = None) -> None:
        slot = self.slot(worker_id)
        bit = 1 << slot
        device = medium in DEVICE_MEDIA
        table = self._device if device else self._lower
        held = self._held[slot].setdefault(None if device else medium, set())
        predicted = self._predicted
        for h in hashes:
            table[h] = table.get(h, 0) | bit
            held.add(h)
            if device and h in predicted:
                self._unpredict(h, bit)

    def removed(self, worker_id: Hashable, hashes: Iterable[Hashable], medium: str | None = None) -> None:
        slot = self.slot(worker_id)
        bit = 1 << slot
        device = medium in DEVICE_MEDIA
        media = self._held[slot]
        held = media.get(None if device else medium)
        for h in hashes:
            if held is not None and h in held:
                held.discard(h)
                # a lower-tier bit stays while another lower medium of this worker still holds h
                if device or not any(h in s for m, s in media.items() if m is not None):
                    self._clear_bit(self._device if device else self._lower, h, bit)
            if device and h in self._predicted:
                self._unpredict(h, bit)

    def cleared(self, worker_id: Hashable, *, predictions: bool = True) -> None:
        """Drop everything the worker holds, on every tier, and its predictions.

        ``predictions=False`` keeps the predicted inserts: what the index knew of the worker is
        being rebuilt (a snapshot), but the requests routed to it are still on their way.
        """
        slot = self.slot(worker_id)
        bit = 1 << slot
        for medium, hashes in self._held[slot].items():
            table = self._device if medium is None else self._lower
            for h in hashes:
                self._clear_bit(table, h, bit)
        self._held[slot] = {}
        if not predictions:
            return
        for (s, h) in [key for key in self._prediction_deadline if key[0] == slot]:
            del self._prediction_deadline[(s, h)]
            self._clear_bit(self._predicted, h, bit)

    def apply(self, worker_id: Hashable, events: Iterable, medium: str | None = None) -> None:
        """Apply prefixkv's core events (``prefixkv.events``) in order.

        Each event keeps its tier: a core event's own ``medium`` (``"CPU"`` for the host tier)
        wins, and the device pool's (``None``) becomes ``medium``, as on the wire (``to_wire``).
        Anything else in ``events`` is refused before any event is applied.
        """
        events = list(events)
        self.slot(worker_id)
        for event in events:
            if type(event) not in (BlockStored, BlockRemoved, AllBlocksCleared):
                raise InvalidArgument("events", f"not a prefixkv KV event: {type(event).__name__}")
        stored: list = []
        stored_medium = medium
        for event in events:
            kind = type(event)
            if kind is BlockStored:
                event_medium = event.medium or medium
                if stored and event_medium != stored_medium:
                    self.stored(worker_id, stored, stored_medium)
                    stored = []
                stored_medium = event_medium
                stored.append(event.block_hash)
                continue
            if stored:
                self.stored(worker_id, stored, stored_medium)
                stored = []
            if kind is BlockRemoved:
                self.removed(worker_id, (event.block_hash,), event.medium or medium)
            else:
                self.cleared(worker_id)
        if stored:
            self.stored(worker_id, stored, stored_medium)

    # -- predicted inserts ---------------------------------------------------
    def predict(self, worker_id: Hashable, hashes: Sequence[Hashable], now: float) -> None:
        """Count ``hashes`` as on the worker's device until confirmed, removed or ``now + ttl``."""
        slot = self.slot(worker_id)
        bit = 1 << slot
        device = self._device
        deadline = now + self.predict_ttl
        fresh = tuple(h for h in hashes if not device.get(h, 0) & bit)
        if not fresh:
            return
        predicted = self._predicted
        deadlines = self._prediction_deadline
        for h in fresh:
            predicted[h] = predicted.get(h, 0) | bit
            deadlines[(slot, h)] = deadline
        self._prediction_queue.append((deadline, slot, fresh))

    def expire(self, now: float) -> int:
        """Drop predictions whose deadline passed; returns how many were dropped."""
        queue = self._prediction_queue
        deadlines = self._prediction_deadline
        dropped = 0
        while queue and queue[0][0] <= now:
            _, slot, hashes = queue.popleft()
            for h in hashes:
                # a later prediction of the same block moved its deadline: that one decides
                if deadlines.get((slot, h), now + 1) <= now:
                    del deadlines[(slot, h)]
                    self._clear_bit(self._predicted, h, 1 << slot)
                    dropped += 1
        return dropped

    def _unpredict(self, h: Hashable, bit: int) -> None:
        if self._predicted.get(h, 0) & bit:
            self._clear_bit(self._predicted, h, bit)
            self._prediction_deadline.pop((bit.bit_length() - 1, h), None)

    @staticmethod
    def _clear_bit(table: dict, h: Hashable, bit: int) -> None:
        mask = table.get(h, 0) & ~bit
        if mask:
            table[h] = mask
        else:
            table.pop(h, None)

    # -- questions -----------------------------------------------------------
    def overlaps(self, hashes: Sequence[Hashable], worker_ids: Sequence[Hashable]) -> list[tuple[int, int]]:
        """For each worker: (leading blocks on its device, leading blocks on any tier).

        Predicted blocks count as on the device. The second figure is at least the first;
        the difference is the lower-tier hit the worker would load instead of recompute.
        """
        slots = [self._slot.get(w) for w in worker_ids]
        wanted = 0
        for s in slots:
            if s is not None:
                wanted |= 1 << s
        device = list(map(self._device.get, hashes, repeat(0)))
        if self._predicted:
            device = [d | p for d, p in zip(device, map(self._predicted.get, hashes, repeat(0)))]
        first = _prefix_lengths(device, wanted)
        if self._lower:
            lower = map(self._lower.get, hashes, repeat(0))
            second = _prefix_lengths([d | l for d, l in zip(device, lower)], wanted)
        else:
            second = first
        return [(0, 0) if s is None else (first.get(s, 0), second.get(s, 0)) for s in slots]

    def blocks_of(self, worker_id: Hashable, medium: str | None = "GPU") -> set:
        """The hashes the index believes the worker holds on ``medium`` (a copy; predictions excluded)."""
        media = self._held[self.slot(worker_id)]
        return set(media.get(None if medium in DEVICE_MEDIA else medium, ()))

    def num_blocks(self) -> int:
        """Distinct hashes indexed on any tier (predictions excluded)."""
        return len(self._device.keys() | self._lower.keys()) if self._lower else len(self._device)


def _prefix_lengths(masks: list[int], wanted: int) -> dict[int, int]:
    """slot -> how many leading masks have its bit, for the slots in ``wanted``."""
    out: dict[int, int] = {}
    alive = wanted
    for i, mask in enumerate(masks):
        lost = alive & ~mask
        if lost:
            alive &= mask
            while lost:
                low = lost & -lost
                out[low.bit_length() - 1] = i
                lost ^= low
            if not alive:
                return out
    n = len(masks)
    while alive:
        low = alive & -alive
        out[low.bit_length() - 1] = n
        alive ^= low
    return out
