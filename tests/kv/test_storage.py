"""KVStore: pools, writes through the manager's slot mappings, COW copies, swap, sizing."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from prefixkv import KVCacheManager, KVSpec, plan  # noqa: E402
from prefixkv.cli import main as cli_main  # noqa: E402
from prefixkv.kv.storage import KVStore, torch_dtype  # noqa: E402

NEEDS_CUDA = "needs CUDA (torch.cuda.is_available() is False)"

SPEC = KVSpec(layers=3, kv_heads=2, head_dim=8, dtype="float32")


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def rand_kv(n, store, gen):
    shape = (n, store.kv_heads, store.head_dim)
    k = torch.randn(shape, generator=gen).to(store.dtype).to(store.device)
    v = torch.randn(shape, generator=gen).to(store.dtype).to(store.device)
    return k, v


class Shadow:
    """What every sequence's history must be: K/V per layer as plain tensors, by position."""

    def __init__(self, store, seed=0):
        self.store = store
        self.gen = torch.Generator().manual_seed(seed)
        self.kv: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def extend(self, seq, mgr, n_new):
        """Write the KV of ``seq``'s last ``n_new`` tokens in every layer (the model's job)."""
        total = mgr.num_tokens(seq)
        slots = mgr.slot_mapping(seq, total - n_new, total)
        empty = torch.empty(0, self.store.kv_heads, self.store.head_dim, dtype=self.store.dtype)
        layers = self.kv.setdefault(seq, [(empty, empty)] * self.store.num_layers)
        new = []
        for layer in range(self.store.num_layers):
            k, v = rand_kv(n_new, self.store, self.gen)
            self.store.write(layer, slots, k, v)
            new.append((torch.cat([layers[layer][0], k.cpu()]), torch.cat([layers[layer][1], v.cpu()])))
        self.kv[seq] = new

    def fork(self, parent, child):
        self.kv[child] = list(self.kv[parent])

    def check(self, seq, mgr):
        table = mgr.block_table(seq)
        for layer in range(self.store.num_layers):
            k, v = self.store.gather(layer, table, mgr.num_tokens(seq))
            assert torch.equal(k.cpu(), self.kv[seq][layer][0]), (seq, layer)
            assert torch.equal(v.cpu(), self.kv[seq][layer][1]), (seq, layer)


# -- layout ----------------------------------------------------------------------
@pytest.mark.parametrize("dtype,expect", [("float32", torch.float32), ("fp32", torch.float32),
                                          ("float16", torch.float16), ("half", torch.float16),
                                          ("bfloat16", torch.bfloat16), ("bf16", torch.bfloat16)])
def test_pools_layout_and_dtype(dtype, expect):
    spec = KVSpec(layers=2, kv_heads=4, head_dim=16, dtype=dtype)
    store = KVStore(spec, num_blocks=5, block_size=8)
    assert store.dtype == expect and len(store.k) == len(store.v) == 2
    for pool in store.k + store.v:
        assert pool.shape == (5, 8, 4, 16) and pool.dtype == expect and pool.is_contiguous()
    pointers = {p.data_ptr() for p in store.k + store.v}
    assert len(pointers) == 4, "every layer's K and V pool is its own memory"
    assert store.bytes == 5 * spec.bytes_per_block(8)
    assert "KVStore(" in repr(store)


def test_tensor_parallel_heads_per_gpu():
    store = KVStore(KVSpec(layers=1, kv_heads=8, head_dim=4, dtype="fp16", tensor_parallel=4), 2, 4)
    assert store.k[0].shape == (2, 4, 2, 4)


@pytest.mark.parametrize("dtype", ["fp8", "int8", "float8_e4m3fn"])
def test_unsupported_dtypes_refused(dtype):
    with pytest.raises(ValueError, match="float32, float16 and bfloat16"):
        KVStore(KVSpec(layers=1, kv_heads=1, head_dim=4, dtype=dtype), 2, 4)
    with pytest.raises(ValueError, match="float32, float16 and bfloat16"):
        KVStore.from_budget(KVSpec(layers=1, kv_heads=1, head_dim=4, dtype=dtype), 4, 2**20)
    with pytest.raises(ValueError):
        torch_dtype(torch.float64)


