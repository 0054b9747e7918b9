"""Fixtures shared by the engine tests."""

from __future__ import annotations

import pytest

from kinject.engine import host_gemv


@pytest.fixture(scope="session")
def gemv():
    """kinject's compiled host kernels (skipped where they cannot be built here)."""
    g = host_gemv.load()
    if g is None:
        pytest.skip(f"no compiled host kernels here: {host_gemv.unavailable_reason()}")
    return g
