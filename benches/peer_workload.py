#!/usr/bin/env python
"""prefixkv on the peers' workload: the same requests, scheduler loop and probe as
``vllm_blockpool_bench.py`` / ``sglang_radix_bench.py`` (shared/peers), driven
through ``prefixkv.KVCacheManager``.

Run with the project's python:
    .venv/bin/python benches/peer_workload.py [--num-requests 2000] [--json]

The peers' ``workload.py`` is imported by path from ``<repo>/../shared/peers``
(override with the environment variable PREFIXKV_PEERS_DIR).

Adapter (one call of the manager per callback, as a scheduler would make):

  admit : mgr.admit(rid, prompt)       # encode + hash + prefix lookup + allocate;
                                       # returns the hit tokens (block aligned,
                                       # capped at len(prompt)-1 like the peers)
  step  : mgr.append_token(rid, tok)   # one decode token (--decode-step: one
                                       # mgr.decode_step() per scheduler step instead)
  finish: mgr.free(rid)                # blocks stay cached (LRU)

Long-prompt probe: a 32k-token prompt is admitted and freed once (so it is
cached), then timed repeatedly:
  long_hash_ms            : mgr.prompt(tokens) + prompt.block_hashes() (encode + 2048 hashes)
  long_match_ms           : mgr.match(prompt) on the already hashed prompt (lookup only)
  long_hash_plus_match_ms : mgr.match(mgr.prompt(tokens)), timed as one call
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PEERS_ENV = "PREFIXKV_PEERS_DIR"

# Figures of the default workload that every implementation must reproduce.
EXPECTED_DIGEST = "d417d6598d6582f2"
EXPECTED_HIT_TOKENS = 2_039_744


def peers_dir() -> Path | None:
    """The shared peers folder (holding workload.py), or None if it is not there."""
    override = os.environ.get(PEERS_ENV)
    path = Path(override).expanduser() if override else REPO.parent / "shared" / "peers"
    return path.resolve() if (path / "workload.py").is_file() else None


def load_workload(required: bool = True):
    """Import the peers' workload.py by path (standard library only).

    With ``required`` a missing folder exits with a message; otherwise returns None.
    """
    path = peers_dir()
    if path is None:
        if not required:
            return None
        where = os.environ.get(PEERS_ENV) or str(REPO.parent / "shared" / "peers")
        sys.exit(f"peer_workload: no workload.py in {where}; "
                 f"set {PEERS_ENV} to the folder holding the peers' workload.py")
    if "prefixkv_peer_workload" in sys.modules:
        return sys.modules["prefixkv_peer_workload"]
    spec = importlib.util.spec_from_file_location("prefixkv_peer_workload", path / "workload.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


class PrefixKVAdapter:
    """The workload's callbacks over one prefixkv KVCacheManager."""

    def __init__(self, num_blocks: int, block_size: int, hash_algorithm: str = "xxh3_128",
                 policy: str = "lru", index: str = "auto") -> None:
        from prefixkv import KVCacheManager

        self.mgr = KVCacheManager(num_blocks, block_size, hash_seed=0, hash_algorithm=hash_algorithm,
                                  policy=policy, index=index)
        self.block_size = block_size
        self.blocks_acquired = 0
        self.blocks_released = 0

    # --- workload callbacks -------------------------------------------------
    def admit(self, rid, prompt):
        return rid, self.mgr.admit(rid, prompt)

    def step(self, rid, tok):
        self.mgr.append_token(rid, tok)

    def finish(self, rid):
        n = len(self.mgr.block_ids(rid))
        self.blocks_acquired += n
        self.blocks_released += n
        self.mgr.free(rid)

    # --- long prompt probe --------------------------------------------------
    def long_probe(self, tokens, reps: int) -> dict:
        mgr = self.mgr
        _, warm_hit = self.admit("long-warm", tokens)
        self.finish("long-warm")
        pc = time.perf_counter
        hash_t, match_t, both_t = [], [], []
        hit = both_hit = None
        for _ in range(reps):
            t0 = pc()
            prompt = mgr.prompt(tokens)
            prompt.block_hashes()
            t1 = pc()
            m = mgr.match(prompt)
            t2 = pc()
            hash_t.append(t1 - t0)
            match_t.append(t2 - t1)
            hit = m.hit_tokens
        for _ in range(reps):
            t0 = pc()
            m = mgr.match(mgr.prompt(tokens))
            both_t.append(pc() - t0)
            both_hit = m.hit_tokens
        assert hit == both_hit, (hit, both_hit)
        med = _median
        return {
            "prompt_tokens": len(tokens),
            "hit_tokens": hit,
            "hash_ms": round(med(hash_t) * 1e3, 3),
            "match_ms": round(med(match_t) * 1e3, 3),
            "hash_plus_match_ms": round(med(both_t) * 1e3, 3),
        }


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def run_schedule_decode_step(W, reqs, concurrency, ad: PrefixKVAdapter):
    """workload.run_schedule with one mgr.decode_step() per scheduler step
    (same admission/finish order, same tokens), like SGLang's batched decode."""
    from collections import deque

    pc = time.perf_counter
    st = W.RunStats()
    pending = deque(reqs)
    running = []
    decode_step = ad.mgr.decode_step
    t_start = pc()
    while pending or running:
        while pending and len(running) < concurrency:
            r = pending.popleft()
            t0 = pc()
            handle, hit = ad.admit(r.rid, r.prompt)
            st.admit_s += pc() - t0
            st.prompt_tokens += len(r.prompt)
            st.hit_tokens += hit
            running.append([r, handle, 0])
        t0 = pc()
        decode_step([it[1] for it in running], [it[0].output[it[2]] for it in running])
        for it in running:
            it[2] += 1
        st.step_s += pc() - t0
        st.steps += 1
        t0 = pc()
        still = []
        for it in running:
            if it[2] >= len(it[0].output):
                ad.finish(it[1])
                st.requests += 1
            else:
                still.append(it)
        running = still
        st.finish_s += pc() - t0
    st.wall_s = pc() - t_start
    return st


