"""``prefixkv tier`` (stats, clear): a timeout that is not a usable number of seconds and a bad
prefix are refused naming the flag (never clearing the default prefix); without redis-py the
command says what to install; the URL's password is masked in what it prints; a bad fingerprint
is quoted as typed; and the checked options still work against a real redis-server."""

from __future__ import annotations

import json
import sys

import pytest

from cli_helpers import fails
from redis_fixtures import REDIS_SERVER, SKIP_REASON, redis_server  # noqa: F401 (a module's server)

from prefixkv.cli import main


@pytest.mark.parametrize("value", ["inf", "1e10", "nan", "0", "-1", "x"])
def test_tier_timeout_must_be_a_usable_number_of_seconds(capsys, value):
    # inf and 1e10 reached the socket and the writer's join: OverflowError with a traceback
    for command in ("stats", "clear"):
        err = fails(capsys, "tier", command, "redis://127.0.0.1:1", f"--timeout={value}")
        assert "--timeout" in err and "OverflowError" not in err


@pytest.mark.parametrize("prefix", ["", "a b", "x" * 65])
def test_tier_clear_refuses_a_bad_prefix_instead_of_clearing_the_default_one(capsys, prefix):
    # --prefix "" (an empty shell variable) used to clear the default prefix pkv's blocks
    err = fails(capsys, "tier", "clear", "redis://127.0.0.1:1", f"--prefix={prefix}")
    assert "--prefix" in err and "unreachable" not in err


def test_tier_without_redis_py_says_what_to_install(capsys, monkeypatch):
    for name in [m for m in sys.modules if m == "redis" or m.startswith("redis.")
                 or m.startswith("prefixkv.tiers.redis")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "redis", None)        # import redis -> ImportError
    err = fails(capsys, "tier", "stats", "redis://127.0.0.1:1")
    assert "prefixkv[redis]" in err


def ok(capsys, *argv) -> str:
    code = main([str(a) for a in argv])
    out = capsys.readouterr()
    assert code == 0, out.err
    return out.out


@pytest.mark.redis
@pytest.mark.skipif(REDIS_SERVER is None, reason=SKIP_REASON)
def test_tier_stats_and_clear_still_work_with_their_checked_options(capsys, redis_server):  # noqa: F811
    doc = json.loads(ok(capsys, "tier", "stats", redis_server.url, "--timeout", "0.5", "--json"))
    assert doc["url"] == redis_server.url and len(doc["nodes"]) == 1
    out = ok(capsys, "tier", "clear", redis_server.url, "--prefix", "review-x", "--timeout", "2")
    assert "deleted 0 block(s) of every fingerprint" in out


# -- the URL's password is masked; a bad fingerprint is quoted as typed ------------------------------

class _FakeOperatorStore:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def server_stats(self):
        return [dict(node="h:1", used_memory=2**20, maxmemory=0, maxmemory_policy="noeviction", keys=3,
                     evicted_keys=0, keyspace_hits=1, keyspace_misses=1)]

    def clear(self, fingerprint):
        return 4


@pytest.mark.parametrize("argv", [("stats",), ("stats", "--json"), ("clear",)])
@pytest.mark.parametrize("url, secret", [("redis://default:hunter2@h:1/0", "hunter2"),
                                         ("redis://:p@ss@h:1", "p@ss"),
                                         ("unix:///run/r.sock?db=0&password=hunter2", "hunter2"),
                                         ("redis+cluster://u:hunter2@a:1,b:2", "hunter2")])
def test_tier_commands_do_not_print_the_urls_password(capsys, monkeypatch, argv, url, secret):
    """tier stats / clear echoed the URL as given, password included, to the terminal (and the
    logs of whatever runs them); the password is masked now."""
    import prefixkv.tiers.cli as tier_cli
    from prefixkv.cli import main

    monkeypatch.setattr(tier_cli, "_operator_store", lambda *a, **k: _FakeOperatorStore())
    assert main(["tier", argv[0], url, *argv[1:]]) == 0
    out = capsys.readouterr().out
    assert secret not in out and "***" in out


def test_tier_fingerprint_error_shows_what_was_typed(capsys):
    from cli_helpers import fails

    err = fails(capsys, "tier", "clear", "redis://127.0.0.1:1", "--fingerprint", " XYZ")
    assert "' XYZ'" in err
