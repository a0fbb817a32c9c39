"""A remote tier that cannot be used says why, in the words an operator acts on.

``prefixkv tier stats|clear`` named a reachable server "unreachable" (a password wanted:
``unreachable: HELLO must be called ...``; an HTTP server: ``unreachable: Protocol error, got
"<"``); ``generate --remote`` against a wrong port, a missing or wrong password, or a server that
is not Redis exited 0 with nothing but ``nodes down 1``. Now both name the problem
(authentication, not Redis, timed out, refused), ``generate`` on stderr at start-up and in the
JSON (``remote_contact``, ``store_node_errors``).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading

import pytest

from prefixkv.cli import main
from redis_fixtures import REDIS_SERVER, SKIP_REASON, RedisServer, free_port

pytest.importorskip("redis")

needs_redis = pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)


@contextlib.contextmanager
def fake_server(reply: bytes | None):
    """A loopback listener that answers every connection's first bytes with ``reply`` (an HTTP
    server's error page), or never answers (``None``: a hung peer). Stopped on exit."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()
    conns = []

    def serve():
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            conns.append(conn)
            if reply is not None:
                conn.settimeout(1.0)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
                    conn.sendall(reply)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    finally:
        stop.set()
        thread.join(5)
        for conn in conns:
            conn.close()
        listener.close()


HTTP_REPLY = b"<html><body><h1>400 Bad Request</h1></body></html>\n"


@pytest.fixture(scope="module")
def password_server(tmp_path_factory):
    if REDIS_SERVER is None:
        pytest.skip(SKIP_REASON)
    server = RedisServer(tmp_path_factory.mktemp("redis-auth")).start()      # start() waits on a plain PING
    assert server.command("CONFIG", "SET", "requirepass", "sekret").startswith(b"+OK")
    yield server
    server.stop()


def tier_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(["tier", *argv])
    err = capsys.readouterr().err
    assert info.value.code == 2 and "Traceback" not in err, err
    return err


@needs_redis
@pytest.mark.parametrize("command", [["stats"], ["clear"]])
def test_tier_names_a_missing_or_wrong_password(capsys, password_server, command):
    port = password_server.port
    err = tier_error(capsys, *command, f"redis://127.0.0.1:{port}/0")
    assert "authentication failed" in err and "requires a password" in err and "unreachable" not in err, err
    err = tier_error(capsys, *command, f"redis://:wrong@127.0.0.1:{port}/0")
    assert "authentication failed" in err and "refused" in err and "unreachable" not in err, err
    assert "wrong" not in err          # the password is never printed
    main(["tier", *command, f"redis://:sekret@127.0.0.1:{port}/0"])     # the right one works


@pytest.mark.parametrize("command", [["stats"], ["clear"]])
def test_tier_names_a_server_that_is_not_redis(capsys, command):
    with fake_server(HTTP_REPLY) as url:
        err = tier_error(capsys, *command, url)
    assert "not a Redis server" in err and "'<'" in err and "unreachable" not in err, err


@pytest.mark.parametrize("command", [["stats", "--timeout", "0.3"], ["clear", "--timeout", "0.3"]])
def test_tier_names_a_timeout_and_a_refused_connection(capsys, command):
    with fake_server(None) as url:
        err = tier_error(capsys, command[0], url, *command[1:])
    assert "timed out after 0.3 s" in err and "did not answer" in err, err
    err = tier_error(capsys, command[0], f"redis://127.0.0.1:{free_port()}/0", *command[1:])
    assert "connection refused" in err, err


# -- generate --remote: said at start-up, on stderr and in the JSON ---------------------------

GENERATE = ["generate", "--requests", "2", "--max-new-tokens", "2", "--repeat", "1", "--layers", "1",
            "--hidden-size", "64", "--heads", "2", "--kv-heads", "1", "--json"]


def generate(capsys, url):
    pytest.importorskip("torch")
    assert main([*GENERATE, "--remote", url]) == 0
    out, err = capsys.readouterr()
    return json.loads(out), err


def test_generate_names_a_refused_remote_at_start_up(capsys):
    result, err = generate(capsys, f"redis://127.0.0.1:{free_port()}/0")
    assert "warning: remote tier" in err and "connection refused" in err, err
    contact = result["remote_contact"]
    assert contact["ok"] is False
    (why,) = contact["nodes"].values()
    assert why.startswith("connection refused")
    assert "connection refused" in next(iter(result["cache_on"]["remote"]["store_node_errors"].values()))


def test_generate_names_a_remote_that_is_not_redis(capsys):
    with fake_server(HTTP_REPLY) as url:
        result, err = generate(capsys, url)
    assert "not a Redis server" in err, err
    assert not result["remote_contact"]["ok"]


@needs_redis
def test_generate_names_a_missing_or_wrong_password(capsys, password_server):
    port = password_server.port
    for url, words in ((f"redis://127.0.0.1:{port}/0", "requires a password"),
                       (f"redis://:wrong@127.0.0.1:{port}/0", "refused the URL's user name or password")):
        result, err = generate(capsys, url)
        assert "authentication failed" in err and words in err, err
        assert not result["remote_contact"]["ok"]
        assert "wrong" not in err and "wrong" not in json.dumps(result)
    result, err = generate(capsys, f"redis://:sekret@127.0.0.1:{port}/0")
    assert "warning" not in err and result["remote_contact"]["ok"], err
    assert result["remote_contact"]["url"] == f"redis://:***@127.0.0.1:{port}/0"
