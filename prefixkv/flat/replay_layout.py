"""The layout the compiled replay loop (``replay_kernels``, numba) and its Python side
(``prefixkv.sim.fastreplay``) share: policy kinds, the slots of its parameter arrays, its counters.
No numba here: the Python side reads these before it knows whether numba loads.
"""

NONE = -1           # end of a list
UNSET = -3          # a queue's cursor before the first walk of an allocation

LRU, FIFO, SLRU, S3FIFO, ARC, LFU, CLOCK, SIEVE, TWOQ, MQ, LEAF_LRU, GDSF = range(12)
COMPILED = {"lru": LRU, "fifo": FIFO, "slru": SLRU, "s3fifo": S3FIFO, "arc": ARC, "lfu": LFU,
            "clock": CLOCK, "sieve": SIEVE, "2q": TWOQ, "mq": MQ, "leaf-lru": LEAF_LRU, "gdsf": GDSF}
CHAINS = (LEAF_LRU, GDSF)           # the kinds that read a block's parent and depth
GHOSTS = (S3FIFO, ARC, TWOQ, MQ)    # the kinds that remember evicted ids

# ip (int64 policy parameters and scalars) and fp (float64) slots
IP_LIMIT, IP_MOVE, IP_MAXFREQ, IP_SMALL_TARGET, IP_GHOST_SIZE, IP_CAPACITY, IP_SIZE1, IP_SIZE2, \
    IP_ACCESSES, IP_HALF_LIFE, IP_TICKET, IP_HEAP, IP_NUM_PROTECTED, IP_INIT_FREQ, IP_HAND, IP_PUSHED, \
    IP_PUSHED_VALUE, IP_VTIME, IP_PENDING, IP_QUEUES, IP_LIFETIME, IP_HEAP2, IP_INHERIT, IP_EVICTED_PARENT \
    = range(24)
IP_SLOTS = 32
FP_P, FP_CLOCK, FP_DEPTH_COST, FP_ORPHAN = range(4)
FP_SLOTS = 8
# bint (int64 per block, 4 columns): GDSF's depth, parent id, and links of its parent's candidate set
B_DEPTH, B_PARENT, B_KPREV, B_KNEXT = range(4)
# bflt (float64 per block, 2 columns): GDSF's clock at release and value
BF_BASE, BF_VALUE = range(2)

# counters returned by the loop
C_EVICTIONS, C_CACHED, C_UNUSED, C_EVICTIONS_W, C_CACHED_W, C_UNUSED_W, C_UNUSED_CACHED = range(7)
