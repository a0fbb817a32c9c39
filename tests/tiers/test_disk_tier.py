"""The disk tier through the engine, on a real filesystem: a restart in a new process serves the
prefix, kill -9 of a writing process at random points, damaged, swapped and foreign files, two
processes sharing one directory, the capacity bound and a full disk. In every case the outputs
equal a run without any tier: nothing unverified reaches the KV pools.

The child processes run ``tests/disk_engine_child.py``; trial counts follow
``PREFIXKV_HYPOTHESIS_PROFILE`` (``long``: more kill -9 trials).
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

from interrupt_helpers import trials  # noqa: E402
from prefixkv.engine import Engine, SchedulerConfig, TinyLlama, TinyLlamaConfig  # noqa: E402
from prefixkv.tiers.disk_store import DiskStoreConfig  # noqa: E402
from prefixkv.tiers.disk_writer import DiskWriter  # noqa: E402

CHILD = str(Path(__file__).resolve().parents[1] / "disk_engine_child.py")
BLOCK = 16
PREFIX = [(7 * i + 3) % 256 for i in range(512)]                        # 32 blocks
PROMPTS = [PREFIX + [(11 * i + j) % 256 for j in range(5 + 3 * i)] for i in range(8)]

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def model():
    return TinyLlama(TinyLlamaConfig(seed=0))


def make_engine(model, path=None, *, disk_bytes=2**30, num_blocks=256, fsync="none"):
    disk = {} if path is None else dict(disk=path, disk_bytes=disk_bytes, disk_config=DiskStoreConfig(fsync=fsync))
    return Engine.from_model(model, num_blocks=num_blocks, block_size=BLOCK,
                             config=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8), **disk)


def generate(model, prompts, path=None, **kw):
    engine = make_engine(model, path, **kw)
    try:
        outputs = engine.generate(prompts, max_new_tokens=4)
        stats = None
        if engine.disk is not None:
            engine.disk.flush()
            stats = engine.disk.stats()
        return outputs, stats, engine.summary()
    finally:
        engine.close()


@pytest.fixture(scope="module")
def expected(model):
    return generate(model, PROMPTS)[0]


def child(*args, stdin=None):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(CHILD).parent), *sys.path]))
    return subprocess.Popen([sys.executable, CHILD, *map(str, args)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            stdin=stdin, text=True, env=env)


def child_runs(tmp_path, path, prompts, rounds=1):
    spec = tmp_path / f"prompts-{random.random()}.json"
    spec.write_text(json.dumps(prompts))
    proc = child("run", path, spec, rounds)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return [json.loads(line) for line in out.splitlines()]


def block_files(path) -> list[Path]:
    return sorted(p for p in Path(path).rglob("*") if p.is_file() and p.suffix == ".kv")


def test_a_new_process_on_the_directory_computes_at_most_one_block_of_the_prefix(model, tmp_path, expected):
    path = tmp_path / "kv"
    outputs_a, stats_a, _ = generate(model, PROMPTS, path)
    assert outputs_a == expected and stats_a["store_writes"] >= 32
    (b,) = child_runs(tmp_path, path, PROMPTS)
    assert b["outputs"] == expected
    suffixes = sum(len(p) - len(PREFIX) for p in PROMPTS)
    # engine B computes at most one block of the shared prefix per prompt (the rest is loaded from disk
    # or hit on the device), plus each prompt's own suffix
    assert b["computed"] <= suffixes + BLOCK * len(PROMPTS), b
    assert b["staged"] >= 31 and b["rejected"] == {}


def test_kill_9_of_a_writing_process_serves_no_bad_block(model, tmp_path):
    path = tmp_path / "kv"
    n = trials(20, quick=3, long=40)
    seed = 5
    proc = child("kill", path, n, seed, stdin=subprocess.PIPE)
    sys.path.insert(0, str(Path(CHILD).parent))
    try:
        import disk_engine_child as writer
    finally:
        sys.path.pop(0)
    staged = discarded = 0
    try:
        for k in range(n):
            line = proc.stdout.readline()
            assert line.strip() == f"killed {k}", (line, proc.stderr.read() if proc.poll() is not None else "")
            prompts = writer.kill_prompts(seed * 1000 + k * 10)[:6]       # what the writer began with
            reference = generate(model, prompts)[0]
            outputs, stats, _ = generate(model, prompts, path)
            assert outputs == reference, f"trial {k}"
            staged += stats["staged_blocks"]
            discarded += sum(stats["store_rejected"].values())
            assert not list(Path(path).rglob("*.tmp")), f"trial {k}: a temporary file left after the next open"
            proc.stdin.write("go\n")
            proc.stdin.flush()
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert staged > 0           # the killed writers' blocks were served (verified), not only discarded
    print(f"{n} kills: {staged} blocks served, {discarded} values discarded (counted by reason)")


def _flip(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[len(data) // 2] ^= 0x40
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", ["flipped", "truncated", "swapped", "foreign"])
def test_damaged_swapped_and_foreign_files_are_misses_counted_by_reason(model, tmp_path, expected, damage):
    path = tmp_path / "kv"
    generate(model, PROMPTS, path)
    files = block_files(path)
    assert len(files) >= 32
    rng = random.Random(damage)
    chosen = rng.sample(files, 6)
    if damage == "flipped":
        for f in chosen:
            _flip(f)
    elif damage == "truncated":
        for f in chosen:
            f.write_bytes(f.read_bytes()[: f.stat().st_size // 3])
    elif damage == "swapped":
        for a, b in zip(chosen[::2], chosen[1::2]):
            data_a, data_b = a.read_bytes(), b.read_bytes()
            a.write_bytes(data_b)
            b.write_bytes(data_a)
    else:
        # another model's directory: its files renamed into this model's namespace
        other = tmp_path / "other"
        generate(TinyLlama(TinyLlamaConfig(seed=1)), PROMPTS, other)
        (mine,) = [p for p in path.iterdir() if p.is_dir()]
        (theirs,) = [p for p in other.iterdir() if p.is_dir()]
        shutil.rmtree(mine)
        shutil.copytree(theirs, mine)
        chosen = block_files(path)
    outputs, stats, _ = generate(model, PROMPTS, path)
    assert outputs == expected
    rejected = sum(stats["store_rejected"].values())
    assert rejected >= 1, stats
    assert stats["store_bad_keys_deleted"] >= 1
    if damage == "foreign":
        assert set(stats["store_rejected"]) == {"fingerprint"}, stats["store_rejected"]


def test_two_processes_sharing_one_directory_give_identical_outputs(model, tmp_path, expected):
    path = tmp_path / "kv"
    spec = tmp_path / "prompts.json"
    spec.write_text(json.dumps(PROMPTS))
    procs = [child("run", path, spec, 3) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        runs = [json.loads(line) for line in out.splitlines()]
        assert len(runs) == 3
        for run in runs:
            assert run["outputs"] == expected
            assert run["rejected"] == {}, run
        assert runs[-1]["staged"] >= 31        # the later rounds load the prefix from disk


def test_the_disk_never_holds_more_than_its_capacity(model, tmp_path):
    path = tmp_path / "kv"
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(10 * BLOCK + 3)] for _ in range(16)]     # 160 distinct blocks
    probe = make_engine(model, tmp_path / "probe")
    value = probe.disk.store.value_bytes + BLOCK * 4            # a value with its token ids
    probe.close()
    capacity = 40 * value                                        # 4x more distinct blocks than fit
    engine = make_engine(model, path, disk_bytes=capacity)
    reference = generate(model, prompts)[0]
    try:
        outputs = []
        for p in prompts:
            outputs += engine.generate([p], max_new_tokens=4)
            engine.disk.flush()
            used = sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file() and f.suffix == ".kv")
            assert used <= capacity + value
        stats = engine.disk.stats()
    finally:
        engine.close()
    assert outputs == reference
    assert stats["store_evictions"] > 0 and stats["store_used_bytes"] <= capacity


def test_a_full_disk_drops_writes_counts_them_and_generation_goes_on(model, tmp_path, expected, monkeypatch):
    path = tmp_path / "kv"
    calls = {"n": 0}
    real = DiskWriter._write_all

    def full_after_ten(fd, data):
        calls["n"] += 1
        if calls["n"] > 10:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(fd, data)

    monkeypatch.setattr(DiskWriter, "_write_all", staticmethod(full_after_ten))
    outputs, stats, _ = generate(model, PROMPTS, path)
    assert outputs == expected
    assert stats["store_writes"] == 10 and stats["store_dropped"].get("no_space", 0) > 0, stats
    monkeypatch.undo()
    outputs, stats, _ = generate(model, PROMPTS, path)        # the ten blocks written are served
    assert outputs == expected and stats["staged_blocks"] == 10


def test_prometheus_series_of_the_disk_tier(model, tmp_path):
    pytest.importorskip("prometheus_client")
    from prefixkv.metrics import Metrics
    from prometheus_client import generate_latest

    path = tmp_path / "kv"
    generate(model, PROMPTS, path)
    engine = make_engine(model, path)
    metrics = Metrics()
    metrics.watch_engine(engine, worker="w0")
    try:
        engine.generate(PROMPTS[:2], max_new_tokens=2)
        engine.disk.flush()
        text = generate_latest(metrics.registry).decode()
    finally:
        engine.close()
    staged = [line for line in text.splitlines()
              if line.startswith('prefixkv_store_tier_blocks_total{event="staged",tier="disk",worker="w0"}')]
    assert staged and float(staged[0].split()[-1]) >= 31, text
    assert 'prefixkv_store_tier_bytes{kind="capacity",tier="disk",worker="w0"} 1.073741824e+09' in text
