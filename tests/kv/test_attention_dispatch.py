"""``paged_attention`` on CUDA tensors (impl "auto" / "cuda") with the inputs a generation loop hands it.

Without a GPU, the CUDA kernels run through the CPU emulator (tests/cuda_emu) behind the same entry
points the CuPy path has (``cuda_kernels.paged_attention_cuda`` / ``launch_paged_attention``), on
CPU tensors that report ``is_cuda``. The emulated launcher enforces the kernels' own contract
(``check_inputs``: contiguous, 16-byte aligned), as the CuPy launcher does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prefixkv.kv import attention as attn  # noqa: E402
from prefixkv.kv import cuda_kernels as ck  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # tests/, where cuda_emu is
from cuda_emu import harness  # noqa: E402

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(harness.available() is not None,
                                 reason=f"CPU emulation unavailable: {harness.available()}")]


class FakeCuda(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device (what the dispatch looks at)."""

    @property
    def is_cuda(self):
        return True


def cuda(t):
    return t.as_subclass(FakeCuda)


@pytest.fixture(scope="module")
def emulated(request):
    source = Path(__file__).resolve().parents[2] / "kernels" / ck.SOURCE
    return harness.build(source, ck.all_kernel_names())


@pytest.fixture
def kernels_on_cpu(monkeypatch, emulated):
    """Route cuda_kernels' launchers to the emulator; record each call."""
    calls = []

    def launch(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc=None, return_lse=False, *,
               out=None, lse=None, num_splits=None, rows=None, poison=True):
        def arr(t):
            return None if t is None else t.as_subclass(torch.Tensor).numpy()

        res, _ = harness.emulated_paged_attention(
            emulated, arr(query), arr(k_pool), arr(v_pool), arr(block_tables), arr(seq_lens), scale,
            arr(query_start_loc), return_lse, dtype="float16", out=arr(out), lse=arr(lse), poison=poison)
        calls.append(1)
        if return_lse:
            o, l = res
            return (out if out is not None else cuda(torch.from_numpy(o))), cuda(torch.from_numpy(l))
        return out if out is not None else cuda(torch.from_numpy(res))

    def plain(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc=None, return_lse=False):
        return launch(query, k_pool, v_pool, block_tables, seq_lens, scale, query_start_loc, return_lse)

    monkeypatch.setattr(attn, "_cupy_available", lambda: True)
    monkeypatch.setattr(ck, "launch_paged_attention", launch)
    monkeypatch.setattr(ck, "paged_attention_cuda", plain)
    return calls


def problem(seed=0, *, B=16, Hkv=2, G=4, d=64, lens=(5, 16, 40), extend=False):
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-L // B) for L in lens]
    num_blocks = sum(needs) + 2
    # K and V interleaved in one allocation [num_blocks, 2, B, Hkv, d] (a common fused layout):
    # each pool is a strided view.
    kv = torch.randn(num_blocks, 2, B, Hkv, d, generator=gen).half()
    perm = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(lens), max(needs) + 1, dtype=torch.int32)
    used = 0
    for i, n in enumerate(needs):
        tables[i, :n] = perm[used:used + n].int()
        used += n
    q_lens = [min(L, 3) for L in lens] if extend else [1] * len(lens)
    tokens = sum(q_lens)
    # q of a fused qkv projection: a strided view [tokens, Hq, d] of [tokens, (Hq + 2 Hkv) * d].
    Hq = Hkv * G
    qkv = torch.randn(tokens, (Hq + 2 * Hkv) * d, generator=gen).half()
    query = qkv[:, :Hq * d].view(tokens, Hq, d)
    starts = torch.tensor(np.cumsum([0] + q_lens), dtype=torch.int32) if extend else None
    return query, kv[:, 0], kv[:, 1], tables, torch.tensor(lens, dtype=torch.int32), starts


@pytest.mark.parametrize("extend", [False, True])
def test_auto_on_cuda_takes_strided_queries_and_outputs(kernels_on_cpu, extend):
    """A query sliced out of a fused qkv projection and an ``out`` that is a slice of a bigger buffer
    are ordinary tensors to a generation loop: the kernel path must take them (the torch path does)."""
    query, k_pool, v_pool, tables, lens, starts = problem(extend=extend)
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    want, want_lse = attn.paged_attention_reference(query, k_pool, v_pool, tables, lens, None, starts,
                                                    return_lse=True)
    assert not query.is_contiguous()
    got, lse = attn.paged_attention(cuda(query), (cuda(k_pool), cuda(v_pool)), None, tables, lens,
                                    query_start_loc=starts, return_lse=True)
    assert kernels_on_cpu, "the kernels ran"
    torch.testing.assert_close(got.as_subclass(torch.Tensor).float(), want.float(), atol=3e-3, rtol=3e-3)
    torch.testing.assert_close(lse.as_subclass(torch.Tensor), want_lse, atol=1e-3, rtol=1e-4)

    buffer = torch.full((query.shape[0], query.shape[1], 2 * query.shape[2]), float("nan"), dtype=query.dtype)
    out = buffer[..., :query.shape[2]]                      # strided: every row is half a buffer row
    result = attn.paged_attention(cuda(query), (cuda(k_pool), cuda(v_pool)), None, tables, lens,
                                  query_start_loc=starts, impl="cuda", out=cuda(out))
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out.float(), want.float(), atol=3e-3, rtol=3e-3)
    assert torch.isnan(buffer[..., query.shape[2]:]).all(), "only the out view was written"

    flat = torch.empty(query.numel() + 1, dtype=query.dtype)
    odd = flat[1:].view(query.shape)                       # contiguous, 2 bytes off 16-byte alignment
    odd.copy_(query)
    got = attn.paged_attention(cuda(odd), (cuda(k_pool), cuda(v_pool)), None, tables, lens, query_start_loc=starts)
    torch.testing.assert_close(got.as_subclass(torch.Tensor).float(), want.float(), atol=3e-3, rtol=3e-3)