def test_bad_sizes_refused():
    with pytest.raises(ValueError, match="num_blocks"):
        KVStore(SPEC, 0, 4)
    with pytest.raises(ValueError, match="block_size"):
        KVStore(SPEC, 4, 0)
    with pytest.raises(ValueError, match="hold no block"):
        KVStore.from_budget(SPEC, 16, 100)


@pytest.mark.parametrize("layers,kv_heads,head_dim,dtype,block,pool", [
    (2, 2, 8, "float32", 16, "1MiB"),
    (4, 4, 32, "bfloat16", 8, 3 * 2**20 + 12345),
    (1, 8, 16, "fp16", 32, "2.5MiB"),
])
def test_from_budget_agrees_with_plan(capsys, layers, kv_heads, head_dim, dtype, block, pool):
    spec = KVSpec(layers=layers, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    store = KVStore.from_budget(spec, block, pool)
    pool_bytes = pool if isinstance(pool, int) else int(float(pool[:-3]) * 2**20)
    assert store.num_blocks == spec.num_blocks(pool_bytes, block) == plan(spec, block, pool_bytes, 1).num_blocks
    assert store.bytes == store.num_blocks * spec.bytes_per_block(block) <= pool_bytes
    assert pool_bytes - store.bytes < spec.bytes_per_block(block)
    code = cli_main(["plan", "--layers", str(layers), "--kv-heads", str(kv_heads), "--head-dim", str(head_dim),
                     "--dtype", dtype, "--block-size", str(block), "--pool", str(pool_bytes), "--json"])
    assert code == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["num_blocks"] == store.num_blocks
    assert printed["bytes_per_block"] * store.num_blocks == store.bytes


# -- writes and gathers through the manager ----------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_write_through_manager_slots_then_gather(dtype):
    spec = KVSpec(layers=2, kv_heads=2, head_dim=8, dtype=dtype)
    store = KVStore(spec, num_blocks=64, block_size=4)
    mgr = KVCacheManager(64, 4, hash_seed=0)
    shadow = Shadow(store)
    rng = random.Random(1)
    prompts = {"a": list(range(11)), "b": list(range(11)) + [99, 98], "c": [7] * 4}
    for seq, tokens in prompts.items():
        cached = mgr.admit(seq, tokens)
        if seq == "b":
            assert cached == 8  # two full blocks shared with "a": their KV is a's
            shadow.kv["b"] = [(k[:8], v[:8]) for k, v in shadow.kv["a"]]
        shadow.extend(seq, mgr, len(tokens) - cached)
    for _ in range(9):  # decode rounds: one slot per sequence, one write per layer for the batch
        seqs = list(prompts)
        slots = mgr.decode_step(seqs, [rng.randrange(1000) for _ in seqs])
        assert not mgr.take_copies()
        for layer in range(store.num_layers):
            k, v = rand_kv(len(seqs), store, shadow.gen)
            store.write(layer, slots, k, v)
            for row, seq in enumerate(seqs):
                old_k, old_v = shadow.kv[seq][layer]
                shadow.kv[seq][layer] = (torch.cat([old_k, k[row:row + 1]]), torch.cat([old_v, v[row:row + 1]]))
    for seq in prompts:
        shadow.check(seq, mgr)


def test_write_accepts_tensor_and_numpy_slots_and_empty():
    store = KVStore(SPEC, 4, 4)
    k = torch.ones(2, 2, 8)
    store.write(0, torch.tensor([3, 9]), k, 2 * k)
    store.write(1, np.array([3, 9], dtype=np.int32), 3 * k, 4 * k)
    store.write(2, [], torch.empty(0, 2, 8), torch.empty(0, 2, 8))
    flat_k = store.k[0].view(-1, 2, 8)
    assert torch.equal(flat_k[3], k[0]) and torch.equal(flat_k[9], k[1])
    assert torch.equal(store.v[1].view(-1, 2, 8)[9], 4 * k[1])
    assert float(store.k[0].abs().sum()) == 2 * 16  # nothing else written
    assert float(store.k[2].abs().sum()) == 0


@pytest.mark.parametrize("call,match", [
    (lambda s: s.write(0, [0], torch.ones(1, 2, 7), torch.ones(1, 2, 7)), r"\[num_tokens, 2, 8\]"),
    (lambda s: s.write(0, [0], torch.ones(1, 2, 8, dtype=torch.float16), torch.ones(1, 2, 8)), "float16"),
    (lambda s: s.write(0, [0, 1], torch.ones(1, 2, 8), torch.ones(1, 2, 8)), "2 slots for 1 tokens"),
    (lambda s: s.write(0, [0], torch.ones(1, 2, 8), torch.ones(2, 2, 8)), "v has 2"),
    (lambda s: s.write(0, [16], torch.ones(1, 2, 8), torch.ones(1, 2, 8)), "out of range"),
    (lambda s: s.write(0, [-1], torch.ones(1, 2, 8), torch.ones(1, 2, 8)), "out of range"),
    (lambda s: s.write(0, [0.5], torch.ones(1, 2, 8), torch.ones(1, 2, 8)), "integers"),
    (lambda s: s.gather(0, [0], 5), "2 are needed"),
    (lambda s: s.gather(0, [0, 7], 5), "out of range"),
    (lambda s: s.copy_blocks([(0, 4)]), "out of range"),
])
def test_bad_calls_raise_clear_errors(call, match):
    with pytest.raises(ValueError, match=match):
        call(KVStore(SPEC, 4, 4))


def test_bad_layer_and_type():
    store = KVStore(SPEC, 4, 4)
    with pytest.raises(IndexError):
        store.write(3, [0], torch.ones(1, 2, 8), torch.ones(1, 2, 8))
    with pytest.raises(TypeError):
        store.write(0, [0], np.ones((1, 2, 8), np.float32), torch.ones(1, 2, 8))


def test_gather_ignores_padding_entries_and_length_zero():
    store = KVStore(SPEC, 4, 4)
    store.k[1].fill_(1)
    k, v = store.gather(1, [1, -5, 99], 3)  # only the first block is needed; the rest is padding
    assert k.shape == (3, 2, 8) and k.is_contiguous() and float(k.sum()) == 48
    k, v = store.gather(0, [], 0)
    assert k.shape == v.shape == (0, 2, 8)


# -- copy-on-write -------------------------------------------------------------------
def test_cow_copies_keep_forked_histories_apart():
    store = KVStore(SPEC, 32, 4)
    mgr = KVCacheManager(32, 4, hash_seed=0)
    shadow = Shadow(store, seed=3)
    mgr.admit("p", list(range(10)))            # 2 full blocks + a partial tail of 2
    shadow.extend("p", mgr, 10)
    mgr.fork("p", "c1")
    mgr.fork("p", "c2")
    shadow.fork("p", "c1")
    shadow.fork("p", "c2")
    for step in range(6):
        for seq in ("p", "c1", "c2"):
            mgr.append(seq, [100 + step])
        copies = mgr.take_copies()
        if step == 0:
            assert len(copies) == 2  # two of the three sharers of the partial tail copy it
        assert store.copy_blocks(copies) == len(copies)   # before this step's writes
        for seq in ("p", "c1", "c2"):
            shadow.extend(seq, mgr, 1)
    for seq in ("p", "c1", "c2"):
        shadow.check(seq, mgr)
    # The three histories share their first 10 positions and differ after.
    k_p, _ = store.gather(0, mgr.block_table("p"), 16)
    k_c, _ = store.gather(0, mgr.block_table("c1"), 16)
    assert torch.equal(k_p[:10], k_c[:10]) and not torch.equal(k_p[10:], k_c[10:])


def test_cow_without_copy_would_corrupt():
    """Control: skipping copy_blocks loses the shared prefix of the tail (the test above is not vacuous)."""
    store = KVStore(SPEC, 32, 4)
    mgr = KVCacheManager(32, 4, hash_seed=0)
    shadow = Shadow(store, seed=3)
    mgr.admit("p", list(range(10)))
    shadow.extend("p", mgr, 10)
    mgr.fork("p", "c")
    shadow.fork("p", "c")
    mgr.append("c", [1])
    assert mgr.take_copies()
    shadow.extend("c", mgr, 1)
    with pytest.raises(AssertionError):
        shadow.check("c", mgr)


def sequential_copies(data, copies):
    for src, dst in copies:
        data[:, :, dst] = data[:, :, src].clone()


def test_copy_blocks_equals_copies_run_one_by_one():
    """Chains (a block copied, then copied on), repeated destinations and self-copies
    give what running the pairs in order gives, in one vectorised gather/scatter."""
    rng = random.Random(7)
    for trial in range(40):
        store = KVStore(SPEC, 8, 2)
        store.data.copy_(torch.randn(store.data.shape, generator=torch.Generator().manual_seed(trial)))
        expect = store.data.clone()
        copies = [(rng.randrange(8), rng.randrange(8)) for _ in range(rng.randrange(0, 10))]
        sequential_copies(expect, copies)
        store.copy_blocks(copies)
        assert torch.equal(store.data, expect), copies


def test_copy_blocks_every_layer_and_both_pools():
    store = KVStore(SPEC, 6, 2)
    store.data.copy_(torch.arange(store.data.numel(), dtype=torch.float32).view(store.data.shape))
    before = store.data.clone()
    assert store.copy_blocks([(1, 4), (2, 5)]) == 2
    for layer in range(3):
        for pool, index in ((store.k, 0), (store.v, 1)):
            assert torch.equal(pool[layer][4], before[layer, index, 1])
            assert torch.equal(pool[layer][5], before[layer, index, 2])
            assert torch.equal(pool[layer][:4], before[layer, index, :4])
    assert store.copy_blocks([]) == 0


# -- swap ------------------------------------------------------------------------------
def test_swap_requires_host_space():
    store = KVStore(SPEC, 4, 4)
    with pytest.raises(RuntimeError, match="allocate_host"):
        store.swap_out([(0, 0)])
    store.allocate_host(2)
    assert store.num_host_blocks == 2 and store.host_bytes == store.bytes // 2
    assert not store.host.is_pinned()  # CPU pools: ordinary host memory
    with pytest.raises(ValueError, match="out of range"):
        store.swap_out([(0, 2)])
    with pytest.raises(ValueError, match="num_host_blocks"):
        store.allocate_host(-1)


@pytest.mark.parametrize("evict", [False, True])
def test_swap_out_and_in_round_trip_through_manager(evict):
    blocks, size = 12, 4
    store = KVStore(SPEC, blocks, size)
    store.allocate_host(8)
    mgr = KVCacheManager(blocks, size, hash_seed=0, num_host_blocks=8)
    shadow = Shadow(store, seed=11)
    mgr.admit("a", list(range(14)))          # 4 blocks (3 full)
    shadow.extend("a", mgr, 14)
    mgr.admit("b", list(range(500, 506)))    # 2 blocks
    shadow.extend("b", mgr, 6)
    out = mgr.swap_out("a")
    assert len(out) == 4
    assert store.swap_out(out) == 4
    if evict:
        # Another sequence takes every free block (evicting a's cached ones) and writes over them.
        mgr.admit("x", list(range(1000, 1000 + mgr.num_free_blocks * size)))
        shadow.extend("x", mgr, mgr.num_tokens("x"))
        mgr.free("x")
    back = mgr.swap_in("a")
    assert len(back) == (4 if evict else 1)    # cached full blocks come back without a copy
    assert store.swap_in(back) == len(back)
    for seq in ("a", "b"):
        shadow.check(seq, mgr)
    mgr.check_invariants()


def test_swap_copies_every_layer():
    store = KVStore(SPEC, 4, 2)
    store.allocate_host(3)
    store.data.copy_(torch.randn(store.data.shape))
    original = store.data.clone()
    store.swap_out([(1, 2), (3, 0)])
    assert torch.equal(store.host[:, :, 2], original[:, :, 1]) and torch.equal(store.host[:, :, 0], original[:, :, 3])
    store.data.zero_()
    store.swap_in([(2, 0), (0, 3)])
    assert torch.equal(store.data[:, :, 0], original[:, :, 1]) and torch.equal(store.data[:, :, 3], original[:, :, 3])
    assert float(store.data[:, :, 1:3].abs().sum()) == 0
    assert store.swap_in([]) == 0 and store.swap_out([]) == 0


# -- grad modes ------------------------------------------------------------------------
@pytest.mark.parametrize("built_in, used_in", [("inference_mode", "no_grad"), ("inference_mode", "enable_grad"),
                                               ("no_grad", "inference_mode"), ("enable_grad", "inference_mode"),
                                               ("inference_mode", "inference_mode")])
def test_store_built_in_one_grad_mode_works_in_another(built_in, used_in):
    """Pools allocated inside torch.inference_mode() must not be inference tensors (they could not be
    written in place outside it); pools built outside must be writable inside it."""
    modes = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "enable_grad": torch.enable_grad}
    with modes[built_in]():
        store = KVStore(SPEC, 6, 4)
        store.allocate_host(3)
    assert not store.data.is_inference() and not store.host.is_inference()
    assert not any(t.is_inference() for t in store.k + store.v)
    gen = torch.Generator().manual_seed(5)
    k, v = rand_kv(7, store, gen)
    slots = list(range(4, 11))                      # blocks 1 and 2
    for mode in (used_in, built_in, used_in):       # and back again
        with modes[mode]():
            for layer in range(store.num_layers):
                store.write(layer, slots, k, v)
            assert store.copy_blocks([(1, 4), (2, 5)]) == 2
            assert store.swap_out([(4, 0), (5, 1)]) == 2
            assert store.swap_in([(0, 3), (1, 0)]) == 2
            for layer in range(store.num_layers):
                for table in ([1, 2], [4, 5], [3, 0]):
                    got_k, got_v = store.gather(layer, [t for t in table], 7)
                    assert torch.equal(got_k, k) and torch.equal(got_v, v)
        k, v = k + 1, v - 1


# -- CUDA ------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason=NEEDS_CUDA)
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_store_copy_write_swap(dtype):
    spec = KVSpec(layers=2, kv_heads=2, head_dim=8, dtype=dtype)
    store = KVStore(spec, 16, 4, device="cuda")
    store.allocate_host(8)
    assert store.host.is_pinned()
    mgr = KVCacheManager(16, 4, hash_seed=0, num_host_blocks=8)
    shadow = Shadow(store, seed=5)
    mgr.admit("p", list(range(6)))
    shadow.extend("p", mgr, 6)
    mgr.fork("p", "c")
    shadow.fork("p", "c")
    mgr.append("c", [9])
    store.copy_blocks(mgr.take_copies())    # queued on the current stream ...
    shadow.extend("c", mgr, 1)              # ... before this write, no synchronisation in between
    shadow.check("p", mgr)
    shadow.check("c", mgr)
    store.swap_out(mgr.swap_out("c"))
    store.data.fill_(float("nan"))          # everything on the device is gone
    mgr.free("p")
    mgr.reset_prefix_cache()
    store.swap_in(mgr.swap_in("c"))
    shadow.check("c", mgr)

