"""Where the KV bytes live: paged K and V pools per layer (torch extra).

Layout. Every layer has a K pool and a V pool, each a contiguous tensor
``[num_blocks, block_size, kv_heads, head_dim]`` (physical block, slot in the
block, KV head, dimension): the layout the manager's slot numbers index
(``slot = block * block_size + offset``) and the attention kernels read. The
pools are views of one backing allocation ``data`` shaped
``[layers, 2, num_blocks, block_size, kv_heads, head_dim]`` (index 0: K, 1: V),
so ``k[layer]`` and ``v[layer]`` are separate, contiguous tensors while a block
copy touches every layer's K and V with a single index operation.

Executing the manager's output:

* ``write(layer, slot_mapping, k, v)``: new KV through a slot mapping
  (``KVCacheManager.slot_mapping`` / ``decode_step`` / ``append_token``).
* ``copy_blocks(KVCacheManager.take_copies())``: copy-on-write, before that
  step's writes.
* ``allocate_host(n)``, then ``swap_out(KVCacheManager.swap_out(seq))`` and
  ``swap_in(KVCacheManager.swap_in(seq))``: preemption by swapping.
* ``transfer(mgr.take_demotions(), mgr.take_loads(), mgr.take_copies())``: the
  host tier's demotions (device -> host) and loads (host -> device), then the
  copy-on-write copies, in that order, before the step's writes. The host tier
  and swap space are one host pool (``allocate_host``).

Stream ordering on CUDA: every operation here is a torch operation issued on
the *current* CUDA stream, so a ``copy_blocks`` (or ``swap_in``) followed by
``write`` calls and attention on the same stream runs in that order on the
device, with no host synchronisation. Callers that write or read on another
stream must order it themselves (an event, or ``torch.cuda.current_stream().wait_stream``).
``swap_out`` returns once the host copy is complete (host memory is safe to read
and the device blocks safe to reuse).

Grad modes: the pools (and the host swap space) are always normal tensors,
allocated under ``torch.inference_mode(False)``, so a store built inside
``torch.inference_mode()`` can be written outside it and the other way round.

CPU memory: the pools of a CPU store and a host pool that is not pinned (pinned is for
CUDA) ask for transparent huge pages (``_cpu_zeros``), and CPU block moves (swap, demote,
load) copy runs of blocks with ``memmove`` through numpy views of the same memory
(``_copy_runs``); ``copy_blocks`` is one index_select + index_copy_ on every device.

Only ``import prefixkv.kv.storage`` needs torch; ``import prefixkv`` does not.
"""

from __future__ import annotations

import ctypes
import math
import operator
import sys
from typing import Iterable, Sequence

import numpy as np
import torch

from ..copies import BlockCopies
from ..errors import InvalidArgument
from ..sizing import KVSpec, parse_size

__all__ = ["KVStore", "TORCH_DTYPES", "torch_dtype"]

TORCH_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "fp32": torch.float32,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
}
_SUPPORTED = (torch.float32, torch.float16, torch.bfloat16)


def torch_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"bfloat16"`` / ``"bf16"`` / ``torch.bfloat16`` -> ``torch.bfloat16``; refuses the rest
    (``InvalidArgument`` naming ``dtype``: the ValueError this raised before it named it)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _SUPPORTED:
            raise InvalidArgument("dtype", f"KV storage supports float32, float16 and bfloat16, not {dtype}")
        return dtype
    try:
        return TORCH_DTYPES[dtype]
    except (KeyError, TypeError):       # (TypeError: an unhashable dtype, a list)
        raise InvalidArgument("dtype", f"KV storage supports float32, float16 and bfloat16 "
                                       f"({', '.join(sorted(TORCH_DTYPES))}), not {dtype!r}") from None


def _block_rows(t: torch.Tensor) -> np.ndarray:
    """A contiguous CPU pool ``[layers, 2, blocks, ...]`` as a numpy view ``[layers * 2, blocks]``
    of the same memory whose elements are raw bytes, one (layer, K/V, block) chunk each: any
    dtype (bfloat16 included), and an assignment copies each chunk with one ``memmove``."""
    if not t.is_contiguous():
        raise ValueError("block copies need contiguous pools")   # a reshape would copy, and writes be lost
    planes, blocks = t.shape[0] * t.shape[1], t.shape[2]
    row = t[0, 0, 0].numel() * t.element_size()
    raw = t.detach().view(torch.uint8).numpy().reshape(planes, blocks, row)
    return raw.view(np.dtype((np.void, row)))[..., 0]


