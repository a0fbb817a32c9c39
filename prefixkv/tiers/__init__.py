"""Storage tiers below the device pool: where evicted or shared KV blocks live.

Tiers stack: the device pool (``prefixkv.pool.BlockPool``) -> a host tier (in the core:
``prefixkv.host_tier``) -> an optional disk tier -> an optional remote tier, each talking only to
the one above it (``prefixkv.tier_stack``). This package holds the pieces a tier is made of; each
module has one job and states its contract in its docstring:

* ``fingerprint``: what makes two processes' KV bytes interchangeable (weights
  digest, dtype, shapes, block size, tensor parallelism, hash algorithm and
  seed, layout), as one digest that every remote key carries.
* ``block_codec``: one self-describing, checksummed value per block (header +
  all layers' K and V); decoding verifies everything and names the reason
  when a value is refused.
* ``redis_keys``: the key of a block (prefix, format version, fingerprint,
  chained hash) and the Cluster hash tag that keeps a run of consecutive
  blocks of one chain in one slot.
* ``redis_store``: the Redis block store (extra ``[redis]``): probe, fetch with
  verification, put, stats and operator calls; its API contract is there.
* ``redis_net``: URLs, per-node connections without retries, circuit breakers,
  cluster slot routing, one-round-trip sends.
* ``redis_writer``: the store's background thread (bounded write queue, SET NX
  of only the blocks the server lacks, deletion of refused values, breaker probes).
* ``staging``: packing one block out of / into ``KVStore`` pools (torch).
* ``store_tier``: what every tier over a block store does (prefetch into the host tier,
  write-back after a step, keeping what a tier below served); ``disk_tier`` and ``remote`` are
  the two such tiers.
* ``stack``: the one helper the faces build stacks with (``plan_stack``, ``bind_stack``).
* ``disk_store`` (with ``disk_layout``, ``disk_index``, ``disk_writer``, ``disk_reader``,
  ``disk_admin``): the persistent, verified disk block store.
* ``remote``: the remote tier: the Redis store below the host tier, reached through
  it (prefetch stages verified blocks in host memory before admission; write-back
  queues what the device computed after a step).
* ``cli``: ``prefixkv tier stats|clear`` for operators.

Importing this package imports neither redis nor torch; only the ``redis_*``
modules need redis-py and only ``staging`` needs torch.
"""

_LAZY = {"HostTier": "..host_tier", "DiskTier": ".disk_tier", "RemoteTier": ".remote", "StoreTier": ".store_tier",
         "TierStack": "..tier_stack", "plan_stack": ".stack", "bind_stack": ".stack",
         "model_weights_digest": ".fingerprint"}


def __getattr__(name: str):
    """The tier classes by name, imported when first asked for (``DiskTier`` and ``RemoteTier`` need torch)."""
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
