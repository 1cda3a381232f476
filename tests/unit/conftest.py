"""Unit-test fixtures."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny tensors: extra OpenMP threads only add overhead (many small ops on 2 cores)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
