"""Trace loading (Mooncake, kv-cache-tester, prefixkv tokens) and the synthetic workload generator.

What a loader refuses rather than drops, merges or half reads (metadata of the wrong type, two
conversations or sub-agents with one id, the same file twice, an entry with hash ids and nested
requests, a key given twice, ids that are not strings, block sizes that are not ints), how ids and
blocks are held (local ids never collide with a global file's; a block id repeated by every turn
is held once), and Mooncake session inference."""

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from prefixkv.errors import InvalidArgument, PrefixKVError
from prefixkv.manager import KVCacheManager
from prefixkv.sim.replay import replay
from prefixkv.sim.traces import (NAMESPACE_BITS, TraceFormatError, TraceRequest, detect_format,
                                 load_kvcache_tester, load_mooncake, load_token_trace, load_trace,
                                 write_token_trace)
from prefixkv.sim.workloads import (BUILTIN_WORKLOADS, DEFAULT_WORKLOAD, WorkloadConfig, builtin_trace,
                                    generate_requests, generate_trace)

SHARED = Path(__file__).resolve().parents[2].parent / "shared" / "traces"
needs_shared = pytest.mark.skipif(not SHARED.is_dir(), reason=f"shared traces not found at {SHARED}")


def write_lines(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


def mooncake(ts, n, ids, out=10):
    return {"timestamp": ts, "input_length": n, "output_length": out, "hash_ids": ids}


def assert_names(exc_info, path, line, *words):
    err = exc_info.value
    assert isinstance(err, PrefixKVError) and isinstance(err, ValueError)
    assert err.path == str(path) and err.line == line
    message = str(err)
    assert message.startswith(f"{path}:{line}: "), message
    for word in words:
        assert word in message, message


# -- Mooncake ------------------------------------------------------------------------

def test_mooncake_loads_and_converts_ms(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake(0, 1000, [1, 2]), "", mooncake(1500, 512, [1], out=3)])
    trace = load_mooncake(path)
    assert trace.block_size == 512 and trace.format == "mooncake" and len(trace) == 2
    a, b = trace.requests
    assert (a.timestamp, a.input_length, a.output_length, a.block_hashes) == (0.0, 1000, 10, [1, 2])
    assert (b.timestamp, b.output_length, b.tokens) == (1.5, 3, None)
    assert trace.num_block_accesses() == 3 and trace.num_block_accesses(include_partial=False) == 2
    assert trace.distinct_blocks() == 2


@pytest.mark.parametrize("bad, line, words", [
    ('{"timestamp": 5, "input_length": 10,', 2, ["bad JSON"]),
    ('[1, 2]', 2, ["expected a JSON object"]),
    ({"timestamp": 5, "input_length": 10, "output_length": 1}, 2, ["missing field", "hash_ids"]),
    ({"input_length": 10, "output_length": 1, "hash_ids": [1]}, 2, ["missing field", "timestamp"]),
    (mooncake(5, -10, []), 2, ["negative", "input_length"]),
    (mooncake(5, 10, [1], out=-1), 2, ["negative", "output_length"]),
    (mooncake(5, 1025, [1, 2]), 2, ["2 hash id(s) contradict 1025", "expected 3"]),
    (mooncake(5, 10, [1, 2]), 2, ["contradict"]),
    (mooncake(5, "10", [1]), 2, ["input_length", "string"]),
    (mooncake(5, 10.0, [1]), 2, ["input_length", "number"]),
    (mooncake(None, 10, [1]), 2, ["timestamp"]),
    (mooncake(5, 10, "1"), 2, ["hash_ids", "array"]),
    (mooncake(5, 10, ["a"]), 2, ["hash_ids", "element 0"]),
    (mooncake(5, 10, [True]), 2, ["hash_ids", "boolean"]),
    (mooncake(5, 1100, [4, 5, 4]), 2, ["hash_ids", "block hash 2 (4) repeats block hash 0"]),
])
def test_mooncake_malformed_names_file_and_line(tmp_path, bad, line, words):
    path = write_lines(tmp_path / "bad.jsonl", [mooncake(0, 10, [7]), bad, mooncake(9, 10, [7])])
    with pytest.raises(TraceFormatError) as exc_info:
        load_mooncake(path)
    assert_names(exc_info, path, line, *words)


def test_mooncake_decreasing_timestamp_is_an_error(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake(0, 10, [1]), mooncake(5, 10, [1]), mooncake(5, 10, [1]),
                                              "", mooncake(4, 10, [1])])
    with pytest.raises(TraceFormatError) as exc_info:
        load_mooncake(path)
    assert_names(exc_info, path, 5, "earlier", "must not decrease")


def test_mooncake_block_size_is_a_parameter(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake(0, 100, [1, 2, 3, 4, 5, 6, 7])])
    assert load_mooncake(path, block_size=16).block_size == 16
    with pytest.raises(TraceFormatError):
        load_mooncake(path)


def test_hashed_requests_fit_the_manager(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [mooncake(0, 10, [1, 2, 3]), mooncake(1, 12, [1, 2, 3])])
    trace = load_mooncake(path, block_size=4)
    mgr = KVCacheManager(16, 4, hash_seed=0, index="dict")     # the trace's integer ids
    hits = []
    for i, r in enumerate(trace):
        hits.append(mgr.admit(i, mgr.prompt_from_hashes(r.block_hashes, r.input_length), compute_last_token=False))
        mgr.free(i)
    assert hits == [0, 8]


