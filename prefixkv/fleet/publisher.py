"""A worker's KV events on ZMQ in vLLM's wire format, a replay socket, and heartbeats (extra ``[fleet]``).

``KVEventPublisher`` binds three sockets:

* events (PUB): ``(topic, seq as 8 bytes big-endian, msgpack KVEventBatch)``, exactly as
  vLLM's ``ZmqEventPublisher`` sends them, so llm-d's indexer or Dynamo can subscribe;
* replay (ROUTER): an 8-byte start sequence gets every buffered batch from there, then
  the end marker (sequence -1), as vLLM answers; prefixkv's extra request
  ``SNAPSHOT_REQUEST`` gets one batch ``[AllBlocksCleared, BlockStored...]`` rebuilding
  everything the worker holds, whose sequence field is the next sequence number (the
  state reflects every batch before it), then the end marker;
* heartbeats (PUB, topic ``prefixkv-heartbeat``): worker id, incarnation, fingerprint,
  free blocks, queued prefill tokens, running requests and the next sequence number,
  every ``heartbeat_interval_s``.

Every socket is owned by one background thread (ZMQ sockets are not thread-safe);
``publish`` hands batches to it through an in-process socket, so the caller never blocks
on the network.
"""

from __future__ import annotations

import math
import numbers
import operator
import threading
import time
import uuid
from collections import deque
from typing import Iterable, Mapping, Sequence

import zmq

from ..errors import InvalidArgument
from . import wire

MAX_POLL_S = 1.0    # the socket thread's longest wait: ZMQ's poll timeout is a C long of milliseconds


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _hashing_of(manager) -> tuple[int, int | None]:
    """(block size, hash seed) a manager hashes with, as a heartbeat states them: an unpinned
    seed is random per process, so no other process can match it (None)."""
    try:
        block_size = manager.block_size
        seed = manager.hasher.seed if manager.hash_seed_pinned else None
    except AttributeError as exc:
        raise InvalidArgument("manager", f"expected a KVCacheManager, got {type(manager).__name__} "
                                         f"({exc})") from None
    return block_size, seed