def replay(W, reqs, *, num_blocks, block_size, concurrency, hash_algorithm="xxh3_128",
           decode_step=False, policy="lru", index="auto"):
    """Run the schedule and check the end state; returns (adapter, RunStats)."""
    ad = PrefixKVAdapter(num_blocks, block_size, hash_algorithm, policy, index)
    if decode_step:
        st = run_schedule_decode_step(W, reqs, concurrency, ad)
    else:
        st = W.run_schedule(reqs, concurrency, ad.admit, ad.step, ad.finish)
    ops = W.block_ops(reqs, block_size)
    assert ad.blocks_acquired * 2 == ops, (ad.blocks_acquired, ops)
    stats = ad.mgr.stats()
    assert stats.active_blocks == 0 and stats.sequences == 0, stats
    assert stats.free_blocks == num_blocks, stats
    ad.mgr.check_invariants()
    assert stats.hit_tokens == st.hit_tokens, (stats.hit_tokens, st.hit_tokens)
    return ad, st


def main(argv=None):
    W = load_workload()
    from prefixkv.hashing import HASH_ALGORITHMS

    import prefixkv

    ap = W.add_common_args(argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter))
    ap.add_argument("--hash", default="xxh3_128", choices=sorted(HASH_ALGORITHMS),
                    help="prefixkv hash_algorithm")
    ap.add_argument("--policy", default="lru", help="eviction policy name")
    ap.add_argument("--index", default="auto", choices=("auto", "flat", "dict"), help="the pool's hash index")
    ap.add_argument("--decode-step", action="store_true",
                    help="one mgr.decode_step() per scheduler step instead of append_token per request")
    ap.add_argument("--profile", type=int, nargs="?", const=25, metavar="TOP",
                    help="cProfile the replay (not the probe); print the TOP functions by tottime to stderr")
    args = ap.parse_args(argv)

    reqs = W.make_workload(
        args.seed, args.num_requests, args.num_prefixes, args.prefix_len,
        args.suffix_max, args.decode_steps, args.vocab,
    )
    long_tokens = W.make_long_prompt(args.seed, args.long_prompt_len, args.vocab)

    replay_args = dict(num_blocks=args.num_blocks, block_size=args.block_size, concurrency=args.concurrency,
                       hash_algorithm=args.hash, decode_step=args.decode_step, policy=args.policy,
                       index=args.index)
    if args.profile:
        import cProfile
        import pstats

        profiler = cProfile.Profile()
        ad, st = profiler.runcall(replay, W, reqs, **replay_args)
        print(f"profile of the replay ({args.num_requests} requests; timings below are inflated by the "
              f"profiler):", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(args.profile)
    else:
        ad, st = replay(W, reqs, **replay_args)
    stats = ad.mgr.stats()
    st.extra = {
        "decode_mode": "decode_step" if args.decode_step else "append_token",
        "free_blocks_after": stats.free_blocks,
        "active_blocks_after": stats.active_blocks,
        "evictions": stats.evictions,
    }
    long = ad.long_probe(long_tokens, args.long_prompt_reps)
    ad.mgr.check_invariants()
    out = W.summarize(f"prefixkv-{prefixkv.__version__}-KVCacheManager", st, reqs, args.block_size, long)
    out["hash"] = args.hash
    out["workload_digest"] = W.workload_digest(reqs)
    out["config"] = {k: getattr(args, k) for k in W.DEFAULTS}

    # The default workload has known figures; any implementation must reproduce them.
    workload_keys = ("seed", "num_requests", "num_prefixes", "prefix_len", "suffix_max",
                     "decode_steps", "vocab")
    if all(getattr(args, k) == W.DEFAULTS[k] for k in workload_keys):
        assert out["workload_digest"] == EXPECTED_DIGEST, out["workload_digest"]
        if args.block_size == W.DEFAULTS["block_size"] and args.num_blocks >= W.DEFAULTS["num_blocks"] \
                and args.concurrency == W.DEFAULTS["concurrency"]:
            assert out["hit_tokens"] == EXPECTED_HIT_TOKENS, out["hit_tokens"]
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>24}: {v}")
    return out


if __name__ == "__main__":
    main()
