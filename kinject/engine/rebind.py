"""A module's own forward with some of the global names it calls bound to kinject's versions.

Why: a transformers module calls helpers by global name (``F.linear`` in a router,
``apply_rotary_pos_emb`` in an attention), and at batch 1 on a CPU those calls are where torch's
per-operation cost shows (docs/architecture.md, "Host compute"). The module's class forward is
copied, the same code object, defaults and closure, with a copy of its globals in which the names
``replace`` answers for are bound to the replacement; the copy is set as the instance's ``forward``
(hooks still run) and deleting it restores the class's. Every other line runs as transformers
wrote it, and nothing outside the instance changes (a ``TorchFunctionMode`` would reach the same
calls without a copy but sends every torch call of the forward through Python).
"""

from __future__ import annotations

import types
from typing import Callable

import torch


def code_key(fn) -> tuple | None:
    """What makes two functions the same computation for kinject's recognisers (a norm, a rotary
    embedding): their bytecode, constants, names and variable names (line numbers aside); None for
    anything without code."""
    c = getattr(fn, "__code__", None)
    return None if c is None else (c.co_code, c.co_consts, c.co_names, c.co_varnames)


def hub_wrapped(value) -> types.FunctionType | None:
    """The Python function ``value`` is, or the one it wraps as a hub-kernel layer, else None.

    Why: with the ``kernels`` package installed (a dependency of transformers from 5.25), a module-level
    function decorated with ``use_kernel_forward_from_hub`` (Llama's ``apply_rotary_pos_emb`` and its
    copies) is an ``nn.Module`` instance whose class ``forward`` calls the original function, held in
    its closure as ``func``, unless a model was kernelized. The recognisers compare the original's code;
    the wrapper itself stays what a replacement falls back to. A wrapper with its own ``forward``,
    parameters, children or hooks is not unwrapped."""
    if isinstance(value, types.FunctionType):
        return value
    if not isinstance(value, torch.nn.Module) or "forward" in value.__dict__ or value._parameters \
            or value._modules or value._forward_hooks or value._forward_pre_hooks:
        return None
    forward = getattr(type(value), "forward", None)
    code, cells = getattr(forward, "__code__", None), getattr(forward, "__closure__", None)
    if code is None or not cells or "func" not in code.co_freevars:
        return None
    try:
        inner = cells[code.co_freevars.index("func")].cell_contents
    except ValueError:            # (an empty cell)
        return None
    return inner if isinstance(inner, types.FunctionType) else None


def plain_forward(module: torch.nn.Module) -> types.FunctionType | None:
    """``module``'s class forward where it is a plain function and the instance has no ``forward`` of
    its own (else None: nothing to copy, or someone else's forward)."""
    fn = getattr(type(module), "forward", None)
    if "forward" in module.__dict__ or not isinstance(fn, types.FunctionType):
        return None
    return fn


def rebound_forward(module: torch.nn.Module, replace: Callable[[str, object], object | None]):
    """``module``'s class forward (:func:`plain_forward`, which must not be None) bound to ``module``,
    with each global name its code uses for which ``replace(name, value)`` is not None bound to that
    instead; None where no name is replaced. A forward wrapped by a decorator (``functools.wraps``: its
    ``__wrapped__`` in a closure cell, as transformers' ``deprecate_kwarg``) is copied with the wrapped
    function's copy in that cell, so the decorator still runs."""
    copy = _rebound(plain_forward(module), replace, depth=0)
    if copy is None:
        return None
    copy.kinject_rebound = True
    return copy.__get__(module)


def _rebound(fn: types.FunctionType, replace, depth: int) -> types.FunctionType | None:
    g = None
    for name in fn.__code__.co_names:
        if name in fn.__globals__:
            new = replace(name, fn.__globals__[name])
            if new is not None:
                g = g if g is not None else dict(fn.__globals__)
                g[name] = new
    closure, inner_copy = fn.__closure__, None
    inner = getattr(fn, "__wrapped__", None)
    if isinstance(inner, types.FunctionType) and closure and depth < 4 \
            and any(_holds(c, inner) for c in closure):
        inner_copy = _rebound(inner, replace, depth + 1)
        if inner_copy is not None:
            closure = tuple(types.CellType(inner_copy) if _holds(c, inner) else c for c in closure)
    if g is None and inner_copy is None:
        return None
    copy = types.FunctionType(fn.__code__, g if g is not None else fn.__globals__, fn.__name__, fn.__defaults__,
                              closure)
    copy.__kwdefaults__ = fn.__kwdefaults__
    copy.__qualname__ = fn.__qualname__
    copy.__dict__.update(fn.__dict__)
    if inner_copy is not None:
        copy.__wrapped__ = inner_copy
    return copy


def _holds(cell, value) -> bool:
    try:
        return cell.cell_contents is value
    except ValueError:              # an empty cell
        return False


def is_rebound(forward) -> bool:
    """Whether ``forward`` (an instance's ``forward`` attribute) is a :func:`rebound_forward` copy."""
    return getattr(forward, "kinject_rebound", False)
