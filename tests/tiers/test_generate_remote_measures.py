"""``generate --remote`` on an empty server measures the server as found: its warm-up used to write
the tier and the cache-on runs then read those blocks back (97.7 % hits against 63.8 % without
``--remote``, "blocks loaded" from an empty server). Now the warm-up never uses the tier and the
cache-on figures are one run against the server as found; a second command does reuse the
first one's blocks, as a restarted replica would."""

from __future__ import annotations

import json

import pytest

from prefixkv.cli import main
from redis_fixtures import needs_redis, redis_server, server  # noqa: F401  (fixtures)

pytest.importorskip("torch")
pytest.importorskip("redis")
pytestmark = needs_redis

GENERATE = ["generate", "--requests", "3", "--max-new-tokens", "2", "--repeat", "2", "--layers", "1",
            "--hidden-size", "64", "--heads", "2", "--kv-heads", "1", "--json"]


def generate(capsys, *extra):
    assert main([*GENERATE, *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_an_empty_server_serves_nothing_and_the_figures_say_what_was_measured(capsys, server):
    plain = generate(capsys)
    first = generate(capsys, "--remote", server.url)
    remote = first["cache_on"]["remote"]
    assert remote["staged_blocks"] == 0 and remote["host_hit_tokens"] == 0
    assert first["cache_on"]["prefix_hit_rate"] == plain["cache_on"]["prefix_hit_rate"]
    assert first["cache_on_runs"] == 1 and "as found" in first["measured"]
    assert first["remote_contact"]["ok"]
    # A second command (a restarted replica) finds the first one's blocks: reuse the server offers.
    second = generate(capsys, "--remote", server.url)
    assert second["cache_on"]["remote"]["staged_blocks"] > 0
    assert second["cache_on"]["prefix_hit_rate"] > plain["cache_on"]["prefix_hit_rate"]
    assert second["outputs_identical"]