# -- kv-cache-tester -------------------------------------------------------------------

def conversation(requests, block_size=4, **extra):
    return {"id": extra.pop("id", "conv"), "block_size": block_size, "hash_id_scope": "local",
            "requests": requests, **extra}


def req(t, n, ids, out=5, **extra):
    return {"t": t, "type": "n", "in": n, "out": out, "hash_ids": ids, **extra}


def pretty(path, doc):
    """One request per line, like a pretty-printed document: line numbers are meaningful."""
    path.write_text(json.dumps(doc, indent=1))
    return path


def line_of(path, needle):
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if needle in line)


def test_kvcache_tester_flattens_subagents_and_namespaces(tmp_path):
    a = conversation([req(0.0, 8, [1, 2]),
                      {"t": 10.0, "type": "subagent", "agent_id": "agent_001",
                       "requests": [req(0.0, 4, [50]), req(3.0, 9, [50, 51])]},
                      req(12.0, 12, [1, 2, 3])], id="a")
    b = conversation([req(0.0, 8, [1, 2]), req(11.0, 7, [1])], id="b")
    (tmp_path / "a.json").write_text(json.dumps(a))
    (tmp_path / "b.json").write_text(json.dumps(b))
    trace = load_kvcache_tester(tmp_path)
    assert trace.format == "kvcache-tester" and trace.block_size == 4
    assert [(r.timestamp, r.session) for r in trace] == [
        (0.0, "a"), (0.0, "b"), (10.0, "a/agent_001"), (11.0, "b"), (12.0, "a"), (13.0, "a/agent_001")]
    sub = [r for r in trace if r.parent is not None]
    assert [r.parent for r in sub] == ["a", "a"] and sub[1].block_hashes == [50, 51]
    # equal local ids in two files do not collide
    first_a, first_b = trace.requests[0], trace.requests[1]
    assert first_a.block_hashes == [1, 2]
    assert first_b.block_hashes == [(1 << NAMESPACE_BITS) + 1, (1 << NAMESPACE_BITS) + 2]
    assert not set(first_a.block_hashes) & set(first_b.block_hashes)
    assert trace.num_block_accesses() == 2 + 1 + 2 + 3 + 2 + 1
    assert trace.distinct_blocks() == 3 + 2 + 2


def test_kvcache_tester_global_scope_and_stagger(tmp_path):
    for stem in ("x", "y"):
        doc = conversation([req(0.0, 8, [1, 2])], id=stem)
        doc["hash_id_scope"] = "global"
        (tmp_path / f"{stem}.json").write_text(json.dumps(doc))
    trace = load_kvcache_tester([tmp_path / "x.json", tmp_path / "y.json"], stagger=5.0)
    assert [r.block_hashes for r in trace] == [[1, 2], [1, 2]]
    assert [r.timestamp for r in trace] == [0.0, 5.0]


def test_kvcache_tester_accepts_floor_and_ceil_hash_counts(tmp_path):
    path = tmp_path / "c.json"
    path.write_text(json.dumps(conversation([req(0.0, 9, [1, 2]), req(1.0, 9, [1, 2, 3]), req(2.0, 8, [1, 2])])))
    assert len(load_kvcache_tester(path)) == 3


@pytest.mark.parametrize("mutate, words", [
    (lambda r: r.pop("in"), ["missing field 'in'"]),
    (lambda r: r.pop("t"), ["missing field 't'"]),
    (lambda r: r.update({"in": -3}), ["negative"]),
    (lambda r: r.update({"out": -1}), ["negative", "'out'"]),
    (lambda r: r.update({"hash_ids": [1, 2, 3, 4, 5]}), ["5 hash id(s) contradict 9", "expected 2 or 3"]),
    (lambda r: r.update({"hash_ids": [1, -2]}), ["hash_ids", "below 0"]),
    (lambda r: r.update({"hash_ids": [3, 3]}), ["hash_ids", "block hash 1 (3) repeats block hash 0"]),
    (lambda r: r.update({"in": "9"}), ["'in'", "string"]),
    (lambda r: r.update({"t": 0.5}), ["earlier", "must not decrease"]),
])
def test_kvcache_tester_malformed_request_names_file_line_and_path(tmp_path, mutate, words):
    bad = req(2.0, 9, [1, 2], marker="BAD")
    mutate(bad)
    doc = conversation([req(0.0, 4, [1]), req(1.0, 4, [1]), bad, req(3.0, 4, [1])])
    path = pretty(tmp_path / "conv.json", doc)
    with pytest.raises(TraceFormatError) as exc_info:
        load_kvcache_tester(path)
    # the error points at the line where the offending request object opens
    marker_line = line_of(path, '"marker": "BAD"')
    opening = [i for i, line in enumerate(path.read_text().splitlines(), 1) if line.strip() == "{"
               and i < marker_line][-1]
    assert_names(exc_info, path, opening, "requests[2]", *words)


def test_kvcache_tester_nested_error_names_the_nested_request(tmp_path):
    doc = conversation([req(0.0, 4, [1]),
                        {"t": 1.0, "type": "subagent", "agent_id": "sa",
                         "requests": [req(0.0, 4, [9]), req(1.0, -4, [])]}])
    path = tmp_path / "one_line.json"
    path.write_text(json.dumps(doc))            # a single line, as the real files are
    with pytest.raises(TraceFormatError) as exc_info:
        load_kvcache_tester(path)
    assert_names(exc_info, path, 1, "requests[1].requests[1]", "negative", "column")
    column = int(str(exc_info.value).split("(column ")[1].rstrip(")"))
    assert path.read_text()[column - 1:].startswith('{"t": 1.0, "type": "n", "in": -4')


