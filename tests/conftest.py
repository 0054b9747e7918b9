"""Shared fixtures. GPU tests carry @pytest.mark.gpu and are skipped without CUDA."""

import logging

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    """Tiny models on a 2-core CI box: torch's intra-op threads only spin (measured ~3x slower)."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


@pytest.fixture(autouse=True)
def _quiet_transformers():
    logging.getLogger("transformers").setLevel(logging.ERROR)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    yield


@pytest.fixture(scope="session")
def tok():
    """The built-in tiny tokenizer (left padding), shared: nothing changes it."""
    from kinject.testing import tiny_tokenizer

    return tiny_tokenizer()


@pytest.fixture
def nothing_read(monkeypatch):
    """Fail the test if any checkpoint bytes are read (errors must come first)."""
    import kinject.engine.disk_sources as disk_sources

    def refuse(*args, **kwargs):
        raise AssertionError("a weight was read before the error")

    monkeypatch.setattr(disk_sources, "read_pieces", refuse)
