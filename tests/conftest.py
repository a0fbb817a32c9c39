"""Fixtures shared by several test files."""

import pytest


@pytest.fixture(scope="module")
def one_torch_thread():
    """Torch on one thread for a module of small tensors: faster than two, and immune to OpenMP
    threads spinning on a busy CPU. Restored afterwards for the rest of the session."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
