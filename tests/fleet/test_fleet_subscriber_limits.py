"""The subscriber over hours and floods, on a scripted worker and a test clock moved by hand: the
retry back-off of a replay request never answered stays bounded (``poll`` keeps working after
thousands of retries), and a flood of early batches while a snapshot is out costs no scan per batch.
"""

from __future__ import annotations

import time

from fleet_doubles import follow, live_link, stored, until  # noqa: F401 (fixture)

from prefixkv.fleet import subscriber as subscriber_module
from prefixkv.fleet import wire

INTERVAL = 1000.0    # the scripted worker's heartbeat interval (the test clock moves by hand)


def test_a_request_never_answered_for_hours_does_not_break_poll(follow):
    """The retry back-off computed REPLY_TIMEOUT_S * 2 ** retries with retries never capped: after
    ~1024 unanswered retries (about 4.5 h at the 16 s cap) the float overflowed and every poll()
    raised OverflowError, for every worker the router follows."""
    worker, sub, clock = follow
    link = live_link(worker, sub)
    worker.publish(stored(1), lost=True)
    worker.publish(stored(2, parent=1))
    until(sub, lambda: link.asking == "replay")
    for step in range(1100):              # ~5 h on the test clock, beating as a live worker does
        clock.now += subscriber_module.MAX_RETRY_S + 1.0
        if step % 10 == 0:
            worker.beat()                 # handled before the clock moves on: the worker stays live
            until(sub, lambda: link.last_seen == clock.now)
        sub.poll(0.0)
        if step % 50 == 0:
            worker.take_requests()
    assert link.asking == "replay" and link.retries >= 1024     # asked again all along
    worker.take_requests()
    clock.now += subscriber_module.MAX_RETRY_S + 1.0
    worker.beat()
    until(sub, lambda: link.asking is None and 2 in sub.index.blocks_of("w"), worker, bound=5.0)


def test_overflow_while_a_snapshot_is_out_is_not_a_scan_per_batch(follow):
    """While a snapshot was out, each early batch past MAX_PENDING dropped the oldest with
    min(link.pending): a scan of all MAX_PENDING (10,000) keys per batch, exactly when a
    flood arrives. Draining a flood of early batches stays cheap."""
    worker, sub, clock = follow
    link = live_link(worker, sub)
    batch = wire.KVEventBatch(ts=0.0, events=[stored(1)], data_parallel_rank=0)
    limit = subscriber_module.MAX_PENDING
    start = time.perf_counter()
    for seq in range(1, limit + 1):       # seq 0 never comes: early batches, up to the limit
        sub._offer(link, seq, batch)
    baseline = time.perf_counter() - start
    sub._offer(link, limit + 1, batch)    # one past it: a snapshot is asked for (the early batches go)
    assert link.asking == "snapshot" and not link.pending
    for seq in range(limit + 2, 2 * limit + 2):    # early again, up to the limit
        sub._offer(link, seq, batch)
    start = time.perf_counter()
    for seq in range(2 * limit + 2, 3 * limit + 2):    # as many again past it, the snapshot still out
        sub._offer(link, seq, batch)
    spent = time.perf_counter() - start
    assert link.asking == "snapshot" and len(link.pending) <= limit
    assert max(link.pending) == 3 * limit + 1       # the newest are kept: the snapshot covers the oldest
    assert spent < 20 * baseline + 0.1, f"{limit} early batches took {spent:.3f} s, {baseline:.3f} s below the limit"
