"""The compiled cache-mode replay loops (numba): the pool, its hash index and a built-in policy in
one loop over a trace's dense block ids, one loop per policy kind (``replay_cache``).
``prefixkv.sim.fastreplay`` is its only caller and says what it reproduces; the constants
(policy kinds, parameter slots, counters) are ``replay_layout``'s.

Every helper is inlined into its kind's loop: a call that passes the state's arrays would cost
more than the step it makes. Each policy's events are four functions (``EVENTS``), so that a
loop holds its own policy's code only (see "one compiled loop per policy kind" below).
"""

from __future__ import annotations

import hashlib
import math
import types
from pathlib import Path

import numpy as np

from .replay_layout import BELADY, FP_MEAN, FP_WINDOW_TICKS, IP_ESTIMATE_LIMIT, WORKLOAD
from .replay_layout import FP_DISCOUNT, FP_LEARNING_RATE, FP_W_LFU, FP_W_LRU, IP_LC_PUSHED, IP_TIME, LECAR
from .replay_layout import IP_COUNTED, IP_SAMPLE, IP_SIZE0, WTINYLFU
from .replay_layout import (HIR, IP_LIR_LIMIT, IP_NONRESIDENT_LIMIT, IP_NUM_LIR, LIR, LIRS, NONRESIDENT)
from .replay_layout import (CAR, FP_DOWN, FP_GHOST, FP_HALF_LIFE, FP_HIGH, FP_INV_H, FP_LOW, FP_MEDIAN, FP_MEMORY,
                              FP_P_INNER, FP_P_LEAF, FP_RATE, FP_STEP, FP_TAU, FP_UP, FP_WINDOW, G_LAST, G_OPEN,
                              IP_ACC_HEAD, IP_ACC_TAIL, IP_LEAF_PENALTY, IP_MEMORY, IP_MEMORY_CAP, IP_NOW,
                              IP_REL_HEAD, IP_WINDOW, LRFU)
from .replay_layout import (B_DEPTH, B_KNEXT, B_KPREV, B_PARENT, BF_BASE, BF_VALUE, FP_CLOCK, FP_DEPTH_COST,
                              FP_ORPHAN, GDSF, IP_EVICTED_PARENT, IP_HEAP2, IP_INHERIT, LEAF_LRU)
from .replay_layout import (ARC, C_CACHED, C_CACHED_W, C_EVICTIONS, C_EVICTIONS_W, C_UNUSED, C_UNUSED_CACHED,
                              C_UNUSED_W, CLOCK, FIFO, FP_P, IP_ACCESSES, IP_CAPACITY, IP_GHOST_SIZE, IP_HALF_LIFE,
                              IP_HAND, IP_HEAP, IP_INIT_FREQ, IP_LIFETIME, IP_LIMIT, IP_MAXFREQ, IP_MOVE,
                              IP_NUM_PROTECTED, IP_PENDING, IP_PUSHED, IP_PUSHED_VALUE, IP_QUEUES, IP_SIZE1,
                              IP_SIZE2, IP_SMALL_TARGET, IP_TICKET, IP_VTIME, LFU, LRU, MQ, NONE, S3FIFO, SIEVE,
                              SLRU, TWOQ, UNSET)
from . import replay_layout
from .kernels import _jit


# -- doubly linked lists over blocks (or ids): prev / nxt / ends[q] = (head, tail, count) -------------

@_jit(nogil=True, inline="always")
def _push(prev, nxt, where, ends, q, b):
    tail = ends[q, 1]
    prev[b] = tail
    nxt[b] = NONE
    if tail == NONE:
        ends[q, 0] = b
    else:
        nxt[tail] = b
    ends[q, 1] = b
    ends[q, 2] += 1
    where[b] = q


@_jit(nogil=True, inline="always")
def _cut(prev, nxt, where, ends, b):
    q = where[b]
    p = prev[b]
    n = nxt[b]
    if p == NONE:
        ends[q, 0] = n
    else:
        nxt[p] = n
    if n == NONE:
        ends[q, 1] = p
    else:
        prev[n] = p
    where[b] = -1
    ends[q, 2] -= 1


@_jit(nogil=True, inline="always")
def _push_front(prev, nxt, where, ends, q, b):
    head = ends[q, 0]
    nxt[b] = head
    prev[b] = NONE
    if head == NONE:
        ends[q, 1] = b
    else:
        prev[head] = b
    ends[q, 0] = b
    ends[q, 2] += 1
    where[b] = q


@_jit(nogil=True, inline="always")
def _pop_head(prev, nxt, where, ends, q):
    b = ends[q, 0]
    _cut(prev, nxt, where, ends, b)
    return b


# -- the candidates of a queue that keeps held blocks in place (FIFO, S3-FIFO) -----------------------

@_jit(nogil=True, inline="always")
def _first_candidate(nxt, held, ends, cursor, q):
    """The oldest block of queue ``q`` not held by the request being admitted. Within one
    allocation nothing is released, so the walk resumes where the previous one stopped."""
    c = cursor[q]
    if c == UNSET:
        c = ends[q, 0]
    while c != NONE and held[c]:
        c = nxt[c]
    cursor[q] = c
    return c


@_jit(nogil=True, inline="always")
def _cut_candidate(prev, nxt, where, ends, cursor, b):
    q = where[b]
    if cursor[q] == b:
        cursor[q] = nxt[b]
    _cut(prev, nxt, where, ends, b)


@_jit(nogil=True, inline="always")
def _push_candidate(prev, nxt, where, ends, cursor, q, b):
    _push(prev, nxt, where, ends, q, b)
    if cursor[q] == NONE:       # the walk had passed every block: this one is next
        cursor[q] = b


# -- LFU's candidates: a binary heap keyed (E, w, ticket) with each block's position --------------

@_jit(nogil=True, inline="always")
def _before(ke, kw, kt, a, b):
    if ke[a] != ke[b]:
        return ke[a] < ke[b]
    if kw[a] != kw[b]:
        return kw[a] < kw[b]
    return kt[a] < kt[b]


@_jit(nogil=True, inline="always")
def _sift_up(heap, pos, ke, kw, kt, i):
    b = heap[i]
    while i > 0:
        parent = (i - 1) >> 1
        p = heap[parent]
        if not _before(ke, kw, kt, b, p):
            break
        heap[i] = p
        pos[p] = i
        i = parent
    heap[i] = b
    pos[b] = i


@_jit(nogil=True, inline="always")
def _sift_down(heap, pos, ke, kw, kt, i, n):
    b = heap[i]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _before(ke, kw, kt, heap[child + 1], heap[child]):
            child += 1
        c = heap[child]
        if not _before(ke, kw, kt, c, b):
            break
        heap[i] = c
        pos[c] = i
        i = child
    heap[i] = b
    pos[b] = i


@_jit(nogil=True, inline="always")
def _heap_remove(heap, pos, ke, kw, kt, ip, b):
    i = pos[b]
    n = ip[IP_HEAP] - 1
    ip[IP_HEAP] = n
    pos[b] = -1
    if i == n:
        return
    last = heap[n]
    heap[i] = last
    pos[last] = i
    _sift_down(heap, pos, ke, kw, kt, i, n)
    if heap[i] == last:
        _sift_up(heap, pos, ke, kw, kt, i)


# -- a binary heap keyed (kf, kt) (float, ticket) at heap[base:], its size in ip[slot] (leaf-LRU, GDSF) ----

@_jit(nogil=True, inline="always")
def _hbefore(kf, kt, a, b):
    if kf[a] != kf[b]:
        return kf[a] < kf[b]
    return kt[a] < kt[b]


@_jit(nogil=True, inline="always")
def _hup(heap, base, pos, kf, kt, i):
    b = heap[base + i]
    while i > 0:
        parent = (i - 1) >> 1
        p = heap[base + parent]
        if not _hbefore(kf, kt, b, p):
            break
        heap[base + i] = p
        pos[p] = i
        i = parent
    heap[base + i] = b
    pos[b] = i


@_jit(nogil=True, inline="always")
def _hdown(heap, base, pos, kf, kt, i, n):
    b = heap[base + i]
    while True:
        child = 2 * i + 1
        if child >= n:
            break
        if child + 1 < n and _hbefore(kf, kt, heap[base + child + 1], heap[base + child]):
            child += 1
        c = heap[base + child]
        if not _hbefore(kf, kt, c, b):
            break
        heap[base + i] = c
        pos[c] = i
        i = child
    heap[base + i] = b
    pos[b] = i


@_jit(nogil=True, inline="always")
def _hpush(heap, base, pos, kf, kt, ip, slot, b):
    n = ip[slot]
    heap[base + n] = b
    ip[slot] = n + 1
    _hup(heap, base, pos, kf, kt, n)


@_jit(nogil=True, inline="always")
def _hremove(heap, base, pos, kf, kt, ip, slot, b):
    i = pos[b]
    n = ip[slot] - 1
    ip[slot] = n
    pos[b] = -1
    if i == n:
        return
    last = heap[base + n]
    heap[base + i] = last
    pos[last] = i
    _hdown(heap, base, pos, kf, kt, i, n)
    if heap[base + i] == last:
        _hup(heap, base, pos, kf, kt, i)


