"""The trace lab (no torch): trace readers and writers (``traces``), the seeded workload
generator (``workloads``), one replay through the real manager (``replay``), the policy x
capacity sweep behind ``prefixkv compare`` (``sweep``), and the design notes' small-pool
lab with its numpy slot store (``lab``, ``slotstore``).
"""

from .replay import ReplayResult, replay
from .traces import Trace, TraceFormatError, TraceRequest, load_trace
from .workloads import DEFAULT_WORKLOAD, WorkloadConfig, generate_trace

__all__ = ["Trace", "TraceRequest", "TraceFormatError", "load_trace", "replay", "ReplayResult",
           "WorkloadConfig", "DEFAULT_WORKLOAD", "generate_trace"]
