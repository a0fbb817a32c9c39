"""The layout the compiled replay loop (``replay_kernels``, numba) and its Python side
(``prefixkv.sim.fastreplay``) share: policy kinds, the slots of its parameter arrays, its counters.
No numba here: the Python side reads these before it knows whether numba loads.
"""

NONE = -1           # end of a list
UNSET = -3          # a queue's cursor before the first walk of an allocation

LRU, FIFO, SLRU, S3FIFO, ARC, LFU = range(6)
COMPILED = {"lru": LRU, "fifo": FIFO, "slru": SLRU, "s3fifo": S3FIFO, "arc": ARC, "lfu": LFU}

# ip (int64 policy parameters and scalars) and fp (float64) slots
IP_LIMIT, IP_MOVE, IP_MAXFREQ, IP_SMALL_TARGET, IP_GHOST_SIZE, IP_CAPACITY, IP_SIZE1, IP_SIZE2, \
    IP_ACCESSES, IP_HALF_LIFE, IP_TICKET, IP_HEAP, IP_NUM_PROTECTED = range(13)
FP_P = 0

# counters returned by the loop
C_EVICTIONS, C_CACHED, C_UNUSED, C_EVICTIONS_W, C_CACHED_W, C_UNUSED_W, C_UNUSED_CACHED = range(7)
