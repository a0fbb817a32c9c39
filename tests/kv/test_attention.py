"""Paged attention against dense float64 attention: decode, extend, GQA, dtypes, masking, lse."""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prefixkv import KVCacheManager, KVSpec  # noqa: E402
from prefixkv.kv import attention as attn  # noqa: E402
from prefixkv.kv.attention import (attention_wrong_per_block_average, paged_attention,  # noqa: E402
                                paged_attention_reference, paged_attention_torch)
from prefixkv.kv.storage import KVStore  # noqa: E402

NEEDS_CUDA = "needs CUDA (torch.cuda.is_available() is False)"
BACKENDS = {"reference": paged_attention_reference, "torch": paged_attention_torch}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# (atol, rtol) of the output against float64 attention over the same (rounded) inputs; the lse is
# float32 in every dtype. Outputs are averages of N(0, 1) values, so |out| is mostly below 1: the
# half-precision bounds are a few ulps of the output's own rounding (fp16 2^-11, bf16 2^-8).
OUT_TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 4e-3), torch.bfloat16: (1.6e-2, 2e-2)}
LSE_TOL = (2e-5, 1e-5)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# -- building cases ------------------------------------------------------------
@dataclass
class Case:
    query: torch.Tensor
    k_pool: torch.Tensor
    v_pool: torch.Tensor
    tables: torch.Tensor
    seq_lens: torch.Tensor
    starts: torch.Tensor | None
    scale: float
    expect: torch.Tensor      # float64 [T, Hq, d]
    expect_lse: torch.Tensor  # float64 [T, Hq]

    def args(self):
        return (self.query, self.k_pool, self.v_pool, self.tables, self.seq_lens, self.scale, self.starts)


def poison_value(poison, dtype):
    if poison == "nan":
        return float("nan")
    if poison == "inf":
        return float("inf")
    return 1e30 if dtype == torch.float32 else torch.finfo(dtype).max   # "big": finite, overflows q.K


def dense(q, k, v, scale, q_len):
    """float64 attention of the last ``q_len`` positions of one sequence over ``k``/``v`` [L, Hkv, d]."""
    L, Hkv, d = k.shape
    Hq = q.shape[1]
    G = Hq // Hkv
    if L == 0:   # a decode row with no history: zeros and -inf by definition
        return torch.zeros(q.shape, dtype=torch.float64), torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    k = k.double().repeat_interleave(G, dim=1)
    v = v.double().repeat_interleave(G, dim=1)
    s = torch.einsum("thd,lhd->thl", q.double(), k) * scale
    position = torch.arange(L - q_len, L)
    s = s.masked_fill(torch.arange(L)[None, None, :] > position[:, None, None], -math.inf)
    return torch.einsum("thl,lhd->thd", torch.softmax(s, dim=-1), v), torch.logsumexp(s, dim=-1)