def test_kvcache_tester_document_errors(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"block_size": 4,\n "requests": [\n  {"t": 0, "in": 4,, "out": 1}\n]}')
    with pytest.raises(TraceFormatError) as exc_info:
        load_kvcache_tester(path)
    assert_names(exc_info, path, 3, "bad JSON")
    path.write_text(json.dumps({"block_size": 4}))
    with pytest.raises(TraceFormatError) as exc_info:
        load_kvcache_tester(path)
    assert_names(exc_info, path, 1, "missing field 'requests'")
    path.write_text(json.dumps({"requests": []}))
    with pytest.raises(TraceFormatError, match="missing field 'block_size'"):
        load_kvcache_tester(path)
    (tmp_path / "other.json").write_text(json.dumps(conversation([req(0.0, 8, [1])], block_size=8)))
    path.write_text(json.dumps(conversation([req(0.0, 8, [1, 2])], block_size=4)))
    with pytest.raises(TraceFormatError, match="block_size 8 differs from 4"):
        load_kvcache_tester(tmp_path)


# -- prefixkv token traces ----------------------------------------------------------------

def test_token_trace_round_trip_and_manager(tmp_path):
    requests = [TraceRequest(0.0, 10, 3, None, list(range(10)), [7, 8, 9], None, "s1", "chat"),
                TraceRequest(0.5, 13, 2, None, list(range(10)) + [7, 8, 9], None, "tenant", "s1", "chat")]
    path = write_token_trace(tmp_path / "t.jsonl", requests, block_size=4, name="tiny")
    trace = load_trace(path)
    assert trace.format == "tokens" and trace.block_size == 4 and trace.name == "tiny"
    assert [(r.timestamp, r.input_length, r.output_length, r.salt, r.session) for r in trace] == [
        (0.0, 10, 3, None, "s1"), (0.5, 13, 2, "tenant", "s1")]
    assert trace.requests[0].output_tokens == [7, 8, 9] and trace.requests[1].output_tokens is None
    assert trace.requests[1].block_hashes is None and trace.num_block_accesses() == 2 + 3
    assert load_token_trace(path, block_size=2).block_size == 2
    # the salt isolates: the second request shares nothing with the first
    assert trace.distinct_blocks() == 5
    mgr = KVCacheManager(32, 4, hash_seed=0)
    assert mgr.admit("a", mgr.prompt(trace.requests[0].tokens)) == 0
    assert mgr.admit("b", mgr.prompt(trace.requests[1].tokens, salt=trace.requests[1].salt)) == 0


def test_token_trace_without_header_defaults_to_block_size_16(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [{"timestamp": 0, "tokens": [1] * 40, "output_length": 0}])
    trace = load_trace(path)
    assert trace.block_size == 16 and trace.num_block_accesses() == 2 and trace.name == "t"


@pytest.mark.parametrize("bad, words", [
    ("{not json", ["bad JSON"]),
    ({"timestamp": 1, "output_length": 2}, ["missing field 'tokens'"]),
    ({"tokens": [1], "output_length": 2}, ["missing field 'timestamp'"]),
    ({"timestamp": 1, "tokens": [1]}, ["output_tokens", "output_length"]),
    ({"timestamp": 1, "tokens": [1], "output_length": -2}, ["negative"]),
    ({"timestamp": 1, "tokens": [1, -1], "output_length": 0}, ["tokens", "element 1", "below 0"]),
    ({"timestamp": 1, "tokens": [1, 2**32], "output_length": 0}, ["tokens", "element 1"]),
    ({"timestamp": 1, "tokens": [1, 2.5], "output_length": 0}, ["tokens", "element 1", "number"]),
    ({"timestamp": 1, "tokens": [1], "output_tokens": [1, 2], "output_length": 3}, ["contradicts"]),
    ({"timestamp": 1, "tokens": [1], "output_length": 0, "salt": [1]}, ["salt"]),
    ({"timestamp": -1, "tokens": [1], "output_length": 0}, ["earlier", "must not decrease"]),
])
def test_token_trace_malformed_names_file_and_line(tmp_path, bad, words):
    path = write_lines(tmp_path / "t.jsonl", [{"prefixkv_trace": 1, "block_size": 4},
                                              {"timestamp": 0, "tokens": [1, 2], "output_length": 1},
                                              "", bad])
    with pytest.raises(TraceFormatError) as exc_info:
        load_token_trace(path)
    assert_names(exc_info, path, 4, *words)


def test_token_trace_rejects_unknown_version(tmp_path):
    path = write_lines(tmp_path / "t.jsonl", [{"prefixkv_trace": 2}])
    with pytest.raises(TraceFormatError) as exc_info:
        load_token_trace(path)
    assert_names(exc_info, path, 1, "version")


def test_write_token_trace_needs_tokens(tmp_path):
    with pytest.raises(ValueError, match="no token ids"):
        write_token_trace(tmp_path / "x.jsonl", [TraceRequest(0.0, 4, 0, [1])])
    assert not list(tmp_path.iterdir())     # nothing half-written left behind


# -- detection -------------------------------------------------------------------------------