def test_auto_on_cuda_with_strided_pools_takes_the_torch_path(kernels_on_cpu):
    """Pools that are strided views cannot be read by the kernels in place (and copying a pool per
    call is out of the question): "auto" runs the torch path, "cuda" refuses naming the pools."""
    query, k_pool, v_pool, tables, lens, starts = problem(seed=1)
    assert not k_pool.is_contiguous()
    want = attn.paged_attention_reference(query, k_pool, v_pool, tables, lens, None)
    got = attn.paged_attention(cuda(query), (cuda(k_pool), cuda(v_pool)), None, tables, lens)
    assert not kernels_on_cpu
    torch.testing.assert_close(got.as_subclass(torch.Tensor).float(), want.float(), atol=3e-3, rtol=3e-3)
    with pytest.raises(ValueError, match="contiguous K and V pools"):
        attn.paged_attention(cuda(query), (cuda(k_pool), cuda(v_pool)), None, tables, lens, impl="cuda")


def test_auto_on_cuda_with_misaligned_pools_takes_the_torch_path(kernels_on_cpu):
    query, k_pool, v_pool, tables, lens, starts = problem(seed=2)
    flat = torch.empty(k_pool.numel() + 1, dtype=k_pool.dtype)
    k_odd = flat[1:].view(k_pool.shape)                     # contiguous, 2 bytes off 16-byte alignment
    k_odd.copy_(k_pool)
    v_pool = v_pool.contiguous()
    want = attn.paged_attention_reference(query, k_odd, v_pool, tables, lens, None)
    got = attn.paged_attention(cuda(query.contiguous()), (cuda(k_odd), cuda(v_pool)), None, tables, lens)
    assert not kernels_on_cpu
    torch.testing.assert_close(got.as_subclass(torch.Tensor).float(), want.float(), atol=3e-3, rtol=3e-3)


@pytest.fixture
def no_launch(monkeypatch):
    """cuda_kernels' launchers replaced by one that fails the test: nothing may reach a kernel."""
    def launch(*args, **kwargs):
        raise AssertionError("the kernel was launched with metadata that should have been refused")

    monkeypatch.setattr(attn, "_cupy_available", lambda: True)
    monkeypatch.setattr(ck, "launch_paged_attention", launch)
    monkeypatch.setattr(ck, "paged_attention_cuda", launch)


@pytest.mark.parametrize("change, match", [
    (dict(seq_lens=[5, 16, 99]), "columns"),                       # past the table: the kernel would read
    (dict(seq_lens=[5, -1, 40]), "negative"),                      # beyond the row / another sequence's blocks
    (dict(query_start_loc=[0, 1, 8, 8], seq_lens=[5, 16, 40], extend=True), "from 0 to the"),
    (dict(query_start_loc=[0, 3, 2, 9], seq_lens=[5, 16, 40], extend=True), "decreases"),
    (dict(query_start_loc=[0, 3, 9, 9], seq_lens=[5, 4, 40], extend=True), "new queries"),
])
def test_host_metadata_is_checked_when_the_block_tables_are_on_the_device(no_launch, change, match):
    """Block tables kept on the device (built once per step) with seq_lens / query_start_loc given
    from the host: the host values are checked (no synchronisation needed) before any launch."""
    query, k_pool, v_pool, tables, lens, starts = problem(seed=3, extend=change.get("extend", False))
    query, k_pool, v_pool = query.contiguous(), k_pool.contiguous(), v_pool.contiguous()
    assert query.shape[0] == (9 if change.get("extend") else 3)
    with pytest.raises(ValueError, match=match):
        attn.paged_attention(cuda(query), (cuda(k_pool), cuda(v_pool)), None, cuda(tables), change["seq_lens"],
                             query_start_loc=change.get("query_start_loc"))


@pytest.mark.parametrize("extend", [False, True])
def test_device_tables_with_host_lengths_still_run(kernels_on_cpu, extend):
    query, k_pool, v_pool, tables, lens, starts = problem(seed=4, extend=extend)
    k_pool, v_pool = k_pool.contiguous(), v_pool.contiguous()
    want = attn.paged_attention_reference(query, k_pool, v_pool, tables, lens, None, starts)
    got = attn.paged_attention(cuda(query), (cuda(k_pool), cuda(v_pool)), None, cuda(tables), lens.tolist(),
                               query_start_loc=None if starts is None else starts.tolist())
    assert kernels_on_cpu
    torch.testing.assert_close(got.as_subclass(torch.Tensor).float(), want.float(), atol=3e-3, rtol=3e-3)
