"""Argument converters shared by the command lines.

argparse words a converter's ValueError after the function's name ("invalid
_size value"), so each of these raises ArgumentTypeError with a message
written for the user instead.
"""

from __future__ import annotations

import argparse

from .checks import integer, real
from .sizing import DTYPE_BYTES, parse_size


def _parsed(text: str, parse, check, expected: str):
    """``check(parse(text))``, or the ArgumentTypeError that says what was ``expected``."""
    try:
        return check(parse(text))
    except ValueError:      # (InvalidArgument is one)
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None


def positive_int(text: str) -> int:
    return _parsed(text, int, lambda v: integer("value", v, low=1), "a positive integer")


def non_negative_int(text: str) -> int:
    return _parsed(text, int, lambda v: integer("value", v, low=0), "a non-negative integer")


def positive_float(text: str) -> float:
    return _parsed(text, float, lambda v: real("value", v, low=0, low_open=True), "a positive number")


def non_negative_float(text: str) -> float:
    return _parsed(text, float, lambda v: real("value", v, low=0), "a finite number >= 0")


def seed(text: str) -> int:
    """A random seed torch, numpy and the engine all take: an integer in [0, 2**63)."""
    return _parsed(text, int, lambda v: integer("value", v, low=0, high=2**63 - 1),
                   "an integer seed from 0 to 2**63 - 1")


def fraction(text: str) -> float:
    """A fraction in [0, 1)."""
    return _parsed(text, float, lambda v: real("value", v, low=0, high=1, high_open=True), "a fraction in [0, 1)")


def size(text: str) -> int:
    """Bytes, with binary units (``24GiB``)."""
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def positive_size(text: str) -> int:
    value = size(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a size above zero, got {text!r}")
    return value


def model_spec(text: str) -> dict:
    """``layers,kv_heads,head_dim[,dtype[,tp]]`` as ``KVSpec`` fields."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) not in (3, 4, 5):
        raise argparse.ArgumentTypeError(f"--model-spec is layers,kv_heads,head_dim[,dtype[,tp]], got {text!r}")
    try:
        out = dict(layers=int(parts[0]), kv_heads=int(parts[1]), head_dim=int(parts[2]))
        if len(parts) > 3:
            out["dtype"] = parts[3]
        if len(parts) > 4:
            out["tensor_parallel"] = int(parts[4])
    except ValueError:
        raise argparse.ArgumentTypeError(f"--model-spec is layers,kv_heads,head_dim[,dtype[,tp]], got {text!r}") from None
    bad = [name for name in ("layers", "kv_heads", "head_dim", "tensor_parallel") if name in out and out[name] <= 0]
    if bad:
        raise argparse.ArgumentTypeError(f"--model-spec: {', '.join(bad)} must be positive, got {text!r}")
    if "dtype" in out and out["dtype"] not in DTYPE_BYTES:
        raise argparse.ArgumentTypeError(f"--model-spec: unknown dtype {out['dtype']!r}; choose from "
                                         f"{', '.join(sorted(DTYPE_BYTES))}")
    return out