class KVEventPublisher:
    """A worker's KV events, replay socket and heartbeats (see the module's docstring).

    ``manager``: the ``KVCacheManager`` whose events this publishes; its block size and hash
    seed are what the heartbeats announce (``block_size`` / ``hash_seed`` then need not be
    given, and are refused if they differ). Without it, ``block_size`` is required.
    """

    def __init__(self, worker_id: str, *, block_size: int | None = None, manager=None,
                 endpoint: str = "tcp://127.0.0.1:0", replay_endpoint: str = "tcp://127.0.0.1:0",
                 heartbeat_endpoint: str = "tcp://127.0.0.1:0", topic: str = "", fingerprint: str = "",
                 hash_seed: int | None = None, heartbeat_interval_s: float = 0.5, buffer_steps: int = 10_000,
                 data_parallel_rank: int = 0) -> None:
        # Every argument is checked before the socket thread starts: what the heartbeat cannot
        # encode (or a router cannot decode) would kill the thread or every router's poll() later.
        if manager is not None:
            own_size, own_seed = _hashing_of(manager)
            if block_size is not None and block_size != own_size:
                raise InvalidArgument("block_size", f"{block_size!r} differs from the manager's {own_size}")
            if hash_seed is not None and hash_seed != own_seed:
                raise InvalidArgument("hash_seed", f"{hash_seed!r} differs from the manager's {own_seed!r}: "
                                                   "routers would hash its prompts unlike its events")
            block_size, hash_seed = own_size, own_seed
        elif block_size is None:
            raise InvalidArgument("block_size", "required without a manager (or pass manager=)")
        for name, value in (("worker_id", worker_id), ("topic", topic), ("fingerprint", fingerprint)):
            if not isinstance(value, str):
                raise InvalidArgument(name, f"must be a str, got {type(value).__name__} {value!r}")
        for name, value, low, bound in (("block_size", block_size, 1, "positive"),
                                        ("buffer_steps", buffer_steps, 1, ">= 1"),
                                        ("data_parallel_rank", data_parallel_rank, 0, ">= 0")):
            if not _is_int(value):
                raise InvalidArgument(name, f"must be an int, got {type(value).__name__} {value!r}")
            if value < low:
                raise InvalidArgument(name, f"must be {bound}, got {value}")
        if hash_seed is not None:
            if not _is_int(hash_seed):
                raise InvalidArgument("hash_seed", f"must be an int or None, got {type(hash_seed).__name__} "
                                                   f"{hash_seed!r}")
            if not -2**63 <= hash_seed < 2**64:
                raise InvalidArgument("hash_seed", f"{hash_seed} does not fit a heartbeat (msgpack's 64-bit "
                                                   "integers, -2**63 to 2**64 - 1)")
        if isinstance(heartbeat_interval_s, bool) or not isinstance(heartbeat_interval_s, numbers.Real):
            raise InvalidArgument("heartbeat_interval_s", f"must be a number of seconds, got "
                                                          f"{heartbeat_interval_s!r}")
        if not (math.isfinite(heartbeat_interval_s) and heartbeat_interval_s > 0):
            raise InvalidArgument("heartbeat_interval_s", f"must be a finite number > 0, got "
                                                          f"{heartbeat_interval_s!r}")
        self.worker_id = worker_id
        self.block_size = block_size
        self.topic = topic.encode("utf-8")
        self.fingerprint = fingerprint
        self.hash_seed = hash_seed
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.incarnation = uuid.uuid4().hex     # new on every start: routers forget what the last one held
        self.data_parallel_rank = data_parallel_rank
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._held: dict[tuple[str | None, object], object] = {}   # (medium, hash) -> parent: for snapshots
        self._next_seq = 0
        self._load = (0, 0, 0)
        self._ctx = zmq.Context()
        self._inbox = f"inproc://prefixkv-publisher-{uuid.uuid4().hex}"
        self._push_lock = threading.Lock()
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._error: BaseException | None = None
        self._closed = False
        self.endpoints: dict[str, str] = {}
        self._thread = threading.Thread(target=self._run, args=(endpoint, replay_endpoint, heartbeat_endpoint),
                                        daemon=True, name=f"kv-events-{worker_id}")
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            self._thread.join(10)
            self._ctx.term()       # the thread closed every socket it made: no port stays bound
            raise self._error
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDTIMEO, 100)   # a hand-over re-checks now and then that the thread lives
        self._push.connect(self._inbox)

    # -- caller side ------------------------------------------------------------
    def publish(self, events: Iterable, *, medium: str = wire.MEDIUM_GPU,
                tokens: Mapping[object, Sequence[int]] | None = None, drop: bool = False) -> None:
        """Publish prefixkv core events as one batch (nothing is sent for no events).

        ``drop=True`` is fault injection for tests and drills: the batch takes its sequence
        number and enters the replay buffer but never reaches the wire, as if lost.
        """
        if not isinstance(medium, str):   # the wire would carry it, but no router could decode the batch
            raise InvalidArgument("medium", f"must be a str ('GPU', 'CPU'...), got {type(medium).__name__} "
                                            f"{medium!r}")
        converted = wire.to_wire(events, block_size=self.block_size, medium=medium, tokens=tokens)
        if converted:
            # encoded here, so a batch the wire cannot carry is refused before it takes a number
            payload = wire.encode(wire.KVEventBatch(ts=time.time(), events=converted,
                                                    data_parallel_rank=self.data_parallel_rank))
            with self._push_lock:
                if self._closed:
                    raise RuntimeError(f"publisher {self.worker_id!r} is closed")
                self._hand_over(("batch", (converted, payload), drop))

    def publish_from(self, manager, *, prompts: Sequence = (), drop: bool = False) -> None:
        """Drain ``manager``'s events (``record_events=True``) and publish them; the token ids
        of blocks from ``prompts`` (token prompts admitted since the last call) go along."""
        block_size, seed = _hashing_of(manager)
        if (block_size, seed) != (self.block_size, self.hash_seed):
            # checked before draining: a refused call leaves the manager's events for a right one
            raise InvalidArgument("manager", f"hashes blocks of {block_size} tokens with hash seed {seed!r}, but "
                                             f"publisher {self.worker_id!r} announces block size {self.block_size} "
                                             f"and hash seed {self.hash_seed!r}: routers would hash its prompts "
                                             "unlike its events (make the publisher with manager=)")
        tokens: dict = {}
        for prompt in prompts:
            tokens.update(wire.block_tokens(prompt))
        self.publish(manager.drain_events(), tokens=tokens or None, drop=drop)

    def set_load(self, *, free_blocks: int, queued_prefill_tokens: int = 0, running_requests: int = 0) -> None:
        """The load the next heartbeats report: integers >= 0 (numpy integers too)."""
        load = []
        for name, value in (("free_blocks", free_blocks), ("queued_prefill_tokens", queued_prefill_tokens),
                            ("running_requests", running_requests)):
            try:
                number = operator.index(value)
            except TypeError:
                raise InvalidArgument(name, f"must be an integer, got {value!r} ({type(value).__name__})") from None
            if number < 0:
                raise InvalidArgument(name, f"must be >= 0, got {number}")
            load.append(number)
        self._load = tuple(load)   # one assignment: the socket thread reads it whole

    def _hand_over(self, message) -> None:
        """To the socket thread (the caller holds ``_push_lock``); raises if the thread is gone."""
        while True:
            if not self._thread.is_alive():
                raise RuntimeError(f"publisher {self.worker_id!r}: its socket thread stopped "
                                   f"({self._error!r}); nothing more can be published")
            try:
                self._push.send_pyobj(message)
                return
            except zmq.Again:      # the thread is busy (or gone): look again
                continue

    def close(self) -> None:
        """Stop the socket thread and close every socket (again: nothing to do)."""
        with self._push_lock:
            if self._closed:
                return
            self._closed = True
            self._stop.set()
            try:
                self._hand_over(("stop", None, False))
            except RuntimeError:
                pass               # the thread is gone already
        self._thread.join(10)
        self._push.close(0)
        self._ctx.term()

    def __enter__(self) -> "KVEventPublisher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- the socket thread ------------------------------------------------------
    def _run(self, endpoint: str, replay_endpoint: str, heartbeat_endpoint: str) -> None:
        made: list = []
        try:
            for kind in (zmq.PUB, zmq.ROUTER, zmq.PUB, zmq.PULL):
                made.append(self._ctx.socket(kind))
            pub, replay, beat, inbox = made
            replay.setsockopt(zmq.SNDHWM, 2 * (self._buffer.maxlen + 1))   # a full replay plus its marker
            for name, sock, where in (("events", pub, endpoint), ("replay", replay, replay_endpoint),
                                      ("heartbeat", beat, heartbeat_endpoint)):
                try:
                    sock.bind(where)
                except zmq.ZMQError as exc:
                    raise zmq.ZMQError(exc.errno, f"cannot bind the {name} socket to {where!r}: "
                                                  f"{exc.strerror}") from None
                self.endpoints[name] = sock.getsockopt_string(zmq.LAST_ENDPOINT)
            inbox.bind(self._inbox)
        except BaseException as exc:   # reported to the constructor's caller, with every socket closed
            for sock in made:
                sock.close(0)
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(replay, zmq.POLLIN)
        poller.register(inbox, zmq.POLLIN)
        next_beat = 0.0
        try:
            while True:
                now = time.monotonic()
                if now >= next_beat:
                    beat.send_multipart([wire.HEARTBEAT_TOPIC, wire.encode(self._heartbeat())])
                    next_beat = now + self.heartbeat_interval_s
                wait_s = min(next_beat - time.monotonic(), MAX_POLL_S)
                ready = dict(poller.poll(max(1, int(1000 * wait_s))))
                if inbox in ready:
                    kind, batch, drop = inbox.recv_pyobj()
                    if kind == "stop":
                        return
                    self._send_batch(pub, *batch, drop)
                if replay in ready:
                    self._serve_replay(replay)
        except BaseException as exc:     # publish() reports it from now on
            self._error = exc
            raise
        finally:
            for sock in (pub, replay, beat, inbox):
                sock.close(0)

    def _send_batch(self, pub, events: list, payload: bytes, drop: bool) -> None:
        seq = self._next_seq
        if not drop:
            pub.send_multipart([self.topic, wire.seq_bytes(seq), payload])
        self._buffer.append((seq, payload))
        self._next_seq = seq + 1
        self._mirror(events)

    def _mirror(self, events: list) -> None:
        held = self._held
        for e in events:
            if isinstance(e, wire.BlockStored):
                parent = e.parent_block_hash
                for h in e.block_hashes:
                    held[(e.medium, h)] = parent
                    parent = h
            elif isinstance(e, wire.BlockRemoved):
                for h in e.block_hashes:
                    held.pop((e.medium, h), None)
            else:
                held.clear()

    def _serve_replay(self, replay) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            return   # not a request of vLLM's shape: ignored, as vLLM does
        client, _, request = frames
        if request == wire.SNAPSHOT_REQUEST:
            events: list = [wire.AllBlocksCleared()]
            events += [wire.BlockStored(block_hashes=[h], parent_block_hash=parent, token_ids=[],
                                        block_size=self.block_size, lora_id=None, medium=medium, lora_name=None)
                       for (medium, h), parent in self._held.items()]
            payload = wire.encode(wire.KVEventBatch(ts=time.time(), events=events,
                                                    data_parallel_rank=self.data_parallel_rank))
            replay.send_multipart([client, b"", self.topic, wire.seq_bytes(self._next_seq), payload])
        elif len(request) == 8:
            start = int.from_bytes(request, "big")
            for seq, payload in self._buffer:
                if seq >= start:
                    replay.send_multipart([client, b"", self.topic, wire.seq_bytes(seq), payload])
        replay.send_multipart([client, b"", b"", wire.END_SEQ, b""])

    def _heartbeat(self) -> wire.Heartbeat:
        free, queued, running = self._load
        return wire.Heartbeat(worker_id=self.worker_id, incarnation=self.incarnation, fingerprint=self.fingerprint,
                              block_size=self.block_size, hash_seed=self.hash_seed, free_blocks=free,
                              queued_prefill_tokens=queued, running_requests=running, next_seq=self._next_seq,
                              interval_s=self.heartbeat_interval_s, ts=time.time())