def _copy_runs(dst: torch.Tensor, dst_blocks: list[int], src: torch.Tensor, src_blocks: list[int]) -> int:
    """Copy blocks (dim 2 of ``[layers, 2, blocks, ...]``) between two contiguous CPU tensors in
    one pass, without staging.

    ``dst_blocks`` must be distinct (``_resolve_copies`` makes them so) and ``dst`` must not
    share memory with ``src``; the pairs then commute, so they run in source order: pairs that
    continue each other (``s + 1 -> d + 1``) become one slice copy whatever order they came in.
    The copies go through numpy views of the same memory (``_block_rows``): a run is one
    assignment that moves whole (layer, K/V) chunks with ``memmove``, at a fraction of the
    per-call cost of a torch ``copy_`` of the strided block. An index_select into a staging tensor and an
    index_copy_ out of it would move every byte twice (and index_copy_ scatters element by
    element on the CPU).
    """
    rows_dst, rows_src = _block_rows(dst), _block_rows(src)
    pairs = sorted(zip(src_blocks, dst_blocks))
    i, n = 0, len(pairs)
    while i < n:
        s, d = pairs[i]
        j = i + 1
        while j < n and pairs[j][0] == s + (j - i) and pairs[j][1] == d + (j - i):
            j += 1
        rows_dst[:, d:d + j - i] = rows_src[:, s:s + j - i]
        i = j
    return n


_HUGE_PAGE = 2 << 20
_MADV_HUGEPAGE = 14   # Linux <sys/mman.h>


def _madvise_huge_pages():
    """``libc.madvise`` where transparent huge pages can be asked for (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        madvise = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    madvise.restype = ctypes.c_int
    return madvise


_madvise = _madvise_huge_pages()


def _cpu_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``torch.zeros(shape, dtype=dtype)`` on the CPU, backed by transparent huge pages where
    the kernel grants them (Linux, THP ``always`` or ``madvise``).

    A block move touches each block as 2 x layers chunks of ``block_size * kv_heads *
    head_dim`` elements scattered over the pool (32 KiB for 8 KV heads x 128 in bf16 at block
    size 16); on 4 KiB pages ``demote`` / ``load`` of scattered blocks take 25-40% longer
    (page walks for every chunk; ``benches/test_bench_host_tier.py``). The tensor
    is a contiguous view, 2 MiB-aligned, of an allocation one huge page larger; where THP is
    off it is ordinary memory, as before. Pools under 4 MiB are plain ``torch.zeros``.
    """
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if _madvise is None or nbytes < 2 * _HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + _HUGE_PAGE, dtype=torch.uint8)
    start = -raw.data_ptr() % _HUGE_PAGE
    _madvise(raw.data_ptr() + start, nbytes - nbytes % _HUGE_PAGE, _MADV_HUGEPAGE)   # advice only
    tensor = raw[start:start + nbytes].view(dtype).view(shape)
    tensor.zero_()          # before first use: faults every page in (huge where granted)
    return tensor


# The errors below are InvalidArgument naming the caller's argument (``copies``, ``demotions``, ...):
# both the TypeError and the ValueError they were before they named it.

def _block_id(value, what: str, i: int, pair, argument: str) -> int:
    """One block id of ``what`` pair ``i``: an integer (a Python or numpy int, an integer 0-d
    tensor); a float, a string or a bool is refused rather than truncated, parsed or taken as 0 / 1."""
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(argument, f"{what} pair {i} {pair!r} has block id {value!r}, not an integer")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(argument, f"{what} pair {i} {pair!r} has block id {value!r}, "
                                        "not an integer") from None


def _check_span(low: int, high: int, what: str, limit: int, argument: str) -> None:
    if low < 0 or high >= limit:
        raise InvalidArgument(argument, f"{what} out of range: values span [{low}, {high}], valid is [0, {limit})")


