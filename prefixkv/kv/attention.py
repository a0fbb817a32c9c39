"""Paged attention: attention that reads K/V through block tables (torch extra).

Two modes, one function::

    paged_attention(query, kv_store, layer, block_tables, seq_lens, scale,
                    query_start_loc=None, return_lse=False, impl="auto", out=None)

* **Decode** (``query_start_loc is None``): ``query`` is ``[num_seqs, Hq, d]``, one
  query per sequence at position ``seq_lens[i] - 1`` (its K/V already written to
  the store); it attends to the sequence's whole history ``0 .. seq_lens[i]-1``.
* **Extend / prefill**: ``query`` is flat ``[total_new_tokens, Hq, d]``,
  ``query_start_loc`` (int, ``[num_seqs + 1]``, cumulative, starting at 0) says
  which rows belong to which sequence. ``seq_lens[i]`` is the sequence's total
  length *including* its ``q_len_i`` new tokens, which are its last ``q_len_i``
  positions (their K/V already written); the new tokens see the cached history
  and are causal among themselves. Pure prefill is ``q_len_i == seq_lens[i]``;
  a decode step can be mixed in as ``q_len_i == 1``.

``block_tables`` is ``[num_seqs, max_blocks]`` (int; the manager's
``block_tables()``), entries past a sequence's ``ceil(seq_len / block_size)``
blocks are padding and never read. ``seq_lens`` is ``[num_seqs]``. Grouped-query
attention: ``Hq`` must be a multiple of the pools' ``Hkv``; query head ``h``
reads KV head ``h // (Hq // Hkv)``. Returns ``out`` (query's dtype and shape) and,
with ``return_lse``, the natural-log log-sum-exp of the scaled scores, float32
``[num_tokens, Hq]`` (what is needed to merge partial attentions).

**Length 0.** A decode row whose sequence has ``seq_lens[i] == 0`` has no key to
attend to; its output is defined as zeros and its lse as ``-inf`` (the identity
of a log-sum-exp merge), rather than the NaN a 0/0 softmax would give.

**Masking.** Slots at or past ``seq_lens[i]`` (the empty tail of the last
block) and, in extend mode, positions after a query's own are masked *before*
anything reads them: scores go through ``torch.where`` to ``-inf`` and the value
tiles are zeroed with ``torch.where``, so NaN or inf garbage left in unused
slots never reaches a result (a multiply by zero probability would not do:
``0 * nan == nan``).

Implementations (``impl=``):

* ``"reference"``: ``paged_attention_reference``, the specification. Walks the
  logical blocks one by one, loads each physical block through the table, and
  merges an online softmax (running max ``m``, sum ``l``, output ``acc``) in
  float32 across blocks.
* ``"torch"``: ``paged_attention_torch``, the fast path for CPUs: gathers each
  sequence's K/V through its block table (``index_select``) and calls
  ``torch.nn.functional.scaled_dot_product_attention``; decode batches are padded
  to their longest sequence and masked. Runs on any torch device.
* ``"cuda"``: the CuPy raw kernels of ``prefixkv.kv.cuda_kernels``
  (``paged_attention_cuda(query, k_pool, v_pool, block_tables, seq_lens, scale,
  query_start_loc=None, return_lse=False)``), CUDA tensors only. A strided or misaligned
  query is copied first and a strided ``out`` written through a contiguous temporary.
* ``"auto"`` (default): ``"cuda"`` when the query is a CUDA tensor, ``cupy`` imports,
  the kernels cover the shape and can read the pools in place (contiguous, 16-byte
  aligned); ``"torch"`` otherwise. If
  ``prefixkv.kv.cuda_kernels`` cannot be imported, a warning is issued once and the
  torch path runs.

Value checks (lengths against the tables, block ids in range, query offsets)
read the metadata on the host; the torch and reference paths need it there
anyway. The CUDA path checks shapes and dtypes always and values only where the
metadata is given on the CPU (all of it: every check; block tables on the device
with lengths or query offsets from the host: those lengths and offsets), so a step
with device-resident metadata never synchronises.
"""

from __future__ import annotations

import math
import threading
import warnings
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_torch",
           "attention_wrong_per_block_average", "IMPLS", "clear_workspace"]

