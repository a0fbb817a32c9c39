"""The trace loaders and the token-trace writer on bad or unusual input: a byte-order mark, numbers
too large for a float, duplicate keys, bad arguments (InvalidArgument naming them); and how often a
trace is parsed (a one-line kv-cache-tester document, once)."""

from __future__ import annotations

import json
import os

import pytest

from prefixkv.errors import InvalidArgument
from prefixkv.sim.traces import (TraceFormatError, TraceRequest, detect_format, load_kvcache_tester,
                                 load_mooncake, load_token_trace, load_trace, write_token_trace)

BOM = b"\xef\xbb\xbf"


def _mooncake_text(rows) -> str:
    return "".join(json.dumps({"timestamp": ts, "input_length": n, "output_length": 1, "hash_ids": ids}) + "\n"
                   for ts, n, ids in rows)


def _conversation(n: int = 3, cid: str = "c1") -> dict:
    return {"id": cid, "block_size": 64, "requests": [{"t": float(i), "in": 64 * (i + 1), "out": 1,
                                                       "hash_ids": list(range(1, i + 2))} for i in range(n)]}


# -- detection parses a one-line kv-cache-tester document once ---------------------------------

def test_loading_a_one_line_kvcache_tester_file_parses_the_document_once(tmp_path, monkeypatch):
    path = tmp_path / "c1.json"
    text = json.dumps(_conversation(200))
    path.write_text(text)
    decoded = []
    real = json.JSONDecoder.raw_decode

    def counting(self, s, idx=0):
        obj, end = real(self, s, idx)
        decoded.append(end - idx)
        return obj, end

    monkeypatch.setattr(json.JSONDecoder, "raw_decode", counting)
    trace = load_trace(path)
    assert len(trace) == 200
    # detect_format read the whole first line (the whole document) as JSON, then the loader did again
    assert sum(decoded) < 1.5 * len(text), (sum(decoded), len(text))


@pytest.mark.parametrize("first, fmt", [
    ({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}, "mooncake"),
    ({"prefixkv_trace": 1, "block_size": 4}, "tokens"),
    ({"timestamp": 0, "tokens": [1, 2], "output_length": 1}, "tokens"),
    ({"id": "x", "block_size": 64, "requests": []}, "kvcache-tester"),
    ({"requests": [{"t": 0, "hash_ids": [1]}]}, "kvcache-tester"),
    ({"hash_ids": [1], "requests": []}, "mooncake"),     # as before: hash_ids decides first
])
def test_detect_format_still_reads_the_first_object(tmp_path, first, fmt):
    path = tmp_path / "t.jsonl"
    path.write_text(json.dumps(first) + "\n")
    assert detect_format(path) == fmt


def test_detect_format_names_the_line_it_could_not_recognise(tmp_path):
    path = tmp_path / "odd.jsonl"
    path.write_text('\n\n{"foo": 1}\n')
    with pytest.raises(TraceFormatError) as info:
        detect_format(path)
    assert info.value.line == 3 and str(info.value).startswith(f"{path}:3: unknown trace format")


# -- a UTF-8 byte-order mark reads the same in every loader -------------------------------------

def _files(tmp_path, bom: bytes) -> dict:
    out = tmp_path / ("bom" if bom else "plain")
    out.mkdir()
    mooncake = out / "m.jsonl"
    mooncake.write_bytes(bom + _mooncake_text([(0, 600, [1, 2]), (5, 1024, [1, 3])]).encode())
    tokens = out / "t.jsonl"
    tokens.write_bytes(bom + b'{"prefixkv_trace": 1, "block_size": 4}\n'
                             b'{"timestamp": 0, "tokens": [1, 2, 3, 4, 5], "output_length": 2}\n')
    bare = out / "bare.jsonl"
    bare.write_bytes(bom + b'{"timestamp": 0, "tokens": [1, 2, 3, 4, 5], "output_length": 2}\n')
    one_line = out / "c1.json"
    one_line.write_bytes(bom + json.dumps(_conversation()).encode())
    pretty = out / "c2.json"
    pretty.write_bytes(bom + json.dumps(_conversation(cid="c2"), indent=2).encode())
    return {"mooncake": mooncake, "tokens": tokens, "bare": bare, "one_line": one_line, "pretty": pretty}


def _shape(trace):
    return trace.format, trace.block_size, [(r.timestamp, r.input_length, r.output_length, r.block_hashes,
                                             r.tokens, r.session) for r in trace.requests]


@pytest.mark.parametrize("which, fmt", [("mooncake", "mooncake"), ("tokens", "tokens"), ("bare", "tokens"),
                                        ("one_line", "kvcache-tester"), ("pretty", "kvcache-tester")])
