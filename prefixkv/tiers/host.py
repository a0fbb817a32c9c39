"""The host tier lives in the core (``prefixkv.host_tier``): the manager's swap space and the first
tier below the device pool are one pool, which the manager builds and drives itself. Kept here so
``prefixkv.tiers.host.HostTier`` still names it."""

from ..host_tier import MEDIUM, HostTier

__all__ = ["HostTier", "MEDIUM"]