def test_load_trace_detects_formats(tmp_path):
    m = write_lines(tmp_path / "m.jsonl", [mooncake(0, 10, [1])])
    t = write_lines(tmp_path / "t.jsonl", [{"timestamp": 0, "tokens": [1], "output_length": 0}])
    k = tmp_path / "k.json"
    k.write_text(json.dumps(conversation([req(0.0, 4, [1])]), indent=2))
    assert detect_format(m) == "mooncake" and detect_format(t) == "tokens" and detect_format(k) == "kvcache-tester"
    assert load_trace(m).format == "mooncake"
    assert load_trace(t).format == "tokens"
    assert load_trace(k).format == "kvcache-tester"
    assert load_trace([k]).format == "kvcache-tester"
    assert load_trace(m, format="mooncake", block_size=16).block_size == 16
    odd = write_lines(tmp_path / "odd.jsonl", [{"foo": 1}])
    with pytest.raises(TraceFormatError, match="unknown trace format"):
        load_trace(odd)
    empty = write_lines(tmp_path / "empty.jsonl", [""])
    with pytest.raises(TraceFormatError, match="empty"):
        load_trace(empty)
    with pytest.raises(ValueError, match="unknown trace format"):
        load_trace(m, format="csv")


# -- the real shared traces --------------------------------------------------------------------

@needs_shared
@pytest.mark.parametrize("name, requests, accesses, full_accesses, distinct", [
    ("conversation_trace.jsonl", 12_031, 288_500, 276_491, 182_790),
    ("synthetic_trace.jsonl", 3_993, 121_877, 117_888, 43_924),
])
def test_real_mooncake_traces(name, requests, accesses, full_accesses, distinct):
    trace = load_trace(SHARED / name)
    assert trace.format == "mooncake" and trace.block_size == 512
    assert len(trace) == requests
    assert trace.num_block_accesses() == accesses
    assert trace.num_block_accesses(include_partial=False) == full_accesses
    assert trace.distinct_blocks() == distinct
    ts = [r.timestamp for r in trace]
    assert ts == sorted(ts)


@needs_shared
def test_real_weka_sample():
    trace = load_trace(SHARED / "weka-kv-cache-tester")
    assert trace.format == "kvcache-tester" and trace.block_size == 64
    assert len(trace.meta["files"]) == 24
    tops = sum(len(json.loads(p.read_text())["requests"]) for p in (SHARED / "weka-kv-cache-tester").glob("*.json"))
    assert tops == 914
    # 914 top-level entries: 913 requests and one sub-agent (in trace_0014) holding 2 requests
    assert len(trace) == 915
    sub = [r for r in trace if r.parent is not None]
    assert [(r.session, r.parent, r.timestamp) for r in sub] == [
        ("trace_0014/agent_001", "trace_0014", 961.349), ("trace_0014/agent_001", "trace_0014", 965.349)]
    assert trace.num_block_accesses() == 1_172_138
    assert trace.distinct_blocks() == 67_792
    assert {r.block_hashes[0] >> NAMESPACE_BITS for r in trace} == set(range(24))
    ts = [r.timestamp for r in trace]
    assert ts == sorted(ts)


# -- the workload generator --------------------------------------------------------------------

SMALL = replace(DEFAULT_WORKLOAD, name="small", num_requests=120)


def test_generator_is_deterministic(tmp_path):
    a = generate_trace(tmp_path / "a.jsonl", SMALL).read_bytes()
    b = generate_trace(tmp_path / "b.jsonl", SMALL).read_bytes()
    c = generate_trace(tmp_path / "c.jsonl", replace(SMALL, seed=1)).read_bytes()
    assert a == b
    assert a != c


def test_generated_trace_loads_with_its_config(tmp_path):
    path = generate_trace(tmp_path / "w.jsonl", SMALL)
    trace = load_trace(path)
    assert trace.format == "tokens" and trace.block_size == SMALL.block_size and trace.name == "small"
    assert len(trace) == SMALL.num_requests
    assert trace.meta["config"]["seed"] == SMALL.seed
    ts = [r.timestamp for r in trace]
    assert ts == sorted(ts)
    assert {r.kind for r in trace} == {"chat", "fewshot", "agent", "oneshot"}
    assert all(r.tokens is not None and r.block_hashes is None and r.output_length == len(r.output_tokens)
               for r in trace)


def test_generated_sessions_really_share_prefixes():
    requests = generate_requests(SMALL)
    by_session = {}
    for r in requests:
        by_session.setdefault(r.session, []).append(r)
    grown = 0
    for turns in by_session.values():
        for prev, cur in zip(turns, turns[1:]):
            # a later chat turn / agent step extends the previous prompt and its output
            base = prev.tokens + prev.output_tokens
            assert cur.tokens[:len(base)] == base and len(cur.tokens) > len(base)
            grown += 1
    assert grown > 20
    # the same tenant's sessions share the system prompt
    tenant_prompts = {}
    for r in requests:
        tenant_prompts.setdefault(r.session.split("/")[0], []).append(r.tokens)
    popular = max(tenant_prompts.values(), key=len)
    assert len(popular) > 5 and len({tuple(t[:SMALL.system_prompt_tokens[0]]) for t in popular}) == 1


def test_generated_trace_gives_prefix_hits_through_the_manager(tmp_path):
    trace = load_trace(generate_trace(tmp_path / "w.jsonl", SMALL))
    size = trace.block_size
    mgr = KVCacheManager(100_000, size, hash_seed=0)
    hit = total = 0
    for i, r in enumerate(trace):
        hit += mgr.admit(i, mgr.prompt(r.tokens, salt=r.salt), compute_last_token=False)
        total += r.input_length // size * size
        mgr.free(i)
    assert total == trace.num_block_accesses() * size
    assert 0.3 < hit / total < 0.95


