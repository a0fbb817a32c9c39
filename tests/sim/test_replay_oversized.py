"""``replay`` says how many requests did not fit: a capacity below the largest request used to
report ``block_hit_rate 0.00 %`` with no word that every request was larger than the whole cache
(WEKA ``trace_0001.json`` at 500 blocks: 41 of 41)."""

from __future__ import annotations

import json

from prefixkv.cli import main


def test_requests_larger_than_the_cache_are_named_in_the_table_and_the_json(tmp_path, capsys):
    trace = tmp_path / "w.jsonl"
    assert main(["workload", "--out", str(trace), "--requests", "30", "--seed", "3"]) == 0
    capsys.readouterr()
    assert main(["replay", "--trace", str(trace), "--capacity", "4", "--json"]) == 0
    out, err = capsys.readouterr()
    result = json.loads(out)
    n, total, largest = result["oversized_requests"], result["requests"], result["largest_request_blocks"]
    assert 0 < n <= total and largest > 4
    assert result["fitting_requests"] == total - n
    assert f"{n:,} of {total:,} measured requests did not fit" in err
    assert f"--capacity {largest:,} or more fits every request" in err

    assert main(["replay", "--trace", str(trace), "--capacity", "4"]) == 0
    table = capsys.readouterr().out
    assert f"note: {n:,} of {total:,} measured requests did not fit" in table
    assert "larger than the whole cache of 4 blocks" in table

    assert main(["replay", "--trace", str(trace), "--capacity", str(largest), "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["oversized_requests"] == 0 and "did not fit" not in err
