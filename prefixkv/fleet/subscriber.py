"""The router's side of the wire: workers' event streams into a KVIndex (extra ``[fleet]``).

Per worker, ``FleetSubscriber`` holds a SUB socket on its events, a SUB socket on its
heartbeats and a DEALER socket on its replay socket, and keeps the stream whole:

* batches apply in sequence order; a gap (a batch ahead of the next expected one, or a
  heartbeat announcing batches not seen) buffers what came early and asks the replay
  socket for the missing ones; when the replay falls short (the worker's buffer no
  longer holds them), it asks for a snapshot; a worker that cannot give one (vLLM) is
  forgotten and followed from where its stream is now;
* a new incarnation in a heartbeat, or a live sequence number going back (the worker
  restarted), drops the worker's entries and reads its stream again from the start;
* a worker silent for ``MISSED_HEARTBEATS`` heartbeat intervals is removed: no router
  picks it until it beats again;
* a request whose reply stops coming (the worker's ROUTER socket drops what it cannot
  deliver) is asked again after ``REPLY_TIMEOUT_S`` without a reply frame, then after twice
  as long each time, up to ``MAX_RETRY_S``, until a reply frame comes;
* early batches past ``MAX_PENDING`` ask for a snapshot; while it is out, more of them drop
  the oldest (the snapshot covers those) instead of asking again;
* a heartbeat naming another worker than the one connected is refused (``WireError``).

``FleetRouter`` puts it together: ``poll()`` to take in what arrived, ``pick(tokens)`` to
route (hashing the prompt as the workers do, with the fleet's pinned seed). ``wait_ready()`` polls
until the workers are live and caught up: a router connected to a worker that already published
sees nothing of it until a heartbeat (every ``heartbeat_interval_s``) and the replay of what it
missed come in, and until then ``pick`` has no worker (``NoWorkerAvailable``) or reports misses.
"""

from __future__ import annotations

import numbers
import time
from dataclasses import dataclass, field
from typing import Callable, Hashable, Mapping, Sequence

import zmq

from ..errors import InvalidArgument
from ..hashing import NO_EXTRA_KEYS, BlockHasher, ExtraKeys, encode_tokens
from ..prompt import Prompt
from . import wire
from .index import KVIndex
from .router import Decision, RouterConfig, WorkerLoad, make_router

MISSED_HEARTBEATS = 3
MAX_PENDING = 10_000      # early batches kept while a gap is repaired; beyond: snapshot
REPLY_TIMEOUT_S = 2.0     # a replay request with no reply frame for this long is asked again
MAX_RETRY_S = 16.0        # asking again backs off (2, 4, 8... s) up to this, until a reply frame comes
MAX_MESSAGES = 10_000     # messages one poll() handles at most: it returns even while workers keep talking
_MAX_DOUBLINGS = 32       # retries past this back off no further (MAX_RETRY_S is reached long before)


@dataclass
class _Link:
    worker_id: str
    events: zmq.Socket
    heartbeats: zmq.Socket
    replay: zmq.Socket
    replay_endpoint: str = ""
    expected: int = 0                       # next sequence number to apply
    live_high: int | None = None            # highest sequence seen on the live socket (this incarnation)
    pending: dict = field(default_factory=dict)   # seq -> batch that came early
    asking: str | None = None               # "replay" / "snapshot" / "snapshot taken" while a request is out
    asked_at: float | None = None           # when the request went out, or its last reply frame came
    retries: int = 0                        # times the request out was asked again with no reply frame
    incarnation: str | None = None
    heartbeat: wire.Heartbeat | None = None
    last_seen: float | None = None
    gap_since: float | None = None          # when the current gap was noticed
    repairs: list = field(default_factory=list)   # seconds each repaired gap took


