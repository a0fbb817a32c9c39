"""Real redis-server processes for tests: a single server and a three-node cluster, on loopback.

Import the fixtures into a test module (``from redis_fixtures import redis_server, ...``).
Every server binds 127.0.0.1 on a free port, runs without persistence, with
``maxmemory`` and ``allkeys-lru``, and is stopped by its PID. Where the binary
is missing, tests marked with ``needs_redis`` are skipped with the reason.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
SKIP_REASON = "redis-server is not installed (Debian: apt-get install -y redis-server)"
needs_redis = [pytest.mark.redis, pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_cluster_port(tries: int = 200) -> int:
    """A free port <= 55535 whose cluster bus port (+10000) is free too (redis-server refuses higher)."""
    import random

    rng = random.Random()
    for _ in range(tries):
        port = rng.randrange(20000, 55535)
        try:
            for p in (port, port + 10000):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no free port pair for a cluster node after {tries} tries")


def _command(port: int, *args: str, timeout: float = 0.5) -> bytes:
    """One RESP command over a plain socket (no redis-py: the fixture must not depend on the code under test)."""
    payload = f"*{len(args)}\r\n".encode() + b"".join(f"${len(a.encode())}\r\n{a}\r\n".encode() for a in args)
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(payload)
        data = b""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            chunk = s.recv(1 << 16)
            if not chunk:
                break
            data += chunk
            if data.startswith((b"+", b"-", b":")) and data.endswith(b"\r\n"):
                break
            if data.startswith(b"$"):
                head, _, rest = data.partition(b"\r\n")
                if int(head[1:]) < 0 or len(rest) >= int(head[1:]) + 2:
                    break
        return data


class RedisServer:
    """One redis-server process."""

    def __init__(self, workdir: Path, port: int | None = None, maxmemory: str = "256mb", extra: tuple = ()) -> None:
        self.port = port or free_port()
        self.workdir = workdir
        self.maxmemory = maxmemory
        self.extra = extra
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "RedisServer":
        self.workdir.mkdir(parents=True, exist_ok=True)
        log = open(self.workdir / f"redis-{self.port}.log", "ab")
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru", "--dir", str(self.workdir),
             "--protected-mode", "no", *self.extra],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:       # wait for PING
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on {self.port} exited with {self.proc.returncode}; "
                                   f"see {self.workdir}/redis-{self.port}.log")
            try:
                if _command(self.port, "PING").startswith(b"+PONG"):
                    return self
            except OSError:
                pass
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server on {self.port} did not answer PING within {timeout} s")

    def command(self, *args: str) -> bytes:
        return _command(self.port, *args)

    def pause(self) -> None:
        """SIGSTOP: the process holds its socket but answers nothing (a hung server)."""
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        """Stop it by its PID (SIGCONT first, in case it is paused)."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
            os.kill(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    """A module's redis-server (256 MiB, allkeys-lru); tests FLUSHALL what they need clean."""
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


@pytest.fixture
def own_redis_server(tmp_path):
    """A server for one test (to kill, pause or restart)."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


@contextlib.contextmanager
def running_cluster(base):
    """Three masters under ``base``, no replicas, ``cluster-require-full-coverage no`` and a 1 s node
    timeout (when one node dies, the others keep serving their slots past the timeout); stopped on
    exit. Skips without redis-cli."""
    if REDIS_CLI is None:
        pytest.skip("redis-cli is not installed (it comes with redis-server on Debian)")
    nodes = []
    try:
        for i in range(3):
            port = free_cluster_port()
            nodes.append(RedisServer(base / f"n{i}", port, extra=(
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no")).start())
        subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if all(b"cluster_state:ok" in n.command("CLUSTER", "INFO") for n in nodes):
                break
            time.sleep(0.1)
        else:
            raise RuntimeError("the three-node cluster did not reach cluster_state:ok within 30 s")
        yield nodes
    finally:
        for node in nodes:
            node.stop()


@pytest.fixture(scope="module")
def redis_cluster(tmp_path_factory):
    """A ``running_cluster`` for a module."""
    with running_cluster(tmp_path_factory.mktemp("cluster")) as nodes:
        yield nodes


def cluster_url(nodes) -> str:
    return "redis+cluster://" + ",".join(f"127.0.0.1:{n.port}" for n in nodes)


class Blocks:
    """A prompt's chain of block hashes with random payloads and token contents, for store tests."""

    def __init__(self, fingerprint, num_blocks: int, seed: int) -> None:
        import random

        from prefixkv.hashing import BlockHasher, encode_tokens

        rng = random.Random(seed)
        hasher = BlockHasher(fingerprint.block_size, fingerprint.hash_seed, fingerprint.hash_algorithm)
        self.tokens = encode_tokens([rng.randrange(32000) for _ in range(num_blocks * fingerprint.block_size)])
        self.chain = hasher.hash_blocks(self.tokens, 0, num_blocks, None)
        self.contents = [hasher.block_content(self.tokens, i) for i in range(num_blocks)]
        self.payloads = [rng.randbytes(fingerprint.block_bytes) for _ in range(num_blocks)]
        self.root = hasher.root

    def __len__(self) -> int:
        return len(self.chain)

    def parent(self, i: int) -> bytes:
        return self.chain[i - 1] if i else self.root


@pytest.fixture
def server(redis_server):
    """The module's server, emptied for this test."""
    redis_server.command("FLUSHALL")
    return redis_server


@pytest.fixture
def raw(server):
    """A plain redis-py client on ``server``."""
    import redis

    client = redis.Redis(host="127.0.0.1", port=server.port)
    yield client
    client.close()