def test_salted_tenants_do_not_share_across_tenants():
    plain = generate_requests(replace(SMALL, num_tenants=1, salt_tenants=False))
    salted = generate_requests(replace(SMALL, num_tenants=2, salt_tenants=True))
    assert all(r.salt is None for r in plain)
    assert {r.salt for r in salted} == {"tenant-0", "tenant-1"}


def test_default_workload_size():
    config = DEFAULT_WORKLOAD
    requests = generate_requests(config)
    tokens = sum(r.input_length for r in requests)
    assert len(requests) == config.num_requests == 300
    assert 100_000 < tokens < 1_000_000


def test_builtin_trace_is_generated_once_and_reused(tmp_path):
    trace = builtin_trace("default", tmp_path)
    files = sorted(tmp_path.iterdir())
    assert [f.suffix for f in files] == [".jsonl", ".xxh3"]      # the trace and its digest
    assert len(trace) == DEFAULT_WORKLOAD.num_requests
    stamp = files[0].stat().st_mtime_ns
    builtin_trace("default", tmp_path)
    assert files[0].stat().st_mtime_ns == stamp
    assert set(BUILTIN_WORKLOADS) >= {"default"}
    with pytest.raises(KeyError):
        builtin_trace("nope", tmp_path)


@pytest.mark.parametrize("bad", [dict(num_requests=0), dict(session_rate=0), dict(mix=(("video", 1.0),)),
                                 dict(user_tokens=(5, 1)), dict(chat_turns=0.5)])
def test_workload_config_validates(bad):
    with pytest.raises(ValueError):
        WorkloadConfig(**bad)


def test_kvcache_tester_without_any_request_is_refused(tmp_path):
    from prefixkv.sim.traces import load_kvcache_tester

    for name in ("a", "b"):
        (tmp_path / f"{name}.json").write_text(json.dumps({"id": name, "block_size": 64, "requests": []}))
    with pytest.raises(TraceFormatError, match="no requests"):
        load_kvcache_tester(tmp_path / "a.json")
    with pytest.raises(TraceFormatError, match="no requests"):
        load_kvcache_tester(tmp_path)


def test_writing_a_trace_into_a_missing_directory_names_it(tmp_path):
    from prefixkv.sim.traces import write_token_trace

    with pytest.raises(FileNotFoundError, match="directory .*nope does not exist"):
        write_token_trace(tmp_path / "nope" / "t.jsonl", [], block_size=16)


# -- session metadata (issue 16) ---------------------------------------------------------------

def test_kvcache_tester_requests_keep_stop_reason_times_and_turn(tmp_path):
    doc = {"id": "conv", "block_size": 4, "requests": [
        {"t": 0.0, "in": 8, "out": 1, "hash_ids": [1, 2], "stop": "tool_use", "api_time": 1.5, "think_time": 0.0},
        {"t": 5.0, "type": "subagent", "agent_id": "ag", "requests": [
            {"t": 0.0, "in": 4, "out": 1, "hash_ids": [9], "stop": "end_turn"}]},
        {"t": 9.0, "in": 12, "out": 1, "hash_ids": [1, 2, 3], "stop": "", "think_time": 7}]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(doc))
    reqs = load_trace(path).requests
    assert [(r.session, r.parent, r.stop, r.api_time, r.think_time, r.turn) for r in reqs] == [
        ("conv", None, "tool_use", 1.5, 0.0, 0), ("conv/ag", "conv", "end_turn", None, None, 0),
        ("conv", None, "", None, 7.0, 1)]


def test_mooncake_sessions_are_inferred_from_hash_chains(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [
        mooncake(0, 1500, [1, 2, 3]),            # s0: shared prompt 1, then its own 2 (3 is its partial tail)
        mooncake(1, 1500, [1, 5, 6]),            # s1: shares block 1 with s0 -> block 1 is shared
        mooncake(2, 2560, [1, 2, 7, 8, 9]),      # extends s0's full chain [1, 2]: s0, turn 1
        mooncake(3, 1024, [1, 5]),               # contains s1's chain [1, 5]: s1, turn 1
        mooncake(4, 1000, [1, 11]),              # only the shared block 1: a new session
        mooncake(5, 2900, [1, 2, 7, 8, 9, 10]),  # extends s0's second turn: turn 2
    ])
    reqs = load_trace(path).requests
    assert [(r.session, r.turn) for r in reqs] == [("s0", 0), ("s1", 0), ("s0", 1), ("s1", 1), ("s2", 0),
                                                   ("s0", 2)]


def test_token_trace_session_fields_round_trip_and_are_checked(tmp_path):
    requests = [TraceRequest(0.0, 4, 1, None, [1, 2, 3, 4], [5], session="s", stop="tool_use", api_time=2.0,
                             think_time=0.5, turn=3)]
    trace = load_trace(write_token_trace(tmp_path / "t.jsonl", requests, block_size=4))
    r = trace.requests[0]
    assert (r.session, r.stop, r.api_time, r.think_time, r.turn) == ("s", "tool_use", 2.0, 0.5, 3)
    for field, value, words in (("stop", 3, "'stop'"), ("api_time", -1, "'api_time'"), ("turn", 1.5, "'turn'"),
                                ("think_time", "x", "'think_time'")):
        path = write_lines(tmp_path / f"bad-{field}.jsonl",
                           [{"timestamp": 0, "tokens": [1], "output_length": 0, field: value}])
        with pytest.raises(TraceFormatError) as info:
            load_trace(path)
        assert_names(info, path, 1, words)


