"""The ``torch-host`` host kernel of :mod:`operators.host_experts`: an experts operator's host experts
computed by :class:`kinject.engine.host_kernels.ExpertKernels` (kinject's grouped GEMV where
``pipeline.host_gemv`` lets it, torch's CPU GEMV, INT8 and INT4 weight-only kernels otherwise, at
memory speed at batch 1; docs/architecture.md "Host compute").

This module is the glue between an experts operator and those kernels: which layouts they serve
(:func:`skip`), the rule's ``host_format`` (:func:`check_host_format`), and the operator's units
handed over as the functions :class:`~kinject.engine.host_kernels.ExpertKernels` takes
(:func:`expert_kernels`), so the kernels read no operator or store state of their own.

``host_format: int8`` / ``int4`` in an experts rule's kwargs (with ``compute: host`` or ``auto``):
the host computes those experts in that format, from their weights quantized once when first
computed on the host (the store keeps its own bytes for moves: a moved expert computes as stored).
Without it, the expert's stored form decides: its own tensors, or its stored INT8 bytes
(:mod:`kinject.engine.formats.int8`) natively.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch

from kinject.engine.host_kernels import HOST_FORMATS, ExpertKernels


class HostSide(Protocol):
    """What the kernels read of the host compute site (operators.host_experts.HostExperts), named
    here so this module does not import it back: the experts (units, layout), the weights reader
    and the format the host computes in."""

    experts: Any
    weights: Callable
    host_format: str | None
    runtime: Any                   # its pipeline settings (host_gemv) only


def check_host_format(value, compute: str) -> None:
    """A rule's ``host_format`` (None, or one of :data:`~kinject.engine.host_kernels.HOST_FORMATS`,
    with ``compute`` host or auto); a ValueError whose ``.key`` is ``host_format`` otherwise."""
    if value is None:
        return
    if value not in HOST_FORMATS:
        msg = f"host_format must be one of {', '.join(HOST_FORMATS)} (or null), got {value!r}"
    elif compute == "device":
        msg = f"host_format {value!r} needs compute: host or auto (compute: device computes nothing on the host)"
    else:
        return
    err = ValueError(msg)
    err.key = "host_format"
    raise err


def skip(layout, cuda: bool, op=None, host_format: str | None = None) -> str | None:
    """Why the ``torch-host`` kernels cannot compute ``layout``'s experts (None: they can): they
    compute transformers' fused experts contract (``routed``), two unbiased projections stored
    ``[out, in]`` with the layout's own activation between, in bfloat16 (where their bits are
    transformers' own: float32 GEMMs accumulate in another order) or in a ``host_format``."""
    math = getattr(layout, "math", None)
    if math is None or layout.call != "routed":
        return f"needs transformers' fused experts contract (layout {layout.name!r})"
    if math.transposed:
        return f"computes experts stored [out, in] (layout {layout.name!r} stores them [in, out])"
    biased = [p for p in layout.params if "bias" in p]
    if biased:
        return f"computes unbiased experts only (layout {layout.name!r} has {biased})"
    dtype = _dtype(op)
    if dtype is not None and dtype != torch.bfloat16 and host_format is None:
        return (f"computes bfloat16 experts as they are (these compute in {dtype}: torch-grouped gives transformers' "
                "own bits there), or any float experts in a host_format")
    return None


def _dtype(op) -> torch.dtype | None:
    """The experts' compute dtype: their units' once registered, before that the operator's."""
    if op is None:
        return None
    units = getattr(op, "units", None)
    if units:
        return units[0].compute_dtype
    return getattr(op, "dtype", None)


def expert_kernels(host: HostSide) -> Callable:
    """The :class:`~kinject.engine.host_kernels.ExpertKernels` of ``host``'s operator."""
    experts = host.experts
    units = experts.units
    math = experts.layout.math

    def stored(e: int) -> dict:
        u = units[e]
        if u.tier != "host" or not u.quant:
            return {}
        out = {}
        for role in u.quant:
            parts = {k[len(role) + 1:]: v for k, v in u.tensors.items() if k.startswith(role + ".")}
            codec = u.stored[role] if u.stored else None
            out[role] = (parts, getattr(codec, "fmt", codec))
        return out

    dtype = units[0].compute_dtype if units else None
    from kinject.engine import host_gemv
    setting = host.runtime.pipeline.host_gemv                 # exact | fast | torch
    return ExpertKernels(gemv=None if setting == "torch" else host_gemv.load(), gemv_bf16=setting == "fast",
                         weights=host.weights, stored=stored, cacheable=lambda e: units[e].tier == "host",
                         up=math.up, down=math.down, activation=math.activation, post=math.post,
                         host_format=host.host_format,
                         compute_dtype=dtype if dtype in (torch.bfloat16, torch.float16, torch.float32) else torch.bfloat16)
