"""The network under the Redis block store: URLs, nodes, circuit breakers, cluster routing, round trips.

Why not ``redis.Redis`` / ``redis.RedisCluster`` directly: their defaults retry
with backoff (a dead server costs seconds per call), a cluster client retries
and re-discovers the topology inside a call, and a pipeline re-checks its
scripts every time (an extra round trip). Here every node has two plain
redis-py ``Connection`` objects (hiredis parser when installed), one for the
caller's thread and one for the store's background thread, each built with
``retry=Retry(NoBackoff(), 0)`` (no retries, ``retries_of(conn) == 0``) and
0.2 s connect and socket timeouts by default. Nothing in this module sleeps or
loops without a bound.

Circuit breaker, one per node: a connection error or timeout, or a reply stream
that is not RESP (something else listens there), marks the node ``down``. While
it is down a call costs one attribute read for it (no clock, no socket); the
background thread PINGs it every ``probe_interval_s`` and marks it up again on
the first answer, an error reply included (the server answers; ``LOADING`` after
a restart is the exception: up but not ready). A server reply that is an error
(OOM, MOVED, NOSCRIPT) is not a network failure and opens nothing. Every trip
makes both of the node's connections reconnect before their next command: a
socket opened before the failure may still lead to the dead server.

URLs: ``redis://[user:pass@]host:port[/db]``, ``rediss://...``, ``unix:///path.sock[?db=N]``,
and ``redis+cluster://[user:pass@]host:port[,host:port...]`` (seed nodes of a
Redis Cluster; the slot map comes from ``CLUSTER SLOTS`` and is refreshed in the
background after a ``MOVED`` reply or a node's recovery).
"""

from __future__ import annotations

import re
import socket
import threading
from dataclasses import dataclass
from typing import Iterable, Sequence
from urllib.parse import unquote, urlparse

import redis
from redis.backoff import NoBackoff
from redis.connection import Connection, UnixDomainSocketConnection, parse_url
from redis.crc import key_slot
from redis.exceptions import AuthenticationError, InvalidResponse, ResponseError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from ..errors import PrefixKVError

_URL_PASSWORD = re.compile(r"(://[^/@:]*:)[^/]*@")         # redis://user:secret@host (to the last @)
_QUERY_PASSWORD = re.compile(r"([?&]password=)[^&#]*")     # unix:///path.sock?password=secret


def masked_url(url: str) -> str:
    """``url`` with its password masked: errors and stats end up in terminals and logs."""
    return _QUERY_PASSWORD.sub(r"\1***", _URL_PASSWORD.sub(r"\1***@", url))

__all__ = ["RemoteTierError", "StoreClosed", "NodeClosed", "NodeDown", "Node", "Topology", "NETWORK_ERRORS", "retries_of", "roundtrip",
           "CLUSTER_SCHEME", "HIREDIS", "explain"]

CLUSTER_SCHEME = "redis+cluster://"
# The connection is unusable: unreachable, timed out, or its peer does not speak RESP (redis-py
# raises InvalidResponse for a reply stream it cannot parse, and has dropped the socket).
NETWORK_ERRORS = (RedisConnectionError, RedisTimeoutError, socket.timeout, OSError, InvalidResponse)
SLOTS = 16384
HIREDIS = bool(getattr(redis.utils, "HIREDIS_AVAILABLE", False))


class RemoteTierError(PrefixKVError):
    """An operator call (clear, stats) could not reach the store, or the URL is unusable."""


class StoreClosed(RemoteTierError):
    """A call on a store (or its topology) after ``close()``: nothing was sent, nothing reconnected."""


class NodeClosed(RedisConnectionError):
    """A connection of a closed node was asked to connect. A network error to the code that meets
    it, so a background round that outlived ``close()`` winds down like one that met a dead node."""


class NodeDown(Exception):
    """Placeholder result for commands not sent because their node's breaker is open."""


def retries_of(conn: Connection) -> int:
    """How many times redis-py would retry a failed command on this connection (ours: 0)."""
    return conn.retry.get_retries()


@dataclass(frozen=True, slots=True)
class Timeouts:
    connect_s: float = 0.2
    socket_s: float = 0.2


