"""``prefixkv tier stats|clear`` for a disk store directory, as for a Redis URL (issue 26, point 3).

Real directories under ``tmp_path``, written by real stores; the command runs through
``prefixkv.cli.main`` (and once as a subprocess). Permission errors are simulated (the tests may
run as root, for whom every ``access`` check passes).
"""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from redis_fixtures import Blocks

from prefixkv.cli import main
from prefixkv.errors import InvalidArgument
from prefixkv.tiers import disk_admin
from prefixkv.tiers.cli import disk_path
from prefixkv.tiers.disk_store import DiskBlockStore, DiskStoreConfig
from prefixkv.tiers.fingerprint import Fingerprint, weights_digest

FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32))]), "float16", 2, 2, 8, 4, hash_seed=7)
OTHER_FP = Fingerprint(weights_digest([("w", np.arange(8, dtype=np.float32) * 2)]), "float16", 2, 2, 8, 4,
                       hash_seed=7)
FAST = DiskStoreConfig(fsync="none")


def dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


@pytest.fixture
def store_dir(tmp_path):
    """Two fingerprints' namespaces (6 and 4 blocks), a dead writer's leftover, a live write in
    progress, an operator's note and a link named like a block in a fan-out folder, a file at the top."""
    root = tmp_path / "kv"
    blocks, other = Blocks(FP, 6, seed=1), Blocks(OTHER_FP, 4, seed=2)
    with DiskBlockStore(root, FP, 10**6, FAST) as a, DiskBlockStore(root, OTHER_FP, 2 * 10**6, FAST) as b:
        a.put(blocks.chain, 0, blocks.payloads, blocks.contents)
        b.put(other.chain, 0, other.payloads, other.contents)
        assert a.flush() and b.flush()
    name = blocks.chain[0].hex()
    folder = root / FP.hex / name[:2]
    extra = {
        "leftover": folder / f"{name}.{dead_pid()}.1.tmp",
        "live": folder / f"{name}.{os.getpid()}.7.tmp",
        "note": folder / "notes.txt",
        "link": folder / f"{name[:2]}{'0' * 30}.kv",      # named like a block, a symbolic link
        "top": root / "README.txt",
    }
    for key in ("leftover", "live", "note", "top"):
        extra[key].write_bytes(b"x" * 10)
    os.symlink(root / "README.txt", extra["link"])
    return root, blocks, other, extra


def block_files(root: Path, fp: Fingerprint) -> list[Path]:
    return sorted(p for p in (root / fp.hex).glob("*/*.kv") if p.is_file() and not p.is_symlink())


def tier(capsys, *argv) -> tuple[int, str, str]:
    code = main(["tier", *argv])
    out, err = capsys.readouterr()
    return code, out, err


def tier_error(capsys, *argv) -> str:
    with pytest.raises(SystemExit) as info:
        main(["tier", *argv])
    out, err = capsys.readouterr()
    assert info.value.code == 2 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err


def test_the_forms_of_a_disk_store_and_of_a_redis_url():
    assert disk_path("disk:///var/kv") == "/var/kv" and disk_path("disk://kv/a") == "kv/a"
    assert disk_path("/var/kv") == "/var/kv" and disk_path("kv") == "kv"
    for url in ("redis://127.0.0.1:6379/0", "unix:///run/redis.sock", "redis+cluster://h:1,h:2"):
        assert disk_path(url) is None


