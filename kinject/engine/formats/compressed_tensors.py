"""compressed-tensors ``pack-quantized`` (``quant_method: compressed-tensors``): INT4 / INT8 weights.

The layout of the INT4 MoE releases made for vLLM (Kimi-K2-Thinking, the W4A16 Qwen3 / DeepSeek
conversions). A Linear weight ``W [out, in]`` named ``X.weight`` is stored as::

    X.weight_packed      int32 [out, ceil(in * bits / 32)]   values + 2**(bits-1), element i of a row
                                                           at bit i*bits of the row's word stream
    X.weight_scale       float [out, in / group_size]        ("group"), or [out, 1] ("channel")
    X.weight_shape       int   [2]                           (out, in)
    X.weight_zero_point  int32 [ceil(out * bits / 32), n]    asymmetric only; packed along dim 0

and ``W = (q - zero_point) * scale`` computed in the scale's dtype, then cast to the model's, as
the ``compressed-tensors`` package does (``PackedQuantizationCompressor.decompress`` ->
``unpack_from_int32`` -> ``dequantize``), which is what transformers' load calls. This module does
the same arithmetic in plain torch; the package is needed only as the reference in tests.

Which weights are quantized comes from ``config_groups[*].targets`` minus ``ignore``: ``re:``
patterns match the module name (``re.match``), other targets an exact module name or a class name
of the module (``Linear``). Class names need the module: :func:`module_classes` derives them from a
model, with the per-expert projections of fused experts counted as ``Linear`` as
compressed-tensors counts them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import ClassVar

import torch

from kinject.engine.formats.base import FormatError, Layout, StoredFormat
from kinject.formatting import format_shape

PACKED_FORMATS = ("pack-quantized",)
SUPPORTED_BITS = (4, 8)                 # bit widths whose values never straddle an int32
SUPPORTED_STRATEGIES = ("group", "channel")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_INT_DTYPES = (torch.int32, torch.int64)
_EXPERT_PROJECTION = re.compile(r"\.experts\.\d+\.[^.]+$")

# module name -> class names of the module and its bases (None: not a module of the model)
ModuleClasses = Callable[[str], "tuple[str, ...] | None"]


class CompressedTensorsFormat(StoredFormat):
    """Codec of ``quant_method: compressed-tensors`` with ``format: pack-quantized`` INT weights."""

    method: ClassVar[str] = "compressed-tensors"
    storage_suffixes: ClassVar[tuple[str, ...]] = (
        "weight_packed", "weight_scale", "weight_shape", "weight_zero_point", "weight_g_idx", "weight_global_scale")

    def __init__(self, groups: list[dict], ignore: tuple[str, ...], where: str,
                 module_class: ModuleClasses | None = None):
        self.groups = groups          # [{"name", "targets", "num_bits", "strategy", "group_size", "symmetric"}]
        self.ignore = ignore
        self.where = where
        self.module_class = module_class

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> CompressedTensorsFormat:
        """Validate a ``quantization_config``: every group must be a weight-only INT scheme we decode."""
        if qconfig.get("quant_method") != cls.method:
            raise FormatError(f"{where}: quant_method {qconfig.get('quant_method')!r} is not {cls.method!r}")
        if cls is CompressedTensorsFormat and qconfig.get("format") in ("nvfp4-pack-quantized", "mxfp4-pack-quantized"):
            # FP4 values have their own codec, ahead of this one in the chain (kinject.engine.formats.fp4)
            raise FormatError(f"{where}: key 'format' = {qconfig.get('format')!r} is FP4, read by "
                              "kinject.engine.formats.fp4.CompressedFP4Format (format_for chooses it)")
        _require(qconfig.get("format"), PACKED_FORMATS + ("nvfp4-pack-quantized", "mxfp4-pack-quantized"), where,
                 "format")
        status = qconfig.get("quantization_status", "compressed")
        _require(status, ("compressed",), where, "quantization_status")
        for key in ("kv_cache_scheme", "sparsity_config", "transform_config"):
            if qconfig.get(key):
                raise FormatError(f"{where}: key {key!r} is not supported (only weight quantization is)")
        groups = qconfig.get("config_groups") or {}
        if not groups:
            raise FormatError(f"{where}: key 'config_groups' is empty; nothing says how weights are stored")
        parsed = [_parse_group(name, group, f"{where}: config_groups.{name}") for name, group in groups.items()]
        ignore = qconfig.get("ignore") or []
        if not isinstance(ignore, list | tuple) or not all(isinstance(i, str) for i in ignore):
            raise FormatError(f"{where}: key 'ignore' must be a list of module names or 're:' patterns")
        return cls(parsed, tuple(ignore), where)

    def bind(self, model: torch.nn.Module) -> CompressedTensorsFormat:
        """Resolve class-name targets (``Linear``) against ``model``'s modules; returns ``self``.

        Without it only ``re:`` / exact-name targets and the per-expert projections of fused
        experts match, so a ``Linear`` weight stored packed would be looked up as a float key and
        reported missing (never read as float).
        """
        self.module_class = module_classes(model)
        return self

    def group_of(self, name: str) -> dict | None:
        """The config group storing weight ``name`` (``X.weight``), or ``None`` where it stays float."""
        module, _, param = name.rpartition(".")
        if param != "weight" or self._matches(module, self.ignore):
            return None
        return next((g for g in self.groups if self._matches(module, g["targets"])), None)

    def storage_keys(self, name: str) -> dict[str, str] | None:
        """``X.weight`` -> ``X.weight_packed`` / ``_scale`` / ``_shape`` (+ ``_zero_point``); ``None`` if float."""
        group = self.group_of(name)
        if group is None:
            return None
        parts = ["weight_packed", "weight_scale", "weight_shape"]
        if not group["symmetric"]:
            parts.append("weight_zero_point")
        module = name.rpartition(".")[0]
        return {part: f"{module}.{part}" for part in parts}

    def weight_name(self, key: str) -> str | None:
        """The weight a storage key belongs to (``X.weight_packed`` -> ``X.weight``), or ``None``.

        Lets a reader build the logical tensors from the checkpoint's own keys (per-expert
        ``experts.N.gate_proj.weight``, which a transformers 5 model fuses and so does not name).
        """
        module, _, part = key.rpartition(".")
        keys = self.storage_keys(f"{module}.weight")
        return f"{module}.weight" if keys and keys.get(part) == key else None

    def logical_shape(self, name: str, parts: Layout) -> tuple[int, int]:
        """``[out, in]`` of weight ``name`` from its storage layout (``weight_shape``'s values are data).

        Exact for group scales (``in = n_groups * group_size``); for channel scales ``in`` is the
        packed width, exact when it is a multiple of ``32 / bits`` values (checked again against
        ``weight_shape`` when dequantizing).
        """
        group = self.group_of(name)
        if group is None:
            raise FormatError(f"{self.where}: tensor '{name}' is not quantized by any config group")
        out, words = (int(d) for d in parts["weight_packed"][0][-2:])
        if group["strategy"] == "group":
            return out, int(parts["weight_scale"][0][-1]) * group["group_size"]
        return out, words * (32 // group["num_bits"])

    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        """Refuse stored tensors whose dtype or shape cannot dequantize to ``shape`` ``[out, in]``."""
        group = self.group_of(name)
        keys = self.storage_keys(name)
        if group is None or keys is None:
            raise FormatError(f"{self.where}: tensor '{name}' is not quantized by any config group")
        missing = sorted(set(keys) - set(parts))
        if missing:
            raise FormatError(f"{self.where}: tensor '{keys[missing[0]]}' is missing "
                              f"({name} is stored pack-quantized)")
        if len(shape) != 2:
            raise FormatError(f"tensor '{name}': shape {format_shape(shape)}; pack-quantized weights are 2-D [out, in]")
        expected = _expected_parts(name, group, tuple(shape))
        for part, key in keys.items():
            got_shape, got_dtype = tuple(parts[part][0]), parts[part][1]
            want_shape, want_dtypes = expected[part]
            if got_dtype not in want_dtypes:
                raise FormatError(f"tensor '{key}': dtype {_dtype_name(got_dtype)}, expected "
                                  f"{' or '.join(_dtype_name(d) for d in want_dtypes)}")
            if got_shape != want_shape:
                raise FormatError(f"tensor '{key}': shape {format_shape(got_shape)} does not fit {name} "
                                  f"{format_shape(shape)} ({_describe(group)}: expected {format_shape(want_shape)})")

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """Stored tensors of one weight -> ``[..., out, in]`` in ``dtype``, as compressed-tensors computes it.

        The scheme is read off the parts (bits from the packed width, group size from the scale's,
        zero points where present), so a leading expert dim may be stacked on every part.
        Channel scales are groups of the whole row: the same products element by element.
        """
        packed, scale = parts["weight_packed"], parts["weight_scale"]             # [..., out, W], [..., out, G]
        out, cols = self._logical_shape(parts["weight_shape"])
        bits = self._bits(cols, packed.shape[-1])
        if packed.shape[-2] != out or cols % scale.shape[-1]:
            raise FormatError(f"{self.where}: weight_shape {[out, cols]} does not fit weight_packed "
                              f"{format_shape(packed.shape)} / weight_scale {format_shape(scale.shape)}")
        groups = scale.shape[-1]
        q = unpack_int32(packed, bits, cols).unflatten(-1, (groups, cols // groups))   # [..., out, G, g] int8
        w = q.to(scale.dtype)
        zero = parts.get("weight_zero_point")
        if zero is not None:
            zero = unpack_int32(zero.transpose(-1, -2), bits, out).transpose(-1, -2)   # [..., out, G] int8
            w = w - zero.unsqueeze(-1).to(scale.dtype)
        w = w * scale.unsqueeze(-1)                                               # in the scale's dtype
        return w.flatten(-2).to(dtype)                                            # [..., out, in]

    def describe(self) -> str:
        return "compressed-tensors pack-quantized " + ", ".join(_describe(g) for g in self.groups)

    def _logical_shape(self, weight_shape: torch.Tensor) -> tuple[int, int]:
        """(out, in) from ``weight_shape`` (one row per stacked expert, all the same)."""
        rows = weight_shape.reshape(-1, 2).tolist()
        if any(row != rows[0] for row in rows):
            raise FormatError(f"{self.where}: stacked weight_shape rows differ ({rows[0]} vs others)")
        return int(rows[0][0]), int(rows[0][1])

    def _bits(self, cols: int, words: int) -> int:
        """The configured bit width that packs ``cols`` values into ``words`` int32s (exactly one)."""
        widths = sorted({g["num_bits"] for g in self.groups})
        fits = [b for b in widths if math.ceil(cols * b / 32) == words]
        if len(fits) != 1:
            raise FormatError(f"{self.where}: weight_packed has {words} int32 words per row for {cols} values, "
                              f"which {'fits several' if fits else 'fits none'} of the configured widths {widths}")
        return fits[0]

    def _matches(self, module: str, targets) -> bool:
        """compressed-tensors' rule: ``re:`` regex on the name, else exact name or class name."""
        classes: tuple[str, ...] | None = None
        for target in targets:
            if target.startswith("re:"):
                if re.match(target.removeprefix("re:"), module):
                    return True
                continue
            if target == module:
                return True
            if classes is None:
                classes = self._classes(module)
            if target in classes:
                return True
        return False

    def _classes(self, module: str) -> tuple[str, ...]:
        if self.module_class is not None:
            found = self.module_class(module)
            if found is not None:
                return found
        # a per-expert projection of a fused experts module (the checkpoint's names) is a Linear
        return ("Linear",) if _EXPERT_PROJECTION.search(module) else ()


def module_classes(model: torch.nn.Module) -> ModuleClasses:
    """Class names (MRO) of ``model``'s modules by name, for matching class targets like ``Linear``."""
    table = {name: tuple(c.__name__ for c in type(m).__mro__) for name, m in model.named_modules()}
    return table.get


def unpack_int32(packed: torch.Tensor, bits: int, cols: int) -> torch.Tensor:
    """``[rows, words]`` int32 -> ``[rows, cols]`` int8 signed values (``bits`` in 4, 8).

    Element ``i`` of a row sits at bit ``(i % per_word) * bits`` of word ``i // per_word`` and is
    stored offset by ``2**(bits-1)``; the bytes of a word are read as the integer's value, so this is
    independent of the host's byte order.
    """
    per_word = 32 // bits
    shifts = torch.arange(per_word, dtype=torch.int32, device=packed.device) * bits
    fields = (packed.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [rows, words, per_word]
    values = fields.flatten(-2)[..., :cols]                                       # [rows, cols]
    return (values - (1 << (bits - 1))).to(torch.int8)


def _parse_group(name: str, group: dict, where: str) -> dict:
    """One config group -> the fields decoding needs; refuses schemes we would decode wrongly."""
    if group.get("format") is not None:
        _require(group["format"], PACKED_FORMATS, where, "format")
    targets = group.get("targets") or []
    if not targets:
        raise FormatError(f"{where}: key 'targets' is empty")
    for key in ("input_activations", "output_activations"):
        if group.get(key):
            raise FormatError(f"{where}: key {key!r} is set (activation quantization); only weight-only "
                              "schemes (W4A16, W8A16) are supported")
    weights = group.get("weights")
    if not weights:
        raise FormatError(f"{where}: key 'weights' is missing")
    _require(weights.get("type", "int"), ("int",), where, "weights.type")
    _require(weights.get("num_bits"), SUPPORTED_BITS, where, "weights.num_bits")
    _require(weights.get("strategy"), SUPPORTED_STRATEGIES, where, "weights.strategy")
    for key, refused in (("dynamic", "dynamic weight scales"), ("actorder", "activation-order (g_idx) groups"),
                         ("block_structure", "block scales")):
        if weights.get(key) not in (None, False):
            raise FormatError(f"{where}: key 'weights.{key}' = {weights[key]!r} ({refused}) is not supported")
    group_size = weights.get("group_size")
    if weights["strategy"] == "group" and (not isinstance(group_size, int) or group_size <= 0):
        raise FormatError(f"{where}: key 'weights.group_size' = {group_size!r}; strategy 'group' needs a "
                          "positive integer")
    return {"name": name, "targets": tuple(targets), "num_bits": weights["num_bits"],
            "strategy": weights["strategy"], "group_size": group_size,
            "symmetric": bool(weights.get("symmetric", True))}


def _require(value, supported: tuple, where: str, key: str) -> None:
    if value not in supported:
        raise FormatError(f"{where}: key {key!r} = {value!r} is not supported "
                          f"(supported: {', '.join(repr(s) for s in supported)})")


def _expected_parts(name: str, group: dict, shape: tuple[int, int]) -> dict[str, tuple[tuple[int, ...], tuple]]:
    """Part -> (shape, allowed dtypes) of weight ``name`` ``[out, in]`` stored under ``group``."""
    out, cols = shape
    bits = group["num_bits"]
    n_scales = 1
    if group["strategy"] == "group":
        if cols % group["group_size"]:
            raise FormatError(f"tensor '{name}': in-features {cols} is not a multiple of group_size "
                              f"{group['group_size']}")
        n_scales = cols // group["group_size"]
    return {
        "weight_packed": ((out, math.ceil(cols * bits / 32)), (torch.int32,)),
        "weight_scale": ((out, n_scales), _FLOAT_DTYPES),
        "weight_shape": ((2,), _INT_DTYPES),
        "weight_zero_point": ((math.ceil(out * bits / 32), n_scales), (torch.int32,)),
    }


def _describe(group: dict) -> str:
    size = f" {group['group_size']}" if group["strategy"] == "group" else ""
    return f"int{group['num_bits']} {group['strategy']}{size}"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
