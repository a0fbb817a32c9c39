"""The cost of paging on the CPU: paged decode attention vs SDPA over contiguous KV.

    .venv/bin/pytest benches/test_bench_attention.py --benchmark-only --benchmark-columns=min,median
    .venv/bin/pytest benches/test_bench_attention.py --benchmark-disable   # smoke: each body once

Decode at 32 sequences x 4,096 tokens, 2 KV heads, 8 query heads, head dim 64,
float32, block size 16 (8,192 physical blocks, shuffled): 64 MiB of K and 64 MiB
of V read per step. ``paged`` is ``paged_attention(impl="torch")`` through the
block tables (gather + SDPA); ``contiguous`` is one SDPA call on KV already laid
out as ``[seqs, kv_heads, tokens, head_dim]``, the same bytes. The ratio of the
two medians is the cost of paging on the CPU. ``reference`` (the block-by-block
specification) is timed for scale only.

Every bench checks its result against the contiguous computation.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from prefixkv.kv.attention import paged_attention  # noqa: E402

SEQS, TOKENS, KV_HEADS, Q_HEADS, HEAD_DIM, BLOCK = 32, 4096, 2, 8, 64, 16
GROUP = Q_HEADS // KV_HEADS
SCALE = HEAD_DIM ** -0.5


@pytest.fixture(scope="module")
def decode_case():
    return build_decode_case()


def build_decode_case() -> dict:
    gen = torch.Generator().manual_seed(0)
    blocks_per_seq = TOKENS // BLOCK
    num_blocks = SEQS * blocks_per_seq
    k_pool = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    v_pool = torch.randn(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(SEQS, blocks_per_seq).int()
    seq_lens = torch.full((SEQS,), TOKENS, dtype=torch.int32)
    query = torch.randn(SEQS, Q_HEADS, HEAD_DIM, generator=gen)
    # The same KV, contiguous per sequence in SDPA's layout.
    k_dense = k_pool[tables.long()].reshape(SEQS, TOKENS, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    v_dense = v_pool[tables.long()].reshape(SEQS, TOKENS, KV_HEADS, HEAD_DIM).transpose(1, 2).contiguous()
    expect = contiguous_sdpa(query, k_dense, v_dense)
    return dict(query=query, k_pool=k_pool, v_pool=v_pool, tables=tables, seq_lens=seq_lens,
                k_dense=k_dense, v_dense=v_dense, expect=expect)


def contiguous_sdpa(query, k_dense, v_dense):
    # GQA as in the paged path: the 4 query heads of a KV head are 4 query rows (no K/V repeat).
    q = query.view(SEQS, KV_HEADS, GROUP, HEAD_DIM)
    return F.scaled_dot_product_attention(q, k_dense, v_dense, scale=SCALE).reshape(SEQS, Q_HEADS, HEAD_DIM)


def _info(benchmark):
    benchmark.extra_info.update(seqs=SEQS, tokens=TOKENS, kv_heads=KV_HEADS, q_heads=Q_HEADS, head_dim=HEAD_DIM,
                                block_size=BLOCK, dtype="float32", threads=torch.get_num_threads(),
                                kv_bytes_read=2 * SEQS * TOKENS * KV_HEADS * HEAD_DIM * 4)


def test_decode_32x4096_paged_torch(benchmark, decode_case):
    c = decode_case
    _info(benchmark)
    out = benchmark(paged_attention, c["query"], (c["k_pool"], c["v_pool"]), None, c["tables"], c["seq_lens"],
                    SCALE, impl="torch")
    torch.testing.assert_close(out, c["expect"], atol=1e-5, rtol=1e-5)


def test_decode_32x4096_contiguous_sdpa(benchmark, decode_case):
    c = decode_case
    _info(benchmark)
    out = benchmark(contiguous_sdpa, c["query"], c["k_dense"], c["v_dense"])
    torch.testing.assert_close(out, c["expect"])


def test_decode_32x4096_paged_reference(benchmark, decode_case):
    c = decode_case
    _info(benchmark)
    out = benchmark.pedantic(paged_attention, args=(c["query"], (c["k_pool"], c["v_pool"]), None, c["tables"],
                                                    c["seq_lens"], SCALE),
                             kwargs=dict(impl="reference"), rounds=3, iterations=1, warmup_rounds=0)
    torch.testing.assert_close(out, c["expect"], atol=1e-5, rtol=1e-5)
