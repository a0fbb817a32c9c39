"""The disk tier through Hugging Face ``generate``: a second store on the same directory (a restart,
in effect: a fresh manager and pool) loads the first one's prefix from disk, verified, and generates
the same tokens as ``generate`` without any prefixkv cache, in gather and paged mode."""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hf_generate import generate_plain, generate_through  # noqa: E402
try:
    from prefixkv.integrations.hf import PrefixKVStore  # noqa: E402
except ImportError as exc:  # an unsupported transformers version
    pytest.skip(str(exc), allow_module_level=True)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("mode", ["gather", "paged"])
def test_hf_generate_loads_a_previous_stores_prefix_from_disk(tmp_path, tiny_hf_models, mode):
    model = tiny_hf_models[mode]
    rng = random.Random(3)
    shared = [rng.randrange(3, 256) for _ in range(96)]
    prompts = [shared + [rng.randrange(3, 256) for _ in range(5)] for _ in range(3)]
    reference = generate_plain(model, prompts)

    def run():
        store = PrefixKVStore(model, num_blocks=16, block_size=8, disk=tmp_path / "kv", disk_bytes=2**26)
        outs = generate_through(store, model, prompts, mode)
        assert store.disk.flush()
        stats = store.disk.stats()
        store.close()
        return outs, stats, store.manager.stats()

    first, s1, _ = run()
    second, s2, m2 = run()
    assert first == second == reference
    assert s1["store_writes"] >= 12 and s2["staged_blocks"] >= 12 and m2.host_hit_tokens >= 96
    assert s2["store_rejected"] == {}


def test_a_disk_tier_needs_the_models_weights_and_no_verify(tmp_path, tiny_hf_models):
    model = tiny_hf_models["gather"]
    with pytest.raises(ValueError, match="without verify=True"):
        PrefixKVStore(model, num_blocks=16, block_size=8, disk=tmp_path / "kv", verify=True)
