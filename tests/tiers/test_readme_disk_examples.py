"""The README's disk tier examples run as written (``<!-- example: disk-tier -->``, ``tier-stack``)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cli"))
from test_readme_examples import block_after  # noqa: E402

from prefixkv import KVCacheManager  # noqa: E402
from prefixkv.engine import Engine, TinyLlama, TinyLlamaConfig  # noqa: E402
from prefixkv.kv.storage import KVStore  # noqa: E402

PROMPTS = [list(range(1, 200)) + [i] for i in range(4)]


def test_disk_tier_example_serves_a_restart(tmp_path):
    model = TinyLlama(TinyLlamaConfig(seed=0))
    code = compile(block_after("example: disk-tier"), "README:disk-tier", "exec")
    runs = []
    for _ in range(2):
        ns = {"Engine": Engine, "model": model, "prompts": PROMPTS, "path": tmp_path / "kv"}
        exec(code, ns)
        runs.append(ns["engine"])
    first, second = (e.requests for e in runs)
    assert [r.output for r in first.values()] == [r.output for r in second.values()]
    assert runs[0].disk is None and runs[1].disk is None              # closed
    # the second engine loaded the shared prefix from disk: its first prompt hit too
    assert runs[1].summary()["prefix_hit_tokens"] > runs[0].summary()["prefix_hit_tokens"]


def test_tier_stack_example(tmp_path):
    model = TinyLlama(TinyLlamaConfig(seed=0))
    spec = model.config.kv_spec()
    ns = {"KVCacheManager": KVCacheManager, "KVStore": KVStore, "path": tmp_path / "kv", "spec": spec,
          "model": model, "tokens": list(range(100))}
    exec(compile(block_after("example: tier-stack"), "README:tier-stack", "exec"), ns)
    mgr = ns["mgr"]
    assert [t.name for t in mgr.tiers] == ["CPU", "DISK"]
    mgr.check_invariants()
    mgr.tiers.close()