class Node:
    """One Redis server: a foreground and a background connection and its breaker.

    ``fg`` serves the caller's thread (the store serialises foreground calls),
    ``bg`` the store's background thread; neither is shared between threads."""

    __slots__ = ("name", "down", "opens", "closes", "epoch", "error", "closed", "fg", "bg", "timeouts", "_kwargs",
                 "_epochs", "_open_lock")

    def __init__(self, name: str, kwargs: dict, timeouts: Timeouts) -> None:
        self.name = name
        self.down = False        # the breaker: True = open (skip this node until the prober sees it answer)
        self.opens = 0
        self.closes = 0
        self.epoch = 0           # network failures seen; a connection older than the last one reconnects
        self.error: str | None = None   # while down: why (the last failure), e.g. a refused password
        self.closed = False
        self.timeouts = timeouts
        # Held while a connection opens its socket and while close() sweeps them: a thread that was
        # mid-call when the node closed (a writer round past close()'s bounded join) cannot open a
        # socket after the sweep, however the two interleave. Held for one connect at most (bounded
        # by the connect and socket timeouts), never across a command.
        self._open_lock = threading.Lock()
        self._kwargs = dict(kwargs, socket_timeout=timeouts.socket_s, socket_connect_timeout=timeouts.connect_s,
                            retry=Retry(NoBackoff(), 0))
        self.fg = self._connection()
        self.bg = self._connection()
        self._epochs = {id(self.fg): 0, id(self.bg): 0}

    def fresh(self, conn: Connection) -> Connection:
        """``conn``, disconnected first when a network failure was seen since it last checked (by
        either thread): its socket may lead to a server that died or restarted since. Called by
        the thread that owns ``conn`` before each use."""
        epoch = self.epoch
        if self._epochs[id(conn)] != epoch:
            conn.disconnect()
            self._epochs[id(conn)] = epoch
        return conn

    def _connection(self) -> Connection:
        kwargs = dict(self._kwargs)
        cls = kwargs.pop("connection_class", Connection)
        conn = cls(**kwargs)
        # redis-py (re)connects inside any send; this is the one door every (re)connect goes through.
        opener = conn.connect_check_health

        def connect_unless_closed(*args, **kw):
            with self._open_lock:
                if self.closed:
                    raise NodeClosed(f"{self.name}: the store is closed")
                return opener(*args, **kw)

        conn.connect_check_health = connect_unless_closed
        return conn

    def trip(self, conn: Connection, exc: BaseException | None = None) -> None:
        """A network failure: drop the connection (its replies are out of step) and open the breaker."""
        conn.disconnect()
        self.epoch += 1
        self.error = _describe(exc, self.timeouts)
        if not self.down:
            self.down = True
            self.opens += 1

    def ping(self) -> bool:
        """Background probe: closes the breaker when the server answers (an error reply is an
        answer: a server that refuses PING, e.g. by ACL, is up; LOADING is not ready yet)."""
        if self.closed:
            return False
        conn = self.fresh(self.bg)
        try:
            conn.send_command("PING", check_health=False)
            conn.read_response()
        except NETWORK_ERRORS as exc:    # BusyLoadingError (LOADING) among them: up, not ready
            conn.disconnect()
            self.error = _describe(exc, self.timeouts)
            return False
        except ResponseError:
            pass
        if self.down:
            self.down = False
            self.error = None
            self.closes += 1
        return True

    def close(self) -> None:
        """Disconnect both connections for good: neither connects again (``NodeClosed``)."""
        with self._open_lock:
            self.closed = True
            self.fg.disconnect()
            self.bg.disconnect()


def roundtrip(node: Node, conn: Connection, commands: Sequence[tuple]) -> list:
    """Send ``commands`` in one write and read every reply: one round trip.

    Returns one entry per command: the reply, or the ``ResponseError`` the
    server answered. A network failure trips the node's breaker and is raised; a closed node
    raises ``NodeClosed`` (a network error) without tripping.
    """
    if node.closed:
        raise NodeClosed(f"{node.name}: the store is closed")
    node.fresh(conn)
    try:
        conn.send_packed_command(conn.pack_commands(commands), check_health=False)
        return _read(conn, len(commands))
    except NETWORK_ERRORS as exc:
        node.trip(conn, exc)
        raise
    except BaseException:
        conn.disconnect()        # e.g. KeyboardInterrupt mid-read: the stream is out of step
        raise


def _describe(exc: BaseException | None, timeouts: Timeouts | None = None) -> str:
    """Why a node is down, for stats: the problem in words, then what redis-py said."""
    if exc is None:
        return "unknown"
    return f"{explain(exc, timeouts)} ({type(exc).__name__}: {exc})"


_NO_PASSWORD = ("NOAUTH", "HELLO must be called with the client already authenticated", "Authentication required")


