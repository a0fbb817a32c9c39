"""The registered paged attention for transformers: ``attn_implementation="prefixkv_paged"``.

``register()`` (run when ``prefixkv.integrations.hf`` is imported) adds two
entries under the name ``PAGED_ATTENTION``:

* ``AttentionInterface``: ``paged_attention_forward``. A ``PrefixKVCache`` in
  ``mode="paged"`` puts a ``PagedCall`` (this forward's block tables, lengths,
  query layout, and the layer) into the ``kwargs`` dict the model passes to
  ``cache.update``; transformers hands the same dict to the attention function,
  which then calls ``prefixkv.kv.attention.paged_attention`` on the pool: no
  contiguous K/V is assembled by the cache. Without a ``PagedCall`` (any other
  cache, or no cache) it is plain SDPA over the key/value it was given, so a
  model switched to ``prefixkv_paged`` still works with ``DynamicCache``.
* ``AttentionMaskInterface``: transformers' ``sdpa_mask``. Without a mask
  function registered under the same name, ``create_causal_mask`` returns
  ``None`` for an unknown implementation, and SDPA with ``mask=None`` and a
  query shorter than the keys takes ``is_causal=True`` and cuts the keys to the
  query's length: a cached prefix silently dropped. With it, the mask is built
  from the cache's ``get_mask_sizes`` (``None`` only where that is exactly
  causal), and the paged path checks that the mask covers the whole cached
  history.

A ``sliding_window`` attention argument is accepted while no sequence is longer
than the window (it then masks nothing); ``PrefixKVCache`` refuses a sequence
that would outgrow it before the forward runs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from prefixkv.kv.attention import paged_attention

__all__ = ["PAGED_ATTENTION", "PAGED_KWARG", "PagedStep", "PagedCall", "paged_attention_forward", "register",
           "kv_heads_of", "alibi_of", "attention_backend_problem", "check_text_only"]

PAGED_ATTENTION = "prefixkv_paged"
PAGED_KWARG = "prefixkv_paged_call"

# Attention features the paged kernels do not implement: refused rather than ignored.
_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")


# -- model facts shared by the cache (hf.py) and the engine (hf_engine.py) -------------------
def kv_heads_of(config) -> int:
    """The number of K/V heads a model's attention hands to the cache (what the KV pool must hold).

    Usually ``num_key_value_heads`` (or ``num_attention_heads``). Falcon derives it from its own
    fields (transformers 5.24, ``FalconAttention.forward``): with ``new_decoder_architecture`` the
    grouped K/V are broadcast to every query head before ``cache.update`` (so ``num_attention_heads``),
    else ``multi_query`` means 1 head and otherwise ``num_attention_heads`` (``num_kv_heads`` is only
    read by the new architecture's fused QKV split).
    """
    heads = int(config.num_attention_heads)
    if getattr(config, "model_type", None) == "falcon":
        if getattr(config, "new_decoder_architecture", False):
            return heads
        return 1 if getattr(config, "multi_query", False) else int(getattr(config, "num_kv_heads", None) or heads)
    return int(getattr(config, "num_key_value_heads", None) or heads)


_MEDIA_FIELDS = ("vision_config", "audio_config", "image_token_id", "image_token_index", "video_token_id",
                 "audio_token_id")


def check_text_only(config) -> None:
    """Refuse multimodal models: prefix hits (cache and engine alike) are matched on token ids."""
    media = [f for f in _MEDIA_FIELDS if getattr(config, f, None) is not None]
    if media:
        raise ValueError(f"multimodal models are not supported ({', '.join(media)} in the config): prefix hits "
                         "are matched on token ids, so two prompts with equal image/audio placeholder tokens "
                         "would share KV computed from different media")


def alibi_of(config) -> bool:
    """True for ALiBi models (Bloom, MPT, Falcon with ``alibi=True``, ...)."""
    if getattr(config, "model_type", None) in ("bloom", "mpt"):
        return True
    if getattr(config, "alibi", False) is True:
        return True
    attn_config = getattr(config, "attn_config", None)
    if getattr(attn_config, "alibi", False) is True or (isinstance(attn_config, dict) and attn_config.get("alibi")):
        return True
    return getattr(config, "position_embedding_type", None) == "alibi"


ALIBI_REASON = ("ALiBi adds a per-head bias that the model computes from the attention mask's key positions; "
                "prefixkv's paged kernels have no ALiBi bias, and these models take no position_ids, which is "
                "how the cache checks that each forward's tokens sit at the positions it holds")


def attention_backend_problem(model) -> str | None:
    """Why ``model``'s attention cannot be replaced by a registered attention function (or ``None``).

    Models with ``_supports_attention_backend = False`` (Falcon, Bloom, ...) compute attention
    inline and never call ``ALL_ATTENTION_FUNCTIONS[config._attn_implementation]``.
    """
    if getattr(type(model), "_supports_attention_backend", True) is False:
        return (f"{type(model).__name__} computes attention inside its own modules and never calls the "
                f"registered attention function (transformers marks it _supports_attention_backend=False)")
    return None


@dataclass(slots=True)
class PagedStep:
    """One forward's paged-attention metadata, shared by every layer."""

    store: object                      # prefixkv.kv.storage.KVStore
    block_tables: torch.Tensor         # [num_seqs, width] int32, on the pool's device
    seq_lens: torch.Tensor             # [num_seqs] int32: history length including this forward's tokens
    query_start_loc: torch.Tensor | None   # [num_seqs + 1] int32 (extend); None: decode, one query per row
    query_index: torch.Tensor | None   # rows of the flattened [batch * q_len] query that are real tokens;
    #                                    None: all of them (no padding column in this forward)
    batch: int
    q_len: int
    kv_columns: int                    # columns of the padded history (what the model's mask spans)
    impl: str = "auto"
    max_seq_len: int = 0               # longest history (checked against a sliding window)
    consumed: int = 0                  # layers whose attention ran through the pool this forward


@dataclass(slots=True)
class PagedCall:
    step: PagedStep
    layer: int


def paged_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                            attention_mask: torch.Tensor | None, scaling: float | None = None,
                            dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature; returns ``(attn_output [B, q, Hq, d], None)``."""
    call = kwargs.pop(PAGED_KWARG, None)
    if call is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    step = call.step
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{PAGED_ATTENTION} does not support the attention argument {name!r}")
    window = kwargs.get("sliding_window")
    if window is not None and step.max_seq_len > int(window):
        raise NotImplementedError(f"{PAGED_ATTENTION}: a sequence of {step.max_seq_len} tokens outgrows the sliding "
                                  f"window ({window}); sliding-window paged attention is not implemented")
    if dropout and module.training:
        raise ValueError(f"{PAGED_ATTENTION} is for inference; attention dropout is not supported")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{PAGED_ATTENTION} cannot return attention weights; use mode='gather' with 'eager'")
    batch, q_heads, q_len, head_dim = query.shape
    if batch != step.batch or q_len != step.q_len:
        raise RuntimeError(f"{PAGED_ATTENTION}: query is [{batch}, {q_len}] but the cache prepared "
                           f"[{step.batch}, {step.q_len}] for this forward")
    if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != step.kv_columns:
        raise RuntimeError(f"{PAGED_ATTENTION}: the attention mask spans {attention_mask.shape[-1]} key columns "
                           f"but the cache holds {step.kv_columns}; the cached prefix would be truncated")
    if step.query_start_loc is None:
        # Decode: one query per sequence, at its last position.
        out = paged_attention(query[:, :, 0, :], step.store, call.layer, step.block_tables, step.seq_lens, scaling,
                              impl=step.impl)
        result = out[:, None]
    else:
        flat = query.transpose(1, 2).reshape(batch * q_len, q_heads, head_dim)
        if step.query_index is not None:
            flat = flat.index_select(0, step.query_index)
        out = paged_attention(flat, step.store, call.layer, step.block_tables, step.seq_lens, scaling,
                              query_start_loc=step.query_start_loc, impl=step.impl)
        if step.query_index is None:
            result = out.view(batch, q_len, q_heads, head_dim)
        else:
            # Padding columns (no KV in the pool) get zeros; nothing real reads them.
            full = out.new_zeros((batch * q_len, q_heads, head_dim))
            full.index_copy_(0, step.query_index, out)
            result = full.view(batch, q_len, q_heads, head_dim)
    step.consumed += 1
    return result, None


def register(name: str = PAGED_ATTENTION) -> str:
    """Register the paged attention and its mask function under ``name`` (idempotent)."""
    AttentionInterface.register(name, paged_attention_forward)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name
