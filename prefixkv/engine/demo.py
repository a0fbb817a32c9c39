"""``prefixkv generate``: a tiny random-weight Llama through the engine, prefix cache on and off.

The prompts share a system prompt (UTF-8 bytes are the token ids of the
byte-level vocabulary), so with the prefix cache on every request after the
first skips its prefill. Both runs use the same model, pool, budget and
prompts; their outputs must be identical (they are printed as a check, not as
text: the weights are random).

With ``--remote URL`` the server is contacted first (one PING per node): a server that cannot be
used (refused connection, a password wanted or refused, not Redis, a timeout) is named on stderr
and in the JSON (``remote_contact``), and the run goes on without its hits. The warm-up does not
use the remote tier, and the cache-on figures are one run against the server as found: a repeat
would read back what the earlier cache-on runs of this command wrote, which is reuse the
command made itself, not reuse the server offered. ``--disk PATH`` (a persistent disk tier,
``--disk-bytes`` of blocks) is measured the same way: one cache-on run against the directory as
found, so a second ``generate --disk`` on the same directory shows what a restart gets back.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

SYSTEM_PROMPT = (
    "You are the on-call assistant for a paged KV-cache library. Answer in one short paragraph, "
    "name the exact function or command to use, never invent an option, and say so when a "
    "question is outside the library.\n\n"
)

QUESTIONS = [
    "User: How many blocks does a 4,097-token request take at block size 16?",
    "User: Why did my request wait even though the pool is only 70% used?",
    "User: What happens to cached blocks when a request is cancelled?",
    "User: Should I swap or recompute a preempted 4,000-token request?",
    "User: How do I share a system prompt between tenants safely?",
    "User: What does copy-on-write do when two sequences share a tail block?",
    "User: Which eviction policy should I start with?",
    "User: How do I check that no block leaks after a run?",
    "User: What is tail waste and how do I measure it?",
    "User: Can two requests read the same physical block at once?",
    "User: Why must the capacity check happen before publishing block tables?",
    "User: How does the prefix cache hash a block?",
]


def demo_prompts(n: int) -> list[list[int]]:
    """``n`` prompts: the shared system prompt plus one question each (cycling), as byte ids."""
    return [list((SYSTEM_PROMPT + QUESTIONS[i % len(QUESTIONS)] + f" (#{i})\nAssistant:").encode())
            for i in range(n)]


def _run(model, prompts, args, caching: bool):
    from .engine import Engine
    from .metrics import WallClock
    from .request import SamplingParams
    from .scheduler import SchedulerConfig

    remote = getattr(args, "remote", None) if caching else None
    disk = getattr(args, "disk", None) if caching else None
    engine = Engine.from_model(
        model, num_blocks=args.num_blocks, block_size=args.block_size, enable_caching=caching,
        config=SchedulerConfig(max_num_batched_tokens=args.budget, max_num_seqs=args.max_seqs),
        clock=WallClock(), seed=args.seed, remote=remote, disk=disk,
        disk_bytes=getattr(args, "disk_bytes", None) if disk else None)
    # No per-request seed: each request gets its own stream from the engine's seed.
    sampling = SamplingParams(temperature=args.temperature)
    try:
        start = time.perf_counter()
        outputs = engine.generate(prompts, max_new_tokens=args.max_new_tokens, sampling=sampling)
        wall = time.perf_counter() - start
        engine.manager.check_invariants()
        summary = engine.summary(wall_s=wall)
        summary["prefill_tokens_saved"] = summary["prefix_hit_tokens"]
        if engine.remote is not None:
            stats = engine.remote.stats()
            summary["remote"] = {k: stats[k] for k in ("url", "fingerprint", "staged_blocks", "queued_blocks",
                                                       "store_rejected", "store_nodes_down", "store_node_errors",
                                                       "store_dropped_full")}
            summary["remote"]["host_hit_tokens"] = engine.manager.stats().host_hit_tokens
        if engine.disk is not None:
            engine.disk.flush()
            stats = engine.disk.stats()
            summary["disk"] = {k: stats[k] for k in ("path", "fingerprint", "staged_blocks", "queued_blocks",
                                                     "kept_from_below", "store_rejected", "store_writes",
                                                     "store_dropped", "store_evictions", "store_used_bytes",
                                                     "store_capacity_bytes", "store_open_s")}
    finally:
        engine.close()          # flushes the remote tier's queued writes (bounded)
    return outputs, summary


def contact_remote(url: str) -> dict:
    """One PING per node of the remote tier at ``url``, with the engine's own timeouts: ``{"url":
    masked, "nodes": {node: None | why not}, "ok": every node answered}``."""
    from ..tiers.cli import _operator_store, shown_url
    from ..tiers.redis_store import RedisStoreConfig

    config = RedisStoreConfig()
    with _operator_store(url, config.socket_timeout_s) as store:
        nodes = store.ping()
    return {"url": shown_url(url), "nodes": nodes, "ok": all(why is None for why in nodes.values())}


def run_demo(args) -> dict:
    import torch

    from .model import TinyLlama, TinyLlamaConfig

    contact = None
    if getattr(args, "remote", None):
        contact = contact_remote(args.remote)
        for node, why in contact["nodes"].items():
            if why is not None:
                print(f"prefixkv generate: warning: remote tier {contact['url']}: {node}: {why}; the cache-on runs "
                      f"go on without it", file=sys.stderr, flush=True)
    torch.set_num_threads(args.threads)
    config = TinyLlamaConfig(hidden_size=args.hidden_size, intermediate_size=2 * args.hidden_size,
                             num_layers=args.layers, num_heads=args.heads, num_kv_heads=args.kv_heads,
                             head_dim=args.hidden_size // args.heads, seed=args.seed)
    model = TinyLlama(config)
    prompts = demo_prompts(args.requests)
    # warm-up (never a disk or remote tier: what it wrote would be read back as hits by the runs below)
    _run(model, prompts[:2], argparse.Namespace(**{**vars(args), "max_new_tokens": 2, "remote": None,
                                                   "disk": None}), True)
    stored = contact is not None or getattr(args, "disk", None) is not None
    runs: dict = {}
    for i in range(args.repeat):            # alternate, so load changes hit both settings alike
        for caching in (True, False):
            if caching and stored and i:
                continue        # one cache-on run against the tiers as found (module docs)
            outputs, summary = _run(model, prompts, args, caching)
            if caching not in runs or summary["seconds"] < runs[caching][1]["seconds"]:
                runs[caching] = (outputs, summary)
    (out_on, on), (out_off, off) = runs[True], runs[False]
    shared = len(SYSTEM_PROMPT.encode())
    return {
        "model": {"layers": config.num_layers, "hidden_size": config.hidden_size, "heads": config.num_heads,
                  "kv_heads": config.num_kv_heads, "vocab_size": config.vocab_size, "seed": config.seed,
                  "weights": "random"},
        "requests": len(prompts), "system_prompt_tokens": shared,
        "prompt_tokens": [len(p) for p in prompts], "max_new_tokens": args.max_new_tokens,
        "block_size": args.block_size, "num_blocks": args.num_blocks, "budget": args.budget,
        "max_seqs": args.max_seqs, "temperature": args.temperature,
        "cache_on": on, "cache_off": off,
        "outputs_identical": out_on == out_off,
        "speedup": off["seconds"] / on["seconds"] if on["seconds"] else None,
        **({"remote_contact": contact} if contact is not None else {}),
        **({"cache_on_runs": 1,
            "measured": "cache on: one run against the stored tiers as found at start (the warm-up does not "
                        f"use them); cache off: the fastest of {args.repeat} run(s)"} if stored else {}),
    }


def _fmt(value, kind: str) -> str:
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "ms":
        return f"{1e3 * value:.2f}"
    if kind == "s":
        return f"{value:.3f}"
    if kind == "rate":
        return f"{value:,.0f}"
    return f"{value:,}"


def print_report(result: dict) -> None:
    m = result["model"]
    lengths = result["prompt_tokens"]
    from ..console import counted

    span = f"{min(lengths)}" if min(lengths) == max(lengths) else f"{min(lengths)}-{max(lengths)}"
    print(f"prefixkv generate: {counted(result['requests'], 'prompt')} of {span} tokens sharing a "
          f"{result['system_prompt_tokens']}-token system prompt, {result['max_new_tokens']} new tokens each")
    print(f"model: tiny Llama, {m['layers']} layers, hidden {m['hidden_size']}, {m['heads']} heads / "
          f"{m['kv_heads']} KV heads, random weights (seed {m['seed']}); block {result['block_size']}, "
          f"{counted(result['num_blocks'], 'block')}, budget {result['budget']} tokens/step, "
          f"{counted(result['max_seqs'], 'seq')}")
    rows = [
        ("prompt tokens", "prompt_tokens", "int"),
        ("prefill tokens computed", "prefill_tokens_computed", "int"),
        ("prefill tokens saved", "prefill_tokens_saved", "int"),
        ("prefix hit rate", "prefix_hit_rate", "pct"),
        ("output tokens", "output_tokens", "int"),
        ("steps", "steps", "int"),
        ("preemptions", "preemptions", "int"),
        ("wall time (s)", "seconds", "s"),
        ("tokens/s (prompt + output)", "tokens_per_s", "rate"),
        ("output tokens/s", "output_tokens_per_s", "rate"),
        ("TTFT p50 (ms)", "ttft_p50_s", "ms"),
        ("ITL p50 (ms)", "itl_p50_s", "ms"),
    ]
    width = max(len(label) for label, _, _ in rows)
    print(f"{'':<{width}}  {'cache on':>12}  {'cache off':>12}")
    for label, key, kind in rows:
        print(f"{label:<{width}}  {_fmt(result['cache_on'][key], kind):>12}  "
              f"{_fmt(result['cache_off'][key], kind):>12}")
    remote = result["cache_on"].get("remote")
    if remote:
        down = "".join(f"; {node}: {why}" for node, why in remote["store_node_errors"].items())
        print(f"remote tier {remote['url']} (fingerprint {remote['fingerprint']}): "
              f"{remote['staged_blocks']:,} blocks loaded (verified), {remote['queued_blocks']:,} queued for "
              f"writing, {remote['host_hit_tokens']:,} prompt tokens served below the device; refused values "
              f"{remote['store_rejected'] or 'none'}, nodes down {remote['store_nodes_down']}{down}")
    disk = result["cache_on"].get("disk")
    if disk:
        print(f"disk tier {disk['path']} (fingerprint {disk['fingerprint'][:16]}…): {disk['staged_blocks']:,} "
              f"blocks loaded (verified), {disk['store_writes']:,} written, {disk['store_evictions']:,} evicted, "
              f"{disk['store_used_bytes']:,} of {disk['store_capacity_bytes']:,} bytes used; refused values "
              f"{disk['store_rejected'] or 'none'}, writes dropped {disk['store_dropped'] or 'none'}")
    if "measured" in result:
        print(f"measured: {result['measured']}")
    print(f"outputs identical: {'yes' if result['outputs_identical'] else 'NO'}")
    if result["speedup"]:
        print(f"end-to-end speed-up with the prefix cache: {result['speedup']:.2f}x")


# Host bytes per demo request: its prompt ids take 2.4 KB as a Python list (tracemalloc); the
# rest leaves room for the outputs and the engine's request and metrics objects.
BYTES_PER_REQUEST = 16 * 2**10


def model_bytes(args) -> int:
    """Host bytes of the demo model's float32 weights (``TinyLlama``: embedding and LM head, per
    layer the attention and MLP projections and two norms), plus one copy of its largest matrix
    (``torch.randn(...) / sqrt(n)`` makes a temporary the size of each weight it draws)."""
    hidden, heads, kv_heads, layers = args.hidden_size, args.heads, args.kv_heads, args.layers
    head_dim = hidden // heads
    inner = 2 * hidden                   # intermediate_size, as run_demo builds the config
    vocab = 256
    per_layer = (2 * heads + 2 * kv_heads) * head_dim * hidden + 3 * inner * hidden + 2 * hidden
    params = 2 * vocab * hidden + layers * per_layer + hidden
    largest = max(vocab * hidden, inner * hidden, heads * head_dim * hidden)
    return 4 * (params + largest)


def check_memory(args) -> None:
    """Refuse sizes whose model, prompts, requests or KV pool cannot fit in host memory, before
    building any."""
    from ..console import counted
    from ..hostmem import MANAGER_BYTES_PER_BLOCK, require
    from ..sizing import format_size

    head_dim = args.hidden_size // args.heads
    kv_bytes = args.num_blocks * args.block_size * 2 * args.layers * args.kv_heads * head_dim * 4   # float32 K, V
    weights = model_bytes(args)
    require(args.requests * BYTES_PER_REQUEST + kv_bytes + args.num_blocks * MANAGER_BYTES_PER_BLOCK + weights,
            f"{counted(args.requests, 'request')} with a pool of {counted(args.num_blocks, 'block')} and a model of hidden size "
            f"{args.hidden_size:,} x {args.layers:,} layers ({format_size(weights)} of weights)")


def cmd_generate(args) -> int:
    try:
        import torch  # noqa: F401
    except ImportError:
        raise RuntimeError("prefixkv generate needs torch (pip install 'prefixkv[torch]')") from None
    if args.hidden_size % args.heads or args.heads % args.kv_heads:
        raise ValueError("--hidden-size must be a multiple of --heads, and --heads of --kv-heads")
    head_dim = args.hidden_size // args.heads
    if head_dim % 2:
        raise ValueError(f"--hidden-size / --heads is the head dimension, which rotary embeddings need even; "
                         f"got {args.hidden_size} / {args.heads} = {head_dim}")
    temperature = args.temperature
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) \
            or not (math.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"--temperature must be a finite number >= 0, got {temperature!r}")
    check_memory(args)
    result = run_demo(args)
    if args.json:
        print(json.dumps(result))
    else:
        print_report(result)
    return 0 if result["outputs_identical"] else 1
