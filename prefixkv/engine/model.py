"""A tiny Llama-style decoder with random weights, for tests and demos (torch).

RMSNorm, rotary position embeddings at per-token positions, grouped-query
attention, SwiGLU MLP. Weights come from a config and a seed: no hub, no
network, the same model in every process.

Attention is pluggable: ``forward(token_ids, positions, attention)`` calls
``attention(layer, q, k, v)`` in every layer, so one model runs

* paged (``PagedAttentionBackend``): K/V written through a slot mapping into a
  ``KVStore``, then ``prefixkv.kv.attention.paged_attention`` over the block
  tables: a flat packed row of many requests' prefill chunks and decodes;
* dense (``DenseCausalAttention``): one sequence, every token at once, no
  cache at all: the reference that engine outputs are compared with.
"""

from __future__ import annotations

import math
import numbers
import operator
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..kv.attention import paged_attention
from ..sizing import KVSpec
from ..kv.storage import torch_dtype


@dataclass(frozen=True, slots=True)
class TinyLlamaConfig:
    vocab_size: int = 256          # byte-level: the demo feeds UTF-8 bytes
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 16
    rope_theta: float = 10_000.0
    rms_norm_eps: float = 1e-5
    dtype: str = "float32"
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if name != "seed" and value <= 0:
                raise ValueError(f"{name} must be positive, got {value}")
        for name, low in (("rope_theta", "> 0"), ("rms_norm_eps", ">= 0")):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
            # rope_theta <= 0 or NaN, or a negative eps, gives NaN logits everywhere.
            if not (math.isfinite(value) and (value > 0 if low == "> 0" else value >= 0)):
                raise ValueError(f"{name} must be a finite number {low}, got {value}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads "
                             f"({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ValueError(f"rotary embeddings need an even head_dim, got {self.head_dim}")
        torch_dtype(self.dtype)

    def kv_spec(self) -> KVSpec:
        return KVSpec(layers=self.num_layers, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                      dtype=self.dtype)


class EngineModel(Protocol):
    """What ``Engine.from_model`` / ``ModelExecutor`` need of a model (``TinyLlama``,
    ``prefixkv.integrations.hf_engine.HFEngineModel``):

    * ``config.kv_spec()``: the ``KVSpec`` of its K/V (layers, KV heads, head dim, dtype);
    * ``device``: where its weights (and so the KV store) live;
    * ``forward(token_ids, positions, attention)`` (or ``__call__``): hidden states of a
      flat packed row, calling ``attention(layer, q, k, v)`` in every layer;
    * ``logits(hidden)``: ``[rows, vocab]`` logits.

    Optional: ``vocab_size`` (or ``config.vocab_size``), the number of token ids the model
    embeds. When known, the engine refuses prompts holding ids outside ``[0, vocab_size)``
    when they are added (``InvalidRequestTokens``) instead of failing a whole step
    (see ``model_vocab_size``).
    """

    config: object
    device: torch.device

    def __call__(self, token_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor: ...

    def logits(self, hidden: torch.Tensor) -> torch.Tensor: ...


def model_vocab_size(model) -> int | None:
    """The model's vocabulary size: ``model.vocab_size``, else ``model.config.vocab_size``,
    else None (unknown: token ids are then only checked against ``[0, 2**32)``)."""
    for owner in (model, getattr(model, "config", None)):
        value = getattr(owner, "vocab_size", None)
        if value is not None:
            value = _vocab_int(value)
            if value <= 0:
                raise ValueError(f"the model's vocab_size must be positive, got {value}")
            return value
    return None


def _vocab_int(value) -> int:
    """``value`` as an int: an integer (numpy, 0-d torch too) or a float holding one (32000.0);
    a fraction, nan, inf, a boolean or a string is refused, not truncated (int(256.7) was 256)."""
    if not isinstance(value, bool) and str(getattr(value, "dtype", "")) not in ("bool", "torch.bool"):
        try:
            return operator.index(value)
        except TypeError:
            pass
        if isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
            return int(value)
    raise ValueError(f"the model's vocab_size must be a positive integer, got {value!r}")


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q ``[T, Hq, d]``, k/v ``[T, Hkv, d]`` (rotary already applied) -> ``[T, Hq, d]``."""


class DenseCausalAttention:
    """One sequence, all of its tokens, causal; nothing cached."""

    def __call__(self, layer, q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             is_causal=True)
        return out.transpose(0, 1)


class PagedAttentionBackend:
    """Write each layer's new K/V through the slot mapping, then attend through the block
    tables (paged attention's extend path: ``query_start_loc`` splits the packed row)."""

    def __init__(self, kv_store, slot_mapping, block_tables, seq_lens, query_start_loc, impl: str = "torch"):
        self.kv_store = kv_store
        self.slot_mapping = slot_mapping
        self.block_tables = block_tables
        self.seq_lens = seq_lens
        self.query_start_loc = query_start_loc
        self.impl = impl

    def __call__(self, layer, q, k, v):
        self.kv_store.write(layer, self.slot_mapping, k, v)
        return paged_attention(q, self.kv_store, layer, self.block_tables, self.seq_lens,
                               query_start_loc=self.query_start_loc, impl=self.impl)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class Block(nn.Module):
    def __init__(self, cfg: TinyLlamaConfig, gen: torch.Generator) -> None:
        super().__init__()
        D, I, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim

        def weight(rows, cols):
            return nn.Parameter(torch.randn(rows, cols, generator=gen) / math.sqrt(cols))

        self.cfg = cfg
        self.attn_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.wq, self.wk, self.wv = weight(cfg.num_heads * d, D), weight(cfg.num_kv_heads * d, D), \
            weight(cfg.num_kv_heads * d, D)
        self.wo = weight(D, cfg.num_heads * d)
        self.mlp_norm = RMSNorm(D, cfg.rms_norm_eps)
        self.w_gate, self.w_up, self.w_down = weight(I, D), weight(I, D), weight(D, I)

    def forward(self, x, cos, sin, layer: int, attention: AttentionBackend):
        cfg = self.cfg
        T = x.shape[0]
        h = self.attn_norm(x)
        q = F.linear(h, self.wq).view(T, cfg.num_heads, cfg.head_dim)
        k = F.linear(h, self.wk).view(T, cfg.num_kv_heads, cfg.head_dim)
        v = F.linear(h, self.wv).view(T, cfg.num_kv_heads, cfg.head_dim)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        a = attention(layer, q.contiguous(), k.contiguous(), v.contiguous())
        x = x + F.linear(a.reshape(T, -1), self.wo)
        h = self.mlp_norm(x)
        return x + F.linear(F.silu(F.linear(h, self.w_gate)) * F.linear(h, self.w_up), self.w_down)


class TinyLlama(nn.Module):
    def __init__(self, config: TinyLlamaConfig | None = None) -> None:
        super().__init__()
        cfg = config or TinyLlamaConfig()
        self.config = cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        self.embed = nn.Parameter(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen))
        self.layers = nn.ModuleList(Block(cfg, gen) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Parameter(2 * torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)
                                    / math.sqrt(cfg.hidden_size))
        half = cfg.head_dim // 2
        # float64, outside the module's state: angles are exact whatever the weights' dtype.
        self.inv_freq = cfg.rope_theta ** (-torch.arange(half, dtype=torch.float64) / half)
        self.to(torch_dtype(cfg.dtype))
        self.requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.embed.device

    @property
    def vocab_size(self) -> int:
        """Token ids run from 0 to ``vocab_size - 1`` (``config.vocab_size``)."""
        return self.config.vocab_size

    def rotary(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``[T, 1, head_dim]`` at each token's own position."""
        angles = positions.to(torch.float64)[:, None] * self.inv_freq.to(positions.device)[None, :]
        angles = torch.cat((angles, angles), dim=-1)[:, None, :]
        dtype = self.embed.dtype
        return angles.cos().to(dtype), angles.sin().to(dtype)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention: AttentionBackend) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of a flat row of tokens at the given positions."""
        x = self.embed[token_ids]
        cos, sin = self.rotary(positions)
        for layer, block in enumerate(self.layers):
            x = block(x, cos, sin, layer, attention)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head).float()

    @torch.inference_mode()
    def dense_logits(self, token_ids) -> torch.Tensor:
        """Logits ``[T, vocab]`` of one whole sequence with plain causal attention (no cache)."""
        ids = torch.as_tensor(list(token_ids), dtype=torch.long, device=self.device)
        positions = torch.arange(ids.numel(), device=self.device)
        return self.logits(self.forward(ids, positions, DenseCausalAttention()))
