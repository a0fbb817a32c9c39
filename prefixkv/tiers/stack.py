"""The one place a face (engine, HF store, command line) turns tier options into a manager's stack.

``plan_stack(...)`` takes what a user types (host blocks, a disk directory and its byte budget, a
remote URL) and returns the ``tiers`` list for ``KVCacheManager`` with the hash seed and weights
digest the lower tiers need; ``bind_stack(manager, kv, plan)`` opens the lower tiers once the KV
store exists. The rules live here once:

* a tier that holds bytes (disk, remote) stages what it serves in the host tier, so it implies a
  caching host tier, sized ``default_host_blocks(num_blocks)`` when none is sized;
* it needs prefix caching and hashes every process agrees on: with ``hash_seed=None`` the seed is
  derived from the weights digest, dtype and block size (``derived_hash_seed``);
* tiers stack top first: host -> disk -> remote.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import InvalidArgument
from ..host_tier import HostTier
from ..checks import integer

__all__ = ["StackPlan", "plan_stack", "bind_stack", "default_host_blocks", "DEFAULT_DISK_BYTES"]

DEFAULT_DISK_BYTES = 4 * 2**30      # a disk tier's budget when none is given


def default_host_blocks(num_blocks: int) -> int:
    """The host tier a lower tier gets when none is sized: twice the device pool. A lower tier
    stages a prompt's fetched blocks there before admission, so it must hold at least one
    admissible prompt's blocks (at most the device pool) beside the host tier's own cache."""
    return 2 * num_blocks


@dataclass
class StackPlan:
    tiers: list = field(default_factory=list)     # KVCacheManager(tiers=...)
    hash_seed: int | None = None
    weights: bytes | None = None                  # the lower tiers' fingerprint needs it

    @property
    def lower(self) -> list:
        return [t for t in self.tiers if not isinstance(t, HostTier)]


def plan_stack(*, num_blocks: int, block_size: int, dtype, num_host_blocks: int = 0, host_cache: bool = False,
               host_policy="lru", host_inclusive: bool = False, hash_seed: int | None = 0,
               enable_caching: bool = True, model=None, weights: bytes | None = None,
               disk=None, disk_bytes: int | None = None, disk_config=None,
               remote: str | None = None, remote_config=None) -> StackPlan:
    """The stack for these options (see the module docs). ``model`` (or ``weights``, its digest) is
    read only when a lower tier is asked for."""
    lower = []
    if disk is not None:
        from .disk_tier import DiskTier
        lower.append(DiskTier(disk, DEFAULT_DISK_BYTES if disk_bytes is None else disk_bytes, config=disk_config))
    elif disk_bytes is not None:
        raise InvalidArgument("disk_bytes", "disk_bytes sizes a disk tier: give its directory too (disk=PATH)")
    if remote is not None:
        from .remote import RemoteTier
        lower.append(RemoteTier(remote, config=remote_config))
    if lower:
        what = lower[0].name.lower()
        if not enable_caching:
            raise InvalidArgument("enable_caching", f"a {what} tier needs prefix caching (enable_caching=True)")
        if weights is None:
            if model is None:
                raise InvalidArgument("model", f"a {what} tier needs the model's weights (their digest is in "
                                               "every stored block's fingerprint)")
            from .fingerprint import model_weights_digest
            weights = model_weights_digest(model)
        if hash_seed is None:
            from .fingerprint import derived_hash_seed
            hash_seed = derived_hash_seed(weights, dtype=dtype, block_size=block_size)
        num_host_blocks = num_host_blocks or default_host_blocks(integer("num_blocks", num_blocks, low=1))
        host_cache = True
    tiers = []
    if num_host_blocks:
        tiers.append(HostTier(num_host_blocks, policy=host_policy, cache=host_cache, inclusive=host_inclusive))
    elif host_cache:
        raise InvalidArgument("host_cache", "host_cache needs host blocks: pass num_host_blocks > 0")
    return StackPlan([*tiers, *lower], hash_seed, weights)


def bind_stack(manager, kv, plan: StackPlan, *, tp_rank: int = 0, tp_size: int = 1):
    """Give ``kv`` its host pool and open ``plan``'s lower tiers on it; returns ``manager.tiers``."""
    if manager.num_host_blocks and kv.host is None:
        kv.allocate_host(manager.num_host_blocks)
    if plan.lower:
        manager.tiers.bind(kv, weights=plan.weights, tp_rank=tp_rank, tp_size=tp_size)
    return manager.tiers