@_jit(nogil=True, inline="always")
def _hrekey(heap, base, pos, kf, kt, ip, slot, b):
    """``b``'s key changed in place: back to its place in the heap."""
    i = pos[b]
    _hdown(heap, base, pos, kf, kt, i, ip[slot])
    if heap[base + i] == b:
        _hup(heap, base, pos, kf, kt, i)


# -- GDSF's candidates per parent id (those keyed as non-orphans): a list through bint ----------------

@_jit(nogil=True, inline="always")
def _kid_add(bint, kid_head, jval, p, b):
    head = kid_head[p]
    bint[b, B_KNEXT] = head
    bint[b, B_KPREV] = NONE
    if head != NONE:
        bint[head, B_KPREV] = b
    kid_head[p] = b
    jval[b] = p


@_jit(nogil=True, inline="always")
def _kid_remove(bint, kid_head, jval, b):
    p = jval[b]
    before = bint[b, B_KPREV]
    after = bint[b, B_KNEXT]
    if before == NONE:
        kid_head[p] = after
    else:
        bint[before, B_KNEXT] = after
    if after != NONE:
        bint[after, B_KPREV] = before
    jval[b] = NONE


# -- the policies' events ----------------------------------------------------------------------------

@_jit(nogil=True, inline="always")
def _ghost_add(gprev, gnxt, gwhere, gends, g, h):
    _push(gprev, gnxt, gwhere, gends, g, h)


@_jit(nogil=True, inline="always")
def _bounded_ghost_add(gprev, gnxt, gwhere, gends, gval, g, h, value, limit, ip):
    """``GhostList.add``: ``h`` (no ghost now: a cached id never is) newest, the oldest pushed out past
    ``limit`` and remembered until the next take."""
    _push(gprev, gnxt, gwhere, gends, g, h)
    gval[h] = value
    if gends[g, 2] > limit:
        old = _pop_head(gprev, gnxt, gwhere, gends, g)
        ip[IP_PUSHED] = old
        ip[IP_PUSHED_VALUE] = gval[old]
    else:
        ip[IP_PUSHED] = NONE


@_jit(nogil=True, inline="always")
def _bounded_ghost_take(gprev, gnxt, gwhere, gends, gval, g, h, ip):
    """``GhostList.take``: ``h``'s value (>= 0) if it is a ghost of list ``g`` or the entry the latest
    add pushed out, else -1; a found ghost leaves room for the pushed-out entry, oldest again."""
    pushed = ip[IP_PUSHED]
    ip[IP_PUSHED] = NONE
    if gwhere[h] == g:
        _cut(gprev, gnxt, gwhere, gends, h)
        value = gval[h]
        if pushed != NONE:
            _push_front(gprev, gnxt, gwhere, gends, g, pushed)
            gval[pushed] = ip[IP_PUSHED_VALUE]
        return value
    if pushed == h:
        return ip[IP_PUSHED_VALUE]
    return -1


@_jit(nogil=True, inline="always")
def _mq_access(b, freq, ival, jval, kt, ip):
    ival[b] = freq
    q = 0
    while freq > 1:                 # floor(log2(freq))
        freq >>= 1
        q += 1
    jval[b] = min(q, ip[IP_QUEUES] - 1)
    kt[b] = ip[IP_VTIME] + ip[IP_LIFETIME]
    ip[IP_VTIME] += 1
    ip[IP_PENDING] += 1


@_jit(nogil=True, inline="always")
def _mq_adjust(prev, nxt, where, ends, jval, kt, ip):
    """MQ's owed Adjust runs, each at its own virtual time: the least recent candidate of each
    queue above 0 whose expiry passed moves down one queue."""
    end = ip[IP_VTIME]
    queues = ip[IP_QUEUES]
    lifetime = ip[IP_LIFETIME]
    for vtime in range(end - ip[IP_PENDING] + 1, end + 1):
        for k in range(1, queues):
            if ends[k, 2]:
                b = ends[k, 0]
                if kt[b] < vtime:
                    _cut(prev, nxt, where, ends, b)
                    _push(prev, nxt, where, ends, k - 1, b)
                    jval[b] = k - 1
                    kt[b] = vtime + lifetime
    ip[IP_PENDING] = 0


