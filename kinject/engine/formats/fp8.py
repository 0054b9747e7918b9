"""Fine-grained FP8 (``quant_method: fp8``): DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8, GLM-4.5-FP8, MiniMax-M2.

Each quantized weight is stored as ``<name>`` (``float8_e4m3fn`` values, the weight's shape) and
``<name>_scale_inv`` (float32 multipliers, one per ``weight_block_size`` block: ``[ceil(R/128),
ceil(C/128)]``; one per row for per-channel checkpoints; one per tensor). Dequantization is
transformers' own (``Fp8Dequantize``, what its CPU ``from_pretrained`` runs): ``q.float() * s``
per block, cast to the model's dtype, so the weights are bit-identical to its load.
"""

from __future__ import annotations

import functools
import math
import re
from typing import ClassVar

import torch

from kinject.engine.formats.base import FormatError, Layout, StoredFormat, check_keys
from kinject.formatting import format_shape

_VALUE_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
_E8M0 = tuple(d for d in (torch.uint8, getattr(torch, "float8_e8m0fnu", None)) if d is not None)


class FP8Format(StoredFormat):
    """Block-wise, per-channel or per-tensor FP8 weights with float (or UE8M0) scales."""

    method: ClassVar[str] = "fp8"
    storage_suffixes: ClassVar[tuple[str, ...]] = ("weight_scale_inv", "_scale_inv", "activation_scale")

    def __init__(self, block: tuple[int, int] | None, skip: tuple[str, ...] = (), scale_fmt: str = "float",
                 static_activations: bool = False):
        self.block, self.skip, self.scale_fmt = block, skip, scale_fmt
        self.static_activations = static_activations

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> FP8Format:
        check_keys(qconfig, {"activation_scheme": ("dynamic", "static"), "scale_fmt": ("float", "ue8m0"),
                             "expert_dtype": ("fp8",), "modules_to_convert": (None, [])},
                   method=cls.method, where=where)
        block = qconfig.get("weight_block_size", (128, 128))
        if block is not None:
            if not (isinstance(block, (list, tuple)) and len(block) == 2
                    and all(isinstance(b, int) and b > 0 for b in block)):
                raise FormatError(f"{where}: quantization_config.weight_block_size = {block!r} is not supported "
                                  "(supported: two positive integers, e.g. [128, 128], or null)")
            block = (int(block[0]), int(block[1]))
        skip = qconfig.get("modules_to_not_convert") or qconfig.get("ignored_layers") or ()
        return cls(block, tuple(skip), qconfig.get("scale_fmt", "float"),
                   qconfig.get("activation_scheme", "dynamic") == "static")

    def describe(self) -> str:
        return f"fp8, weight_block_size {list(self.block) if self.block else None}, scales {self.scale_fmt}"

    # ---- keys ------------------------------------------------------------------------------

    def storage_keys(self, name: str) -> dict[str, str] | None:
        """``x.weight`` -> ``x.weight`` + ``x.weight_scale_inv``; a fused experts parameter
        ``experts.gate_up_proj`` (transformers' ``FP8Experts``) -> ``+ experts.gate_up_proj_scale_inv``."""
        if name.endswith(".weight"):
            module, scale = name[: -len(".weight")], name + "_scale_inv"
        elif re.search(r"\.experts\.\w+_proj$", name):
            module, scale = name.rpartition(".")[0], name + "_scale_inv"
        else:
            return None
        if not self._converted(module):
            return None
        keys = {"weight": name, "weight_scale_inv": scale}
        if self.static_activations and name.endswith(".weight"):   # unused by dequantization, as in transformers
            keys["activation_scale"] = module + ".activation_scale"
        return keys

    def _converted(self, module: str) -> bool:
        """transformers' ``should_convert_module`` over ``modules_to_not_convert``: a name from the
        start up to a module boundary, as a regex with that boundary, or as a suffix."""
        boundary = r"(?:(?<=\.)|(?=\.|$))"
        return not any(re.match(rf"(?:{key}){boundary}", module) or module.endswith(key) for key in self.skip)

    # ---- checks ----------------------------------------------------------------------------

    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        wshape, wdtype = parts["weight"]
        if len(wshape) > 2:
            # releases store one 2-D weight per expert; transformers (5.24) does not dequantize
            # experts fused into one [E, ...] tensor (it uses their raw float8 values): with no
            # reference to match, kinject's own reading would be a different answer, not an error
            raise FormatError(f"tensor '{name}': FP8 values stored fused as one {format_shape(wshape)} tensor; "
                              "kinject reads FP8 checkpoints with one 2-D weight per expert (the layout "
                              "releases use and transformers dequantizes)")
        if wdtype not in _VALUE_DTYPES:
            raise FormatError(f"tensor '{name}': FP8 values stored as {wdtype}, expected float8_e4m3fn")
        if tuple(wshape) != tuple(shape):
            raise FormatError(f"tensor '{name}': FP8 values have shape {format_shape(wshape)}, "
                              f"the model's weight is {format_shape(shape)}")
        sshape, sdtype = parts["weight_scale_inv"]
        self._check_scale_dtype(name, sdtype)
        grid = self._grid(name, tuple(sshape), tuple(shape))
        rows, cols = shape[-2:]
        if self.block and grid != (math.ceil(rows / self.block[0]), math.ceil(cols / self.block[1])):
            raise FormatError(f"tensor '{name}': scale has shape {format_shape(sshape)}, which does not fit the weight "
                              f"{format_shape(shape)}" + self._expected(shape))
        for n, g, b, what in ((rows, grid[0], self.block and self.block[0], "rows"),
                              (cols, grid[1], self.block and self.block[1], "columns")):
            if n % g:
                raise FormatError(f"tensor '{name}': its {n} {what} do not divide into the {g} blocks of "
                                  f"scale {format_shape(sshape)} (weight {format_shape(shape)})")
            if b and g == math.ceil(n / b) and g > 1 and n // g != b:
                raise FormatError(f"tensor '{name}': {n} {what} in blocks of {b} leave a partial block that "
                                  f"transformers' dequantization reads as {g} blocks of {n // g}; not supported")

    def _check_scale_dtype(self, name: str, dtype: torch.dtype) -> None:
        ok = dtype in _E8M0 if self.scale_fmt == "ue8m0" else dtype.is_floating_point and dtype not in _E8M0
        if not ok:
            raise FormatError(f"tensor '{name}': scale stored as {dtype}, expected "
                              + ("uint8 / float8_e8m0fnu exponents" if self.scale_fmt == "ue8m0" else "float32")
                              + f" (scale_fmt {self.scale_fmt!r})")

    def _grid(self, name: str, sshape: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, int]:
        """(row blocks, column blocks) of a scale tensor: one per tensor (a scalar or ``[1]``), or its
        last two dims with the weight's leading (expert) dims before them."""
        if math.prod(sshape) == 1 and len(sshape) <= len(shape):
            return 1, 1
        if len(sshape) != len(shape) or sshape[:-2] != shape[:-2]:
            raise FormatError(f"tensor '{name}': scale has shape {format_shape(sshape)}, which is no block grid of "
                              f"the weight {format_shape(shape)}" + self._expected(shape))
        return sshape[-2], sshape[-1]

    def _expected(self, shape: tuple[int, ...]) -> str:
        if not self.block:
            return ""
        grid = shape[:-2] + (math.ceil(shape[-2] / self.block[0]), math.ceil(shape[-1] / self.block[1]))
        return f" (expected {format_shape(grid)} for blocks of {list(self.block)})"

    # ---- values ----------------------------------------------------------------------------

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """transformers' ``Fp8Dequantize._dequantize_one`` (``activation_scale`` plays no part in it)."""
        return _dequantizer()._dequantize_one(parts["weight"], parts["weight_scale_inv"], output_dtype=dtype)


@functools.cache
def _dequantizer():
    """transformers' FP8 dequantization operation (it keeps no state of its own)."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    return Fp8Dequantize(None)