# -- issue 12, item 10: binary files and traces without requests ---------------------------------------------

@pytest.mark.parametrize("name,content,line", [
    ("bin.jsonl", b"\x95\x00\xff\xfe binary", 1),
    ("bin.json", b"\x95\x00\xff\xfe binary", 1),
    ("late.jsonl", b'{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n\x95\x96\n', 2),
    ("late.json", b'{"id": "x",\n "block_size": 4,\n "requests": [\xff]}', 3),
])
def test_a_binary_trace_names_the_path_and_line(tmp_path, name, content, line):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert_names(info, path, line, "UTF-8")


def test_a_binary_file_in_a_trace_folder_names_it(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"block_size": 4, "requests": [
        {"t": 0, "in": 4, "out": 1, "hash_ids": [1]}]}))
    (tmp_path / "b.json").write_bytes(b"\x89PNG\r\n\x1a\n")
    with pytest.raises(TraceFormatError) as info:
        load_trace(tmp_path)
    assert_names(info, tmp_path / "b.json", 1, "UTF-8")


@pytest.mark.parametrize("lines", [
    [{"prefixkv_trace": 1, "block_size": 4}],         # a token trace's header alone
    [{"prefixkv_trace": 1}, ""],
    ["", "   "],                                      # blank lines only
    [],                                               # an empty file
])
def test_a_trace_without_requests_is_refused_everywhere(tmp_path, lines):
    path = write_lines(tmp_path / "t.jsonl", lines) if lines else tmp_path / "t.jsonl"
    if not lines:
        path.write_bytes(b"")
    with pytest.raises(TraceFormatError, match="no requests") as info:
        load_trace(path)
    assert info.value.path == str(path)
    with pytest.raises(TraceFormatError, match="no requests"):
        load_token_trace(path)
    if not any(isinstance(line, dict) for line in lines):   # a header is not Mooncake at all
        with pytest.raises(TraceFormatError, match="no requests"):
            load_mooncake(path)


# -- kv-cache-tester: refused entries, ids and metadata -----------------------------------------------

def _write(path, text):
    path.write_text(text)
    return path


def test_kvcache_tester_entry_with_hash_ids_and_nested_requests_is_refused_not_half_read(tmp_path):
    # An entry holding both its own hash_ids and nested requests was read as one request and its
    # nested requests were dropped without a word. It is ambiguous: refuse it, naming the entry.
    from prefixkv.sim.traces import TraceFormatError

    doc = {"id": "c", "block_size": 4, "requests": [
        {"t": 0, "in": 8, "out": 1, "hash_ids": [1, 2]},
        {"t": 1, "in": 8, "out": 1, "hash_ids": [1, 2],
         "requests": [{"t": 0, "in": 8, "out": 1, "hash_ids": [1, 2]}]}]}
    path = _write(tmp_path / "c.json", json.dumps(doc))
    with pytest.raises(TraceFormatError) as err:
        load_trace(path)
    assert str(err.value).startswith(f"{path}:1: requests[1]:")
    assert "hash_ids" in str(err.value) and "requests" in str(err.value)


def test_kvcache_tester_local_ids_never_collide_with_a_global_file(tmp_path):
    # File 0's local namespace (k = 0) was the global ids' own: local id 1 of the first file and
    # global id 1 of another file were taken for the same block (hits that never happened).
    from prefixkv.sim.traces import load_kvcache_tester

    for stem, scope in (("a", "local"), ("b", "global"), ("c", "global")):
        doc = {"id": stem, "block_size": 4, "hash_id_scope": scope,
               "requests": [{"t": 0.0, "in": 8, "out": 1, "hash_ids": [1, 2]}]}
        _write(tmp_path / f"{stem}.json", json.dumps(doc))
    trace = load_kvcache_tester(tmp_path)
    a, b, c = trace.requests
    assert b.block_hashes == c.block_hashes == [1, 2]          # global ids are shared, as they are
    assert not set(a.block_hashes) & set(b.block_hashes)
    assert trace.distinct_blocks() == 4
    assert replay(trace, "lru", 100).block_hits == 2


def _conversation(path, requests, **doc):
    doc = {"id": path.stem, "block_size": 64, "hash_id_scope": "local", **doc, "requests": requests}
    path.write_text(json.dumps(doc))
    return path


def _request(t, **fields):
    return {"t": t, "type": "n", "in": 64, "out": 1, "hash_ids": [1], **fields}


@pytest.mark.parametrize("fields, words", [
    ({"api_time": "7.3"}, "'api_time'"),        # was dropped: api_time None
    ({"api_time": -1.0}, "'api_time'"),         # was kept as -1.0 s
    ({"think_time": "x"}, "'think_time'"),
    ({"think_time": -2}, "'think_time'"),
    ({"stop": 5}, "'stop'"),                    # was dropped: stop None
    ({"type": 3}, "'type'"),                    # was dropped: kind None
])
def test_kvcache_tester_metadata_of_the_wrong_type_is_refused_not_dropped(tmp_path, fields, words):
    # The token-trace loader refuses these; the kv-cache-tester loader kept a negative time and
    # silently turned a wrong type into "unknown", so a replay's hints lost the request's stop reason.
    path = _conversation(tmp_path / "c.json", [_request(0.0), _request(1.0, **fields)])
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:1: requests[1]: ") and words in message, message


