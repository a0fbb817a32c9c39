"""The remote tier through Hugging Face ``generate``: a second store (another process's, in
effect: a fresh manager and pool) loads the first one's prefix from the server, verified, and
generates the same tokens as ``generate`` without any prefixkv cache, in gather and paged mode."""

from __future__ import annotations

import random

import pytest

from redis_fixtures import needs_redis, redis_server  # noqa: F401 (fixture)

torch = pytest.importorskip("torch")
pytest.importorskip("redis")
pytest.importorskip("transformers")
from hf_generate import generate_plain, generate_through  # noqa: E402
try:
    from prefixkv.integrations.hf import PrefixKVStore  # noqa: E402
except ImportError as exc:  # an unsupported transformers version
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = [*needs_redis, pytest.mark.usefixtures("one_torch_thread")]


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_hf_generate_loads_another_stores_prefix(redis_server, tiny_hf_models, mode):  # noqa: F811
    redis_server.command("FLUSHALL")
    model = tiny_hf_models[mode]
    rng = random.Random(2)
    shared = [rng.randrange(3, 256) for _ in range(96)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(5)] for _ in range(3)]
    reference = generate_plain(model, prompts)

    def run():
        store = PrefixKVStore(model, num_blocks=16, block_size=8, remote=redis_server.url)
        outs = generate_through(store, model, prompts, mode)
        stats = store.remote.stats()
        assert store.remote.flush()
        store.close()
        return outs, stats, store.manager.stats()

    first, s1, _ = run()
    second, s2, m2 = run()
    assert first == second == reference
    assert s1["queued_blocks"] >= 12 and s2["staged_blocks"] >= 12 and m2.host_hit_tokens >= 96
    assert s2["store_rejected"] == {}
