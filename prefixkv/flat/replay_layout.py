"""The layout the compiled replay loop (``replay_kernels``, numba) and its Python side
(``prefixkv.sim.fastreplay``) share: policy kinds, the slots of its parameter arrays, its counters.
No numba here: the Python side reads these before it knows whether numba loads.
"""

NONE = -1           # end of a list
UNSET = -3          # a queue's cursor before the first walk of an allocation

LRU, FIFO, SLRU, S3FIFO, ARC, LFU, CLOCK, SIEVE, TWOQ, MQ, LEAF_LRU, GDSF, CAR, LRFU, LIRS, WTINYLFU, LECAR, BELADY, WORKLOAD = range(19)
COMPILED = {"lru": LRU, "fifo": FIFO, "slru": SLRU, "s3fifo": S3FIFO, "arc": ARC, "lfu": LFU,
            "clock": CLOCK, "sieve": SIEVE, "2q": TWOQ, "mq": MQ, "leaf-lru": LEAF_LRU, "gdsf": GDSF,
            "car": CAR, "lrfu": LRFU, "lirs": LIRS, "wtinylfu": WTINYLFU, "lecar": LECAR,
            "belady": BELADY, "workload": WORKLOAD}
GHOSTS = (S3FIFO, ARC, TWOQ, MQ, CAR, LRFU, LIRS, LECAR, WORKLOAD)    # the kinds that remember evicted ids

# ip (int64 policy parameters and scalars) and fp (float64) slots
IP_LIMIT, IP_MOVE, IP_MAXFREQ, IP_SMALL_TARGET, IP_GHOST_SIZE, IP_CAPACITY, IP_SIZE1, IP_SIZE2, \
    IP_ACCESSES, IP_HALF_LIFE, IP_TICKET, IP_HEAP, IP_NUM_PROTECTED, IP_INIT_FREQ, IP_HAND, IP_PUSHED, \
    IP_PUSHED_VALUE, IP_VTIME, IP_PENDING, IP_QUEUES, IP_LIFETIME, IP_HEAP2, IP_INHERIT, IP_EVICTED_PARENT, \
    IP_NOW, IP_WINDOW, IP_MEMORY, IP_MEMORY_CAP, IP_LEAF_PENALTY, IP_ACC_HEAD, IP_ACC_TAIL, IP_REL_HEAD, \
    IP_NUM_LIR, IP_LIR_LIMIT, IP_NONRESIDENT_LIMIT, \
    IP_SAMPLE, IP_COUNTED, IP_SIZE0 = range(38)      # IP_SIZE0 + 0, 1, 2: W-TinyLFU's segment sizes
IP_TIME = 41
IP_ESTIMATE_LIMIT = 48 - 1          # workload's (its other lengths are fp)
IP_LC_PUSHED = 42   # LeCaR, per history g: IP_LC_PUSHED + 3 g + (0: id or NONE, 1: its time, 2: its count)
IP_SLOTS = 48
FP_P, FP_CLOCK, FP_DEPTH_COST, FP_ORPHAN, FP_P_LEAF, FP_P_INNER, FP_MEDIAN, FP_UP, FP_DOWN, FP_LOW, FP_HIGH, \
    FP_INV_H, FP_TAU, FP_HALF_LIFE, FP_GHOST, FP_STEP, FP_MEMORY, FP_WINDOW, FP_RATE, FP_W_LRU, FP_W_LFU, \
    FP_LEARNING_RATE, FP_DISCOUNT, FP_MEAN, FP_WINDOW_TICKS = range(25)
FP_SLOTS = 32
# bint (int64 per block, 4 columns): GDSF's depth, parent id, and links of its parent's candidate set
B_DEPTH, B_PARENT, B_KPREV, B_KNEXT = range(4)
# bflt (float64 per block, 2 columns): GDSF's clock at release and value
BF_BASE, BF_VALUE = range(2)      # LRFU: BF_BASE holds the log-score at the last access
# gint (int64 per id, 2 columns): LRFU's tick of the last access and of its open leaf experiment
G_LAST, G_OPEN = range(2)
# LIRS: an id's status (sstat, int8 per id; -1: none) and its place in the stack S
LIR, HIR, NONRESIDENT = range(3)

# counters returned by the loop
C_EVICTIONS, C_CACHED, C_UNUSED, C_EVICTIONS_W, C_CACHED_W, C_UNUSED_W, C_UNUSED_CACHED = range(7)
