"""Review of ``prefixkv.flat`` (the flat hash index and ``FlatBlockPool``): defects found, each
with the test that showed it.

* numba's on-disk cache (``cache=True``) with nowhere to write: importing the kernels raised, so
  ``available()`` said yes and ``KVCacheManager()`` (index ``"auto"``) failed to build.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("numba")

ROOT = Path(__file__).resolve().parent.parent


def _run(code: str, timeout: float = 240) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


# -- numba's cache with no writable place ------------------------------------------------------------


def test_kernels_import_without_a_writable_numba_cache():
    """A read-only install with no writable user cache dir: numba finds no cache locator for
    ``cache=True`` functions and raises at decoration time. The kernels must still import (compiled
    per process) and the default manager must build and work."""
    code = """
import numba.core.caching as caching
caching.CacheImpl._locator_classes = []          # no place to keep a cache (read-only install, no HOME)
import prefixkv.flat as flat
assert flat.available()
from prefixkv import KVCacheManager
m = KVCacheManager(num_blocks=8, block_size=4, hash_seed=0)
assert m.admit("a", list(range(9))) == 0
m.free("a")
assert m.admit("b", list(range(9))) == 8
print(type(m.pool).__name__)
"""
    done = _run(code)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["FlatBlockPool"]
