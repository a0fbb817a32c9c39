"""How many bytes a token's KV takes, and what fits in a pool.

Units are binary throughout: KiB/MiB/GiB/TiB = 2**10/2**20/2**30/2**40 bytes.
Decimal units (KB, GB) are refused rather than guessed at: mixing them into a
capacity question silently loses about 7% at GiB scale.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from numbers import Integral

from .checks import integer
from .errors import InvalidArgument

DTYPE_BYTES = {
    "float32": 4, "fp32": 4,
    "float16": 2, "fp16": 2, "half": 2,
    "bfloat16": 2, "bf16": 2,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "fp8": 1, "int8": 1,
}

_UNITS = {"": 1, "b": 1, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*$", re.ASCII)


def parse_size(text: str | int) -> int:
    """``"24GiB"`` -> 25769803776. Plain numbers are bytes.

    Refused with ``InvalidArgument`` naming ``size`` (a ValueError, as before it named it)."""
    if isinstance(text, Integral) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgument("size", f"must be >= 0, got {text}")
        return int(text)
    if not isinstance(text, str):
        # (a float used to reach the regex: a bare TypeError; True was a size of 1 byte)
        raise InvalidArgument("size", f"expected a byte count or a string such as 24GiB, got "
                                      f"{type(text).__name__} {text!r}")
    match = _SIZE.match(text)
    if not match:
        raise InvalidArgument("size", f"cannot read {text!r}; write e.g. 24GiB, 512MiB or a byte count")
    number, unit = match.groups()
    key = unit.lower()
    if key not in _UNITS:
        if key in ("kb", "mb", "gb", "tb", "k", "m", "g", "t"):
            raise InvalidArgument("size", f"{text!r} uses a decimal or ambiguous unit; use KiB/MiB/GiB/TiB "
                                          "(powers of 2) or a plain byte count")
        raise InvalidArgument("size", f"unknown unit {unit!r} in {text!r}; use B, KiB, MiB, GiB or TiB")
    from fractions import Fraction

    value = Fraction(number) * _UNITS[key]       # exact: a float loses bytes past 2**53
    if value.denominator != 1:
        raise InvalidArgument("size", f"{text!r} is not a whole number of bytes")
    return int(value)


def format_size(num_bytes: int) -> str:
    """Exact when possible: 131072 -> '128 KiB', 1536 -> '1.5 KiB'."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if num_bytes >= scale:
            value = num_bytes / scale
            return f"{value:,.0f} {unit}" if value == int(value) else f"{value:,.2f} {unit}"
    return f"{num_bytes:,} B"



