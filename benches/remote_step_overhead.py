"""What the remote tier costs a step, up and down, and how fast it recovers (issue 14, point 2).

    .venv/bin/python benches/remote_step_overhead.py [--repeat 3] [--json]

Starts its own redis-server on 127.0.0.1 (a free port, no persistence, 256 MiB allkeys-lru) and
runs the tiny engine (8 prompts of 552 tokens sharing a 512-token prefix; 40 device blocks of 16,
so no two requests fit together) with and without the tier:

* ``up``: the tier on an empty server (every prompt probes and misses, every computed block is
  packed and queued), so the schedule equals the run without the tier step for step and the
  per-step difference is the tier's own cost;
* ``killed``: the server killed after step 3 (the remaining steps run with the breaker open);
* ``hung``: the server SIGSTOPped after step 3 (the first call to meet it waits one socket
  timeout, then the breaker is open);
* ``resume``: after a kill, the server restarted empty: seconds until the first write is stored;
* ``hits``: the tier on a server that holds the prefix (a second replica's run).

Per setting it prints the largest per-step difference against the same step without the tier
(the minimum over ``--repeat`` runs of each step, so CPU noise from other processes does not
count) and the slowest single tier call. Targets: no step more than 250 ms slower, a tier call
within 250 ms while hung, writes again within 6 s of a restart.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import torch  # noqa: E402

from prefixkv.engine import Engine, SchedulerConfig, TinyLlama, TinyLlamaConfig  # noqa: E402
from prefixkv.tiers.redis_store import RedisStoreConfig  # noqa: E402
from redis_fixtures import RedisServer  # noqa: E402

CONFIG = RedisStoreConfig()        # the defaults: 0.2 s timeouts, breaker probe every 2 s


def prompts(n=8, seed=0, prefix=512):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(prefix)]
    return [shared + [rng.randrange(3, 256) for _ in range(40)] for _ in range(n)]


def make_engine(model, url=None):
    return Engine.from_model(model, num_blocks=40, block_size=16, remote=url, remote_config=CONFIG,
                             config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=2))


def timed_run(model, url=None, event=None, ps=None):
    """Per-step seconds, outputs and the tier's stats; ``event(step)`` runs before each step."""
    e = make_engine(model, url)
    ids = [e.add_request(p, max_new_tokens=6) for p in (ps or prompts())]
    times, n = [], 0
    while e.has_unfinished:
        if event is not None:
            event(n)
        t0 = time.perf_counter()
        e.step()
        times.append(time.perf_counter() - t0)
        n += 1
    stats = e.remote.stats() if e.remote is not None else {}
    outputs = [e.requests[i].output for i in ids]
    e.tiers.close(flush_timeout_s=2.0)
    e._remote_step = None
    return times, outputs, stats