def make_case(lens, q_lens=None, *, B=16, Hkv=2, G=4, d=64, dtype=torch.float32, poison="nan", pad=-1,
              seed=0, spare=3, device="cpu"):
    """Random K/V for sequences of ``lens`` in shuffled physical blocks; every slot not written is poison.

    ``q_lens`` None: decode (one query per sequence, at its last position).
    Otherwise extend: sequence i has q_lens[i] new queries, its last positions.
    """
    gen = torch.Generator().manual_seed(seed)
    needs = [-(-n // B) for n in lens]
    total = sum(needs) + spare
    physical = torch.randperm(total, generator=gen)
    width = max(needs, default=0) + 1     # one padding column at least
    tables = torch.full((len(lens), width), pad, dtype=torch.int32)
    fill = poison_value(poison, dtype)
    k_pool = torch.full((total, B, Hkv, d), fill, dtype=dtype)
    v_pool = torch.full((total, B, Hkv, d), fill, dtype=dtype)
    decode = q_lens is None
    q_lens = [1 if n else 0 for n in lens] if decode else q_lens
    queries, expects, lses = [], [], []
    used = 0
    for i, (n, q_len) in enumerate(zip(lens, q_lens)):
        blocks = physical[used:used + needs[i]]
        used += needs[i]
        tables[i, :needs[i]] = blocks.int()
        k = torch.randn(n, Hkv, d, generator=gen).to(dtype)
        v = torch.randn(n, Hkv, d, generator=gen).to(dtype)
        slots = blocks.long().repeat_interleave(B)[:n] * B + torch.arange(n) % B
        k_pool.view(-1, Hkv, d)[slots] = k
        v_pool.view(-1, Hkv, d)[slots] = v
        rows = max(q_len, 1) if decode else q_len
        q = torch.randn(rows, Hkv * G, d, generator=gen).to(dtype)
        out, lse = dense(q, k, v, 1 / math.sqrt(d), q_len if n else 1)
        queries.append(q)
        expects.append(out)
        lses.append(lse)
    starts = None if decode else torch.tensor(np.cumsum([0] + list(q_lens)), dtype=torch.int32)
    return Case(torch.cat(queries).to(device), k_pool.to(device), v_pool.to(device), tables.to(device),
                torch.tensor(lens, dtype=torch.int32).to(device), None if starts is None else starts.to(device),
                1 / math.sqrt(d), torch.cat(expects), torch.cat(lses))


def check(case, out, lse=None, what=""):
    atol, rtol = OUT_TOL[case.query.dtype]
    assert out.dtype == case.query.dtype and out.shape == case.query.shape
    got = out.detach().cpu().double()
    assert torch.isfinite(got).all(), f"{what}: non-finite output"
    err = (got - case.expect).abs()
    bound = atol + rtol * case.expect.abs()
    assert (err <= bound).all(), f"{what}: max error {err.max().item():.3g} (atol {atol}, rtol {rtol})"
    if lse is not None:
        assert lse.dtype == torch.float32 and lse.shape == case.query.shape[:2]
        got, want = lse.detach().cpu().double(), case.expect_lse
        assert torch.equal(torch.isinf(got), torch.isinf(want)), f"{what}: -inf lse in the wrong rows"
        finite = torch.isfinite(want)
        torch.testing.assert_close(got[finite], want[finite], atol=LSE_TOL[0], rtol=LSE_TOL[1])


def edge_lengths(B):
    return [0, 1, B - 1, B, B + 1, 300]


# -- decode ----------------------------------------------------------------------
@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B", [8, 16, 32])
@pytest.mark.parametrize("G", [1, 4, 8])
def test_decode_matches_dense(impl, dtype, B, G):
    case = make_case(edge_lengths(B), B=B, G=G, dtype=DTYPES[dtype], seed=B * 10 + G)
    out, lse = BACKENDS[impl](*case.args(), return_lse=True)
    check(case, out, lse, f"{impl} {dtype} B={B} G={G}")
    assert torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()  # length 0


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("d", [4, 8, 64, 128])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_dims(impl, d, dtype):
    case = make_case([1, 17, 40, 129], B=16, Hkv=4, G=2, d=d, dtype=DTYPES[dtype], seed=d)
    out, lse = BACKENDS[impl](*case.args(), return_lse=True)
    check(case, out, lse, f"{impl} d={d}")


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poison", ["nan", "big", "inf"])
def test_poisoned_unused_slots_never_reach_the_result(impl, dtype, poison):
    """Tails, spare blocks and the block padding entries point at NaN / huge / inf: masked, never read."""
    for pad in (-1, 0, 2**30):   # padding entries: negative, a real block, far out of range
        case = make_case([1, 7, 9, 33, 0], B=8, G=4, dtype=DTYPES[dtype], poison=poison, pad=pad, seed=5)
        if pad == 0:
            case.tables[case.tables == -1] = 0
        out, lse = BACKENDS[impl](*case.args(), return_lse=True)
        check(case, out, lse, f"{impl} {dtype} poison={poison} pad={pad}")


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_every_output_element_is_written(impl, mode):
    q_lens = None if mode == "decode" else [0, 1, 3, 5, 40]
    lens = [0, 1, 8, 21, 40] if mode == "decode" else [0, 4, 8, 21, 40]
    case = make_case(lens, q_lens, B=8, G=4, seed=9)
    out = torch.full_like(case.query, float("nan"))
    result = BACKENDS[impl](*case.args(), out=out)
    assert result is out
    check(case, out, what=f"{impl} {mode} into a NaN buffer")


@pytest.mark.parametrize("impl", BACKENDS)
def test_decode_all_empty_and_single(impl):
    case = make_case([0, 0], B=8, G=2)
    out, lse = BACKENDS[impl](*case.args(), return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    case = make_case([5], B=8, G=2, seed=1)
    check(case, *BACKENDS[impl](*case.args(), return_lse=True))


@pytest.mark.parametrize("impl", BACKENDS)
def test_decode_equal_lengths_no_padding(impl):
    case = make_case([64, 64, 64], B=16, G=4, seed=2)     # the unmasked fast case of the torch path
    check(case, *BACKENDS[impl](*case.args(), return_lse=True))


# -- extend / prefill --------------------------------------------------------------
EXTEND_CASES = {
    # name: (seq_lens, q_lens)
    "prefill": ([1, 7, 8, 9, 33], [1, 7, 8, 9, 33]),                 # no history: causal only
    "on_cached_prefix": ([20, 17, 300, 40], [4, 1, 20, 24]),         # history + new tokens across blocks
    "mixed_with_decode_and_empty": ([16, 5, 9, 0, 12], [16, 1, 0, 0, 3]),
    "long_prefill": ([300], [300]),
}


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("G", [1, 4, 8])
@pytest.mark.parametrize("name", EXTEND_CASES)
def test_extend_matches_dense(impl, dtype, G, name):
    lens, q_lens = EXTEND_CASES[name]
    case = make_case(lens, q_lens, B=8, Hkv=2, G=G, d=32, dtype=DTYPES[dtype], seed=len(name) + G)
    out, lse = BACKENDS[impl](*case.args(), return_lse=True)
    check(case, out, lse, f"{impl} {dtype} G={G} {name}")


@pytest.mark.parametrize("B", [8, 16, 32])
def test_extend_block_sizes_poisoned(B):
    case = make_case([B - 1, B, B + 1, 3 * B + 5], [B - 1, 2, B + 1, B], B=B, G=4, seed=B, poison="big")
    for impl in BACKENDS:
        check(case, *BACKENDS[impl](*case.args(), return_lse=True), what=f"{impl} B={B}")


@pytest.mark.parametrize("chunk_bytes", [1, 4 * 8 * 40])
def test_extend_lse_in_row_chunks_matches_dense(monkeypatch, chunk_bytes):
    """A long prefill's lse is taken a few query rows at a time (never its whole [Hq, n, L] scores):
    chunks of one row and of five rows give the dense lse, across causal positions and sequences."""
    from prefixkv.kv import attention

    monkeypatch.setattr(attention, "_LSE_CHUNK_BYTES", chunk_bytes)
    case = make_case([37, 40, 9], [37, 12, 1], B=8, Hkv=2, G=4, d=16, seed=7)
    check(case, *attention.paged_attention_torch(*case.args(), return_lse=True), what=f"chunks of {chunk_bytes} B")


def test_extend_of_one_token_equals_decode():
    lens = [1, 9, 16, 17]
    decode = make_case(lens, B=8, G=4, seed=4)
    for impl in BACKENDS:
        a = BACKENDS[impl](*decode.args())
        b = BACKENDS[impl](*decode.args()[:-1], torch.arange(5, dtype=torch.int32))
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


# -- the wrong way ------------------------------------------------------------------
def test_per_block_average_is_wrong_and_the_online_softmax_is_right():
    """Softmax per block then averaging the block outputs ignores how much each block weighs;
    the online softmax renormalises across blocks and matches dense attention."""
    case = make_case([40, 64, 100], B=16, G=4, seed=13)
    wrong = attention_wrong_per_block_average(*case.args())
    err = (wrong.double() - case.expect).abs().max().item()
    assert err > 0.1, f"the per-block average should be visibly wrong, max error {err}"
    with pytest.raises(AssertionError):
        check(case, wrong, what="per-block average")
    check(case, paged_attention_reference(*case.args()), what="reference")
    check(case, paged_attention_torch(*case.args()), what="torch")
    # Within one block there is nothing to merge: both agree.
    single = make_case([5, 16], B=16, G=4, seed=14)
    check(single, attention_wrong_per_block_average(*single.args()), what="single block")


# -- dispatch, store, manager, validation ----------------------------------------------
def test_paged_attention_with_a_store_and_the_manager_tables():
    """End to end: prompts admitted by the manager (one shares a cached prefix), KV written
    through its slot mappings, a decode step, then attention through its block tables."""
    spec = KVSpec(layers=2, kv_heads=2, head_dim=16, dtype="float32")
    store = KVStore(spec, num_blocks=40, block_size=8)
    store.data.fill_(float("nan"))                 # unwritten slots are poison
    mgr = KVCacheManager(40, 8, hash_seed=0)
    gen = torch.Generator().manual_seed(0)
    history = {}
    prompts = {"a": list(range(21)), "b": list(range(21)) + [5, 6, 7], "c": [3] * 9}
    for seq, tokens in prompts.items():
        cached = mgr.admit(seq, tokens)
        slots = mgr.slot_mapping(seq, cached)
        k = torch.randn(len(slots), 2, 16, generator=gen)
        v = torch.randn(len(slots), 2, 16, generator=gen)
        store.write(1, slots, k, v)
        if cached:
            ka, va = history["a"]
            k, v = torch.cat([ka[:cached], k]), torch.cat([va[:cached], v])
        history[seq] = (k, v)
    seqs = list(prompts)
    slots = mgr.decode_step(seqs, [1, 2, 3])
    k_new, v_new = torch.randn(3, 2, 16, generator=gen), torch.randn(3, 2, 16, generator=gen)
    store.write(1, slots, k_new, v_new)
    query = torch.randn(3, 8, 16, generator=gen)
    tables = mgr.block_tables(seqs)                         # numpy int32, padded with 0
    lens = np.array([mgr.num_tokens(s) for s in seqs], dtype=np.int32)
    for impl in ("auto", "reference", "torch"):
        out, lse = paged_attention(query, store, 1, tables, lens, 0.25, return_lse=True, impl=impl)
        for row, seq in enumerate(seqs):
            k = torch.cat([history[seq][0], k_new[row:row + 1]])
            v = torch.cat([history[seq][1], v_new[row:row + 1]])
            want, want_lse = dense(query[row:row + 1], k, v, 0.25, 1)
            torch.testing.assert_close(out[row:row + 1].double(), want, atol=2e-5, rtol=1e-4)
            torch.testing.assert_close(lse[row:row + 1].double(), want_lse, atol=1e-4, rtol=1e-5)
    # A (k_pool, v_pool) pair works too, with layer=None.
    alone = paged_attention(query, (store.k[1], store.v[1]), None, tables, lens, 0.25)
    torch.testing.assert_close(alone, out)


def test_default_scale_is_inverse_sqrt_head_dim():
    case = make_case([10, 30], B=8, G=2, d=64, seed=3)
    torch.testing.assert_close(paged_attention_torch(*case.args()[:5], None),
                               paged_attention_torch(*case.args()[:5], 0.125))


def test_auto_on_cpu_is_the_torch_path(monkeypatch):
    case = make_case([3, 12], B=8, G=2, seed=6)
    called = []
    real = attn.paged_attention_torch
    monkeypatch.setattr(attn, "paged_attention_torch", lambda *a, **k: called.append(1) or real(*a, **k))
    paged_attention(case.query, (case.k_pool, case.v_pool), None, case.tables, case.seq_lens, case.scale)
    assert called == [1]


GRAD_MODES = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "enable_grad": torch.enable_grad}


@pytest.mark.parametrize("first", GRAD_MODES)
@pytest.mark.parametrize("then", GRAD_MODES)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_torch_path_does_not_depend_on_an_earlier_calls_grad_mode(first, then, mode):
    """The CPU gather buffer is reused across calls: one made inside inference_mode must not be an
    inference tensor, or every later call outside inference mode fails writing into it."""
    attn.clear_workspace()
    case = make_case([5, 21], None if mode == "decode" else [3, 21], B=8, G=2, seed=11)
    big = make_case([40, 70], None if mode == "decode" else [2, 70], B=8, G=2, seed=12)
    try:
        with GRAD_MODES[first]():
            check(big, paged_attention_torch(*big.args()), what=f"first call under {first}")
        with GRAD_MODES[then]():
            # Smaller than the first call: reuses the buffer the first call allocated.
            out, lse = paged_attention_torch(*case.args(), return_lse=True)
        check(case, out, lse, what=f"{first} then {then}")
        with GRAD_MODES[then]():
            check(big, paged_attention_torch(*big.args()), what=f"again under {then}")
    finally:
        attn.clear_workspace()


def test_cuda_impl_refuses_cpu_tensors_and_unknown_impl():
    case = make_case([3], B=8, G=2)
    pools = (case.k_pool, case.v_pool)
    with pytest.raises(ValueError, match="CUDA tensors"):
        paged_attention(case.query, pools, None, case.tables, case.seq_lens, case.scale, impl="cuda")
    with pytest.raises(ValueError, match="impl must be one of"):
        paged_attention(case.query, pools, None, case.tables, case.seq_lens, case.scale, impl="triton")


def test_missing_kernel_module_warns_once(monkeypatch):
    monkeypatch.setitem(sys.modules, "prefixkv.kv.cuda_kernels", None)   # makes the import fail
    monkeypatch.setattr(attn, "_warned_no_kernels", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert attn._load_cuda_kernels(warn=True) is None
        assert attn._load_cuda_kernels(warn=True) is None
    assert len([w for w in caught if "falls back to the torch path" in str(w.message)]) == 1
    with pytest.raises(ImportError):
        attn._load_cuda_kernels(warn=False)


def _bad(case, **change):
    args = dict(query=case.query, k_pool=case.k_pool, v_pool=case.v_pool, block_tables=case.tables,
                seq_lens=case.seq_lens, scale=case.scale, query_start_loc=case.starts)
    args.update(change)
    return args


@pytest.mark.parametrize("change,match", [
    (lambda c: {"query": c.query[0]}, r"query must be \[num_tokens"),
    (lambda c: {"query": c.query.double()}, "float32, float16 or bfloat16"),
    (lambda c: {"query": c.query.half()}, "k_pool is torch.float32 but query is torch.float16"),
    (lambda c: {"k_pool": c.k_pool[0]}, r"k_pool must be \[num_blocks"),
    (lambda c: {"v_pool": c.v_pool[:, :, :1]}, "differ in shape"),
    (lambda c: {"query": c.query[:, :, :8]}, "head_dim"),
    (lambda c: {"query": c.query[:, :3]}, "multiple of KV heads"),
    (lambda c: {"block_tables": c.tables[0]}, r"block_tables must be \[num_seqs"),
    (lambda c: {"block_tables": c.tables[:1]}, "1 rows for 2 sequences"),
    (lambda c: {"block_tables": c.tables.float()}, "integers"),
    (lambda c: {"seq_lens": c.seq_lens[None]}, r"seq_lens must be \[num_seqs\]"),
    (lambda c: {"seq_lens": torch.tensor([3, -1])}, "negative"),
    (lambda c: {"seq_lens": torch.tensor([3, 99])}, "columns"),
    (lambda c: {"query": c.query[:1]}, "one query per sequence"),
    (lambda c: {"query_start_loc": torch.tensor([0, 1])}, r"query_start_loc must be \[num_seqs \+ 1\]"),
    (lambda c: {"query_start_loc": torch.tensor([0, 1, 3])}, "from 0 to the 2 query rows"),
    (lambda c: {"query_start_loc": torch.tensor([0, 2, 2]), "seq_lens": torch.tensor([1, 12])}, "2 new queries"),
    (lambda c: {"block_tables": torch.tensor([[0, 0], [1, 999]])}, r"block_tables\[1, 1\] = 999"),
    (lambda c: {"scale": float("nan")}, "scale must be finite"),
])
@pytest.mark.parametrize("impl", BACKENDS)
def test_validation(change, match, impl):
    case = make_case([3, 12], B=8, G=2, d=16, seed=1)
    with pytest.raises(ValueError, match=match):
        BACKENDS[impl](**_bad(case, **change(case)))


def test_validation_of_out_and_pools():
    case = make_case([3, 12], B=8, G=2, d=16, seed=1)
    with pytest.raises(ValueError, match="out must be"):
        paged_attention_torch(*case.args(), out=torch.empty(2, 4, 16, dtype=torch.float16))
    with pytest.raises(ValueError, match="layer must be None"):
        paged_attention(case.query, (case.k_pool, case.v_pool), 1, case.tables, case.seq_lens, case.scale)
    with pytest.raises(TypeError, match="KVStore"):
        paged_attention(case.query, object(), 0, case.tables, case.seq_lens, case.scale)


# -- GPU: one body for every backend on CUDA, the CuPy kernel included -------------------------------
def _cuda_backend(name):
    if not torch.cuda.is_available():
        pytest.skip(NEEDS_CUDA)
    if name == "cuda":
        try:
            import cupy  # noqa: F401
        except Exception as exc:  # pragma: no cover - depends on the machine
            pytest.skip(f"impl='cuda' needs cupy ({exc})")
        try:
            import prefixkv.kv.cuda_kernels  # noqa: F401
        except ImportError as exc:  # pragma: no cover
            pytest.skip(f"prefixkv.kv.cuda_kernels is not importable ({exc})")
    return lambda q, k, v, *rest, **kw: paged_attention(q, (k, v), None, *rest, impl=name, **kw)


GPU_SHAPES = [(B, d, G) for B in (8, 16, 32) for d in (64, 128) for G in (1, 4, 8)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
@pytest.mark.parametrize("backend", ["reference", "torch", "cuda"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("B,d,G", GPU_SHAPES)
@pytest.mark.parametrize("mode", ["decode", "extend"])
def test_cuda_backends_match_dense(backend, dtype, B, d, G, mode):
    run = _cuda_backend(backend)
    lens = [0, 1, B - 1, B, B + 1, 300, 2000] if mode == "decode" else [B + 1, 300, 37, 1]
    q_lens = None if mode == "decode" else [B + 1, 20, 5, 1]
    case = make_case(lens, q_lens, B=B, Hkv=2, G=G, d=d, dtype=DTYPES[dtype], pad=0, poison="nan",
                     seed=B + d + G, device="cuda")
    out = torch.full_like(case.query, float("nan"))
    result, lse = run(*case.args()[:6], query_start_loc=case.starts, return_lse=True, out=out)
    torch.cuda.synchronize()
    assert result.data_ptr() == out.data_ptr()
    check(case, out, lse, f"{backend} {dtype} B={B} d={d} G={G} {mode}")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
@pytest.mark.parametrize("backend", ["reference", "torch", "cuda"])
def test_cuda_backends_agree_with_reference_on_long_few_sequences(backend):
    """Few sequences x long context: the split-context shape of the kernels."""
    run = _cuda_backend(backend)
    case = make_case([16384, 5000], B=16, Hkv=8, G=4, d=128, dtype=torch.bfloat16, pad=0, seed=1, device="cuda")
    out, lse = run(*case.args()[:6], return_lse=True)
    ref_out, ref_lse = paged_attention_reference(*case.args(), return_lse=True)
    torch.testing.assert_close(out.float(), ref_out.float(), atol=1.6e-2, rtol=2e-2)
    torch.testing.assert_close(lse, ref_lse, atol=1e-3, rtol=1e-4)
