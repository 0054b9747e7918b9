"""MXFP4 (``quant_method: mxfp4``): the experts of gpt-oss as the releases ship them.

A fused experts parameter that transformers holds as ``gate_up_proj`` ``[E, H, 2I]`` (``down_proj``
``[E, I, H]``) is stored transposed and packed as two tensors::

    gate_up_proj_blocks  uint8 [E, 2I, H/32, 16]   two e2m1 codes per byte, low nibble first
    gate_up_proj_scales  uint8 [E, 2I, H/32]       one E8M0 exponent (bias 127) per 32 values

so one expert's storage is the slice ``[e]`` of both. :meth:`MXFP4Format.dequantize` repeats the
arithmetic of transformers' CPU load (``integrations/mxfp4.py``, ``_convert_moe_packed_tensors``:
a lookup of the code in a table of the target dtype, then ``torch.ldexp`` by the exponent, then the
transpose), so the result is bit-identical to the parameter ``from_pretrained`` builds.
"""

from __future__ import annotations

import functools
from typing import ClassVar

import torch

from kinject.engine.formats.base import FormatError, Layout, StoredFormat
from kinject.formatting import format_shape

# e2m1 code (sign << 3 | magnitude index) -> value; the order of transformers' FP4_VALUES.
FP4_VALUES: tuple[float, ...] = (
    +0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)
BLOCK = 32                    # values sharing one E8M0 scale
PACKED = BLOCK // 2           # bytes holding one block
E8M0_BIAS = 127
PROJECTIONS = ("gate_up_proj", "down_proj")   # the fused experts parameters a release packs
_CONFIG_KEYS = {"quant_method", "modules_to_not_convert", "dequantize"}


@functools.lru_cache(maxsize=None)
def _should_convert():
    """transformers' own module matcher for ``modules_to_not_convert`` (prefix, regex, suffix)."""
    from transformers.quantizers.quantizers_utils import should_convert_module
    return should_convert_module


class MXFP4Format(StoredFormat):
    """Codec of ``quant_method: mxfp4``: storage keys, checks, dequantize and bytes of one weight."""

    method: ClassVar[str] = "mxfp4"
    storage_suffixes: ClassVar[tuple[str, ...]] = tuple(f"{p}_{part}" for p in PROJECTIONS
                                                       for part in ("blocks", "scales"))

    def __init__(self, modules_to_not_convert: tuple[str, ...] = (), where: str = "quantization_config"):
        self.modules_to_not_convert = tuple(modules_to_not_convert)
        self.where = where

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> MXFP4Format:
        """Validate a checkpoint's ``quantization_config``; refuse keys that would change the meaning."""
        if qconfig.get("quant_method") != cls.method:
            raise FormatError(f"{where}: quant_method {qconfig.get('quant_method')!r} is not {cls.method!r}")
        unknown = sorted(set(qconfig) - _CONFIG_KEYS)
        if unknown:
            raise FormatError(f"{where}: key {unknown[0]!r} of an mxfp4 quantization_config is not supported "
                              f"(supported keys: {', '.join(sorted(_CONFIG_KEYS))})")
        skip = qconfig.get("modules_to_not_convert") or []
        if not isinstance(skip, list | tuple) or not all(isinstance(s, str) for s in skip):
            raise FormatError(f"{where}: key 'modules_to_not_convert' must be a list of module names or "
                              f"patterns, got {skip!r}")
        return cls(tuple(skip), where)

    def storage_keys(self, name: str) -> dict[str, str] | None:
        """``...experts.gate_up_proj`` -> its ``_blocks`` / ``_scales`` keys; ``None`` where not packed."""
        module, _, param = name.rpartition(".")
        if param not in PROJECTIONS:
            return None
        if not _should_convert()(module, list(self.modules_to_not_convert)):
            return None
        return {"blocks": f"{name}_blocks", "scales": f"{name}_scales"}

    def weight_name(self, key: str) -> str | None:
        """The weight a storage key belongs to (``..._blocks`` -> ``...``), or ``None``.

        Lets a reader build the logical tensors from the checkpoint's own keys, where the
        weight's name is no key (with :meth:`logical_shape` for its shape).
        """
        for part in ("blocks", "scales"):
            name = key.removesuffix(f"_{part}")
            if name != key and (self.storage_keys(name) or {}).get(part) == key:
                return name
        return None

    def logical_shape(self, name: str, parts: Layout) -> tuple[int, ...]:
        """Weight ``name``'s shape from its storage layout: blocks ``[..., R, G, 16]`` -> ``[..., G*32, R]``."""
        *prefix, rows, n_blocks, _ = (int(d) for d in parts["blocks"][0])
        return (*prefix, n_blocks * BLOCK, rows)

    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        """Refuse blocks / scales whose dtype or shape cannot dequantize to ``shape`` (whole or one expert)."""
        keys = self.storage_keys(name) or {"blocks": f"{name}_blocks", "scales": f"{name}_scales"}
        missing = sorted(set(keys) - set(parts))
        if missing:
            raise FormatError(f"{self.where}: tensor '{keys[missing[0]]}' is missing ({name} is stored as MXFP4)")
        (b_shape, b_dtype), (s_shape, s_dtype) = parts["blocks"], parts["scales"]
        for part, dtype in (("blocks", b_dtype), ("scales", s_dtype)):
            if dtype != torch.uint8:
                raise FormatError(f"tensor '{keys[part]}': dtype {_dtype_name(dtype)}, MXFP4 {part} are uint8")
        b_shape, s_shape, shape = tuple(b_shape), tuple(s_shape), tuple(shape)
        if len(b_shape) < 3 or b_shape[-1] != PACKED:
            raise FormatError(f"tensor '{keys['blocks']}': shape {format_shape(b_shape)}, expected "
                              f"[..., rows, n_blocks, {PACKED}]")
        if s_shape != b_shape[:-1]:
            raise FormatError(f"tensor '{keys['scales']}': shape {format_shape(s_shape)} does not fit {keys['blocks']} "
                              f"{format_shape(b_shape)} (expected {format_shape(b_shape[:-1])})")
        expected = self.logical_shape(name, parts)
        if shape != expected:
            raise FormatError(f"tensor '{keys['blocks']}': shape {format_shape(b_shape)} dequantizes to {format_shape(expected)}, "
                              f"but {name} is {format_shape(shape)}")

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Blocks ``[..., R, G, 16]`` + scales ``[..., R, G]`` -> weight ``[..., G*32, R]`` in ``dtype``.

        Same table lookup, ``ldexp`` and transpose as transformers' dequantizing load, so the
        bits match its parameter; ``[e]`` slices give expert ``e``'s ``param[e]``.
        """
        blocks, scales = parts["blocks"].to(torch.uint8), parts["scales"]          # [..., R, G, 16], [..., R, G]
        lut = torch.tensor(FP4_VALUES, dtype=dtype, device=blocks.device)
        out = torch.empty(*blocks.shape[:-1], BLOCK, dtype=dtype, device=blocks.device)   # [..., R, G, 32]
        out[..., 0::2] = lut[(blocks & 0x0F).to(torch.int)]
        out[..., 1::2] = lut[(blocks >> 4).to(torch.int)]
        exponents = (scales.to(torch.int32) - E8M0_BIAS).unsqueeze(-1)            # [..., R, G, 1]
        torch.ldexp(out, exponents, out=out)
        return out.flatten(-2).transpose(-1, -2).contiguous()                     # [..., G*32, R]

    def describe(self) -> str:
        return f"mxfp4, modules_to_not_convert {list(self.modules_to_not_convert)}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
