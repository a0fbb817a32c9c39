"""Fixtures for the pytest-benchmark suite in benches/.

    .venv/bin/pytest benches/ --benchmark-only      # timed
    .venv/bin/pytest benches/ --benchmark-disable   # smoke: each bench body runs once
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import peer_workload  # noqa: E402

VOCAB = 32000


@pytest.fixture(scope="session")
def peer_workload_module():
    """The peers' workload.py, or a skip naming where it was looked for."""
    W = peer_workload.load_workload(required=False)
    if W is None:
        import os

        where = os.environ.get(peer_workload.PEERS_ENV) or peer_workload.REPO.parent / "shared" / "peers"
        pytest.skip(f"peers' workload.py not found in {where} (set ${peer_workload.PEERS_ENV})")
    return W


@pytest.fixture(scope="session")
def long_tokens() -> list[int]:
    """A 32k-token prompt: 2048 blocks of 16."""
    rng = random.Random(1234)
    return [rng.randrange(VOCAB) for _ in range(32768)]


@pytest.fixture
def rng() -> random.Random:
    return random.Random(0)