def _resolve_copies(copies: Iterable[tuple[int, int]], *, chained: bool, what: str = "copy",
                    limits: tuple[str, int, str, int] | None = None,
                    argument: str = "copies") -> tuple[list[int], list[int]]:
    """(src, dst) pairs, run in order, as one gather + one scatter with the same result.

    A later pair may read a block an earlier pair wrote (COW of a block that
    was itself just copied, e.g. fork -> append -> fork -> append in one step)
    or overwrite an earlier destination; a gather of all sources followed by a
    scatter would get both wrong. ``chained`` (source and destination in the
    same pool) follows each source back to the block whose *current* content
    it will hold; in every case the last write to a destination wins. Block ids
    must be integers and every item a (source, destination) pair (errors name ``argument``, the
    caller's, and ``what`` pair it is).
    ``limits`` (source name, source pool size, destination name, size) range-checks every id
    given, before the resolution drops any (a self-copy, an overwritten destination).
    """
    if isinstance(copies, BlockCopies):
        if limits is not None and len(copies):
            _check_span(int(copies.src.min()), int(copies.src.max()), limits[0], limits[1], argument)
            _check_span(int(copies.dst.min()), int(copies.dst.max()), limits[2], limits[3], argument)
        if not chained and np.unique(copies.dst).shape[0] == len(copies):
            return copies.src.tolist(), copies.dst.tolist()     # every destination written once: in order
        copies = zip(copies.src.tolist(), copies.dst.tolist())   # int64, checked
        checked = False
    else:
        checked = True
    origin: dict[int, int] = {}
    raw_src: list[int] = []
    if checked:
        for i, pair in enumerate(copies):
            try:
                src, dst = pair
            except (TypeError, ValueError):
                raise InvalidArgument(argument, f"item {i} must be a (source, destination) {what} pair, "
                                                f"got {pair!r}") from None
            if type(src) is not int:       # (a bool is not ``int`` here either)
                src = _block_id(src, what, i, pair, argument)
            if type(dst) is not int:
                dst = _block_id(dst, what, i, pair, argument)
            raw_src.append(src)
            origin[dst] = origin.get(src, src) if chained else src
    else:
        for src, dst in copies:
            origin[dst] = origin.get(src, src) if chained else src
    if checked and limits is not None and origin:
        _check_span(min(raw_src), max(raw_src), limits[0], limits[1], argument)
        _check_span(min(origin), max(origin), limits[2], limits[3], argument)   # every destination given is a key
    pairs = [(s, d) for d, s in origin.items() if not (chained and s == d)]
    return [s for s, _ in pairs], [d for _, d in pairs]


