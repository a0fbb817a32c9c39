"""What makes two processes' KV bytes interchangeable, as one 16-byte digest.

A block's KV is only reusable by another process when everything that shaped
its bytes agrees: the weights (their contents, not their names or shapes: two
tiny models built with different seeds have equal shapes and different KV),
the dtype, the number of layers, the KV heads one tensor-parallel rank holds,
the head dim, the block size, the rank and the TP size, the layout of a block's
payload, and the hash algorithm and seed that name blocks. Every remote key
and every stored value carries ``Fingerprint.digest``; a value written under
one fingerprint is never read under another.

Contract:

* ``weights_digest(named_tensors)`` hashes every tensor's name, dtype, shape and
  bytes in name order. It reads every byte of the weights, so compute it once
  when a tier is attached (and again only after the weights change in place).
* ``Fingerprint(...)`` refuses a missing hash seed (``UnpinnedHashSeed``): the
  default seed is random per process, so two replicas would never agree on a
  block hash and a shared tier would only ever miss. Pin ``hash_seed=`` on the
  manager, or take ``derived_hash_seed(...)`` (a seed from the other fields:
  deterministic, so anyone holding the same weights can predict the hashes).

No torch and no redis here: tensors are read through their own methods.
"""

from __future__ import annotations

import dataclasses
import json
import struct
from dataclasses import dataclass, field
from typing import Iterable

import xxhash

from ..checks import integer
from ..errors import InvalidArgument, PrefixKVError
from ..hashing import HASH_ALGORITHMS
from ..sizing import DTYPE_BYTES

__all__ = ["Fingerprint", "UnpinnedHashSeed", "weights_digest", "derived_hash_seed", "canonical_dtype",
           "LAYOUT_L2BHD", "DIGEST_SIZE"]

DIGEST_SIZE = 16

# A block's payload: layers x (K, V) x slots x KV heads x head dim, C order, the
# order of ``KVStore.data[:, :, block]`` (see ``staging``). Another layout is
# another string, hence another fingerprint.
LAYOUT_L2BHD = "L2BHD"

# Aliases spell one dtype several ways; the fingerprint uses one name per dtype.
_CANONICAL = {"fp32": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"}


class UnpinnedHashSeed(PrefixKVError, ValueError):
    """A shared tier was asked for without a pinned hash seed."""

    def __init__(self) -> None:
        super().__init__(
            "a remote tier needs a pinned hash seed: the default seed is random per process, so replicas "
            "would never agree on a block hash and would share nothing. Pass hash_seed=<int> to the manager "
            "(the same on every replica), or use prefixkv.tiers.fingerprint.derived_hash_seed(...)")




def payload_view(payload: object, index: int, block_bytes: int) -> memoryview:
    """``payloads[index]`` as a flat byte view of exactly one block (``InvalidArgument`` naming
    ``payloads`` otherwise): what the staging buffer and the Redis store accept as a block."""
    try:
        view = memoryview(payload).cast("B")
    except (TypeError, ValueError) as exc:
        raise InvalidArgument("payloads", f"payload {index} is not a contiguous buffer: {exc}") from None
    if view.nbytes != block_bytes:
        raise InvalidArgument("payloads", f"payload {index} is {view.nbytes} bytes; a block is {block_bytes}")
    return view


def canonical_dtype(dtype: object) -> str:
    """``"bf16"``, ``"bfloat16"`` or ``torch.bfloat16`` -> ``"bfloat16"``; refuses unknown dtypes."""
    name = str(dtype).removeprefix("torch.")
    name = _CANONICAL.get(name, name)
    if name not in DTYPE_BYTES:
        raise InvalidArgument("dtype", f"unknown KV dtype {dtype!r}; choose from {', '.join(sorted(DTYPE_BYTES))}")
    return name


def _tensor_bytes(tensor: object) -> memoryview:
    """The raw bytes of a torch tensor, a numpy array or any buffer, in C order."""
    if hasattr(tensor, "detach"):
        # A torch tensor (bf16 included, which numpy lacks): torch is imported only here, where a
        # tensor proves it is installed; ``import prefixkv.tiers.fingerprint`` stays torch-free.
        import torch

        t = tensor.detach().cpu().contiguous().reshape(-1)
        return memoryview(t.view(torch.uint8).numpy()).cast("B")
    if hasattr(tensor, "tobytes") and hasattr(tensor, "dtype"):   # numpy
        import numpy as np

        return memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8))
    return memoryview(tensor).cast("B")


