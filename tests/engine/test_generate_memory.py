"""``generate`` refuses, up front, a model whose weights cannot fit in host memory (``--hidden-size
100000`` failed inside torch's allocator asking for 40 GB), as it refuses ``--num-blocks`` and
``--layers`` that cannot."""

from __future__ import annotations

import argparse

import pytest

import prefixkv.hostmem as hostmem
from cli_helpers import fails
from prefixkv.engine.demo import check_memory, model_bytes


def demo_args(**kw):
    base = dict(requests=8, num_blocks=512, block_size=16, layers=4, hidden_size=256, heads=8, kv_heads=2)
    return argparse.Namespace(**{**base, **kw})


def test_model_bytes_counts_the_tiny_models_weights():
    torch = pytest.importorskip("torch")
    from prefixkv.engine import TinyLlama, TinyLlamaConfig

    torch.manual_seed(0)
    args = demo_args(hidden_size=64, heads=4, kv_heads=2, layers=2)
    model = TinyLlama(TinyLlamaConfig(hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                                      num_kv_heads=2, head_dim=16))
    weights = 4 * sum(p.numel() for p in model.parameters())
    assert weights <= model_bytes(args) <= 1.5 * weights


def test_weights_that_do_not_fit_are_refused_before_anything_is_built(monkeypatch):
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 64 * 2**20)
    check_memory(demo_args(hidden_size=128))                   # small: fits in 64 MiB
    with pytest.raises(hostmem.TooLarge, match=r"hidden size 1,024 x 4 layers \(.* of weights\)"):
        check_memory(demo_args(hidden_size=1024))              # ~170 MB of weights, a small pool


def test_generate_refuses_a_huge_hidden_size(capsys):
    pytest.importorskip("torch")
    err = fails(capsys, "generate", "--hidden-size", "100000")
    assert "hidden size 100,000" in err and "of host memory" in err, err