@_jit(nogil=True, inline="always")
def _leaf_move(heap, pos, where, fval, kt, ip, b, to):
    """A leaf-LRU candidate changes heap (0: leaves, 1: inner), its release ticket kept."""
    blocks = pos.shape[0]
    if to == 1:
        _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
        _hpush(heap, blocks, pos, fval, kt, ip, IP_HEAP2, b)
    else:
        _hremove(heap, blocks, pos, fval, kt, ip, IP_HEAP2, b)
        _hpush(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    where[b] = to


@_jit(nogil=True)
def lrfu_rescale(ip, fp):
    """LRFU's lengths from its reuse-distance median, redone whenever it has moved by 1%."""
    median = fp[FP_MEDIAN]
    fp[FP_LOW] = median * 0.99
    fp[FP_HIGH] = median * 1.01
    h = fp[FP_HALF_LIFE] * median
    fp[FP_INV_H] = 1.0 / h
    ip[IP_GHOST_SIZE] = int(fp[FP_GHOST] * h)
    ip[IP_WINDOW] = max(1, int(fp[FP_WINDOW] * h))
    ip[IP_MEMORY] = min(int(fp[FP_MEMORY] * median) + 1, ip[IP_MEMORY_CAP])


@_jit(nogil=True, inline="always")
def _lrfu_bump(score, now, fresh):
    """log2(2**score + 2**now); ``fresh``: no score yet (``now``)."""
    if fresh:
        return now
    d = score - now
    if d > 0.0:
        return score + math.log2(1.0 + 2.0 ** -d)
    return now + math.log2(1.0 + 2.0 ** d)


@_jit(nogil=True, inline="always")
def _lrfu_learn(leaf, outcome, fp):
    if leaf:
        fp[FP_P_LEAF] += fp[FP_RATE] * (outcome - fp[FP_P_LEAF])
    else:
        fp[FP_P_INNER] += fp[FP_RATE] * (outcome - fp[FP_P_INNER])


@_jit(nogil=True, inline="always")
def _lrfu_accessed(h, gint, lg, rel_leaf, ip, fp):
    """Every LRFU access: the reuse-distance median, the tracker's memory, the hash's open experiment."""
    now = ip[IP_NOW]
    if fp[FP_STEP] != 0.0:
        previous = gint[h, G_LAST]
        if previous >= 0:
            median = fp[FP_MEDIAN]
            median = median * (fp[FP_UP] if now - previous + 0.5 > median else fp[FP_DOWN])
            fp[FP_MEDIAN] = median
            if not fp[FP_LOW] < median < fp[FP_HIGH]:
                lrfu_rescale(ip, fp)
    gint[h, G_LAST] = now
    tail = ip[IP_ACC_TAIL]
    lg[tail, 0] = now
    lg[tail, 1] = h
    ip[IP_ACC_TAIL] = tail + 1
    head = ip[IP_ACC_HEAD]
    limit = now - ip[IP_MEMORY]
    while lg[head, 0] < limit:              # the entry just added is never older: no underflow
        old = lg[head, 1]
        if gint[old, G_LAST] == lg[head, 0]:
            gint[old, G_LAST] = -1
        head += 1
    ip[IP_ACC_HEAD] = head
    tick = gint[h, G_OPEN]
    if tick >= 0:
        gint[h, G_OPEN] = -1
        _lrfu_learn(rel_leaf[tick], 1.0, fp)


@_jit(nogil=True, inline="always")
def _lrfu_penalty(ip, fp):
    if not ip[IP_LEAF_PENALTY]:
        return 0.0
    ratio = max(fp[FP_P_LEAF], 1e-3) / max(fp[FP_P_INNER], 1e-3)
    return -math.log2(ratio) if ratio < 1.0 else 0.0


# -- LIRS: the stack S over ids (sprev / snxt / swhere, row 1 of gends), the non-resident ids in S
# (gprev / gnxt / gwhere, row 0), each id's status in sstat; Q's candidates (list 0), LIR ones (list 1)

@_jit(nogil=True, inline="always")
def _lirs_to_top(sprev, snxt, swhere, gends, h):
    if swhere[h] >= 0:
        _cut(sprev, snxt, swhere, gends, h)
    _push(sprev, snxt, swhere, gends, 1, h)


@_jit(nogil=True, inline="always")
def _lirs_prune(sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends):
    """Pop S's bottom until it is LIR; non-resident ids popped are forgotten."""
    while gends[1, 2]:
        bottom = gends[1, 0]
        st = sstat[bottom]
        if st == LIR:
            return
        _cut(sprev, snxt, swhere, gends, bottom)
        if st == NONRESIDENT:
            sstat[bottom] = -1
            _cut(gprev, gnxt, gwhere, gends, bottom)


@_jit(nogil=True, inline="always")
def _lirs_demote_bottom(prev, nxt, where, ends, sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends,
                        block_of_id, ip):
    """S's bottom LIR block becomes HIR, to Q's end; then S is pruned. Pruned first too, as
    ``LIRSPolicy._demote_bottom_lir`` says why."""
    _lirs_prune(sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends)
    bottom = gends[1, 0]
    _cut(sprev, snxt, swhere, gends, bottom)
    sstat[bottom] = HIR
    ip[IP_NUM_LIR] -= 1
    b = block_of_id[bottom]
    if where[b] == 1:
        _cut(prev, nxt, where, ends, b)
        _push(prev, nxt, where, ends, 0, b)
    _lirs_prune(sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends)


@_jit(nogil=True, inline="always")
def _lirs_make_lir(prev, nxt, where, ends, sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends, block_of_id,
                   ip, h):
    sstat[h] = LIR
    ip[IP_NUM_LIR] += 1
    _lirs_to_top(sprev, snxt, swhere, gends, h)
    while ip[IP_NUM_LIR] > ip[IP_LIR_LIMIT] and gends[1, 2]:
        _lirs_demote_bottom(prev, nxt, where, ends, sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends,
                            block_of_id, ip)


# -- W-TinyLFU: segments window (list 0), probation (1), protected (2), each block's in ival, sizes
# (blocks in use included) in ip[IP_SIZE0 + segment]; exact counts per id in gval, the ids counted
# listed in gint[:, 0]

@_jit(nogil=True, inline="always")
def _wt_count(h, gval, gint, ip):
    n = gval[h]
    if n == 0:
        gint[ip[IP_COUNTED], 0] = h
        ip[IP_COUNTED] += 1
    gval[h] = n + 1
    ip[IP_ACCESSES] += 1
    if ip[IP_ACCESSES] >= ip[IP_SAMPLE]:       # age: every count halves, zeros are forgotten
        ip[IP_ACCESSES] = 0
        kept = 0
        for i in range(ip[IP_COUNTED]):
            g = gint[i, 0]
            n = gval[g]
            if n > 1:
                gval[g] = n >> 1
                gint[kept, 0] = g
                kept += 1
            else:
                gval[g] = 0
        ip[IP_COUNTED] = kept


@_jit(nogil=True, inline="always")
def _wt_move(b, segment, ival, ip):
    ip[IP_SIZE0 + ival[b]] -= 1
    ival[b] = segment
    ip[IP_SIZE0 + segment] += 1


@_jit(nogil=True, inline="always")
def _wt_spill(prev, nxt, where, ends, ival, ip):
    while ip[IP_SIZE0] > ip[IP_WINDOW] and ends[0, 2]:
        b = _pop_head(prev, nxt, where, ends, 0)
        _wt_move(b, 1, ival, ip)
        _push(prev, nxt, where, ends, 1, b)


@_jit(nogil=True, inline="always")
def _wt_demote_overflow(prev, nxt, where, ends, ival, ip):
    while ip[IP_SIZE0 + 2] > ip[IP_LIMIT] and ends[2, 2]:
        b = _pop_head(prev, nxt, where, ends, 2)
        _wt_move(b, 1, ival, ip)
        _push(prev, nxt, where, ends, 1, b)


@_jit(nogil=True, inline="always")
def _wt_take(prev, nxt, where, ends, ival, ip, b):
    _cut(prev, nxt, where, ends, b)
    ip[IP_SIZE0 + ival[b]] -= 1
    return b


# -- LeCaR: Python's random.Random (MT19937, its state from ``getstate``: 624 words, then the index),
# two histories (GhostList, each with its own pushed-out entry) over ids: count in gval, time in gint[:, 0]

@_jit(nogil=True, inline="always")
def _mt_word(mt):
    i = mt[624]
    if i >= 624:
        for kk in range(624):
            y = (mt[kk] & 0x80000000) | (mt[(kk + 1) % 624] & 0x7fffffff)
            v = mt[(kk + 397) % 624] ^ (y >> 1)
            if y & 1:
                v ^= 0x9908b0df
            mt[kk] = v
        i = 0
    y = mt[i]
    mt[624] = i + 1
    y ^= y >> 11
    y ^= (y << 7) & 0x9d2c5680
    y ^= (y << 15) & 0xefc60000
    y ^= y >> 18
    return y & 0xffffffff


@_jit(nogil=True, inline="always")
def _mt_random(mt):
    """``random.Random.random()``: 53 bits from two words."""
    a = _mt_word(mt) >> 5
    b = _mt_word(mt) >> 6
    return (a * 67108864.0 + b) * (1.0 / 9007199254740992.0)


@_jit(nogil=True, inline="always")
def _lc_add(gprev, gnxt, gwhere, gends, gval, gint, g, h, time, freq, limit, ip):
    _push(gprev, gnxt, gwhere, gends, g, h)
    gint[h, 0] = time
    gval[h] = freq
    slot = IP_LC_PUSHED + 3 * g
    if gends[g, 2] > limit:
        old = _pop_head(gprev, gnxt, gwhere, gends, g)
        ip[slot] = old
        ip[slot + 1] = gint[old, 0]
        ip[slot + 2] = gval[old]
    else:
        ip[slot] = NONE


@_jit(nogil=True, inline="always")
def _lc_take(gprev, gnxt, gwhere, gends, gval, gint, g, h, ip):
    """``GhostList.take`` of history ``g``: whether ``h`` was there; its (time, count) in ``ip[slot + 1:3]``."""
    slot = IP_LC_PUSHED + 3 * g
    pushed = ip[slot]
    ip[slot] = NONE
    if gwhere[h] == g:
        _cut(gprev, gnxt, gwhere, gends, h)
        time = gint[h, 0]
        freq = gval[h]
        if pushed != NONE:
            _push_front(gprev, gnxt, gwhere, gends, g, pushed)
            gint[pushed, 0] = ip[slot + 1]
            gval[pushed] = ip[slot + 2]
        ip[slot + 1] = time
        ip[slot + 2] = freq
        return True
    return pushed == h         # the entry the latest add pushed out: its values are in the slots


@_jit(nogil=True)
def belady_next_uses(offsets, ids, num_ids, out):
    """``out[p]``: the index of the next request that names reference ``p``'s id, inf if none
    (``replay._next_uses``)."""
    after = np.full(num_ids, np.inf)
    for i in range(offsets.shape[0] - 2, -1, -1):
        for p in range(offsets[i], offsets[i + 1]):
            out[p] = after[ids[p]]
        for p in range(offsets[i], offsets[i + 1]):
            after[ids[p]] = i


# -- workload: classes are prefix roots (ids). ``lw``: the estimates in LRU order (eprev / enxt /
# ewhere, row 1 of gends) with their values (est); each class's candidates in release order (whead /
# wtail / wcount, the blocks linked through bint's B_KPREV / B_KNEXT, tickets in kt); the classes with
# candidates in a heap keyed (rank of the oldest, its ticket) (cheap / cpos / ckf / ckt); the ghosts'
# class and ticket (gcls / gtick, the ghost list itself row 0 of gprev / gnxt / gwhere); a scratch
# list of the classes an eviction's ghost expiry touched

_CLAMP = 1e-6       # policies/workload.py's


@_jit(nogil=True, inline="always")
def _wl_get(lw, cls, fp):
    eprev, enxt, ewhere, est = lw[0], lw[1], lw[2], lw[3]
    return est[cls] if ewhere[cls] >= 0 else fp[FP_MEAN]


@_jit(nogil=True, inline="always")
def _wl_rekey(lw, bint, kt, cls, ip, fp):
    est, whead, wcount, cheap, cpos, ckf, ckt = lw[3], lw[4], lw[6], lw[7], lw[8], lw[9], lw[10]
    if cpos[cls] >= 0:
        _hremove(cheap, 0, cpos, ckf, ckt, ip, IP_HEAP, cls)
    if wcount[cls]:
        oldest = kt[whead[cls]]
        p = min(max(_wl_get(lw, cls, fp), _CLAMP), 1.0 - _CLAMP)
        ckf[cls] = oldest + fp[FP_P] * math.log(p / (1.0 - p))       # FP_P: tau
        ckt[cls] = oldest
        _hpush(cheap, 0, cpos, ckf, ckt, ip, IP_HEAP, cls)


@_jit(nogil=True, inline="always")
def _wl_set_estimate(lw, bint, kt, gends, cls, value, ip, fp):
    eprev, enxt, ewhere, est, cpos = lw[0], lw[1], lw[2], lw[3], lw[8]
    est[cls] = value
    if ewhere[cls] >= 0:
        _cut(eprev, enxt, ewhere, gends, cls)
    _push(eprev, enxt, ewhere, gends, 1, cls)
    if gends[1, 2] > ip[IP_ESTIMATE_LIMIT]:
        dropped = _pop_head(eprev, enxt, ewhere, gends, 1)     # reads as the running mean again
        if cpos[dropped] >= 0:
            _wl_rekey(lw, bint, kt, dropped, ip, fp)


@_jit(nogil=True, inline="always")
def _wl_learn(lw, bint, kt, gends, cls, outcome, rekey, ip, fp):
    rate = fp[FP_RATE]
    estimate = _wl_get(lw, cls, fp)
    _wl_set_estimate(lw, bint, kt, gends, cls, estimate + rate * (outcome - estimate), ip, fp)
    fp[FP_MEAN] += rate * (outcome - fp[FP_MEAN])
    if rekey and lw[8][cls] >= 0:
        _wl_rekey(lw, bint, kt, cls, ip, fp)


@_jit(nogil=True, inline="always")
def _wl_wait(lw, bint, cls, b):
    whead, wtail, wcount = lw[4], lw[5], lw[6]
    tail = wtail[cls]
    bint[b, B_KPREV] = tail
    bint[b, B_KNEXT] = NONE
    if tail == NONE:
        whead[cls] = b
    else:
        bint[tail, B_KNEXT] = b
    wtail[cls] = b
    wcount[cls] += 1


@_jit(nogil=True, inline="always")
def _wl_unwait(lw, bint, cls, b):
    whead, wtail, wcount = lw[4], lw[5], lw[6]
    before = bint[b, B_KPREV]
    after = bint[b, B_KNEXT]
    if before == NONE:
        whead[cls] = after
    else:
        bint[before, B_KNEXT] = after
    if after == NONE:
        wtail[cls] = before
    else:
        bint[after, B_KPREV] = before
    wcount[cls] -= 1


@_jit(nogil=True, inline="always")
def _car_trim(gprev, gnxt, gwhere, gends, ends, ip):
    """CAR's ghost trim before a new hash enters T1."""
    c = ip[IP_CAPACITY]
    if ends[1, 2] + gends[1, 2] >= c:
        while gends[1, 2] and ends[1, 2] + gends[1, 2] >= c:
            _pop_head(gprev, gnxt, gwhere, gends, 1)
    else:
        while gends[2, 2] and ends[1, 2] + ends[2, 2] + gends[1, 2] + gends[2, 2] >= 2 * c:
            _pop_head(gprev, gnxt, gwhere, gends, 2)


@_jit(nogil=True, inline="always")
def _arc_trim(gprev, gnxt, gwhere, gends, ip):
    c = ip[IP_CAPACITY]
    while gends[1, 2] and ip[IP_SIZE1] + gends[1, 2] > c:
        _pop_head(gprev, gnxt, gwhere, gends, 1)
    while ip[IP_SIZE1] + ip[IP_SIZE2] + gends[1, 2] + gends[2, 2] > 2 * c:
        _pop_head(gprev, gnxt, gwhere, gends, 2 if gends[2, 2] else 1)


@_jit(nogil=True, inline="always")
def _lfu_epoch(ip):
    epoch = ip[IP_ACCESSES] // ip[IP_HALF_LIFE]
    ip[IP_ACCESSES] += 1
    return epoch


# -- the events, one function per policy kind (``EVENTS``), each with every state array it may
# need: inlined, unused arguments cost nothing. ``lr``: LRFU's (gint, lg, rel_leaf); ``ls``: LIRS's
# (sprev, snxt, swhere, sstat), LeCaR's MT state and workload's arrays (tuples: a call of over 30
# arguments is one numba cannot inline).
#
# cached: block ``b`` now holds id ``h`` (its ``depth`` in the request, its ``parent`` id).
@_jit(nogil=True, inline="always")
def _fifo_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                 block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    _push_candidate(prev, nxt, where, ends, cursor, 0, b)     # held until its release: no candidate yet


@_jit(nogil=True, inline="always")
def _slru_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                 block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    ival[b] = 0                                               # on probation


@_jit(nogil=True, inline="always")
def _s3fifo_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                   block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    q = 0
    if gwhere[h] >= 0:                                        # back from the ghost queue: to main
        _cut(gprev, gnxt, gwhere, gends, h)
        q = 1
    _push_candidate(prev, nxt, where, ends, cursor, q, b)
    ival[b] = 0                                               # frequency


@_jit(nogil=True, inline="always")
def _arc_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    which = 1
    g = gwhere[h]
    if g == 1:
        fp[FP_P] = min(float(ip[IP_CAPACITY]), fp[FP_P] + max(gends[2, 2] / gends[1, 2], 1.0))
        _cut(gprev, gnxt, gwhere, gends, h)
        which = 2
    elif g == 2:
        fp[FP_P] = max(0.0, fp[FP_P] - max(gends[1, 2] / gends[2, 2], 1.0))
        _cut(gprev, gnxt, gwhere, gends, h)
        which = 2
    ival[b] = which
    if which == 1:
        ip[IP_SIZE1] += 1
    else:
        ip[IP_SIZE2] += 1
    _arc_trim(gprev, gnxt, gwhere, gends, ip)


@_jit(nogil=True, inline="always")
def _lfu_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    ival[b] = _lfu_epoch(ip)
    fval[b] = 1.0


@_jit(nogil=True, inline="always")
def _clock_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                  block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    _push(prev, nxt, where, ends, 0, b)                       # held in place until released
    ival[b] = ip[IP_INIT_FREQ]


@_jit(nogil=True, inline="always")
def _sieve_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                  block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    _push(prev, nxt, where, ends, 0, b)
    ival[b] = 0                                               # unvisited


@_jit(nogil=True, inline="always")
def _twoq_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                 block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    if _bounded_ghost_take(gprev, gnxt, gwhere, gends, gval, 0, h, ip) >= 0:
        ival[b] = 1                                           # back from A1out: Am
    else:
        ival[b] = 0                                           # A1in, held in place
        _push(prev, nxt, where, ends, 0, b)


@_jit(nogil=True, inline="always")
def _mq_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
               block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    freq = _bounded_ghost_take(gprev, gnxt, gwhere, gends, gval, 0, h, ip)
    _mq_access(b, (freq if freq > 0 else 0) + 1, ival, jval, kt, ip)


@_jit(nogil=True, inline="always")
def _leaf_lru_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                     block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    jval[b] = parent                                          # gval: cached blocks naming an id as parent
    if parent >= 0:
        n = gval[parent]
        gval[parent] = n + 1
        if n == 0:                                            # the parent stops being a leaf
            p = block_of_id[parent]
            if p >= 0 and where[p] == 0:
                _leaf_move(heap, pos, where, fval, kt, ip, p, 1)


@_jit(nogil=True, inline="always")
def _gdsf_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                 block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    ival[b] = 1                                               # accesses
    bint[b, B_DEPTH] = depth
    bint[b, B_PARENT] = parent


@_jit(nogil=True, inline="always")
def _car_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    ival[b] = 0                                               # unreferenced
    g = gwhere[h]
    c = ip[IP_CAPACITY]
    if g == 1:
        fp[FP_P] = min(fp[FP_P] + max(1.0, gends[2, 2] / gends[1, 2]), float(c))
        _cut(gprev, gnxt, gwhere, gends, h)
        which = 2
    elif g == 2:
        fp[FP_P] = max(fp[FP_P] - max(1.0, gends[1, 2] / gends[2, 2]), 0.0)
        _cut(gprev, gnxt, gwhere, gends, h)
        which = 2
    else:
        _car_trim(gprev, gnxt, gwhere, gends, ends, ip)
        which = 1
    _push(prev, nxt, where, ends, which, b)                   # held in place until released


@_jit(nogil=True, inline="always")
def _lrfu_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                 block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    gint, lg, rel_leaf = lr
    jval[b] = parent                                          # gval: cached blocks under an id
    if parent >= 0:
        gval[parent] += 1
    ghost = gwhere[h] == 0
    if ghost:
        _cut(gprev, gnxt, gwhere, gends, h)
    bflt[b, BF_BASE] = _lrfu_bump(gflt[h], fp[FP_TAU], not ghost)
    _lrfu_accessed(h, gint, lg, rel_leaf, ip, fp)


@_jit(nogil=True, inline="always")
def _lirs_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                 block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    sprev, snxt, swhere, sstat = (ls[0], ls[1], ls[2], ls[3])
    if sstat[h] == NONRESIDENT:                               # its reuse distance beats the bottom LIR's
        _cut(gprev, gnxt, gwhere, gends, h)
        _lirs_make_lir(prev, nxt, where, ends, sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends,
                       block_of_id, ip, h)
    elif ip[IP_NUM_LIR] < ip[IP_LIR_LIMIT]:
        _lirs_make_lir(prev, nxt, where, ends, sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends,
                       block_of_id, ip, h)
    else:
        sstat[h] = HIR
        _lirs_to_top(sprev, snxt, swhere, gends, h)


@_jit(nogil=True, inline="always")
def _wtinylfu_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                     block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    gint = lr[0]
    _wt_count(h, gval, gint, ip)
    ival[b] = 0
    ip[IP_SIZE0] += 1
    if ip[IP_SIZE0] > ip[IP_WINDOW]:
        _wt_spill(prev, nxt, where, ends, ival, ip)


@_jit(nogil=True, inline="always")
def _lecar_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                  block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    gint = lr[0]
    ip[IP_TIME] += 1
    freq = 0
    for expert in range(2):         # a returning hash rewards the expert that did not evict it
        if _lc_take(gprev, gnxt, gwhere, gends, gval, gint, expert, h, ip):
            slot = IP_LC_PUSHED + 3 * expert
            reward = math.exp(fp[FP_LEARNING_RATE] * fp[FP_DISCOUNT] ** float(ip[IP_TIME] - ip[slot + 1]))
            if expert == 0:
                fp[FP_W_LFU] *= reward
            else:
                fp[FP_W_LRU] *= reward
            total = fp[FP_W_LRU] + fp[FP_W_LFU]
            fp[FP_W_LRU] /= total
            fp[FP_W_LFU] /= total
            freq = ip[slot + 2]
            break
    ival[b] = freq + 1


@_jit(nogil=True, inline="always")
def _workload_cached(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                     block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    lw = ls[5]
    if parent < 0:
        root = h
    else:
        p = block_of_id[parent]
        root = jval[p] if p >= 0 else parent
    jval[b] = root                                            # its class
    _wl_set_estimate(lw, bint, kt, gends, root, _wl_get(lw, root, fp), ip, fp)
    if gends[0, 2] and gwhere[h] == 0:                        # evicted, and needed again within the window
        _cut(gprev, gnxt, gwhere, gends, h)
        _wl_learn(lw, bint, kt, gends, lw[11][h], 1.0, True, ip, fp)


@_jit(nogil=True, inline="always")
def _cached_nothing(b, h, depth, parent, prev, nxt, where, ends, cursor, heap, pos, ival, jval, fval, kt, bint, bflt,
                    block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, lr, ls, ip, fp):
    pass


# hit: a hit on ``b``, a candidate (between requests every cached block is one).
@_jit(nogil=True, inline="always")
def _lru_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
             gwhere, gends, block_of_id, ip, fp):
    _cut(prev, nxt, where, ends, b)


@_jit(nogil=True, inline="always")
def _slru_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
              gwhere, gends, block_of_id, ip, fp):
    _cut(prev, nxt, where, ends, b)
    if not ival[b]:
        ival[b] = 1
        ip[IP_NUM_PROTECTED] += 1
        _slru_demote_overflow(prev, nxt, where, ends, ival, ip)