def _count(value, what: str) -> int:
    """An integer argument (a Python or numpy int; not a bool, a float or a string)."""
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgument(what, f"must be an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise InvalidArgument(what, f"must be an integer, got {value!r}") from None


class KVStore:
    """Per-layer K and V block pools on one torch device.

    >>> from prefixkv import KVSpec
    >>> store = KVStore(KVSpec(layers=2, kv_heads=2, head_dim=8, dtype="float32"), num_blocks=4, block_size=16)
    >>> store.k[0].shape
    torch.Size([4, 16, 2, 8])
    """

    def __init__(self, spec: KVSpec, num_blocks: int, block_size: int, device: str | torch.device = "cpu",
                 *, dtype: str | torch.dtype | None = None) -> None:
        num_blocks, block_size = _count(num_blocks, "num_blocks"), _count(block_size, "block_size")
        if num_blocks <= 0:
            raise InvalidArgument("num_blocks", f"must be positive, got {num_blocks}")
        if block_size <= 0:
            raise InvalidArgument("block_size", f"must be positive, got {block_size}")
        self.spec = spec
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.num_layers = spec.layers
        self.kv_heads = spec.kv_heads_per_gpu
        self.head_dim = spec.head_dim
        self.dtype = torch_dtype(spec.dtype if dtype is None else dtype)
        self.device = torch.device(device)
        # Normal (non-inference) tensors whatever the caller's grad mode: a store built
        # inside ``torch.inference_mode()`` would otherwise hold inference tensors that
        # cannot be written in place outside it. Normal tensors can be written in both.
        with torch.inference_mode(False):
            shape = (self.num_layers, 2, self.num_blocks, self.block_size, self.kv_heads, self.head_dim)
            if self.device.type == "cpu":
                self.data = _cpu_zeros(shape, self.dtype)
            else:
                self.data = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.k: list[torch.Tensor] = [self.data[layer, 0] for layer in range(self.num_layers)]
            self.v: list[torch.Tensor] = [self.data[layer, 1] for layer in range(self.num_layers)]
        self.host: torch.Tensor | None = None

    @classmethod
    def from_budget(cls, spec: KVSpec, block_size: int, pool_bytes: int | str,
                    device: str | torch.device = "cpu") -> "KVStore":
        """As many blocks as ``pool_bytes`` holds: ``spec.num_blocks(pool_bytes, block_size)``,
        the number ``prefixkv plan`` prints for the same spec, block size and pool."""
        pool_bytes = parse_size(pool_bytes)
        torch_dtype(spec.dtype)  # refuse fp8/int8 before sizing with their byte width
        num_blocks = spec.num_blocks(pool_bytes, block_size)
        if num_blocks <= 0:
            raise InvalidArgument("pool_bytes", f"{pool_bytes} bytes hold no block of "
                                                f"{spec.bytes_per_block(block_size)} bytes")
        return cls(spec, num_blocks, block_size, device)

    # -- sizes ---------------------------------------------------------------
    @property
    def bytes(self) -> int:
        """Device bytes of all K and V pools (``num_blocks * spec.bytes_per_block(block_size)``)."""
        return self.data.numel() * self.data.element_size()

    @property
    def host_bytes(self) -> int:
        return 0 if self.host is None else self.host.numel() * self.host.element_size()

    @property
    def num_host_blocks(self) -> int:
        return 0 if self.host is None else self.host.shape[2]

    def __repr__(self) -> str:
        return (f"KVStore(layers={self.num_layers}, num_blocks={self.num_blocks}, block_size={self.block_size}, "
                f"kv_heads={self.kv_heads}, head_dim={self.head_dim}, dtype={self.dtype}, device={self.device}, "
                f"host_blocks={self.num_host_blocks})")

    # -- helpers -------------------------------------------------------------
    def _index(self, values, what: str, limit: int, device: torch.device, *, stop: int | None = None,
               argument: str | None = None) -> torch.Tensor:
        """int64 index tensor on ``device``; range-checked when the values are on the CPU (lists,
        arrays, CPU tensors: checked *before* they move to ``device``, so a bad id is a ValueError
        rather than a device-side assert; values already on the device are trusted, no sync).
        Errors are ``InvalidArgument`` naming ``argument`` (``what`` by default)."""
        argument = argument or what
        name = "" if argument == what else f"{what} "
        if isinstance(values, torch.Tensor):
            if values.dtype.is_floating_point or values.dtype.is_complex or values.dtype == torch.bool:
                raise InvalidArgument(argument, f"{name}must hold integers, got {values.dtype}")
            index = values.reshape(-1)
            if device.type == "cpu":
                index = index.to(device)      # to the CPU anyway (a sync): checked there
        else:
            array = np.asarray(values)
            if array.size and not np.issubdtype(array.dtype, np.integer):
                raise InvalidArgument(argument, f"{name}must hold integers, got {array.dtype}")
            index = torch.from_numpy(np.ascontiguousarray(array, dtype=np.int64).reshape(-1))
        if stop is not None:
            if stop > index.numel():
                raise InvalidArgument(argument, f"{name}has {index.numel()} entries but {stop} are needed")
            index = index[:stop]
        if index.device.type == "cpu" and index.numel():
            low, high = int(index.min()), int(index.max())
            if low < 0 or high >= limit:
                raise InvalidArgument(argument, f"{name}out of range: values span [{low}, {high}], "
                                                f"valid is [0, {limit})")
        return index.to(device=device, dtype=torch.int64)

    def _layer(self, layer: int) -> int:
        if isinstance(layer, (bool, np.bool_)) or not isinstance(layer, (int, np.integer)):
            raise InvalidArgument("layer", f"must be an integer, got {layer!r}")
        if not -self.num_layers <= layer < self.num_layers:
            # an IndexError as a list's, not InvalidArgument: callers index layers as they index lists
            raise IndexError(f"layer {layer} out of range for {self.num_layers} layer(s)")
        return int(layer) % self.num_layers

    # -- writes --------------------------------------------------------------
    def write(self, layer: int, slot_mapping, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store ``k``, ``v`` (``[num_tokens, kv_heads, head_dim]``, the pool's dtype) at the
        physical slots ``slot_mapping`` (``block * block_size + offset``, one per token).

        One ``index_copy_`` per pool on the flattened ``[num_blocks * block_size, H, d]``
        view; no Python loop over tokens. Slots must be distinct within one call: with a slot
        given twice, which token's KV it keeps is unspecified (on CUDA it can differ from run to
        run). Not checked, for its cost: a check on the host (the only place it can run without
        a sync) measured +3-7% on a write of 4,096 slots and +18-50% on a decode-sized write of 8
        (2 shared cores, CPU pools); the manager's slot mappings never repeat a slot (a shared
        block is copied before a sequence writes into it).
        """
        layer = self._layer(layer)
        shape = (self.kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InvalidArgument(name, f"must be a torch tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != shape:
                raise InvalidArgument(name, f"must be [num_tokens, {shape[0]}, {shape[1]}], got {tuple(t.shape)}")
            if t.dtype != self.dtype:
                raise InvalidArgument(name, f"is {t.dtype} but the pools hold {self.dtype}")
            if t.device != self.device:
                raise InvalidArgument(name, f"is on {t.device} but the pools are on {self.device}")
        if k.shape[0] != v.shape[0]:
            raise InvalidArgument("v", f"k has {k.shape[0]} tokens but v has {v.shape[0]}")
        slots = self._index(slot_mapping, "slot_mapping", self.num_blocks * self.block_size, self.device)
        if slots.numel() != k.shape[0]:
            raise InvalidArgument("slot_mapping", f"has {slots.numel()} slots for {k.shape[0]} tokens")
        if not slots.numel():
            return
        self.k[layer].view(-1, *shape).index_copy_(0, slots, k)
        self.v[layer].view(-1, *shape).index_copy_(0, slots, v)

    def copy_blocks(self, copies: Iterable[tuple[int, int]]) -> int:
        """Run copy-on-write copies, ``(src, dst)`` pairs as ``KVCacheManager.take_copies()``
        returns them (oldest first), in every layer's K and V pool; returns the copies run.

        Vectorised: one gather and one scatter over the backing tensor, for all
        layers and both pools. Pairs are resolved as if run one after another
        (see ``_resolve_copies``). On CUDA the copy is queued on the current
        stream, so run it before that step's ``write`` calls on the same stream
        (the manager's contract) and they see the copied blocks.
        """
        return self._run_copies(*self._cow_pairs(copies))

    def _cow_pairs(self, copies) -> tuple[list[int], list[int]]:
        """``copy_blocks``' pairs resolved and checked (integers, in range), nothing moved yet."""
        return _resolve_copies(copies, chained=True, what="copy", argument="copies",
                               limits=("copy source block", self.num_blocks, "copy destination block", self.num_blocks))

    def _run_copies(self, src: list[int], dst: list[int]) -> int:
        if not dst:
            return 0
        src_index = self._index(src, "copy source block", self.num_blocks, self.device)
        dst_index = self._index(dst, "copy destination block", self.num_blocks, self.device)
        self.data.index_copy_(2, dst_index, self.data.index_select(2, src_index))
        return len(dst)

    # -- host swap space -----------------------------------------------------
    def allocate_host(self, num_host_blocks: int) -> None:
        """Host memory for ``num_host_blocks`` blocks of every layer's K and V (pinned when the
        pools are on CUDA); pass the same number as ``KVCacheManager(num_host_blocks=...)``."""
        num_host_blocks = _count(num_host_blocks, "num_host_blocks")
        if num_host_blocks < 0:
            raise InvalidArgument("num_host_blocks", f"must be >= 0, got {num_host_blocks}")
        shape = (self.num_layers, 2, num_host_blocks, self.block_size, self.kv_heads, self.head_dim)
        with torch.inference_mode(False):   # usable inside and outside inference mode (see __init__)
            if self.device.type == "cuda":
                self.host = torch.zeros(shape, dtype=self.dtype, device="cpu", pin_memory=True)
            else:
                self.host = _cpu_zeros(shape, self.dtype)

    def _need_host(self) -> torch.Tensor:
        if self.host is None:
            raise RuntimeError("no host swap space: call allocate_host(num_host_blocks) first")
        return self.host

    def swap_out(self, copies: Sequence[tuple[int, int]]) -> int:
        """Device -> host for ``(device_block, host_block)`` pairs (``KVCacheManager.swap_out``),
        all layers, K and V. Returns when the host copy is done; returns the blocks copied."""
        return self._to_host(*self._host_pairs(copies, "swap-out", to_host=True, argument="copies"))

    def swap_in(self, copies: Sequence[tuple[int, int]]) -> int:
        """Host -> device for ``(host_block, device_block)`` pairs (``KVCacheManager.swap_in``),
        all layers, K and V; on CUDA queued on the current stream (run it before the
        sequence's next step on that stream). Returns the blocks copied."""
        return self._to_device(*self._host_pairs(copies, "swap-in", to_host=False, argument="copies"))

    def demote(self, demotions: Sequence[tuple[int, int]]) -> int:
        """Evicted device blocks to the host tier: ``(device_block, host_block)`` pairs from
        ``KVCacheManager.take_demotions()``. Run before anything can write those device blocks
        (the step's loads and writes); returns when the host copies are complete."""
        return self._to_host(*self._host_pairs(demotions, "demotion", to_host=True, argument="demotions"))

    def load(self, loads: Sequence[tuple[int, int]]) -> int:
        """Host-tier hits to the device: ``(host_block, device_block)`` pairs from
        ``KVCacheManager.take_loads()``, after ``demote`` and before the step's copies and writes
        (queued on the current stream on CUDA, like ``swap_in``)."""
        return self._to_device(*self._host_pairs(loads, "load", to_host=False, argument="loads"))

    def transfer(self, demotions: Sequence[tuple[int, int]], loads: Sequence[tuple[int, int]],
                 copies: Iterable[tuple[int, int]] = ()) -> None:
        """A step's block moves in the order they must run: demotions (they read device blocks
        about to be reused), loads (they write reused blocks), copy-on-write copies. All three
        batches are checked first: a bad pair in any of them raises with nothing moved."""
        demoted = self._host_pairs(demotions, "demotion", to_host=True, argument="demotions")
        loaded = self._host_pairs(loads, "load", to_host=False, argument="loads")
        copied = self._cow_pairs(copies)
        self._to_host(*demoted)
        self._to_device(*loaded)
        self._run_copies(*copied)

    def _host_pairs(self, pairs, what: str, *, to_host: bool, argument: str) -> tuple[list[int], list[int], str]:
        """Device <-> host pairs resolved and checked (integers, in range, host space there),
        nothing moved yet."""
        if not isinstance(pairs, (BlockCopies, list, tuple, np.ndarray)):
            pairs = list(pairs)            # a generator, any iterable of pairs
        if not len(pairs):
            return [], [], what
        host_blocks = self._need_host().shape[2]
        src_where, src_limit = ("device", self.num_blocks) if to_host else ("host", host_blocks)
        dst_where, dst_limit = ("host", host_blocks) if to_host else ("device", self.num_blocks)
        src, dst = _resolve_copies(pairs, chained=False, what=what, argument=argument,
                                   limits=(f"{what} {src_where} block", src_limit, f"{what} {dst_where} block", dst_limit))
        return src, dst, what

    def _to_host(self, src: list[int], dst: list[int], what: str) -> int:
        if not dst:
            return 0
        host = self._need_host()
        if self.device.type == "cpu":
            return _copy_runs(host, dst, self.data, src)
        src_index = self._index(src, f"{what} device block", self.num_blocks, self.device)
        dst_index = self._index(dst, f"{what} host block", host.shape[2], torch.device("cpu"))
        staged = self.data.index_select(2, src_index)
        pinned = torch.empty(staged.shape, dtype=staged.dtype, pin_memory=True)
        pinned.copy_(staged)   # synchronous: the host buffer is complete when this returns
        host.index_copy_(2, dst_index, pinned)
        return len(dst)

    def _to_device(self, src: list[int], dst: list[int], what: str) -> int:
        if not dst:
            return 0
        host = self._need_host()
        if self.device.type == "cpu":
            return _copy_runs(self.data, dst, host, src)
        src_index = self._index(src, f"{what} host block", host.shape[2], torch.device("cpu"))
        dst_index = self._index(dst, f"{what} device block", self.num_blocks, self.device)
        shape = list(host.shape)
        shape[2] = len(src)
        pinned = torch.empty(shape, dtype=host.dtype, pin_memory=True)
        torch.index_select(host, 2, src_index, out=pinned)
        # non_blocking from pinned memory: the caching allocator keeps ``pinned``
        # alive until the copy that reads it has run on the stream.
        self.data.index_copy_(2, dst_index, pinned.to(self.device, non_blocking=True))
        return len(dst)

    # -- reads ---------------------------------------------------------------
    def gather(self, layer: int, block_table, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The contiguous ``[length, kv_heads, head_dim]`` K and V of one sequence (tests, debugging)."""
        layer = self._layer(layer)
        length = _count(length, "length")
        if length < 0:
            raise InvalidArgument("length", f"must be >= 0, got {length}")
        needed = -(-length // self.block_size)
        table = self._index(block_table, f"(for length {length})", self.num_blocks, self.device,
                            stop=needed, argument="block_table")
        shape = (-1, self.kv_heads, self.head_dim)
        k = self.k[layer].index_select(0, table).reshape(shape)[:length].contiguous()
        v = self.v[layer].index_select(0, table).reshape(shape)[:length].contiguous()
        return k, v
