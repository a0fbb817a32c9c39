"""prefixkv as a Hugging Face transformers cache (extra ``hf``; transformers >=5.24,<5.25).

::

    from prefixkv.integrations.hf import PrefixKVStore

    store = PrefixKVStore(model, num_blocks=4096, block_size=16)     # lives as long as you want hits
    with store.cache(model) as cache:                                 # one cache per generate call
        cache.prepare(input_ids, attention_mask)                      # admit: prefix hits are looked up here
        out = model.generate(input_ids, attention_mask=attention_mask, cache=cache, max_new_tokens=64)
    # leaving the block frees the sequences; their full blocks stay cached for later prompts

**Store and cache.** A ``PrefixKVStore`` owns a ``KVCacheManager`` (block tables,
refcounts, prefix hashes, eviction) and a ``KVStore`` (the per-layer K/V pools)
sized for the model. It outlives ``generate`` calls: a later prompt that shares
full blocks with an earlier one (in this process, through this store) reuses
their KV. A ``PrefixKVCache`` is a ``transformers.Cache`` with one
``PrefixKVLayer`` (a ``CacheLayerMixin``) per decoder layer; it holds one
manager sequence per batch row. ``release()`` (or leaving the ``with`` block)
frees them: every block goes back to the pool (full ones stay cached and
evictable).

**Skipping the cached prefill.** ``prepare(input_ids, attention_mask)`` admits
each row (left padding removed) and sets ``get_seq_length()`` to the number of
leading columns every row has cached. ``generate`` then feeds the model only the
remaining columns, with position ids from the attention mask, so they are
correctly positioned. Rows with more cached tokens than the batch minimum
recompute the difference but do not write it again. Without ``prepare`` the
cache admits the rows on the first forward: correct, but nothing is skipped (and
with ``prefill_chunk_size``, a row whose left padding fills the first chunk is
refused: call ``prepare``).

**Modes.** ``mode="gather"`` (default): ``update`` writes the new K/V through the
slot mapping and returns the padded, contiguous ``[B, H, T, d]`` K/V gathered
through the block tables; it works with every attention implementation.
``mode="paged"``: the model must use ``attn_implementation="prefixkv_paged"``
(``model.set_attn_implementation(PAGED_ATTENTION)``); ``update`` only writes and
hands the block tables to that attention function through the attention kwargs,
which calls ``prefixkv.kv.attention.paged_attention`` on the pool: no contiguous
copy per step in the cache (on the CPU the ``"torch"`` implementation still
gathers internally; the CUDA kernels read the pool in place).

**What generate can get silently wrong, and what this cache does about it.**

* *Full prompt, or suffix with a covering mask.* ``generate`` slices the input
  to ``input_ids[:, get_seq_length():]`` only when the attention mask is as long
  as the ids. Pass the full prompt (with or without a mask), or only the
  uncached suffix together with an attention mask covering the whole sequence.
  Suffix ids without such a mask are sliced a second time and positioned from 0;
  the cache checks every forward's token ids, position ids and attention mask
  against the prepared rows and raises instead.
* *A cache covering the whole prompt.* ``generate`` would slice
  ``input_ids[:, -0:]`` (the whole prompt) if ``get_seq_length()`` equalled the
  prompt length. Admission always leaves at least the last prompt token to
  compute (a fully cached, block-aligned prompt recomputes its last block), so
  the model produces the logits of the next token.
* *Batches.* Left padding only (right padding is refused). Padding columns are
  never stored; each row's KV is addressed by its own positions, so a row's
  blocks can be shared with prompts that were padded differently or not at all.
  Position ids are required for padded rows (``generate`` builds them from the
  mask).
* *num_return_sequences > 1* (and beam search): ``generate`` repeats each row;
  the cache forks the row's sequence (blocks shared, copy-on-write on the first
  divergent write of a shared tail) instead of storing copies.
* *A second prompt on the same cache.* Call ``prepare`` again (it releases the
  previous rows). Without it the cache still holds the previous call's rows and
  columns; ``generate`` slices the new ids past them and the forward is refused
  with a message saying so.
* *After generate.* The cache holds, per row, the prompt and every generated
  token *except the last one*: the last sampled token was never fed to the
  model, so its KV does not exist (``get_seq_length() == sequences.shape[1] - 1``,
  as with ``DynamicCache``). To continue, pass the full ``out.sequences`` (plus
  new ids) with the same cache; the last token is computed then. ``release()``
  returns every block; ``store.check_invariants()`` holds and
  ``store.stats().active_blocks == 0`` once every cache is released.
* *KV published before it is written.* The manager publishes a block's hash at
  admission, before the forward writes its KV. The store keeps such blocks
  "pending" until a forward has written them completely; a later admission does
  not count a pending block as a hit (it recomputes it), so a cache prepared and
  never run, or a forward that raised, cannot hand unwritten KV to another
  request.

**One store per model.** Cached KV is only valid for the weights that computed
it, and hits are looked up by token ids alone, so a store is bound to one model
object (see ``PrefixKVStore``): a cache for any other model, even a same-shape
one, is refused with ``ValueError``; ``store.reset(model)`` forgets every cached
block and rebinds it.

**Hooks.** A cache follows each forward through hooks on the model it was built
for (the top-level model, which ``generate`` calls, and its base model); nested
hooked calls count as one forward. The top-level hook is what makes models whose
``*ForCausalLM`` bypasses the base model's ``forward`` work (OPT calls
``self.model.decoder``).

**Sliding windows.** A sliding-window model (Mistral's default
``sliding_window=4096``, ``layer_types`` with ``"sliding_attention"``) is
accepted while no sequence is longer than the window: then the window masks
nothing. ``prepare`` or the forward that would grow a sequence past it raises
``NotImplementedError`` (the cache keeps and attends to every token).

**Architectures.** Any decoder-only model whose attention calls ``cache.update``
works in ``mode="gather"`` (Llama, Mistral, Qwen2, GPT-2, GPT-BigCode, OPT,
Falcon with rotary positions, ...). ``mode="paged"`` also needs the attention to
go through the registered attention function; models that compute it inline
(``_supports_attention_backend = False``: Falcon, Bloom) are refused for it.
Falcon's KV head count follows its config (``multi_query``: 1;
``new_decoder_architecture``: one per query head, as its attention broadcasts
the grouped K/V before ``cache.update``).

Not supported (refused with an error): ALiBi models (Bloom, MPT, Falcon with
``alibi=True``: the paged kernels have no ALiBi bias, and they take no position
ids, through which the cache checks every forward's positions), chunked,
linear-attention or KV-sharing layers, sequences longer than a sliding window,
encoder-decoder models, ``inputs_embeds`` without ``input_ids`` (the prefix
cache hashes token ids), ``crop`` (assisted/speculative decoding),
multi-dimensional position ids.

The integration is pinned to transformers ``SUPPORTED_TRANSFORMERS``: the cache
API changed in 5.17, 5.23 and 5.24. Importing this module under another version
raises ``ImportError`` unless ``PREFIXKV_HF_ALLOW_UNSUPPORTED=1`` is set (then
it warns).
"""

