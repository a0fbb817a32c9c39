"""prefixkv's secondary tier under vLLM 0.33.0's real TieringOffloadingManager (issue 27's acceptance).

Each step runs in a fresh process of the vLLM venv (engine_runner). ``store``: chunks stored into
the primary (CPU) tier cascade into prefixkv's tier through the manager; ``load``: a restarted
manager's lookups go RETRY (the tier's lookup in flight) -> HIT_PENDING (promotion) -> HIT, and
the promoted rows of the primary view equal what was stored. The round trip builds vLLM's real
Scheduler (a local model config.json, skip_tokenizer_init) with the OffloadingConnector; the
fault tests build the same spec from the OffloadingConfig the scheduler normalises (faster).
"""

from __future__ import annotations

import pytest

from engine_runner import run, tier_stats
from redis_fixtures import needs_redis, own_redis_server, redis_server  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.vllm]

CHUNKS = 5


@pytest.fixture(params=["disk", pytest.param("redis", marks=needs_redis)])
def tier(request, tmp_path):
    if request.param == "disk":
        return {"store": f"disk://{tmp_path / 'disk'}", "capacity_bytes": 64 * 2**20}
    server = request.getfixturevalue("redis_server")
    server.command("FLUSHALL")
    return {"store": server.url}


def spec(tmp_path, tier: dict, **more) -> dict:
    return {"tier": tier, "model": "tiny-a", "chunks": CHUNKS, "out": str(tmp_path / "out"), **more}


def test_store_cascades_and_a_restarted_manager_hits(tmp_path, tier):
    s = spec(tmp_path, tier, scheduler=True)
    stored = run("vllm", "store", s, tmp_path)
    assert stored["cascaded"] and stored["stats"]["queued_pages"] == CHUNKS, stored
    assert stored["stats"]["store"]["writes"] == CHUNKS and stored["stats"]["errors"] == 0
    got = run("vllm", "load", s, tmp_path)
    assert got["first"][0] == "RETRY", got             # the lookup is in flight on the tier's thread
    assert got["settled"] and got["final"] == ["HIT"] * CHUNKS, got
    assert got["bytes_equal"] == [True] * CHUNKS
    assert got["stats"]["loaded_pages"] == CHUNKS and got["fingerprint"] == stored["fingerprint"]
    if tier["store"].startswith("disk://"):            # the operator's view of what the tier wrote
        found = {n["fingerprint"]: n["blocks"] for n in tier_stats(tier["store"])["namespaces"]}
        assert found == {stored["fingerprint"]: CHUNKS}


def test_faults_are_misses_counted_and_nothing_wrong_is_loaded(tmp_path, tier):
    s = spec(tmp_path, tier)
    run("vllm", "store", s, tmp_path)
    run("vllm", "store", {**s, "model": "tiny-b"}, tmp_path)
    runs = [{"damage": [{"chunk": 2, "how": "flip"}]},
            {"damage": [{"chunk": 1, "how": "truncate"}]},
            {"damage": [{"chunk": 0, "how": "foreign", "from_model": "tiny-b"}]},
            {"model": "tiny-c"}, {"salt": "tenant-2"}]
    flipped, truncated, foreign, other_model, other_salt = run("vllm", "load", {**s, "runs": runs}, tmp_path)
    for r, good, reasons in ((flipped, 2, {"payload_checksum"}), (truncated, 1, {"truncated", "length"}),
                             (foreign, 0, {"fingerprint"})):
        assert r["settled"], r
        assert r["final"][:good] == ["HIT"] * good and r["final"][good] == "MISS", r   # marked a miss: no livelock
        assert r.get("bytes_equal", []) == [True] * good
        rejected = r["stats"]["store"]["rejected"]
        assert sum(rejected.values()) == 1 and set(rejected) <= reasons, rejected
    for r in (other_model, other_salt):
        assert r["settled"] and r["final"][0] == "MISS" and r["hits"] == 0, r
        assert r["stats"]["loads"] == 0


@pytest.mark.redis
def test_redis_hung_then_killed_is_a_miss_after_at_most_one_timeout(tmp_path, own_redis_server):  # noqa: F811
    s = spec(tmp_path, {"store": own_redis_server.url, "timeout_s": 0.2})
    run("vllm", "store", s, tmp_path)
    own_redis_server.pause()
    try:
        hung = run("vllm", "load", s, tmp_path)
    finally:
        own_redis_server.resume()
    own_redis_server.stop()
    killed = run("vllm", "load", s, tmp_path)
    for r in (hung, killed):
        assert r["settled"] and r["final"][0] == "MISS" and r["hits"] == 0, r
        assert r["settle_s"] < 0.2 + 1.0, r            # one timeout on the lookup thread, a few scheduler steps
        assert r["stats"]["errors"] == 0 and r["stats"]["store"]["breaker_opens"] >= 1