@_jit(nogil=True, inline="always")
def _s3fifo_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
                gwhere, gends, block_of_id, ip, fp):
    if ival[b] < ip[IP_MAXFREQ]:
        ival[b] += 1


@_jit(nogil=True, inline="always")
def _arc_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
             gwhere, gends, block_of_id, ip, fp):
    _cut(prev, nxt, where, ends, b)
    if ival[b] == 1:
        ival[b] = 2
        ip[IP_SIZE1] -= 1
        ip[IP_SIZE2] += 1


@_jit(nogil=True, inline="always")
def _lfu_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
             gwhere, gends, block_of_id, ip, fp):
    _heap_remove(heap, pos, ival, fval, kt, ip, b)
    k = _lfu_epoch(ip)
    e = ival[b]
    w = fval[b]
    top = e if e > k else k
    w = math.ldexp(w, e - top) + math.ldexp(1.0, k - top)
    if w >= 2.0:
        w *= 0.5
        top += 1
    ival[b] = top
    fval[b] = w


@_jit(nogil=True, inline="always")
def _clock_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
               gwhere, gends, block_of_id, ip, fp):
    if ival[b] < ip[IP_MAXFREQ]:
        ival[b] += 1


@_jit(nogil=True, inline="always")
def _sieve_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
               gwhere, gends, block_of_id, ip, fp):
    ival[b] = 1                                               # visited