from __future__ import annotations

import inspect
import itertools
import os
import re
import time
import warnings
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import transformers
from transformers.cache_utils import Cache, CacheLayerMixin

from prefixkv.errors import OutOfBlocks, SequenceTooLong
from prefixkv.manager import KVCacheManager
from prefixkv.sizing import KVSpec, parse_size
from prefixkv.kv.storage import KVStore

SUPPORTED_TRANSFORMERS = ">=5.24,<5.25"
_SUPPORTED_RANGE = ((5, 24), (5, 25))


def _check_transformers_version(version: str = transformers.__version__) -> None:
    match = re.match(r"(\d+)\.(\d+)", version)
    parsed = (int(match.group(1)), int(match.group(2))) if match else None
    if parsed is not None and _SUPPORTED_RANGE[0] <= parsed < _SUPPORTED_RANGE[1]:
        return
    message = (f"prefixkv.integrations.hf supports transformers {SUPPORTED_TRANSFORMERS}, found {version} "
               "(the Cache API changed in 5.17, 5.23 and 5.24); install 'prefixkv[hf]'")
    if os.environ.get("PREFIXKV_HF_ALLOW_UNSUPPORTED") == "1":
        warnings.warn(message + "; continuing because PREFIXKV_HF_ALLOW_UNSUPPORTED=1", RuntimeWarning, stacklevel=3)
        return
    raise ImportError(message)


_check_transformers_version()

from .hf_paged import (ALIBI_REASON, PAGED_ATTENTION, PAGED_KWARG, PagedCall, PagedStep,  # noqa: E402
                       alibi_of, attention_backend_problem, check_text_only, kv_heads_of, paged_attention_forward,
                       register)

register()

__all__ = ["PrefixKVStore", "PrefixKVCache", "PrefixKVLayer", "PrefillInfo", "PAGED_ATTENTION",
           "SUPPORTED_TRANSFORMERS", "paged_attention_forward", "register", "model_kv_spec"]

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
_MODES = ("gather", "paged")


# -- model facts -------------------------------------------------------------------
def _text_config(model_or_config):
    config = getattr(model_or_config, "config", model_or_config)
    return config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config


def _check_supported_config(config) -> None:
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError("PrefixKVCache supports decoder-only models, not encoder-decoder ones")
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and any(t not in ("full_attention", "sliding_attention") for t in layer_types):
        raise ValueError(f"PrefixKVCache supports full-attention (and sliding-window) layers only, got "
                         f"{sorted(set(layer_types))}")
    if getattr(config, "kv_sharing_modes", None) is not None:
        raise ValueError("PrefixKVCache does not support KV sharing between layers")
    if getattr(config, "attention_chunk_size", None) is not None:
        raise ValueError("PrefixKVCache does not support chunked attention")
    if alibi_of(config):
        raise ValueError(f"{getattr(config, 'model_type', None) or type(config).__name__} uses ALiBi attention "
                         f"biases, which PrefixKVCache does not support: {ALIBI_REASON}")


def _sliding_window(config) -> int | None:
    """The sliding window of any layer (``None``: every layer attends to its whole history)."""
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if "sliding_attention" in layer_types else None
    if window is not None and getattr(config, "use_sliding_window", True):
        return int(window)
    return None


def model_kv_spec(model_or_config, dtype: torch.dtype | str | None = None) -> KVSpec:
    """The ``KVSpec`` (layers, KV heads, head dim, dtype) of a decoder-only transformers model."""
    check_text_only(getattr(model_or_config, "config", model_or_config))
    config = _text_config(model_or_config)
    _check_supported_config(config)
    heads = config.num_attention_heads
    kv_heads = kv_heads_of(config)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    if dtype is None:
        dtype = getattr(model_or_config, "dtype", None) if hasattr(model_or_config, "parameters") else None
        dtype = dtype or getattr(config, "dtype", None) or torch.float32
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    if dtype not in _DTYPE_NAMES:
        raise ValueError(f"KV storage supports float32, float16 and bfloat16, not {dtype}")
    return KVSpec(layers=config.num_hidden_layers, kv_heads=kv_heads, head_dim=head_dim, dtype=_DTYPE_NAMES[dtype])


