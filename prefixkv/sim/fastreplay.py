"""Cache-mode replay compiled (numba): the pool, its hash index and a built-in policy in one loop.

``replay`` hands a replay here when its policy is a built-in one named by a string (``COMPILED``),
the mode is ``cache`` and there is no tier below the device (``replay._why_not_compiled`` says why not):
the loop then runs over a trace's ``BlockArrays`` (dense ids, request offsets) with no Python step
per request. It is the general path's pool, step for step, on integers:

* a request's hits are its leading cached ids; they are taken (pinned) before anything else moves;
* its other blocks come from the free stack (last released first), then blocks never handed out
  (ascending), then the policy's victims, one ``evict`` after another, as ``BlockPool._claim``;
* its fresh blocks are published in order; an id cached already (further down a chain that
  missed) leaves its block a duplicate, which goes back to the free stack at the release;
* the release runs tail first: cached primaries become candidates (``on_released``), the rest
  (duplicates, a token request's partial last block) go on the free stack;
* a request of more blocks than the pool is counted all misses and changes nothing.

The policies are the Python classes' rules on the same events (``policies/*.py``): the same
victims, in the same order, so every figure of the result is the general path's (the lockstep
tests, ``tests/sim/test_fast_replay.py``, compare both on random and shared traces). Block ids are
assigned as the pool assigns them, so a policy whose ties fell to block ids would tie the same way.
The policies that read a block's chain (leaf-LRU, GDSF) get its parent id and depth from its
place in the request that published it, as the pool records ``parent_hash`` and ``depth``; the
ghost lists of 2Q, MQ and LeCaR keep ``GhostList``'s pushed-out entry (``policies/ghosts.py``).
Belady's oracle hears each reference's next use (the next request naming its id) before the request
is admitted, as ``replay`` tells ``set_next_use``; LeCaR draws its expert with MT19937 from
``random.Random(seed)``'s own state, so its draws are the class's.

Still on the general path: ``session`` (its hints and forecasts) and ``workload:by_depth=true``
(classes of a root and a depth bucket), and any policy object.

The loop itself is ``prefixkv.flat.replay_kernels`` (numba), compiled once per policy kind (each
kind's loop holds only its own policy's code) and imported only when a compiled replay runs: this
module imports without numba (``replay`` asks ``prefixkv.flat.available()`` first).
"""

from __future__ import annotations

import numpy as np

from ..flat.replay_layout import (  # noqa: F401  (the counters too: replay reads them here)
    ARC, B_DEPTH, C_CACHED, C_CACHED_W, C_EVICTIONS, C_EVICTIONS_W, C_UNUSED, C_UNUSED_CACHED, C_UNUSED_W, CLOCK,
    COMPILED, FIFO, FP_DEPTH_COST, FP_ORPHAN, FP_SLOTS, GDSF, GHOSTS, IP_CAPACITY, IP_GHOST_SIZE, IP_HALF_LIFE,
    IP_HAND, IP_INHERIT, IP_INIT_FREQ, IP_LIFETIME, IP_LIMIT, IP_MAXFREQ, IP_MOVE, IP_PUSHED, IP_QUEUES, IP_SLOTS,
    IP_SMALL_TARGET, LEAF_LRU, LFU, LRU, MQ, NONE, S3FIFO, SIEVE, SLRU, TWOQ)
from ..flat.replay_layout import (CAR, FP_DOWN, FP_GHOST, FP_HALF_LIFE, FP_MEDIAN, FP_MEMORY, FP_P_INNER, FP_P_LEAF,
                                  FP_RATE, FP_STEP, FP_UP, FP_WINDOW, IP_LEAF_PENALTY, IP_LIR_LIMIT, IP_MEMORY_CAP,
                                  IP_NONRESIDENT_LIMIT, IP_REL_HEAD, LIRS, LRFU)
from ..flat.replay_layout import IP_SAMPLE, IP_WINDOW, WTINYLFU
from ..flat.replay_layout import BELADY, FP_MEAN, FP_P, FP_WINDOW_TICKS, IP_ESTIMATE_LIMIT, WORKLOAD
from ..flat.replay_layout import FP_DISCOUNT, FP_LEARNING_RATE, FP_W_LFU, FP_W_LRU, IP_LC_PUSHED, LECAR


# -- the Python side ---------------------------------------------------------------------------------

