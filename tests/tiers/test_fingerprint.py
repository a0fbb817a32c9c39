"""The compatibility fingerprint of a remote tier: every field that shapes KV bytes changes it; bad
fields are refused naming them, and integer-like ones (numpy ints) name the same fingerprint."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import numpy as np
import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.tiers.fingerprint import Fingerprint, UnpinnedHashSeed, derived_hash_seed, weights_digest

WEIGHTS = weights_digest([("w", np.arange(12, dtype=np.float32))])
BASE = dict(weights=WEIGHTS, dtype="bfloat16", layers=2, kv_heads=2, head_dim=8, block_size=4, hash_seed=7)


def test_two_tiny_models_with_different_seeds_never_share():
    torch = pytest.importorskip("torch")
    from prefixkv.engine import TinyLlama, TinyLlamaConfig

    digests = {}
    for seed in (0, 1):
        model = TinyLlama(TinyLlamaConfig(seed=seed))
        digests[seed] = weights_digest(model.state_dict().items())
    assert digests[0] != digests[1]
    again = TinyLlama(TinyLlamaConfig(seed=0))
    assert weights_digest(again.state_dict().items()) == digests[0]       # contents, not object identity
    fps = {seed: Fingerprint(**{**BASE, "weights": d}) for seed, d in digests.items()}
    assert fps[0].digest != fps[1].digest
    # bf16 tensors (no numpy dtype) are read through a byte view
    bf16 = torch.arange(6, dtype=torch.bfloat16)
    assert weights_digest([("x", bf16)]) != weights_digest([("x", bf16.float())])


def test_weights_digest_sees_names_shapes_and_single_bytes():
    a = np.zeros(8, dtype=np.float16)
    b = a.copy()
    b[3] = 1
    assert weights_digest([("a", a)]) != weights_digest([("a", b)])
    assert weights_digest([("a", a)]) != weights_digest([("b", a)])
    assert weights_digest([("a", a)]) != weights_digest([("a", a.reshape(2, 4))])
    assert weights_digest([("a", a), ("b", b)]) == weights_digest([("b", b), ("a", a)])   # name order
    with pytest.raises(ValueError, match="twice"):
        weights_digest([("a", a), ("a", b)])
    with pytest.raises(ValueError, match="at least one"):
        weights_digest([])


@pytest.mark.parametrize("field, other", [
    ("weights", weights_digest([("w", np.arange(12, dtype=np.float32) + 1)])),
    ("dtype", "float16"), ("layers", 3), ("kv_heads", 1), ("head_dim", 16), ("block_size", 8),
    ("hash_seed", 8), ("hash_algorithm", "xxh3_64"), ("tp_rank", 1), ("layout", "L2HBD"),
])
def test_every_field_changes_the_digest(field, other):
    base = Fingerprint(**BASE, tp_size=2)
    changed = Fingerprint(**{**BASE, field: other}, tp_size=2)
    assert changed.digest != base.digest
    assert len(base.digest) == 16 and base.hex == base.digest.hex()


def test_tp_size_changes_the_digest_and_dtype_aliases_do_not():
    assert Fingerprint(**BASE).digest != Fingerprint(**BASE, tp_size=2).digest
    assert Fingerprint(**{**BASE, "dtype": "bf16"}).digest == Fingerprint(**BASE).digest
    assert Fingerprint(**{**BASE, "dtype": "torch.bfloat16"}).digest == Fingerprint(**BASE).digest


def test_a_remote_tier_requires_a_pinned_seed_and_says_so():
    with pytest.raises(UnpinnedHashSeed, match="hash_seed"):
        Fingerprint(**{**BASE, "hash_seed": None})
    with pytest.raises(UnpinnedHashSeed):      # refused before the weights are read
        Fingerprint.for_model(iter(()), dtype="bf16", layers=1, kv_heads=1, head_dim=8, block_size=4, hash_seed=None)
    seed = derived_hash_seed(WEIGHTS, dtype="bf16", block_size=4)
    assert seed == derived_hash_seed(WEIGHTS, dtype="bfloat16", block_size=4)
    assert seed != derived_hash_seed(WEIGHTS, dtype="bf16", block_size=8)
    assert Fingerprint(**{**BASE, "hash_seed": seed}).hash_seed == seed


@pytest.mark.parametrize("change, match", [
    ({"layers": 0}, "layers"), ({"tp_rank": 2}, "tp_rank"), ({"dtype": "int4"}, "dtype"),
    ({"hash_algorithm": "md5"}, "algorithm"), ({"weights": b"x"}, "weights"), ({"layout": ""}, "layout"),
])
def test_bad_fields_are_refused(change, match):
    with pytest.raises(ValueError, match=match):
        Fingerprint(**{**BASE, **change})


def test_sizes():
    fp = Fingerprint(**BASE)
    assert fp.block_bytes == 2 * 2 * 4 * 2 * 8 * 2
    assert fp.hash_size == 16 and Fingerprint(**{**BASE, "hash_algorithm": "xxh3_64"}).hash_size == 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        fp.layers = 3


def test_the_package_and_its_pure_modules_import_neither_redis_nor_torch():
    code = ("import json, sys, prefixkv, prefixkv.tiers, prefixkv.tiers.fingerprint, prefixkv.tiers.block_codec, "
            "prefixkv.tiers.redis_keys\n"
            "print(json.dumps([m for m in ('redis', 'torch') if m in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", layers=2, kv_heads=2,
                 head_dim=8, block_size=4, hash_seed=7)


# -- bad fields: InvalidArgument naming the field ---------------------------------------------------

FP_ARGS = dict(weights=FP.weights, dtype="float16", layers=2, kv_heads=2, head_dim=8, block_size=4, hash_seed=7)


@pytest.mark.parametrize("change, argument", [
    ({"hash_algorithm": "md5"}, "hash_algorithm"), ({"dtype": "int4"}, "dtype"), ({"weights": b"x"}, "weights"),
    ({"layout": ""}, "layout"), ({"layout": 5}, "layout"), ({"layers": 0}, "layers"),
    # a float or a boolean dimension was taken (int(2.5) passed the check) and went into the digest as
    # written: layers=2.0 and layers=2 named different fingerprints, so the replicas shared nothing
    ({"layers": 2.0}, "layers"), ({"layers": 2.5}, "layers"), ({"kv_heads": True}, "kv_heads"),
    ({"block_size": "4"}, "block_size"), ({"tp_size": 1.5}, "tp_size"), ({"tp_rank": 2}, "tp_rank"),
    ({"tp_rank": 0.0}, "tp_rank"), ({"hash_seed": "7"}, "hash_seed"), ({"hash_seed": 7.0}, "hash_seed"),
    ({"hash_seed": True}, "hash_seed"),
])
def test_bad_fingerprint_fields_are_refused_naming_them(change, argument):
    with pytest.raises(InvalidArgument) as info:
        Fingerprint(**{**FP_ARGS, **change})
    assert info.value.argument == argument


def test_integer_like_fingerprint_fields_name_the_same_fingerprint():
    assert Fingerprint(**{**FP_ARGS, "layers": np.int64(2), "hash_seed": np.uint32(7)}).digest == FP.digest
    assert type(Fingerprint(**{**FP_ARGS, "layers": np.int64(2)}).layers) is int


def test_weights_digest_and_dtype_refusals_name_the_argument():
    from prefixkv.tiers.fingerprint import canonical_dtype

    with pytest.raises(InvalidArgument) as info:
        weights_digest([("w", np.zeros(2)), ("w", np.ones(2))])
    assert info.value.argument == "named_tensors" and "twice" in str(info.value)
    with pytest.raises(InvalidArgument, match="at least one") as info:
        weights_digest([])
    assert info.value.argument == "named_tensors"
    with pytest.raises(InvalidArgument) as info:
        canonical_dtype("int4")
    assert info.value.argument == "dtype"
