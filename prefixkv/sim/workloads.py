"""A seeded synthetic workload generator that writes a prefixkv token trace.

The generator writes a file first (``generate_trace``); a replay loads it
afterwards (``prefixkv.sim.traces.load_trace``). A fixed file is the basis of every
fair comparison: every policy and capacity sees exactly the same requests.

The workload mixes the sharing patterns a prefix cache lives on:

* **Tenants with shared system prompts.** Each tenant has one system prompt
  (random tokens) that starts every one of its requests. Tenants are picked
  with Zipf popularity (``tenant_zipf``), so a few are hot and many are cold.
  With ``salt_tenants`` each tenant's requests carry a salt (isolated caches).
* **Multi-turn chat sessions** (``chat``): turn ``k``'s prompt is turn
  ``k-1``'s prompt, plus ``k-1``'s output, plus new user text.
* **Few-shot templates** (``fewshot``): system prompt + one of the tenant's
  templates (instructions and examples, Zipf popularity ``template_zipf``)
  + a short query. One request per session.
* **Agent loops** (``agent``): system prompt + a task, then each step appends
  the model's action (its output) and the tool's output to the prompt.
* **One-shot questions** (``oneshot``): system prompt + a question.

Sessions arrive as a Poisson process (``session_rate`` per second); a session
of kind ``k`` is drawn from ``mix``. Later turns of a chat follow after an
exponential think time (mean ``think_time`` s), later agent steps after an
exponential tool time (mean ``tool_time`` s). Lengths are drawn uniformly from
inclusive ``(low, high)`` ranges; turn and step counts are geometric
(``1, 2, ...``) with the given mean. Sessions are generated until the
``num_requests`` earliest requests are all known; the trace holds exactly
those, in time order (ties: session order, then turn order).

Everything is drawn from one ``numpy.random.Generator`` seeded with ``seed``,
in a fixed order: the same config writes a byte-identical file.
"""

from __future__ import annotations

import bisect
import contextlib
import json
import math
import os
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from .traces import Trace, TraceRequest, load_token_trace, write_token_trace

__all__ = ["WorkloadConfig", "DEFAULT_WORKLOAD", "BUILTIN_WORKLOADS", "generate_requests", "generate_trace",
           "builtin_trace"]

KINDS = ("chat", "fewshot", "agent", "oneshot")


def _is_int(value: object) -> bool:
    """A plain int (the header is JSON: no numpy ints), not a bool."""
    return type(value) is int


