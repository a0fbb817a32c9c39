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
    # the host pool (swap space and, with host_cache, the host tier)
    host_capacity: int = 0
    host_active_blocks: int = 0     # held by swapped-out sequences or by pending loads
    host_evictable_blocks: int = 0  # cached on the host tier
    host_free_uncached_blocks: int = 0
    host_hit_tokens: int = 0        # of ``hit_tokens``, served from the host tier
    loads: int = 0                  # host -> device block copies for host hits (promotions)
    loads_refused: int = 0          # host hits the load gate found dearer than recomputing
    demotions: int = 0              # device -> host block copies of evicted blocks

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    @property
    def device_hit_tokens(self) -> int:
        return self.hit_tokens - self.host_hit_tokens

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
