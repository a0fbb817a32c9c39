"""The cost models every part shares (no torch needed).

Two views of the same hardware figures:

* ``CostParams`` (profiles ``h200`` and ``cpu-tiny``, or a JSON/TOML file via
  ``load_params``): what one engine step costs term by term; ``prefixkv bench``'s
  cost-model executor charges steps with it.
* ``PreemptionCostModel``: moving KV bytes over a link against recomputing the
  tokens. The scheduler uses it to pick recompute or swap; the same comparison
  gates a load from a lower tier.

Preemption by recompute or by swap, the design notes' estimate, with every input
configurable (measure your own):

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

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from numbers import Real
from pathlib import Path
from typing import Literal

from .errors import InvalidArgument

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
        # Finite numbers only: a NaN rate or size makes every comparison in choose() false (swap
        # is then never chosen, silently), an infinite one makes recompute or the link free.
        for name in ("prefill_tokens_per_s", "link_bytes_per_s", "kv_bytes_per_token"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real) or not (_finite(value) and value > 0):
                raise InvalidArgument(name, f"{name} must be a finite number > 0, got {value!r}")
        if self.mode not in ("auto", "recompute", "swap"):
            raise InvalidArgument("mode", f"mode must be auto, recompute or swap, got {self.mode!r}")

    @classmethod
    def for_spec(cls, spec, **kwargs) -> "PreemptionCostModel":
        """Take the KV bytes per token from a ``KVSpec``."""
        return cls(kv_bytes_per_token=spec.bytes_per_token, **kwargs)

    @classmethod
    def from_params(cls, params: "CostParams", kv_bytes_per_token: int, **kwargs) -> "PreemptionCostModel":
        """The prefill rate and link bandwidth of a ``CostParams`` profile."""
        return cls(prefill_tokens_per_s=1.0 / max(params.prefill_s_per_token, 1e-12),
                   link_bytes_per_s=params.link_bytes_per_s, kv_bytes_per_token=kv_bytes_per_token, **kwargs)

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


# Measured on the development machine (x86-64 container, Python 3.11, numpy, xxhash) with
# ``measure_bookkeeping()``: per-block costs of prefixkv's own manager, separated from the
# per-token hashing cost by timing the same tokens at block sizes 4 and 64.
# Result: 0.66 us per block allocated (+ published, freed), 23 ns per block-table entry,
# 59 ns per cached block matched, 3.9 ns per token hashed.
MEASURED_BOOKKEEPING = dict(block_alloc_s=6.6e-7, block_table_entry_s=2.3e-8, hit_block_s=5.9e-8,
                            hash_s_per_token=3.9e-9)


@dataclass(frozen=True, slots=True)
class CostParams:
    name: str = "custom"
    source: str = ""
    step_overhead_s: float = 0.0
    prefill_s_per_token: float = 5.0e-5
    decode_s_per_token: float = 5.0e-5
    kv_read_bytes_per_s: float = 3.84e12
    link_bytes_per_s: float = 25 * 2**30
    remote_bytes_per_s: float = 12.5e9          # a remote tier's network (100 Gb/s), for replay's remote model
    disk_read_bytes_per_s: float = 6.0e9        # a local NVMe disk (PCIe 4), for replay's disk model
    disk_write_bytes_per_s: float = 3.0e9
    read_whole_blocks: bool = True
    block_alloc_s: float = MEASURED_BOOKKEEPING["block_alloc_s"]
    block_table_entry_s: float = MEASURED_BOOKKEEPING["block_table_entry_s"]
    hit_block_s: float = MEASURED_BOOKKEEPING["hit_block_s"]
    hash_s_per_token: float = MEASURED_BOOKKEEPING["hash_s_per_token"]

    def __post_init__(self) -> None:
        for f in fields(self):
            problem = _field_problem(f, getattr(self, f.name))
            if problem:
                raise ValueError(f"cost parameter {f.name} {problem}")

    def as_dict(self) -> dict:
        return asdict(self)


_POSITIVE = ("kv_read_bytes_per_s", "link_bytes_per_s", "remote_bytes_per_s", "disk_read_bytes_per_s",
             "disk_write_bytes_per_s")


def _finite(value: int | float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:       # an int past a float's range (a JSON 1 followed by 400 zeros)
        return False


def _field_problem(f, value) -> str | None:
    """What is wrong with ``value`` for the ``CostParams`` field ``f`` (None: nothing)."""
    if f.type in ("bool", bool):
        return None if isinstance(value, bool) else f"must be true or false, got {value!r}"
    if f.type in ("str", str):
        return None if isinstance(value, str) else f"must be a string, got {value!r}"
    if f.type in ("float", float):
        if isinstance(value, bool) or not (isinstance(value, (int, float)) and value >= 0 and _finite(value)):
            return f"must be a finite number >= 0, got {value!r}"
        if f.name in _POSITIVE and value <= 0:
            return f"must be > 0, got {value!r}"
    return None


def _line_of(text: str, key: str, toml: bool) -> int:
    """The 1-based line where ``key`` is given in a JSON or TOML text (1 when it cannot be found)."""
    import re

    k = re.escape(key)
    pattern = (rf'^[ \t]*(?:{k}|"{k}"|\'{k}\')\s*=' if toml else rf'"{k}"\s*:')
    match = re.search(pattern, text, re.MULTILINE)
    return text.count("\n", 0, match.start()) + 1 if match else 1


_H200_SOURCE = (
    "Assumptions, not measurements: an H200 (HBM3e, 4.8 TB/s peak) at 80% achievable bandwidth "
    "= 3.84e12 B/s for KV reads; step overhead = reading a Llama-3-8B-like model's 16.06e9 bytes of "
    "bf16 weights once per step at that bandwidth (4.2 ms); prefill and decode compute at the design "
    "notes' 20,000 tokens/s (50 us/token); swap link 25 GiB/s (the notes); bookkeeping measured from "
    "prefixkv's manager on the host CPU (measure_bookkeeping).")

# Fitted by ``calibrate_engine()`` (least squares over measured steps of prefixkv.engine's
# TinyLlama with its default config, float32, torch CPU, 1 thread) on the development machine.
_CPU_SOURCE = ("Measured: least-squares fit (calibrate_engine) of prefixkv.engine.TinyLlama (default config, "
               "float32, torch CPU, 1 thread) steps on the development machine; bookkeeping measured from "
               "prefixkv's manager (measure_bookkeeping). Re-fit on your machine with calibrate_engine().")

PROFILES: dict[str, CostParams] = {
    "h200": CostParams(name="h200", source=_H200_SOURCE, step_overhead_s=16.06e9 / 3.84e12,
                       prefill_s_per_token=1 / 20_000, decode_s_per_token=1 / 20_000,
                       kv_read_bytes_per_s=0.8 * 4.8e12, link_bytes_per_s=25 * 2**30),
    # calibrate_engine() gave step 0.61 ms, prefill 7.8 us/token, decode 59 us/token, KV read 23 GB/s
    # (the KV term is the noisiest: a tiny model reads little KV); link: a host memcpy, assumed 5 GB/s.
    "cpu-tiny": CostParams(name="cpu-tiny", source=_CPU_SOURCE, step_overhead_s=6.1e-4,
                           prefill_s_per_token=7.8e-6, decode_s_per_token=5.9e-5,
                           kv_read_bytes_per_s=2.3e10, link_bytes_per_s=5.0e9),
}


def load_params(spec: str | Path | None = None) -> CostParams:
    """A profile name (``h200``, ``cpu-tiny``), or a JSON / TOML file of ``CostParams`` fields.

    A file may name ``base`` (a profile; default ``h200``); the fields it gives replace
    the base's. ``None`` is the ``h200`` profile.
    """
    if spec is None:
        return PROFILES["h200"]
    if isinstance(spec, str) and spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec)
    if str(spec) == "" or not path.exists():
        raise ValueError(f"cost parameters {str(spec)!r}: not a profile ({', '.join(PROFILES)}) nor a file")
    if path.is_dir():
        raise ValueError(f"cost parameters {str(spec)!r}: a directory, not a profile ({', '.join(PROFILES)}) "
                         "nor a file")
    toml = path.suffix.lower() == ".toml"
    try:
        text = path.read_text(encoding="utf-8")
        if toml:
            import tomllib
            data = tomllib.loads(text)
        else:
            data = json.loads(text)
    except UnicodeDecodeError:
        raise ValueError(f"cost parameters {path}: not a text file") from None
    except ValueError as exc:   # json.JSONDecodeError and tomllib.TOMLDecodeError are ValueErrors
        kind = "TOML" if toml else "JSON"
        raise ValueError(f"cost parameters {path}: not valid {kind} ({exc})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected an object of cost parameters")
    base = data.pop("base", "h200")
    if not isinstance(base, str) or base not in PROFILES:
        raise ValueError(f"{path}:{_line_of(text, 'base', toml)}: unknown base profile "
                         f"{base!r}; choose from {', '.join(PROFILES)}")
    known = {f.name: f for f in fields(CostParams)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{path}:{_line_of(text, unknown[0], toml)}: unknown cost parameter(s) "
                         f"{', '.join(unknown)}; known: {', '.join(sorted(known))}")
    for key, value in data.items():
        problem = _field_problem(known[key], value)
        if problem:
            raise ValueError(f"{path}:{_line_of(text, key, toml)}: cost parameter {key} {problem}")
    data.setdefault("name", path.stem)
    data.setdefault("source", f"{path} (on top of profile {base})")
    return replace(PROFILES[base], **data)