@dataclass(frozen=True)
class WorkloadConfig:
    """Parameters of a synthetic workload (token counts are tokens; times are seconds)."""

    name: str = "default"
    seed: int = 0
    num_requests: int = 300                 # requests in the trace
    block_size: int = 16                    # recorded in the header: replays use it unless told otherwise
    vocab_size: int = 32_000                # token ids are drawn from [0, vocab_size)
    session_rate: float = 4.0               # new sessions per second (Poisson arrivals)
    think_time: float = 4.0                 # mean gap between chat turns (exponential)
    tool_time: float = 1.0                  # mean gap between agent steps (exponential)
    # session kinds and their weights
    mix: tuple[tuple[str, float], ...] = (("chat", 0.45), ("fewshot", 0.25), ("agent", 0.2), ("oneshot", 0.1))
    # tenants
    num_tenants: int = 8
    tenant_zipf: float = 1.1                # popularity of tenant i is proportional to 1 / i**s
    salt_tenants: bool = False              # give each tenant's requests a salt (no cross-tenant sharing)
    system_prompt_tokens: tuple[int, int] = (200, 800)
    # chat
    chat_turns: float = 4.0                 # mean turns per chat session (geometric)
    user_tokens: tuple[int, int] = (20, 200)
    chat_output_tokens: tuple[int, int] = (20, 300)
    # few-shot
    templates_per_tenant: int = 4
    template_zipf: float = 1.0
    template_tokens: tuple[int, int] = (300, 1200)
    query_tokens: tuple[int, int] = (20, 150)
    fewshot_output_tokens: tuple[int, int] = (5, 100)
    # agent
    agent_steps: float = 5.0                # mean steps per agent loop (geometric)
    agent_turns: float = 1.0                # mean user turns per agent session (geometric; 1: one loop)
    agent_think_time: float = 30.0          # mean gap after an agent's end_turn, before the user's next turn
    task_tokens: tuple[int, int] = (50, 300)
    action_tokens: tuple[int, int] = (20, 150)
    tool_output_tokens: tuple[int, int] = (50, 600)
    # one-shot
    question_tokens: tuple[int, int] = (20, 300)
    oneshot_output_tokens: tuple[int, int] = (20, 300)

    def __post_init__(self) -> None:
        if not _is_int(self.seed) or self.seed < 0:
            # None seeded numpy from the OS: another trace on every call, "seed": null in the header.
            raise ValueError(f"seed must be an int >= 0 (the same seed writes the same trace), got {self.seed!r}")
        for name in ("num_requests", "block_size", "vocab_size", "num_tenants", "templates_per_tenant"):
            if not _is_int(getattr(self, name)):    # 2.5 failed later or drew from a truncated range
                raise ValueError(f"{name} must be an int, got {getattr(self, name)!r}")
        if self.vocab_size > 2**32:
            raise ValueError(f"vocab_size must be <= 2**32 (token ids are uint32), got {self.vocab_size}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.block_size < 1 or self.vocab_size < 2 or self.num_tenants < 1 or self.templates_per_tenant < 1:
            raise ValueError("block_size, num_tenants and templates_per_tenant must be >= 1, vocab_size >= 2")
        for name in ("session_rate", "think_time", "tool_time", "agent_think_time", "tenant_zipf", "template_zipf",
                     "chat_turns", "agent_steps", "agent_turns"):
            # session_rate=inf drew every gap as 0.0 and generation never ended; an infinite mean count
            # failed in numpy; an infinite time wrote Infinity (not JSON) into the header.
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("session_rate",):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        for name in ("think_time", "tool_time", "agent_think_time", "tenant_zipf", "template_zipf"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        for name in ("chat_turns", "agent_steps", "agent_turns"):
            if not getattr(self, name) >= 1:
                raise ValueError(f"{name} (a mean count) must be >= 1, got {getattr(self, name)}")
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name.endswith("_tokens") and not (isinstance(value, tuple) and len(value) == 2
                                                   and _is_int(value[0]) and _is_int(value[1])
                                                   and 0 <= value[0] <= value[1]):
                raise ValueError(f"{f.name} must be a (low, high) pair of ints with 0 <= low <= high, got {value!r}")
        if not isinstance(self.mix, (tuple, list)) or not all(
                isinstance(entry, (tuple, list)) and len(entry) == 2 and isinstance(entry[0], str)
                and isinstance(entry[1], (int, float)) and not isinstance(entry[1], bool) and math.isfinite(entry[1])
                for entry in self.mix):
            # else: an unpacking error, or an infinite weight that numpy turned into NaN probabilities
            raise ValueError(f"mix must be (kind, finite weight) pairs, got {self.mix!r}")
        kinds = [k for k, _ in self.mix]
        if not kinds or any(k not in KINDS for k in kinds) or len(set(kinds)) != len(kinds):
            raise ValueError(f"mix must name distinct kinds from {KINDS}, got {kinds}")
        weights = [w for _, w in self.mix]
        if any(not w >= 0 for w in weights) or sum(weights) <= 0:
            raise ValueError(f"mix weights must be >= 0 with a positive sum, got {weights}")
        if self.system_prompt_tokens[0] < 1:     # the low bound: else a request could be empty
            raise ValueError(f"system_prompt_tokens: every system prompt needs at least one token, "
                             f"got {self.system_prompt_tokens!r}")

    def as_dict(self) -> dict:
        return asdict(self)


DEFAULT_WORKLOAD = WorkloadConfig()
"""The built-in workload: 300 requests, 427,200 prompt tokens (26,555 blocks of 16, 5,610 distinct).
One LRU replay at block size 16 takes about 25 ms."""

BUILTIN_WORKLOADS: dict[str, WorkloadConfig] = {
    "default": DEFAULT_WORKLOAD,
    "chat": replace(DEFAULT_WORKLOAD, name="chat", mix=(("chat", 1.0),)),
    # agent sessions of several user turns: short tool gaps inside a turn, long ones between turns
    "agent": replace(DEFAULT_WORKLOAD, name="agent", mix=(("agent", 1.0),), agent_turns=3.0, tool_time=2.0,
                     agent_think_time=60.0),
    "large": replace(DEFAULT_WORKLOAD, name="large", num_requests=5000, num_tenants=32),
}


def _zipf(n: int, s: float) -> np.ndarray:
    weights = 1.0 / np.arange(1, n + 1, dtype=np.float64) ** s
    return weights / weights.sum()


class _Generator:
    def __init__(self, config: WorkloadConfig) -> None:
        self.c = config
        self.rng = np.random.default_rng(config.seed)
        c = config
        self.tenant_p = _zipf(c.num_tenants, c.tenant_zipf)
        self.template_p = _zipf(c.templates_per_tenant, c.template_zipf)
        self.kinds = [k for k, _ in c.mix]
        w = np.array([w for _, w in c.mix], dtype=np.float64)
        self.kind_p = w / w.sum()
        self.system = [self.tokens(c.system_prompt_tokens) for _ in range(c.num_tenants)]
        self.templates = [[self.tokens(c.template_tokens) for _ in range(c.templates_per_tenant)]
                          for _ in range(c.num_tenants)]

    def length(self, bounds: tuple[int, int]) -> int:
        return int(self.rng.integers(bounds[0], bounds[1] + 1))

    def tokens(self, bounds: tuple[int, int]) -> list[int]:
        return self.rng.integers(0, self.c.vocab_size, self.length(bounds)).tolist()

    def session(self, index: int, start: float) -> list[tuple[float, int, int, TraceRequest]]:
        """One session's requests as (time, session index, turn, request)."""
        c, rng = self.c, self.rng
        tenant = int(rng.choice(c.num_tenants, p=self.tenant_p))
        kind = self.kinds[int(rng.choice(len(self.kinds), p=self.kind_p))]
        salt = f"tenant-{tenant}" if c.salt_tenants else None
        label = f"t{tenant}/{kind}{index}"
        prompt = list(self.system[tenant])
        out: list[tuple[float, int, int, TraceRequest]] = []
        t = start

        def emit(output: list[int], stop: str = "end_turn") -> None:
            request = TraceRequest(round(t, 6), len(prompt), len(output), None, list(prompt), output, salt,
                                   session=label, kind=kind, stop=stop, turn=len(out))
            out.append((request.timestamp, index, len(out), request))

        if kind == "chat":
            for turn in range(int(rng.geometric(1.0 / c.chat_turns))):
                if turn:
                    t += float(rng.exponential(c.think_time))
                prompt += self.tokens(c.user_tokens)
                output = self.tokens(c.chat_output_tokens)
                emit(output)
                prompt += output
        elif kind == "agent":
            # An agent loop: each step ends in a tool call (stop "tool_use", the next step follows
            # after the tool's time) until the last, which hands back to the user ("end_turn");
            # with agent_turns > 1 the user comes back after a think time with a new instruction.
            prompt += self.tokens(c.task_tokens)
            turns = 1 if c.agent_turns == 1 else int(rng.geometric(1.0 / c.agent_turns))
            for turn in range(turns):
                if turn:
                    t += float(rng.exponential(c.agent_think_time))
                    prompt += self.tokens(c.user_tokens)
                steps = int(rng.geometric(1.0 / c.agent_steps))
                for step in range(steps):
                    if step:
                        t += float(rng.exponential(c.tool_time))
                    output = self.tokens(c.action_tokens)
                    emit(output, "tool_use" if step < steps - 1 else "end_turn")
                    prompt += output
                    prompt += self.tokens(c.tool_output_tokens)
        elif kind == "fewshot":
            template = int(rng.choice(c.templates_per_tenant, p=self.template_p))
            prompt += self.templates[tenant][template]
            prompt += self.tokens(c.query_tokens)
            emit(self.tokens(c.fewshot_output_tokens))
        else:
            prompt += self.tokens(c.question_tokens)
            emit(self.tokens(c.oneshot_output_tokens))
        return out

    def run(self) -> list[TraceRequest]:
        n = self.c.num_requests
        entries: list[tuple[float, int, int, TraceRequest]] = []
        times: list[float] = []          # sorted request times, to know when the first n are final
        start = 0.0
        index = 0
        while True:
            if len(times) >= n and start > times[n - 1]:
                break                    # no later session can add one of the n earliest requests
            for entry in self.session(index, start):
                entries.append(entry)
                bisect.insort(times, entry[0])
            index += 1
            start += float(self.rng.exponential(1.0 / self.c.session_rate))
        entries.sort(key=lambda e: e[:3])
        return [e[3] for e in entries[:n]]


def generate_requests(config: WorkloadConfig = DEFAULT_WORKLOAD) -> list[TraceRequest]:
    """The workload's requests in time order (token traces: ``tokens`` set, ``block_hashes`` None)."""
    return _Generator(config).run()


def generate_trace(path: str | os.PathLike, config: WorkloadConfig = DEFAULT_WORKLOAD) -> Path:
    """Write the workload as a prefixkv token JSONL trace at ``path``; returns the path.

    The header records the generator and the full config. Same config, same bytes.
    """
    requests = generate_requests(config)
    return write_token_trace(path, requests, block_size=config.block_size, name=config.name,
                             meta={"generator": "prefixkv.sim.workloads", "config": config.as_dict()})


def estimated_bytes(config: WorkloadConfig, sample: int = 200) -> int:
    """Host memory generating ``config`` takes, extrapolated from its first ``sample`` requests
    (about 40 B per token: a Python int and its list slot, then its JSON text)."""
    probe = generate_requests(replace(config, num_requests=min(sample, config.num_requests)))
    tokens_per_request = sum(r.input_length + r.output_length for r in probe) / max(len(probe), 1)
    return int(config.num_requests * tokens_per_request * 40)


def builtin_trace(name: str = "default", directory: str | os.PathLike | None = None) -> Trace:
    """Generate (once, into ``directory``) and load a built-in workload by name.

    The file is ``<directory>/prefixkv-<name>-<seed>.jsonl``; an existing file is reused only
    if its header records the same config and the whole file matches the digest written beside
    it (``.xxh3``) when it was generated: a cut, edited or corrupt file is regenerated.
    ``directory`` defaults to the system temporary directory.
    """
    if name not in BUILTIN_WORKLOADS:
        raise KeyError(f"unknown built-in workload {name!r}; choose from {sorted(BUILTIN_WORKLOADS)}")
    config = BUILTIN_WORKLOADS[name]
    if directory is None:
        import tempfile
        directory = tempfile.gettempdir()
    path = Path(directory) / f"prefixkv-{config.name}-{config.seed}.jsonl"
    digest_path = path.with_name(path.name + ".xxh3")
    if not (_header_matches(path, config) and _digest_matches(path, digest_path)):
        _write_verified(path, digest_path, config)
    return load_token_trace(path)


def _file_digest(path: Path) -> str:
    import xxhash

    h = xxhash.xxh3_128()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _digest_matches(path: Path, digest_path: Path) -> bool:
    try:
        return digest_path.read_text(encoding="ascii").strip() == _file_digest(path)
    except (OSError, ValueError):
        return False


def _write_verified(path: Path, digest_path: Path, config: WorkloadConfig) -> None:
    """Trace first, digest last, each renamed into place whole: an interrupted write leaves at
    worst a trace without a digest, which the next call regenerates."""
    from ..outputs import atomic_path

    with contextlib.suppress(OSError):
        digest_path.unlink()
    with atomic_path(path) as tmp:
        generate_trace(tmp, config)
        digest = _file_digest(tmp)
    with atomic_path(digest_path) as tmp:
        tmp.write_text(digest + "\n", encoding="ascii")


def _header_matches(path: Path, config: WorkloadConfig) -> bool:
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
    except (OSError, ValueError):
        return False
    expected = json.loads(json.dumps(config.as_dict()))   # tuples become lists, as in the file
    return isinstance(header, dict) and header.get("config") == expected
