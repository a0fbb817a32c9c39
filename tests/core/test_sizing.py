import pytest

from prefixkv import KVSpec, format_size, parse_size, plan, tail_waste


def test_seed_model_24gib():
    spec = KVSpec(layers=32, kv_heads=8, head_dim=128, dtype="bfloat16")
    assert spec.bytes_per_token == 131_072 == 128 * 2**10
    p = plan(spec, block_size=16, pool_bytes=parse_size("24GiB"), prompt_tokens=4097)
    assert p.num_blocks == 12_288
    assert p.blocks_per_request == 257
    assert p.max_requests == 47
    assert p.leftover_blocks == 209


def test_seed_exercise_8gib_1025_tokens():
    spec = KVSpec(layers=24, kv_heads=4, head_dim=128, dtype="bfloat16")
    p = plan(spec, 16, parse_size("8GiB"), 1025)
    assert p.bytes_per_token == 49_152
    assert p.bytes_per_block == 768 * 2**10
    assert p.num_blocks == 10_922
    assert p.blocks_per_request == 65
    assert p.max_requests == 168
    assert p.leftover_blocks == 2
    assert p.unallocated_bytes == 512 * 2**10


@pytest.mark.parametrize("block_size,blocks,slots,waste,mib", [(4, 29, 116, 4, 0.5), (16, 8, 128, 16, 2), (64, 3, 192, 80, 10)])
def test_tail_waste_table(block_size, blocks, slots, waste, mib):
    t = tail_waste([17, 32, 63], block_size)
    assert (t["blocks"], t["slots"], t["useful"], t["tail_waste"]) == (blocks, slots, 112, waste)
    assert t["tail_waste"] * 128 * 2**10 == mib * 2**20


@pytest.mark.parametrize("heads,tp,per_gpu", [(8, 1, 8), (8, 2, 4), (8, 8, 1), (8, 16, 1), (1, 4, 1)])
def test_tensor_parallel_heads_per_gpu(heads, tp, per_gpu):
    spec = KVSpec(32, heads, 128, "bfloat16", tensor_parallel=tp)
    assert spec.kv_heads_per_gpu == per_gpu
    assert spec.bytes_per_token == 2 * 32 * per_gpu * 128 * 2


@pytest.mark.parametrize("heads,tp", [(8, 3), (8, 12)])
def test_tensor_parallel_must_divide(heads, tp):
    with pytest.raises(ValueError, match="tensor parallel|split evenly"):
        KVSpec(32, heads, 128, tensor_parallel=tp)


def test_dtypes_and_bad_spec():
    assert KVSpec(1, 1, 1, "float32").bytes_per_token == 8
    assert KVSpec(1, 1, 1, "fp8").bytes_per_token == 2
    with pytest.raises(ValueError, match="unknown dtype"):
        KVSpec(1, 1, 1, "float64x")
    with pytest.raises(ValueError, match="layers must be positive"):
        KVSpec(0, 1, 1)


@pytest.mark.parametrize("text,value", [("24GiB", 24 * 2**30), ("512 MiB", 512 * 2**20), ("1.5KiB", 1536),
                                        ("4096", 4096), ("7B", 7), ("1TiB", 2**40)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["24GB", "1k", "abc", "1.3B", "-5", "3 parsecs"])
def test_parse_size_refuses(text):
    with pytest.raises(ValueError):
        parse_size(text)


def test_format_size():
    assert format_size(131072) == "128 KiB"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(24 * 2**30) == "24 GiB"
    assert format_size(100) == "100 B"


# -- parse_size: exact, whole ASCII bytes ---------------------------------------------------------

@pytest.mark.parametrize("text, value", [
    ("9007199254740993", 2**53 + 1),                  # a byte count past float precision
    ("12345678901234567891", 12345678901234567891),
    ("4.5TiB", 9 * 2**39),
    ("0.5KiB", 512),
])
def test_parse_size_is_exact(text, value):
    from prefixkv.sizing import parse_size

    assert parse_size(text) == value


@pytest.mark.parametrize("text", ["1.0000000000000001GiB", "0.3B", "\u0663GiB"])
def test_parse_size_refuses_what_is_not_whole_ascii_bytes(text):
    from prefixkv.sizing import parse_size

    with pytest.raises(ValueError):
        parse_size(text)


# -- KVSpec and plan: non-integer, zero and negative inputs ------------------------------------------

def test_kvspec_refuses_non_integer_fields():
    from prefixkv.sizing import KVSpec

    with pytest.raises(ValueError, match="layers"):
        KVSpec(layers=1.5, kv_heads=8, head_dim=128)           # was: a float bytes_per_token
    with pytest.raises(ValueError, match="head_dim"):
        KVSpec(layers=32, kv_heads=8, head_dim="128")          # was: TypeError
    with pytest.raises(ValueError, match="kv_heads"):
        KVSpec(layers=32, kv_heads=True, head_dim=128)


def test_block_and_pool_sizes_are_checked():
    from prefixkv.sizing import KVSpec, plan

    spec = KVSpec(32, 8, 128)
    with pytest.raises(ValueError, match="block_size"):
        spec.num_blocks(2**30, 0)                              # was ZeroDivisionError
    with pytest.raises(ValueError, match="block_size"):
        spec.bytes_per_block(-16)                              # was a negative byte count
    with pytest.raises(ValueError, match="pool_bytes"):
        spec.num_blocks(-1, 16)
    with pytest.raises(ValueError, match="pool_bytes"):
        plan(spec, 16, -5, 10)                                 # was num_blocks -1, max_requests -1
    with pytest.raises(ValueError, match="host_pool_bytes"):
        plan(spec, 16, 2**30, 10, host_pool_bytes=-1)
