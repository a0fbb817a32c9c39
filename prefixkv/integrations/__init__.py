"""Integrations of prefixkv with generation libraries.

* ``prefixkv.integrations.hf`` (extra ``hf``): a Hugging Face transformers
  ``Cache`` whose K/V live in prefixkv's paged pool, with prefix caching across
  ``generate`` calls and an optional registered paged attention
  (``attn_implementation="prefixkv_paged"``).

Nothing is imported here, so ``import prefixkv.integrations`` needs neither
torch nor transformers; import the submodule you use.
"""
