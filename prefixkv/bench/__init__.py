"""``prefixkv bench``: block-size, pool and policy experiments, following the design notes' method.

A valid block-size experiment fixes four things and changes one:

* the input: one saved trace (arrivals, lengths, shared prefixes, seed), replayed;
* the budget: the same KV pool *bytes* (``num_blocks = pool_bytes // bytes_per_block``,
  so a smaller block never gets more memory), the same scheduler token budget
  and concurrency limit, the same precision;

and records tail waste, block-table length, preemptions, P50/P99 TTFT and
inter-token latency, completed requests/s, prefix hit rate and block usage
(active / cached-evictable / free) over time.

Modules: ``costmodel`` (the calibrated cost-model executor; its parameter
profiles are ``prefixkv.costs``), ``reserved`` (the reserve-max-length baseline), ``runner`` (one run
per block size), ``report`` (table, JSON, plots), ``cli`` (``add_bench_command``).
"""

from __future__ import annotations

from .costmodel import CostModel, CostModelExecutor
from .reserved import ReservedAllocator, run_reserved
from .runner import BenchConfig, BenchResult, prepare_trace, run_block_size, run_bench

__all__ = ["CostModel", "CostModelExecutor", "ReservedAllocator",
           "run_reserved", "BenchConfig", "BenchResult", "prepare_trace", "run_block_size", "run_bench"]