def test_a_byte_order_mark_is_read_past_by_every_loader(tmp_path, which, fmt):
    plain, marked = _files(tmp_path, b"")[which], _files(tmp_path, BOM)[which]
    assert detect_format(marked) == fmt
    expected = _shape(load_trace(plain))
    assert _shape(load_trace(marked)) == expected
    assert _shape(load_trace(marked, fmt)) == expected


def test_a_byte_order_mark_in_a_kvcache_tester_folder(tmp_path):
    files = _files(tmp_path, BOM)
    folder = tmp_path / "folder"
    folder.mkdir()
    for key in ("one_line", "pretty"):
        os.replace(files[key], folder / files[key].name)
    trace = load_kvcache_tester(folder)
    assert len(trace) == 6 and {r.session for r in trace.requests} == {"c1", "c2"}


def test_errors_after_a_byte_order_mark_keep_their_line_and_column(tmp_path):
    doc = _conversation()
    doc["requests"][0]["in"] = -1
    path = tmp_path / "c.json"
    path.write_bytes(BOM + json.dumps(doc).encode())
    plain = tmp_path / "p.json"
    plain.write_text(json.dumps(doc))
    with pytest.raises(TraceFormatError) as marked_info:
        load_trace(path)
    with pytest.raises(TraceFormatError) as plain_info:
        load_trace(plain)
    assert marked_info.value.problem == plain_info.value.problem and marked_info.value.line == 1


# -- write_token_trace ------------------------------------------------------------------------

def test_write_token_trace_refuses_block_hashes_it_would_drop(tmp_path):
    # A token trace stores token ids only: hashes given beside them (a request may carry either, not
    # both) were silently dropped, and read back as None.
    path = tmp_path / "t.jsonl"
    request = TraceRequest(0.0, 8, 1, block_hashes=[70, 71], tokens=list(range(8)), output_tokens=[9])
    with pytest.raises(InvalidArgument, match=r"requests: request 0 has both tokens and block_hashes"):
        write_token_trace(path, [request], block_size=4)
    assert list(tmp_path.iterdir()) == []


def test_write_token_trace_round_trips_every_field(tmp_path):
    requests = [TraceRequest(0.0, 5, 2, tokens=[1, 2, 3, 4, 5], output_tokens=[6, 7], salt="tenant",
                             session="s0", kind="chat", parent="p", stop="end_turn", api_time=0.5,
                             think_time=1.25, turn=0),
                TraceRequest(1.5, 3, 4, tokens=[1, 2, 3], salt=7, session="s0", turn=1)]
    path = write_token_trace(tmp_path / "t.jsonl", requests, block_size=4, name="rt", meta={"note": "x"})
    trace = load_token_trace(path)
    assert trace.requests == requests
    assert (trace.block_size, trace.name, trace.meta["note"]) == (4, "rt", "x")


@pytest.mark.parametrize("kwargs, argument", [
    (dict(block_size=0), "block_size"),
    (dict(block_size=2.5), "block_size"),
    (dict(block_size=True), "block_size"),
    (dict(meta={"block_size": -3}), "meta"),
    (dict(meta={"name": ["x"]}), "meta"),
    (dict(name=5), "name"),
    (dict(meta={"when": object()}), "meta"),
])
def test_write_token_trace_refuses_a_header_it_could_not_read_back(tmp_path, kwargs, argument):
    # block_size=0 (or a meta block_size of -3) was written, then refused by load_token_trace; a name
    # that is not a string was written and read back as the file's stem
    path = tmp_path / "t.jsonl"
    with pytest.raises(InvalidArgument) as info:
        write_token_trace(path, [TraceRequest(0.0, 1, 1, tokens=[1])], **kwargs)
    assert info.value.argument == argument
    assert list(tmp_path.iterdir()) == []


def test_write_token_trace_refuses_a_timestamp_that_is_not_a_number(tmp_path):
    # TypeError: '<' not supported between instances of 'NoneType' and 'float'
    with pytest.raises(InvalidArgument, match=r"^requests: request 1: field 'timestamp' is null"):
        write_token_trace(tmp_path / "t.jsonl", [TraceRequest(0.0, 1, 1, tokens=[1]), TraceRequest(None, 1, 1, tokens=[1])])
    assert list(tmp_path.iterdir()) == []


# -- bad arguments are InvalidArgument, naming the argument ------------------------------------

def test_invalid_argument_is_a_value_error():
    assert issubclass(InvalidArgument, ValueError)


