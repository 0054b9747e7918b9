"""Test-only fault injectors: operators that fail in optimize's apply phase, disk references that fail to read."""

import concurrent.futures as cf
from typing import Callable, Literal

import pytest

import torch

from operators.base import Operator


class MetaOnAttach(Operator):
    """Drops its module's weights on attach (as offloading would); raises when attaching the
    module named ``fail_on``, so rollback can be checked."""

    def __init__(self, base, *, key, runtime, fail_on: str = "", mode: Literal["a", "b"] = "a"):
        super().__init__(base, key=key, runtime=runtime)
        self.fail_on = fail_on
        self._saved = {}

    def attach(self):
        for n, p in self.base.named_parameters():
            self._saved[n] = p.data
            p.data = torch.zeros((), dtype=p.dtype).expand(p.shape)  # storage-less placeholder
        if self.key == self.fail_on:
            raise RuntimeError("injected attach failure")
        super().attach()

    def detach(self):
        params = dict(self.base.named_parameters())
        for n, d in self._saved.items():
            params[n].data = d
        self._saved.clear()
        return super().detach()


class NotAnOperator(torch.nn.Module):
    def __init__(self, base, *, key, runtime):
        super().__init__()


class ExplodingSource:
    """A disk reference shaped like ``good`` (a checkpoint ``Source``) whose every read raises
    ``OSError(message)``: a failing disk read in the middle of ``generate``."""

    def __init__(self, good, message: str):
        self.shape, self.dtype, self.nbytes, self.pieces = good.shape, good.dtype, good.nbytes, good.pieces
        self.message = message

    def read(self, dtype=None, out=None):
        raise OSError(self.message)


def assert_failing_read_raises_then_recovers(model, unit_name: str, key: str, run: Callable[[], torch.Tensor],
                                            ref: torch.Tensor, message: str) -> None:
    """Make ``key`` of store unit ``unit_name`` fail to read: ``run()`` (a ``generate``) must raise
    a KinjectError with ``message`` within seconds (never a hang); once the read works again the
    same model gives ``ref`` and holds no unit as acquired."""
    from kinject.errors import KinjectError

    unit = model.kinject.store[unit_name]
    good = unit.tensors[key]
    unit.tensors[key] = ExplodingSource(good, message)
    try:
        with cf.ThreadPoolExecutor(1) as pool:
            with pytest.raises(KinjectError, match=message):
                pool.submit(run).result(timeout=30)
    finally:
        unit.tensors[key] = good
    assert torch.equal(run(), ref)                                        # the same model runs again
    assert all(u.refs == 0 for u in model.kinject.store.units.values())   # nothing leaked as acquired