@_jit(nogil=True, inline="always")
def _twoq_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
              gwhere, gends, block_of_id, ip, fp):
    if ival[b]:                                               # Am: out of the LRU order; A1in: held in place
        _cut(prev, nxt, where, ends, b)


@_jit(nogil=True, inline="always")
def _mq_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
            gwhere, gends, block_of_id, ip, fp):
    _cut(prev, nxt, where, ends, b)
    _mq_access(b, ival[b] + 1, ival, jval, kt, ip)


@_jit(nogil=True, inline="always")
def _leaf_lru_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev,
                  gnxt, gwhere, gends, block_of_id, ip, fp):
    if where[b] == 0:
        _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    else:
        _hremove(heap, pos.shape[0], pos, fval, kt, ip, IP_HEAP2, b)
    where[b] = -1


@_jit(nogil=True, inline="always")
def _gdsf_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
              gwhere, gends, block_of_id, ip, fp):
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    if jval[b] != NONE:
        _kid_remove(bint, gval, jval, b)
    ival[b] += 1


@_jit(nogil=True, inline="always")
def _car_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
             gwhere, gends, block_of_id, ip, fp):
    ival[b] = 1                                               # referenced; held in place


@_jit(nogil=True, inline="always")
def _lrfu_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
              gwhere, gends, block_of_id, ip, fp):
    gint, lg, rel_leaf = lr
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    bflt[b, BF_BASE] = _lrfu_bump(bflt[b, BF_BASE], fp[FP_TAU], False)
    _lrfu_accessed(h, gint, lg, rel_leaf, ip, fp)


@_jit(nogil=True, inline="always")
def _lirs_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
              gwhere, gends, block_of_id, ip, fp):
    sprev, snxt, swhere, sstat = (ls[0], ls[1], ls[2], ls[3])
    _cut(prev, nxt, where, ends, b)
    if sstat[h] == LIR:
        was_bottom = gends[1, 0] == h
        _lirs_to_top(sprev, snxt, swhere, gends, h)
        if was_bottom:
            _lirs_prune(sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends)
    elif swhere[h] >= 0:                                      # HIR in S: LIR now
        ip[IP_NUM_LIR] += 1
        sstat[h] = LIR
        _lirs_to_top(sprev, snxt, swhere, gends, h)
        _lirs_demote_bottom(prev, nxt, where, ends, sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends,
                            block_of_id, ip)
    else:
        _lirs_to_top(sprev, snxt, swhere, gends, h)           # stays HIR; rejoins Q's end when released


@_jit(nogil=True, inline="always")
def _wtinylfu_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev,
                  gnxt, gwhere, gends, block_of_id, ip, fp):
    gint = lr[0]
    _cut(prev, nxt, where, ends, b)
    _wt_count(h, gval, gint, ip)
    if ival[b] == 1:
        _wt_move(b, 2, ival, ip)
        _wt_demote_overflow(prev, nxt, where, ends, ival, ip)


@_jit(nogil=True, inline="always")
def _lecar_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
               gwhere, gends, block_of_id, ip, fp):
    _cut(prev, nxt, where, ends, b)
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    ip[IP_TIME] += 1
    ival[b] += 1


@_jit(nogil=True, inline="always")
def _belady_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
                gwhere, gends, block_of_id, ip, fp):
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)


@_jit(nogil=True, inline="always")
def _workload_hit(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev,
                  gnxt, gwhere, gends, block_of_id, ip, fp):
    lw = ls[5]
    cls = jval[b]
    _wl_unwait(lw, bint, cls, b)
    _wl_learn(lw, bint, kt, gends, cls, 1.0, True, ip, fp)     # re-keys the class too


@_jit(nogil=True, inline="always")
def _hit_nothing(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, gval, lr, ls, gprev, gnxt,
                 gwhere, gends, block_of_id, ip, fp):
    pass


@_jit(nogil=True, inline="always")
def _slru_demote_overflow(prev, nxt, where, ends, ival, ip):
    while ip[IP_NUM_PROTECTED] > ip[IP_LIMIT] and ends[1, 2]:
        b = _pop_head(prev, nxt, where, ends, 1)
        ival[b] = 0
        ip[IP_NUM_PROTECTED] -= 1
        _push(prev, nxt, where, ends, 0, b)


# released: ``b``, cached under ``h``, is a candidate again (its request ended).
@_jit(nogil=True, inline="always")
def _lru_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                  lr, ls, ip, fp):
    _push(prev, nxt, where, ends, 0, b)


@_jit(nogil=True, inline="always")
def _slru_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                   lr, ls, ip, fp):
    if ival[b]:
        _push(prev, nxt, where, ends, 1, b)
        _slru_demote_overflow(prev, nxt, where, ends, ival, ip)
    else:
        _push(prev, nxt, where, ends, 0, b)


@_jit(nogil=True, inline="always")
def _arc_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                  lr, ls, ip, fp):
    _push(prev, nxt, where, ends, ival[b], b)


@_jit(nogil=True, inline="always")
def _lfu_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                  lr, ls, ip, fp):
    kt[b] = ip[IP_TICKET]
    ip[IP_TICKET] += 1
    n = ip[IP_HEAP]
    heap[n] = b
    ip[IP_HEAP] = n + 1
    _sift_up(heap, pos, ival, fval, kt, n)