def policy_kind(policy) -> tuple[int, dict] | None:
    """(kind, parameters) of a policy spec the compiled loop runs (``"lru"``, ``"slru:protected_size=64"``),
    else None. Only names: a policy object, even a built-in class's, keeps the general path (it is
    the caller's, bound to the pool it serves). The parameters are the policy object's own, as the
    registry builds it from the spec (its options checked there)."""
    if not isinstance(policy, str) or policy.partition(":")[0].strip() not in COMPILED:
        return None
    from ..policies import ARCPolicy, FIFOPolicy, LFUPolicy, LRUPolicy, S3FIFOPolicy, SLRUPolicy, make_policy
    from ..policies.belady import BeladyPolicy
    from ..policies.car import CARPolicy
    from ..policies.clock import ClockPolicy
    from ..policies.lirs import LIRSPolicy
    from ..policies.lecar import LeCaRPolicy
    from ..policies.lrfu import LRFUPolicy
    from ..policies.workload import WorkloadPolicy
    from ..policies.wtinylfu import WTinyLFUPolicy
    from ..policies.gdsf import GDSFPolicy
    from ..policies.leaf_lru import LeafLRUPolicy
    from ..policies.mq import MQPolicy
    from ..policies.sieve import SievePolicy
    from ..policies.twoq import TwoQPolicy

    obj = make_policy(policy)
    classes = {LRU: LRUPolicy, FIFO: FIFOPolicy, SLRU: SLRUPolicy, S3FIFO: S3FIFOPolicy, ARC: ARCPolicy,
               LFU: LFUPolicy, CLOCK: ClockPolicy, SIEVE: SievePolicy, TWOQ: TwoQPolicy, MQ: MQPolicy,
               LEAF_LRU: LeafLRUPolicy, GDSF: GDSFPolicy, CAR: CARPolicy, LRFU: LRFUPolicy,
               LIRS: LIRSPolicy, WTINYLFU: WTinyLFUPolicy, LECAR: LeCaRPolicy,
               BELADY: BeladyPolicy, WORKLOAD: WorkloadPolicy}
    kind = COMPILED[policy.partition(":")[0].strip()]
    if type(obj) is not classes[kind]:      # a subclass registered in its place would change the rules
        return None
    if kind == WORKLOAD and obj.by_depth:   # classes (root, depth bucket): general path
        return None
    return kind, dict(vars(obj))


def _parameters(kind: int, options: dict, capacity: int, block_size: int, ip: np.ndarray, fp: np.ndarray) -> None:
    """What each policy's ``bind`` derives from the pool (``policies/*.py``), for ``capacity`` blocks."""
    if kind == SLRU:
        size = options["protected_size"]
        ip[IP_LIMIT] = size if size is not None else int(options["protected_fraction"] * capacity)
    elif kind == S3FIFO:
        small = max(1, round(options["small_fraction"] * capacity))
        ip[IP_SMALL_TARGET] = small
        ip[IP_GHOST_SIZE] = max(1, capacity - small)
        ip[IP_MOVE] = options["move_threshold"]
        ip[IP_MAXFREQ] = options["max_freq"]
    elif kind in (ARC, CAR):
        ip[IP_CAPACITY] = capacity
    elif kind == WORKLOAD:
        fp[FP_RATE] = options["rate"]
        fp[FP_MEAN] = options["mean"]                                     # the prior
        fp[FP_P] = options["horizon"] * capacity                          # tau
        fp[FP_WINDOW_TICKS] = options["window"] * capacity
        ip[IP_GHOST_SIZE] = 4 * capacity
        ip[IP_ESTIMATE_LIMIT] = 64 * capacity
    elif kind == LECAR:
        c = max(1, capacity)
        ip[IP_CAPACITY] = c                                                 # each history's limit
        given = options["_discount_option"]
        fp[FP_DISCOUNT] = given if given is not None else 0.005 ** (1.0 / c)
        fp[FP_LEARNING_RATE] = options["learning_rate"]
        fp[FP_W_LRU] = fp[FP_W_LFU] = 0.5
        ip[IP_LC_PUSHED] = ip[IP_LC_PUSHED + 3] = NONE
    elif kind == LFU:
        given = options["_half_life_option"]
        ip[IP_HALF_LIFE] = given if given is not None else max(16, capacity)
    elif kind == CLOCK:
        ip[IP_MAXFREQ] = options["max_freq"]
        ip[IP_INIT_FREQ] = options["init_freq"]
    elif kind == TWOQ:
        ip[IP_LIMIT] = int(options["in_fraction"] * capacity)           # kin
        ip[IP_GHOST_SIZE] = int(options["out_fraction"] * capacity)     # kout
    elif kind == MQ:
        ip[IP_QUEUES] = options["n_queues"]
        ip[IP_LIFETIME] = options["lifetime"]
        ip[IP_GHOST_SIZE] = int(capacity * options["ghost_ratio"])
    elif kind == GDSF:
        given = options["_depth_cost_option"]
        fp[FP_DEPTH_COST] = given if given is not None else block_size / 32768
        fp[FP_ORPHAN] = options["orphan_factor"]
        ip[IP_INHERIT] = bool(options["inherit"])
    elif kind == LRFU:
        for slot, name in ((FP_HALF_LIFE, "half_life"), (FP_GHOST, "ghost"), (FP_STEP, "step"), (FP_MEMORY, "memory"),
                           (FP_WINDOW, "window"), (FP_RATE, "rate"), (FP_UP, "_up"), (FP_DOWN, "_down")):
            fp[slot] = options[name]
        given = options["reuse_distance"]
        fp[FP_MEDIAN] = float(capacity) if given is None else float(given)
        fp[FP_P_LEAF] = fp[FP_P_INNER] = 0.5
        ip[IP_MEMORY_CAP] = 64 * capacity
        ip[IP_LEAF_PENALTY] = bool(options["leaf_penalty"])
        ip[IP_REL_HEAD] = 1                  # releases are ticks 1, 2, ...; rescaled in ``run``
    elif kind == LIRS:
        ip[IP_LIR_LIMIT] = max(0, capacity - max(1, int(options["hir_fraction"] * capacity)))
        ip[IP_NONRESIDENT_LIMIT] = int(options["nonresident_ratio"] * capacity)
    elif kind == WTINYLFU:
        window = max(1, round(options["window_fraction"] * capacity))
        ip[IP_WINDOW] = window
        ip[IP_LIMIT] = int(options["protected_fraction"] * max(0, capacity - window))
        ip[IP_SAMPLE] = max(1, int(options["sample_ratio"] * capacity))


