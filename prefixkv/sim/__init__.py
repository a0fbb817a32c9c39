"""The trace lab (no torch): trace readers and writers (``traces``), the seeded workload
generator (``workloads``), one replay through the real manager (``replay``), the policy x
capacity sweep behind ``prefixkv compare`` (``sweep``), and the design notes' small-pool
lab with its numpy slot store (``lab``, ``slotstore``).
"""
