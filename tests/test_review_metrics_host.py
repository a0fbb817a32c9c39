"""Review of metrics, KV events, host memory, the host tier, staging, the block codec and the tier CLI:
each test failed before its fix."""

from __future__ import annotations

import pytest

from prefixkv.errors import InvalidArgument


# -- prefixkv tier ----------------------------------------------------------------------------------

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
