"""Request traces: loading, validating and writing.

A trace is a list of :class:`TraceRequest` in arrival order plus the block size
its block ids refer to (:class:`Trace`). Three formats load:

**Mooncake JSONL** (``load_mooncake``), FAST'25 traces of Moonshot AI's Kimi.
One JSON object per line::

    {"timestamp": 1200, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1, 2, ...]}

``timestamp`` is in milliseconds (converted to seconds here); ``hash_ids`` are
prefix-chained ids of 512-token blocks, one per block *including* the last,
partly filled one: ``len(hash_ids) == ceil(input_length / 512)``. The ids are
kept as they are (ints), partial-block id included; ``KVCacheManager.prompt_from_hashes``
accepts that shape. Mooncake has no session ids: ``infer_sessions`` gives each request
one from the hash chains (a request containing an earlier request's whole chain of full
blocks continues its session; ``turn`` counts the session's requests).

**kv-cache-tester JSON** (``load_kvcache_tester``), WEKA's agentic coding
sessions. One JSON document per conversation::

    {"id": "trace_0001", "block_size": 64, "hash_id_scope": "local",
     "requests": [{"t": 0.0, "type": "n", "in": 71175, "out": 169, "hash_ids": [1, 2, ...]},
                  {"t": 961.3, "type": "subagent", "agent_id": "agent_001",
                   "requests": [{"t": 0.0, "in": 8868, "out": 159, "hash_ids": [...]}, ...]},
                  ...]}

``t`` is in seconds from the start of the conversation; ``hash_ids`` cover the
*full* blocks only (``floor(in / block_size)``; ``ceil`` is accepted too). A
sub-agent entry (one with its own nested ``requests``) is not a request: its
nested requests are flattened into the trace, each at ``container.t + t`` (a
nested ``t`` counts from the sub-agent's start, as the tester replays it),
with ``session`` ``"<conversation>/<agent_id>"`` and ``parent`` the
conversation's session label. Each request keeps ``stop`` (why it ended:
``tool_use``, ``end_turn``, ``""``), ``api_time``, ``think_time`` and its
``turn`` (index among its session's requests); these are optional (null reads
as absent), but a wrong type or a negative time is refused. ``id`` and
``agent_id`` must be strings; without one, a conversation is labelled by its
file's stem and a sub-agent by its index. Every session label must be unique: two files with one ``id``, two sub-agents of a conversation with
one ``agent_id``, or one file given twice are refused, since their requests would
merge into one session.

Hash ids are local to a file (``"hash_id_scope": "local"``, the default): file
number ``k`` (in load order) maps id ``h`` to ``k * 2**40 + h``, so two files'
equal local ids never collide and the ids stay plain ints (fast dict keys).
Files with ``"hash_id_scope": "global"`` keep their ids (then a local first file,
whose namespace ``0`` they would share, takes ``len(files) * 2**40 + h``). Every conversation
starts at ``t = 0``: they run side by side, as concurrent users do, and the
flattened requests are merged by timestamp with a stable tie-break (file load
order, then order inside the file). ``stagger=s`` starts conversation ``k`` at
``k * s`` seconds instead. A directory loads every ``*.json`` in it, sorted by
name; all files must share one block size.

**prefixkv token JSONL** (``load_token_trace``, ``write_token_trace``): real
token ids, so a replay exercises the real hashing (``block_hashes`` is None).
An optional header object on the first line, then one request per line::

    {"prefixkv_trace": 1, "block_size": 16, "name": "default", ...}
    {"timestamp": 0.0, "tokens": [17, 4, ...], "output_tokens": [9, 311, ...],
     "salt": "tenant-3", "session": "t3/chat7", "kind": "chat"}

* ``timestamp`` (seconds, int or float, non-decreasing) and ``tokens`` (a list
  of ints in ``[0, 2**32)``) are required.
* ``output_tokens`` (list of token ids) or ``output_length`` (int >= 0): at
  least one; when both are given they must agree.
* ``salt`` (str or int), ``session``, ``kind``, ``parent``, ``stop`` (str),
  ``api_time``, ``think_time`` (seconds >= 0) and ``turn`` (int >= 0) are optional;
  ``salt`` isolates the request's blocks in the cache, as ``KVCacheManager.prompt(salt=...)``.
* The header's keys besides ``prefixkv_trace`` (the format version, 1) are
  free-form metadata; ``block_size`` is the block size a replay uses unless
  told otherwise (16 when absent), ``name`` names the trace.

Validation: every loader stops at the first problem with a
:class:`TraceFormatError` naming the file and line ("file:line: problem"):
bad JSON, a key given twice in one object, a missing field, a wrong type, a
negative length, a hash count that contradicts the length, a kv-cache-tester
entry with both ``hash_ids`` and nested ``requests``, or a timestamp earlier than the one before (traces
are never re-sorted silently; inside a kv-cache-tester conversation the check
is per level: a conversation's requests, and each sub-agent's).
For a JSON document the line is the line of the offending request, and the
message gives its JSON path (``requests[36].requests[1]``) and column, since
these documents are usually a single line.

A trace without a single request (an empty file, a token trace with only its
header, kv-cache-tester documents with empty ``requests``) is refused the same
way everywhere: ``TraceFormatError`` "no requests". A file that is not UTF-8
text is refused with its path and the line of the first undecodable byte.

A UTF-8 byte-order mark at the start of a file is read past, in every format.
Bad arguments (a block size that is not a positive int, a negative ``stagger``,
an unknown format) raise ``prefixkv.errors.InvalidArgument`` naming the argument.

``load_trace`` picks the format from the content: the first top-level key of the
first object that names one (``hash_ids``, ``tokens`` / ``prefixkv_trace``, ``requests``).
"""

from __future__ import annotations

import json
import math
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Hashable, Iterable, Iterator, Sequence

from ..errors import InvalidArgument, PrefixKVError
from ..hashing import repeated_hash