def run(arrays, kind: int, options: dict, capacity: int, warm: int, block_size: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """Replay ``arrays`` (``BlockArrays``) at ``capacity`` blocks of ``block_size`` tokens: (leading
    hits per request, ``C_*`` counters, the first three also at request ``warm``)."""
    num_requests = arrays.num_requests
    longest = int(arrays.total_blocks.max()) if num_requests else 0
    # No more blocks are ever handed out than can be cached or held at once: the arrays stay the
    # trace's size however large the pool (a pool of 10^9 blocks costs nothing here either).
    blocks = max(1, min(capacity, arrays.num_ids + longest))
    ip = np.zeros(IP_SLOTS, np.int64)
    ip[IP_HAND] = ip[IP_PUSHED] = NONE
    fp = np.zeros(FP_SLOTS, np.float64)
    _parameters(kind, options, capacity, block_size, ip, fp)
    ends = np.zeros((max(3, options["n_queues"]) if kind == MQ else 3, 3), np.int64)
    ends[:, :2] = NONE
    gends = np.zeros((3, 3), np.int64)
    gends[:, :2] = NONE
    links = np.int32 if blocks < 2**31 - 1 else np.int64     # block ids: 4 bytes where they fit
    prev = np.full(blocks, NONE, links)
    nxt = np.full(blocks, NONE, links)
    where = np.full(blocks, -1, np.int8)
    ival = np.zeros(blocks, np.int64)
    jval = np.full(blocks if kind in (MQ, LEAF_LRU, GDSF, LRFU, WORKLOAD) else 1, NONE, np.int64)
    fval = np.zeros(blocks, np.float64)
    kt = np.zeros(blocks, np.int64)
    heaps = {LFU: blocks, GDSF: blocks, LRFU: blocks, LECAR: blocks, BELADY: blocks, LEAF_LRU: 2 * blocks}.get(kind, 0)    # leaf-LRU: leaves, then inner
    heap = np.zeros(max(1, heaps), np.int64)
    pos = np.full(blocks if heaps else 1, -1, np.int64)
    bint = np.full((blocks if kind in (GDSF, WORKLOAD) else 1, 4), NONE, np.int64)
    bint[:, B_DEPTH] = 0
    bflt = np.zeros((blocks if kind in (GDSF, LRFU) else 1, 2), np.float64)
    ghosts = arrays.num_ids if kind in GHOSTS else 0
    gprev = np.full(ghosts, NONE, np.int64)
    gnxt = np.full(ghosts, NONE, np.int64)
    gwhere = np.full(max(ghosts, arrays.num_ids), -1, np.int8)
    per_id = kind in (TWOQ, MQ, LEAF_LRU, GDSF, LRFU, WTINYLFU, LECAR)   # LRFU: cached blocks under an id; W-TinyLFU: counts
    # 2Q, MQ: a ghost's value; leaf-LRU: cached children per id; GDSF: the first candidate keyed under it
    gval = np.full(arrays.num_ids if per_id else 1, NONE if kind == GDSF else 0, np.int64)
    # GDSF: chain value; LRFU: ghost score; Belady: next use (inf until the oracle tells it)
    gflt = np.full(arrays.num_ids if kind in (GDSF, LRFU, BELADY) else 1, np.inf if kind == BELADY else 0.0)
    # LRFU: per id the ticks of its last access and open experiment; its accesses and releases in
    # order (each is one reference of the trace at most), as (tick, id) and (id, is leaf) by tick
    refs = int(arrays.offsets[-1]) + 2 if kind == LRFU else 1
    gint = np.full((arrays.num_ids if kind in (LRFU, WTINYLFU, LECAR) else 1, 2), -1, np.int64)   # W-TinyLFU: ids counted
    lg = np.zeros((refs, 3), np.int32 if refs < 2**31 - 1 and arrays.num_ids < 2**31 - 1 else np.int64)
    rel_leaf = np.zeros(refs, np.uint8)
    # LIRS: the stack S over ids and each id's status
    stack = arrays.num_ids if kind == LIRS else 1
    sprev = np.full(stack, NONE, np.int64)
    snxt = np.full(stack, NONE, np.int64)
    swhere = np.full(stack, -1, np.int8)
    sstat = np.full(stack, -1, np.int8)
    # LeCaR: its random.Random(seed)'s state, as getstate gives it (624 words, then the index)
    if kind == LECAR:
        import random
        mt = np.array(random.Random(options["seed"]).getstate()[1], np.int64)
    else:
        mt = np.zeros(625, np.int64)
    # workload: see replay_kernels (estimates, candidates per class, the classes' heap, ghosts' values)
    k = arrays.num_ids if kind == WORKLOAD else 1
    lw = (np.full(k, NONE, np.int64), np.full(k, NONE, np.int64), np.full(k, -1, np.int8), np.zeros(k, np.float64),
          np.full(k, NONE, np.int64), np.full(k, NONE, np.int64), np.zeros(k, np.int64), np.zeros(k, np.int64),
          np.full(k, -1, np.int64), np.zeros(k, np.float64), np.zeros(k, np.int64), np.zeros(k, np.int64),
          np.zeros(k, np.int64), np.zeros(k + 1, np.int64))
    hits = np.zeros(num_requests, np.int64)
    counters = np.zeros(8, np.int64)
    from ..flat.replay_kernels import belady_next_uses, lrfu_rescale, replay_cache

    nu = np.zeros(int(arrays.offsets[-1]) if kind == BELADY else 1, np.float64)
    if kind == BELADY:
        belady_next_uses(arrays.offsets, arrays.ids, arrays.num_ids, nu)

    if kind == LRFU:
        lrfu_rescale(ip, fp)

    replay_cache(kind, arrays.offsets, arrays.ids, arrays.total_blocks, capacity, warm, ip, fp, ends, gends,
                 prev, nxt, where, ival, jval, fval, kt, bint, bflt, heap, pos, gprev, gnxt, gwhere, gval, gflt,
                 gint, lg, rel_leaf, sprev, snxt, swhere, sstat, mt, nu, lw, hits, counters)
    return hits, counters


_warmed: set = set()


def warm(kinds) -> None:
    """Load the compiled loop of each policy kind in ``kinds`` (from numba's cache, or compile it:
    seconds each) with one tiny replay, so that this happens once per process and before a
    replay's clock starts; a sweep calls it before its workers fork, so that they inherit the
    loaded code."""
    todo = [kind for kind in dict.fromkeys(kinds) if kind not in _warmed]
    if not todo:
        return
    from .blockarrays import BlockArrays

    one = np.ones(1, np.int64)
    tiny = BlockArrays(np.array([0, 1], np.int64), np.zeros(1, np.int32), 1, one, one, one * 4, one * 4)
    names = {kind: name for name, kind in COMPILED.items()}
    for kind in todo:
        run(tiny, kind, policy_kind(names[kind])[1], 1, 0)     # the defaults' options
        _warmed.add(kind)
