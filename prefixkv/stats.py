"""A point-in-time picture of the cache, for logs, dashboards and tests."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from .sizing import KVSpec


@dataclass(frozen=True, slots=True)
class CacheStats:
    capacity: int
    block_size: int
    active_blocks: int          # unique blocks held by at least one table
    evictable_blocks: int       # refcount 0, still cached
    free_uncached_blocks: int
    cached_hashes: int          # distinct hashes in the prefix cache
    sequences: int
    preempted_sequences: int
    admitted: int
    query_tokens: int           # prompt tokens looked up at admission
    hit_tokens: int             # of those, served from the prefix cache
    evictions: int
    insertions: int             # hashes that entered the prefix cache (a residency each)
    unused_removals: int | None  # residencies ended (eviction, reset) without a hit; None untracked
    cow_copies: int
    preemptions: int
    recomputed_tokens: int      # tokens recomputed on resume after preemption
    resumed_hit_tokens: int     # cached tokens reused on resume (not counted as hits)
    swaps_out: int
    swaps_in: int
    swapped_out_blocks: int     # device -> host block copies
    swapped_in_blocks: int      # host -> device block copies (cache hits need none)
    tail_waste_slots: int       # empty slots in unique partly filled tail blocks
    block_table_lengths: tuple[int, ...]

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def free_blocks(self) -> int:
        return self.evictable_blocks + self.free_uncached_blocks

    def tail_waste_bytes(self, spec: KVSpec) -> int:
        return self.tail_waste_slots * spec.bytes_per_token

    def as_dict(self, spec: KVSpec | None = None) -> dict:
        out = asdict(self)
        out["block_table_lengths"] = list(self.block_table_lengths)
        out["hit_rate"] = self.hit_rate
        if spec is not None:
            out["tail_waste_bytes"] = self.tail_waste_bytes(spec)
        return out
