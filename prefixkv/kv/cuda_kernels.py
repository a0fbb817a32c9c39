"""Paged attention with the CuPy raw kernels of ``kernels/paged_attention.cu``.

``paged_attention_cuda(query, k_pool, v_pool, block_tables, seq_lens, scale,
query_start_loc=None, return_lse=False)`` runs on torch CUDA tensors:

* pools ``[num_blocks, block_size, kv_heads, head_dim]``, fp16 or bf16, contiguous;
  block size 8, 16 or 32, head dim 64 or 128; ``query`` of the same dtype;
* decode: ``query [num_seqs, Hq, head_dim]``, query ``i`` at position ``seq_lens[i] - 1``
  (its K/V already written); extend: ``query [total_new_tokens, Hq, head_dim]`` with
  ``query_start_loc`` int32 ``[num_seqs + 1]``: the new tokens are the last ``q_len_i``
  positions of sequence ``i`` and see the history plus the new tokens up to themselves;
* ``block_tables`` int32 ``[num_seqs, W]``, ``seq_lens`` int32 ``[num_seqs]``, ``Hq`` a
  multiple of ``Hkv``; returns ``out`` (the query's shape and dtype) or ``(out, lse)`` with
  ``lse`` float32 ``[tokens, Hq]`` in natural log. A length-0 history gives 0 and -inf.

Tensors reach CuPy without copies (``cupy.asarray`` over ``__cuda_array_interface__``; fp16/bf16
are viewed as int16 first, since CuPy has no bfloat16) and the kernels run on torch's current stream.
Nothing reads the device metadata back: the number of context splits comes from the table width,
not from ``seq_lens``, so a call never synchronises. Sequence lengths must not exceed ``W * block_size``
and block ids must be valid; the kernels trust the metadata.

Kernel choice: one CTA per (query token, group of up to ``rows`` query heads of one KV head, context
split). When those CTAs would not fill the GPU (few sequences, long context), the context is split
into ranges of whole blocks; every split writes a partial (acc, max, sum) and a reduction kernel
merges them. The planning below is backend-neutral: the CPU emulation in ``tests/cuda_emu`` launches
the same plans, with the same argument lists, as the CuPy path.
"""

from __future__ import annotations

import math
import os
import threading
from dataclasses import dataclass
from typing import Callable

import numpy as np

SOURCE = "paged_attention.cu"
BLOCK_SIZES = (8, 16, 32)
HEAD_DIMS = (64, 128)
ROWS = (1, 2, 4, 8)                 # query heads per CTA (template parameter)
DTYPES = {"float16": "__half", "bfloat16": "__nv_bfloat16"}
THREADS = 128                       # kThreads in the kernel
TILE = 64                           # kTile
MAX_SPLITS = 512                    # kMaxSplits
MIN_SPLIT_TOKENS = 256              # a split covers at least this many positions
FLAG_EXTEND = 1
FLAG_LSE = 2
LOG2E = 1.4426950408889634
DEFAULT_NUM_SMS = 132               # when the device cannot be asked (planning without a GPU)
CTAS_PER_SM_TARGET = 4              # split the context until about this many CTAs per SM


def attention_kernel_name(dtype: str, head_dim: int, block_size: int, rows: int) -> str:
    return f"prefixkv::paged_attention_kernel<{DTYPES[dtype]}, {head_dim}, {block_size}, {rows}>"


def reduce_kernel_name(dtype: str, head_dim: int) -> str:
    return f"prefixkv::paged_attention_reduce_kernel<{DTYPES[dtype]}, {head_dim}>"


def all_kernel_names() -> list[str]:
    names = []
    for dtype in DTYPES:
        for d in HEAD_DIMS:
            names += [attention_kernel_name(dtype, d, b, r) for b in BLOCK_SIZES for r in ROWS]
            names.append(reduce_kernel_name(dtype, d))
    return names


def default_rows(group: int, head_dim: int) -> int:
    """Query heads per CTA: the whole group up to 4 (head dim 128) or 8 (head dim 64).

    More rows reuse each loaded K/V vector for more heads but cost registers (see the
    register report of ``tests/kv/test_kernels_compile.py``); a larger group is split into
    several CTAs that read the same K/V (mostly from L2).
    """
    cap = 4 if head_dim >= 128 else 8
    want = min(group, cap)
    return next(r for r in ROWS if r >= want)


