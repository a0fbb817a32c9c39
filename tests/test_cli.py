import json
import subprocess
import sys

import pytest

from prefixkv.cli import main


def run(capsys, *argv):
    code = main(list(argv))
    return code, capsys.readouterr().out


def test_plan_json_seed_model(capsys):
    code, out = run(capsys, "plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128", "--dtype", "bfloat16",
                    "--block-size", "16", "--pool", "24GiB", "--prompt-tokens", "4097", "--json")
    assert code == 0
    d = json.loads(out)
    assert (d["bytes_per_token"], d["bytes_per_block"], d["num_blocks"], d["blocks_per_request"],
            d["max_requests"], d["leftover_blocks"], d["unallocated_bytes"]) == (131072, 2 * 2**20, 12288, 257, 47, 209, 0)


def test_plan_text_second_example(capsys):
    code, out = run(capsys, "plan", "--layers", "24", "--kv-heads", "4", "--pool", "8GiB", "--prompt-tokens", "1025")
    assert code == 0
    assert "49,152 B (48 KiB)" in out and "10,922 blocks" in out and "168" in out
    assert "2 blocks + 512 KiB unallocated" in out


def test_plan_tp_json(capsys):
    _, out = run(capsys, "plan", "--tp", "16", "--json")
    assert json.loads(out)["kv_heads_per_gpu"] == 1


@pytest.mark.parametrize("argv,message", [
    (["plan", "--pool", "24GB"], "decimal"),
    (["plan", "--dtype", "float99"], "unknown dtype"),
    (["plan", "--block-size", "0"], "positive"),
    (["plan", "--tp", "3"], "split evenly"),
    (["lab", "--lengths", "1,x"], "comma-separated"),
])
def test_bad_arguments_exit_2_with_a_clear_message(capsys, argv, message):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("block_size,line", [(16, "blocks=8 slots=128 useful=112 tail_waste=16"),
                                             (4, "blocks=29 slots=116 useful=112 tail_waste=4"),
                                             (64, "blocks=3 slots=192 useful=112 tail_waste=80")])
def test_lab(capsys, block_size, line):
    code, out = run(capsys, "lab", "--block-size", str(block_size), "--lengths", "17,32,63")
    assert code == 0
    assert line in out
    assert out.count("PASS") == 5 and "FAIL" not in out


def test_console_script_runs():
    out = subprocess.run([sys.executable, "-m", "prefixkv.cli", "plan", "--json"], capture_output=True,
                         text=True, check=True).stdout
    assert json.loads(out)["max_requests"] == 47
