"""Run an engine script (tests/engines/*.py) under that engine's own venv, and read its answer.

SGLang and vLLM pin CUDA torch builds and conflicting dependencies, so each lives in its own venv
(.ci/install_engines.sh builds both under /tmp/prefixkv-engines); prefixkv's suite drives them
through a subprocess. ``PREFIXKV_SGLANG_PYTHON`` / ``PREFIXKV_VLLM_PYTHON`` name another venv's
python. Where the python is missing or cannot import its engine, the marked tests are skipped
with that reason.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
ENGINES = os.environ.get("PREFIXKV_ENGINES", "/tmp/prefixkv-engines")
PYTHONS = {"sglang": os.environ.get("PREFIXKV_SGLANG_PYTHON", f"{ENGINES}/sglang/bin/python"),
           "vllm": os.environ.get("PREFIXKV_VLLM_PYTHON", f"{ENGINES}/vllm/bin/python")}
MODULES = {"sglang": "sglang.srt.mem_cache.hicache_storage", "vllm": "vllm.v1.kv_offload.tiering.base"}
SCRIPTS = {"sglang": HERE / "sglang_hicache.py", "vllm": HERE / "vllm_tiering.py"}


@functools.cache
def absent(engine: str) -> str | None:
    """Why ``engine``'s venv cannot run the tests, or None."""
    python = PYTHONS[engine]
    if not os.path.exists(python):
        return (f"{engine} venv not found at {python} (build it: bash .ci/install_engines.sh {engine}, or set "
                f"PREFIXKV_{engine.upper()}_PYTHON)")
    probe = subprocess.run([python, "-c", f"import {MODULES[engine]}, prefixkv"], capture_output=True, text=True,
                           timeout=300, env=engine_env(), cwd=HERE)
    if probe.returncode:
        return f"{python} cannot import {engine} and prefixkv: {probe.stderr.strip().splitlines()[-1:]}"
    return None


def engine_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), str(HERE), str(HERE / "stubs")])
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def run(engine: str, step: str, spec: dict, tmp_path: Path, timeout: float = 300) -> dict:
    """Run ``step`` of the engine's script on ``spec`` in a fresh process; its last stdout line, as JSON."""
    reason = absent(engine)
    if reason:
        pytest.skip(reason)
    path = tmp_path / f"spec-{step}-{os.urandom(4).hex()}.json"
    path.write_text(json.dumps(spec))
    proc = subprocess.run([PYTHONS[engine], str(SCRIPTS[engine]), step, str(path)], capture_output=True, text=True,
                          timeout=timeout, env=engine_env(), cwd=HERE)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("{", "["))]
    if proc.returncode or not lines:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-8000:])
        raise AssertionError(f"{engine} {step} exited {proc.returncode} without an answer (its output is above)")
    return json.loads(lines[-1])


def tier_stats(target: str) -> dict:
    """``prefixkv tier stats TARGET --json`` (this checkout, this interpreter): the operator's view."""
    proc = subprocess.run([sys.executable, "-m", "prefixkv", "tier", "stats", target, "--json"], capture_output=True,
                          text=True, timeout=60, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    return json.loads(proc.stdout)