def explain(exc: BaseException, timeouts: Timeouts | None = None) -> str:
    """What a failed contact with a node means, in the words an operator acts on: a server that
    wants a password (or refused the one given), a server that is not Redis, one that timed out,
    a refused connection. A reachable server is never called unreachable."""
    text = str(exc)
    if isinstance(exc, AuthenticationError) or "NOAUTH" in text or "WRONGPASS" in text:
        if any(marker in text for marker in _NO_PASSWORD):
            return ("authentication failed: the server requires a password and the URL gives none "
                    "(redis://[user]:password@host:port/db)")
        return "authentication failed: the server refused the URL's user name or password"
    if isinstance(exc, InvalidResponse):
        got = re.search(r'got "(.*?)"', text)
        seen = f" (its reply starts with {got.group(1)!r})" if got else ""
        return f"not a Redis server: it does not answer in the Redis protocol{seen}; is another service on that port?"
    if isinstance(exc, (RedisTimeoutError, socket.timeout)):
        connecting = "connect" in text.lower()
        limit = None if timeouts is None else (timeouts.connect_s if connecting else timeouts.socket_s)
        after = f" after {limit:g} s" if limit is not None else ""
        if connecting:
            return f"timed out{after} connecting: nothing answered the connection (a firewall, or a wrong host)"
        return f"timed out{after}: the server accepted the connection but did not answer (hung or overloaded)"
    if isinstance(exc, NodeClosed):
        return "the store is closed"
    errno = getattr(exc, "errno", None)
    if errno is None and exc.args and isinstance(exc.args[0], str):
        found = re.match(r"Error (\d+)", exc.args[0])
        errno = int(found.group(1)) if found else None
    if errno == 111 or "Connection refused" in text:
        return "connection refused: nothing listens on that port (is the server running, the port right?)"
    if errno == 2 or "No such file" in text:
        return "no such socket file (is the server running with that unixsocket path?)"
    if "Name or service not known" in text or "nodename nor servname" in text or "getaddrinfo" in text:
        return "unknown host name"
    return f"unreachable: {text}"


def _read(conn: Connection, n: int) -> list:
    out = []
    for _ in range(n):
        try:
            out.append(conn.read_response())
        except ResponseError as exc:
            out.append(exc)
    return out


def _node_kwargs(url: str) -> dict:
    try:
        kwargs = parse_url(url)
    except ValueError as exc:
        raise RemoteTierError(f"unusable remote URL {masked_url(url)!r}: {exc}") from None
    # redis-py drops a database it cannot read as a number and connects to database 0 instead
    path = urlparse(url).path.strip("/")
    if not url.startswith("unix:") and path and not path.isdecimal():
        raise RemoteTierError(f"unusable remote URL {masked_url(url)!r}: the database must be a number, "
                              f"got {path!r}")
    return kwargs


class Topology:
    """Which node serves a key: one node, or a Redis Cluster slot map."""

    def __init__(self, url: str, timeouts: Timeouts) -> None:
        self.url = url
        self.timeouts = timeouts
        self.cluster = url.startswith(CLUSTER_SCHEME)
        self.stale = False
        self._lock = threading.Lock()     # guards slot-map swaps against the background refresher
        if self.cluster:
            self._auth, seeds = _parse_cluster_url(url)
            self.nodes: dict[str, Node] = {}
            self._node_list: tuple[Node, ...] = ()
            for host, port in seeds:
                self._node(host, port)
            self.slots: list[Node | None] = [None] * SLOTS
            try:
                self.stale = not self.refresh()
            except RemoteTierError:      # a seed without cluster support: no store to build
                self.close()
                raise
        else:
            kwargs = _node_kwargs(url)
            name = kwargs.get("path") or f"{kwargs.get('host', 'localhost')}:{kwargs.get('port', 6379)}"
            if kwargs.get("path"):
                kwargs.setdefault("connection_class", UnixDomainSocketConnection)
            self.single = Node(name, kwargs, timeouts)
            self.nodes = {name: self.single}

    def _node(self, host: str, port: int) -> Node:
        name = f"{host}:{port}"
        node = self.nodes.get(name)
        if node is None:
            node = Node(name, dict(self._auth, host=host, port=port), self.timeouts)
            self.nodes[name] = node
            # a fresh tuple, swapped in whole: the caller's thread iterates it while the
            # background refresh may add nodes
            self._node_list = (*self._node_list, node)
        return node

    def node_for(self, key: bytes) -> Node | None:
        """The node serving ``key`` (None: its cluster slot has no known owner)."""
        if not self.cluster:
            return self.single
        return self.slots[key_slot(key)]

    def all_down(self) -> bool:
        """Every known node's breaker is open (the cheap early exit of every call)."""
        if not self.cluster:
            return self.single.down
        for node in self._node_list:
            if not node.down:
                return False
        return True

    def refresh(self) -> bool:
        """Reload the slot map from the first node that answers ``CLUSTER SLOTS`` (background thread).

        Raises ``RemoteTierError`` when a node answers that it has no cluster support: a cluster URL
        naming a plain server would otherwise miss on every call without a word. The node is also
        marked down with that reason (``stats().node_errors``) for a refresh in the background."""
        if not self.cluster:
            return True
        for node in sorted(self._node_list, key=lambda n: n.down):     # answering nodes first
            try:
                reply = roundtrip(node, node.bg, [("CLUSTER", "SLOTS")])[0]
            except NETWORK_ERRORS:
                continue
            if isinstance(reply, ResponseError):
                if "cluster support disabled" in str(reply):
                    error = RemoteTierError(
                        f"{node.name} is not a Redis Cluster node (it answers: {reply}); a redis+cluster:// URL "
                        f"needs cluster nodes: for a single server use redis://{node.name}")
                    node.trip(node.bg, error)
                    raise error
                continue
            slots: list[Node | None] = [None] * SLOTS
            for entry in reply:
                start, end, master = int(entry[0]), int(entry[1]), entry[2]
                host = master[0].decode() if isinstance(master[0], bytes) else str(master[0])
                owner = self._node(host or node.name.rsplit(":", 1)[0], int(master[1]))
                for slot in range(start, end + 1):
                    slots[slot] = owner
            with self._lock:
                self.slots = slots
                self.stale = False
            return True
        return False

    def masters(self) -> list[Node]:
        """Nodes that own slots (cluster) or the one node."""
        if not self.cluster:
            return [self.single]
        seen: dict[str, Node] = {}
        for node in self.slots:
            if node is not None:
                seen.setdefault(node.name, node)
        return list(seen.values()) or list(self._node_list)

    def close(self) -> None:
        for node in self.nodes.values():
            node.close()


