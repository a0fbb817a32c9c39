"""Where writes for a down node are counted, as the README says: through an engine's remote tier
they are not even packed (``RemoteTier.stats()["write_back_skipped_down"]``), so the store's own
``dropped_down`` (``store_dropped_down``) stays 0; the README said only "dropped and counted"."""

from __future__ import annotations

import pathlib

import pytest

from redis_fixtures import free_port

pytest.importorskip("redis")
torch = pytest.importorskip("torch")

README = " ".join((pathlib.Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8").split())


def test_writes_for_a_down_node_are_counted_where_the_readme_says():
    from prefixkv.engine import Engine, TinyLlama, TinyLlamaConfig

    engine = Engine.from_model(TinyLlama(TinyLlamaConfig(seed=0)), num_blocks=64, block_size=4,
                               remote=f"redis://127.0.0.1:{free_port()}/0")
    try:
        engine.generate([list(range(1, 30)), list(range(1, 20)) + [99]], max_new_tokens=3)
        stats = engine.remote.stats()
    finally:
        engine.close()
    assert stats["store_nodes_down"] == 1
    assert stats["write_back_skipped_down"] > 0 and stats["store_dropped_down"] == 0
    assert '`RemoteTier.stats()["write_back_skipped_down"]`' in README
    assert "`store_dropped_down` stays 0" in README