def test_kvcache_tester_null_metadata_reads_as_absent(tmp_path):
    path = _conversation(tmp_path / "c.json", [_request(0.0, api_time=None, think_time=None, stop=None, type=None)])
    r = load_trace(path).requests[0]
    assert (r.api_time, r.think_time, r.stop, r.kind) == (None, None, None, None)


def test_two_conversations_with_one_id_are_refused_not_merged_into_one_session(tmp_path):
    # Both files' requests became session "c", turn 0 twice: a replay's hints took two
    # concurrent conversations for one.
    a = _conversation(tmp_path / "a.json", [_request(0.0)], id="c")
    b = _conversation(tmp_path / "b.json", [_request(0.0)], id="c")
    with pytest.raises(TraceFormatError) as info:
        load_kvcache_tester([a, b])
    assert str(info.value).startswith(f"{b}:1: ") and "'c'" in str(info.value) and str(a) in str(info.value)


def test_the_same_conversation_file_twice_is_refused(tmp_path):
    a = _conversation(tmp_path / "a.json", [_request(0.0)])
    with pytest.raises(ValueError, match="twice"):
        load_kvcache_tester([a, tmp_path / "." / "a.json"])


def test_two_subagents_with_one_agent_id_are_refused_not_merged(tmp_path):
    # Both sub-agents' requests became session "c/x", each starting again at turn 0.
    path = _conversation(tmp_path / "c.json", [
        _request(0.0),
        {"t": 1.0, "type": "subagent", "agent_id": "x", "requests": [_request(0.0)]},
        {"t": 2.0, "type": "subagent", "agent_id": "x", "requests": [_request(0.0)]}], id="c")
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    message = str(info.value)
    assert message.startswith(f"{path}:1: requests[2]") and "'c/x'" in message, message


# -- Mooncake session inference ---------------------------------------------------------------------

def test_inferred_mooncake_turns_count_the_sessions_requests(tmp_path):
    # The turn is the request's index in its session (SessionHint.turn, as the other loaders give
    # it). Inferred sessions took the turn of the request they continue plus one, so a session
    # that goes back to an earlier turn's prompt (a retry, an edited message) repeated turns:
    # s0 read 0, 1, 1, 2 (conversation_trace.jsonl has 23 such sessions, one reading 0..5, 3, 4, 3, 3).
    path = tmp_path / "m.jsonl"
    rows = [(0, [1, 2]), (1, [1, 2, 3, 4]), (2, [1, 2, 5, 6]), (3, [1, 2, 5, 6, 7, 8])]
    path.write_text("".join(json.dumps({"timestamp": ts, "input_length": 512 * len(ids), "output_length": 1,
                                        "hash_ids": ids}) + "\n" for ts, ids in rows))
    assert [(r.session, r.turn) for r in load_trace(path)] == [("s0", 0), ("s0", 1), ("s0", 2), ("s0", 3)]


# -- memory -----------------------------------------------------------------------------------------

def _traced_bytes(load):
    import gc
    import tracemalloc

    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        trace = load()
        gc.collect()
        return trace, tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("fmt", ["kvcache-tester", "mooncake", "tokens"])
def test_a_block_id_repeated_by_every_turn_is_held_once(tmp_path, fmt):
    # Agentic sessions resend their whole prefix every turn: each request's hash ids repeat the
    # previous request's. Every reference was its own int object (JSON parses each number anew,
    # and the namespace offset made another), about 40 bytes a reference instead of a list slot's 8:
    # the 26 MB weka-kv-cache-tester-more sample took 410 MB, and each sweep worker copied it. Token
    # ids likewise (the built-in "large" workload: 326 MB for 8.7 M prompt tokens).
    chains = [list(range(1, 40 * (i + 1) + 1)) for i in range(50)]          # 51,000 references
    if fmt == "tokens":
        path = tmp_path / "t.jsonl"
        path.write_text("".join(json.dumps({"timestamp": i, "tokens": [1000 + x for x in ids], "output_length": 1})
                                + "\n" for i, ids in enumerate(chains)))
        trace, used = _traced_bytes(lambda: load_trace(path))
        assert trace.input_tokens() == 51_000
        assert used < 16 * 51_000, f"{used / 51_000:.1f} bytes per token"
        assert [[x - 1000 for x in r.tokens] for r in trace] == chains
        return
    if fmt == "mooncake":
        path = tmp_path / "m.jsonl"
        path.write_text("".join(json.dumps({"timestamp": i, "input_length": 512 * len(ids), "output_length": 1,
                                            "hash_ids": ids}) + "\n" for i, ids in enumerate(chains)))
        load = lambda: load_trace(path)  # noqa: E731
    else:
        first = _conversation(tmp_path / "a.json", [_request(0.0)])
        second = _conversation(tmp_path / "b.json", [_request(float(i), **{"in": 64 * len(ids), "hash_ids": ids})
                                                     for i, ids in enumerate(chains)])
        load = lambda: load_kvcache_tester([first, second])  # noqa: E731
    trace, used = _traced_bytes(load)
    refs = trace.num_block_accesses()
    assert refs >= 51_000
    assert used < 16 * refs, f"{used / refs:.1f} bytes per block reference"
    # and the ids are the same values as before
    ids = [r.block_hashes for r in trace if len(r.block_hashes) > 1]
    offset = 0 if fmt == "mooncake" else 1 << 40
    assert [[h - offset for h in x] for x in ids] == chains