# -- validation -------------------------------------------------------------------------------------
def _dtype_name(x) -> str:
    name = str(getattr(x, "dtype", "?"))
    return name.replace("torch.", "")


def _is_contiguous(x) -> bool:
    if hasattr(x, "is_contiguous"):
        return bool(x.is_contiguous())
    flags = getattr(x, "flags", None)
    return bool(flags is not None and flags["C_CONTIGUOUS"])


def _data_ptr(x) -> int:
    if hasattr(x, "data_ptr"):
        return int(x.data_ptr())
    return int(x.ctypes.data)


def check_inputs(query, k_pool, v_pool, block_tables, seq_lens, query_start_loc=None, *,
                 dtype: str | None = None) -> dict:
    """Shapes, dtypes, layout and alignment the kernels need; raises ValueError before any launch.

    Works on torch tensors and numpy arrays (the emulator passes bf16 as uint16 with ``dtype``).
    Returns the problem dimensions.
    """
    dtype = dtype or _dtype_name(query)
    if dtype not in DTYPES:
        raise ValueError(f"paged_attention_cuda supports float16 and bfloat16, got {dtype}")
    for name, x in (("k_pool", k_pool), ("v_pool", v_pool)):
        if _dtype_name(x) != _dtype_name(query):
            raise ValueError(f"{name} dtype {_dtype_name(x)} differs from the query's {_dtype_name(query)}")
    if len(k_pool.shape) != 4:
        raise ValueError(f"k_pool must be [num_blocks, block_size, kv_heads, head_dim], got shape {tuple(k_pool.shape)}")
    if tuple(v_pool.shape) != tuple(k_pool.shape):
        raise ValueError(f"v_pool shape {tuple(v_pool.shape)} differs from k_pool's {tuple(k_pool.shape)}")
    _, block_size, num_kv_heads, head_dim = (int(s) for s in k_pool.shape)
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block size {block_size} is not supported by the CUDA kernels (use one of {BLOCK_SIZES})")
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head dim {head_dim} is not supported by the CUDA kernels (use one of {HEAD_DIMS})")
    if len(query.shape) != 3 or int(query.shape[2]) != head_dim:
        raise ValueError(f"query must be [tokens, q_heads, {head_dim}], got shape {tuple(query.shape)}")
    num_tokens, num_q_heads = int(query.shape[0]), int(query.shape[1])
    if num_kv_heads < 1 or num_q_heads % num_kv_heads:
        raise ValueError(f"query heads ({num_q_heads}) must be a multiple of KV heads ({num_kv_heads})")
    if len(block_tables.shape) != 2 or _dtype_name(block_tables) != "int32":
        raise ValueError(f"block_tables must be int32 [num_seqs, W], got {_dtype_name(block_tables)} "
                         f"{tuple(block_tables.shape)}")
    num_seqs = int(block_tables.shape[0])
    if tuple(seq_lens.shape) != (num_seqs,) or _dtype_name(seq_lens) != "int32":
        raise ValueError(f"seq_lens must be int32 [{num_seqs}], got {_dtype_name(seq_lens)} {tuple(seq_lens.shape)}")
    if query_start_loc is None:
        if num_tokens != num_seqs:
            raise ValueError(f"decode needs one query per sequence: {num_tokens} queries, {num_seqs} sequences "
                             "(pass query_start_loc for extend)")
    elif tuple(query_start_loc.shape) != (num_seqs + 1,) or _dtype_name(query_start_loc) != "int32":
        raise ValueError(f"query_start_loc must be int32 [{num_seqs + 1}], got {_dtype_name(query_start_loc)} "
                         f"{tuple(query_start_loc.shape)}")
    arrays = [("query", query), ("k_pool", k_pool), ("v_pool", v_pool), ("block_tables", block_tables),
              ("seq_lens", seq_lens)] + ([("query_start_loc", query_start_loc)] if query_start_loc is not None else [])
    for name, x in arrays:
        if not _is_contiguous(x):
            raise ValueError(f"{name} must be contiguous")
    for name, x in arrays[:3]:
        if _data_ptr(x) % 16:
            raise ValueError(f"{name} must be 16-byte aligned (the kernels use 16-byte vector loads)")
    if num_tokens >= 2**31 or num_seqs >= 2**31:
        raise ValueError("too many tokens")
    return dict(dtype=dtype, num_tokens=num_tokens, num_seqs=num_seqs, num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size,
                table_width=int(block_tables.shape[1]), is_extend=query_start_loc is not None)


