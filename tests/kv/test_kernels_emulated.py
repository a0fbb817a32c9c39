"""The CUDA paged-attention kernels against dense float64 attention, emulated on the CPU and on a GPU.

One test body per case, parametrised by backend: "emulated" compiles kernels/paged_attention.cu with
g++ against tests/cuda_emu's shims and runs it with the fiber runtime; "cuda" (marked gpu) runs the
same plans through CuPy on torch CUDA tensors. Both go through prefixkv.kv.cuda_kernels' planning and
argument lists, so they cannot drift apart. Inputs: shuffled physical blocks, NaN (or huge) values in
every slot no sequence owns, padded table entries pointing at poisoned blocks, outputs and split
scratch prefilled with NaN.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np
import pytest

from cuda_emu import harness
from prefixkv.kv import cuda_kernels as ck

KERNEL = Path(__file__).resolve().parents[2] / "kernels" / ck.SOURCE
_reason = harness.available()
needs_emulator = pytest.mark.skipif(_reason is not None, reason=f"CPU emulation unavailable: {_reason}")

BACKENDS = [pytest.param("emulated", marks=needs_emulator), pytest.param("cuda", marks=pytest.mark.gpu)]
TOL = {"float16": dict(atol=3e-3, rtol=3e-3), "bfloat16": dict(atol=2e-2, rtol=2e-2)}


# -- backends ---------------------------------------------------------------------------------------
@pytest.fixture(scope="session")
def emu_module():
    if _reason is not None:
        pytest.skip(f"CPU emulation unavailable: {_reason}")
    return harness.build(KERNEL, ck.all_kernel_names())


def _cuda_reason():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False)"
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # ImportError or a broken CUDA runtime
        return f"cupy unavailable: {exc}"
    return None


class Runner:
    """Runs prefixkv.kv.cuda_kernels' plans on one backend; inputs and outputs are numpy."""

    def __init__(self, backend, request=None, module=None):
        self.backend = backend
        if module is not None:
            self.module = module
        elif backend == "emulated":
            self.module = request.getfixturevalue("emu_module")
        else:
            reason = _cuda_reason()
            if reason:
                pytest.skip(f"GPU test skipped: {reason}")

    def __call__(self, case, *, num_splits=None, rows=None, return_lse=True):
        if self.backend == "emulated":
            res, plan = harness.emulated_paged_attention(
                self.module, case.q, case.k, case.v, case.tables, case.lens, case.scale, case.qsl, return_lse,
                dtype=case.dtype, num_splits=num_splits, rows=rows, poison=True)
            out, lse = res if return_lse else (res, None)
            return harness.to_float(out, case.dtype).astype(np.float64), lse, plan
        import torch

        dev = torch.device("cuda")

        def t(x):
            if x is None:
                return None
            if x.dtype == np.uint16:  # bf16 bit patterns
                return torch.from_numpy(x.view(np.int16)).to(dev).view(torch.bfloat16)
            return torch.from_numpy(x).to(dev)

        res = ck.launch_paged_attention(t(case.q), t(case.k), t(case.v), t(case.tables), t(case.lens), case.scale,
                                        t(case.qsl), return_lse, num_splits=num_splits, rows=rows, poison=True)
        torch.cuda.synchronize()
        out, lse = res if return_lse else (res, None)
        dims = ck.check_inputs(t(case.q), t(case.k), t(case.v), t(case.tables), t(case.lens), t(case.qsl))
        plan = ck.plan_attention(dims, num_sms=ck._device_sms(0), num_splits=num_splits, rows=rows)
        return (out.float().cpu().numpy().astype(np.float64),
                None if lse is None else lse.cpu().numpy(), plan)


@pytest.fixture(params=BACKENDS)
def run(request):
    return Runner(request.param, request)


