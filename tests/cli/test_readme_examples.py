"""README.md's examples and command reference, checked against the code (CPU, a second or two).

The code blocks are read from README.md itself, by the marker on the line before them
(``<!-- example: NAME -->``, ``<!-- main-command -->``, ``<!-- test-command -->``), so an example
that stops working, or a marker that goes missing, fails here.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import shlex
import subprocess

import pytest

from prefixkv import cli, parse_size
from prefixkv.copies import BlockCopies

ROOT = pathlib.Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def block_after(marker: str) -> str:
    """The fenced code block right after ``<!-- marker -->`` (blank lines allowed between)."""
    m = re.search(r"^<!-- " + re.escape(marker) + r" -->\n\s*```[a-z]*\n(.*?)^```", README, re.M | re.S)
    assert m, f"README.md has no code block after <!-- {marker} -->"
    return m.group(1)


def section(title: str) -> str:
    m = re.search(r"^## " + re.escape(title) + r"\n(.*?)(?=^## )", README, re.M | re.S)
    assert m, f"README.md has no section '## {title}'"
    return m.group(1)


# --- set-up commands ---------------------------------------------------------------------------

def test_ci_runs_the_readme_test_command():
    """`.ci/run` takes its command from the README by an awk program: run that program here."""
    ci = (ROOT / ".ci" / "run").read_text()
    prog = re.search(r"awk '([^']*)' README\.md", ci)
    assert prog, ".ci/run no longer reads the command from README.md with awk"
    got = subprocess.run(["awk", prog.group(1), str(ROOT / "README.md")], capture_output=True, text=True,
                         check=True).stdout.strip()
    assert got == block_after("test-command").strip()
    assert got.startswith("python3 -m venv .venv && ")
    assert ".venv/bin/pytest -q && .venv/bin/pytest -q benches --benchmark-disable" in got
    assert "pip install -e '.[test]'" in got


def test_main_command_runs_the_default_compare():
    cmd = block_after("main-command").strip()
    assert cmd == "python3 -m venv .venv && .venv/bin/pip install -e . && .venv/bin/prefixkv compare"
    args = cli.build_parser().parse_args(shlex.split(cmd.rsplit("&&", 1)[1])[1:])
    assert args.command == "compare"
    assert args.capacities == "auto" and args.trace == [] and args.policies is None


# --- Python examples -----------------------------------------------------------------------------

def test_generation_loop_example():
    ns: dict = {"token_ids": list(range(1, 101)), "next_token": 7}
    exec(compile(block_after("example: generation-loop"), "README:generation-loop", "exec"), ns)
    mgr = ns["mgr"]
    assert ns["m"].fits and ns["cached"] == 0
    assert ns["slots"].dtype.name == "int64" and len(ns["slots"]) == 100
    assert ns["table"].dtype.name == "int32" and len(ns["table"]) == 7
    assert ns["slot"] == 100                         # the 101st token lands in block 6, slot 4
    mgr.check_invariants()
    st = mgr.stats()
    assert st.active_blocks + st.evictable_blocks + st.free_uncached_blocks == st.capacity == 4096
    assert st.sequences == 0 and st.insertions == 6  # six full blocks published, all evictable now
    # the same prompt again hits the six full blocks
    assert mgr.admit("req-2", mgr.prompt(ns["token_ids"], salt="tenant-a")) == 96


class _RecordingStore:
    """Stands in for KVStore.transfer (torch-free): records what the manager hands over."""

    def __init__(self):
        self.calls = []

    def transfer(self, demotions, loads, copies):
        self.calls.append((demotions, loads, copies))


def test_host_tier_example():
    from prefixkv import KVCacheManager

    prompt = KVCacheManager(4096, 16, hash_seed=0).prompt(list(range(1000)))
    store = _RecordingStore()
    ns: dict = {"KVCacheManager": KVCacheManager, "prompt": prompt, "store": store}
    exec(compile(block_after("example: host-tier"), "README:host-tier", "exec"), ns)
    m, mgr = ns["m"], ns["mgr"]
    assert (m.hit_blocks, m.lower_hit_blocks) == (0, 0)
    (demotions, loads, copies), = store.calls
    assert isinstance(demotions, BlockCopies) and isinstance(loads, BlockCopies)
    assert demotions == [] and loads == [] and list(copies) == []
    mgr.check_invariants()
    assert mgr.stats().host_capacity == 32768


# --- command reference -----------------------------------------------------------------------------

def _subparsers(parser, prefix=""):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _subparsers(sub, f"{prefix}{name} ")
    if prefix:
        yield prefix.strip(), parser


PARSERS = dict(_subparsers(cli.build_parser()))


def _options(parser) -> dict[str, argparse.Action]:
    return {o: a for a in parser._actions for o in a.option_strings if o.startswith("--")}


def _synopses():
    """Every ``prefixkv CMD ...`` code span of the Commands list and the bench paragraph."""
    text = section("Commands") + section("Benchmarks")
    for span in re.findall(r"`(prefixkv [a-z]+[^`]*)`", text, re.S):
        words = span.split()
        cmd = f"{words[1]} {words[2]}" if len(words) > 2 and f"{words[1]} {words[2]}" in PARSERS else words[1]
        if cmd in PARSERS and any(w.lstrip("[").startswith("--") for w in words):
            yield cmd, " ".join(words)


def test_every_command_has_a_synopsis():
    documented = {cmd for cmd, _ in _synopses()}
    assert set(PARSERS) - {"tier", "trace"} <= documented       # (the groups: their subcommands are)


@pytest.mark.parametrize("cmd,span", list(_synopses()), ids=lambda x: x if isinstance(x, str) and len(x) < 20 else "")
def test_synopsis_flags_exist(cmd, span):
    opts = _options(PARSERS[cmd])
    flags = set(re.findall(r"(--[a-z][a-z-]*)", span))
    assert flags - set(opts) == set(), f"`prefixkv {cmd}`: README flags missing from --help"


def _same(value: str, default) -> bool:
    if isinstance(default, bool):
        return False
    if isinstance(default, (list, tuple)):
        return value == ",".join(map(str, default))
    if isinstance(default, float):
        return float(value) == default
    if isinstance(default, int):
        return (int(value) if value.isdigit() else parse_size(value)) == default
    return value == str(default)


@pytest.mark.parametrize("cmd,span", list(_synopses()), ids=lambda x: x if isinstance(x, str) and len(x) < 20 else "")
def test_synopsis_defaults_match(cmd, span):
    """``--flag VALUE`` with a literal value (not a PLACEHOLDER or a|b choice) names the default,
    wherever the flag has one (examples of flags that default to off, such as --host-pool 64GiB, are
    not defaults)."""
    opts = _options(PARSERS[cmd])
    for flag, value in re.findall(r"(--[a-z][a-z-]*) ([^\s\[\]]+)", span):
        action = opts.get(flag)
        if action is None or "|" in value or value.startswith("--") or not re.match(r"[a-z0-9]", value):
            continue
        default = action.default
        if default in (None, 0, False) or isinstance(default, bool):
            continue
        assert _same(value, default), f"`prefixkv {cmd}`: README says {flag} {value}, the default is {default!r}"


def test_help_flags_are_in_the_readme():
    missing = {cmd: [o for o in _options(p) if o not in README and o != "--help"] for cmd, p in PARSERS.items()}
    assert {cmd: m for cmd, m in missing.items() if m} == {}


def test_policy_names_in_the_readme_are_registered():
    from prefixkv.policies import available_policies

    names = set(available_policies())
    listed = re.search(r"\*\*Eviction policies\*\* by name: (.*?)`PriorityPolicy", README, re.S).group(1)
    for name in re.findall(r"`([a-z0-9-]+)` \(|`([a-z0-9-]+)`,", listed):
        name = next(n for n in name if n)
        assert name in names, name
    assert "belady" in names
