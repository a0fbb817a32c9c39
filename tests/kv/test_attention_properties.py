"""Property tests: paged attention (reference, torch path, emulated CUDA kernels) against dense
``scaled_dot_product_attention`` over the gathered K/V, over random shapes.

Random block sizes (including ones that divide nothing), lengths 0 .. a few blocks (tails with one
valid slot, exact multiples), GQA groups that are not powers of two, decode and extend rows mixed in
one batch, block tables padded with -1, 0 or garbage, unused slots poisoned with NaN, large logits.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402

from prefixkv.kv.attention import paged_attention_reference, paged_attention_torch  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Against float64 dense attention over the same rounded inputs: a few ulps of the output's dtype.
OUT_TOL = {torch.float32: (2e-5, 2e-5), torch.float16: (3e-3, 5e-3), torch.bfloat16: (2e-2, 3e-2)}


def dense_sdpa(q, k, v, scale, q_len):
    """float64 SDPA of the last ``q_len`` positions over ``k``/``v`` [L, Hkv, d]: bottom-right causal."""
    L, Hkv, d = k.shape
    T, Hq, _ = q.shape
    if L == 0:
        return torch.zeros(T, Hq, d, dtype=torch.float64), torch.full((T, Hq), -math.inf, dtype=torch.float64)
    G = Hq // Hkv
    kk = k.double().repeat_interleave(G, dim=1).transpose(0, 1)     # [Hq, L, d]
    vv = v.double().repeat_interleave(G, dim=1).transpose(0, 1)
    qq = q.double().transpose(0, 1)                                  # [Hq, T, d]
    position = torch.arange(L - q_len, L)
    mask = torch.arange(L)[None, :] <= position[:, None]             # [T, L]
    out = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=scale).transpose(0, 1)
    s = torch.where(mask, qq @ kk.transpose(-1, -2) * scale, -math.inf)
    return out, torch.logsumexp(s, dim=-1).transpose(0, 1)


@st.composite
def problems(draw, *, block_sizes=None, head_dims=None, dtypes=None, max_len=70):
    B = draw(st.sampled_from(block_sizes) if block_sizes else st.integers(1, 12))
    d = draw(st.sampled_from(head_dims) if head_dims else st.sampled_from([1, 3, 8, 16, 32]))
    dtype = draw(st.sampled_from(dtypes or list(DTYPES)))
    Hkv = draw(st.integers(1, 3))
    G = draw(st.integers(1, 9))
    n = draw(st.integers(1, 5))
    special = st.sampled_from([0, 1, B - 1, B, B + 1, 2 * B, 2 * B + 1])
    lens = draw(st.lists(st.one_of(st.integers(0, max_len), special.filter(lambda x: x >= 0)),
                         min_size=n, max_size=n))
    extend = draw(st.booleans())
    q_lens = None
    if extend:
        q_lens = [draw(st.integers(0, L)) if draw(st.booleans()) else min(L, draw(st.sampled_from([1, L])))
                  for L in lens]
    pad = draw(st.sampled_from([-1, 0, "garbage"]))
    extra_cols = draw(st.integers(0, 2))
    q_scale = draw(st.sampled_from([1.0, 1.0, 8.0, 100.0]))                 # 8: large logits, peaked softmax
    seed = draw(st.integers(0, 2**31 - 1))
    return dict(B=B, d=d, dtype=DTYPES[dtype], Hkv=Hkv, G=G, lens=lens, q_lens=q_lens, pad=pad,
                extra_cols=extra_cols, q_scale=q_scale, seed=seed)


def build(p):
    gen = torch.Generator().manual_seed(p["seed"])
    B, d, dtype, Hkv, G = p["B"], p["d"], p["dtype"], p["Hkv"], p["G"]
    lens, q_lens = p["lens"], p["q_lens"]
    needs = [-(-L // B) for L in lens]
    total = sum(needs) + 2
    physical = torch.randperm(total, generator=gen)
    width = max(needs + [0]) + p["extra_cols"]
    if p["pad"] == "garbage":
        tables = torch.randint(-(2**31), 2**31 - 1, (len(lens), width), generator=gen, dtype=torch.int64)
        tables = tables.to(torch.int32)
    else:
        tables = torch.full((len(lens), width), p["pad"], dtype=torch.int32)
    k_pool = torch.full((total, B, Hkv, d), float("nan"), dtype=dtype)
    v_pool = torch.full((total, B, Hkv, d), float("nan"), dtype=dtype)
    decode = q_lens is None
    queries, outs, lses = [], [], []
    used = 0
    for i, L in enumerate(lens):
        blocks = physical[used:used + needs[i]]
        used += needs[i]
        tables[i, :needs[i]] = blocks.int()
        k = torch.randn(L, Hkv, d, generator=gen).to(dtype)
        v = torch.randn(L, Hkv, d, generator=gen).to(dtype)
        slots = blocks.long().repeat_interleave(B)[:L] * B + torch.arange(L) % B
        k_pool.view(-1, Hkv, d)[slots] = k
        v_pool.view(-1, Hkv, d)[slots] = v
        rows = 1 if decode else q_lens[i]
        q = (torch.randn(rows, Hkv * G, d, generator=gen) * p["q_scale"]).to(dtype)
        o, lse = dense_sdpa(q, k, v, 1 / math.sqrt(d), rows if L else 0)
        queries.append(q)
        outs.append(o)
        lses.append(lse)
    starts = None if decode else torch.tensor(np.cumsum([0] + list(q_lens)), dtype=torch.int32)
    query = torch.cat(queries) if queries else torch.zeros(0, Hkv * G, d, dtype=dtype)
    expect = torch.cat(outs) if outs else torch.zeros(0, Hkv * G, d, dtype=torch.float64)
    expect_lse = torch.cat(lses) if lses else torch.zeros(0, Hkv * G, dtype=torch.float64)
    return query, k_pool, v_pool, tables, torch.tensor(lens, dtype=torch.int32), starts, expect, expect_lse


def logit_scale(query, k_pool):
    """A bound on |q.k| * scale over the finite keys (NaN poison ignored)."""
    if query.numel() == 0:
        return 1.0
    k = torch.nan_to_num(k_pool.double(), nan=0.0)
    return float(query.double().abs().amax(dim=(0, 1)).norm() * k.abs().amax(dim=(0, 1, 2)).norm()
                 / math.sqrt(query.shape[-1])) + 1.0


def assert_matches(out, lse, expect, expect_lse, dtype, what, logit_scale=1.0):
    atol, rtol = OUT_TOL[dtype]
    # float32 scores of magnitude |s| carry an absolute error of about |s| * 2^-24 each, which moves
    # the softmax weights (and so the output) by as much: allow for it with large logits.
    atol = atol + 4e-7 * logit_scale
    got = out.double()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = (got - expect).abs()
    assert (err <= atol + rtol * expect.abs()).all(), f"{what}: max error {err.max().item():.3g}"
    assert torch.equal(torch.isneginf(lse), torch.isneginf(expect_lse)), f"{what}: -inf lse in the wrong rows"
    finite = torch.isfinite(expect_lse)
    torch.testing.assert_close(lse.double()[finite], expect_lse[finite], atol=1e-4 + 4e-7 * logit_scale,
                               rtol=1e-5, msg=what)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_reference_and_torch_paths_match_dense_sdpa(p):
    query, k_pool, v_pool, tables, lens, starts, expect, expect_lse = build(p)
    for name, fn in (("reference", paged_attention_reference), ("torch", paged_attention_torch)):
        out, lse = fn(query, k_pool, v_pool, tables, lens, None, starts, return_lse=True)
        assert out.dtype == query.dtype and out.shape == query.shape
        assert_matches(out, lse, expect, expect_lse, p["dtype"], f"{name} {p}", logit_scale(query, k_pool))


# -- the CUDA kernels, emulated on the CPU ---------------------------------------------------------
def _emulator():
    import sys
    from pathlib import Path

    here = str(Path(__file__).resolve().parents[1])      # tests/, where cuda_emu is
    if here not in sys.path:
        sys.path.insert(0, here)
    from cuda_emu import harness

    return harness


@pytest.fixture(scope="module")
def emu():
    harness = _emulator()
    reason = harness.available()
    if reason is not None:
        pytest.skip(f"CPU emulation unavailable: {reason}")
    from pathlib import Path

    from prefixkv.kv import cuda_kernels as ck

    source = Path(__file__).resolve().parents[2] / "kernels" / ck.SOURCE
    return harness, harness.build(source, ck.all_kernel_names())


def run_emulated(emu, p, *, num_splits=None, rows=None):
    harness, module = emu
    query, k_pool, v_pool, tables, lens, starts, expect, expect_lse = build(p)
    name = "float16" if p["dtype"] == torch.float16 else "bfloat16"

    def dev(x):
        if x.dtype == torch.bfloat16:
            return np.ascontiguousarray(x.view(torch.int16).numpy().view(np.uint16))
        return np.ascontiguousarray(x.numpy())

    res, plan = harness.emulated_paged_attention(
        module, dev(query), dev(k_pool), dev(v_pool), dev(tables), dev(lens), 1 / math.sqrt(p["d"]),
        None if starts is None else dev(starts), True, dtype=name, num_splits=num_splits, rows=rows, poison=True)
    out, lse = res
    out = torch.from_numpy(harness.to_float(out, name).astype(np.float64)).to(p["dtype"])
    return out, torch.from_numpy(lse), expect, expect_lse, logit_scale(query, k_pool), plan


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                 HealthCheck.function_scoped_fixture])
@given(problems(block_sizes=[8, 16, 32], head_dims=[64, 128], dtypes=["float16", "bfloat16"], max_len=150),
       st.sampled_from([None, 1, 2, 3, 5]), st.sampled_from([None, 1, 2, 4, 8]))
def test_emulated_kernels_match_dense_sdpa(emu, p, num_splits, rows):
    p = dict(p, Hkv=min(p["Hkv"], 2), lens=p["lens"][:3], q_lens=None if p["q_lens"] is None else p["q_lens"][:3])
    out, lse, expect, expect_lse, scale, plan = run_emulated(emu, p, num_splits=num_splits, rows=rows)
    assert_matches(out, lse, expect, expect_lse, p["dtype"], f"kernel {p} splits={num_splits} rows={rows} {plan}",
                   scale)
