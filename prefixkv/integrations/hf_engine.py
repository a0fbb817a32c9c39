"""Run a Hugging Face decoder-only model in prefixkv's packed engine.

>>> from transformers import LlamaConfig, LlamaForCausalLM            # doctest: +SKIP
>>> from prefixkv.engine import Engine                                # doctest: +SKIP
>>> from prefixkv.integrations.hf_engine import HFEngineModel         # doctest: +SKIP
>>> hf = LlamaForCausalLM(LlamaConfig(...)).eval()                    # doctest: +SKIP
>>> engine = Engine.from_model(HFEngineModel(hf), num_blocks=256, block_size=16)   # doctest: +SKIP
>>> engine.generate([[1, 2, 3], [1, 2, 4]], max_new_tokens=8)         # doctest: +SKIP

``HFEngineModel`` exposes the model interface ``Engine.from_model`` needs
(``config.kv_spec()``, ``device``, ``forward(ids, positions, attention)``,
``logits(hidden)``). Each engine step is one call of the HF *base* model
(``LlamaModel``, ``Qwen2Model``, ``MistralModel``, ...) on the packed flat row:
``input_ids [1, T]`` and ``position_ids [1, T]`` (each token's own position,
so RoPE rotates every request's tokens at their positions), ``use_cache=False``,
and the engine's attention backend under the keyword ``ENGINE_KWARG``.
transformers forwards unknown keyword arguments from the base model through
every decoder layer to the attention function, which is how the backend reaches
it.

``register()`` (run on import) adds, under ``ENGINE_ATTENTION``
(``"prefixkv_engine"``):

* ``AttentionInterface``: ``engine_attention_forward``. With a backend in its
  kwargs it takes the layer from ``module.layer_idx``, writes that layer's new
  K/V through the backend's slot mapping into the ``KVStore`` and runs
  ``prefixkv.kv.attention.paged_attention`` over the block tables with
  ``query_start_loc``: causal inside each request's new tokens, over its cached
  prefix, never across requests. Without a backend (a plain ``model.generate``
  on the same model) it is transformers' SDPA attention, so switching a model
  to ``prefixkv_engine`` leaves its ordinary use unchanged.
* ``AttentionMaskInterface``: ``engine_mask``. During an engine forward it
  returns ``None`` at once: no dense ``[T, T]`` mask is built for the packed row
  (the block tables and ``query_start_loc`` are the mask). Outside one it is
  transformers' ``sdpa_mask``, which the SDPA fallback needs (a ``None`` mask
  with a cached prefix would silently truncate it).

Supported: decoder-only models whose attention modules call the registered
attention function with ``(module, query, key, value, attention_mask, scaling=...)``
and carry ``layer_idx`` (Llama, Mistral, Qwen2, GPT-2, OPT and the many models
built the same way). A sliding window, or Llama 4's attention chunk, is accepted only while no
sequence outgrows it (then it masks nothing); softcapping, attention sinks and
the like are refused, and so are layers that are not attention (convolutions,
state-space mixers: ``layer_types``). The LM head's logits get the model's own
post-processing (Cohere's ``logit_scale``, Granite's ``logits_scaling``,
Gemma's final softcapping), so sampled tokens follow the model's distribution.

Refused: models whose attention modules compute attention inline and never call
the registered attention function (transformers marks them
``_supports_attention_backend = False``: Falcon, Bloom, ...): the KV pool would
never be written and the output would be silently wrong. ``HFEngineModel``
refuses them up front, and every engine forward checks that each decoder layer
ran ``engine_attention_forward`` exactly once (else ``RuntimeError`` naming the
architecture). ALiBi models (Bloom, MPT, Falcon with ``alibi=True``) are refused
too: the paged kernels have no ALiBi bias.
"""

from __future__ import annotations

import contextlib
import contextvars

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from prefixkv.kv.attention import paged_attention
from prefixkv.sizing import KVSpec

from .hf_paged import ALIBI_REASON, alibi_of, attention_backend_problem, check_text_only, kv_heads_of

__all__ = ["ENGINE_ATTENTION", "ENGINE_KWARG", "HFEngineConfig", "HFEngineModel", "engine_attention_forward",
           "engine_mask", "engine_from_hf", "register"]

