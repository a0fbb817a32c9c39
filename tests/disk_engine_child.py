"""A separate process running an engine with a disk tier, for the disk tier's tests.

``python disk_engine_child.py run DIR PROMPTS_JSON [ROUNDS]``: build the test model and an engine
on ``DIR``, generate the prompts ``ROUNDS`` times (one engine each round: a restart), print one
JSON line (outputs, prefill tokens computed, disk tier stats).

``python disk_engine_child.py kill DIR TRIALS SEED``: build the model once, then for each trial
fork a writer (an engine generating fresh prompts into ``DIR`` until it dies), SIGKILL it at a
random point, print ``killed K`` and wait for a line on stdin before the next trial.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import time

import torch

torch.set_num_threads(1)          # before any op: the fork below must not copy a thread pool

from prefixkv.engine import Engine, SchedulerConfig, TinyLlama, TinyLlamaConfig  # noqa: E402

MODEL_SEED = 0
BLOCK_SIZE = 16


def model():
    return TinyLlama(TinyLlamaConfig(seed=MODEL_SEED))


def engine(m, path, *, disk_bytes=2**30, num_blocks=256, fsync="file"):
    from prefixkv.tiers.disk_store import DiskStoreConfig
    return Engine.from_model(m, num_blocks=num_blocks, block_size=BLOCK_SIZE, disk=path, disk_bytes=disk_bytes,
                             disk_config=DiskStoreConfig(fsync=fsync),
                             config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))


def summary(e, outputs) -> dict:
    e.disk.flush()
    s = e.disk.stats()
    return dict(outputs=outputs, computed=e.summary()["prefill_tokens_computed"], staged=s["staged_blocks"],
                rejected=s["store_rejected"], dropped=s["store_dropped"], writes=s["store_writes"])


def kill_prompts(seed: int, n: int = 64) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(40, 200))] for _ in range(n)]


def main() -> None:
    mode, path = sys.argv[1], sys.argv[2]
    if mode == "run":
        prompts = json.loads(open(sys.argv[3]).read())
        rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 1
        m = model()
        for _ in range(rounds):
            e = engine(m, path)
            try:
                out = e.generate(prompts, max_new_tokens=4)
                print(json.dumps(summary(e, out)), flush=True)
            finally:
                e.close()
        return
    if mode == "kill":
        trials, seed = int(sys.argv[3]), int(sys.argv[4])
        m = model()
        # everything a writer imports and the weights digest, before the first fork: a writer then
        # starts writing within milliseconds, and the kills land while it writes
        import prefixkv.tiers.disk_tier  # noqa: F401
        Engine.from_model(m, num_blocks=64, block_size=BLOCK_SIZE).generate([[1] * 40], max_new_tokens=1)
        rng = random.Random(seed)
        for k in range(trials):
            pid = os.fork()
            if pid == 0:                   # the writer: fresh prompts until killed
                try:
                    e = engine(m, path, fsync=rng.choice(["none", "file"]))
                    round_ = 0
                    while True:
                        e.generate(kill_prompts(seed * 1000 + k * 10 + round_), max_new_tokens=1)
                        round_ += 1
                finally:
                    os._exit(1)
            time.sleep(rng.uniform(0.05, 1.0))
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            print(f"killed {k}", flush=True)
            sys.stdin.readline()
        return
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    main()
