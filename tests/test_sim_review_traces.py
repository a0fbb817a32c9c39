"""Defects found in review of the trace loaders, the workload generator and the sweep, one test each."""

import json

import pytest

from prefixkv.sim.traces import TraceFormatError, load_kvcache_tester, load_trace


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


# -- the sweep ------------------------------------------------------------------------------------

def _tiny_mooncake(path, n=6):
    with open(path, "w") as f:
        for i in range(n):
            ids = [i % 2, 10 + i]
            f.write(json.dumps({"timestamp": i, "input_length": 1024, "output_length": 1, "hash_ids": ids}) + "\n")
    return path


def test_an_explicit_worker_count_is_capped_at_the_number_of_cells(tmp_path, monkeypatch):
    # --workers 8 for 2 cells started a pool of 8 processes (each forked with the parent's memory);
    # only the default was capped.
    import multiprocessing

    from prefixkv.sim import sweep as sweep_mod

    real = multiprocessing.get_context()
    sizes = []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def Pool(self, processes, *args, **kwargs):
            sizes.append(processes)
            return real.Pool(processes, *args, **kwargs)

    monkeypatch.setattr(sweep_mod.multiprocessing, "get_context", lambda *a: Spy())
    source = sweep_mod.TraceSource("m", (str(_tiny_mooncake(tmp_path / "m.jsonl")),), "mooncake")
    results = sweep_mod.sweep([source], ["lru"], {"m": [3, 5]}, workers=8)
    assert len(results) == 2 and sizes == [2]


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


def test_a_sweep_without_capacities_for_a_trace_names_it(tmp_path):
    # A KeyError: 'b' came out of the sweep's checks, naming nothing.
    from prefixkv.sim.sweep import TraceSource, sweep

    path = str(_tiny_mooncake(tmp_path / "m.jsonl"))
    sources = [TraceSource("a", (path,), "mooncake"), TraceSource("b", (path,), "mooncake")]
    with pytest.raises(ValueError, match="no capacities for trace 'b'"):
        sweep(sources, ["lru"], {"a": [3]}, workers=1)