def stepwise_min(runs):
    return [min(r[i] for r in runs) for i in range(min(map(len, runs)))]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = TinyLlama(TinyLlamaConfig(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                                      vocab_size=256))
    timed_run(model)                                            # warm-up
    out = {}
    with TemporaryDirectory() as tmp:
        server = RedisServer(Path(tmp)).start()
        try:
            base_runs, up_runs, up_stats = [], [], []
            for _ in range(args.repeat):
                times, reference, _ = timed_run(model)
                base_runs.append(times)
                server.command("FLUSHALL")
                times, got, stats = timed_run(model, server.url)
                assert got == reference
                up_runs.append(times)
                up_stats.append(stats)
            base = stepwise_min(base_runs)
            out["steps"] = len(base)
            out["step_ms_without_tier"] = {"max": 1e3 * max(base), "mean": 1e3 * sum(base) / len(base)}
            up = stepwise_min(up_runs)
            out["up"] = {"max_step_delta_ms": 1e3 * max(u - b for u, b in zip(up, base)),
                         "mean_step_delta_ms": 1e3 * sum(u - b for u, b in zip(up, base)) / len(base),
                         "slowest_prefetch_ms": 1e3 * min(s["slowest_prefetch_s"] for s in up_stats),
                         "slowest_write_back_ms": 1e3 * min(s["slowest_write_back_s"] for s in up_stats)}
            # a second replica's run: the prefix comes from the server
            times, got, stats = timed_run(model, server.url)
            assert got == reference
            out["hits"] = {"run_s": sum(times), "run_s_without_tier": sum(base), "staged_blocks": stats["staged_blocks"],
                           "slowest_prefetch_ms": 1e3 * stats["slowest_prefetch_s"]}
            for kind in ("killed", "hung"):
                runs, worst = [], {"prefetch": 0.0, "write_back": 0.0}
                for _ in range(args.repeat):
                    if server.proc.poll() is not None:
                        server.start()
                    server.command("FLUSHALL")
                    action = server.stop if kind == "killed" else server.pause
                    try:
                        times, got, stats = timed_run(model, server.url, lambda n: action() if n == 3 else None)
                    finally:
                        if kind == "hung":
                            server.resume()
                    assert got == reference
                    runs.append(times)
                    worst["prefetch"] = max(worst["prefetch"], stats["slowest_prefetch_s"])
                    worst["write_back"] = max(worst["write_back"], stats["slowest_write_back_s"])
                steps = stepwise_min(runs)
                worst_run = max(max(u - b for u, b in zip(r, base)) for r in runs)
                out[kind] = {"max_step_delta_ms": 1e3 * max(u - b for u, b in zip(steps, base)),
                             "max_step_delta_worst_run_ms": 1e3 * worst_run,
                             "slowest_prefetch_ms": 1e3 * worst["prefetch"],
                             "slowest_write_back_ms": 1e3 * worst["write_back"]}
            # writes resume after a restart
            if server.proc.poll() is not None:
                server.start()
            e = make_engine(model, server.url)
            e.generate(prompts(1, seed=1, prefix=64), max_new_tokens=1)
            server.stop()
            e.generate(prompts(1, seed=2, prefix=64), max_new_tokens=1)     # meets the dead server
            server.start()
            writes = e.remote.stats()["store_writes"]
            t0 = time.monotonic()
            k = 0
            while time.monotonic() - t0 < 30:
                k += 1
                e.generate(prompts(1, seed=100 + k, prefix=64), max_new_tokens=1)
                e.remote.flush(1.0)
                if e.remote.stats()["store_writes"] > writes:
                    break
                time.sleep(0.05)
            out["resume_s"] = time.monotonic() - t0
            out["resume_probe_interval_s"] = CONFIG.probe_interval_s
            e.close()
        finally:
            server.stop()
    if args.json:
        print(json.dumps(out))
    else:
        print(f"remote tier step overhead, tiny engine, {out['steps']} steps; without the tier: max step "
              f"{out['step_ms_without_tier']['max']:.1f} ms, mean {out['step_ms_without_tier']['mean']:.1f} ms")
        for kind in ("up", "killed", "hung"):
            r = out[kind]
            print(f"  {kind:<7} max step delta {r['max_step_delta_ms']:7.1f} ms; slowest prefetch "
                  f"{r['slowest_prefetch_ms']:6.1f} ms, write-back {r['slowest_write_back_ms']:6.1f} ms"
                  + (f"; worst single run {r['max_step_delta_worst_run_ms']:.1f} ms"
                     if "max_step_delta_worst_run_ms" in r else ""))
        h = out["hits"]
        print(f"  hits    run {h['run_s'] * 1e3:.0f} ms vs {h['run_s_without_tier'] * 1e3:.0f} ms without the tier, "
              f"{h['staged_blocks']} blocks loaded, slowest prefetch {h['slowest_prefetch_ms']:.1f} ms")
        print(f"  writes resumed {out['resume_s']:.2f} s after a restart (breaker probe every "
              f"{out['resume_probe_interval_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
