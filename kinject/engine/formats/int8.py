"""Per-channel symmetric INT8 weight-only (``format: int8``): one int8 value per weight, one scale per output row.

A weight ``W [out, in]`` (or transformers' per-expert ``[E, out, in]``) is stored as two tensors::

    weight        int8  [..., out, in]     q = clamp(round(W / s), -127, 127)
    weight_scale  float [..., out]         s = amax(|W[row]|) / 127 (1 / 127 for an all-zero row), in W's dtype

and ``W = q * s``, computed in float32 and cast to the compute dtype (:meth:`Int8Format.dequantize`):
what a device does with the bytes when the planner moves them. The host computes on the same bytes
without dequantizing (:mod:`kinject.engine.host_kernels`: torch's ``_weight_int8pack_mm``, which
computes ``(x @ q.T) * s`` accumulating in float32), so host and device see the same stored bytes
and differ only in where the rounding to the compute dtype happens. 1 byte per weight plus
``dtype bytes / in`` for the scales: 0.502 of bfloat16 at ``in = 1024``.

The scale is kept in the weight's own dtype (bfloat16 for a bfloat16 model) because that is the
dtype torch's CPU kernel takes it in: the host kernel then uses the stored scale in place.
:func:`quantize` is the encoder (a rule's ``quant: {format: int8}``, docs/architecture.md "Stored formats").
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kinject.engine.formats.base import FormatError, Layout, StoredFormat
from kinject.formatting import format_shape

QMAX = 127
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """``weight`` (float, ``[..., out, in]``) -> its storage tensors ``{"weight": int8, "weight_scale": [..., out]}``.

    Symmetric, per output row: ``s = amax / 127`` in float32 (``1 / 127`` where a row is all zero,
    so ``q`` is 0 and nothing divides by zero), rounded to the weight's dtype first, then
    ``q = clamp(round(W / s), -127, 127)`` with that rounded scale, so ``q * s`` is the stored
    arithmetic exactly."""
    if not isinstance(weight, torch.Tensor) or weight.dim() < 2 or weight.dtype not in _FLOAT_DTYPES:
        got = f"{weight.dtype} {list(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise FormatError(f"int8: quantizes float weights of at least 2 dims ([..., out, in]), got {got}")
    w = weight.detach().to(torch.float32)
    amax = w.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax, torch.ones_like(amax)) / QMAX
    scale = scale.to(weight.dtype)
    q = torch.round(w / scale.to(torch.float32).unsqueeze(-1)).clamp_(-QMAX, QMAX).to(torch.int8)
    return {"weight": q.contiguous(), "weight_scale": scale.contiguous()}


def dequantize(parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``q * s`` in float32, cast to ``dtype`` (leading expert dims carried through)."""
    q, s = parts["weight"], parts["weight_scale"]
    return (q.to(torch.float32) * s.to(torch.float32).unsqueeze(-1)).to(dtype)


class Int8Format(StoredFormat):
    """Codec of ``format: int8``: per-channel symmetric int8 values + one scale per output row."""

    method: ClassVar[str] = "int8"
    storage_suffixes: ClassVar[tuple[str, ...]] = ("weight_scale",)

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> "Int8Format":
        extra = sorted(k for k in qconfig if k not in ("quant_method", "format"))
        if extra:
            raise FormatError(f"{where}: quantization_config.{extra[0]} is not a setting of format int8 "
                              "(per-channel symmetric int8 takes none)")
        return cls()

    def storage_keys(self, name: str) -> dict[str, str] | None:
        if not name.endswith("weight") and not name.endswith("_proj"):
            return None
        return {"weight": name, "weight_scale": name + "_scale"}

    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        if set(parts) != {"weight", "weight_scale"}:
            raise FormatError(f"{name}: int8 stores 'weight' and 'weight_scale', got {sorted(parts)}")
        (qshape, qdtype), (sshape, sdtype) = parts["weight"], parts["weight_scale"]
        if qdtype != torch.int8 or tuple(qshape) != tuple(shape):
            raise FormatError(f"{name}: int8 values must be int8 {format_shape(shape)}, got {qdtype} {format_shape(qshape)}")
        if sdtype not in _FLOAT_DTYPES or tuple(sshape) != tuple(shape[:-1]):
            raise FormatError(f"{name}: int8 scale must be float {format_shape(shape[:-1])}, "
                              f"got {sdtype} {format_shape(sshape)}")

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return dequantize(parts, dtype)

    def describe(self) -> str:
        return "int8 per-channel symmetric"


def encode(weight: torch.Tensor, settings: dict | None = None) -> tuple[dict[str, torch.Tensor], Int8Format]:
    """An encoder of the quantize-by-rule kind (``(weight, settings) -> (storage tensors, codec)``):
    :func:`quantize` with the codec that decodes it; format int8 takes no settings."""
    if settings:
        raise FormatError(f"int8: takes no settings (per-channel symmetric), got {sorted(settings)}")
    return quantize(weight), Int8Format()