def weights_digest(named_tensors: Iterable[tuple[str, object]]) -> bytes:
    """xxh3-128 over every (name, dtype, shape, bytes) in name order.

    Pass ``model.state_dict().items()`` (parameters and buffers) or any iterable
    of ``(name, tensor)``; torch tensors on any device, numpy arrays and buffers
    are accepted. Names must be unique.
    """
    items = sorted(named_tensors, key=lambda kv: kv[0])
    seen: set[str] = set()
    h = xxhash.xxh3_128(b"prefixkv/weights/v1")
    for name, tensor in items:
        if name in seen:
            raise InvalidArgument("named_tensors", f"weight {name!r} appears twice")
        seen.add(name)
        shape = tuple(int(s) for s in getattr(tensor, "shape", ()))
        meta = f"{name}\0{getattr(tensor, 'dtype', '')}\0{shape}".encode()
        h.update(struct.pack("<I", len(meta)) + meta)
        data = _tensor_bytes(tensor)
        h.update(struct.pack("<Q", data.nbytes))
        h.update(data)
    if not seen:
        raise InvalidArgument("named_tensors", "weights_digest needs at least one tensor")
    return h.digest()


def derived_hash_seed(weights: bytes, *, dtype: str, block_size: int, hash_algorithm: str = "xxh3_128") -> int:
    """A hash seed every replica of the same model computes alike (64 bits).

    Deterministic by design: block hashes become predictable to anyone with
    the same weights, which a per-process random seed prevents. Prefer an
    operator-chosen secret seed where tenants must not probe each other.
    """
    text = f"prefixkv/seed/v1\0{canonical_dtype(dtype)}\0{block_size}\0{hash_algorithm}".encode()
    return xxhash.xxh3_64_intdigest(text + bytes(weights))