@pytest.fixture
def sample(tmp_path):
    mooncake = tmp_path / "m.jsonl"
    mooncake.write_text(_mooncake_text([(0, 600, [1, 2])]))
    tokens = tmp_path / "t.jsonl"
    tokens.write_text('{"timestamp": 0, "tokens": [1], "output_length": 1}\n')
    conv = tmp_path / "c.json"
    conv.write_text(json.dumps(_conversation()))
    return mooncake, tokens, conv


@pytest.mark.parametrize("call, argument", [
    (lambda m, t, c: load_mooncake(m, 0), "block_size"),
    (lambda m, t, c: load_mooncake(m, 2.5), "block_size"),        # read as blocks of 2.5 tokens
    (lambda m, t, c: load_mooncake(m, "512"), "block_size"),      # TypeError: '<=' not supported
    (lambda m, t, c: load_trace(m, block_size=-1), "block_size"),
    (lambda m, t, c: load_token_trace(t, 0), "block_size"),
    (lambda m, t, c: load_token_trace(t, True), "block_size"),
    (lambda m, t, c: load_kvcache_tester(c, block_size=64.0), "block_size"),   # a trace of block size 64.0
    (lambda m, t, c: load_kvcache_tester(c, stagger=-1.0), "stagger"),
    (lambda m, t, c: load_kvcache_tester(c, stagger=None), "stagger"),    # TypeError: '<' not supported
    (lambda m, t, c: load_kvcache_tester([]), "paths"),
    (lambda m, t, c: load_kvcache_tester([c, c]), "paths"),
    (lambda m, t, c: load_trace(m, format="csv"), "format"),
    (lambda m, t, c: load_trace([c], format="mooncake"), "format"),
])
def test_bad_loader_arguments_are_named(sample, call, argument):
    with pytest.raises(InvalidArgument) as info:
        call(*sample)
    assert info.value.argument == argument and str(info.value).startswith(f"{argument}: ")


# -- numbers too large for a float ---------------------------------------------------------------

HUGE = "1" + "0" * 400


@pytest.mark.parametrize("fmt, text, field", [
    ("mooncake", '{"timestamp": %s, "input_length": 10, "output_length": 1, "hash_ids": [1]}\n' % HUGE, "timestamp"),
    ("tokens", '{"timestamp": %s, "tokens": [1], "output_length": 1}\n' % HUGE, "timestamp"),
    ("tokens", '{"timestamp": 0, "tokens": [1], "output_length": 1, "api_time": %s}\n' % HUGE, "api_time"),
    ("kvcache-tester", '{"id": "c", "block_size": 64, "requests": [{"t": %s, "in": 1, "out": 1, "hash_ids": []}]}'
     % HUGE, "t"),
    ("kvcache-tester", '{"id": "c", "block_size": 64, "requests": [{"t": 0, "in": 1, "out": 1, "hash_ids": [], '
                       '"think_time": %s}]}' % HUGE, "think_time"),
])
def test_a_number_too_large_for_a_float_is_a_format_error(tmp_path, fmt, text, field):
    # OverflowError: int too large to convert to float
    path = tmp_path / ("t.json" if fmt == "kvcache-tester" else "t.jsonl")
    path.write_text(text)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path, fmt)
    assert info.value.line == 1 and f"'{field}'" in info.value.problem


# -- a duplicate key in a pretty-printed kv-cache-tester document -------------------------------

def test_a_duplicate_key_is_reported_at_its_own_line(tmp_path):
    # The line was that of the key's second occurrence anywhere in the file: every request has a "t",
    # so a "t" given twice in requests[3] was reported at requests[1]'s line.
    text = json.dumps(_conversation(6), indent=1).replace('"t": 3.0,', '"t": 3.0,\n   "t": 3.5,')
    path = tmp_path / "dup.json"
    path.write_text(text)
    line = next(i for i, row in enumerate(text.splitlines(), 1) if "3.5" in row)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert info.value.line == line and "'t' appears twice" in info.value.problem
    assert "requests[3]" in info.value.problem


def test_a_duplicate_key_in_a_nested_sub_agent_is_found(tmp_path):
    doc = _conversation(2)
    doc["requests"].append({"t": 5.0, "agent_id": "a", "requests": [{"t": 0.0, "in": 64, "out": 1, "DUP": 0,
                                                                      "hash_ids": [9]}]})
    text = json.dumps(doc, indent=1).replace('"DUP": 0', '"in": 64')
    assert text.count('"in": 64') == 3
    path = tmp_path / "dup.json"
    path.write_text(text)
    lines = text.splitlines()
    line = max(i for i, row in enumerate(lines, 1) if '"in": 64' in row)
    with pytest.raises(TraceFormatError) as info:
        load_trace(path)
    assert info.value.line == line and "requests[2].requests[0]" in info.value.problem
