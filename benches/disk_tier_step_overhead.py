"""What the disk tier costs a step when it serves nothing (issue 26's step-overhead benchmark).

    .venv/bin/python benches/disk_tier_step_overhead.py [--repeat 9] [--layers 4] [--json]

The engine (8 prompts of 552 tokens sharing a 512-token prefix; 40 device blocks of 16 and a host
tier of 80, the one a disk tier implies, both ways; a TinyLlama of ``--layers`` layers) runs with and
without a disk tier on an empty directory, alternating: with the tier every admission
probes the disk and misses, and every computed block is packed and queued for the background writer,
so the schedule is the same step for step and the difference is the tier's own cost. A fresh
directory each run (a used one would serve hits). Prints the median over runs of the whole run's
seconds each way and the stepping thread's CPU seconds (``time.thread_time``: what the step path
itself costs, whatever else the machine runs; the writer thread's work is not in it), the medians
of the paired ratios (target <= 1.05), and the slowest prefetch and write-back call the tier saw.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from tempfile import TemporaryDirectory

import torch

from prefixkv.engine import Engine, SchedulerConfig, TinyLlama, TinyLlamaConfig
from prefixkv.tiers.disk_store import DiskStoreConfig


def prompts(n=8, seed=0, prefix=512):
    rng = random.Random(seed)
    shared = [rng.randrange(3, 256) for _ in range(prefix)]
    return [shared + [rng.randrange(3, 256) for _ in range(40)] for _ in range(n)]


def run(model, disk=None):
    # the same host tier both ways (a disk tier implies one: 2 x num_blocks), so the difference is the disk's
    tier = dict(disk=disk, disk_bytes=2**30, disk_config=DiskStoreConfig(fsync="file")) if disk else {}
    e = Engine.from_model(model, num_blocks=40, block_size=16, num_host_blocks=80, host_cache=True, **tier,
                          config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=2))
    ids = [e.add_request(p, max_new_tokens=6) for p in prompts()]
    t0, c0 = time.perf_counter(), time.thread_time()
    while e.has_unfinished:
        e.step()
    seconds = (time.perf_counter() - t0, time.thread_time() - c0)
    stats = e.disk.stats() if e.disk is not None else {}
    outputs = [e.requests[i].output for i in ids]
    e.close()
    return seconds, outputs, stats


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=9)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(1)
    model = TinyLlama(TinyLlamaConfig(num_layers=args.layers, hidden_size=256, intermediate_size=512, num_heads=8,
                                      num_kv_heads=2, head_dim=32, vocab_size=256))
    run(model)                                              # warm-up
    base, tier, ratios, cpu_ratios, prefetch, write_back = [], [], [], [], [], []
    with TemporaryDirectory() as tmp:
        for k in range(args.repeat):
            b, reference, _ = run(model)
            t, got, stats = run(model, f"{tmp}/run{k}")
            assert got == reference and stats["staged_blocks"] == 0
            base.append(b)
            tier.append(t)
            ratios.append(t[0] / b[0])
            cpu_ratios.append(t[1] / b[1])
            prefetch.append(stats["slowest_prefetch_s"])
            write_back.append(stats["slowest_write_back_s"])
    out = {"runs": args.repeat, "layers": args.layers,
           "run_s_without_tier": statistics.median(b[0] for b in base),
           "run_s_with_disk_tier": statistics.median(t[0] for t in tier),
           "step_cpu_s_without_tier": statistics.median(b[1] for b in base),
           "step_cpu_s_with_disk_tier": statistics.median(t[1] for t in tier),
           "ratio_median": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
           "cpu_ratio_median": statistics.median(cpu_ratios), "cpu_ratio_min": min(cpu_ratios),
           "cpu_ratio_max": max(cpu_ratios),
           "slowest_prefetch_ms": 1e3 * statistics.median(prefetch),
           "slowest_write_back_ms": 1e3 * statistics.median(write_back)}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"disk tier, zero hits, {args.layers}-layer TinyLlama, {args.repeat} alternating runs: "
              f"{1e3 * out['run_s_with_disk_tier']:.1f} ms with the tier vs {1e3 * out['run_s_without_tier']:.1f} ms "
              f"without (medians); paired ratio median {out['ratio_median']:.3f} "
              f"[{out['ratio_min']:.3f}-{out['ratio_max']:.3f}]; the stepping thread's CPU time "
              f"{1e3 * out['step_cpu_s_with_disk_tier']:.1f} vs {1e3 * out['step_cpu_s_without_tier']:.1f} ms, paired "
              f"ratio median {out['cpu_ratio_median']:.3f} [{out['cpu_ratio_min']:.3f}-{out['cpu_ratio_max']:.3f}] "
              f"(the writer thread's work is not in it: off the step path); slowest prefetch {out['slowest_prefetch_ms']:.2f} ms, "
              f"write-back {out['slowest_write_back_ms']:.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
