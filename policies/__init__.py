"""Eviction policies, chosen by name.

``make_policy("lru")`` builds one (keyword options go to the class, or come in
the name: ``make_policy("lrfu:half_life=4:ghost=1")``, so a command line can
sweep settings);
``register("name")`` adds a class, and third-party packages can add theirs
through the ``prefixkv.policies`` entry point group (the entry point loads the
class; its key is the registry name; a built-in name always wins).

Built in: ``lru``, ``fifo``, ``lfu``, ``slru``, ``s3fifo``, ``arc``,
``leaf-lru``, ``gdsf``, ``workload``, ``lrfu``, ``session`` (uses the session hints
of ``free()``), the classics ``sieve``, ``clock``, ``2q``, ``mq``, ``car``, ``lirs``,
``wtinylfu`` and ``lecar`` (each cites its paper; README "Policies and libCacheSim" says which
equal libCacheSim's algorithm of the same name), and the offline bound ``belady`` (needs
``set_next_use`` from a trace replayer). ``PriorityPolicy(inner, ...)`` wraps
any of them to pin or prioritise blocks.
"""

from .arc import ARCPolicy
from .base import EvictionPolicy, PolicyBase, SessionHint
from .belady import BeladyPolicy
from .car import CARPolicy
from .check import PolicyCheckFailed, PolicyReport, check_policy
from .clock import ClockPolicy
from .fifo import FIFOPolicy
from .gdsf import GDSFPolicy
from .leaf_lru import LeafLRUPolicy
from .lecar import LeCaRPolicy
from .lfu import LFUPolicy
from .lirs import LIRSPolicy
from .lrfu import LRFUPolicy
from .lru import LRUPolicy
from .mq import MQPolicy
from .priority import PriorityPolicy
from .registry import (BUILTIN_POLICIES, ENTRY_POINT_GROUP, REGISTRY, PolicyRegistry, available_policies,
                       make_policy, parse_policy_spec, register)
from .s3fifo import S3FIFOPolicy
from .session import SessionPolicy
from .sieve import SievePolicy
from .slru import SLRUPolicy
from .twoq import TwoQPolicy
from .workload import WorkloadPolicy
from .wtinylfu import WTinyLFUPolicy

__all__ = [
    "EvictionPolicy",
    "PolicyBase",
    "SessionHint",
    "LRUPolicy",
    "FIFOPolicy",
    "LFUPolicy",
    "SLRUPolicy",
    "S3FIFOPolicy",
    "ARCPolicy",
    "LeafLRUPolicy",
    "GDSFPolicy",
    "WorkloadPolicy",
    "LRFUPolicy",
    "SessionPolicy",
    "BeladyPolicy",
    "SievePolicy",
    "ClockPolicy",
    "TwoQPolicy",
    "MQPolicy",
    "CARPolicy",
    "LIRSPolicy",
    "WTinyLFUPolicy",
    "LeCaRPolicy",
    "PriorityPolicy",
    "PolicyRegistry",
    "ENTRY_POINT_GROUP",
    "REGISTRY",
    "BUILTIN_POLICIES",
    "register",
    "make_policy",
    "parse_policy_spec",
    "check_policy",
    "PolicyCheckFailed",
    "PolicyReport",
    "available_policies",
]