@_jit(nogil=True, inline="always")
def _twoq_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                   lr, ls, ip, fp):
    if ival[b]:
        _push(prev, nxt, where, ends, 1, b)


@_jit(nogil=True, inline="always")
def _mq_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                 lr, ls, ip, fp):
    _push(prev, nxt, where, ends, jval[b], b)
    if ip[IP_PENDING]:
        _mq_adjust(prev, nxt, where, ends, jval, kt, ip)


@_jit(nogil=True, inline="always")
def _leaf_lru_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval,
                       gflt, lr, ls, ip, fp):
    kt[b] = ip[IP_TICKET]
    ip[IP_TICKET] += 1
    if gval[h]:
        _hpush(heap, pos.shape[0], pos, fval, kt, ip, IP_HEAP2, b)
        where[b] = 1
    else:
        _hpush(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
        where[b] = 0


@_jit(nogil=True, inline="always")
def _gdsf_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                   lr, ls, ip, fp):
    depth = bint[b, B_DEPTH]
    value = ival[b] * (1.0 + fp[FP_DEPTH_COST] * depth)
    if ip[IP_INHERIT]:
        inherited = gflt[h]                                   # the best child's value since (0: none)
        gflt[h] = 0.0
        if inherited > value:
            value = inherited
    base = fp[FP_CLOCK]
    parent = bint[b, B_PARENT] if depth else NONE
    if parent != NONE and block_of_id[parent] < 0:           # an orphan: never hit again
        priority = base + value * fp[FP_ORPHAN]
    else:
        priority = base + value
        if parent != NONE:
            _kid_add(bint, gval, jval, parent, b)
            if ip[IP_INHERIT] and gflt[parent] < value:
                gflt[parent] = value
    kt[b] = ip[IP_TICKET]
    ip[IP_TICKET] += 1
    fval[b] = priority
    bflt[b, BF_BASE] = base
    bflt[b, BF_VALUE] = value
    _hpush(heap, 0, pos, fval, kt, ip, IP_HEAP, b)


@_jit(nogil=True, inline="always")
def _lrfu_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                   lr, ls, ip, fp):
    gint, lg, rel_leaf = lr
    now = ip[IP_NOW] + 1
    ip[IP_NOW] = now
    fp[FP_TAU] += fp[FP_INV_H]
    leaf = gval[h] == 0
    score = bflt[b, BF_BASE]
    if leaf and ip[IP_LEAF_PENALTY]:
        score -= _lrfu_penalty(ip, fp)
    fval[b] = score
    kt[b] = now
    _hpush(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    gint[h, G_OPEN] = now                                     # an experiment, open for a window
    lg[now, 2] = h
    rel_leaf[now] = leaf
    horizon = now - ip[IP_WINDOW]
    tick = ip[IP_REL_HEAD]
    while tick <= horizon:                                    # close (as not reused) what left it
        old = lg[tick, 2]
        if gint[old, G_OPEN] == tick:
            gint[old, G_OPEN] = -1
            _lrfu_learn(rel_leaf[tick], 0.0, fp)
        tick += 1
    ip[IP_REL_HEAD] = tick


@_jit(nogil=True, inline="always")
def _lirs_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval, gflt,
                   lr, ls, ip, fp):
    sstat = ls[3]
    q = 1 if sstat[h] == LIR else 0
    _push(prev, nxt, where, ends, q, b)


@_jit(nogil=True, inline="always")
def _wtinylfu_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval,
                       gflt, lr, ls, ip, fp):
    segment = ival[b]
    _push(prev, nxt, where, ends, segment, b)
    if segment == 2:
        _wt_demote_overflow(prev, nxt, where, ends, ival, ip)
    elif segment == 0 and ip[IP_SIZE0] > ip[IP_WINDOW]:
        _wt_spill(prev, nxt, where, ends, ival, ip)


@_jit(nogil=True, inline="always")
def _heap_by_release(heap, pos, fval, kt, ip, b, key):
    """``b`` into the heap keyed (``key``, its release ticket): ties go to the earlier release."""
    fval[b] = key
    kt[b] = ip[IP_TICKET]
    ip[IP_TICKET] += 1
    _hpush(heap, 0, pos, fval, kt, ip, IP_HEAP, b)


@_jit(nogil=True, inline="always")
def _lecar_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval,
                    gflt, lr, ls, ip, fp):
    _push(prev, nxt, where, ends, 0, b)
    _heap_by_release(heap, pos, fval, kt, ip, b, ival[b])      # keyed (count, release ticket)


@_jit(nogil=True, inline="always")
def _belady_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval,
                     gflt, lr, ls, ip, fp):
    _heap_by_release(heap, pos, fval, kt, ip, b, -gflt[h])     # keyed (-next use, release ticket)


@_jit(nogil=True, inline="always")
def _workload_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval,
                       gflt, lr, ls, ip, fp):
    lw = ls[5]
    cls = jval[b]
    ticket = ip[IP_TICKET]
    ip[IP_TICKET] += 1
    ip[IP_NOW] = ticket
    kt[b] = ticket
    _wl_wait(lw, bint, cls, b)
    if lw[6][cls] == 1:
        _wl_rekey(lw, bint, kt, cls, ip, fp)


# FIFO, S3-FIFO, CLOCK, SIEVE, 2Q's A1in: a held block keeps its place; releasing it only ends the hold
@_jit(nogil=True, inline="always")
def _released_nothing(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt, block_of_id, gval,
                      gflt, lr, ls, ip, fp):
    pass
    # FIFO, S3-FIFO, CLOCK, SIEVE, 2Q's A1in: a held block keeps its place; releasing it only ends the hold


# evict: one victim, as the policy's ``evict`` chooses it (the caller drops its hash).
@_jit(nogil=True, inline="always")
def _lru_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
               block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    return _pop_head(prev, nxt, where, ends, 0)


@_jit(nogil=True, inline="always")
def _fifo_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    b = _first_candidate(nxt, held, ends, cursor, 0)
    _cut_candidate(prev, nxt, where, ends, cursor, b)
    return b


@_jit(nogil=True, inline="always")
def _slru_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    if ends[0, 2]:
        b = _pop_head(prev, nxt, where, ends, 0)
    else:
        b = _pop_head(prev, nxt, where, ends, 1)
        ip[IP_NUM_PROTECTED] -= 1
    return b


@_jit(nogil=True, inline="always")
def _s3fifo_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                  id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    while True:
        small_candidates = ends[0, 2] - heldq[0]
        if small_candidates and (ends[0, 2] >= ip[IP_SMALL_TARGET] or ends[1, 2] - heldq[1] == 0):
            b = _first_candidate(nxt, held, ends, cursor, 0)
            _cut_candidate(prev, nxt, where, ends, cursor, b)
            if ival[b] >= ip[IP_MOVE]:                       # lazy promotion to main
                _push_candidate(prev, nxt, where, ends, cursor, 1, b)
                continue
            _ghost_add(gprev, gnxt, gwhere, gends, 0, id_of_block[b])
            if gends[0, 2] > ip[IP_GHOST_SIZE]:
                _pop_head(gprev, gnxt, gwhere, gends, 0)
            return b
        b = _first_candidate(nxt, held, ends, cursor, 1)
        _cut_candidate(prev, nxt, where, ends, cursor, b)
        if ival[b]:                                           # second chance
            ival[b] -= 1
            _push_candidate(prev, nxt, where, ends, cursor, 1, b)
            continue
        return b


@_jit(nogil=True, inline="always")
def _arc_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
               block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    if ends[1, 2] and (ip[IP_SIZE1] > fp[FP_P] or not ends[2, 2]):
        b = _pop_head(prev, nxt, where, ends, 1)
        which = 1
        ip[IP_SIZE1] -= 1
    else:
        b = _pop_head(prev, nxt, where, ends, 2)
        which = 2
        ip[IP_SIZE2] -= 1
    _ghost_add(gprev, gnxt, gwhere, gends, which, id_of_block[b])
    _arc_trim(gprev, gnxt, gwhere, gends, ip)
    return b


@_jit(nogil=True, inline="always")
def _lfu_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
               block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    b = heap[0]
    _heap_remove(heap, pos, ival, fval, kt, ip, b)
    return b


@_jit(nogil=True, inline="always")
def _clock_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                 id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    while True:
        b = _first_candidate(nxt, held, ends, cursor, 0)
        _cut_candidate(prev, nxt, where, ends, cursor, b)
        if ival[b]:                                           # second chance: back to the new end
            ival[b] -= 1
            _push_candidate(prev, nxt, where, ends, cursor, 0, b)
            continue
        return b


