"""Preemption by recompute or by swap: which one costs less (no torch needed).

The design notes' estimate, with every input configurable (measure your own):

* recompute: drop the KV, keep the token ids, prefill them again later:
  ``tokens / prefill_tokens_per_s`` (4,000 tokens at 20,000 tokens/s = 200 ms);
* swap: copy the KV blocks to host memory and back: ``bytes / link_bytes_per_s``
  each way (500 MiB at 25 GiB/s = 500 / 25 / 1024 s = 19.5 ms, 39.1 ms out and
  back), and only when enough host blocks are free.

``choose`` compares recompute time with the swap round trip. Neither counts
what the notes warn about (synchronisation, scheduling, who is blocked
meanwhile); set ``mode`` to force one when you know better.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

KiB, MiB, GiB = 2**10, 2**20, 2**30

PreemptMode = Literal["recompute", "swap"]


@dataclass(frozen=True, slots=True)
class PreemptionChoice:
    mode: PreemptMode
    recompute_s: float
    swap_s: float           # out and back; inf when swapping is not possible
    reason: str


@dataclass(frozen=True, slots=True)
class PreemptionCostModel:
    prefill_tokens_per_s: float = 20_000.0
    link_bytes_per_s: float = 25 * GiB
    kv_bytes_per_token: int = 128 * KiB     # the notes' model: 32 layers x 8 KV heads x 128 x bf16 x K,V
    mode: Literal["auto", "recompute", "swap"] = "auto"

    def __post_init__(self) -> None:
        if not self.prefill_tokens_per_s > 0:
            raise ValueError(f"prefill_tokens_per_s must be > 0, got {self.prefill_tokens_per_s}")
        if not self.link_bytes_per_s > 0:
            raise ValueError(f"link_bytes_per_s must be > 0, got {self.link_bytes_per_s}")
        if self.kv_bytes_per_token <= 0:
            raise ValueError(f"kv_bytes_per_token must be > 0, got {self.kv_bytes_per_token}")
        if self.mode not in ("auto", "recompute", "swap"):
            raise ValueError(f"mode must be auto, recompute or swap, got {self.mode!r}")

    @classmethod
    def for_spec(cls, spec, **kwargs) -> "PreemptionCostModel":
        """Take the KV bytes per token from a ``KVSpec``."""
        return cls(kv_bytes_per_token=spec.bytes_per_token, **kwargs)

    def recompute_s(self, tokens: int) -> float:
        return tokens / self.prefill_tokens_per_s

    def swap_one_way_s(self, num_bytes: int) -> float:
        return num_bytes / self.link_bytes_per_s

    def swap_round_trip_s(self, num_bytes: int) -> float:
        return 2 * self.swap_one_way_s(num_bytes)

    def choose(self, *, tokens: int, blocks: int, block_size: int, host_blocks_free: int) -> PreemptionChoice:
        """Recompute ``tokens`` or swap ``blocks`` whole blocks out and back?"""
        recompute = self.recompute_s(tokens)
        if blocks > host_blocks_free:
            return PreemptionChoice("recompute", recompute, math.inf,
                                    f"swap needs {blocks} host block(s), {host_blocks_free} free")
        swap = self.swap_round_trip_s(blocks * block_size * self.kv_bytes_per_token)
        if self.mode != "auto":
            return PreemptionChoice(self.mode, recompute, swap, f"forced {self.mode}")
        if swap < recompute:
            return PreemptionChoice("swap", recompute, swap, f"swap {swap * 1e3:.3g} ms < recompute "
                                                             f"{recompute * 1e3:.3g} ms")
        return PreemptionChoice("recompute", recompute, swap, f"recompute {recompute * 1e3:.3g} ms <= swap "
                                                              f"{swap * 1e3:.3g} ms")