# -- problems and the dense reference ------------------------------------------------------------
class Case:
    def __init__(self, *, lens, block_size=16, kv_heads=2, group=4, head_dim=64, dtype="bfloat16", q_lens=None,
                 poison="nan", seed=0, pad_columns=1, scale=None):
        rng = np.random.default_rng(seed)
        B, D = block_size, head_dim
        self.dtype, self.block_size, self.group = dtype, B, group
        self.scale = D ** -0.5 if scale is None else scale
        nblk = [-(-L // B) for L in lens]
        W = max(nblk + [1]) + pad_columns
        total = sum(nblk) + 4
        ids = rng.permutation(total)
        shape = (total, B, kv_heads, D)
        bad = {"nan": np.nan, "huge": 6.0e4 if dtype == "float16" else 3.0e38}[poison]
        kf = np.full(shape, bad, np.float32)
        vf = np.full(shape, bad, np.float32)
        tables = np.empty((len(lens), W), np.int32)
        spare = ids[sum(nblk):]        # never owned: poisoned through and through
        used = 0
        for i, L in enumerate(lens):
            own = ids[used:used + nblk[i]]
            used += nblk[i]
            tables[i, :nblk[i]] = own
            tables[i, nblk[i]:] = rng.choice(spare, W - nblk[i])   # padding points at poison
            pos = np.arange(L)
            kf[own[pos // B], pos % B] = rng.standard_normal((L, kv_heads, D))
            vf[own[pos // B], pos % B] = rng.standard_normal((L, kv_heads, D))
        self.lens = np.array(lens, np.int32)
        self.tables = tables
        if q_lens is None:
            tokens, self.qsl = len(lens), None
        else:
            assert all(0 <= q <= L for q, L in zip(q_lens, lens))
            self.qsl = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
            tokens = int(self.qsl[-1])
        qf = rng.standard_normal((tokens, kv_heads * group, D)).astype(np.float32) * 1.5
        self.k = harness.to_device_dtype(kf, dtype)
        self.v = harness.to_device_dtype(vf, dtype)
        self.q = harness.to_device_dtype(qf, dtype)
        self.q_lens = q_lens

    def reference(self):
        """Dense attention in float64 over the values the kernel sees (after fp16/bf16 rounding)."""
        k = harness.to_float(self.k, self.dtype).astype(np.float64)
        v = harness.to_float(self.v, self.dtype).astype(np.float64)
        q = harness.to_float(self.q, self.dtype).astype(np.float64)
        B, G = self.block_size, self.group
        tokens, heads, D = q.shape
        out = np.zeros((tokens, heads, D))
        lse = np.full((tokens, heads), -np.inf)
        rows = []   # (token, sequence, visible positions)
        for i, L in enumerate(self.lens):
            if self.qsl is None:
                rows.append((i, i, int(L)))
            else:
                first, n = int(self.qsl[i]), int(self.qsl[i + 1] - self.qsl[i])
                rows += [(first + j, i, int(L) - n + j + 1) for j in range(n)]
        for tok, i, n in rows:
            if n == 0:
                continue
            pos = np.arange(n)
            blocks = self.tables[i, pos // B]
            K = k[blocks, pos % B]                       # [n, Hkv, D]
            V = v[blocks, pos % B]
            for h in range(heads):
                s = K[:, h // G] @ q[tok, h] * self.scale
                m = s.max()
                p = np.exp(s - m)
                out[tok, h] = p @ V[:, h // G] / p.sum()
                lse[tok, h] = m + math.log(p.sum())
        return out, lse


def check(case, out, lse, what=""):
    ref_out, ref_lse = case.reference()
    assert not np.isnan(out).any(), f"{what}: NaN in the output (an unwritten element or a masked slot read)"
    np.testing.assert_allclose(out, ref_out, **TOL[case.dtype], err_msg=what)
    if lse is not None:
        assert not np.isnan(lse).any(), f"{what}: NaN in lse"
        empty = np.isneginf(ref_lse)
        assert np.array_equal(np.isneginf(lse), empty), f"{what}: -inf lse exactly for empty histories"
        np.testing.assert_allclose(lse[~empty], ref_lse[~empty], atol=2e-3, rtol=1e-4, err_msg=what)


def edge_lengths(B, long=150):
    return [0, 1, B - 1, B, B + 1, long]


# -- decode ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_decode_edge_lengths(run, dtype, block_size, group):
    head_dim = 128 if group == 4 else 64
    case = Case(lens=edge_lengths(block_size), block_size=block_size, group=group, head_dim=head_dim,
                dtype=dtype, seed=block_size * 10 + group)
    out, lse, plan = run(case, num_splits=1)
    assert plan.num_splits == 1
    check(case, out, lse, f"decode {dtype} B={block_size} G={group} D={head_dim}")


@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("rows", [1, 2, 4, 8])
def test_rows_per_cta(run, head_dim, rows):
    """Every rows-per-CTA instantiation, including partial row chunks (group 6 over rows 4 or 8)."""
    for group in (8, 6):
        case = Case(lens=[3, 70, 129], group=group, kv_heads=2, head_dim=head_dim, dtype="bfloat16",
                    seed=rows + group)
        out, lse, plan = run(case, rows=rows, num_splits=1)
        assert plan.rows == rows and plan.chunks == -(-group // rows)
        check(case, out, lse, f"G={group} rows={rows} D={head_dim}")


@pytest.mark.parametrize("poison", ["nan", "huge"])
def test_unused_slots_never_reach_the_result(run, poison):
    case = Case(lens=[1, 7, 9, 31, 33], block_size=8, group=2, head_dim=64, dtype="float16", poison=poison,
                pad_columns=3, seed=7)
    out, lse, _ = run(case)
    check(case, out, lse, f"poison={poison}")


def test_without_lse(run):
    case = Case(lens=[0, 5, 40], group=2, dtype="float16", seed=3)
    out, lse, _ = run(case, return_lse=False)
    assert lse is None
    check(case, out, None, "no lse")


# -- split context and its reduction ------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [2, 3, 7])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_split_context(run, num_splits, dtype):
    # width 13 blocks of 16: splits of 7, 5 or 2 blocks, not aligned to 64-position tiles; the short
    # sequences leave later splits empty (acc unwritten, m = -inf, l = 0) and 0 gives all-empty.
    case = Case(lens=[0, 1, 17, 64, 200], block_size=16, group=4, head_dim=128, dtype=dtype, seed=num_splits)
    out, lse, plan = run(case, num_splits=num_splits)
    assert plan.num_splits > 1
    check(case, out, lse, f"splits={num_splits}")


def test_split_chosen_automatically_for_few_long_sequences(run):
    case = Case(lens=[1100, 700], block_size=32, kv_heads=1, group=4, head_dim=64, dtype="bfloat16", seed=11)
    out, lse, plan = run(case)
    assert plan.num_splits > 1, "two sequences of one KV head cannot fill a GPU without splitting"
    assert (plan.blocks_per_split * plan.block_size) % ck.TILE == 0
    check(case, out, lse, "auto split")


# -- extend ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_extend_is_causal_within_the_new_tokens(run, num_splits, dtype):
    lens = [5, 16, 40, 90, 3]
    q_lens = [5, 2, 0, 17, 1]     # a whole prefill, a few tokens, none, a chunk, decode-like
    case = Case(lens=lens, q_lens=q_lens, block_size=8, group=4, head_dim=64, dtype=dtype, seed=21)
    out, lse, plan = run(case, num_splits=num_splits)
    assert plan.is_extend and plan.num_tokens == sum(q_lens)
    check(case, out, lse, f"extend splits={num_splits}")


# -- validation (no backend needed) -------------------------------------------------------------
def _arrays(**over):
    a = dict(q=np.zeros((2, 8, 64), np.float16), k=np.zeros((4, 16, 2, 64), np.float16),
             v=np.zeros((4, 16, 2, 64), np.float16), bt=np.zeros((2, 2), np.int32), sl=np.ones(2, np.int32),
             qsl=None)
    a.update(over)
    return a


@pytest.mark.parametrize("over, message", [
    (dict(k=np.zeros((4, 4, 2, 64), np.float16), v=np.zeros((4, 4, 2, 64), np.float16)), "block size 4"),
    (dict(q=np.zeros((2, 8, 96), np.float16), k=np.zeros((4, 16, 2, 96), np.float16),
          v=np.zeros((4, 16, 2, 96), np.float16)), "head dim 96"),
    (dict(q=np.zeros((2, 7, 64), np.float16)), "multiple of KV heads"),
    (dict(q=np.zeros((2, 8, 64), np.float32), k=np.zeros((4, 16, 2, 64), np.float32),
          v=np.zeros((4, 16, 2, 64), np.float32)), "float16 and bfloat16"),
    (dict(k=np.zeros((4, 16, 2, 128), np.float16)[..., ::2]), "contiguous"),
    (dict(bt=np.zeros((2, 2), np.int64)), "int32"),
    (dict(q=np.zeros((3, 8, 64), np.float16)), "one query per sequence"),
    (dict(qsl=np.zeros(2, np.int32)), "query_start_loc"),
])
def test_unsupported_inputs_are_refused(over, message):
    a = _arrays(**over)
    with pytest.raises(ValueError, match=message):
        ck.check_inputs(a["q"], a["k"], a["v"], a["bt"], a["sl"], a["qsl"])


# -- the emulator itself --------------------------------------------------------------------------
@needs_emulator
@pytest.mark.parametrize("schedule", ["reverse", "random"])
def test_result_does_not_depend_on_thread_order(emu_module, schedule):
    case = Case(lens=[0, 17, 130], group=4, head_dim=128, dtype="bfloat16", seed=5)
    runner = Runner("emulated", module=emu_module)
    try:
        emu_module.set_schedule(schedule, seed=1234)
        out, lse, _ = runner(case, num_splits=2)
    finally:
        emu_module.set_schedule("forward")
    check(case, out, lse, schedule)


MUTANTS = {
    "tail mask off by one": [("if (t0 + u * NSUB + sub < end) valid |= 1u << u;",
                              "if (t0 + u * NSUB + sub <= end) valid |= 1u << u;")],
    "missing __syncthreads": [("    __syncthreads();  // scores visible\n", "\n")],
    "per-tile softmax without the running max": [
        ("const float m_new = fmaxf(m_old, warp_max(fmaxf(x0, x1)));",
         "const float m_new = warp_max(fmaxf(x0, x1));"),
        ("const float corr = exp2f(m_old - m_use);", "const float corr = 1.f;"),
    ],
}


@needs_emulator
def test_mutants_are_caught(emu_module):
    """Each injected bug makes the emulated comparison fail; the real source passes the same check."""
    source = KERNEL.read_text()
    case = Case(lens=[13, 150], block_size=16, group=2, head_dim=64, dtype="float16", seed=99)
    names = [ck.attention_kernel_name("float16", 64, 16, 2)]
    runner = Runner("emulated", module=emu_module)
    out, lse, _ = runner(case, num_splits=1, rows=2)
    check(case, out, lse, "unmutated")

    for label, edits in MUTANTS.items():
        text = source
        for old, new in edits:
            assert text.count(old) == 1, f"mutation site for {label!r} not found exactly once in {KERNEL.name}"
            text = text.replace(old, new)
        runner.module = harness.build(text, names, defines=("PREFIXKV_NO_INSTANTIATIONS",))
        try:
            out, lse, _ = runner(case, num_splits=1, rows=2)
        except harness.EmulationError:
            continue  # refused by the emulator: caught as well
        with pytest.raises(AssertionError):
            check(case, out, lse, label)


SEMANTICS = r"""
extern "C" __global__ void warp_ops(int* out, float* smem_seen) {
  __shared__ float garbage[4];
  __shared__ int counter;
  const int t = threadIdx.x, lane = t & 31;
  if (t < 4) smem_seen[t] = garbage[t];       // before anyone writes: must be the NaN fill
  if (t == 0) counter = 0;
  __syncthreads();
  atomicAdd(&counter, 1);
  int v = t * 10;
  out[t * 8 + 0] = __shfl_xor_sync(0xffffffffu, v, 1);
  out[t * 8 + 1] = __shfl_down_sync(0xffffffffu, v, 3, 8);
  out[t * 8 + 2] = __shfl_up_sync(0xffffffffu, v, 2);
  out[t * 8 + 3] = __shfl_sync(0xffffffffu, v, 5, 16);
  out[t * 8 + 4] = (int)__ballot_sync(0xffffffffu, lane % 3 == 0);
  out[t * 8 + 5] = __any_sync(0xffffffffu, lane == 7) + 2 * __all_sync(0xffffffffu, lane < 32);
  out[t * 8 + 6] = __syncthreads_count(t % 2);
  __syncthreads();
  out[t * 8 + 7] = counter;
}
extern "C" __global__ void divergent_barrier(int* out) {
  // half the warp waits at the block barrier, the other half in a shuffle that needs the first half
  if (threadIdx.x < 16) __syncthreads();
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
extern "C" __global__ void early_exit_shuffle(int* out) {
  if (threadIdx.x == 3) return;
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, (int)threadIdx.x, 1);
}
"""


@needs_emulator
def test_emulator_semantics():
    mod = harness.build(SEMANTICS, ["warp_ops", "divergent_barrier", "early_exit_shuffle"])
    n = 64
    out = np.zeros(n * 8, np.int32)
    seen = np.zeros(4, np.float32)
    mod.launch("warp_ops", (1, 1, 1), (n, 1, 1), [out, seen])
    o = out.reshape(n, 8)
    t = np.arange(n)
    lane = t % 32
    assert np.isnan(seen).all(), "shared memory starts as NaN garbage"
    assert (o[:, 0] == (t ^ 1) * 10).all()
    down = np.where(lane % 8 + 3 < 8, t + 3, t)
    assert (o[:, 1] == down * 10).all()
    up = np.where(lane >= 2, t - 2, t)
    assert (o[:, 2] == up * 10).all()
    assert (o[:, 3] == ((t // 16) * 16 + 5) * 10).all()
    ballot = sum(1 << i for i in range(32) if i % 3 == 0)
    assert (o[:, 4].astype(np.uint32) == np.uint32(ballot)).all()
    assert (o[:, 5] == 3).all()
    assert (o[:, 6] == n // 2).all()
    assert (o[:, 7] == n).all()
    with pytest.raises(harness.EmulationError, match="deadlock"):
        mod.launch("divergent_barrier", (1, 1, 1), (32, 1, 1), [np.zeros(32, np.int32)])
    with pytest.raises(harness.EmulationError, match="exited"):
        mod.launch("early_exit_shuffle", (1, 1, 1), (32, 1, 1), [np.zeros(32, np.int32)])


CONVERT = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
extern "C" __global__ void convert(const float* x, unsigned short* h, unsigned short* b, const unsigned short* hin,
                                   float* hout, int n) {
  for (int i = threadIdx.x; i < n; i += blockDim.x) {
    h[i] = __half_as_ushort(__float2half_rn(x[i]));
    b[i] = __bfloat16_as_ushort(__float2bfloat16_rn(x[i]));
    hout[i] = __half2float(__ushort_as_half(hin[i]));
  }
}
"""


@needs_emulator
def test_fp16_bf16_shims_round_like_ieee():
    mod = harness.build(CONVERT, ["convert"])
    rng = np.random.default_rng(0)
    n = 65536
    special = np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 65504.0, 65519.99, 65520.0, 1e-8, 2.0**-24,
                        2.0**-25, 3 * 2.0**-26, 2.0**-14, 1.0 + 2.0**-11, 1.0 + 3 * 2.0**-11], np.float32)
    with np.errstate(all="ignore"):
        scaled = (rng.standard_normal(n // 2) * 10.0 ** rng.integers(-9, 6, n // 2)).astype(np.float32)
    random_bits = rng.integers(0, 2**32, n // 2 - special.size, dtype=np.uint64).astype(np.uint32).view(np.float32)
    x = np.concatenate([special, scaled, random_bits])
    hin = np.arange(n, dtype=np.uint16)
    h, b = np.empty(n, np.uint16), np.empty(n, np.uint16)
    hout = np.empty(n, np.float32)
    mod.launch("convert", (1, 1, 1), (64, 1, 1), [x, h, b, hin, hout, np.int32(n)])
    with np.errstate(over="ignore", invalid="ignore"):
        want_h = x.astype(np.float16).view(np.uint16)
    nan = np.isnan(x)
    assert (h[~nan] == want_h[~nan]).all()
    assert np.isnan(h.view(np.float16)[nan]).all()
    want_b = harness.to_bf16_bits(x)
    assert (b[~nan] == want_b[~nan]).all() and np.isnan(harness.from_bf16_bits(b[nan])).all()
    ref = hin.view(np.float16).astype(np.float32)
    same = (ref == hout) | (np.isnan(ref) & np.isnan(hout))
    assert same.all(), "every fp16 bit pattern widens exactly"
    try:
        import torch
    except ImportError:
        return
    tb = torch.from_numpy(x[~nan]).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert (b[~nan] == tb).all(), "bf16 rounding matches torch"


@needs_emulator
def test_emulated_suite_builds_fast_enough(emu_module, tmp_path):
    """Guards the 2-minute budget: the full kernel build stays well below it on 2 cores."""
    start = time.perf_counter()
    harness.build(KERNEL, ck.all_kernel_names()[:2], cache=tmp_path)
    assert time.perf_counter() - start < 60