ENGINE_ATTENTION = "prefixkv_engine"
ENGINE_KWARG = "prefixkv_engine_backend"

_UNSUPPORTED_KWARGS = ("softcap", "s_aux", "sinks", "position_bias")
_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}

# True while an HFEngineModel forward runs in this context: the mask function skips the mask.
_in_engine_forward: contextvars.ContextVar[bool] = contextvars.ContextVar("prefixkv_engine_forward", default=False)


# The layers whose attention ran through the engine attention in the current engine forward.
_engine_layers: contextvars.ContextVar[list | None] = contextvars.ContextVar("prefixkv_engine_layers", default=None)


@contextlib.contextmanager
def _engine_forward():
    token = _in_engine_forward.set(True)
    layers: list[int] = []
    layers_token = _engine_layers.set(layers)
    try:
        yield layers
    finally:
        _engine_layers.reset(layers_token)
        _in_engine_forward.reset(token)


def engine_mask(*args, **kwargs):
    """Mask function for ``ENGINE_ATTENTION``: ``None`` during an engine forward (paged attention
    masks through the block tables and ``query_start_loc``), ``sdpa_mask`` otherwise."""
    if _in_engine_forward.get():
        return None
    return sdpa_mask(*args, **kwargs)


def engine_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, scaling: float | None = None,
                             dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    """transformers attention-function signature. ``query [1, Hq, T, d]``, ``key``/``value``
    ``[1, Hkv, T, d]`` (rotary applied) -> ``(attn_output [1, T, Hq, d], None)``."""
    backend = kwargs.pop(ENGINE_KWARG, None)
    if backend is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(f"{ENGINE_ATTENTION} does not support the attention argument {name!r}")
    if dropout and module.training:
        raise ValueError(f"{ENGINE_ATTENTION} is for inference; attention dropout is not supported")
    if kwargs.get("output_attentions"):
        raise ValueError(f"{ENGINE_ATTENTION} cannot return attention weights")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise RuntimeError(f"{ENGINE_ATTENTION}: {type(module).__name__} has no layer_idx; cannot find its KV pool")
    batch = query.shape[0]
    if batch != 1:
        raise RuntimeError(f"{ENGINE_ATTENTION}: the engine packs every request into one row; got batch {batch}")
    window = kwargs.get("sliding_window")
    if window is not None and int(backend.seq_lens.max()) > int(window):
        raise NotImplementedError(f"{ENGINE_ATTENTION}: a sequence of {int(backend.seq_lens.max())} tokens outgrows "
                                  f"the sliding window ({window}); sliding-window paged attention is not implemented")
    seen = _engine_layers.get()
    if seen is not None:
        seen.append(int(layer))
    q = query[0].transpose(0, 1)                       # [T, Hq, d]
    k = key[0].transpose(0, 1).contiguous()            # [T, Hkv, d]
    v = value[0].transpose(0, 1).contiguous()
    store = backend.kv_store
    store.write(layer, backend.slot_mapping, k, v)
    out = paged_attention(q.contiguous(), store, layer, backend.block_tables, backend.seq_lens, scaling,
                          query_start_loc=backend.query_start_loc, impl=backend.impl)
    return out.unsqueeze(0), None


def register(name: str = ENGINE_ATTENTION) -> str:
    """Register the engine attention and its mask function under ``name`` (idempotent)."""
    AttentionInterface.register(name, engine_attention_forward)
    AttentionMaskInterface.register(name, engine_mask)
    return name


register()