IMPLS = ("auto", "reference", "torch", "cuda")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_NEG_INF = float("-inf")
_TORCH_VERSION = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
_HAS_ENABLE_GQA = _TORCH_VERSION >= (2, 5)


# -- checking and normalising the inputs --------------------------------------
@dataclass(slots=True)
class _Batch:
    num_seqs: int
    num_tokens: int
    q_heads: int
    kv_heads: int
    group: int              # query heads per KV head
    head_dim: int
    block_size: int
    num_blocks: int         # physical blocks in the pool
    scale: float
    tables: torch.Tensor    # int64 [num_seqs, max_blocks] on the query's device
    seq_lens: list[int]
    starts: list[int] | None  # query_start_loc as a list (extend), None for decode


def _as_int_tensor(value, what: str, device: torch.device) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        tensor = value
    else:
        array = np.asarray(value)
        if array.size == 0:
            array = array.astype(np.int64)
        if not (np.issubdtype(array.dtype, np.integer)):
            raise ValueError(f"{what} must hold integers, got {array.dtype}")
        tensor = torch.as_tensor(array)
    if tensor.dtype.is_floating_point or tensor.dtype.is_complex or tensor.dtype == torch.bool:
        raise ValueError(f"{what} must hold integers, got {tensor.dtype}")
    return tensor.to(device)