# -- the shared store --------------------------------------------------------------
class PrefixKVStore:
    """A model's paged KV pool and its prefix-caching manager, shared by ``PrefixKVCache`` objects.

    Give ``num_blocks`` or ``pool_bytes`` (e.g. ``"2GiB"``). ``dtype`` and
    ``device`` default to the model's. ``impl`` is passed to
    ``paged_attention`` in paged mode. ``hash_seed``, ``policy``, ``verify``
    and ``enable_caching`` go to ``KVCacheManager``. ``num_host_blocks`` with
    ``host_cache=True`` adds the host tier: blocks evicted from the device pool
    are kept in (pinned) host memory and loaded back on a later hit. ``remote``
    (``redis://host:port/db``, ``unix://``, ``redis+cluster://``) adds a shared
    remote tier below it (``prefixkv.tiers.remote``); ``disk`` (a directory, at
    most ``disk_bytes`` of blocks) a persistent disk tier between the two
    (``prefixkv.tiers.disk_tier``): a store built again on it serves what this one
    wrote. Either implies the host tier (``2 * num_blocks`` host blocks unless
    given) and a pinned hash seed (derived from the weights digest when
    ``hash_seed`` is None; ``self.hash_seed``); ``close()`` flushes them.

    **One store per model.** Cached KV is only valid for the weights that
    computed it, and prefix hits are looked up by token ids alone. A store is
    therefore bound to one model object: the ``model`` given here (if it is a
    ``torch.nn.Module``), until KV is first written; from then on to the model
    whose cache wrote it. ``store.cache(other_model)`` (or
    ``PrefixKVCache(store, other_model)``) for any other object, even one of
    the same shape or a copy, raises ``ValueError``. ``reset(model)`` forgets
    every cached block and binds the store to ``model`` (after a change of
    weights in place, call it too: the store cannot notice that).
    """

    def __init__(self, model, *, num_blocks: int | None = None, pool_bytes: int | str | None = None,
                 block_size: int = 16, dtype: torch.dtype | str | None = None, device=None, policy="lru",
                 hash_seed: int | None = None, verify: bool = False, enable_caching: bool = True,
                 impl: str = "auto", num_host_blocks: int = 0, host_cache: bool = False,
                 host_policy="lru", remote: str | None = None, remote_config=None, disk=None,
                 disk_bytes: int | None = None, disk_config=None) -> None:
        self.spec = model_kv_spec(model, dtype)
        if device is None:
            device = getattr(model, "device", "cpu")
        if (num_blocks is None) == (pool_bytes is None):
            raise ValueError("give exactly one of num_blocks and pool_bytes")
        if pool_bytes is not None:
            self.kv = KVStore.from_budget(self.spec, block_size, parse_size(pool_bytes), device)
        else:
            self.kv = KVStore(self.spec, num_blocks, block_size, device)
        self.block_size = block_size
        if (remote is not None or disk is not None) and verify:
            raise ValueError("a disk or remote tier needs prefix caching without verify=True (the tier "
                             "verifies every block's token ids itself)")
        if (remote is not None or disk is not None) and not isinstance(model, torch.nn.Module):
            raise TypeError("a disk or remote tier needs the model's weights (their digest is in every key)")
        from prefixkv.tiers.stack import bind_stack, plan_stack
        plan = plan_stack(num_blocks=self.kv.num_blocks, block_size=block_size, dtype=str(self.kv.dtype),
                          num_host_blocks=num_host_blocks, host_cache=host_cache, host_policy=host_policy,
                          hash_seed=hash_seed, enable_caching=enable_caching, model=model, disk=disk,
                          disk_bytes=disk_bytes, disk_config=disk_config, remote=remote, remote_config=remote_config)
        self.hash_seed = plan.hash_seed
        self.manager = KVCacheManager(self.kv.num_blocks, block_size, policy=policy, hash_seed=plan.hash_seed,
                                      verify=verify, enable_caching=enable_caching, tiers=plan.tiers)
        self.impl = impl
        # Blocks whose hash may be published but whose KV is not known to be completely written.
        self.pending: set[int] = set()
        self.manager.unwritten = self.pending          # the host tier never keeps such a block
        self.tiers = bind_stack(self.manager, self.kv, plan)
        self._ids = itertools.count()
        # The model whose KV this store holds (weak: the store does not keep a model alive).
        self._model_ref = weakref.ref(model) if isinstance(model, torch.nn.Module) else None
        self._kv_written = False     # once True, the binding is fixed until reset()

    def run_transfers(self) -> None:
        """The manager's pending block moves, in order: demotions to the host tier, loads of
        host-tier hits, copy-on-write copies."""
        manager = self.manager
        self.kv.transfer(manager.take_demotions(), manager.take_loads(), manager.take_copies())

    @property
    def remote(self):
        """The remote tier of the stack (None: none)."""
        return self.tiers.tier("REMOTE")

    @property
    def disk(self):
        """The disk tier of the stack (None: none)."""
        return self.tiers.tier("DISK")

    def prefetch(self, prompt) -> int:
        """Stage the continuation of ``prompt`` (a manager ``Prompt``) from the tiers below the host
        tier (disk, remote) in the host tier before it is admitted; 0 without such tiers."""
        return self.tiers.prefetch(prompt)

    def write_back(self) -> int:
        """Queue blocks whose KV a forward has written for the tiers below the host tier (never waits)."""
        return self.tiers.write_back()

    def close(self) -> None:
        """Flush (bounded) and close the tiers below the host tier, if any."""
        self.tiers.close()

    def cache(self, model, mode: str = "gather", *, session=None, end: str | None = None) -> "PrefixKVCache":
        """A new ``PrefixKVCache`` on this store for ``model`` (the model you call ``generate`` on).
        ``session`` / ``end``: the session hint its rows are released with (see ``PrefixKVCache``)."""
        return PrefixKVCache(self, model, mode=mode, session=session, end=end)

    def reset(self, model=None) -> None:
        """Forget every cached block (no prefix hits from earlier KV) and bind the store to ``model``
        (``None``: to the next model that uses it). Refused (``CacheBusy``) while a cache holds rows:
        release them first."""
        self.manager.reset_prefix_cache()
        self.pending.clear()
        self._model_ref = weakref.ref(model) if isinstance(model, torch.nn.Module) else None
        self._kv_written = False

    def _bind(self, model) -> None:
        """Refuse a model other than the one whose KV this store holds."""
        bound = self._model_ref() if self._model_ref is not None else None
        if bound is model:
            return
        if self._model_ref is None or not self._kv_written:
            self._model_ref = weakref.ref(model)
            return
        raise ValueError(f"this store holds KV computed by another model; build one store per model "
                         f"(PrefixKVStore(model, ...)), or call store.reset(model) to forget every cached block "
                         f"and bind the store to this {type(model).__name__}")

    def stats(self):
        """The manager's ``CacheStats`` (active/evictable/free blocks, prefix hits, COW copies, ...)."""
        return self.manager.stats()

    def check_invariants(self) -> None:
        """The manager's invariants (refcounts vs block tables, block accounting)."""
        self.manager.check_invariants()

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def _new_seq_id(self) -> int:
        return next(self._ids)

    def __repr__(self) -> str:
        s = self.manager.stats()
        return (f"PrefixKVStore({self.spec}, blocks={self.kv.num_blocks}x{self.block_size}, "
                f"active={s.active_blocks}, evictable={s.evictable_blocks}, device={self.kv.device})")


# -- per-row and per-forward state ----------------------------------------------------
@dataclass(slots=True)
class _Row:
    seq: int               # manager sequence id
    pad: int               # left-padding columns (never stored)
    tokens: list[int]      # token ids of positions 0 .. len-1 (the manager holds the same)
    written: int           # positions 0 .. written-1 have their KV in the pool
    own_start: int         # first position this row computed itself (block aligned)


@dataclass(slots=True)
class _Forward:
    col0: int                       # columns before this forward
    batch: int
    q_len: int
    src_index: torch.Tensor | None  # rows of the flattened [batch * q_len] K/V to write (None: all, in order)
    dst_slots: torch.Tensor | None  # their physical slots (None: nothing to write)
    gather_slots: torch.Tensor | None   # [batch * columns] slots (gather mode)
    gather_pad: torch.Tensor | None     # [batch, columns, 1, 1] True at padding columns (None: no padding)
    paged: PagedStep | None
    new_written: list[int] = field(default_factory=list)
    layers_done: set[int] = field(default_factory=set)
    injected: int = 0


