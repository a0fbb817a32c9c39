"""The registry of eviction policies: built-in classes by name, ``register``, the
``prefixkv.policies`` entry point group, and ``make_policy`` for a name with options
(``"lrfu:half_life=4:ghost=1"``). The manager and the pools import this module, not the package,
so the conformance checker (``check``, which drives the manager) is never on their import path.
"""


from __future__ import annotations

import ast
import inspect
import typing
import warnings
from importlib.metadata import entry_points
from typing import Callable

from .arc import ARCPolicy
from .base import EvictionPolicy
from .belady import BeladyPolicy
from .car import CARPolicy
from .clock import ClockPolicy
from .fifo import FIFOPolicy
from .gdsf import GDSFPolicy
from .leaf_lru import LeafLRUPolicy
from .lecar import LeCaRPolicy
from .lfu import LFUPolicy
from .lirs import LIRSPolicy
from .lru import LRUPolicy
from .lrfu import LRFUPolicy
from .mq import MQPolicy
from .s3fifo import S3FIFOPolicy
from .session import SessionPolicy
from .sieve import SievePolicy
from .slru import SLRUPolicy
from .twoq import TwoQPolicy
from .workload import WorkloadPolicy
from .wtinylfu import WTinyLFUPolicy

ENTRY_POINT_GROUP = "prefixkv.policies"

_BUILTIN: dict[str, Callable[..., EvictionPolicy]] = {
    "lru": LRUPolicy,
    "fifo": FIFOPolicy,
    "lfu": LFUPolicy,
    "slru": SLRUPolicy,
    "s3fifo": S3FIFOPolicy,
    "arc": ARCPolicy,
    "leaf-lru": LeafLRUPolicy,
    "gdsf": GDSFPolicy,
    "workload": WorkloadPolicy,
    "lrfu": LRFUPolicy,
    "session": SessionPolicy,
    # the classics of the eviction literature (issue 28), for comparison
    "sieve": SievePolicy,
    "clock": ClockPolicy,
    "2q": TwoQPolicy,
    "mq": MQPolicy,
    "car": CARPolicy,
    "lirs": LIRSPolicy,
    "wtinylfu": WTinyLFUPolicy,
    "lecar": LeCaRPolicy,
    "belady": BeladyPolicy,
}


class PolicyRegistry:
    """Name -> policy factory. One registry per process is the default; tests
    may build their own."""

    def __init__(self, builtins: dict[str, Callable[..., EvictionPolicy]]) -> None:
        self._factories = dict(builtins)
        self._entry_points_loaded = False

    def register(self, name: str, factory: Callable[..., EvictionPolicy] | None = None):
        """Register ``factory`` under ``name``; usable as a class decorator."""

        def add(cls):
            if name in self._factories and self._factories[name] is not cls:
                raise ValueError(f"eviction policy {name!r} is already registered")
            self._factories[name] = cls
            return cls

        return add if factory is None else add(factory)

    def _load_entry_points(self) -> None:
        if self._entry_points_loaded:
            return
        self._entry_points_loaded = True
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name in self._factories:
                continue  # built-in and explicitly registered names win
            try:
                self._factories[ep.name] = ep.load()
            except Exception as exc:  # a broken plug-in must not break the built-in policies
                warnings.warn(f"cannot load eviction policy {ep.name!r} from entry point {ep.value!r}: "
                              f"{type(exc).__name__}: {exc}", RuntimeWarning, stacklevel=3)

    def names(self) -> list[str]:
        self._load_entry_points()
        return sorted(self._factories)

    def make(self, name: str, **options) -> EvictionPolicy:
        """Build a policy by name; ``"name:key=value:key=value"`` carries options in the name."""
        spec_options: dict = {}
        if ":" in name:
            name, spec_options = parse_policy_spec(name)
            options = {**spec_options, **options}
        if name not in self._factories:
            self._load_entry_points()
        try:
            factory = self._factories[name]
        except KeyError:
            names = (n + " (replay only)" if n == "belady" else n for n in self.names())
            raise ValueError(f"unknown eviction policy {name!r}; available: {', '.join(names)}") from None
        if not spec_options:  # keyword options fail as any call does (TypeError for a wrong name)
            return factory(**options)
        _check_options(name, factory, spec_options)
        try:
            return factory(**options)
        except (TypeError, ValueError) as exc:
            shown = ":".join(f"{k}={v!r}" for k, v in options.items())
            argument = getattr(exc, "argument", None)
            if isinstance(argument, str):   # an InvalidArgument keeps naming its option
                from prefixkv.errors import InvalidArgument

                raise InvalidArgument(argument, f"eviction policy {name!r} with {shown}: "
                                                f"{getattr(exc, 'problem', exc)}") from exc
            raise ValueError(f"eviction policy {name!r} with {shown}: {exc}") from exc


def parse_policy_spec(spec: str) -> tuple[str, dict]:
    """``"lrfu:half_life=4:ghost=1"`` -> ``("lrfu", {"half_life": 4, "ghost": 1})``.

    Values are Python literals (numbers, ``True``/``False``/``None``, also
    lower-case ``true``/``false``/``none``), anything else a string.
    """
    name, *parts = spec.split(":")
    options: dict = {}
    for part in parts:
        key, sep, text = part.partition("=")
        key = key.strip()
        if not sep or not key.isidentifier():
            raise ValueError(f"bad policy option {part!r} in {spec!r}: expected key=value, "
                             f"as in 'lrfu:half_life=4:ghost=1'")
        if key in options:
            raise ValueError(f"policy option {key!r} given twice in {spec!r}")
        text = text.strip()
        lowered = {"true": "True", "false": "False", "none": "None"}.get(text, text)
        try:
            options[key] = ast.literal_eval(lowered)
        except (ValueError, SyntaxError):
            options[key] = text
    return name.strip(), options


def _check_options(name: str, factory, options: dict) -> None:
    try:
        params = inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a factory without a signature: let it judge
        return
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    accepted = [k for k, p in params.items() if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)]
    unknown = [k for k in options if k not in accepted]
    if unknown:
        raise ValueError(f"eviction policy {name!r} has no option {', '.join(map(repr, unknown))}; "
                         f"its options: {', '.join(accepted) or 'none'}")
    try:
        hints = typing.get_type_hints(factory.__init__ if isinstance(factory, type) else factory)
    except Exception:  # unresolvable annotations: fall back to the defaults' types
        hints = {}
    for key, value in options.items():
        allowed = _allowed_types(hints.get(key), params[key].default)
        if allowed and not _is_instance(value, allowed):
            words = {bool: "true/false", type(None): "none", int: "an integer", float: "a number", str: "text"}
            names = " or ".join(words.get(t, t.__name__) for t in allowed)
            raise ValueError(f"eviction policy {name!r}: option {key}={value!r} should be {names}")


def _allowed_types(hint, default) -> tuple:
    """The plain types an option accepts, from its annotation or else its default (() = any)."""
    if hint is not None:
        args = typing.get_args(hint) or (hint,)
        types = tuple(a for a in args if isinstance(a, type))
        return types if len(types) == len(args) else ()
    if default is inspect.Parameter.empty or default is None:
        return ()
    return (type(default),)


def _is_instance(value, allowed: tuple) -> bool:
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int) and float in allowed:
        return True
    return isinstance(value, allowed)


BUILTIN_POLICIES = tuple(_BUILTIN)
REGISTRY = PolicyRegistry(_BUILTIN)
register = REGISTRY.register
make_policy = REGISTRY.make
available_policies = REGISTRY.names