@dataclass(frozen=True, slots=True)
class KVSpec:
    """The model facts that size KV: per token, 2 (K and V) x layers x KV heads
    held by one GPU x head dim x bytes per element."""

    layers: int
    kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    tensor_parallel: int = 1

    def __post_init__(self) -> None:
        for name in ("layers", "kv_heads", "head_dim", "tensor_parallel"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Integral):
                raise InvalidArgument(name, f"a KVSpec's {name} must be a positive integer, got {value!r}")
            if value <= 0:
                raise InvalidArgument(name, f"a KVSpec's {name} must be positive, got {value}")
        if not isinstance(self.dtype, str) or self.dtype not in DTYPE_BYTES:     # (a list is unhashable)
            raise InvalidArgument("dtype", f"unknown dtype {self.dtype!r}; choose from "
                                           f"{', '.join(sorted(DTYPE_BYTES))}")
        tp, heads = self.tensor_parallel, self.kv_heads
        if tp <= heads and heads % tp:
            raise InvalidArgument("tensor_parallel", f"{heads} KV heads cannot be split evenly over tensor "
                                                     f"parallel {tp}")
        if tp > heads and tp % heads:
            raise InvalidArgument("tensor_parallel", f"tensor parallel {tp} must be a multiple of the {heads} KV "
                                                     "heads to replicate them")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def kv_heads_per_gpu(self) -> int:
        # With more GPUs than KV heads each GPU keeps a full replica of one
        # head; replicated heads are not divided again.
        return max(1, self.kv_heads // self.tensor_parallel)

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads_per_gpu * self.head_dim * self.dtype_bytes

    def bytes_per_block(self, block_size: int) -> int:
        integer("block_size", block_size, low=1)
        return self.bytes_per_token * block_size

    def num_blocks(self, pool_bytes: int, block_size: int) -> int:
        integer("pool_bytes", pool_bytes, low=0)
        return pool_bytes // self.bytes_per_block(block_size)


@dataclass(frozen=True, slots=True)
class Plan:
    spec: KVSpec
    block_size: int
    pool_bytes: int
    prompt_tokens: int
    bytes_per_token: int
    bytes_per_block: int
    num_blocks: int
    blocks_per_request: int
    max_requests: int
    leftover_blocks: int
    unallocated_bytes: int
    tail_waste_slots_per_request: int
    host_pool_bytes: int = 0
    host_blocks: int = 0            # blocks of the host tier / swap space in ``host_pool_bytes``

    def as_dict(self) -> dict:
        return {
            "layers": self.spec.layers, "kv_heads": self.spec.kv_heads, "head_dim": self.spec.head_dim,
            "dtype": self.spec.dtype, "tensor_parallel": self.spec.tensor_parallel,
            "kv_heads_per_gpu": self.spec.kv_heads_per_gpu, "block_size": self.block_size,
            "pool_bytes": self.pool_bytes, "prompt_tokens": self.prompt_tokens,
            "bytes_per_token": self.bytes_per_token, "bytes_per_block": self.bytes_per_block,
            "num_blocks": self.num_blocks, "blocks_per_request": self.blocks_per_request,
            "max_requests": self.max_requests, "leftover_blocks": self.leftover_blocks,
            "unallocated_bytes": self.unallocated_bytes,
            "tail_waste_slots_per_request": self.tail_waste_slots_per_request,
            "tail_waste_bytes_per_request": self.tail_waste_slots_per_request * self.bytes_per_token,
            "host_pool_bytes": self.host_pool_bytes, "host_blocks": self.host_blocks,
        }


def plan(spec: KVSpec, block_size: int, pool_bytes: int, prompt_tokens: int, host_pool_bytes: int = 0) -> Plan:
    """How many requests of ``prompt_tokens`` fit, each in whole blocks, no sharing; and how many
    blocks a host pool of ``host_pool_bytes`` holds."""
    # (a float block size planned fractional blocks; a string failed in '<=' as a bare TypeError)
    integer("block_size", block_size, low=1)
    integer("prompt_tokens", prompt_tokens, low=1)
    integer("pool_bytes", pool_bytes, low=0)
    integer("host_pool_bytes", host_pool_bytes, low=0)
    per_block = spec.bytes_per_block(block_size)
    num_blocks = pool_bytes // per_block
    per_request = -(-prompt_tokens // block_size)
    max_requests = num_blocks // per_request
    return Plan(
        spec=spec, block_size=block_size, pool_bytes=pool_bytes, prompt_tokens=prompt_tokens,
        bytes_per_token=spec.bytes_per_token, bytes_per_block=per_block, num_blocks=num_blocks,
        blocks_per_request=per_request, max_requests=max_requests,
        leftover_blocks=num_blocks - max_requests * per_request,
        unallocated_bytes=pool_bytes - num_blocks * per_block,
        tail_waste_slots_per_request=per_request * block_size - prompt_tokens,
        host_pool_bytes=host_pool_bytes, host_blocks=host_pool_bytes // per_block,
    )


def tail_waste(lengths: list[int], block_size: int) -> dict:
    """Blocks, slots, useful slots and empty tail slots for sequences of ``lengths``."""
    integer("block_size", block_size, low=1)
    if isinstance(lengths, (str, bytes)) or not hasattr(lengths, "__iter__"):
        raise InvalidArgument("lengths", f"expected a sequence of lengths, got {type(lengths).__name__}")
    lengths = list(lengths)     # (a generator: read once, used three times below)
    bad = next((n for n in lengths if isinstance(n, bool) or not isinstance(n, Integral) or n < 0), None)
    if bad is not None:
        raise InvalidArgument("lengths", f"each must be an integer >= 0, got {bad!r}")
    blocks = sum(-(-n // block_size) for n in lengths)
    slots = blocks * block_size
    useful = sum(lengths)
    return {"blocks": blocks, "slots": slots, "useful": useful, "tail_waste": slots - useful}