@pytest.mark.parametrize("form", ["absolute", "relative", "plain"])
def test_stats_per_fingerprint_namespace_and_nothing_changed(capsys, monkeypatch, store_dir, form):
    root, blocks, other, extra = store_dir
    monkeypatch.chdir(root.parent)
    target = {"absolute": f"disk://{root}", "relative": "disk://kv", "plain": "kv"}[form]
    before = sorted((str(p), p.lstat().st_mtime_ns) for p in root.rglob("*"))
    code, out, _ = tier(capsys, "stats", target, "--json")
    assert code == 0
    report = json.loads(out)
    assert report["store"] == "disk" and report["path"] == str(root)
    spaces = {n["fingerprint"]: n for n in report["namespaces"]}
    assert set(spaces) == {FP.hex, OTHER_FP.hex}
    mine = spaces[FP.hex]
    assert mine["blocks"] == 6 and mine["bytes"] == sum(p.stat().st_size for p in block_files(root, FP))
    assert mine["ledger_bytes"] == mine["bytes"] and mine["capacity_bytes"] == 10**6
    assert (mine["leftover_temps"], mine["live_temps"], mine["unknown_files"]) == (1, 1, 2)    # note + link
    theirs = spaces[OTHER_FP.hex]
    assert theirs["blocks"] == 4 and theirs["capacity_bytes"] == 2 * 10**6 and theirs["leftover_temps"] == 0
    # stats writes nothing: the leftover is still there (an open would delete it), no file touched
    assert sorted((str(p), p.lstat().st_mtime_ns) for p in root.rglob("*")) == before
    code, out, _ = tier(capsys, "stats", target)
    assert code == 0 and f"disk store {root} (2 fingerprints)" in out
    line = next(l for l in out.splitlines() if FP.hex in l)
    assert "6 blocks" in line and "of 976.6 KiB" in line and "1 leftover temporary file" in line
    assert "1 write in progress" in line and "2 other files" in line


def test_stats_says_when_the_ledger_disagrees_and_when_no_capacity_was_recorded(capsys, store_dir):
    root, *_ = store_dir
    (root / FP.hex / "usage").write_bytes(b"")         # a ledger from before capacities were recorded, damaged
    code, out, _ = tier(capsys, "stats", str(root))
    line = next(l for l in out.splitlines() if FP.hex in l)
    assert code == 0 and "(capacity not recorded)" in line and "the ledger records missing" in out


def test_clear_deletes_every_fingerprints_block_files_and_nothing_else(capsys, store_dir):
    root, blocks, other, extra = store_dir
    with DiskBlockStore(root, FP, 10**6, FAST) as running:         # a store open during the clear
        assert running.probe(blocks.chain) == 6
        extra["leftover"].write_bytes(b"x")                         # (its open deleted the first one)
        code, out, _ = tier(capsys, "clear", f"disk://{root}")
        assert code == 0
        assert "deleted 10 block file(s)" in out and "of every fingerprint" in out
        assert "1 leftover temporary file(s)" in out
        assert block_files(root, FP) == block_files(root, OTHER_FP) == []
        for key in ("live", "note", "top"):
            assert extra[key].read_bytes() == b"x" * 10, key        # not the store's, or a write in progress
        assert extra["link"].is_symlink() and not extra["leftover"].exists()
        assert (root / FP.hex / "usage").exists()
        got = running.fetch(blocks.chain, 0, 6, blocks.contents)
        assert got.count == 0 and got.stop == "miss"                # the running store sees misses
        assert running.stats().used_bytes == 0                       # the shared ledger was set under its lock
        running.put(blocks.chain, 0, blocks.payloads, blocks.contents)
        assert running.flush() and running.fetch(blocks.chain, 0, 6, blocks.contents).count == 6
    code, out, _ = tier(capsys, "stats", str(root), "--json")
    spaces = {n["fingerprint"]: n for n in json.loads(out)["namespaces"]}
    assert spaces[FP.hex]["blocks"] == 6 and spaces[OTHER_FP.hex]["blocks"] == 0
    assert spaces[OTHER_FP.hex]["ledger_bytes"] == 0


def test_clear_one_fingerprint_leaves_the_others(capsys, store_dir):
    root, blocks, other, _ = store_dir
    code, out, _ = tier(capsys, "clear", str(root), "--fingerprint", OTHER_FP.hex.upper())
    assert code == 0 and f"deleted 4 block file(s)" in out and f"fingerprint {OTHER_FP.hex}" in out
    assert len(block_files(root, FP)) == 6 and block_files(root, OTHER_FP) == []
    code, out, _ = tier(capsys, "clear", str(root), "--fingerprint", "0" * 32)      # none: nothing, like Redis
    assert code == 0 and "deleted 0 block file(s)" in out and len(block_files(root, FP)) == 6