@_jit(nogil=True, inline="always")
def _sieve_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                 id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    c = cursor[0]
    if c == UNSET:
        c = ip[IP_HAND]
        if c == NONE:
            c = ends[0, 0]
    while True:
        while c != NONE and held[c]:
            c = nxt[c]
        if c == NONE:                                         # past the newest: wrap to the oldest
            c = ends[0, 0]
            continue
        if ival[c]:
            ival[c] = 0
            c = nxt[c]
            continue
        break
    b = c
    after = nxt[b]
    _cut(prev, nxt, where, ends, b)
    c = after
    while c != NONE and held[c]:
        c = nxt[c]
    if c == NONE:
        ip[IP_HAND] = NONE
        cursor[0] = UNSET
    else:
        ip[IP_HAND] = after
        cursor[0] = c
    return b


@_jit(nogil=True, inline="always")
def _twoq_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    if ends[0, 2] - heldq[0] and (ends[0, 2] > ip[IP_LIMIT] or not ends[1, 2]):
        b = _first_candidate(nxt, held, ends, cursor, 0)
        _cut_candidate(prev, nxt, where, ends, cursor, b)
        _bounded_ghost_add(gprev, gnxt, gwhere, gends, gval, 0, id_of_block[b], 0, ip[IP_GHOST_SIZE], ip)
        return b
    return _pop_head(prev, nxt, where, ends, 1)


@_jit(nogil=True, inline="always")
def _mq_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
              block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    if ip[IP_PENDING]:
        _mq_adjust(prev, nxt, where, ends, jval, kt, ip)
    q = 0
    while not ends[q, 2]:
        q += 1
    b = _pop_head(prev, nxt, where, ends, q)
    _bounded_ghost_add(gprev, gnxt, gwhere, gends, gval, 0, id_of_block[b], ival[b], ip[IP_GHOST_SIZE], ip)
    return b


@_jit(nogil=True, inline="always")
def _leaf_lru_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                    id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    blocks = pos.shape[0]
    if ip[IP_HEAP]:
        b = heap[0]
        _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    else:                                                     # no leaf waits: the oldest inner one
        b = heap[blocks]
        _hremove(heap, blocks, pos, fval, kt, ip, IP_HEAP2, b)
    where[b] = -1
    parent = jval[b]
    if parent >= 0:
        n = gval[parent] - 1
        gval[parent] = n
        if n == 0:                                            # its parent is a leaf again
            p = block_of_id[parent]
            if p >= 0 and where[p] == 1:
                _leaf_move(heap, pos, where, fval, kt, ip, p, 0)
    return b


@_jit(nogil=True, inline="always")
def _gdsf_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    parent = ip[IP_EVICTED_PARENT]
    if parent != NONE:                                        # its waiting children are orphans now
        ip[IP_EVICTED_PARENT] = NONE
        if block_of_id[parent] < 0:
            c = gval[parent]
            gval[parent] = NONE
            while c != NONE:
                after = bint[c, B_KNEXT]
                jval[c] = NONE
                fval[c] = bflt[c, BF_BASE] + bflt[c, BF_VALUE] * fp[FP_ORPHAN]
                _hrekey(heap, 0, pos, fval, kt, ip, IP_HEAP, c)
                c = after
    b = heap[0]
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    if jval[b] != NONE:
        _kid_remove(bint, gval, jval, b)
    if fval[b] > fp[FP_CLOCK]:
        fp[FP_CLOCK] = fval[b]
    h = id_of_block[b]
    gflt[h] = 0.0
    if gval[h] != NONE:
        ip[IP_EVICTED_PARENT] = h
    return b


@_jit(nogil=True, inline="always")
def _car_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
               block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    while True:
        t1 = ends[1, 2] - heldq[1]
        if t1 and (ends[1, 2] >= max(1.0, fp[FP_P]) or ends[2, 2] - heldq[2] == 0):
            which = 1
        else:
            which = 2
        b = _first_candidate(nxt, held, ends, cursor, which)
        _cut_candidate(prev, nxt, where, ends, cursor, b)
        if ival[b]:                                           # second chance, in T2
            ival[b] = 0
            _push_candidate(prev, nxt, where, ends, cursor, 2, b)
            continue
        _push(gprev, gnxt, gwhere, gends, which, id_of_block[b])
        return b


@_jit(nogil=True, inline="always")
def _lrfu_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    b = heap[0]
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    h = id_of_block[b]
    _push(gprev, gnxt, gwhere, gends, 0, h)
    gflt[h] = bflt[b, BF_BASE]
    while gends[0, 2] > ip[IP_GHOST_SIZE]:
        _pop_head(gprev, gnxt, gwhere, gends, 0)
    parent = jval[b]
    if parent >= 0:
        gval[parent] -= 1
        jval[b] = NONE
    return b


@_jit(nogil=True, inline="always")
def _lirs_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt, id_of_block,
                block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    sprev, snxt, swhere, sstat = ls[0], ls[1], ls[2], ls[3]
    q = 0 if ends[0, 2] else 1
    b = _pop_head(prev, nxt, where, ends, q)
    h = id_of_block[b]
    st = sstat[h]
    if st == LIR:
        ip[IP_NUM_LIR] -= 1
        sstat[h] = -1
        _cut(sprev, snxt, swhere, gends, h)
        _lirs_prune(sprev, snxt, swhere, sstat, gprev, gnxt, gwhere, gends)
    elif swhere[h] >= 0:
        sstat[h] = NONRESIDENT
        _push(gprev, gnxt, gwhere, gends, 0, h)
        if gends[0, 2] > ip[IP_NONRESIDENT_LIMIT]:
            oldest = _pop_head(gprev, gnxt, gwhere, gends, 0)
            _cut(sprev, snxt, swhere, gends, oldest)
            sstat[oldest] = -1
    else:
        sstat[h] = -1
    return b


@_jit(nogil=True, inline="always")
def _wtinylfu_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                    id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    main = 1 if ends[1, 2] else (2 if ends[2, 2] else -1)
    if ends[0, 2] and (ip[IP_SIZE0] >= ip[IP_WINDOW] or main < 0):
        candidate = ends[0, 0]
        if main >= 0:
            victim = ends[main, 0]
            if gval[id_of_block[candidate]] > gval[id_of_block[victim]]:   # admitted: the main victim goes
                _cut(prev, nxt, where, ends, candidate)
                _wt_move(candidate, 1, ival, ip)
                _push(prev, nxt, where, ends, 1, candidate)
                return _wt_take(prev, nxt, where, ends, ival, ip, victim)
        return _wt_take(prev, nxt, where, ends, ival, ip, candidate)
    return _wt_take(prev, nxt, where, ends, ival, ip, ends[main, 0])


@_jit(nogil=True, inline="always")
def _lecar_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                 id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    by_lru = ends[0, 0]
    by_lfu = heap[0]
    expert = 0 if _mt_random(mt) < fp[FP_W_LRU] else 1
    b = by_lru if expert == 0 else by_lfu
    _cut(prev, nxt, where, ends, b)
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    if by_lru != by_lfu:
        _lc_add(gprev, gnxt, gwhere, gends, gval, gint, expert, id_of_block[b], ip[IP_TIME], ival[b],
                ip[IP_CAPACITY], ip)
    return b


