"""Seconds from Ctrl-C (SIGINT to the process group) to exit, for the README's main command and a
two-worker sweep of conversation_trace.jsonl. Target: every command stops within 2 s.

    .venv/bin/python benches/interrupt_latency.py [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import pathlib
import signal
import statistics
import subprocess
import sys
import tempfile
import time

TRACE = pathlib.Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
COMMANDS = {"prefixkv compare (README main command)": ["compare"],
            "prefixkv compare --trace conversation_trace.jsonl --workers 2": ["compare", "--trace", str(TRACE),
                                                                              "--workers", "2"]}


def _workers_started(pid: int) -> bool:
    try:
        return bool(pathlib.Path(f"/proc/{pid}/task/{pid}/children").read_text().split())
    except OSError:
        return False


def interrupt_once(argv: list[str], after_s: float) -> tuple[float, int]:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.Popen([sys.executable, "-m", "prefixkv", *argv], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, env={**os.environ, "TMPDIR": tmp}, start_new_session=True)
        while not _workers_started(proc.pid) and proc.poll() is None:
            time.sleep(0.01)
        time.sleep(after_s)
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.perf_counter()
        code = proc.wait(timeout=60)
        return time.perf_counter() - sent, code


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    for name, argv in COMMANDS.items():
        took, codes = zip(*(interrupt_once(argv, after_s=0.5) for _ in range(args.runs)))
        print(f"{name}: exit status {set(codes)}, seconds to exit after SIGINT: median "
              f"{statistics.median(took):.3f}, max {max(took):.3f} ({args.runs} runs)")


if __name__ == "__main__":
    main()