def _check_shapes(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, out):
    """Shape, dtype and device checks (no look at values). Returns (num_seqs, group, scale)."""
    if not isinstance(query, torch.Tensor):
        raise TypeError(f"query must be a torch tensor, got {type(query).__name__}")
    if query.dim() != 3:
        raise ValueError(f"query must be [num_tokens, q_heads, head_dim], got shape {tuple(query.shape)}")
    if query.dtype not in _DTYPES:
        raise ValueError(f"query must be float32, float16 or bfloat16, got {query.dtype}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if not isinstance(pool, torch.Tensor) or pool.dim() != 4:
            shape = tuple(pool.shape) if isinstance(pool, torch.Tensor) else type(pool).__name__
            raise ValueError(f"{name} must be [num_blocks, block_size, kv_heads, head_dim], got {shape}")
        if pool.dtype != query.dtype:
            raise ValueError(f"{name} is {pool.dtype} but query is {query.dtype}; they must match")
        if pool.device != query.device:
            raise ValueError(f"{name} is on {pool.device} but query is on {query.device}")
    if k_pool.shape != v_pool.shape:
        raise ValueError(f"k_pool {tuple(k_pool.shape)} and v_pool {tuple(v_pool.shape)} differ in shape")
    num_tokens, q_heads, head_dim = query.shape
    _, block_size, kv_heads, pool_dim = k_pool.shape
    if head_dim != pool_dim:
        raise ValueError(f"query head_dim {head_dim} != pool head_dim {pool_dim}")
    if head_dim == 0 or block_size == 0 or kv_heads == 0:
        raise ValueError(f"empty dimension in pools {tuple(k_pool.shape)}")
    if q_heads % kv_heads:
        raise ValueError(f"grouped-query attention needs query heads ({q_heads}) to be a multiple of "
                         f"KV heads ({kv_heads})")
    if block_tables.dim() != 2:
        raise ValueError(f"block_tables must be [num_seqs, max_blocks], got shape {tuple(block_tables.shape)}")
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens must be [num_seqs], got shape {tuple(seq_lens.shape)}")
    num_seqs = seq_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows for {num_seqs} sequences")
    if query_start_loc is None:
        if num_tokens != num_seqs:
            raise ValueError(f"decode takes one query per sequence: query has {num_tokens} rows for "
                             f"{num_seqs} sequences (pass query_start_loc for extend/prefill)")
    elif query_start_loc.dim() != 1 or query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError(f"query_start_loc must be [num_seqs + 1] = [{num_seqs + 1}], "
                         f"got shape {tuple(query_start_loc.shape)}")
    if out is not None:
        if not isinstance(out, torch.Tensor) or out.shape != query.shape or out.dtype != query.dtype \
                or out.device != query.device:
            raise ValueError("out must be a tensor of the query's shape, dtype and device")
    if scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    return num_seqs, q_heads // kv_heads, scale


def _check_lengths(width: int, seq_lens: list[int] | None, starts: list[int] | None, num_tokens: int,
                   block_size: int) -> None:
    """Lengths against the table width, query offsets against the rows and lengths (either may be None)."""
    for i, n in enumerate(seq_lens or ()):
        if n < 0:
            raise ValueError(f"seq_lens[{i}] = {n} is negative")
        if n > width * block_size:
            raise ValueError(f"seq_lens[{i}] = {n} needs {-(-n // block_size)} blocks but block_tables has "
                             f"{width} columns (block size {block_size})")
    if starts is not None:
        if starts[0] != 0 or starts[-1] != num_tokens:
            raise ValueError(f"query_start_loc must run from 0 to the {num_tokens} query rows, "
                             f"got {starts[0]} .. {starts[-1]}")
        for i in range(len(starts) - 1):
            q_len = starts[i + 1] - starts[i]
            if q_len < 0:
                raise ValueError(f"query_start_loc decreases at sequence {i}")
            if seq_lens is not None and q_len > seq_lens[i]:
                raise ValueError(f"sequence {i} has {q_len} new queries but seq_lens[{i}] = {seq_lens[i]} "
                                 "(seq_lens counts the new tokens too)")


def _check_values(tables: torch.Tensor, seq_lens: list[int], starts: list[int] | None, num_tokens: int,
                  block_size: int, num_blocks: int) -> None:
    width = tables.shape[1]
    _check_lengths(width, seq_lens, starts, num_tokens, block_size)
    if tables.numel():
        needed = torch.tensor([-(-n // block_size) for n in seq_lens], dtype=torch.int64)
        cpu = tables.cpu()
        used = torch.arange(width)[None, :] < needed[:, None]
        bad = used & ((cpu < 0) | (cpu >= num_blocks))
        if bool(bad.any()):
            i, b = (int(x) for x in bad.nonzero()[0])
            raise ValueError(f"block_tables[{i}, {b}] = {int(cpu[i, b])} is not a block of the pool "
                             f"(0 .. {num_blocks - 1})")


def _prepare(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, out) -> _Batch:
    device = query.device if isinstance(query, torch.Tensor) else torch.device("cpu")
    block_tables = _as_int_tensor(block_tables, "block_tables", device)
    seq_lens_t = _as_int_tensor(seq_lens, "seq_lens", device)
    starts_t = None if query_start_loc is None else _as_int_tensor(query_start_loc, "query_start_loc", device)
    num_seqs, group, scale = _check_shapes(query, k_pool, v_pool, block_tables, seq_lens_t, scale, starts_t, out)
    lens = [int(n) for n in seq_lens_t.tolist()]
    starts = None if starts_t is None else [int(s) for s in starts_t.tolist()]
    _check_values(block_tables, lens, starts, query.shape[0], k_pool.shape[1], k_pool.shape[0])
    return _Batch(num_seqs=num_seqs, num_tokens=query.shape[0], q_heads=query.shape[1],
                  kv_heads=k_pool.shape[2], group=group, head_dim=query.shape[2], block_size=k_pool.shape[1],
                  num_blocks=k_pool.shape[0], scale=scale, tables=block_tables.to(torch.int64),
                  seq_lens=lens, starts=starts)


def _token_layout(batch: _Batch, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query row: its sequence, its position, and its sequence's length (int64)."""
    lens = torch.tensor(batch.seq_lens, dtype=torch.int64, device=device)
    if batch.starts is None:
        seq = torch.arange(batch.num_seqs, device=device)
        return seq, lens - 1, lens
    starts = torch.tensor(batch.starts, dtype=torch.int64, device=device)
    q_lens = starts[1:] - starts[:-1]
    seq = torch.repeat_interleave(torch.arange(batch.num_seqs, device=device), q_lens)
    # row r of sequence s sits at position seq_len[s] - q_len[s] + (r - start[s])
    rows = torch.arange(batch.num_tokens, device=device)
    position = lens[seq] - q_lens[seq] + rows - starts[:-1][seq]
    return seq, position, lens[seq]


# -- the specification ---------------------------------------------------------
def _block_walk(query, k_pool, v_pool, batch: _Batch):
    """Yield, per logical block b: (valid [T, B], k tile, v tile), float32, tiles already masked.

    ``valid[t, j]``: slot j of the block is a key query row t may attend to
    (below its sequence's length, and not after the query's own position).
    Table entries of blocks a sequence does not use are padding and are
    replaced by block 0 before indexing; their slots are all invalid.
    """
    device = query.device
    seq, position, length = _token_layout(batch, device)
    B = batch.block_size
    slot = torch.arange(B, device=device)
    max_blocks = max((-(-n // B) for n in batch.seq_lens), default=0)
    for b in range(max_blocks):
        logical = b * B + slot                                                   # [B]
        valid = (logical[None, :] < length[:, None]) & (logical[None, :] <= position[:, None])
        in_use = b * B < length                                                  # [T]
        physical = torch.where(in_use, batch.tables[seq, b], 0)
        keep = valid[:, :, None, None]
        k_tile = torch.where(keep, k_pool[physical].float(), 0.0)                # [T, B, Hkv, d]
        v_tile = torch.where(keep, v_pool[physical].float(), 0.0)
        yield valid, k_tile, v_tile


def _scores(q: torch.Tensor, k_tile: torch.Tensor, valid: torch.Tensor, scale: float) -> torch.Tensor:
    """Masked scaled scores [T, Hkv, G, B]: -inf wherever ``valid`` is False, whatever the tile held."""
    s = torch.einsum("thgd,tbhd->thgb", q, k_tile) * scale
    return torch.where(valid[:, None, None, :], s, _NEG_INF)


def paged_attention_reference(query, k_pool, v_pool, block_tables, seq_lens, scale=None, query_start_loc=None,
                              return_lse=False, *, out=None):
    """The specification: block by block through the table, online softmax merged in float32.

    For each logical block b: physical = block_table[b]; load the K/V tile;
    scores = q·Kᵀ·scale, masked to -inf past the sequence length (and after
    the query's position); then with the running max m, sum l and output acc:

        m' = max(m, max_j s_j);  α = exp(m - m');  p_j = exp(s_j - m')
        l  = α·l + Σ_j p_j;      acc = α·acc + Σ_j p_j·v_j;  m = m'

    and finally out = acc / l, lse = m + log l (zeros / -inf where l = 0).
    """
    batch = _prepare(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, out)
    T, H, G, d = batch.num_tokens, batch.kv_heads, batch.group, batch.head_dim
    q = query.float().reshape(T, H, G, d)
    m = torch.full((T, H, G), _NEG_INF, device=query.device)
    l = torch.zeros((T, H, G), device=query.device)
    acc = torch.zeros((T, H, G, d), device=query.device)
    for valid, k_tile, v_tile in _block_walk(query, k_pool, v_pool, batch):
        s = _scores(q, k_tile, valid, batch.scale)
        m_new = torch.maximum(m, s.amax(dim=-1))
        # Rows with no valid key yet keep m = -inf; subtract 0 there so exp() sees -inf, not nan.
        m_ref = torch.where(m_new == _NEG_INF, 0.0, m_new)
        alpha = torch.exp(m - m_ref)
        p = torch.exp(s - m_ref[..., None])
        l = l * alpha + p.sum(dim=-1)
        acc = acc * alpha[..., None] + torch.einsum("thgb,tbhd->thgd", p, v_tile)
        m = m_new
    seen = l > 0
    result = torch.where(seen[..., None], acc / torch.where(seen, l, 1.0)[..., None], 0.0)
    result = result.reshape(T, batch.q_heads, d).to(query.dtype)
    if out is None:
        out = result
    else:
        out.copy_(result)
    if not return_lse:
        return out
    lse = torch.where(seen, m + torch.log(torch.where(seen, l, 1.0)), _NEG_INF)
    return out, lse.reshape(T, batch.q_heads)


def attention_wrong_per_block_average(query, k_pool, v_pool, block_tables, seq_lens, scale=None,
                                      query_start_loc=None):
    """The wrong way, kept to be shown failing: a softmax inside each block, then the plain
    average of the per-block outputs. Each block's weights are normalised by that
    block's own sum, so a block with one weak key weighs as much as a block of strong
    ones; only a single-block history comes out right."""
    batch = _prepare(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, None)
    T, H, G, d = batch.num_tokens, batch.kv_heads, batch.group, batch.head_dim
    q = query.float().reshape(T, H, G, d)
    total = torch.zeros((T, H, G, d), device=query.device)
    count = torch.zeros((T, 1, 1, 1), device=query.device)
    for valid, k_tile, v_tile in _block_walk(query, k_pool, v_pool, batch):
        s = _scores(q, k_tile, valid, batch.scale)
        has_key = valid.any(dim=1)
        p = torch.softmax(torch.where(has_key[:, None, None, None], s, 0.0), dim=-1)
        p = torch.where(valid[:, None, None, :], p, 0.0)
        total += torch.einsum("thgb,tbhd->thgd", p, v_tile)
        count += has_key.float()[:, None, None, None]
    return (total / count.clamp_min(1)).reshape(T, batch.q_heads, d).to(query.dtype)


# -- the fast torch path -------------------------------------------------------
_workspace = threading.local()


def clear_workspace() -> None:
    """Free this thread's gather buffers (kept between calls on the CPU; see ``_gather``)."""
    _workspace.__dict__.clear()


def _gather(pool: torch.Tensor, blocks: torch.Tensor, name: str) -> torch.Tensor:
    """``pool[blocks]`` as ``[len(blocks), B, H, d]``.

    On the CPU into a per-thread buffer reused across calls: a fresh
    multi-MiB allocation is returned to the OS on free and page-faults on
    every call, which costs more than the attention itself. The buffer lives
    until the next call of this thread (the results never alias it).

    The buffer is always a normal (non-inference) tensor, allocated under
    ``torch.inference_mode(False)``: an inference tensor cannot be written in
    place outside inference mode, so a buffer made during a call inside
    ``torch.inference_mode()`` would break every later call made outside it.
    Writing into a normal tensor inside inference mode is allowed, so one
    buffer serves both modes.
    """
    shape = (blocks.numel(),) + tuple(pool.shape[1:])
    if pool.device.type != "cpu":
        return pool.index_select(0, blocks)
    numel = math.prod(shape)
    key = (name, pool.dtype)
    buffer = _workspace.__dict__.get(key)
    if buffer is None or buffer.numel() < numel:
        with torch.inference_mode(False):
            buffer = torch.empty(numel, dtype=pool.dtype)
        _workspace.__dict__[key] = buffer
    return torch.index_select(pool, 0, blocks, out=buffer[:numel].view(shape))


def _used_tables(batch: _Batch, rows: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """Block table rows cut to ``num_blocks`` columns, padding entries replaced by block 0."""
    lens = torch.tensor([batch.seq_lens[i] for i in rows.tolist()], dtype=torch.int64,
                        device=batch.tables.device)
    needed = -(-lens // batch.block_size)
    column = torch.arange(num_blocks, device=batch.tables.device)
    return torch.where(column[None, :] < needed[:, None], batch.tables[rows, :num_blocks], 0)


# Decode batches are gathered and attended a few sequences at a time on the CPU, so the
# gathered copy is still in cache when SDPA reads it (one big gather streams every byte
# through DRAM three times: read, write, read again). At least enough sequences per chunk
# to give every thread a (sequence, KV head) pair.
_CPU_CHUNK_BYTES = 8 << 20


def _decode_chunk(query, k_pool, v_pool, batch: _Batch, rows: list[int], want_lse: bool):
    """SDPA over the sequences ``rows`` (all with length > 0), padded to their longest."""
    device = query.device
    H, G, d, B = batch.kv_heads, batch.group, batch.head_dim, batch.block_size
    index = torch.tensor(rows, dtype=torch.int64, device=device)
    lens = [batch.seq_lens[i] for i in rows]
    n, L = len(rows), max(lens)
    num_blocks = -(-L // B)
    blocks = _used_tables(batch, index, num_blocks).reshape(-1)
    k = _gather(k_pool, blocks, "k").view(n, num_blocks * B, H, d)[:, :L]
    v = _gather(v_pool, blocks, "v").view(n, num_blocks * B, H, d)[:, :L]
    mask = None
    if min(lens) < L:
        # Padding (tails of shorter sequences, block 0 for their unused blocks): zero it
        # in the gathered copy before SDPA reads it, and mask it.
        valid = torch.arange(L, device=device)[None, :] < torch.tensor(lens, device=device)[:, None]
        k.masked_fill_(~valid[:, :, None, None], 0)
        v.masked_fill_(~valid[:, :, None, None], 0)
        mask = valid[:, None, None, :]
    # GQA without repeating K/V: the G query heads of a KV head are G query rows.
    q = query.index_select(0, index).view(n, H, G, d)
    k_t, v_t = k.transpose(1, 2), v.transpose(1, 2)          # [n, H, L, d] views
    o = F.scaled_dot_product_attention(q, k_t, v_t, attn_mask=mask, scale=batch.scale)
    lse = None
    if want_lse:
        s = torch.matmul(q.float(), k_t.float().transpose(-1, -2)) * batch.scale   # [n, H, G, L]
        if mask is not None:
            s = torch.where(mask, s, _NEG_INF)
        lse = torch.logsumexp(s, dim=-1).reshape(n, H * G)
    return index, o.reshape(n, H * G, d), lse


def _decode_torch(query, k_pool, v_pool, batch: _Batch, out, lse) -> None:
    device = query.device
    active = [i for i, n in enumerate(batch.seq_lens) if n > 0]
    if len(active) < batch.num_seqs:
        empty = torch.tensor([i for i, n in enumerate(batch.seq_lens) if n == 0], device=device)
        out[empty] = 0
        if lse is not None:
            lse[empty] = _NEG_INF
    if not active:
        return
    chunk = len(active)
    if device.type == "cpu":
        per_seq = 2 * max(batch.seq_lens) * batch.kv_heads * batch.head_dim * k_pool.element_size()
        chunk = max(1, _CPU_CHUNK_BYTES // per_seq, -(-torch.get_num_threads() // batch.kv_heads))
    for first in range(0, len(active), chunk):
        index, o, value = _decode_chunk(query, k_pool, v_pool, batch, active[first:first + chunk], lse is not None)
        out.index_copy_(0, index, o)
        if lse is not None:
            lse.index_copy_(0, index, value)


def _extend_torch(query, k_pool, v_pool, batch: _Batch, out, lse) -> None:
    device = query.device
    H, G, d, B = batch.kv_heads, batch.group, batch.head_dim, batch.block_size
    Hq = batch.q_heads
    for i in range(batch.num_seqs):
        start, stop = batch.starts[i], batch.starts[i + 1]
        n, L = stop - start, batch.seq_lens[i]
        if n == 0:
            continue
        num_blocks = -(-L // B)
        blocks = batch.tables[i, :num_blocks]
        # Cut to L: slots past the length are never handed to SDPA.
        k = _gather(k_pool, blocks, "k").view(num_blocks * B, H, d)[:L].transpose(0, 1)[None]   # [1, H, L, d]
        v = _gather(v_pool, blocks, "v").view(num_blocks * B, H, d)[:L].transpose(0, 1)[None]
        q = query[start:stop].transpose(0, 1)[None]                                          # [1, Hq, n, d]
        # Query t sits at position L - n + t and sees keys 0 .. L - n + t.
        if n == 1:
            mask, causal = None, False
        elif n == L:
            mask, causal = None, True     # square: SDPA's causal mask is the right one
        else:
            position = torch.arange(L - n, L, device=device)
            mask, causal = torch.arange(L, device=device)[None, :] <= position[:, None], False
        if _HAS_ENABLE_GQA:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=batch.scale,
                                               enable_gqa=G > 1)
        else:
            k_r, v_r = (k, v) if G == 1 else (k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1))
            o = F.scaled_dot_product_attention(q, k_r, v_r, attn_mask=mask, is_causal=causal, scale=batch.scale)
        out[start:stop] = o[0].transpose(0, 1)
        if lse is not None:
            _extend_lse(q[0], k[0], batch, L, lse[start:stop])


# Scores held at once for an extend's lse: rows are taken in chunks so a long prefill never builds
# its whole [Hq, n, L] float32 score matrix (a 32k-token prefill would need ~128 GB).
_LSE_CHUNK_BYTES = 64 << 20


def _extend_lse(q, k, batch: _Batch, L: int, lse) -> None:
    """``lse[t]`` for the rows of one extend: q [Hq, n, d] at positions L - n .. L - 1, k [H, L, d]."""
    H, G, d = batch.kv_heads, batch.group, batch.head_dim
    n = q.shape[1]
    device = q.device
    keys = k.float()[:, None].transpose(-1, -2)                                       # [H, 1, d, L]
    rows = max(1, _LSE_CHUNK_BYTES // (4 * batch.q_heads * max(L, 1)))
    for first in range(0, n, rows):
        last = min(n, first + rows)
        qg = q[:, first:last].float().reshape(H, G, last - first, d)
        s = torch.matmul(qg, keys) * batch.scale                                      # [H, G, rows, L]
        if n > 1:
            position = torch.arange(L - n + first, L - n + last, device=device)
            s = torch.where(torch.arange(L, device=device)[None, :] <= position[:, None], s, _NEG_INF)
        lse[first:last] = torch.logsumexp(s, dim=-1).reshape(batch.q_heads, last - first).transpose(0, 1)


def paged_attention_torch(query, k_pool, v_pool, block_tables, seq_lens, scale=None, query_start_loc=None,
                          return_lse=False, *, out=None):
    """The fast path: gather through the block tables, then ``scaled_dot_product_attention``.

    Decode: batched SDPA calls over the sequences padded to the longest of
    each batch (padding zeroed and masked); one batch on GPUs, on the CPU
    batches of about ``_CPU_CHUNK_BYTES`` of gathered K+V so the copy is still
    in cache when SDPA reads it. Extend: one SDPA call per sequence with a
    bottom-right causal mask. The lse, when asked, is computed separately in
    float32 from the same gathered keys.
    """
    batch = _prepare(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, out)
    if out is None:
        out = torch.empty_like(query)
    lse = torch.empty((batch.num_tokens, batch.q_heads), dtype=torch.float32, device=query.device) \
        if return_lse else None
    if batch.starts is None:
        _decode_torch(query, k_pool, v_pool, batch, out, lse)
    else:
        _extend_torch(query, k_pool, v_pool, batch, out, lse)
    return (out, lse) if return_lse else out


# -- dispatch --------------------------------------------------------------------
_warned_no_kernels = False


def _cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:  # ImportError, or a CUDA runtime cupy cannot load
        return False
    return True


def _load_cuda_kernels(*, warn: bool):
    """``prefixkv.kv.cuda_kernels.paged_attention_cuda`` or None (with a one-time warning when ``warn``)."""
    global _warned_no_kernels
    try:
        from prefixkv.kv.cuda_kernels import paged_attention_cuda
    except ImportError as exc:
        if not warn:
            raise
        if not _warned_no_kernels:
            _warned_no_kernels = True
            warnings.warn(f"prefixkv.kv.cuda_kernels is not available ({exc}); paged attention on CUDA tensors "
                          "falls back to the torch path", RuntimeWarning, stacklevel=3)
        return None
    return paged_attention_cuda


def _kernel_covers(query, k_pool, v_pool) -> bool:
    """The shapes the issue promises the CUDA kernels (others go to the torch path under "auto").

    The kernels also read the pools in place with 16-byte vector loads, so pools that are strided
    views (K and V interleaved in one allocation) or not 16-byte aligned go to the torch path too;
    copying a whole pool per call is not an option. The query and ``out`` can be copied: see
    ``_run_cuda``."""
    try:
        from prefixkv.kv import cuda_kernels
    except ImportError:
        return False
    if not all(p.is_contiguous() and p.data_ptr() % 16 == 0 for p in (k_pool, v_pool)):
        return False
    supports = getattr(cuda_kernels, "supports", None)
    if supports is not None:
        return bool(supports(query, k_pool))
    return (query.dtype in (torch.float16, torch.bfloat16) and k_pool.shape[1] in (8, 16, 32)
            and k_pool.shape[3] in (64, 128))


def _pools(kv_store, layer):
    if isinstance(kv_store, (tuple, list)):
        if len(kv_store) != 2:
            raise ValueError("kv_store must be a KVStore or a (k_pool, v_pool) pair")
        if layer not in (None, 0):
            raise ValueError("layer must be None (or 0) when kv_store is a (k_pool, v_pool) pair")
        return kv_store[0], kv_store[1]
    k, v = getattr(kv_store, "k", None), getattr(kv_store, "v", None)
    if k is None or v is None:
        raise TypeError(f"kv_store must be a KVStore or a (k_pool, v_pool) pair, got {type(kv_store).__name__}")
    if layer is None:
        raise ValueError("layer is required with a KVStore")
    if not -len(k) <= layer < len(k):
        raise IndexError(f"layer {layer} out of range for {len(k)} layer(s)")
    return k[layer], v[layer]


def paged_attention(query, kv_store, layer, block_tables, seq_lens, scale=None, *, query_start_loc=None,
                    return_lse=False, impl="auto", out=None):
    """Attention of ``query`` over the paged KV of ``kv_store`` (a ``KVStore``, or a
    ``(k_pool, v_pool)`` pair with ``layer=None``), layer ``layer``. See the module
    docstring for the decode / extend conventions, masking and length 0.

    ``scale`` defaults to ``1/sqrt(head_dim)``. ``out``: an optional tensor of the
    query's shape and dtype to write into. Returns ``out`` or ``(out, lse)``.
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {', '.join(IMPLS)}, got {impl!r}")
    k_pool, v_pool = _pools(kv_store, layer)
    if impl == "auto":
        impl = "torch"
        if isinstance(query, torch.Tensor) and query.is_cuda and _cupy_available() \
                and _load_cuda_kernels(warn=True) is not None and _kernel_covers(query, k_pool, v_pool):
            impl = "cuda"
    if impl == "reference":
        return paged_attention_reference(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc,
                                         return_lse, out=out)
    if impl == "torch":
        return paged_attention_torch(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc,
                                     return_lse, out=out)
    return _run_cuda(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, return_lse, out)


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_cuda


def _run_cuda(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, return_lse, out):
    if not isinstance(query, torch.Tensor) or not query.is_cuda:
        raise ValueError("impl='cuda' needs CUDA tensors (the query is not on a CUDA device)")
    if not _cupy_available():
        raise RuntimeError("impl='cuda' needs cupy (pip install 'prefixkv[cuda]')")
    kernel = _load_cuda_kernels(warn=False)
    if not (k_pool.is_contiguous() and v_pool.is_contiguous()):
        raise ValueError("impl='cuda' needs contiguous K and V pools (KVStore's are)")
    device = query.device
    metadata_on_host = [not _on_device(x) for x in (block_tables, seq_lens, query_start_loc) if x is not None]
    if all(metadata_on_host):
        # Cheap here (no device sync): full checks, then one copy of the metadata to the device.
        _prepare(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, out)
    tables = _as_int_tensor(block_tables, "block_tables", device).to(torch.int32).contiguous()
    lens = _as_int_tensor(seq_lens, "seq_lens", device).to(torch.int32).contiguous()
    starts = None if query_start_loc is None else \
        _as_int_tensor(query_start_loc, "query_start_loc", device).to(torch.int32).contiguous()
    _, _, scale = _check_shapes(query, k_pool, v_pool, tables, lens, scale, starts, out)
    if not all(metadata_on_host) and any(metadata_on_host):
        # Part of the metadata is on the device (say the block tables) and part on the host: check
        # the host part, which needs no synchronisation. The kernels trust lengths and offsets; a
        # wrong one reads past a table row (another sequence's blocks, or out of bounds).
        def host_list(value, what):
            if value is None or _on_device(value):
                return None
            return [int(x) for x in _as_int_tensor(value, what, torch.device("cpu")).tolist()]

        _check_lengths(tables.shape[1], host_list(seq_lens, "seq_lens"), host_list(query_start_loc, "query_start_loc"),
                       query.shape[0], k_pool.shape[1])
    # The kernels read the query with 16-byte vector loads and write ``out`` densely: a query sliced
    # out of a fused projection (strided, or at an odd offset) is copied, and a strided ``out`` is
    # written through a contiguous temporary, rather than refused.
    if not query.is_contiguous() or query.data_ptr() % 16:
        query = query.clone(memory_format=torch.contiguous_format)
    if out is None:
        return kernel(query, k_pool, v_pool, tables, lens, scale, query_start_loc=starts, return_lse=return_lse)
    from prefixkv.kv.cuda_kernels import launch_paged_attention  # writes straight into ``out``

    if out.is_contiguous():
        return launch_paged_attention(query, k_pool, v_pool, tables, lens, scale, starts, return_lse, out=out)
    result = launch_paged_attention(query, k_pool, v_pool, tables, lens, scale, starts, return_lse)
    out.copy_(result[0] if return_lse else result)
    return (out, result[1]) if return_lse else out