@_jit(nogil=True, inline="always")
def _belady_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                  id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    b = heap[0]
    _hremove(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
    return b


@_jit(nogil=True, inline="always")
def _workload_evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                    id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    lw = ls[5]
    gcls, gtick, touched = lw[11], lw[12], lw[13]
    cls = lw[7][0]
    b = lw[4][cls]
    _wl_unwait(lw, bint, cls, b)
    h = id_of_block[b]
    _push(gprev, gnxt, gwhere, gends, 0, h)
    gcls[h] = cls
    gtick[h] = kt[b]
    horizon = ip[IP_NOW] - fp[FP_WINDOW_TICKS]
    n = 0
    while gends[0, 2]:                  # forget (and count as not reused) what left the window
        g = gends[0, 0]
        if gtick[g] >= horizon and gends[0, 2] <= ip[IP_GHOST_SIZE]:
            break
        _pop_head(gprev, gnxt, gwhere, gends, 0)
        c = gcls[g]
        _wl_learn(lw, bint, kt, gends, c, 0.0, False, ip, fp)
        if c != cls:
            touched[n] = c
            n += 1
    _wl_rekey(lw, bint, kt, cls, ip, fp)
    for i in range(n):                  # re-keying is idempotent: a class listed twice is no matter
        if lw[8][touched[i]] >= 0:
            _wl_rekey(lw, bint, kt, touched[i], ip, fp)
    return b


@_jit(nogil=True, inline="always")
def _evict_nothing(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval, fval, kt, bint, bflt,
                   id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt, ls, mt, gint, ip, fp):
    pass


# each kind's (cached, hit, released, evict): what the loop of that kind inlines
EVENTS = {
    LRU: (_cached_nothing, _lru_hit, _lru_released, _lru_evict),
    FIFO: (_fifo_cached, _hit_nothing, _released_nothing, _fifo_evict),
    SLRU: (_slru_cached, _slru_hit, _slru_released, _slru_evict),
    S3FIFO: (_s3fifo_cached, _s3fifo_hit, _released_nothing, _s3fifo_evict),
    ARC: (_arc_cached, _arc_hit, _arc_released, _arc_evict),
    LFU: (_lfu_cached, _lfu_hit, _lfu_released, _lfu_evict),
    CLOCK: (_clock_cached, _clock_hit, _released_nothing, _clock_evict),
    SIEVE: (_sieve_cached, _sieve_hit, _released_nothing, _sieve_evict),
    TWOQ: (_twoq_cached, _twoq_hit, _twoq_released, _twoq_evict),
    MQ: (_mq_cached, _mq_hit, _mq_released, _mq_evict),
    LEAF_LRU: (_leaf_lru_cached, _leaf_lru_hit, _leaf_lru_released, _leaf_lru_evict),
    GDSF: (_gdsf_cached, _gdsf_hit, _gdsf_released, _gdsf_evict),
    CAR: (_car_cached, _car_hit, _released_nothing, _car_evict),
    LRFU: (_lrfu_cached, _lrfu_hit, _lrfu_released, _lrfu_evict),
    LIRS: (_lirs_cached, _lirs_hit, _lirs_released, _lirs_evict),
    WTINYLFU: (_wtinylfu_cached, _wtinylfu_hit, _wtinylfu_released, _wtinylfu_evict),
    LECAR: (_lecar_cached, _lecar_hit, _lecar_released, _lecar_evict),
    BELADY: (_cached_nothing, _belady_hit, _belady_released, _belady_evict),
    WORKLOAD: (_workload_cached, _workload_hit, _workload_released, _workload_evict),
}


# -- one compiled loop per policy kind --------------------------------------------------------------
# Each kind's loop inlines only that kind's four event functions (``EVENTS``). One loop switching
# on the kind at every event inlined every policy's code: numba spent minutes inlining it, and its
# pass that removes redundant reference counting gave up on a function that size, so three
# quarters of LRU's replay of the WEKA folder went to NRT_incref / NRT_decref (3.6 s; 0.19 s now).
# The event functions are the loop's globals (a copy of this module's, per kind), not closure
# cells: numba keys a cached closure by its cells' pickled contents, and a pickled dispatcher
# differs from one process to the next. The cells are ``kind`` and the digest of replay_layout.py,
# whose edits alone (the constants) would otherwise load a loop compiled with the old ones.
_LAYOUT = hashlib.sha256(Path(replay_layout.__file__).read_bytes()).hexdigest()
_loops: dict = {}


def _loop_for(kind: int):
    layout = _LAYOUT

    # on_cached, on_hit, on_released and evict are this kind's ``EVENTS``: globals of the copy below
    def replay_kind(offsets, ids, total_blocks, capacity, warm, ip, fp, ends, gends,
                    prev, nxt, where, ival, jval, fval, kt, bint, bflt, heap, pos, gprev, gnxt, gwhere, gval, gflt,
                    gint, lg, rel_leaf, sprev, snxt, swhere, sstat, mt, nu, lw, hits, counters):
        layout_digest = layout  # noqa: F841  (read: it is what makes ``layout`` a cell)
        num_requests = offsets.shape[0] - 1
        lr = (gint, lg, rel_leaf)
        ls = (sprev, snxt, swhere, sstat, mt, lw)      # LIRS's arrays, LeCaR's state, workload's arrays
        blocks = prev.shape[0]      # the most blocks ever handed out (``CompiledReplay``): <= capacity
        # int32 where the counts fit (``fastreplay.run`` picks the links' width): the id -> block map
        # is read at random across the trace's distinct ids, so its width is cache misses
        block_of_id = np.full(gwhere.shape[0], -1, prev.dtype)
        id_of_block = np.full(blocks, -1, ids.dtype)
        free = np.empty(blocks, prev.dtype)
        free_top = 0
        fresh = 0
        reused = np.zeros(blocks, np.uint8)
        held = np.zeros(blocks, np.uint8)
        heldq = np.zeros(ends.shape[0], np.int64)
        cursor = np.full(ends.shape[0], UNSET, np.int64)
        longest = 0
        for i in range(num_requests):
            longest = max(longest, total_blocks[i])
        table = np.empty(min(longest, capacity), np.int64)
        evictions = 0
        cached = 0
        unused = 0
        for i in range(num_requests):
            if i == warm:
                counters[C_EVICTIONS_W] = evictions
                counters[C_CACHED_W] = cached
                counters[C_UNUSED_W] = unused
            start = offsets[i]
            n = offsets[i + 1] - start
            total = total_blocks[i]
            if kind == BELADY:      # the oracle hears of every reference before the request is admitted
                for j in range(n):
                    h = ids[start + j]
                    gflt[h] = nu[start + j]                           # the id's next use (inf: never)
                    b = block_of_id[h]
                    if b >= 0 and pos[b] >= 0:                        # a candidate: re-keyed, its ticket kept
                        fval[b] = -nu[start + j]
                        _hrekey(heap, 0, pos, fval, kt, ip, IP_HEAP, b)
            if total > capacity:
                hits[i] = 0
                continue
            k = 0
            while k < n:
                b = block_of_id[ids[start + k]]
                if b < 0:
                    break
                table[k] = b
                k += 1
            hits[i] = k
            for j in range(k):              # pinned: the allocation below cannot take them
                b = table[j]
                on_hit(b, ids[start + j], prev, nxt, where, ends, heap, pos, ival, jval, fval, kt,  # noqa: F821
                       bint, bflt, gval, lr, ls, gprev, gnxt, gwhere, gends, block_of_id, ip, fp)
                held[b] = 1
                if where[b] >= 0:           # FIFO, S3-FIFO: held in place, no candidate while held
                    heldq[where[b]] += 1
                reused[b] = 1
            need = total - k
            if need <= free_top:
                for j in range(need):
                    table[k + j] = free[free_top - 1 - j]
                free_top -= need
            else:
                got = 0
                for j in range(free_top):
                    table[k + got] = free[free_top - 1 - j]
                    got += 1
                free_top = 0
                take = min(capacity - fresh, need - got)
                for j in range(take):
                    table[k + got] = fresh + j
                    got += 1
                fresh += take
                for q in range(cursor.shape[0]):
                    cursor[q] = UNSET
                while got < need:
                    v = evict(prev, nxt, where, ends, cursor, held, heldq, heap, pos, ival, jval,  # noqa: F821
                              fval, kt, bint, bflt, id_of_block, block_of_id, gprev, gnxt, gwhere, gends, gval,
                              gflt, ls, mt, gint, ip, fp)
                    evictions += 1
                    if not reused[v]:
                        unused += 1
                    reused[v] = 0
                    block_of_id[id_of_block[v]] = -1
                    id_of_block[v] = -1
                    cached -= 1
                    table[k + got] = v
                    got += 1
            for j in range(k, n):           # publish: an id cached already leaves a duplicate
                b = table[j]
                h = ids[start + j]
                if block_of_id[h] < 0:
                    block_of_id[h] = b
                    id_of_block[b] = h
                    cached += 1
                    parent = ids[start + j - 1] if j else NONE
                    on_cached(b, h, j, parent, prev, nxt, where, ends, cursor, heap, pos, ival,  # noqa: F821
                              jval, fval, kt, bint, bflt, block_of_id, gprev, gnxt, gwhere, gends, gval, gflt,
                              lr, ls, ip, fp)
            for j in range(total - 1, -1, -1):      # tail first
                b = table[j]
                if j < k:
                    held[b] = 0
                    if where[b] >= 0:
                        heldq[where[b]] -= 1
                h = id_of_block[b]
                if h >= 0:
                    on_released(b, h, prev, nxt, where, ends, heap, pos, ival, jval, fval, kt, bint, bflt,  # noqa: F821
                                 block_of_id, gval, gflt, lr, ls, ip, fp)
                else:
                    free[free_top] = b
                    free_top += 1
        unused_cached = 0
        for b in range(blocks):
            if id_of_block[b] >= 0 and not reused[b]:
                unused_cached += 1
        counters[C_EVICTIONS] = evictions
        counters[C_CACHED] = cached
        counters[C_UNUSED] = unused
        counters[C_UNUSED_CACHED] = unused_cached
        if warm >= num_requests:
            counters[C_EVICTIONS_W] = evictions
            counters[C_CACHED_W] = cached
            counters[C_UNUSED_W] = unused

    namespace = dict(globals())
    namespace.update(zip(("on_cached", "on_hit", "on_released", "evict"), EVENTS[kind]))
    loop = types.FunctionType(replay_kind.__code__, namespace, replay_kind.__name__, None, replay_kind.__closure__)
    loop.__qualname__ = replay_kind.__qualname__
    return _jit(nogil=True)(loop)


def replay_cache(kind, *state):
    """Replay every request (cache mode) under policy ``kind``; ``hits[i]``: request ``i``'s
    leading hits (0 for one longer than the pool, which changes nothing); ``counters``: see
    ``C_*``. The policy state arrays (``state``) come initialised from ``fastreplay.run``."""
    loop = _loops.get(kind)
    if loop is None:
        loop = _loops[kind] = _loop_for(kind)
    loop(*state)