def _parse_cluster_url(url: str) -> tuple[dict, list[tuple[str, int]]]:
    rest = url[len(CLUSTER_SCHEME):]
    auth: dict = {}
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        user, _, password = cred.partition(":")
        if user:
            auth["username"] = unquote(user)
        if password:
            auth["password"] = unquote(password)
    rest, query, options = rest.partition("?")
    if query:   # redis-py's URL options (a password, TLS settings) would be dropped without a word
        raise RemoteTierError(f"cluster URL {masked_url(url)!r}: query options ({masked_url('?' + options)!r}) "
                              "are not supported; give a password as redis+cluster://user:password@host:port")
    hosts, _, db = rest.partition("/")
    # A cluster serves database 0 only; a URL naming another was used as database 0 without a word.
    if db.strip("/") not in ("", "0"):
        raise RemoteTierError(f"cluster URL {masked_url(url)!r}: a Redis Cluster has database 0 only, got {db!r}")
    seeds = []
    for part in hosts.split(","):
        try:
            parsed = urlparse("//" + part)
            host, port = parsed.hostname, parsed.port
        except ValueError as exc:       # a port that is not a number, or out of range
            raise RemoteTierError(f"cluster URL {masked_url(url)!r}: {part!r} is not host:port ({exc})") from None
        if not host:
            raise RemoteTierError(f"cluster URL {masked_url(url)!r}: {part!r} is not host:port")
        seeds.append((host, port or 6379))
    if not seeds:
        raise RemoteTierError(f"cluster URL {masked_url(url)!r} names no node")
    return auth, seeds


def send_all(per_node: Iterable[tuple[Node, list[tuple]]], background: bool = False) -> dict[str, list | Exception]:
    """One round trip to several nodes at once: write to every node, then read every reply.

    Returns, per node name, the replies or the exception that node raised
    (``NodeDown`` when its breaker was already open; nothing is sent there).
    A hung node costs one socket timeout; the others are read all the same.
    """
    results: dict[str, list | Exception] = {}
    sent: list[tuple[Node, Connection, int]] = []
    try:
        for node, commands in per_node:
            if node.closed:
                results[node.name] = NodeClosed(f"{node.name}: the store is closed")
                continue
            if node.down:
                results[node.name] = NodeDown(node.name)
                continue
            conn = node.fresh(node.bg if background else node.fg)
            try:
                conn.send_packed_command(conn.pack_commands(commands), check_health=False)
            except NETWORK_ERRORS as exc:
                node.trip(conn, exc)
                results[node.name] = exc
                continue
            sent.append((node, conn, len(commands)))
    except BaseException:
        for _, conn, _ in sent:      # their replies will never be read: the streams are out of step
            conn.disconnect()
        raise
    for node, conn, n in sent:
        try:
            results[node.name] = _read(conn, n)
        except NETWORK_ERRORS as exc:
            node.trip(conn, exc)
            results[node.name] = exc
        except BaseException:
            for other, other_conn, _ in sent:
                other_conn.disconnect()
            raise
    return results