# -- writing token traces -----------------------------------------------------------------------------

@pytest.mark.parametrize("request_, words", [
    # read back with other lengths: output_length 1 (from output_tokens), input_length 3 (from tokens)
    (dict(input_length=3, output_length=5, tokens=[1, 2, 3], output_tokens=[7]), "output_length 5"),
    (dict(input_length=10, output_length=1, tokens=[1, 2, 3]), "input_length 10"),
    # written, then refused by load_token_trace
    (dict(input_length=3, output_length=1, tokens=[1, 2, 2**40]), "'tokens'"),
    (dict(input_length=3, output_length=-1, tokens=[1, 2, 3]), "'output_length'"),
    (dict(input_length=3, output_length=1, tokens=[1, 2, 3], salt=True), "'salt'"),
    (dict(input_length=3, output_length=1, tokens=[1, 2, 3], turn=-1), "'turn'"),
    (dict(input_length=3, output_length=1, tokens=[1, 2, 3], api_time=-0.5), "'api_time'"),
])
def test_write_token_trace_refuses_what_would_not_read_back_the_same(tmp_path, request_, words):
    from prefixkv.sim.traces import TraceRequest, write_token_trace

    good = TraceRequest(0.0, 2, 1, tokens=[5, 6], output_tokens=[7])
    path = tmp_path / "t.jsonl"
    with pytest.raises(ValueError) as info:
        write_token_trace(path, [good, TraceRequest(1.0, **request_)], block_size=4)
    assert str(info.value).startswith("requests: request 1: ") and words in str(info.value), str(info.value)
    assert not path.exists() and list(tmp_path.iterdir()) == []


# -- a key given twice ---------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["mooncake", "tokens", "kvcache-tester"])
def test_a_key_given_twice_is_refused_not_read_as_the_last_one(tmp_path, fmt):
    # JSON parsers keep the last of two equal keys: a request's first "hash_ids", or a
    # conversation's first "requests" list, was silently dropped.
    if fmt == "mooncake":
        path = tmp_path / "m.jsonl"
        path.write_text('{"timestamp": 0, "input_length": 512, "output_length": 1, "hash_ids": [1]}\n'
                        '{"timestamp": 1, "input_length": 512, "output_length": 1, "hash_ids": [2], '
                        '"timestamp": 9}\n')
        line, key = 2, "timestamp"
    elif fmt == "tokens":
        path = tmp_path / "t.jsonl"
        path.write_text('{"prefixkv_trace": 1, "block_size": 4}\n'
                        '{"timestamp": 0, "tokens": [1, 2], "output_length": 1, "tokens": [3]}\n')
        line, key = 2, "tokens"
    else:
        path = tmp_path / "c.json"
        path.write_text('{"id": "c", "block_size": 64,\n "requests": [{"t": 0, "in": 64, "out": 1, "hash_ids": [1]}],\n'
                        ' "requests": []}\n')
        line, key = 3, "requests"
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:{line}: ") and f"{key!r}" in str(info.value) \
        and "twice" in str(info.value), str(info.value)


@pytest.mark.parametrize("where", ["id", "agent_id"])
def test_a_conversation_or_agent_id_that_is_not_a_string_is_refused_not_replaced(tmp_path, where):
    # "id": 5 silently became the file's stem, "agent_id": 7 the entry's index: the session
    # labels no longer said which conversation or agent a request came from.
    if where == "id":
        path = _conversation(tmp_path / "c.json", [_request(0.0)], id=5)
    else:
        path = _conversation(tmp_path / "c.json", [
            _request(0.0), {"t": 1.0, "type": "subagent", "agent_id": 7, "requests": [_request(0.0)]}])
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert str(info.value).startswith(f"{path}:1: ") and f"'{where}'" in str(info.value), str(info.value)


# -- trace loaders: a numpy integer block size ----------------------------------------------------

def _mooncake_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [0, 1, 2]}\n'
                    '{"timestamp": 5, "input_length": 30, "output_length": 1, "hash_ids": [0, 1]}\n')
    return path


def test_trace_loaders_take_a_numpy_integer_block_size(tmp_path):
    """A block size must be an int, and a numpy integer is one: np.int64(16) (a block size read with
    numpy) is taken by every loader."""
    from prefixkv.sim.traces import TraceRequest, load_mooncake, load_token_trace, load_trace, write_token_trace

    path = _mooncake_file(tmp_path)
    for trace in (load_mooncake(path, block_size=np.int64(16)), load_trace(path, block_size=np.int32(16))):
        assert trace.block_size == 16 and type(trace.block_size) is int
    tokens = tmp_path / "t.jsonl"
    write_token_trace(tokens, [TraceRequest(0.0, 4, 1, tokens=[1, 2, 3, 4])], block_size=np.int64(2))
    assert load_token_trace(tokens).block_size == 2
    trace = load_token_trace(tokens, block_size=np.int64(4))
    assert trace.block_size == 4 and type(trace.block_size) is int


@pytest.mark.parametrize("bad", [16.0, True, np.bool_(True), "16", 0, np.int64(-4)])
def test_trace_loaders_still_refuse_other_block_sizes(tmp_path, bad):
    from prefixkv.sim.traces import load_mooncake

    with pytest.raises(InvalidArgument, match="block_size"):
        load_mooncake(_mooncake_file(tmp_path), block_size=bad)
