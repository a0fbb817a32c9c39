"""The numeric argument checks every part uses (prefixkv.checks): what each takes, what each
refuses, and that a refusal is an InvalidArgument naming the argument."""

import math

import numpy as np
import pytest

from prefixkv.checks import integer, real, seconds
from prefixkv.errors import InvalidArgument


@pytest.mark.parametrize("value, kwargs, expect", [
    (3, {}, 3),
    (np.int64(7), {"low": 1}, 7),
    (np.uint8(0), {"low": 0}, 0),
    (2.0, {"integral_float": True}, 2),
    (-5, {"low": -5, "high": 0}, -5),
])
def test_integer_takes_integers(value, kwargs, expect):
    got = integer("n", value, **kwargs)
    assert got == expect and type(got) is int


@pytest.mark.parametrize("value, kwargs, fragment", [
    (True, {}, "must be an integer, got bool True"),
    (2.5, {}, "must be an integer, got float 2.5"),
    (2.0, {}, "must be an integer, got float 2.0"),          # only with integral_float
    (2.5, {"integral_float": True}, "must be an integer, got float 2.5"),
    (math.inf, {"integral_float": True}, "must be an integer, got float inf"),
    ("3", {}, "must be an integer, got str '3'"),
    (None, {}, "must be an integer, got NoneType None"),
    (0, {"low": 1}, "must be positive, got 0"),
    (-1, {"low": 0}, "must be >= 0, got -1"),
    (11, {"low": 2, "high": 10}, "must be >= 2 and <= 10, got 11"),
])
def test_integer_refuses_naming_the_argument(value, kwargs, fragment):
    with pytest.raises(InvalidArgument) as info:
        integer("count", value, **kwargs)
    assert info.value.argument == "count" and str(info.value) == f"count: {fragment}"


@pytest.mark.parametrize("value, kwargs, fragment", [
    (math.nan, {}, "must be finite, got nan"),
    (math.inf, {}, "must be finite, got inf"),
    (math.nan, {"finite": False}, "must be finite, got nan"),     # NaN passes no bound
    (False, {}, "must be a number, got bool False"),
    ("0.5", {}, "must be a number, got str '0.5'"),
    (0.0, {"low": 0, "low_open": True}, "must be positive, got 0.0"),
    (1.0, {"low": 0, "high": 1, "high_open": True}, "must be >= 0 and < 1, got 1.0"),
    (-0.1, {"low": 0}, "must be >= 0, got -0.1"),
])
def test_real_refuses_naming_the_argument(value, kwargs, fragment):
    with pytest.raises(InvalidArgument) as info:
        real("rate", value, **kwargs)
    assert str(info.value) == f"rate: {fragment}"


def test_real_takes_numbers_as_given_and_infinity_where_asked():
    assert real("x", 3, low=0) == 3 and type(real("x", 3)) is int
    assert real("x", np.float32(0.25), low=0, high=1) == 0.25
    assert real("ttl", math.inf, low=0, low_open=True, finite=False) == math.inf


def test_seconds_are_finite_floats_zero_only_where_allowed():
    assert seconds("timeout_s", 2) == 2.0 and type(seconds("timeout_s", 2)) is float
    assert seconds("timeout_s", 0, zero=True) == 0.0
    for bad, zero in ((0, False), (-1, True), (math.inf, True), (True, True), ("1", True)):
        with pytest.raises(InvalidArgument, match="^timeout_s: "):
            seconds("timeout_s", bad, zero=zero)


def test_every_part_uses_the_one_module():
    """The helpers these checks replaced are gone (a part growing its own again is caught here)."""
    import pathlib
    root = pathlib.Path(__file__).resolve().parents[2]
    names = ("def _size(", "def _check_count(", "def int_argument(", "def seconds_argument(",
             "def number_option(", "def _check_integer(", "def _check_real(")
    found = [f"{p.relative_to(root)}: {name}" for folder in ("prefixkv", "policies")
             for p in sorted((root / folder).rglob("*.py")) for name in names if name in p.read_text()]
    assert found == []
