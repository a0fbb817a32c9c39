"""Checks of numeric arguments, shared by every part: a bad number is refused the same way
everywhere, before anything keeps it, by an ``InvalidArgument`` naming the argument.

Booleans are refused as numbers (``True`` would pass as 1); numpy scalars are taken. A NaN fails
every comparison, so a range check written as ``if x <= 0: raise`` lets it through: ``real``
refuses NaN and the infinities before it compares.
"""

from __future__ import annotations

import math
import numbers
import operator

from .errors import InvalidArgument

__all__ = ["integer", "real", "seconds"]


def _bounds(low, high, low_open: bool = False, high_open: bool = False) -> str:
    if high is None and (low == 0 and low_open or low == 1 and not low_open):
        return "positive"
    parts = [] if low is None else [f"{'>' if low_open else '>='} {low}"]
    if high is not None:
        parts.append(f"{'<' if high_open else '<='} {high}")
    return " and ".join(parts)


def _outside(value, low, high, low_open: bool, high_open: bool) -> bool:
    return (low is not None and (value <= low if low_open else value < low)) or (
        high is not None and (value >= high if high_open else value > high))


def integer(name: str, value: object, *, low: int | None = None, high: int | None = None,
            integral_float: bool = False) -> int:
    """``value`` as an ``int`` within ``[low, high]``. An integral float such as ``2.0`` is taken
    only with ``integral_float``: ``int(2.5)`` would pass a check, and a float written into a
    digest or a key reads ``"2.0"``."""
    try:
        if isinstance(value, bool):
            raise TypeError
        number = operator.index(value)      # an int, a numpy integer, a 0-d integer tensor
    except TypeError:
        if isinstance(value, bool) or not (integral_float and isinstance(value, numbers.Real)
                                           and math.isfinite(value) and value == int(value)):
            raise InvalidArgument(name, f"must be an integer, got {type(value).__name__} {value!r}") from None
        number = int(value)
    if _outside(number, low, high, False, False):
        raise InvalidArgument(name, f"must be {_bounds(low, high)}, got {number}")
    return number


def real(name: str, value: object, *, low: float | None = None, high: float | None = None,
         low_open: bool = False, high_open: bool = False, finite: bool = True) -> float:
    """``value``, a real number within the bounds (``low_open`` / ``high_open``: the bound itself
    is out), finite unless ``finite`` is False (an infinity then means "never", as in a TTL; NaN
    is refused either way). Returned as given (an int stays an int)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgument(name, f"must be a number, got {type(value).__name__} {value!r}")
    if math.isnan(value) or finite and math.isinf(value):
        raise InvalidArgument(name, f"must be finite, got {value!r}")
    if _outside(value, low, high, low_open, high_open):
        raise InvalidArgument(name, f"must be {_bounds(low, high, low_open, high_open)}, got {value!r}")
    return value


def seconds(name: str, value: object, *, zero: bool = False) -> float:
    """A finite duration as a float: positive, or ``>= 0`` with ``zero``. An infinite timeout is
    an unbounded wait, which nothing here may ask for."""
    if not isinstance(value, bool) and not isinstance(value, numbers.Real) and hasattr(value, "__float__"):
        value = float(value)        # (a numpy float is Real already; this takes other float-likes)
    return float(real(name, value, low=0, low_open=not zero))