def test_clear_waits_for_the_namespace_lock(capsys, store_dir):
    root, *_ = store_dir
    fd = os.open(root / FP.hex / "usage", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)                   # a writer of another process in the middle of a commit
    result = {}
    thread = threading.Thread(target=lambda: result.setdefault("code", main(["tier", "clear", str(root),
                                                                              "--fingerprint", FP.hex])))
    try:
        thread.start()
        time.sleep(0.3)
        assert thread.is_alive() and len(block_files(root, FP)) == 6
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    thread.join(10)
    assert result == {"code": 0} and block_files(root, FP) == []
    capsys.readouterr()


@pytest.mark.parametrize("command", ["stats", "clear"])
def test_a_wrong_path_is_one_line_naming_the_problem(capsys, tmp_path, command):
    (tmp_path / "file").write_text("x")
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "photo.jpg").write_text("x")
    (tmp_path / "other" / ("a" * 32)).mkdir()                 # named like a namespace, no ledger
    assert "no such directory" in tier_error(capsys, command, str(tmp_path / "missing"))
    assert "not a directory" in tier_error(capsys, command, f"disk://{tmp_path / 'file'}")
    err = tier_error(capsys, command, str(tmp_path / "other"))
    assert "not a prefixkv disk store" in err
    assert (tmp_path / "other" / "photo.jpg").exists()          # refused before anything was touched
    assert "names no directory" in tier_error(capsys, command, "disk://")
    assert "--timeout applies to a Redis URL" in tier_error(capsys, command, str(tmp_path), "--timeout", "2")
    if command == "clear":
        assert "--prefix applies to a Redis URL" in tier_error(capsys, command, str(tmp_path), "--prefix", "x")


def test_permission_denied_is_named_and_clear_checks_every_namespace_first(capsys, monkeypatch, store_dir):
    root, *_ = store_dir
    real_access, real_scandir = os.access, os.scandir
    locked = str(root / OTHER_FP.hex)
    monkeypatch.setattr(disk_admin.os, "access", lambda p, mode: False if str(p).startswith(locked)
                        else real_access(p, mode))
    err = tier_error(capsys, "clear", str(root))
    assert "permission denied" in err and OTHER_FP.hex in err
    assert len(block_files(root, FP)) == 6 and len(block_files(root, OTHER_FP)) == 4     # nothing deleted

    def scandir(path="."):
        if str(path) == str(root):
            raise PermissionError(13, "Permission denied", str(path))
        return real_scandir(path)

    monkeypatch.setattr(disk_admin.os, "scandir", scandir)
    assert "permission denied" in tier_error(capsys, "stats", str(root))


def test_the_command_line_itself(store_dir):
    root, *_ = store_dir
    done = subprocess.run([sys.executable, "-m", "prefixkv", "tier", "stats", f"disk://{root}"],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0 and "2 fingerprints" in done.stdout, done.stderr
    done = subprocess.run([sys.executable, "-m", "prefixkv", "tier", "clear", str(root / "nope")],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().endswith("no such directory"), done.stderr
    help_text = subprocess.run([sys.executable, "-m", "prefixkv", "tier", "stats", "--help"],
                               capture_output=True, text=True, timeout=60).stdout
    assert "disk:///abs/path" in help_text and "plain path" in help_text


def test_the_stores_own_clear_leaves_files_it_never_wrote(store_dir):
    root, blocks, other, extra = store_dir
    with DiskBlockStore(root, FP, 10**6, FAST) as store:
        assert store.clear() == 10
        assert extra["note"].exists() and extra["live"].exists() and extra["link"].is_symlink()
        assert store.stats().used_bytes == 0


def test_the_operator_calls_refuse_bad_arguments_before_touching_anything(store_dir):
    root, *_ = store_dir
    for call in (lambda: disk_admin.survey(str(root), FP.hex, stale_temp_s=-1),
                 lambda: disk_admin.clear(str(root), stale_temp_s=float("nan")),
                 lambda: disk_admin.clear(str(root), "Z" * 32),
                 lambda: disk_admin.survey(str(root), "../" + FP.hex)):
        with pytest.raises(InvalidArgument) as info:
            call()
        assert info.value.argument in ("stale_temp_s", "name")
    assert len(block_files(root, FP)) == 6 and len(block_files(root, OTHER_FP)) == 4