def supports(query, k_pool) -> bool:
    """Whether the kernels cover this dtype / block size / head dim / GQA shape (no exception)."""
    try:
        return (_dtype_name(query) in DTYPES and _dtype_name(k_pool) == _dtype_name(query)
                and len(k_pool.shape) == 4 and int(k_pool.shape[1]) in BLOCK_SIZES
                and int(k_pool.shape[3]) in HEAD_DIMS and len(query.shape) == 3
                and int(query.shape[2]) == int(k_pool.shape[3])
                and int(query.shape[1]) % int(k_pool.shape[2]) == 0)
    except Exception:
        return False


# -- planning ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class AttentionPlan:
    dtype: str
    head_dim: int
    block_size: int
    rows: int
    num_tokens: int
    num_seqs: int
    num_q_heads: int
    num_kv_heads: int
    table_width: int
    is_extend: bool
    num_splits: int
    blocks_per_split: int

    @property
    def group(self) -> int:
        return self.num_q_heads // self.num_kv_heads

    @property
    def chunks(self) -> int:
        return -(-self.group // self.rows)

    @property
    def attention_kernel(self) -> str:
        return attention_kernel_name(self.dtype, self.head_dim, self.block_size, self.rows)

    @property
    def reduce_kernel(self) -> str:
        return reduce_kernel_name(self.dtype, self.head_dim)

    @property
    def attention_grid(self) -> tuple[int, int, int]:
        return (self.num_tokens, self.num_kv_heads * self.chunks, self.num_splits)

    @property
    def reduce_grid(self) -> tuple[int, int, int]:
        return (self.num_tokens, self.num_q_heads, 1)

    @property
    def block(self) -> tuple[int, int, int]:
        return (THREADS, 1, 1)


def plan_attention(dims: dict, *, num_sms: int | None = None, num_splits: int | None = None,
                   rows: int | None = None) -> AttentionPlan:
    """Kernel, grid and context split for a problem (``dims`` from ``check_inputs``).

    ``num_splits`` forces the number of context splits (tests, benchmarks); by default the
    context is split when the unsplit grid has fewer than ``CTAS_PER_SM_TARGET`` CTAs per SM,
    into ranges of at least ``MIN_SPLIT_TOKENS`` positions aligned to 64-position tiles.
    """
    group = dims["num_q_heads"] // dims["num_kv_heads"]
    if rows is None:
        rows = default_rows(group, dims["head_dim"])
    if rows not in ROWS:
        raise ValueError(f"rows must be one of {ROWS}, got {rows}")
    width, bs = dims["table_width"], dims["block_size"]
    base_ctas = dims["num_tokens"] * dims["num_kv_heads"] * -(-group // rows)
    if num_splits is None:
        target = CTAS_PER_SM_TARGET * (num_sms or DEFAULT_NUM_SMS)
        max_tokens = width * bs
        want = -(-target // max(base_ctas, 1)) if base_ctas < target else 1
        num_splits = max(1, min(want, max_tokens // MIN_SPLIT_TOKENS))
        if num_splits > 1:
            tile_blocks = max(1, TILE // bs)
            bps = -(-width // num_splits)
            bps = -(-bps // tile_blocks) * tile_blocks
        else:
            bps = max(width, 1)
    else:
        if num_splits < 1:
            raise ValueError(f"num_splits must be >= 1, got {num_splits}")
        bps = max(1, -(-width // num_splits)) if num_splits > 1 else max(width, 1)
    bps = max(bps, -(-width // MAX_SPLITS))
    splits = max(1, -(-width // bps)) if width else 1
    if splits == 1:
        bps = max(width, 1)
    return AttentionPlan(dims["dtype"], dims["head_dim"], bs, rows, dims["num_tokens"], dims["num_seqs"],
                         dims["num_q_heads"], dims["num_kv_heads"], width, dims["is_extend"], splits, bps)


def attention_args(plan: AttentionPlan, *, out, lse, part_acc, part_ml, query, k_pool, v_pool, block_tables,
                   seq_lens, query_start_loc, scale: float, want_lse: bool) -> list:
    """The attention kernel's arguments, in order (arrays and numpy scalars)."""
    flags = (FLAG_EXTEND if plan.is_extend else 0) | (FLAG_LSE if want_lse else 0)
    return [out, lse, part_acc, part_ml, query, k_pool, v_pool, block_tables, seq_lens, query_start_loc,
            np.int32(plan.num_seqs), np.int32(plan.table_width), np.int32(plan.num_kv_heads),
            np.int32(plan.group), np.int32(plan.blocks_per_split), np.int32(flags),
            np.float32(float(scale) * LOG2E)]


def reduce_args(plan: AttentionPlan, *, out, lse, part_acc, part_ml, want_lse: bool) -> list:
    return [out, lse, part_acc, part_ml, np.int32(plan.num_splits), np.int32(FLAG_LSE if want_lse else 0)]


Launch = Callable[[str, tuple, tuple, list], None]
Alloc = Callable[[tuple, str], object]   # (shape, "query" | "float32") -> array


def run_plan(plan: AttentionPlan, launch: Launch, alloc: Alloc, *, query, k_pool, v_pool, block_tables, seq_lens,
             query_start_loc, scale: float, return_lse: bool, out=None, lse=None):
    """Allocate what is missing and launch the plan's kernels through ``launch`` (any backend)."""
    tokens, heads, d = plan.num_tokens, plan.num_q_heads, plan.head_dim
    if out is None:
        out = alloc((tokens, heads, d), "query")
    if return_lse and lse is None:
        lse = alloc((tokens, heads), "float32")
    lse_arg = lse if return_lse else out          # any valid pointer: never written without the flag
    if plan.num_splits > 1:
        part_acc = alloc((tokens, heads, plan.num_splits, d), "float32")
        part_ml = alloc((tokens, heads, plan.num_splits, 2), "float32")
    else:
        part_acc = part_ml = out                  # unused with one split
    qsl = query_start_loc if query_start_loc is not None else seq_lens   # unused without the flag
    if tokens:
        launch(plan.attention_kernel, plan.attention_grid, plan.block,
               attention_args(plan, out=out, lse=lse_arg, part_acc=part_acc, part_ml=part_ml, query=query,
                              k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, seq_lens=seq_lens,
                              query_start_loc=qsl, scale=scale, want_lse=return_lse))
        if plan.num_splits > 1:
            launch(plan.reduce_kernel, plan.reduce_grid, plan.block,
                   reduce_args(plan, out=out, lse=lse_arg, part_acc=part_acc, part_ml=part_ml,
                               want_lse=return_lse))
    return (out, lse) if return_lse else out


# -- CuPy backend -----------------------------------------------------------------------------------
_lock = threading.Lock()
_modules: dict = {}
_num_sms: dict = {}


def _source_text() -> str:
    try:
        from prefixkv.kernels import source_path
    except ImportError:  # running from a source checkout without the package mapping
        from kernels import source_path  # type: ignore
    return source_path(SOURCE).read_text()


def _include_options() -> list[tuple[str, ...]]:
    """Option sets to try: CuPy's own include paths first, then a CUDA toolkit's include folder."""
    tries: list[tuple[str, ...]] = [()]
    for env in ("CUDA_PATH", "CUDA_HOME"):
        root = os.environ.get(env)
        if root and os.path.isfile(os.path.join(root, "include", "cuda_fp16.h")):
            tries.append((f"-I{os.path.join(root, 'include')}",))
    if os.path.isfile("/usr/local/cuda/include/cuda_fp16.h"):
        tries.append(("-I/usr/local/cuda/include",))
    return tries


def _functions(plan: AttentionPlan, device_index: int):
    import cupy

    key = (device_index, plan.dtype, plan.head_dim, plan.block_size, plan.rows)
    with _lock:
        hit = _modules.get(key)
        if hit is None:
            names = [plan.attention_kernel, plan.reduce_kernel]
            code = _source_text()
            errors = []
            module = None
            for extra in _include_options():
                try:
                    module = cupy.RawModule(code=code, options=("-DPREFIXKV_NO_INSTANTIATIONS", *extra),
                                            name_expressions=names)
                    module.compile()
                    break
                except cupy.cuda.compiler.CompileException as exc:  # e.g. cuda_fp16.h not found
                    errors.append(str(exc))
                    module = None
            if module is None:
                raise RuntimeError("NVRTC could not compile kernels/paged_attention.cu:\n" + "\n---\n".join(errors))
            hit = {name: module.get_function(name) for name in names}
            _modules[key] = hit
        return hit


def _device_sms(device_index: int) -> int:
    n = _num_sms.get(device_index)
    if n is None:
        import cupy

        with cupy.cuda.Device(device_index):
            n = int(cupy.cuda.Device(device_index).attributes["MultiProcessorCount"])
        _num_sms[device_index] = n
    return n


def _as_cupy(x):
    import cupy
    import torch

    if isinstance(x, torch.Tensor):
        if x.dtype in (torch.float16, torch.bfloat16):
            x = x.view(torch.int16)          # same bytes; CuPy has no bfloat16
        return cupy.asarray(x)               # zero copy through __cuda_array_interface__
    return x


def launch_paged_attention(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc=None,
                           return_lse=False, *, out=None, lse=None, num_splits: int | None = None,
                           rows: int | None = None, poison: bool = False):
    """``paged_attention_cuda`` with knobs: preallocated ``out`` / ``lse``, forced ``num_splits`` or
    ``rows`` (heads per CTA), and ``poison`` (fill outputs and scratch with NaN first, for tests)."""
    import torch

    dims = check_inputs(query, k_pool, v_pool, block_tables, seq_lens, query_start_loc)
    tensors = [query, k_pool, v_pool, block_tables, seq_lens] + ([query_start_loc] if query_start_loc is not None else [])
    if not all(isinstance(t, torch.Tensor) and t.is_cuda for t in tensors):
        raise ValueError("paged_attention_cuda needs torch CUDA tensors")
    device = query.device
    if any(t.device != device for t in tensors):
        raise ValueError("all tensors must be on the query's device")
    if out is not None and (tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype
                            or not out.is_contiguous() or out.device != device):
        raise ValueError("out must be a contiguous tensor of the query's shape, dtype and device")
    if lse is not None and (tuple(lse.shape) != tuple(query.shape[:2]) or lse.dtype != torch.float32
                            or not lse.is_contiguous() or lse.device != device):
        raise ValueError("lse must be a contiguous float32 tensor [tokens, q_heads] on the query's device")
    index = device.index if device.index is not None else torch.cuda.current_device()
    plan = plan_attention(dims, num_sms=_device_sms(index), num_splits=num_splits, rows=rows)
    functions = _functions(plan, index)

    def alloc(shape, kind):
        dtype = query.dtype if kind == "query" else torch.float32
        if poison:
            return torch.full(shape, float("nan"), dtype=dtype, device=device)
        return torch.empty(shape, dtype=dtype, device=device)

    if poison:
        if out is not None:
            out.fill_(float("nan"))
        if lse is not None:
            lse.fill_(float("nan"))

    import cupy

    stream = torch.cuda.current_stream(device)

    def launch(name, grid, block, args):
        with cupy.cuda.Device(index), cupy.cuda.ExternalStream(stream.cuda_stream, index):
            functions[name](grid, block, tuple(_as_cupy(a) for a in args))

    return run_plan(plan, launch, alloc, query=query, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables,
                    seq_lens=seq_lens, query_start_loc=query_start_loc, scale=scale, return_lse=return_lse,
                    out=out, lse=lse)


def paged_attention_cuda(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc=None,
                         return_lse=False):
    """Paged attention on torch CUDA tensors with the CuPy raw kernels (see the module docstring)."""
    return launch_paged_attention(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc,
                                  return_lse)


__all__ = ["paged_attention_cuda", "launch_paged_attention", "supports", "check_inputs", "plan_attention",
           "run_plan", "attention_args", "reduce_args", "AttentionPlan", "all_kernel_names",
           "attention_kernel_name", "reduce_kernel_name", "default_rows"]