__all__ = [
    "TraceRequest", "Trace", "TraceFormatError", "load_trace", "load_mooncake", "load_kvcache_tester",
    "load_token_trace", "write_token_trace", "detect_format", "infer_sessions",
    "MOONCAKE_BLOCK_SIZE", "DEFAULT_TOKEN_BLOCK_SIZE", "NAMESPACE_BITS", "FORMATS",
]

MOONCAKE_BLOCK_SIZE = 512
DEFAULT_TOKEN_BLOCK_SIZE = 16
NAMESPACE_BITS = 40          # kv-cache-tester: file k's local id h becomes (k << 40) + h
TOKEN_FORMAT_VERSION = 1
FORMATS = ("mooncake", "kvcache-tester", "tokens")
_FORMAT_ALIASES = {"mooncake": "mooncake", "kvcache-tester": "kvcache-tester", "kv-cache-tester": "kvcache-tester",
                   "weka": "kvcache-tester", "tokens": "tokens", "prefixkv": "tokens"}
_INT = {int}
_MAX_TOKEN = 2**32
_MAX_LOCAL_ID = 2**NAMESPACE_BITS


class TraceFormatError(PrefixKVError, ValueError):
    """A trace file is malformed. ``path`` and ``line`` (1-based) say where."""

    def __init__(self, path: str | os.PathLike, line: int, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        super().__init__(f"{self.path}:{line}: {problem}")

    def __reduce__(self):  # picklable: compare's worker processes send it back to the parent
        return type(self), (self.path, self.line, self.problem)


@dataclass(slots=True)
class TraceRequest:
    """One request of a trace.

    Exactly one of ``block_hashes`` (precomputed prefix-chained block ids, for
    hashed traces) and ``tokens`` (real token ids, hashed by the manager) is set.
    """

    timestamp: float                        # arrival, seconds
    input_length: int                       # prompt tokens
    output_length: int                      # generated tokens
    block_hashes: list[Hashable] | None = None
    tokens: list[int] | None = None
    output_tokens: list[int] | None = None  # token traces: the generated ids, when known
    salt: str | int | None = None           # token traces: cache isolation key
    session: str | None = None              # conversation / session label
    kind: str | None = None                 # request type ("chat", "agent", Mooncake: None, WEKA: "n"/"s")
    parent: str | None = None               # sub-agent requests: the parent conversation's session label
    stop: str | None = None                 # why the request ended ("tool_use", "end_turn", ...), if known
    api_time: float | None = None           # seconds the request took (kv-cache-tester)
    think_time: float | None = None         # seconds between the session's previous response and this request
    turn: int | None = None                 # index of the request in its session (0 = first)


@dataclass(slots=True)
class Trace:
    """Requests in arrival order, and the block size their block ids refer to."""

    requests: list[TraceRequest]
    block_size: int
    name: str = ""
    path: str | None = None
    format: str = ""
    meta: dict = field(default_factory=dict)   # token traces: the header; kv-cache-tester: file names
    # True when a loader has checked every request's block ids (ints): a replay then uses them
    # as they are instead of checking each request again. Set it only on lists nobody changes.
    checked_hashes: bool = False
    # True when the trace's owner promises that its requests never change (a sweep worker's copy):
    # a replay may then keep what it derives from them, as it does for a ``checked_hashes`` trace.
    frozen: bool = False
    # The trace as ``blockarrays.BlockArrays`` once a replay converted it (kept only where
    # ``checked_hashes`` or ``frozen`` says its lists never change; keyed by hash seed for token traces).
    block_arrays_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.requests)

    def __iter__(self) -> Iterator[TraceRequest]:
        return iter(self.requests)

    @property
    def has_tokens(self) -> bool:
        return any(r.tokens is not None for r in self.requests)

    def num_block_accesses(self, include_partial: bool = True) -> int:
        """Block references: one per block id of every request.

        A hashed trace's every id counts (``include_partial=False`` drops a
        Mooncake request's last, partly filled block); a token trace counts
        its full blocks (a partial block has no hash). This is what
        ``prefixkv.sim.replay`` counts as block accesses.
        """
        size = self.block_size
        total = 0
        for r in self.requests:
            if r.block_hashes is not None:
                total += len(r.block_hashes) if include_partial else min(len(r.block_hashes), r.input_length // size)
            else:
                total += r.input_length // size
        return total

    def distinct_blocks(self, include_partial: bool = True) -> int:
        """Distinct blocks referenced (the working set a cache would need to never miss twice).

        Token traces are hashed with a fixed seed (salt included), as a replay would.
        """
        seen: set = set()
        size = self.block_size
        hasher = None
        for r in self.requests:
            if r.block_hashes is not None:
                seen.update(r.block_hashes if include_partial else r.block_hashes[:r.input_length // size])
            elif r.tokens is not None:
                if hasher is None:
                    from ..hashing import BlockHasher
                    hasher = BlockHasher(size, seed=0)
                seen.update(_token_hashes(hasher, r))
        return len(seen)

    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    def output_tokens(self) -> int:
        return sum(r.output_length for r in self.requests)

    @property
    def duration(self) -> float:
        """Seconds from the first arrival to the last."""
        return self.requests[-1].timestamp - self.requests[0].timestamp if self.requests else 0.0

    def summary(self) -> dict:
        """Counts for reports: requests, block accesses, distinct blocks, tokens, duration."""
        return dict(name=self.name, format=self.format, block_size=self.block_size, requests=len(self),
                    block_accesses=self.num_block_accesses(), distinct_blocks=self.distinct_blocks(),
                    input_tokens=self.input_tokens(), output_tokens=self.output_tokens(),
                    duration_s=self.duration)


def _token_hashes(hasher, r: TraceRequest) -> list:
    from ..hashing import NO_EXTRA_KEYS, ExtraKeys, encode_tokens
    extra = NO_EXTRA_KEYS if r.salt is None else ExtraKeys(salt=r.salt)
    tokens = encode_tokens(r.tokens)
    return hasher.hash_blocks(tokens, 0, len(tokens) // hasher.block_size, None, extra)


# -- small validation helpers -------------------------------------------------

_FLOAT_MAX = 1.7976931348623157e308


def _is_number(x) -> bool:
    """A finite int or float. An int beyond a float's range is not one: JSON reads 1e400 written out
    in digits as an int, and converting it to the float a time is stored as raised OverflowError."""
    if type(x) is float:
        return math.isfinite(x)
    return type(x) is int and -_FLOAT_MAX <= x <= _FLOAT_MAX


def _block_size_argument(block_size) -> int:
    """A block size argument as an int: a numpy integer is taken (the loaders took one before this
    was checked), a float, a bool or a string refused."""
    # (a numpy bool is no numbers.Integral)
    if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral) or block_size <= 0:
        raise InvalidArgument("block_size", f"must be a positive integer (tokens per block), got {_short(block_size)}")
    return int(block_size)


def _type_name(x) -> str:
    return "null" if x is None else {dict: "object", list: "array", str: "string", bool: "boolean",
                                     int: "integer", float: "number"}.get(type(x), type(x).__name__)


def _bad_int_list(values: list, lo: int | None = None, hi: int | None = None) -> str | None:
    """A problem description if ``values`` is not a list of ints within [lo, hi), else None."""
    if {*map(type, values)} - _INT:
        i, bad = next((i, v) for i, v in enumerate(values) if type(v) is not int)
        return f"element {i} is {_type_name(bad)} {bad!r}, expected an integer"
    if values and lo is not None and min(values) < lo:
        i = next(i for i, v in enumerate(values) if v < lo)
        return f"element {i} ({values[i]}) is below {lo}"
    if values and hi is not None and max(values) >= hi:
        i = next(i for i, v in enumerate(values) if v >= hi)
        return f"element {i} ({values[i]}) is not below {hi}"
    return None


def _blocks_problem(n_hashes: int, n_tokens: int, block_size: int, allowed: str) -> str | None:
    full, partial = divmod(n_tokens, block_size)
    ceil = full + (1 if partial else 0)
    ok = {"ceil": (ceil,), "floor": (full,), "either": (full, ceil)}[allowed]
    if n_hashes in ok:
        return None
    expect = " or ".join(str(x) for x in sorted(set(ok)))
    return (f"{n_hashes} hash id(s) contradict {n_tokens} input tokens at block size {block_size} "
            f"(expected {expect})")


def _json_error(path, exc: json.JSONDecodeError, line: int | None = None) -> TraceFormatError:
    return TraceFormatError(path, exc.lineno if line is None else line,
                            f"bad JSON: {exc.msg} (column {exc.colno})")


_BOM = "\ufeff"


def _read_text(path: Path) -> str:
    """A whole file as UTF-8 text, without a leading byte-order mark (a JSONL loader reads past one,
    as json.loads does for bytes; a JSON document must too); a binary file is a TraceFormatError at
    its first bad byte's line."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8").removeprefix(_BOM)
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise TraceFormatError(path, line, f"not UTF-8 text (byte 0x{data[exc.start]:02x} at offset {exc.start}): "
                                           "is this a trace file?") from None


def _iter_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                yield lineno, raw


class _DuplicateKey(Exception):
    """Internal: a JSON object names ``key`` twice."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list) -> dict:
    """``object_pairs_hook``: a JSON reader keeps the last of two equal keys, silently dropping the
    first value (a request's hash ids, a conversation's requests); a trace names each key once."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return obj


def _duplicate_key_problem(key: str) -> str:
    return f"key {key!r} appears twice in one object: which of its values is meant is unknown"


def _loads_line(path: Path, lineno: int, raw: bytes):
    try:
        obj = json.loads(raw, object_pairs_hook=_unique_keys)
    except _DuplicateKey as exc:
        raise TraceFormatError(path, lineno, _duplicate_key_problem(exc.key)) from None
    except UnicodeDecodeError as exc:
        raise TraceFormatError(path, lineno, f"not UTF-8 text ({exc.reason}): is this a trace file?") from None
    except json.JSONDecodeError as exc:
        raise _json_error(path, exc, lineno) from None
    if type(obj) is not dict:
        raise TraceFormatError(path, lineno, f"expected a JSON object, got {_type_name(obj)}")
    return obj


# -- Mooncake ---------------------------------------------------------------------

def load_mooncake(path: str | os.PathLike, block_size: int = MOONCAKE_BLOCK_SIZE, *,
                  name: str | None = None) -> Trace:
    """Load a Mooncake JSONL trace (timestamps in ms become seconds). See the module doc."""
    block_size = _block_size_argument(block_size)
    path = Path(path)
    requests: list[TraceRequest] = []
    append = requests.append
    setdefault = {}.setdefault
    last_ts = -math.inf
    for lineno, raw in _iter_lines(path):
        obj = _loads_line(path, lineno, raw)
        try:
            ts = obj["timestamp"]
            n = obj["input_length"]
            out = obj["output_length"]
            ids = obj["hash_ids"]
        except KeyError as exc:
            raise TraceFormatError(path, lineno, f"missing field {exc.args[0]!r}") from None
        if not _is_number(ts) or type(n) is not int or type(out) is not int or type(ids) is not list:
            for key, want, ok in (("timestamp", "a finite number (ms)", _is_number(ts)),
                                  ("input_length", "an integer", type(n) is int),
                                  ("output_length", "an integer", type(out) is int),
                                  ("hash_ids", "an array of integers", type(ids) is list)):
                if not ok:
                    value = obj[key]
                    raise TraceFormatError(path, lineno, f"field {key!r} is {_type_name(value)} "
                                                         f"{_short(value)}, expected {want}")
        if n < 0 or out < 0:
            key = "input_length" if n < 0 else "output_length"
            raise TraceFormatError(path, lineno, f"field {key!r} is negative ({obj[key]})")
        problem = _blocks_problem(len(ids), n, block_size, "ceil")
        if problem is None:
            problem = _bad_int_list(ids) or repeated_hash(ids)
            if problem is not None:
                problem = f"field 'hash_ids': {problem}"
        if problem is not None:
            raise TraceFormatError(path, lineno, problem)
        if ts < last_ts:
            raise TraceFormatError(path, lineno, f"timestamp {ts} ms is earlier than the previous "
                                                 f"request's {last_ts} ms (timestamps must not decrease)")
        last_ts = ts
        # one int object per distinct id: a conversation's turns repeat its prefix's ids
        append(TraceRequest(ts / 1000.0, n, out, list(map(setdefault, ids, ids))))
    if not requests:
        raise TraceFormatError(path, 1, "no requests: the file holds no request lines")
    infer_sessions(requests, block_size)
    return Trace(requests, block_size, name if name is not None else path.stem, str(path), "mooncake",
                 checked_hashes=True)


def infer_sessions(requests: Sequence[TraceRequest], block_size: int) -> None:
    """Give hashed requests without a session one, from their hash chains (Mooncake).

    A request whose chain contains an earlier request's whole chain of full blocks
    (that request's last full block id at the same position: ids are prefix hashes)
    continues that request's session; the longest such earlier chain wins. Its
    ``turn`` is its index among the session's requests (a session that goes back to
    an earlier turn's prompt, a retry or an edited message, still counts on). A
    block that two sessions have used (a shared system prompt) ends no session: a
    request made of the shared prompt alone would otherwise adopt every later
    conversation. Otherwise the request starts session ``"s<k>"`` at
    turn 0. Only the past is used, so it is what a server could infer online.
    Requests that already have a session, or have token ids, are left as they are.
    """
    ends: dict = {}          # last full block id of a request -> its session
    owner: dict = {}         # block id -> the one session that used it, or _SHARED
    turns: dict = {}         # session -> requests it has had
    fresh = 0
    for r in requests:
        ids = r.block_hashes
        if ids is None or r.session is not None:
            continue
        full = min(len(ids), r.input_length // block_size)
        found = None
        for k in range(full - 1, -1, -1):
            found = ends.get(ids[k])
            if found is not None and owner.get(ids[k]) is not _SHARED:
                break
            found = None
        if found is None:
            found = f"s{fresh}"
            fresh += 1
        session = r.session = found
        r.turn = turns.get(session, 0)
        turns[session] = r.turn + 1
        for h in ids:
            seen = owner.setdefault(h, session)
            if seen is not session and seen != session:
                owner[h] = _SHARED
        if full:
            ends[ids[full - 1]] = session


_SHARED = object()


def _short(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


# -- kv-cache-tester ---------------------------------------------------------------

class _Problem(Exception):
    """Internal: a problem at a JSON path inside one document."""

    def __init__(self, jpath: tuple, message: str) -> None:
        super().__init__(message)
        self.jpath = jpath
        self.message = message


def _expand_paths(paths) -> list[Path]:
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = sorted(p.glob("*.json"))
            if not found:
                raise FileNotFoundError(f"{p}: no *.json trace files in this directory")
            files.extend(found)
        else:
            files.append(p)
    if not files:
        raise InvalidArgument("paths", "no trace files given")
    seen: dict[Path, Path] = {}
    for p in files:
        first = seen.setdefault(p.resolve(), p)
        if first is not p:
            raise InvalidArgument("paths", f"{p}: the same trace file is given twice ({first}): its "
                                           "conversation would be replayed twice, as two users")
    return files


def load_kvcache_tester(paths: str | os.PathLike | Iterable[str | os.PathLike], *,
                        block_size: int | None = None, stagger: float = 0.0,
                        name: str | None = None) -> Trace:
    """Load kv-cache-tester conversations (files, or directories of ``*.json``). See the module doc.

    ``block_size``, when given, must equal the files' own. ``stagger`` offsets
    conversation ``k`` (in load order) by ``k * stagger`` seconds.
    """
    if not _is_number(stagger) or stagger < 0:
        raise InvalidArgument("stagger", f"must be a finite number of seconds >= 0, got {_short(stagger)}")
    if block_size is not None:
        block_size = _block_size_argument(block_size)
    files = _expand_paths(paths)
    requests: list[TraceRequest] = []
    file_block_size: int | None = block_size
    origin = "the caller asked for it"
    first_local: list[TraceRequest] = []
    any_global = False
    owners: dict[str, Path] = {}     # session label -> the file it comes from
    for index, path in enumerate(files):
        text = _read_text(path)
        try:
            doc = json.loads(text, object_pairs_hook=_unique_keys)
        except json.JSONDecodeError as exc:
            raise _json_error(path, exc) from None
        except _DuplicateKey as exc:
            raise _duplicate_key_error(path, text, exc.key) from None
        try:
            size, reqs, scope, labels = _conversation(doc, index, index * stagger, path.stem)
        except _Problem as problem:
            line, col = _position(text, problem.jpath)
            where = _jpath_text(problem.jpath)
            raise TraceFormatError(path, line, f"{where + ': ' if where else ''}{problem.message}"
                                               f"{f' (column {col})' if where else ''}") from None
        if file_block_size is None:
            file_block_size, origin = size, f"{path.name} has it"
        elif size != file_block_size:
            raise TraceFormatError(path, _position(text, ("block_size",))[0],
                                   f"block_size {size} differs from {file_block_size} ({origin})")
        for label, jpath in labels.items():
            # Two files with one conversation id: their requests would form one session.
            if label in owners:
                raise TraceFormatError(path, _position(text, jpath or ("id",))[0],
                                       f"session {label!r} is also a session of {owners[label]}: two "
                                       "conversations would merge into one (conversation ids must differ)")
            owners[label] = path
        requests.extend(reqs)
        if index == 0 and scope == "local":
            first_local = reqs
        elif scope == "global":
            any_global = True
    if first_local and any_global:
        # file 0's namespace (0 << 40) is the global ids' own: move its local ids to one no file uses
        base = len(files) << NAMESPACE_BITS
        canon: dict = {}
        for r in first_local:
            r.block_hashes = [canon.setdefault(h, base + h) for h in r.block_hashes]
    if not requests:
        where = files[0] if len(files) == 1 else files[0].parent
        raise TraceFormatError(where, 1, "no requests: every conversation's \"requests\" list is empty")
    requests.sort(key=_timestamp_key)   # stable: ties keep file order, then order inside the file
    if name is None:
        name = files[0].parent.name if len(files) > 1 else files[0].stem
    return Trace(requests, file_block_size, name, str(files[0].parent if len(files) > 1 else files[0]),
                 "kvcache-tester", {"files": [str(p) for p in files]}, checked_hashes=True)


def _timestamp_key(r: TraceRequest) -> float:
    return r.timestamp


def _conversation(doc, index: int, offset: float, stem: str) -> tuple[int, list[TraceRequest], str, dict]:
    if type(doc) is not dict:
        raise _Problem((), f"expected a JSON object (one conversation), got {_type_name(doc)}")
    if "requests" not in doc:
        raise _Problem((), "missing field 'requests'")
    if "block_size" not in doc:
        raise _Problem((), "missing field 'block_size'")
    size = doc["block_size"]
    if type(size) is not int or size <= 0:
        raise _Problem(("block_size",), f"block_size must be a positive integer, got {_short(size)}")
    scope = doc.get("hash_id_scope", "local")
    if scope not in ("local", "global"):
        raise _Problem(("hash_id_scope",), f"hash_id_scope must be 'local' or 'global', got {_short(scope)}")
    base = 0 if scope == "global" else index << NAMESPACE_BITS
    session = doc.get("id")
    if session is not None and type(session) is not str:
        raise _Problem(("id",), f"field 'id' is {_type_name(session)} {_short(session)}, expected a string "
                                "(the conversation's session label)")
    session = stem if session is None else session
    out: list[TraceRequest] = []
    labels = {session: ()}                # session label -> JSON path of the entry that opened it
    _walk(doc["requests"], ("requests",), size, base, offset, session, None, out, labels, {})
    return size, out, scope, labels


def _walk(reqs, jpath: tuple, size: int, base: int, offset: float, session: str, parent: str | None,
          out: list[TraceRequest], labels: dict, canon: dict) -> None:
    if type(reqs) is not list:
        raise _Problem(jpath, f"'requests' must be an array, got {_type_name(reqs)}")
    last_t = -math.inf
    turn = 0
    for i, r in enumerate(reqs):
        here = jpath + (i,)
        if type(r) is not dict:
            raise _Problem(here, f"expected a request object, got {_type_name(r)}")
        if "t" not in r:
            raise _Problem(here, "missing field 't'")
        t = r["t"]
        if not _is_number(t):
            raise _Problem(here, f"field 't' is {_type_name(t)} {_short(t)}, expected a finite number (s)")
        if t < last_t:
            raise _Problem(here, f"t {t} s is earlier than the previous request's {last_t} s "
                                 "(timestamps must not decrease)")
        last_t = t
        if "requests" in r and "hash_ids" in r:
            raise _Problem(here, "has both 'hash_ids' (a request) and nested 'requests' (a sub-agent); "
                                 "an entry is one or the other")
        if "requests" in r:                                  # a sub-agent: flatten its requests
            agent = r.get("agent_id")
            if agent is not None and type(agent) is not str:
                raise _Problem(here, f"field 'agent_id' is {_type_name(agent)} {_short(agent)}, expected a string "
                                     "(the sub-agent's session label)")
            label = f"{session}/{i if agent is None else agent}"
            if label in labels:
                raise _Problem(here, f"sub-agent session {label!r} is already the session of "
                                     f"{_jpath_text(labels[label]) or 'the conversation'}: two sessions "
                                     "would merge into one (agent ids must differ within a conversation)")
            labels[label] = here
            _walk(r["requests"], here + ("requests",), size, base, offset + t, label, session, out, labels, canon)
            continue
        for key in ("in", "out", "hash_ids"):
            if key not in r:
                raise _Problem(here, f"missing field {key!r}")
        n, m, ids = r["in"], r["out"], r["hash_ids"]
        for key, value in (("in", n), ("out", m)):
            if type(value) is not int:
                raise _Problem(here, f"field {key!r} is {_type_name(value)} {_short(value)}, expected an integer")
            if value < 0:
                raise _Problem(here, f"field {key!r} is negative ({value})")
        if type(ids) is not list:
            raise _Problem(here, f"field 'hash_ids' is {_type_name(ids)}, expected an array of integers")
        problem = _blocks_problem(len(ids), n, size, "either")
        if problem is None:
            problem = _bad_int_list(ids, 0, _MAX_LOCAL_ID) or repeated_hash(ids)
            if problem is not None:
                problem = f"field 'hash_ids': {problem}"
        if problem is not None:
            raise _Problem(here, problem)
        # Optional metadata (null reads as absent): a wrong type or a negative time is refused, as
        # in a token trace, rather than silently read as unknown.
        kind, stop = r.get("type"), r.get("stop")
        for key, value in (("type", kind), ("stop", stop)):
            if value is not None and type(value) is not str:
                raise _Problem(here, f"field {key!r} is {_type_name(value)} {_short(value)}, expected a string")
        api_time, think_time = r.get("api_time"), r.get("think_time")
        for key, value in (("api_time", api_time), ("think_time", think_time)):
            if value is not None and (not _is_number(value) or value < 0):
                raise _Problem(here, f"field {key!r} is {_type_name(value)} {_short(value)}, expected a number "
                                     "of seconds >= 0")
        # One int object per distinct id (``canon``): every turn resends its session's prefix, and
        # an int apiece for each reference took five times the memory of the lists themselves.
        setdefault = canon.setdefault
        ids = [setdefault(h, base + h) for h in ids] if base else list(map(setdefault, ids, ids))
        out.append(TraceRequest(offset + t, n, m, ids,
                                session=session, kind=kind, parent=parent, stop=stop,
                                api_time=None if api_time is None else float(api_time),
                                think_time=None if think_time is None else float(think_time),
                                turn=turn))
        turn += 1


class _Repeated(Exception):
    """Internal: the key at offset ``pos`` of the object at ``jpath`` repeats an earlier key."""

    def __init__(self, jpath: tuple, pos: int, key: str) -> None:
        super().__init__(key)
        self.jpath, self.pos, self.key = jpath, pos, key


def _duplicate_key_error(path: Path, text: str, key: str) -> TraceFormatError:
    """The error for a document that names a key twice in one object, at that key's second
    occurrence (not the key's second occurrence anywhere: every request has a "t")."""
    checked = json.JSONDecoder(object_pairs_hook=_unique_keys).raw_decode
    plain = json.JSONDecoder().raw_decode
    scan = json.decoder.scanstring

    def value(p: int, jpath: tuple) -> int:
        try:
            return checked(text, p)[1]       # nothing repeats inside: skipped at the C decoder's speed
        except _DuplicateKey:
            return walk(p, jpath)

    def walk(p: int, jpath: tuple) -> int:
        if text[p] == "{":
            seen: set = set()
            p = _skip_ws(text, p + 1)
            while text[p] != "}":
                start = p
                name, p = scan(text, p + 1)
                if name in seen:
                    raise _Repeated(jpath, start, name)
                seen.add(name)
                p = _skip_ws(text, value(_skip_ws(text, _skip_ws(text, p) + 1), jpath + (name,)))
                if text[p] == ",":
                    p = _skip_ws(text, p + 1)
            return p + 1
        if text[p] == "[":
            p = _skip_ws(text, p + 1)
            i = 0
            while text[p] != "]":
                p = _skip_ws(text, value(p, jpath + (i,)))
                i += 1
                if text[p] == ",":
                    p = _skip_ws(text, p + 1)
            return p + 1
        return plain(text, p)[1]

    try:
        walk(_skip_ws(text, 0), ())
    except _Repeated as found:
        line = text.count("\n", 0, found.pos) + 1
        column = found.pos - (text.rfind("\n", 0, found.pos) + 1) + 1
        where = _jpath_text(found.jpath)
        return TraceFormatError(path, line, f"{where + ': ' if where else ''}{_duplicate_key_problem(found.key)} "
                                            f"(column {column})")
    except (IndexError, ValueError):
        pass
    return TraceFormatError(path, 1, _duplicate_key_problem(key))


def _jpath_text(jpath: tuple) -> str:
    text = ""
    for step in jpath:
        text += f"[{step}]" if isinstance(step, int) else (f".{step}" if text else step)
    return text


_WS = " \t\n\r"


def _skip_ws(text: str, p: int) -> int:
    """The first position at or after ``p`` that is not JSON whitespace (``len(text)`` at the end)."""
    n = len(text)
    while p < n and text[p] in _WS:
        p += 1
    return p


def _position(text: str, jpath: tuple) -> tuple[int, int]:
    """(line, column), 1-based, of the value at ``jpath`` in a JSON document; best effort."""
    pos = _locate(text, jpath)
    line = text.count("\n", 0, pos) + 1
    return line, pos - (text.rfind("\n", 0, pos) + 1) + 1


def _locate(text: str, jpath: tuple) -> int:
    decode = json.JSONDecoder().raw_decode
    pos = _skip_ws(text, 0)
    try:
        for step in jpath:
            if isinstance(step, int):
                if text[pos] != "[":
                    return pos
                p = _skip_ws(text, pos + 1)
                for _ in range(step):
                    if text[p] == "]":
                        return pos
                    _, p = decode(text, p)
                    p = _skip_ws(text, p)
                    if text[p] == ",":
                        p = _skip_ws(text, p + 1)
                if text[p] == "]":
                    return pos
                pos = p
            else:
                if text[pos] != "{":
                    return pos
                p = _skip_ws(text, pos + 1)
                while True:
                    if text[p] == "}":
                        return pos
                    key, p = decode(text, p)
                    p = _skip_ws(text, p)
                    p = _skip_ws(text, p + 1)          # the ':'
                    if key == step:
                        break
                    _, p = decode(text, p)
                    p = _skip_ws(text, p)
                    if text[p] == ",":
                        p = _skip_ws(text, p + 1)
                pos = p
    except (IndexError, ValueError):
        pass
    return pos


# -- prefixkv token traces ------------------------------------------------------------

def load_token_trace(path: str | os.PathLike, block_size: int | None = None, *,
                     name: str | None = None) -> Trace:
    """Load a prefixkv token JSONL trace. ``block_size`` overrides the header's (default 16)."""
    if block_size is not None:
        block_size = _block_size_argument(block_size)
    path = Path(path)
    header: dict = {}
    requests: list[TraceRequest] = []
    append = requests.append
    setdefault = {}.setdefault
    last_ts = -math.inf
    first = True
    for lineno, raw in _iter_lines(path):
        obj = _loads_line(path, lineno, raw)
        if first and "prefixkv_trace" in obj:
            first = False
            version = obj["prefixkv_trace"]
            if version != TOKEN_FORMAT_VERSION or type(version) is not int:
                raise TraceFormatError(path, lineno, f"unsupported prefixkv_trace version {_short(version)} "
                                                     f"(this prefixkv reads {TOKEN_FORMAT_VERSION})")
            problem = _header_problem(obj)
            if problem is not None:
                raise TraceFormatError(path, lineno, problem)
            header = obj
            continue
        first = False
        try:
            append(_token_request(obj, last_ts, setdefault))
        except _Problem as problem:
            raise TraceFormatError(path, lineno, problem.message) from None
        last_ts = requests[-1].timestamp
    if not requests:
        raise TraceFormatError(path, 1, "no requests: the file holds a header but no request lines"
                               if header else "no requests: the file holds no request lines")
    size = block_size if block_size is not None else header.get("block_size") or DEFAULT_TOKEN_BLOCK_SIZE
    if name is None:
        name = header.get("name") if isinstance(header.get("name"), str) else path.stem
    return Trace(requests, size, name, str(path), "tokens", header)


def _header_problem(header: dict) -> str | None:
    """What ``load_token_trace`` refuses in a header (``prefixkv_trace`` is checked by the caller)."""
    size = header.get("block_size")
    if size is not None and (type(size) is not int or size <= 0):
        return f"header block_size must be a positive integer, got {_short(size)}"
    return None


def _token_request(obj: dict, last_ts: float, setdefault=None) -> TraceRequest:
    """One request line; ``setdefault``, a dict's, holds one int object per distinct token id (a
    session's turns resend its prefix: an int apiece took four times the memory of the lists)."""
    for key in ("timestamp", "tokens"):
        if key not in obj:
            raise _Problem((), f"missing field {key!r}")
    ts, tokens = obj["timestamp"], obj["tokens"]
    if not _is_number(ts):
        raise _Problem((), f"field 'timestamp' is {_type_name(ts)} {_short(ts)}, expected a finite number (s)")
    if type(tokens) is not list:
        raise _Problem((), f"field 'tokens' is {_type_name(tokens)}, expected an array of token ids")
    problem = _bad_int_list(tokens, 0, _MAX_TOKEN)
    if problem is not None:
        raise _Problem((), f"field 'tokens': {problem}")
    out_tokens = obj.get("output_tokens")
    out_len = obj.get("output_length")
    if out_tokens is None and out_len is None:
        raise _Problem((), "missing field 'output_tokens' or 'output_length' (one is required)")
    if out_tokens is not None:
        if type(out_tokens) is not list:
            raise _Problem((), f"field 'output_tokens' is {_type_name(out_tokens)}, expected an array of token ids")
        problem = _bad_int_list(out_tokens, 0, _MAX_TOKEN)
        if problem is not None:
            raise _Problem((), f"field 'output_tokens': {problem}")
    if out_len is not None:
        if type(out_len) is not int:
            raise _Problem((), f"field 'output_length' is {_type_name(out_len)} {_short(out_len)}, expected an integer")
        if out_len < 0:
            raise _Problem((), f"field 'output_length' is negative ({out_len})")
        if out_tokens is not None and out_len != len(out_tokens):
            raise _Problem((), f"output_length {out_len} contradicts the {len(out_tokens)} output_tokens")
    else:
        out_len = len(out_tokens)
    salt = obj.get("salt")
    if salt is not None and type(salt) not in (str, int):
        raise _Problem((), f"field 'salt' is {_type_name(salt)}, expected a string or an integer")
    labels = {}
    for key in ("session", "kind", "parent"):
        value = obj.get(key)
        if value is not None and type(value) is not str:
            raise _Problem((), f"field {key!r} is {_type_name(value)}, expected a string")
        labels[key] = value
    stop = obj.get("stop")
    if stop is not None and type(stop) is not str:
        raise _Problem((), f"field 'stop' is {_type_name(stop)}, expected a string")
    times = {}
    for key in ("api_time", "think_time"):
        value = obj.get(key)
        if value is not None and (not _is_number(value) or value < 0):
            raise _Problem((), f"field {key!r} is {_type_name(value)} {_short(value)}, expected a number of "
                               "seconds >= 0")
        times[key] = None if value is None else float(value)
    turn = obj.get("turn")
    if turn is not None and (type(turn) is not int or turn < 0):
        raise _Problem((), f"field 'turn' is {_type_name(turn)} {_short(turn)}, expected an integer >= 0")
    if ts < last_ts:
        raise _Problem((), f"timestamp {ts} s is earlier than the previous request's {last_ts} s "
                           "(timestamps must not decrease)")
    if setdefault is not None:
        tokens = list(map(setdefault, tokens, tokens))
        if out_tokens is not None:
            out_tokens = list(map(setdefault, out_tokens, out_tokens))
    return TraceRequest(float(ts), len(tokens), out_len, None, tokens, out_tokens, salt, **labels, stop=stop,
                        turn=turn, **times)


def write_token_trace(path: str | os.PathLike, requests: Iterable[TraceRequest], *,
                      block_size: int | None = None, name: str | None = None,
                      meta: dict | None = None) -> Path:
    """Write requests (with ``tokens``) as a prefixkv token JSONL trace; returns the path.

    The header records ``block_size``, ``name`` and ``meta`` (JSON-serialisable;
    its keys do not override the arguments). The output is a pure function of the
    arguments (byte-identical reruns). The file is written next to its final name and
    renamed into place, so a reader never sees half a trace. What would not read back
    the same is refused (``InvalidArgument``), nothing written: a bad header, a request
    that ``load_token_trace`` would refuse, or one with ``block_hashes`` beside its
    tokens (the format stores token ids only).
    """
    path = Path(path)
    header: dict = {"prefixkv_trace": TOKEN_FORMAT_VERSION}
    if block_size is not None:
        header["block_size"] = _block_size_argument(block_size)
    if name is not None:
        if type(name) is not str:
            # load_token_trace ignores a name that is not a string (the trace takes the file's stem)
            raise InvalidArgument("name", f"must be a string, got {_type_name(name)} {_short(name)}")
        header["name"] = name
    if meta:
        header.update((k, v) for k, v in meta.items() if k not in header)
    dumps = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
    problem = _header_problem(header)
    if problem is None and "name" in header and type(header["name"]) is not str:
        problem = f"header name must be a string, got {_type_name(header['name'])} {_short(header['name'])}"
    if problem is None:
        try:
            head = dumps(header)
        except (TypeError, ValueError) as exc:
            problem = f"the header is not JSON: {exc}"
    if problem is not None:
        raise InvalidArgument("meta", problem)
    parent = path.parent
    if not parent.is_dir():
        raise FileNotFoundError(f"cannot write {path}: directory {parent} does not exist")
    if path.is_dir():
        raise IsADirectoryError(f"cannot write {path}: it is a directory")
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    last_ts = -math.inf
    try:
        with open(tmp, "w", encoding="utf-8", newline="\n") as f:
            f.write(head + "\n")
            for i, r in enumerate(requests):
                if r.tokens is None:
                    raise InvalidArgument("requests", f"request {i} has no token ids; a token trace needs them")
                if r.block_hashes is not None:
                    # The file keeps token ids only; the loader reads block_hashes back as None.
                    raise InvalidArgument("requests", f"request {i} has both tokens and block_hashes: a token "
                                                      "trace stores the token ids only (a replay hashes them), "
                                                      "so its block_hashes would be lost; set them to None")
                obj: dict = {"timestamp": r.timestamp}
                for key in ("session", "kind", "parent", "salt", "stop", "api_time", "think_time", "turn"):
                    value = getattr(r, key)
                    if value is not None:
                        obj[key] = value
                obj["tokens"] = list(r.tokens)
                if r.output_tokens is not None:
                    obj["output_tokens"] = list(r.output_tokens)
                else:
                    obj["output_length"] = r.output_length
                # What load_token_trace would refuse, or read back with other lengths, is refused here.
                try:
                    _token_request(obj, last_ts)
                except _Problem as problem:
                    raise InvalidArgument("requests", f"request {i}: {problem.message}") from None
                last_ts = r.timestamp
                if r.input_length != len(obj["tokens"]):
                    raise InvalidArgument("requests", f"request {i}: input_length {r.input_length} contradicts "
                                                      f"its {len(obj['tokens'])} tokens")
                if r.output_tokens is not None and r.output_length != len(obj["output_tokens"]):
                    raise InvalidArgument("requests", f"request {i}: output_length {r.output_length} contradicts "
                                                      f"its {len(obj['output_tokens'])} output_tokens")
                f.write(dumps(obj) + "\n")
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


# -- detection ------------------------------------------------------------------------

def detect_format(path: str | os.PathLike) -> str:
    """'mooncake', 'kvcache-tester' or 'tokens', from the content (a directory: kvcache-tester)."""
    path = Path(path)
    if path.is_dir():
        return "kvcache-tester"
    head, lineno = "", 1
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, 1):
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                _read_text(path)   # raises, naming the line of the first byte that is not UTF-8
            if lineno == 1:
                text = text.removeprefix(_BOM)
            if text.strip():
                head = text
                break
    if not head:
        raise TraceFormatError(path, 1, "empty file: no requests")
    fmt = _head_format(head)
    if fmt is _UNREADABLE:
        try:
            obj = json.loads(head)
        except json.JSONDecodeError:
            obj = None      # a pretty-printed (multi-line) document
        if path.suffix == ".json" or obj is None:
            return "kvcache-tester"
    elif fmt is not None:
        return fmt
    elif path.suffix == ".json":
        return "kvcache-tester"
    raise TraceFormatError(path, lineno, "unknown trace format: expected Mooncake ('hash_ids'), prefixkv "
                                         "tokens ('tokens') or a kv-cache-tester document ('requests')")


# A top-level key that names the format (the first one found decides).
_FORMAT_KEYS = {"hash_ids": "mooncake", "tokens": "tokens", "prefixkv_trace": "tokens", "requests": "kvcache-tester"}
_UNREADABLE = object()


def _head_format(text: str):
    """The format the first top-level key in ``_FORMAT_KEYS`` of the JSON object ``text`` names;
    None for a whole object without one; ``_UNREADABLE`` when ``text`` is not one JSON object.

    Only the values before that key are decoded: a kv-cache-tester document is often one line,
    and decoding it here to read its keys parsed the whole document twice (again in the loader)."""
    decode = json.JSONDecoder().raw_decode
    scan = json.decoder.scanstring
    n = len(text)

    try:
        p = _skip_ws(text, 0)
        if text[p] != "{":
            return _UNREADABLE
        p = _skip_ws(text, p + 1)
        if text[p] == "}":
            return None if _skip_ws(text, p + 1) == n else _UNREADABLE
        while True:
            if text[p] != '"':
                return _UNREADABLE
            key, p = scan(text, p + 1)
            fmt = _FORMAT_KEYS.get(key)
            if fmt is not None:
                return fmt
            p = _skip_ws(text, p)
            if text[p] != ":":
                return _UNREADABLE
            p = _skip_ws(text, decode(text, _skip_ws(text, p + 1))[1])
            if text[p] == "}":
                return None if _skip_ws(text, p + 1) == n else _UNREADABLE
            if text[p] != ",":
                return _UNREADABLE
            p = _skip_ws(text, p + 1)
    except (IndexError, ValueError):
        return _UNREADABLE


def load_trace(path: str | os.PathLike | Sequence[str | os.PathLike], format: str = "auto", *,
               block_size: int | None = None, name: str | None = None) -> Trace:
    """Load a trace of any supported format (``format``: auto, mooncake, kvcache-tester, tokens).

    A list of paths, or a directory, is a kv-cache-tester set. ``block_size``
    defaults to the format's own (Mooncake 512, kv-cache-tester from the file,
    token traces from the header or 16).
    """
    if not isinstance(path, (str, os.PathLike)):
        paths = list(path)
        if format not in ("auto", "kvcache-tester", "kv-cache-tester", "weka"):
            raise InvalidArgument("format", f"several paths load only as kvcache-tester, not {_short(format)}")
        return load_kvcache_tester(paths, block_size=block_size, name=name)
    if format == "auto":
        format = detect_format(path)
    fmt = _FORMAT_ALIASES.get(format) if isinstance(format, str) else None
    if fmt is None:
        raise InvalidArgument("format", f"unknown trace format {_short(format)}; choose from auto, "
                                        f"{', '.join(FORMATS)}")
    if fmt != "kvcache-tester" and Path(path).is_dir():
        raise InvalidArgument("format", f"{fmt} names a file, but {str(path)!r} is a directory: only a "
                                        f"kv-cache-tester set is a directory (of *.json files); use format "
                                        f"kvcache-tester or auto")
    try:
        if fmt == "mooncake":
            return load_mooncake(path, block_size if block_size is not None else MOONCAKE_BLOCK_SIZE, name=name)
        if fmt == "kvcache-tester":
            return load_kvcache_tester(path, block_size=block_size, name=name)
        return load_token_trace(path, block_size, name=name)
    except TraceFormatError as exc:
        # A format given by name that the file is not: say what the file looks like.
        try:
            found = detect_format(path)
        except (OSError, ValueError):
            found = None
        if found is None or found == fmt:
            raise
        raise TraceFormatError(exc.path, exc.line, f"{exc.problem}; read as a {fmt} trace, but the file looks "
                                                   f"like a {found} one: use format {found} or auto") from None