@dataclass(frozen=True, slots=True)
class PrefillInfo:
    """What ``prepare`` did. Pass ``input_ids`` and ``attention_mask`` to ``generate``."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cached_columns: int         # get_seq_length(): leading columns generate will not feed to the model
    hit_tokens: tuple[int, ...]  # per row, prompt tokens whose KV came from the store
    prompt_tokens: tuple[int, ...]
    skipped_tokens: int         # prompt tokens (all rows) the model will not compute


def _hookable(model) -> torch.nn.Module:
    base = getattr(model, "base_model", model)
    return base if isinstance(base, torch.nn.Module) else model


def _hook_targets(model) -> list[torch.nn.Module]:
    """The modules whose forward a cache follows: the model you call (``generate`` calls it) and
    its base model (for direct calls). Some ``*ForCausalLM`` skip the base model's forward (OPT
    calls ``self.model.decoder``), so the top-level model is the one every architecture passes."""
    base = _hookable(model)
    return [model] if base is model else [model, base]


_SIGNATURES: dict[type, inspect.Signature] = {}


def _forward_arguments(module, args, kwargs) -> dict:
    if len(args) <= 1:
        out = dict(kwargs)
        if args:
            out.setdefault("input_ids", args[0])
        return out
    sig = _SIGNATURES.get(type(module))
    if sig is None:
        sig = _SIGNATURES[type(module)] = inspect.signature(module.forward)
    return dict(sig.bind_partial(*args, **kwargs).arguments)


def _cache_of(arguments: dict):
    cache = arguments.get("cache")
    if cache is None:
        cache = arguments.get("past_key_values")
    return cache if isinstance(cache, PrefixKVCache) else None


def _pre_forward(module, args, kwargs):
    arguments = _forward_arguments(module, args, kwargs)
    cache = _cache_of(arguments)
    if cache is not None:
        cache._enter(module, arguments)
    return None


def _post_forward(module, args, kwargs, output):
    # Registered with always_call=True: also runs (output None) when the forward raised, so the
    # nesting depth stays balanced.
    cache = _cache_of(_forward_arguments(module, args, kwargs))
    if cache is not None:
        cache._exit(module, output)
    return None


def _install_hooks(model) -> list[torch.nn.Module]:
    targets = _hook_targets(model)
    for module in targets:
        # Looked up by function, not by a flag attribute: a deepcopy of a hooked model carries the hooks.
        if not any(hook is _pre_forward for hook in module._forward_pre_hooks.values()):
            module.register_forward_pre_hook(_pre_forward, with_kwargs=True)
            module.register_forward_hook(_post_forward, with_kwargs=True, always_call=True)
    return targets


# -- the cache ---------------------------------------------------------------------
class PrefixKVLayer(CacheLayerMixin):
    """One decoder layer's view of a ``PrefixKVCache``: K/V in the store's pool for this layer."""

    is_compileable = False
    is_croppable = False
    is_sliding = False
    supports_early_init = False

    def __init__(self, cache: "PrefixKVCache", layer_idx: int) -> None:
        super().__init__()
        self._cache = weakref.proxy(cache)
        self.layer_idx = layer_idx
        self.columns = 0          # padded columns processed (what DynamicLayer's keys.shape[-2] would be)
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None   # the pool is allocated by the store

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache = self._cache
        fwd = cache._forward
        layer = self.layer_idx
        if fwd is None:
            raise RuntimeError("PrefixKVCache.update outside a forward its hooks saw: build the cache with the "
                               "model you call (PrefixKVCache(store, model) / store.cache(model)), and pass it "
                               "as cache= to that model")
        if layer in fwd.layers_done:
            raise RuntimeError(f"PrefixKVCache: layer {layer} updated twice in one forward")
        batch, heads, q_len, dim = key_states.shape
        if batch != fwd.batch or q_len != fwd.q_len:
            raise RuntimeError(f"PrefixKVCache: layer {layer} got K/V for [{batch}, {q_len}] but the forward's "
                               f"input was [{fwd.batch}, {fwd.q_len}]")
        fwd.layers_done.add(layer)
        kv = cache.store.kv
        if fwd.dst_slots is not None:
            # The pool is inference state: no gradient flows into or out of it.
            k = key_states.detach().transpose(1, 2).reshape(batch * q_len, heads, dim)
            v = value_states.detach().transpose(1, 2).reshape(batch * q_len, heads, dim)
            if fwd.src_index is not None:
                k = k.index_select(0, fwd.src_index)
                v = v.index_select(0, fwd.src_index)
            kv.write(layer, fwd.dst_slots, k, v)
        self.columns = fwd.col0 + q_len
        attn_kwargs = kwargs.get("kwargs")
        if fwd.paged is not None and isinstance(attn_kwargs, dict):
            attn_kwargs[PAGED_KWARG] = PagedCall(fwd.paged, layer)
            fwd.injected += 1
            return key_states, value_states
        if fwd.gather_slots is None:
            cache._plan_gather(fwd)
        columns = fwd.col0 + q_len
        shape = (batch, columns, heads, dim)
        keys = kv.k[layer].view(-1, heads, dim).index_select(0, fwd.gather_slots).view(shape)
        values = kv.v[layer].view(-1, heads, dim).index_select(0, fwd.gather_slots).view(shape)
        if fwd.gather_pad is not None:
            keys.masked_fill_(fwd.gather_pad, 0)
            values.masked_fill_(fwd.gather_pad, 0)
        return keys.transpose(1, 2), values.transpose(1, 2)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.columns + query_length, 0

    def get_seq_length(self) -> int:
        return self.columns

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.columns = 0

    # Batch-shape changes are done once for the whole cache by PrefixKVCache.
    def reorder_cache(self, beam_idx) -> None:
        raise RuntimeError("reorder PrefixKVCache through the cache, not one layer")

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("PrefixKVCache cannot be cropped (assisted/speculative decoding is unsupported)")

    def offload(self) -> None:
        return None

    def prefetch(self) -> None:
        return None


def _out_of_blocks(manager, needed: int, what: str, *, own_rows: int) -> OutOfBlocks:
    """``OutOfBlocks`` for a cache's admission or append, saying so when other caches' rows hold
    blocks: a cache used without ``with`` keeps them until ``release()`` (there is no finalizer),
    so a loop that drops caches unreleased runs the pool dry and this is how it shows."""
    exc = OutOfBlocks(needed, manager.num_free_blocks, what)
    others = len(manager) - own_rows
    if others > 0:
        held = manager.stats().active_blocks
        exc.args = (f"{exc.args[0]}; {others:,} row(s) of other caches on this store still hold blocks "
                    f"({held:,} active in all): a cache keeps its rows until cache.release() or the end of "
                    f"its `with` block, so release caches you are done with",)
    return exc


class PrefixKVCache(Cache):
    """A transformers ``Cache`` backed by a ``PrefixKVStore``. See the module docstring."""

    def __init__(self, store: PrefixKVStore, model, *, mode: str = "gather", session=None,
                 end: str | None = None) -> None:
        if not isinstance(model, torch.nn.Module):
            raise TypeError(f"PrefixKVCache needs the model it will run with, got {type(model).__name__}")
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {', '.join(_MODES)}, got {mode!r}")
        spec = model_kv_spec(model, getattr(model, "dtype", None) if hasattr(model, "parameters") else None)
        if (spec.layers, spec.kv_heads, spec.head_dim) != (store.spec.layers, store.spec.kv_heads, store.spec.head_dim):
            raise ValueError(f"the store was sized for {store.spec}, the model needs {spec}")
        model_dtype = getattr(model, "dtype", None)
        if model_dtype is not None and model_dtype != store.kv.dtype:
            raise ValueError(f"the model computes in {model_dtype} but the store holds {store.kv.dtype}")
        model_device = getattr(model, "device", None)
        if model_device is not None and torch.device(model_device) != store.kv.device:
            raise ValueError(f"the model is on {model_device} but the store's pool is on {store.kv.device}")
        if mode == "paged" and attention_backend_problem(model) is not None:
            raise ValueError(f"mode='paged' cannot work with this model: {attention_backend_problem(model)}; "
                             f"use mode='gather'")
        if mode == "paged" and _attn_implementation(model) != PAGED_ATTENTION:
            raise ValueError(f"mode='paged' needs the model's attention to be {PAGED_ATTENTION!r}: "
                             f"model.set_attn_implementation({PAGED_ATTENTION!r}) (currently "
                             f"{_attn_implementation(model)!r}); or use mode='gather'")
        store._bind(model)
        self.store = store
        self.mode = mode
        self.session, self.end = session, end       # the session hint rows are released with
        self._model = weakref.ref(model)
        self._window = _sliding_window(_text_config(model))
        self._depth = 0             # nesting of hooked forwards (top-level model, base model)
        self._rows: list[_Row] = []
        self._columns = 0
        self._forward: _Forward | None = None
        self._fresh = False         # prepared, no forward run yet
        self._broken: str | None = None
        self._targets = [weakref.ref(module) for module in _install_hooks(model)]
        generation_config = getattr(model, "generation_config", None)
        pad = getattr(generation_config, "pad_token_id", None)
        if pad is None:
            pad = getattr(_text_config(model), "pad_token_id", None)
        self._pad_token_id = int(pad) if isinstance(pad, int) else 0
        self.counters = dict(prompt_tokens=0, hit_tokens=0, skipped_tokens=0, computed_tokens=0,
                             written_tokens=0, forwards=0, forks=0)
        super().__init__(layers=[PrefixKVLayer(self, i) for i in range(store.spec.layers)])

    # -- the public lifecycle ----------------------------------------------------------
    def prepare(self, input_ids, attention_mask=None, *, pad_token_id: int | None = None) -> PrefillInfo:
        """Admit the prompts (looking up cached prefixes) before ``generate``.

        ``input_ids``: a ``[B, P]`` tensor (left-padded, with its ``attention_mask``)
        or a list of token-id lists (then padded here on the left with
        ``pad_token_id``, by default the model's; pass the returned
        ``input_ids`` / ``attention_mask`` to ``generate``). Rows this cache
        held before are released first. All or nothing: if the pool cannot
        hold every row, ``OutOfBlocks`` is raised before anything changes (no
        row admitted, no cached block evicted).
        """
        if self._rows or self._forward is not None or self._broken is not None:
            self.release()
        pad = self._pad_token_id if pad_token_id is None else pad_token_id
        input_ids, attention_mask = _as_batch(input_ids, attention_mask, pad, self.store.kv.device)
        if input_ids.shape[0] == 0:
            raise ValueError("prepare() needs at least one prompt")
        pads = _left_padding(attention_mask, input_ids.shape)
        self._admit(input_ids, pads, max_past=None)
        rows = self._rows
        skipped = sum(max(0, self._columns - row.pad) for row in rows)
        self.counters["skipped_tokens"] += skipped
        return PrefillInfo(input_ids=input_ids, attention_mask=attention_mask, cached_columns=self._columns,
                           hit_tokens=tuple(row.own_start for row in rows),
                           prompt_tokens=tuple(len(row.tokens) for row in rows), skipped_tokens=skipped)

    def release(self, *, end: str | None = None) -> None:
        """Free every row's sequence (finish, cancel and error alike). Full blocks stay cached.

        With a ``session`` (given to ``store.cache``), the rows are released with a session hint
        for the eviction policy: ``end`` here, else the one given to ``cache``, says why the turn
        ended (``"tool_use"`` when the caller's agent loop will call back soon)."""
        manager = self.store.manager
        rows, self._rows = self._rows, []
        hint = None
        if self.session is not None and rows:
            from prefixkv.policies import SessionHint
            hint = SessionHint(self.session, end=end or self.end, time=time.monotonic())
        for row in rows:
            manager.free(row.seq, hint=hint)
        self._set_columns(0)
        self._forward = None
        self._depth = 0
        self._fresh = False
        self._broken = None

    def __enter__(self) -> "PrefixKVCache":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    @property
    def batch_size(self) -> int:
        return len(self._rows)

    @property
    def seq_ids(self) -> list[int]:
        """The manager's sequence id of each batch row."""
        return [row.seq for row in self._rows]

    def tokens(self, row: int) -> list[int]:
        """Token ids whose KV row ``row`` holds (prompt without padding + fed generated tokens)."""
        return list(self._rows[row].tokens)

    def block_table(self, row: int) -> list[int]:
        return self.store.manager.block_ids(self._rows[row].seq)

    def padding(self, row: int) -> int:
        return self._rows[row].pad

    # -- transformers' batch-shape operations --------------------------------------------
    def batch_repeat_interleave(self, repeats: int) -> None:
        """Each row becomes ``repeats`` rows (forks sharing its blocks, copy-on-write)."""
        self._select_rows([i for i in range(len(self._rows)) for _ in range(repeats)])

    def batch_select_indices(self, indices) -> None:
        self._select_rows(_index_list(indices))

    def reorder_cache(self, beam_idx) -> None:
        """Beam search: row i becomes old row ``beam_idx[i]`` (repeats fork, dropped rows are freed)."""
        self._select_rows(_index_list(beam_idx))

    def crop(self, tokens_to_remove: int) -> None:
        if tokens_to_remove:
            raise NotImplementedError("PrefixKVCache cannot be cropped (assisted/speculative decoding is unsupported)")

    def reset(self) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"PrefixKVCache(mode={self.mode!r}, rows={len(self._rows)}, columns={self._columns}, "
                f"layers={len(self.layers)})")

    # -- internals -------------------------------------------------------------------------
    def _check_usable(self) -> None:
        if self._broken is not None:
            raise RuntimeError(f"this PrefixKVCache is unusable ({self._broken}); call release() and prepare again")
        if self._forward is not None:
            raise RuntimeError("a forward through this PrefixKVCache did not finish (it raised?); call release()")

    def _set_columns(self, columns: int) -> None:
        self._columns = columns
        for layer in self.layers:
            layer.columns = columns

    def _admit(self, input_ids: torch.Tensor, pads: list[int], max_past: int | None) -> None:
        store = self.store
        manager = store.manager
        size = store.block_size
        ids = input_ids.tolist()
        if self._window is not None:
            longest = max(len(ids[b]) - pad for b, pad in enumerate(pads))
            self._check_window(longest)
        prompts = []
        for b, pad in enumerate(pads):
            if not ids[b][pad:]:
                raise ValueError(f"row {b} is all padding")
            prompts.append(manager.prompt(ids[b][pad:]))
        self._check_batch_fits(prompts)        # all or nothing: no row evicts anything for a batch that fails
        rows: list[_Row] = []
        try:
            for b, pad in enumerate(pads):
                tokens = ids[b][pad:]
                seq = store._new_seq_id()
                prompt = prompts[b]
                store.prefetch(prompt)             # remote blocks staged (verified) in the host tier
                hit = manager.admit(seq, prompt)
                store.run_transfers()          # host-tier demotions and loads before any write
                rows.append(_Row(seq, pad, tokens, 0, 0))
                table = manager.block_ids(seq)
                trusted = 0
                while trusted * size < hit and table[trusted] not in store.pending:
                    trusted += 1
                own = trusted * size
                rows[-1].written = rows[-1].own_start = own
                store.pending.update(table[trusted:])
        except BaseException:
            for row in rows:
                manager.free(row.seq)
            raise
        self._rows = rows
        past = min(row.pad + row.own_start for row in rows)
        if max_past is not None:
            past = min(past, max_past)
        self._set_columns(past)
        self._fresh = True
        self.counters["prompt_tokens"] += sum(len(row.tokens) for row in rows)
        self.counters["hit_tokens"] += sum(row.own_start for row in rows)

    def _check_batch_fits(self, prompts) -> None:
        """``OutOfBlocks`` (``SequenceTooLong``), before anything changes, when admitting every
        prompt in order would not fit the free blocks. Read-only. A prompt's blocks that an earlier
        row of the batch publishes (or pins, or loads from the host tier) cost it nothing; a hit
        that an earlier row's allocation evicts costs a fresh block instead of the pinned one, so
        the sum stays exact."""
        manager = self.store.manager
        pool = manager.pool
        size = manager.block_size
        ref = pool.ref_count
        lookup = pool.lookup
        caching = manager.enable_caching
        published: set = set()
        needed = 0
        for b, prompt in enumerate(prompts):
            m = manager.match(prompt)
            if m.total_blocks > pool.num_blocks:
                raise SequenceTooLong(m.total_blocks, pool.num_blocks,
                                      f"row {b}: admission of {prompt.num_tokens} tokens")
            need = m.blocks_needed
            if caching and published:
                hashes = prompt.block_hashes()
                for h in hashes[:m.hit_blocks]:       # pinned or loaded by an earlier row already
                    if h in published:
                        block = lookup(h)
                        if block is None or not ref[block]:
                            need -= 1
                blocks = m.hit_blocks
                limit = min((prompt.num_tokens - 1) // size, len(hashes))
                while blocks < limit and hashes[blocks] in published:
                    block = lookup(hashes[blocks])    # an older evictable copy is pinned instead
                    if block is None or ref[block]:
                        need -= 1
                    blocks += 1
            needed += need
            if caching:
                published.update(prompt.block_hashes()[:prompt.num_tokens // size])
        if needed > manager.num_free_blocks:
            raise _out_of_blocks(manager, needed, f"admission of {len(prompts)} row(s)", own_rows=0)

    def _check_window(self, length: int) -> None:
        if self._window is not None and length > self._window:
            raise NotImplementedError(
                f"a sequence of {length} tokens outgrows the model's sliding window ({self._window}): "
                f"PrefixKVCache keeps and attends to every token's KV, which equals sliding-window attention "
                f"only while no sequence is longer than the window")

    def _owns(self, module) -> bool:
        return any(ref() is module for ref in self._targets)

    def _enter(self, module, arguments: dict) -> None:
        self._depth += 1          # first: the always-called post hook decrements it even if this raises
        if self._depth > 1:       # the base model inside the top-level model's forward
            if not self._owns(module):
                raise RuntimeError("this PrefixKVCache was built for another model; build one per model "
                                   "(PrefixKVCache(store, model))")
            return
        self._begin_forward(module, arguments)

    def _exit(self, module, output) -> None:
        if self._depth == 0:
            return
        self._depth -= 1
        if self._depth == 0 and output is not None:   # None: the forward raised (stays unfinished)
            self._end_forward(module)

    def _select_rows(self, indices: list[int]) -> None:
        if self._forward is not None:
            raise RuntimeError("cannot change the batch in the middle of a forward")
        manager = self.store.manager
        rows = self._rows
        if any(not 0 <= i < len(rows) for i in indices):
            raise IndexError(f"row index out of range for {len(rows)} rows: {indices}")
        used: set[int] = set()
        new_rows: list[_Row] = []
        for i in indices:
            row = rows[i]
            if i not in used:
                used.add(i)
                new_rows.append(row)
                continue
            seq = self.store._new_seq_id()
            manager.fork(row.seq, seq)
            new_rows.append(_Row(seq, row.pad, list(row.tokens), row.written, row.own_start))
            self.counters["forks"] += 1
        for i, row in enumerate(rows):
            if i not in used:
                manager.free(row.seq)
        self._rows = new_rows

    def _begin_forward(self, module, arguments: dict) -> None:
        self._check_usable()
        if not self._owns(module):
            raise RuntimeError("this PrefixKVCache was built for another model; build one per model "
                               "(PrefixKVCache(store, model))")
        model = self._model()
        if model is not None:
            self.store._bind(model)       # another cache on this store may have bound it meanwhile
        if self.mode == "paged" and _attn_implementation(module) != PAGED_ATTENTION:
            raise RuntimeError(f"mode='paged' needs attn_implementation={PAGED_ATTENTION!r}, the model now uses "
                               f"{_attn_implementation(module)!r}")
        input_ids = arguments.get("input_ids")
        if input_ids is None:
            raise ValueError("PrefixKVCache needs input_ids (the prefix cache hashes token ids; inputs_embeds alone "
                             "cannot be matched)")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        attention_mask = arguments.get("attention_mask")
        position_ids = arguments.get("position_ids")
        batch, q_len = input_ids.shape
        if q_len == 0:
            if self._rows and not self._fresh:
                raise ValueError(
                    f"a forward with no new tokens: this cache still holds {len(self._rows)} row(s) of "
                    f"{self._columns} column(s) from its previous call, so generate sliced the input to "
                    f"input_ids[:, {self._columns}:] and nothing was left. For a new prompt call "
                    f"cache.prepare(input_ids, attention_mask) first (or use a new store.cache(model)); to "
                    f"continue the held rows pass the full sequence (held tokens + new ones), or only the new "
                    f"ids with an attention mask covering the whole sequence")
            raise ValueError(f"a forward with no tokens: the cache holds {self._columns} column(s) and generate "
                             f"sliced them all away; pass the full prompt given to prepare(), or the uncached "
                             f"suffix with an attention mask covering the whole sequence")
        if not self._rows:
            # Lazy admission from the first forward: it must be the whole prompt.
            if isinstance(attention_mask, torch.Tensor) and attention_mask.shape[-1] != q_len:
                raise ValueError(
                    f"this PrefixKVCache holds nothing, but the attention mask covers {attention_mask.shape[-1]} "
                    f"columns for {q_len} input ids: call cache.prepare(full_prompt_ids, attention_mask) first")
            pads = _left_padding(attention_mask if isinstance(attention_mask, torch.Tensor) else None,
                                 input_ids.shape)
            for b, pad in enumerate(pads):
                if pad >= q_len:
                    raise ValueError(
                        f"row {b} has no token in the first forward: its left padding covers all {q_len} columns "
                        f"(generate's prefill_chunk_size splits the prompt into chunks), so it cannot be admitted "
                        f"from this forward; call cache.prepare(input_ids, attention_mask) before generate")
            self._admit(input_ids, pads, max_past=0)
        if batch != len(self._rows):
            if self._fresh and batch % len(self._rows) == 0:
                self.batch_repeat_interleave(batch // len(self._rows))    # num_return_sequences / num_beams
            else:
                raise ValueError(f"the forward has {batch} rows but the cache holds {len(self._rows)}")
        rows = self._rows
        col0 = self._columns
        width = max(row.pad + len(row.tokens) for row in rows)
        if self._fresh and col0 and q_len >= width:
            # generate slices its input past get_seq_length(); a forward that brings the whole
            # prepared prompt again (plus draft tokens) was not sliced, as in assisted decoding.
            raise ValueError(
                f"the first forward brings {q_len} columns from the start of the {width}-column prompt although "
                f"the cache holds {col0} of them: "
                f"generate did not skip the cached columns, as in assisted decoding (assistant_model=, "
                f"prompt_lookup_num_tokens=), which PrefixKVCache does not support (it cannot be cropped); "
                f"use greedy, sampling or beam search")
        columns = col0 + q_len
        pads = np.fromiter((row.pad for row in rows), dtype=np.int64, count=batch)
        padded = bool(pads.any())
        self._check_mask(attention_mask, pads, col0, columns, q_len)
        self._check_positions(position_ids, pads, col0, columns, q_len, padded)
        appended = self._take_tokens(input_ids, col0, columns)
        self._forward = self._plan(col0, q_len, pads, padded, appended)
        self._fresh = False

    def _check_mask(self, attention_mask, pads: np.ndarray, col0: int, columns: int, q_len: int) -> None:
        if attention_mask is None:
            if pads.any():
                raise ValueError("rows are left-padded but the forward has no attention_mask; pass the mask")
            return
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise ValueError("PrefixKVCache needs a 2D attention_mask (or none); 4D masks are not supported")
        if attention_mask.shape != (len(pads), columns):
            raise ValueError(
                f"attention_mask is {tuple(attention_mask.shape)} but the cache holds {col0} column(s) and the "
                f"forward brings {q_len}: pass the full prompt, or only the uncached suffix with an attention mask "
                f"covering the whole sequence")
        first = col0 if (q_len == 1 and not self._fresh) else 0
        got = attention_mask[:, first:].to(device="cpu", dtype=torch.bool).numpy()
        expect = np.arange(first, columns)[None, :] >= pads[:, None]
        if not np.array_equal(got, expect):
            raise ValueError("attention_mask does not match the prepared rows' left padding: give prepare() the "
                             "attention_mask you give generate (right padding and holes are not supported)")

    def _check_positions(self, position_ids, pads, col0, columns, q_len, padded) -> None:
        if position_ids is None:
            if padded:
                raise ValueError("left-padded rows need position_ids (generate builds them from the attention mask)")
            return
        if not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2:
            raise ValueError("PrefixKVCache supports 2D position_ids only")
        got = position_ids.to("cpu").numpy()
        if got.shape[-1] != q_len:
            raise ValueError(f"position_ids cover {got.shape[-1]} tokens for {q_len} input ids")
        got = np.broadcast_to(got, (len(pads), q_len))
        expect = np.arange(col0, columns)[None, :] - pads[:, None]
        real = expect >= 0
        if not np.array_equal(got[real], expect[real]):
            raise ValueError(
                f"position ids disagree with the cache: the new tokens sit at positions {col0 - int(pads.max())}.. "
                f"(after {col0} cached column(s)); pass the full prompt, or the uncached suffix with an attention "
                f"mask covering the whole sequence")

    def _take_tokens(self, input_ids: torch.Tensor, col0: int, columns: int) -> bool:
        """Check this forward's ids against the rows, append the new ones; True if any was appended."""
        manager = self.store.manager
        store = self.store
        size = store.block_size
        ids = input_ids.tolist()
        news: list[list[int]] = []
        for b, row in enumerate(self._rows):
            start = col0 - row.pad
            first = max(start, 0)
            row_ids = ids[b][first - start:]
            known = len(row.tokens)
            if first > row.written:
                raise RuntimeError(f"row {b}: positions {row.written}..{first - 1} have no KV (internal error)")
            overlap = max(0, min(known, columns - row.pad) - first)
            if row_ids[:overlap] != row.tokens[first:first + overlap]:
                raise ValueError(
                    f"row {b}: the input ids at positions {first}..{first + overlap - 1} differ from the tokens the "
                    f"cache was prepared with; pass the full prompt (or the uncached suffix with an attention mask "
                    f"covering the whole sequence) to generate, the same one given to prepare()")
            news.append(row_ids[overlap:])
        if not any(news):
            return False
        if self._window is not None:
            self._check_window(max(len(row.tokens) + len(new) for row, new in zip(self._rows, news)))
        seqs = [row.seq for row in self._rows]
        if all(len(new) == 1 for new in news):
            manager.decode_step(seqs, [new[0] for new in news])   # all or nothing
        else:
            needed = 0
            ref = manager.pool.ref_count
            holders: dict[int, int] = {}      # shared partial tail -> holders not yet copied away from it
            for seq, new in zip(seqs, news):
                if not new:
                    continue
                need = manager.blocks_needed_to_append(seq, len(new))
                if manager.num_tokens(seq) % size:
                    tail = manager.block_ids(seq)[-1]
                    left = holders.setdefault(tail, ref[tail])
                    if left > 1:
                        holders[tail] = left - 1      # copies it; the last holder writes in place
                    elif ref[tail] > 1:
                        need -= 1                     # counted a copy it will not make
                needed += need
            if needed > manager.num_free_blocks:
                raise _out_of_blocks(manager, needed, f"append of {sum(map(len, news))} token(s)",
                                     own_rows=len(self._rows))
            for seq, new in zip(seqs, news):
                if new:
                    manager.append(seq, new)
        for row, new in zip(self._rows, news):
            row.tokens.extend(new)
        store.run_transfers()    # host-tier demotions and loads, then copy-on-write, before this step's writes
        for row in self._rows:
            table = manager.block_ids(row.seq)
            store.pending.update(table[row.written // size:])
        return True

    def _plan(self, col0: int, q_len: int, pads: np.ndarray, padded: bool, appended: bool) -> _Forward:
        store = self.store
        manager = store.manager
        device = store.kv.device
        batch = len(self._rows)
        columns = col0 + q_len
        src_parts, dst_parts, new_written = [], [], []
        computed = 0
        for b, row in enumerate(self._rows):
            end = max(columns - row.pad, 0)       # a chunk of a prefill may be all padding for a row
            computed += min(q_len, end)
            new_written.append(end)
            if row.written < end:
                first_col = row.written + row.pad - col0
                src_parts.append(np.arange(b * q_len + first_col, (b + 1) * q_len, dtype=np.int64))
                dst_parts.append(manager.slot_mapping(row.seq, row.written, end))
        src_index = dst_slots = None
        if dst_parts:
            src = np.concatenate(src_parts)
            dst = np.concatenate(dst_parts)
            unique, first = np.unique(dst, return_index=True)
            if len(unique) < len(dst):      # forks of one row writing the same shared slots: write once
                keep = np.sort(first)
                src, dst = src[keep], dst[keep]
            if not (len(src) == batch * q_len and np.array_equal(src, np.arange(batch * q_len))):
                src_index = torch.from_numpy(src).to(device)
            dst_slots = torch.from_numpy(dst).to(device)
            self.counters["written_tokens"] += len(dst)
            store._kv_written = True
        self.counters["computed_tokens"] += computed
        self.counters["forwards"] += 1
        fwd = _Forward(col0=col0, batch=batch, q_len=q_len, src_index=src_index, dst_slots=dst_slots,
                       gather_slots=None, gather_pad=None, paged=None, new_written=new_written)
        fwd_pads = pads if padded else None
        if self.mode == "paged":
            fwd.paged = self._plan_paged(col0, q_len, pads, fwd_pads)
        return fwd

    def _tables(self) -> np.ndarray:
        return self.store.manager.block_tables([row.seq for row in self._rows])

    def _plan_gather(self, fwd: _Forward) -> None:
        size = self.store.block_size
        device = self.store.kv.device
        columns = fwd.col0 + fwd.q_len
        pads = np.fromiter((row.pad for row in self._rows), dtype=np.int64, count=fwd.batch)
        tables = self._tables().astype(np.int64)
        position = np.arange(columns, dtype=np.int64)[None, :] - pads[:, None]
        is_pad = position < 0
        position = np.maximum(position, 0)
        slots = np.take_along_axis(tables, position // size, axis=1) * size + position % size
        slots[is_pad] = 0
        fwd.gather_slots = torch.from_numpy(slots.reshape(-1)).to(device)
        if is_pad.any():
            fwd.gather_pad = torch.from_numpy(is_pad).to(device)[:, :, None, None]

    def _plan_paged(self, col0: int, q_len: int, pads: np.ndarray, padded) -> PagedStep:
        device = self.store.kv.device
        columns = col0 + q_len
        lens = np.maximum(columns - pads, 0)
        tables = torch.from_numpy(self._tables()).to(device)
        seq_lens = torch.from_numpy(lens.astype(np.int32)).to(device)
        batch = len(lens)
        if q_len == 1:
            starts = index = None
        else:
            real = np.minimum(q_len, lens)
            starts = torch.from_numpy(np.concatenate([[0], np.cumsum(real)]).astype(np.int32)).to(device)
            index = None
            if (real < q_len).any():
                index = torch.from_numpy(np.concatenate(
                    [np.arange(b * q_len + q_len - r, (b + 1) * q_len) for b, r in enumerate(real)])).to(device)
        return PagedStep(store=self.store.kv, block_tables=tables, seq_lens=seq_lens, query_start_loc=starts,
                         query_index=index, batch=batch, q_len=q_len, kv_columns=columns, impl=self.store.impl,
                         max_seq_len=int(lens.max()) if batch else 0)

    def _end_forward(self, module) -> None:
        fwd = self._forward
        if fwd is None:
            return
        num_layers = len(self.layers)
        if len(fwd.layers_done) != num_layers:
            self._broken = f"only {len(fwd.layers_done)} of {num_layers} layers wrote their KV in a forward"
            raise RuntimeError(f"PrefixKVCache: {self._broken}")
        if fwd.paged is not None and fwd.paged.consumed != fwd.injected:
            self._broken = (f"{fwd.injected - fwd.paged.consumed} layer(s) did not run the {PAGED_ATTENTION} "
                            f"attention in paged mode; their output is wrong")
            raise RuntimeError(f"PrefixKVCache: {self._broken}")
        size = self.store.block_size
        pending = self.store.pending
        manager = self.store.manager
        for row, end in zip(self._rows, fwd.new_written):
            first = max(row.own_start, row.written) // size
            last = end // size
            if last > first:
                table = manager.block_ids(row.seq)
                pending.difference_update(table[first:last])
            row.written = max(row.written, end)
        self._columns = fwd.col0 + fwd.q_len
        self._forward = None
        self.store.write_back()     # blocks this forward completed go to the remote tier (queued)


# -- helpers ---------------------------------------------------------------------------
def _attn_implementation(model) -> str | None:
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if isinstance(impl, dict):
        impl = impl.get("text_config", impl.get("", None))
    return impl


def _index_list(indices) -> list[int]:
    if isinstance(indices, torch.Tensor):
        return [int(i) for i in indices.reshape(-1).tolist()]
    return [int(i) for i in indices]


def _as_batch(input_ids, attention_mask, pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() == 1:
            input_ids = input_ids[None]
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                attention_mask = torch.as_tensor(attention_mask)
            if attention_mask.dim() == 1:
                attention_mask = attention_mask[None]
            if attention_mask.shape != input_ids.shape:
                raise ValueError(f"attention_mask {tuple(attention_mask.shape)} does not match input_ids "
                                 f"{tuple(input_ids.shape)}; prepare() needs the full prompt")
        return input_ids, attention_mask
    if attention_mask is not None:
        raise ValueError("give attention_mask only with a padded input_ids tensor")
    prompts = [list(map(int, p)) for p in input_ids]
    if not prompts or not all(prompts):
        raise ValueError("prepare() needs at least one non-empty prompt")
    width = max(map(len, prompts))
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, p in enumerate(prompts):
        ids[b, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[b, width - len(p):] = 1
    return ids.to(device), mask.to(device)


def _left_padding(attention_mask: torch.Tensor | None, shape) -> list[int]:
    batch, width = shape
    if attention_mask is None:
        return [0] * batch
    mask = attention_mask.to(device="cpu", dtype=torch.bool).numpy()
    pads = (~mask).sum(axis=1)
    expect = np.arange(width)[None, :] >= pads[:, None]
    if not np.array_equal(mask, expect):
        raise ValueError("attention_mask must be left padding (zeros then ones on each row); right padding and "
                         "holes are not supported")
    return [int(p) for p in pads]
