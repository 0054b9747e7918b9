"""Streaming load: a model built with its parameters on the meta device, and the tensors no
operator took read from the checkpoint onto the compute device (used by
:func:`kinject.from_pretrained`)."""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from kinject.errors import KinjectError, LoadError

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta():
    """Create every ``nn.Parameter`` on the meta device, buffers where they would be.

    HF's ``__init__`` then allocates nothing big; non-persistent buffers such as rotary
    ``inv_freq`` are still computed for real. Each parameter is marked as transformers marks one it
    loaded (``_is_hf_initialized``), so transformers' weight init skips it: values drawn into a meta
    tensor are never used, and drawing them runs torch's Python reference kernels (~0.3 s at
    DeepSeek-V3's counts). Buffers are initialised as before.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None:
            if not param.is_meta:
                param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            param._is_hf_initialized = True
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def config_dtype(config) -> torch.dtype:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def materialise_rest(model: nn.Module, index, device: torch.device, dtype: torch.dtype | None, *,
                     named_modules=None) -> None:
    """Read every parameter still on meta, and every persistent buffer the checkpoint has,
    onto the compute device (or the device an operator keeps the module on); tied parameters once.

    ``named_modules``: ``(checkpoint name, module, device)`` triples to visit (default
    ``model.named_modules()``, all onto ``device``); an optimized model passes its modules under
    their original names, each with the device its operator keeps it on
    (:func:`kinject.inject.original_modules`).

    Parameters keep the ``requires_grad`` transformers gave them (as its own ``from_pretrained``
    does). Not only for sameness: on a CPU (torch 2.13) ``F.linear`` of a strided 3-D bfloat16 input
    (the lm_head on a prefill's last positions, ``hidden[:, -1:]``) takes a batched-matmul path ~200x
    slower when the weight needs no grad: 7-10 s instead of 50 ms at a 32000 x 2048 lm_head."""
    if named_modules is None:
        named_modules = ((n, m, device) for n, m in model.named_modules(remove_duplicate=False))
    indexed = set(index.names)
    done: dict[int, nn.Parameter] = {}
    seen: set[int] = set()
    for prefix, module, where in named_modules:
        if id(module) in seen:
            continue
        seen.add(id(module))
        for leaf, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            full = f"{prefix}.{leaf}" if prefix else leaf
            new = done.get(id(param))
            if new is None:
                t = _read(index, full, (dtype or param.dtype) if param.dtype.is_floating_point else None)
                new = done[id(param)] = nn.Parameter(t.to(where), requires_grad=param.requires_grad
                                                     and t.is_floating_point())
            module._parameters[leaf] = new
        for leaf, buf in list(module._buffers.items()):
            full = f"{prefix}.{leaf}" if prefix else leaf
            if buf is None or leaf in module._non_persistent_buffers_set or full not in indexed:
                if buf is not None and buf.is_meta:
                    raise LoadError(f"buffer {full!r} is on the meta device and not in the checkpoint")
                continue
            module._buffers[leaf] = _read(index, full, buf.dtype).to(where)


def _read(index, name: str, dtype):
    try:
        return index.source(name).read(dtype)
    except KinjectError:
        raise
    except Exception as exc:
        raise LoadError(f"reading tensor {name!r} failed: {type(exc).__name__}: {exc}") from exc