class HFEngineConfig:
    """The engine-facing config: ``kv_spec()`` from the HF config and the model's dtype."""

    def __init__(self, hf_config, dtype: torch.dtype) -> None:
        self.hf_config = hf_config
        check_text_only(hf_config)
        if alibi_of(hf_config):
            raise ValueError(f"{getattr(hf_config, 'model_type', None) or type(hf_config).__name__} uses ALiBi "
                             f"attention biases, which the engine does not support: {ALIBI_REASON}")
        heads = hf_config.num_attention_heads
        self.num_layers = int(hf_config.num_hidden_layers)
        self.num_heads = int(heads)
        self.num_kv_heads = kv_heads_of(hf_config)
        self.head_dim = int(getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads)
        self.vocab_size = int(hf_config.vocab_size)
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"the engine's KV store holds float32, float16 or bfloat16, not {dtype}")
        self.dtype = _DTYPE_NAMES[dtype]

    def kv_spec(self) -> KVSpec:
        return KVSpec(layers=self.num_layers, kv_heads=self.num_kv_heads, head_dim=self.head_dim, dtype=self.dtype)

    def __repr__(self) -> str:
        return (f"HFEngineConfig({type(self.hf_config).__name__}, layers={self.num_layers}, heads={self.num_heads}, "
                f"kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, dtype={self.dtype})")


def _base_model(model: torch.nn.Module):
    """The decoder stack under a ``*ForCausalLM`` (hidden states out, no LM head), or None.

    ``get_decoder()`` falls back to the model itself when ``base_model_prefix`` names no attribute
    (``Llama4ForCausalLM``: prefix ``language_model``, stack in ``model``); calling that whole model
    returned logits, not hidden states, and the first engine step died on an AttributeError."""
    candidates = []
    if hasattr(model, "get_decoder"):
        candidates.append(model.get_decoder())
    candidates += [getattr(model, getattr(model, "base_model_prefix", "") or "model", None),
                   getattr(model, "model", None), getattr(model, "transformer", None)]
    for base in candidates:
        if isinstance(base, torch.nn.Module) and base is not model:
            return base
    return None


# Architectures whose ``*ForCausalLM`` scales the LM head's logits by ``config.logits_scaling``
# (transformers 5.24): Granite and its variants divide by it, HyperCLOVA X multiplies.
_LOGITS_SCALING = {"granite": "divide", "granite_swa": "divide", "granitemoe": "divide",
                   "granitemoe_swa": "divide", "granitemoehybrid": "divide", "granitemoeshared": "divide",
                   "hyperclovax": "multiply"}


def _logits_scale(hf_config) -> float | None:
    """The factor the model's own forward multiplies the LM head's logits by (None: 1)."""
    scale = getattr(hf_config, "logit_scale", None)          # Cohere: logits * logit_scale
    scaling = getattr(hf_config, "logits_scaling", None)
    if scaling is not None and float(scaling) != 1.0:
        model_type = getattr(hf_config, "model_type", None)
        how = _LOGITS_SCALING.get(model_type)
        if how is None:
            raise ValueError(f"{model_type or type(hf_config).__name__} has logits_scaling={scaling}, and "
                             f"HFEngineModel does not know whether its forward multiplies or divides the "
                             f"logits by it; sampled tokens would not be the model's")
        factor = 1.0 / float(scaling) if how == "divide" else float(scaling)
        scale = factor if scale is None else float(scale) * factor
    return scale


def _sliding_window(hf_config) -> int | None:
    """The sliding window of any of the model's layers (None: every layer sees its whole history)."""
    window = getattr(hf_config, "sliding_window", None)
    if not window:                       # None, or 0 (Qwen2-MoE without use_sliding_window)
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if getattr(hf_config, "use_sliding_window", True) is False:
        return None
    return int(window)


def _attention_chunk(hf_config) -> int | None:
    """The attention chunk of a model with chunked-attention layers (Llama 4), else None."""
    chunk = getattr(hf_config, "attention_chunk_size", None)
    if chunk is None:
        return None
    layer_types = getattr(hf_config, "layer_types", None)
    if layer_types is not None and "chunked_attention" not in layer_types:
        return None
    return int(chunk)


