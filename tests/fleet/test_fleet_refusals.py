"""``fleet --replicas 100000`` is refused up front (it ran for minutes growing to 820 MB, each
routing decision scoring every replica); ``replay --remote-capacity`` without ``--host-capacity``
says how large the host tier it stages through is (it was visible only in the JSON)."""

from __future__ import annotations

import json

import prefixkv.hostmem as hostmem
from cli_helpers import fails
from prefixkv.cli import main


def test_more_replicas_than_requests_are_refused(capsys):
    err = fails(capsys, "fleet", "--replicas", "100000")
    assert "--replicas: 100,000 replicas for the trace's 300 requests: at most 300" in err, err
    assert main(["fleet", "--replicas", "300", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicas"] == 300


def test_replicas_that_cannot_fit_in_memory_are_refused(capsys, monkeypatch):
    monkeypatch.setattr(hostmem, "available_bytes", lambda: 2**20)
    err = fails(capsys, "fleet", "--replicas", "200")
    assert "200 replicas (the fleet and its round-robin reference" in err and "of host memory" in err, err


def test_the_staging_host_tier_of_a_remote_tier_is_said(capsys):
    assert main(["replay", "--capacity", "500", "--remote-capacity", "2000"]) == 0
    out = capsys.readouterr().out
    assert "note: no --host-capacity: a host tier of " in out and "stages the remote tier's blocks" in out, out
    assert main(["replay", "--capacity", "500", "--remote-capacity", "2000", "--json"]) == 0
    captured = capsys.readouterr()
    host = json.loads(captured.out)["host_capacity"]
    assert f"a host tier of {host:,} blocks (the largest request)" in captured.err
    assert main(["replay", "--capacity", "500", "--remote-capacity", "2000", "--host-capacity", "100"]) == 0
    assert "stages the remote" not in capsys.readouterr().out
