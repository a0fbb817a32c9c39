"""Host tier transfers on the CPU: ``KVStore.demote`` / ``load`` against a plain torch copy of the
same bytes (target: >= 80%). ``python benches/test_bench_host_tier.py`` prints the medians and
ratios of one interleaved run; pytest-benchmark times each alone.

A block of an 8-layer, 8 KV head x 128, bf16 model at block size 16 is 512 KiB spread over
16 strided chunks (K and V of each layer); 128 blocks move per call, in shuffled order, as
LRU victims do.
"""

from __future__ import annotations

import random
import statistics
import time

import pytest

torch = pytest.importorskip("torch")

from prefixkv.kv.storage import KVStore  # noqa: E402
from prefixkv.sizing import KVSpec  # noqa: E402

SPEC = KVSpec(layers=8, kv_heads=8, head_dim=128, dtype="bfloat16")
BLOCKS, MOVED = 256, 128


def make_case(seed: int = 0):
    store = KVStore(SPEC, BLOCKS, 16)
    store.allocate_host(BLOCKS)
    rng = random.Random(seed)
    device = rng.sample(range(BLOCKS), MOVED)
    host = rng.sample(range(BLOCKS), MOVED)
    nbytes = MOVED * store.data[:, :, 0].numel() * store.data.element_size()
    flat_src = torch.ones(nbytes // 2, dtype=torch.bfloat16)
    flat_dst = torch.empty_like(flat_src)
    return store, list(zip(device, host)), list(zip(host, device)), flat_src, flat_dst


@pytest.fixture(scope="module")
def case():
    return make_case()


def test_demote(benchmark, case):
    store, demotions, _, _, _ = case
    assert benchmark(store.demote, demotions) == MOVED


def test_load(benchmark, case):
    store, _, loads, _, _ = case
    assert benchmark(store.load, loads) == MOVED


def test_plain_copy_of_the_same_bytes(benchmark, case):
    _, _, _, src, dst = case
    benchmark(dst.copy_, src)


def main(repeat: int = 30) -> None:
    store, demotions, loads, src, dst = make_case()
    runs = {"demote": lambda: store.demote(demotions), "load": lambda: store.load(loads),
            "plain copy": lambda: dst.copy_(src)}
    times = {k: [] for k in runs}
    for _ in range(repeat):
        for name, fn in runs.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    mib = src.numel() * 2 / 2**20
    plain = statistics.median(times["plain copy"])
    for name, values in times.items():
        med = statistics.median(values)
        print(f"{name:>10}: median {med * 1e3:.2f} ms for {mib:.0f} MiB ({mib / 1024 / med:.2f} GiB/s), "
              f"{plain / med:.0%} of a plain copy's throughput")


if __name__ == "__main__":
    main()