@dataclass(frozen=True, slots=True)
class Fingerprint:
    """Everything that makes a block's KV bytes compatible; ``digest`` names it (16 bytes)."""

    weights: bytes                # weights_digest(...)
    dtype: str
    layers: int
    kv_heads: int                 # KV heads held by one tensor-parallel rank
    head_dim: int
    block_size: int
    hash_seed: int | None
    hash_algorithm: str = "xxh3_128"
    tp_rank: int = 0
    tp_size: int = 1
    layout: str = LAYOUT_L2BHD
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.hash_seed is None:
            raise UnpinnedHashSeed()
        # Every field is checked before any is normalised: a refused fingerprint was never half-built.
        # Integer fields are stored as int: they are written into the digest as text, where 2.0, True
        # or np.int64(2) must not name another fingerprint than 2.
        if not isinstance(self.weights, (bytes, bytearray)) or len(self.weights) < 8:
            raise InvalidArgument("weights", "expected a digest of the weights' contents (weights_digest(...)), "
                                             f"got {self.weights!r}")
        dtype = canonical_dtype(self.dtype)
        ints = {name: integer(name, getattr(self, name), low=1)
                for name in ("layers", "kv_heads", "head_dim", "block_size", "tp_size")}
        ints["hash_seed"] = integer("hash_seed", self.hash_seed)
        ints["tp_rank"] = integer("tp_rank", self.tp_rank)
        if not 0 <= ints["tp_rank"] < ints["tp_size"]:
            raise InvalidArgument("tp_rank", f"must be in [0, {ints['tp_size']}), got {self.tp_rank}")
        if not isinstance(self.hash_algorithm, str) or self.hash_algorithm not in HASH_ALGORITHMS:
            raise InvalidArgument("hash_algorithm", f"unknown hash algorithm {self.hash_algorithm!r}; "
                                                    f"choose from {sorted(HASH_ALGORITHMS)}")
        if not isinstance(self.layout, str) or not self.layout or "\0" in self.layout:
            raise InvalidArgument("layout", f"expected a non-empty name without NUL, got {self.layout!r}")
        object.__setattr__(self, "weights", bytes(self.weights))
        object.__setattr__(self, "dtype", dtype)
        for name, value in ints.items():
            object.__setattr__(self, name, value)
        text = "\0".join(str(v) for v in (
            "prefixkv/fingerprint/v1", self.dtype, self.layers, self.kv_heads, self.head_dim, self.block_size,
            self.tp_rank, self.tp_size, self.hash_algorithm, self.hash_seed % 2**128, self.layout)).encode()
        object.__setattr__(self, "digest", xxhash.xxh3_128_digest(text + b"\0" + self.weights))

    @property
    def hex(self) -> str:
        return self.digest.hex()

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def hash_size(self) -> int:
        """Bytes of one block hash under this fingerprint's algorithm."""
        return HASH_ALGORITHMS[self.hash_algorithm][1]

    @property
    def block_bytes(self) -> int:
        """Bytes of one block's payload: K and V of every layer."""
        return 2 * self.layers * self.block_size * self.kv_heads * self.head_dim * self.dtype_bytes

    @classmethod
    def for_model(cls, named_tensors: Iterable[tuple[str, object]], *, dtype: object, layers: int, kv_heads: int,
                  head_dim: int, block_size: int, hash_seed: int | None, hash_algorithm: str = "xxh3_128",
                  tp_rank: int = 0, tp_size: int = 1, layout: str = LAYOUT_L2BHD) -> "Fingerprint":
        """Hash the weights (once) and build the fingerprint. The seed is checked first, so an
        unpinned seed is refused before the weights are read."""
        if hash_seed is None:
            raise UnpinnedHashSeed()
        return cls(weights_digest(named_tensors), str(dtype), layers, kv_heads, head_dim, block_size, hash_seed,
                   hash_algorithm, tp_rank, tp_size, layout)


def model_weights_digest(model) -> bytes:
    """The digest of what shapes a torch model's KV bytes; reads every byte of its tensors.

    Its ``state_dict`` (parameters and persistent buffers), its non-persistent buffers (Hugging
    Face keeps the rotary frequencies there) and its ``config`` (rope theta and scaling, norm
    eps: equal weights under another config compute other KV). A wrapper without a
    ``state_dict`` of its own (``HFEngineModel``) is read through the model it wraps
    (``hf_model``). Private config fields (``_name_or_path``, ``_attn_implementation``) and
    ``transformers_version`` are left out: replicas of one checkpoint still agree."""
    module = model if hasattr(model, "state_dict") else getattr(model, "hf_model", None)
    state_dict = getattr(module, "state_dict", None)
    if state_dict is None:
        raise InvalidArgument("model", f"cannot read the weights of a {type(model).__name__} (no state_dict()); "
                                       "pass weights= (prefixkv.tiers.fingerprint.weights_digest of its tensors)")
    tensors = dict(state_dict())
    named_buffers = getattr(module, "named_buffers", None)
    if named_buffers is not None:
        for name, buffer in named_buffers():
            tensors.setdefault(name, buffer)
    config = _config_text(getattr(module, "config", None) or getattr(model, "config", None))
    if config is not None:
        tensors["\0config"] = config
    return weights_digest(tensors.items())


def _config_text(config) -> bytes | None:
    """A model config as canonical JSON bytes (None: no config to read)."""
    if config is None:
        return None
    if dataclasses.is_dataclass(config) and not isinstance(config, type):
        fields = dataclasses.asdict(config)
    elif callable(getattr(config, "to_dict", None)):
        fields = config.to_dict()
    else:
        return None
    fields = {k: v for k, v in fields.items() if not str(k).startswith("_") and k != "transformers_version"}
    return json.dumps(fields, sort_keys=True, default=repr).encode()