class FleetSubscriber:
    def __init__(self, index: KVIndex, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.index = index
        self.clock = clock
        self._ctx = zmq.Context()
        self._poller = zmq.Poller()
        self._links: dict[str, _Link] = {}
        self._by_socket: dict[zmq.Socket, tuple[_Link, str]] = {}

    # -- connections ---------------------------------------------------------------
    def connect(self, worker_id: str, endpoints: dict[str, str]) -> None:
        """Follow a worker: ``endpoints`` has ``events``, ``replay`` and ``heartbeat`` addresses."""
        if not isinstance(worker_id, str):   # heartbeats carry a str: any other id would never match theirs
            raise InvalidArgument("worker_id", f"must be a str (as heartbeats carry it), got "
                                               f"{type(worker_id).__name__} {worker_id!r}")
        if not isinstance(endpoints, Mapping):
            raise InvalidArgument("endpoints", f"must be a mapping of 'events', 'replay' and 'heartbeat' "
                                               f"addresses, got {type(endpoints).__name__}")
        if worker_id in self._links:
            raise InvalidArgument("worker_id", f"worker {worker_id!r} is already connected")
        missing = [name for name in ("events", "replay", "heartbeat") if name not in endpoints]
        if missing:
            raise InvalidArgument("endpoints", f"worker {worker_id!r}: endpoints need 'events', 'replay' and "
                                               f"'heartbeat' addresses; missing {', '.join(map(repr, missing))}")
        made: list = []
        try:
            for name, topic in (("events", b""), ("heartbeat", wire.HEARTBEAT_TOPIC), ("replay", None)):
                sock = self._ctx.socket(zmq.SUB if topic is not None else zmq.DEALER)
                made.append(sock)
                sock.setsockopt(zmq.LINGER, 0)
                if topic is not None:
                    sock.setsockopt(zmq.SUBSCRIBE, topic)
                try:
                    sock.connect(endpoints[name])
                except zmq.ZMQError as exc:
                    raise zmq.ZMQError(exc.errno, f"worker {worker_id!r}: cannot connect to its {name} "
                                                  f"endpoint {endpoints[name]!r}: {exc.strerror}") from None
        except BaseException:
            for sock in made:
                sock.close(0)
            raise
        events, beats, replay = made
        link = _Link(worker_id, events, beats, replay, endpoints["replay"])
        self._links[worker_id] = link
        for sock, kind in ((events, "events"), (beats, "heartbeat"), (replay, "replay")):
            self._poller.register(sock, zmq.POLLIN)
            self._by_socket[sock] = (link, kind)

    def _replay_socket(self, link: _Link) -> zmq.Socket:
        replay = self._ctx.socket(zmq.DEALER)
        replay.setsockopt(zmq.LINGER, 0)
        replay.connect(link.replay_endpoint)     # accepted once already, by connect()
        self._poller.register(replay, zmq.POLLIN)
        self._by_socket[replay] = (link, "replay")
        return replay

    def _drop_request(self, link: _Link) -> None:
        """Forget the request that is out: a fresh replay socket, so no reply to it can arrive
        and be taken for the reply to the next one (vLLM's replies do not say what they answer)."""
        if link.asking is None:
            return
        old = link.replay
        self._poller.unregister(old)
        del self._by_socket[old]
        old.close(0)
        link.replay = self._replay_socket(link)
        link.asking = None
        link.asked_at = None

    def close(self) -> None:
        for sock in self._by_socket:
            sock.close(0)
        self._ctx.term()

    # -- the loop -------------------------------------------------------------------
    def poll(self, timeout_s: float = 0.0, max_messages: int = MAX_MESSAGES) -> int:
        """Handle what arrived (waiting up to ``timeout_s`` for the first message), at most
        ``max_messages`` of it (the rest waits for the next call); returns messages handled."""
        # ZMQ reads a negative timeout as "wait forever"; a string failed deep inside the comparison
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or not timeout_s >= 0:
            raise InvalidArgument("timeout_s", f"must be a number of seconds >= 0, got {timeout_s!r}")
        if isinstance(max_messages, bool) or not isinstance(max_messages, numbers.Integral) or max_messages < 1:
            raise InvalidArgument("max_messages", f"must be an int >= 1, got {max_messages!r}")
        handled = 0
        ready = dict(self._poller.poll(int(timeout_s * 1000)))
        while ready:
            for sock in ready:
                if handled >= max_messages:
                    break
                if sock not in self._by_socket:
                    continue              # a replay socket dropped this round: its replies are stale
                link, kind = self._by_socket[sock]
                frames = sock.recv_multipart()
                handled += 1
                try:
                    if kind == "events":
                        self._on_live(link, frames)
                    elif kind == "heartbeat":
                        self._on_heartbeat(link, frames)
                    else:
                        self._on_replay(link, frames)
                except wire.WireError as exc:
                    raise wire.WireError(f"worker {link.worker_id!r}, {kind} socket: {exc}") from None
            ready = dict(self._poller.poll(0)) if handled < max_messages else {}
        self.expire()
        self._retry_requests()
        return handled

    def _retry_requests(self) -> None:
        """Ask again where a request's reply stopped coming (lost: ZMQ's ROUTER drops silently)."""
        now = self.clock()
        for link in self._links.values():
            # backing off: a worker that beats but never answers is not asked every 2 s forever
            # (the exponent capped: 2.0 * 2 ** 1024 overflows a float, after some 4.5 h of retries)
            wait_s = min(REPLY_TIMEOUT_S * 2 ** min(link.retries, _MAX_DOUBLINGS), MAX_RETRY_S)
            if link.asking is None or link.asked_at is None or now - link.asked_at <= wait_s:
                continue
            asked, retries = link.asking, link.retries
            self._drop_request(link)
            if asked == "snapshot":
                self._ask(link, "snapshot", wire.SNAPSHOT_REQUEST)
            elif link.pending or link.expected < self._target(link):
                self._ask_replay(link)
            if link.asking is not None:
                link.retries = retries + 1

    def live_workers(self) -> list[_Link]:
        now = self.clock()
        return [link for link in self._links.values() if link.heartbeat is not None and link.last_seen is not None
                and now - link.last_seen <= MISSED_HEARTBEATS * link.heartbeat.interval_s]

    def expire(self) -> list[str]:
        """Remove workers silent for ``MISSED_HEARTBEATS`` intervals from the index; returns their ids."""
        now = self.clock()
        gone = []
        for link in self._links.values():
            hb = link.heartbeat
            if hb is not None and now - link.last_seen > MISSED_HEARTBEATS * hb.interval_s:
                gone.append(link.worker_id)
                link.heartbeat = None
                link.incarnation = None
                if link.worker_id in self.index:
                    self.index.remove_worker(link.worker_id)
                self._restart_stream(link, ask=False)
        return gone

    def link(self, worker_id: str) -> _Link:
        return self._links[worker_id]

    # -- messages -------------------------------------------------------------------
    def _on_heartbeat(self, link: _Link, frames: list[bytes]) -> None:
        if len(frames) != 2:
            return
        hb = wire.decode_heartbeat(frames[1])
        if hb.worker_id != link.worker_id:
            raise wire.WireError(f"the heartbeat is from worker {hb.worker_id!r}, not from {link.worker_id!r}: "
                                 "were another worker's endpoints connected under this id?")
        self.index.add_worker(link.worker_id)
        if link.incarnation is not None and hb.incarnation != link.incarnation:
            self._resync(link)            # a restarted worker starts empty
        link.incarnation = hb.incarnation
        link.heartbeat = hb
        link.last_seen = self.clock()
        if hb.next_seq > link.expected and link.asking is None:
            self._ask_replay(link)        # batches we never saw, the last one included

    def _on_live(self, link: _Link, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = wire.seq_from(frames[1])
        batch = wire.decode_batch(frames[2])   # refused before anything changes
        if link.live_high is not None and seq <= link.live_high:
            self._resync(link)            # one incarnation's live stream only goes up: it restarted
            link.incarnation = None       # whatever the next heartbeat says is the new one
        link.live_high = seq
        self._offer(link, seq, batch)

    def _on_replay(self, link: _Link, frames: list[bytes]) -> None:
        if len(frames) != 4:
            return
        _, _, seq_frame, payload = frames
        asked = link.asking
        link.retries = 0                      # the worker answers: the next request waits the first timeout
        if seq_frame == wire.END_SEQ:
            link.asking = None
            link.asked_at = None
            if asked == "snapshot taken":
                return                    # what came after it arrives live (or a heartbeat asks for it)
            if asked == "snapshot" and link.expected < self._target(link):
                # No snapshot from this worker (a vLLM publisher): start over from where it is now.
                # (It may have had nothing applied yet: a vLLM worker sends no heartbeat.)
                self._forget_blocks(link)
                link.expected = min(link.pending, default=self._target(link))
                self._drain(link)
            elif link.expected < self._target(link):
                self._ask(link, "snapshot", wire.SNAPSHOT_REQUEST)   # the replay fell short
            return
        seq = wire.seq_from(seq_frame)
        batch = wire.decode_batch(payload)
        link.asked_at = self.clock()          # the reply is coming: no need to ask again yet
        if asked == "snapshot":
            link.asking = "snapshot taken"    # until its end marker: the worker does give snapshots
            self._forget_blocks(link)
            self._apply(link, batch, snapshot=True)
            link.expected = seq
            for old in [s for s in link.pending if s < seq]:
                del link.pending[old]
            self._drain(link)
        else:
            self._offer(link, seq, batch)

    # -- the stream ---------------------------------------------------------------
    def _target(self, link: _Link) -> int:
        """The sequence number we must reach: past every batch seen early or announced."""
        early = max(link.pending, default=-1) + 1
        announced = link.heartbeat.next_seq if link.heartbeat is not None else 0
        return max(early, announced)

    def _offer(self, link: _Link, seq: int, batch) -> None:
        if seq < link.expected:
            return                        # a replayed duplicate
        if seq > link.expected:
            link.pending[seq] = batch
            if link.gap_since is None:
                link.gap_since = self.clock()
            if len(link.pending) > MAX_PENDING:
                if link.asking == "snapshot":
                    # One is out already: asking again would drop it (and its reply), so under a
                    # sustained flood no snapshot would ever land. It covers the oldest early batches:
                    # an eighth of them go at once, one sort per many batches (not a scan per batch;
                    # the keys arrive mostly in order, which the sort is linear on).
                    for old in sorted(link.pending)[:max(1, MAX_PENDING // 8)]:
                        del link.pending[old]
                else:
                    link.pending.clear()
                    self._ask(link, "snapshot", wire.SNAPSHOT_REQUEST)
            elif link.asking is None:
                self._ask_replay(link)
            return
        self._apply(link, batch)
        link.expected = seq + 1
        self._drain(link)

    def _drain(self, link: _Link) -> None:
        while link.expected in link.pending:
            self._apply(link, link.pending.pop(link.expected))
            link.expected += 1
        if not link.pending and link.gap_since is not None and link.expected >= self._target(link):
            link.repairs.append(self.clock() - link.gap_since)
            link.gap_since = None

    def _apply(self, link: _Link, batch, snapshot: bool = False) -> None:
        index, worker = self.index, link.worker_id
        index.add_worker(worker)
        for e in batch.events:
            if isinstance(e, wire.BlockStored):
                index.stored(worker, e.block_hashes, e.medium)
            elif isinstance(e, wire.BlockRemoved):
                index.removed(worker, e.block_hashes, e.medium)
            else:
                index.cleared(worker, predictions=not snapshot)

    def _forget_blocks(self, link: _Link) -> None:
        """Drop what the index believes the worker holds, to rebuild it; the requests routed
        to it (predicted inserts) are still on their way there and keep counting."""
        self.index.add_worker(link.worker_id)
        self.index.cleared(link.worker_id, predictions=False)

    def _ask_replay(self, link: _Link) -> None:
        if link.gap_since is None:
            link.gap_since = self.clock()
        self._ask(link, "replay", wire.seq_bytes(link.expected))

    def _ask(self, link: _Link, what: str, request: bytes) -> None:
        self._drop_request(link)
        link.asking = what
        link.asked_at = self.clock()
        link.retries = 0
        link.replay.send_multipart([b"", request])

    def _resync(self, link: _Link) -> None:
        if link.worker_id in self.index:
            self.index.cleared(link.worker_id)
        self._restart_stream(link, ask=True)

    def _restart_stream(self, link: _Link, ask: bool) -> None:
        link.expected = 0
        link.pending.clear()
        link.live_high = None
        link.gap_since = None
        self._drop_request(link)          # a dead (or restarted) worker never answers it
        if ask:
            self._ask_replay(link)


class FleetRouter:
    """Workers' events -> KVIndex -> a router: ``connect``, ``poll``, ``pick``."""

    def __init__(self, router: str = "kv-aware+guard", *, block_size: int, hash_seed: int,
                 fingerprint: str = "", hash_algorithm: str = "xxh3_128", predict_ttl_s: float = 30.0,
                 on_decision: Callable[[Decision], None] | None = None,
                 clock: Callable[[], float] = time.monotonic, **router_options) -> None:
        """``clock`` (seconds) times workers' liveness, reply timeouts and predicted inserts alike."""
        # Everything that can refuse the arguments comes before the subscriber's ZMQ context, which
        # nobody could close if the constructor raised after making it.
        # None would hash prompts with this process's random seed and check no worker's: nothing
        # could ever match, yet every worker would be picked.
        if isinstance(hash_seed, bool) or not isinstance(hash_seed, numbers.Integral):
            raise InvalidArgument("hash_seed", f"the fleet's pinned seed must be an int, got "
                                               f"{type(hash_seed).__name__} {hash_seed!r}")
        if not -2**63 <= hash_seed < 2**64:
            raise InvalidArgument("hash_seed", f"{hash_seed} does not fit a worker's heartbeat (msgpack's "
                                               "64-bit integers): no worker could announce it")
        if not callable(clock):
            raise InvalidArgument("clock", f"must be callable (returning seconds), got {clock!r}")
        if on_decision is not None and not callable(on_decision):   # else pick() fails after counting
            raise InvalidArgument("on_decision", f"must be callable or None, got {on_decision!r}")
        self.clock = clock
        self.index = KVIndex(predict_ttl=predict_ttl_s)
        self.router = make_router(router, self.index, RouterConfig(block_size=block_size, fingerprint=fingerprint,
                                                                   hash_seed=hash_seed, **router_options))
        self.hasher = BlockHasher(block_size, seed=hash_seed, algorithm=hash_algorithm)
        self.subscriber = FleetSubscriber(self.index, clock=clock)
        self.on_decision = on_decision
        self._dispatched: dict[str, tuple[str, int]] = {}   # worker -> (incarnation, tokens sent since its heartbeat)

    def connect(self, worker_id: str, endpoints: dict[str, str]) -> None:
        self.subscriber.connect(worker_id, endpoints)

    def poll(self, timeout_s: float = 0.0, max_messages: int = MAX_MESSAGES) -> int:
        return self.subscriber.poll(timeout_s, max_messages)

    def not_ready(self, worker_ids: Sequence[str] | None = None) -> dict[str, str]:
        """Of ``worker_ids`` (default: every connected worker), those ``pick`` cannot yet route to
        as they are, each with why: no heartbeat seen (or none lately), or batches its last
        heartbeat announced not yet applied (a replay or snapshot under way). Read-only."""
        links = self.subscriber._links
        if worker_ids is None:
            worker_ids = list(links)
        elif isinstance(worker_ids, str):
            worker_ids = [worker_ids]
        unknown = [w for w in worker_ids if w not in links]
        if unknown:
            raise InvalidArgument("worker_ids", f"not connected: {', '.join(map(repr, unknown))}")
        live = {link.worker_id for link in self.subscriber.live_workers()}
        out = {}
        for worker_id in worker_ids:
            link = links[worker_id]
            if worker_id not in live:
                out[worker_id] = "no heartbeat yet" if link.heartbeat is None else "no recent heartbeat"
            elif link.pending or link.asking is not None or link.expected < link.heartbeat.next_seq:
                out[worker_id] = (f"catching up: {link.expected} of {link.heartbeat.next_seq} announced "
                                  f"batch(es) applied")
        return out

    def wait_ready(self, worker_ids: Sequence[str] | None = None, *, timeout_s: float = 5.0) -> float:
        """Poll until every worker of ``worker_ids`` (default: every connected one) is live and has
        applied every batch its last heartbeat announced (``not_ready()`` is empty); returns the
        seconds it took. ``TimeoutError`` after ``timeout_s`` (wall clock), naming the workers
        still not ready and why. Call it after ``connect``: a worker's first heartbeat comes within
        its ``heartbeat_interval_s`` (0.5 s by default), the replay of what it published before
        the router connected right after."""
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real) or \
                not (timeout_s > 0 and timeout_s < float("inf")):
            raise InvalidArgument("timeout_s", f"must be a finite number of seconds > 0, got {timeout_s!r}")
        start = time.monotonic()
        deadline = start + timeout_s
        while True:
            waiting = self.not_ready(worker_ids)
            if not waiting:
                return time.monotonic() - start
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"after {timeout_s:g} s: " + "; ".join(f"worker {w!r}: {why}"
                                                                         for w, why in waiting.items()))
            self.poll(min(left, 0.05))

    def hashes(self, tokens: Sequence[int], *, salt=None, adapter=None) -> list[Hashable]:
        extra = NO_EXTRA_KEYS if salt is None and adapter is None else ExtraKeys(salt=salt, adapter=adapter)
        ids = encode_tokens(tokens)
        return Prompt(self.hasher, ids, len(ids), extra).block_hashes()

    def workers(self) -> list[WorkerLoad]:
        out = []
        for link in self.subscriber.live_workers():
            hb = link.heartbeat
            since = self._dispatched.get(link.worker_id)
            extra = since[1] if since and since[0] == (hb.incarnation, hb.ts) else 0
            out.append(WorkerLoad(link.worker_id, hb.queued_prefill_tokens + extra, hb.running_requests,
                                  0, hb.fingerprint, hb.block_size, hb.hash_seed))
        return out

    def pick(self, tokens: Sequence[int] | None = None, *, hashes: Sequence[Hashable] | None = None,
             salt=None, adapter=None) -> Decision:
        """Route a prompt (token ids, or precomputed block hashes); counts its blocks as on the
        chosen worker until its events confirm them (predicted inserts)."""
        if (tokens is None) == (hashes is None):
            raise InvalidArgument("tokens", "pass the prompt's tokens or its block hashes (hashes=), one of them")
        if hashes is None:
            hashes = self.hashes(tokens, salt=salt, adapter=adapter)
            num_tokens = len(tokens)
        else:
            num_tokens = len(hashes) * self.hasher.block_size
        now = self.clock()
        self.index.expire(now)
        decision = self.router.pick(hashes, self.workers())
        self.index.predict(decision.worker_id, hashes, now)
        # Load the heartbeat cannot know yet: what we sent since it was made.
        hb = self.subscriber.link(decision.worker_id).heartbeat
        key = (hb.incarnation, hb.ts)
        since = self._dispatched.get(decision.worker_id)
        sent = since[1] if since and since[0] == key else 0
        self._dispatched[decision.worker_id] = (key, sent + num_tokens - decision.overlap_blocks * self.hasher.block_size)
        if self.on_decision is not None:
            self.on_decision(decision)
        return decision

    def close(self) -> None:
        self.subscriber.close()