class HFEngineModel:
    """A Hugging Face ``*ForCausalLM`` behind the engine's model interface.

    Switches ``model`` to ``attn_implementation="prefixkv_engine"`` (pass
    ``set_attention=False`` if you did it yourself); outside the engine that
    implementation is SDPA, so ``model.generate`` keeps working on the same
    object. The model is put in eval mode.
    """

    def __init__(self, model: torch.nn.Module, *, set_attention: bool = True) -> None:
        hf_config = model.config
        if getattr(hf_config, "is_encoder_decoder", False):
            raise ValueError("HFEngineModel runs decoder-only models; this one is encoder-decoder")
        problem = attention_backend_problem(model)
        if problem is not None:
            raise ValueError(f"HFEngineModel cannot run {type(model).__name__}: {problem}, so the engine's KV "
                             f"pool would never be written and the output would be wrong")
        base = _base_model(model)
        head = model.get_output_embeddings()
        if base is None or head is None:
            raise ValueError(f"{type(model).__name__} has no base model and output embeddings "
                             "(need a *ForCausalLM model)")
        config = HFEngineConfig(hf_config, next(model.parameters()).dtype)  # refuses before changing the model
        logits_scale = _logits_scale(hf_config)
        layer_types = getattr(hf_config, "layer_types", None) or ()
        other = sorted(set(layer_types) - {"full_attention", "sliding_attention", "chunked_attention"})
        if other:
            raise ValueError(f"HFEngineModel runs attention layers only; {type(model).__name__} has layer types "
                             f"{other}, whose state the engine's KV pool does not hold")
        if set_attention:
            model.set_attn_implementation(ENGINE_ATTENTION)
        elif hf_config._attn_implementation != ENGINE_ATTENTION:
            raise ValueError(f"the model's attention is {hf_config._attn_implementation!r}; "
                             f"call model.set_attn_implementation({ENGINE_ATTENTION!r}) or pass set_attention=True")
        model.eval()
        self.hf_model = model
        self.base = base
        self.lm_head = head
        self.config = config
        self._arch = type(model).__name__
        self._logit_scale = logits_scale
        self._softcap = getattr(hf_config, "final_logit_softcapping", None)
        self._chunk = _attention_chunk(hf_config)
        self._window = _sliding_window(hf_config)

    @property
    def device(self) -> torch.device:
        return next(self.hf_model.parameters()).device

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, attention) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` of the packed row; ``attention`` is the engine's
        ``PagedAttentionBackend`` (``kv_store``, ``slot_mapping``, ``block_tables``, ``seq_lens``,
        ``query_start_loc``, ``impl``)."""
        longest = int(attention.seq_lens.max()) if len(attention.seq_lens) else 0
        if self._window is not None and longest > self._window:
            # Checked here, not only in the attention function: some models (Qwen2-MoE, PhiMoE) apply
            # their window through the mask alone and never pass ``sliding_window`` to it.
            raise NotImplementedError(
                f"{ENGINE_ATTENTION}: a sequence of {longest} tokens outgrows {self._arch}'s sliding window "
                f"({self._window}); sliding-window paged attention is not implemented")
        if self._chunk is not None:
            if longest > self._chunk:
                raise NotImplementedError(
                    f"{ENGINE_ATTENTION}: a sequence of {longest} tokens outgrows {self._arch}'s attention chunk "
                    f"({self._chunk} tokens); chunked paged attention is not implemented (its layers would "
                    f"attend across chunks)")
        with _engine_forward() as layers:
            out = self.base(input_ids=token_ids.reshape(1, -1), position_ids=positions.reshape(1, -1),
                            use_cache=False, **{ENGINE_KWARG: attention})
        if sorted(layers) != list(range(self.config.num_layers)):
            missing = sorted(set(range(self.config.num_layers)) - set(layers))
            raise RuntimeError(
                f"{self._arch}: in an engine forward, layer(s) {missing or sorted(layers)} did not run the "
                f"{ENGINE_ATTENTION!r} attention exactly once ({len(layers)} call(s) for "
                f"{self.config.num_layers} layers): their attention bypassed the engine's KV pool, so the output "
                f"would be wrong. {self._arch} is not supported by HFEngineModel (its attention modules must call "
                f"the registered attention function)")
        return out.last_hidden_state[0]

    __call__ = forward

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head(hidden)
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits.float()


def engine_from_hf(model: torch.nn.Module, **engine_kwargs):
    """``Engine.from_model(HFEngineModel(model), **engine_kwargs)``."""
    from prefixkv.engine import Engine

    return Engine.from_model(HFEngineModel(model), **engine_kwargs)
