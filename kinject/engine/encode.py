"""Quantize by rule: a rule's ``quant:`` names a stored format, and kinject encodes the weights into
it (docs/architecture.md, "Stored formats").

A checkpoint released quantized arrives as storage tensors that a
:class:`~kinject.engine.formats.base.StoredFormat` decodes on the compute device right before use.
This module makes the same storage tensors from float weights, so a weight quantized by a rule is
held, moved, counted and decoded exactly like one a release ships: one decode path serves both.

    quant: {format: fp8, block: [128, 128]}      # FP8 e4m3, one float32 scale per 128x128 block
    quant: {format: fp8, block: channel}         # FP8 e4m3, one scale per output row
    quant: {format: int4, group_size: 32}        # compressed-tensors pack-quantized, symmetric
    quant: {format: mxfp4}                       # OCP MX: e2m1 values, one E8M0 scale per 32
    quant: {format: hqq, nbits: 4, group_size: 64}   # HQQ (also the old form {nbits: 4, group_size: 64})
    quant: {per_expert: {'[0-3]': {format: fp8}, '.*': {format: mxfp4}}}   # experts operators: by expert index

Each encoder repeats the arithmetic of the quantizer that makes the shipped format (transformers'
``Fp8Quantize`` for FP8; compressed-tensors' ``calculate_qparams`` + ``quantize`` + ``pack_to_int32``
for INT4 and its MXFP4 compressor for MXFP4), bit for bit (tests/engine/test_encode.py compares them).
All group along the last dimension of a 2-D weight: the input dimension of an ``[out, in]``
Linear weight and of transformers' per-expert ``[out, in]`` slices.

A new format is one function and one :func:`register` call::

    def encode_int8(weight, settings) -> tuple[dict[str, torch.Tensor], StoredFormat]: ...
    register(Encoder("int8", encode_int8, keys={"group_size": None}, check=...))
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kinject.engine.formats.base import StoredFormat
from kinject.engine.quant import QuantError, QuantSpec

__all__ = ["ENCODERS", "EncodeSpec", "Encoder", "PerExpertQuant", "encode", "encode_unit", "parse_quant", "register"]

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
Encoded = tuple[dict[str, torch.Tensor], StoredFormat]


@dataclass(frozen=True)
class Encoder:
    """One stored format kinject can encode into.

    ``encode(weight, settings)``: a 2-D float weight -> (its storage tensors by role, the codec that
    decodes them); it raises :class:`QuantError` naming the shape where the format cannot hold it.
    ``keys``: the settings a rule may give, with their defaults. ``check(settings)``: the settings
    normalised, or :class:`QuantError` naming the bad key (run when the rule file is read)."""

    name: str
    encode: Callable[[torch.Tensor, dict], Encoded]
    keys: dict[str, Any] = field(default_factory=dict)
    check: Callable[[dict], dict] = lambda settings: settings
    describe: Callable[[dict], str] | None = None


ENCODERS: dict[str, Encoder] = {}


def register(encoder: Encoder) -> Encoder:
    """Add (or replace) the encoder of ``encoder.name``: rules may then say ``{format: <name>}``."""
    ENCODERS[encoder.name] = encoder
    return encoder


@dataclass(frozen=True)
class EncodeSpec:
    """A rule's ``quant:`` choice of a stored format other than HQQ: the format and its settings."""

    format: str
    settings: tuple[tuple[str, Any], ...] = ()

    @property
    def options(self) -> dict[str, Any]:
        return dict(self.settings)

    def to_dict(self) -> dict[str, Any]:
        return {"format": self.format, **{k: list(v) if isinstance(v, tuple) else v for k, v in self.settings}}

    def describe(self) -> str:
        enc = ENCODERS[self.format]
        return enc.describe(self.options) if enc.describe else self.format

    def __str__(self) -> str:
        return self.describe()


@dataclass(frozen=True)
class PerExpertQuant:
    """``quant: {per_expert: {REGEX: QUANT, ...}}`` of an experts operator: expert ``e`` takes the
    first QUANT whose REGEX matches ``str(e)`` whole (``'[0-3]'``, ``'.*'``); QUANT ``null`` or no
    match: the checkpoint's precision."""

    choices: tuple[tuple[str, QuantSpec | EncodeSpec | None], ...]

    def for_expert(self, e: int) -> QuantSpec | EncodeSpec | None:
        return next((q for regex, q in self.choices if re.fullmatch(regex, str(e))), None)

    def to_dict(self) -> dict[str, Any]:
        return {"per_expert": {regex: q.to_dict() if q is not None else None for regex, q in self.choices}}


def parse_quant(value: Mapping[str, Any] | QuantSpec | EncodeSpec | PerExpertQuant | None, *,
                per_expert: bool = False) -> QuantSpec | EncodeSpec | PerExpertQuant | None:
    """A rule's ``quant:`` -> :class:`QuantSpec` (HQQ) or :class:`EncodeSpec`; None stays None.

    ``{nbits: 4, group_size: 64}`` (no ``format``) and ``{format: hqq, ...}`` are HQQ; any other
    ``format`` must be a registered encoder; ``{per_expert: {REGEX: QUANT}}`` (only where
    ``per_expert``: an experts operator) a :class:`PerExpertQuant`. An unknown format, an unknown key
    or a bad value raises :class:`QuantError` (a ``ValueError``) naming it: the rule loader adds
    file, rule and line."""
    if value is None or isinstance(value, (QuantSpec, EncodeSpec)):
        return value
    if isinstance(value, PerExpertQuant):
        if not per_expert:
            raise QuantError("quant key 'per_expert' is only for experts operators (operators.experts.GroupedExperts)")
        return value
    if isinstance(value, Mapping) and "per_expert" in value:
        return _per_expert(value, per_expert)
    if not isinstance(value, Mapping):
        raise QuantError(f"quant: expected a mapping such as {{format: fp8, block: [128, 128]}}, "
                         f"{{format: int4, group_size: 32}} or null, got {value!r}")
    settings = dict(value)
    name = settings.pop("format", None)
    if name is None or name == "hqq":
        return QuantSpec.from_dict(settings)
    if name not in ENCODERS:
        raise QuantError(f"quant key 'format': {name!r} is not a format kinject encodes; formats: "
                         f"{', '.join(['hqq', *sorted(ENCODERS)])}")
    enc = ENCODERS[name]
    unknown = [k for k in settings if k not in enc.keys]
    if unknown:
        raise QuantError(f"quant key {unknown[0]!r} is unknown for format {name!r}; known keys: "
                         f"{['format', *enc.keys]}")
    full = {**enc.keys, **settings}
    full = enc.check(full)
    return EncodeSpec(name, tuple((k, tuple(v) if isinstance(v, list) else v) for k, v in full.items()))


def _per_expert(value: Mapping[str, Any], allowed: bool) -> PerExpertQuant:
    if not allowed:
        raise QuantError("quant key 'per_expert' is only for experts operators (operators.experts.GroupedExperts)")
    if len(value) != 1:
        other = next(k for k in value if k != "per_expert")
        raise QuantError(f"quant key {other!r} is unknown beside 'per_expert' (give each expert regex its own "
                         "format: {per_expert: {'[0-3]': {format: fp8}, '.*': {format: mxfp4}}})")
    table = value["per_expert"]
    if not isinstance(table, Mapping) or not table:
        raise QuantError(f"quant key 'per_expert': {table!r} must map expert-index regexes to quant settings")
    choices = []
    for regex, quant in table.items():
        try:
            re.compile(str(regex))
        except re.error as exc:
            raise QuantError(f"quant key 'per_expert': bad regex {regex!r}: {exc}") from None
        try:
            choices.append((str(regex), parse_quant(quant)))
        except QuantError as exc:
            raise QuantError(f"quant key 'per_expert' {regex!r}: {exc}") from None
    return PerExpertQuant(tuple(choices))


def encode(weight: torch.Tensor, spec: EncodeSpec) -> Encoded:
    """``weight`` (2-D, float) in ``spec``'s stored format: (storage tensors by role, codec)."""
    if not isinstance(weight, torch.Tensor) or weight.ndim != 2 or weight.dtype not in FLOAT_DTYPES:
        got = f"{weight.dtype} {tuple(weight.shape)}" if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise QuantError(f"{spec.format}: encodes 2-D float32/float16/bfloat16 weights, got {got}")
    with torch.no_grad():
        parts, codec = ENCODERS[spec.format].encode(weight.detach(), spec.options)
    return {k: v.contiguous() for k, v in parts.items()}, codec


def encode_unit(name: str, tensors: dict[str, Any], spec: EncodeSpec, dtype: torch.dtype | None, tier: str):
    """A store unit's weights in ``spec``'s format: (tensors with each encoded role replaced by its
    parts ``"<role>.<part>"``, role -> (shape, compute dtype, codec), role -> codec).

    Every 2-D float weight is encoded (1-D biases and norms stay as they are); one the format cannot
    hold is refused, naming the unit, the tensor and the shape. Checkpoint references are read now
    (in ``dtype``), as HQQ reads them; on the ``disk`` tier every tensor is then a plain tensor, for
    the store to write to its offload directory."""
    out, info, stored = {}, {}, {}
    for role, v in tensors.items():
        is_weight = len(v.shape) == 2 and v.dtype.is_floating_point
        if not is_weight:
            out[role] = v if isinstance(v, torch.Tensor) or tier != "disk" else v.read(dtype)
            continue
        w = v if isinstance(v, torch.Tensor) else v.read(dtype)
        if dtype is not None:
            w = w.to(dtype)
        try:
            parts, codec = encode(w, spec)
        except QuantError as exc:
            raise QuantError(f"unit {name!r}: tensor {role!r} {list(w.shape)}: {exc}") from None
        out.update({f"{role}.{part}": t for part, t in parts.items()})
        info[role] = (tuple(w.shape), w.dtype, codec)
        stored[role] = codec
    if not info:
        raise QuantError(f"unit {name!r}: quant {spec.to_dict()} found no 2-D float weight to encode "
                         f"(tensors: {sorted(tensors)})")
    return out, info, stored


def _positive_int(key: str, value: Any, *, multiple_of: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0 or value % multiple_of:
        extra = f" multiple of {multiple_of}" if multiple_of > 1 else ""
        raise QuantError(f"quant key {key!r}: {value!r} must be a positive{extra} integer")
    return value


def _split(weight: torch.Tensor, rows: int, cols: int, what: str) -> None:
    r, c = weight.shape
    if r % rows or c % cols:
        raise QuantError(f"{what} needs rows divisible by {rows} and columns by {cols}")


# --------------------------------------------------------------------------- fp8

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)      # 448


def _fp8_check(s: dict) -> dict:
    block = s["block"]
    if block == "channel":
        return s
    if not (isinstance(block, (list, tuple)) and len(block) == 2):
        raise QuantError(f"quant key 'block': {block!r} must be two positive integers like [128, 128] or 'channel'")
    s["block"] = [_positive_int("block", b) for b in block]
    return s


def encode_fp8(weight: torch.Tensor, s: dict) -> Encoded:
    """transformers' ``Fp8Quantize._quantize_one``: per block ``scale = 448 / amax`` (1 where the
    block is all zero), values ``clamp(w * scale)`` cast to e4m3, stored with ``1 / scale``
    (``weight_scale_inv``, float32). ``block: channel`` is blocks of ``[1, in]``: one scale a row."""
    from kinject.engine.formats.fp8 import FP8Format

    rows, cols = weight.shape
    bm, bn = (1, cols) if s["block"] == "channel" else s["block"]
    _split(weight, bm, bn, f"fp8 with block [{bm}, {bn}]")
    blocks = weight.to(torch.float32).reshape(rows // bm, bm, cols // bn, bn)
    amax = blocks.abs().amax(dim=(-3, -1))
    scale = FP8_MAX / torch.where(amax > 0, amax, torch.ones_like(amax))
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    inv = (1.0 / scale).to(torch.float32)
    values = torch.clamp(blocks * scale.unsqueeze(-1).unsqueeze(-3), -FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    codec = FP8Format(None if s["block"] == "channel" else (bm, bn))
    return {"weight": values.reshape(rows, cols), "weight_scale_inv": inv}, codec


register(Encoder("fp8", encode_fp8, keys={"block": [128, 128]}, check=_fp8_check,
                 describe=lambda s: "fp8 channel" if s["block"] == "channel" else f"fp8 block {list(s['block'])}"))


# --------------------------------------------------------------------------- int4 / int8 (compressed-tensors)


def _int_check(s: dict) -> dict:
    if s["group_size"] is not None:
        s["group_size"] = _positive_int("group_size", s["group_size"])
    if s["symmetric"] is not True:
        raise QuantError(f"quant key 'symmetric': {s['symmetric']!r}: only symmetric (true) is encoded")
    return s


def _encode_int(bits: int) -> Callable[[torch.Tensor, dict], Encoded]:
    def encode_int(weight: torch.Tensor, s: dict) -> Encoded:
        """compressed-tensors' symmetric ``pack-quantized``, in the weight's dtype as it computes:
        ``scale = amax / ((qmax - qmin) / 2)`` per group (its ``calculate_qparams``; a zero scale
        becomes the dtype's eps), ``q = round(clamp(w / scale, qmin, qmax))`` (its ``quantize``),
        ``bits``-bit values packed into int32 along the row (its ``pack_to_int32``)."""
        from kinject.engine.formats.compressed_tensors import CompressedTensorsFormat

        rows, cols = weight.shape
        group = s["group_size"] or cols
        _split(weight, 1, group, f"int{bits} with group_size {group}")
        if cols * bits % 32:
            raise QuantError(f"int{bits} packs {32 // bits} values per int32; {cols} columns do not fill whole words")
        qmin, qmax = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
        groups = weight.reshape(rows, cols // group, group)
        zero = torch.zeros((), dtype=weight.dtype)
        amax = torch.maximum(groups.amin(-1).minimum(zero).abs(), groups.amax(-1).maximum(zero))
        scale = amax / (torch.tensor(float(qmax - qmin), dtype=weight.dtype) / 2)
        scale = torch.where(scale == 0, torch.tensor(torch.finfo(weight.dtype).eps, dtype=weight.dtype), scale)
        q = torch.round(torch.clamp(groups / scale.unsqueeze(-1), qmin, qmax)).to(torch.int8).reshape(rows, cols)
        codec = CompressedTensorsFormat(
            [{"name": "rule", "targets": ("Linear",), "num_bits": bits, "strategy": "group" if s["group_size"]
              else "channel", "group_size": s["group_size"], "symmetric": True}], (), where="quant rule")
        return {"weight_packed": pack_int32(q, bits), "weight_scale": scale,
                "weight_shape": torch.tensor([rows, cols], dtype=torch.int64)}, codec
    return encode_int


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """``[rows, cols]`` int8 -> ``[rows, cols * bits / 32]`` int32: value ``i`` offset by
    ``2**(bits-1)`` at bit ``(i % per_word) * bits`` of word ``i // per_word`` (compressed-tensors'
    layout; ``kinject.engine.formats.compressed_tensors.unpack_int32`` reads it)."""
    per_word = 32 // bits
    rows, cols = values.shape
    fields = (values.to(torch.int64) + (1 << (bits - 1))).reshape(rows, cols // per_word, per_word)
    shifts = torch.arange(per_word, dtype=torch.int64) * bits
    words = (fields << shifts).sum(-1)                                   # < 2**32: fits int64
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _describe_int(bits: int) -> Callable[[dict], str]:
    return lambda s: f"int{bits} " + (f"g{s['group_size']}" if s["group_size"] else "channel")


register(Encoder("int4", _encode_int(4), keys={"group_size": 128, "symmetric": True}, check=_int_check,
                 describe=_describe_int(4)))


# --------------------------------------------------------------------------- mxfp4

MX_BLOCK = 32
_E2M1_OFFSET = 2                    # floor(log2(6)): e2m1's largest exponent


def encode_mxfp4(weight: torch.Tensor, s: dict) -> Encoded:
    """compressed-tensors' MXFP4 (``calculate_qparams`` with E8M0 scales, ``quantize_and_pack_fp4``):
    per 32 values along the row, ``amax`` rounded to a power of two (up when its mantissa is >= 1.75,
    the package's ``round_to_power_2``), the E8M0 exponent ``log2 - 2``; values ``w / 2**e`` rounded
    to the nearest e2m1 value (ties to the even code) and packed two per byte, low nibble first.

    Stored as an MXFP4 release stores a weight: ``blocks [rows, cols/32, 16]``, ``scales [rows,
    cols/32]``, decoded by :class:`~kinject.engine.formats.mxfp4.MXFP4Format`. That codec reads
    blocks of transformers' transposed expert layout; here the blocks run along the row, so its
    output is transposed back (:class:`Transposed`)."""
    from kinject.engine.formats.mxfp4 import MXFP4Format

    rows, cols = weight.shape
    _split(weight, 1, MX_BLOCK, f"mxfp4 (blocks of {MX_BLOCK})")
    groups = weight.reshape(rows, cols // MX_BLOCK, MX_BLOCK)
    amax = groups.abs().amax(-1).to(torch.float32)
    bits = amax.view(torch.int32)
    rounded = (bits + (1 << 21)) & ~((1 << 23) - 1)                     # power of two, rounded at 1.75
    exponent = ((rounded >> 23) & 0xFF) - 127                           # amax 0 -> -127
    biased = torch.where(amax > 0, exponent + 127 - _E2M1_OFFSET, torch.zeros_like(exponent)).clamp(0, 255)
    scale = torch.exp2((biased - 127).to(torch.float32)).to(weight.dtype)
    # a scale the weight's dtype cannot hold (float16 below 2**-24) is 0 there: the package then
    # takes 1 (its eps for integer scale dtypes), stored as exponent 127
    underflow = scale == 0
    scale = torch.where(underflow, torch.ones_like(scale), scale)
    biased = torch.where(underflow, torch.full_like(biased, 127), biased)
    scaled = (groups / scale.unsqueeze(-1)).to(torch.float32)
    codes = _e2m1_codes(scaled)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)   # [rows, G, 16]
    return {"blocks": packed, "scales": biased.to(torch.uint8)}, Transposed(MXFP4Format())


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Nearest e2m1 code (sign << 3 | magnitude index) of each value, compressed-tensors' buckets:
    ties go to the even code (0.25 -> 0, 0.75 -> 1, 1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)."""
    a = x.abs()
    index = torch.zeros_like(a, dtype=torch.uint8)
    for i, (edge, inclusive) in enumerate(((0.25, False), (0.75, True), (1.25, False), (1.75, True),
                                           (2.5, False), (3.5, True), (5.0, False)), start=1):
        index = torch.where(a >= edge if inclusive else a > edge, torch.tensor(i, dtype=torch.uint8), index)
    return index | (torch.signbit(x).to(torch.uint8) << 3)


class Transposed(StoredFormat):
    """A codec whose decoded weight is the transpose of the one wanted: MXFP4's blocks run along the
    dimension transformers' expert layout keeps first; a rule's blocks run along the row."""

    method = "transposed"

    def __init__(self, inner: StoredFormat):
        self.inner = inner

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> Transposed:   # pragma: no cover - not in the chain
        raise NotImplementedError("Transposed wraps a codec; it reads no checkpoint config")

    def storage_keys(self, name: str) -> dict[str, str] | None:
        return self.inner.storage_keys(name)

    def check(self, name, parts, shape) -> None:
        self.inner.check(name, parts, tuple(shape[:-2]) + (shape[-1], shape[-2]))

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return self.inner.dequantize(parts, dtype).transpose(-1, -2).contiguous()

    def describe(self) -> str:
        return f"{self.inner.describe()} (rows)"


register(Encoder("mxfp4", encode_mxfp4, describe=lambda s: "mxfp4"))


# --------------------------------------------------------------------------- nvfp4

NVFP4_GROUP = 16
_FP4_MAX = 6.0


def nvfp4_parts(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors' NVFP4 (``nvfp4-pack-quantized``): in the weight's dtype as it computes,
    a global scale ``448 * 6 / amax`` (float32, its ``generate_gparam``; a divisor), per 16 values an
    e4m3 scale ``global * amax / 6`` (its ``calculate_qparams``; 0 becomes e4m3's eps 0.125), values
    ``w / (scale / global)`` rounded to e2m1 as :func:`_e2m1_codes` and packed two per byte
    (``quantize_and_pack_fp4``): ``weight_packed [rows, cols/2]``, ``weight_scale [rows, cols/16]``,
    ``weight_global_scale [1]``."""
    rows, cols = weight.shape
    _split(weight, 1, NVFP4_GROUP, f"nvfp4 (groups of {NVFP4_GROUP})")
    zero = torch.zeros((), dtype=weight.dtype)
    peak = torch.maximum(weight.amin().minimum(zero).abs(), weight.amax().maximum(zero))
    peak = torch.clamp(peak, min=torch.finfo(peak.dtype).tiny)
    global_scale = torch.nan_to_num(FP8_MAX * _FP4_MAX / peak, nan=1.0, posinf=1.0, neginf=1.0)
    global_scale = global_scale.to(torch.float32).reshape(1)
    groups = weight.reshape(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    amax = torch.maximum(groups.amin(-1).minimum(zero).abs(), groups.amax(-1).maximum(zero))
    scale = global_scale * (amax / (torch.tensor(2 * _FP4_MAX, dtype=weight.dtype) / 2))
    scale = torch.clamp(scale, -FP8_MAX, FP8_MAX).to(FP8_DTYPE).to(torch.float32)
    scale = torch.where(scale == 0, torch.tensor(0.125, dtype=scale.dtype), scale)
    scaled = groups / (scale / global_scale).unsqueeze(-1)
    codes = _e2m1_codes(torch.clamp(scaled, -_FP4_MAX, _FP4_MAX)).reshape(rows, cols)
    packed = (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)
    return {"weight_packed": packed, "weight_scale": scale.to(FP8_DTYPE), "weight_global_scale": global_scale}


def _register_nvfp4() -> None:
    """``{format: nvfp4}`` decodes through the compressed-tensors FP4 codec
    (``kinject.engine.formats.fp4.CompressedFP4Format``) where this installation has it."""
    try:
        from kinject.engine.formats.fp4 import CompressedFP4Format
    except ImportError:
        return

    def encode_nvfp4(weight: torch.Tensor, s: dict) -> Encoded:
        codec = CompressedFP4Format("nvfp4-pack-quantized", [
            {"name": "rule", "targets": ("Linear",), "num_bits": 4, "strategy": "tensor_group",
             "group_size": NVFP4_GROUP, "symmetric": True}], (), "quant rule")
        return nvfp4_parts(weight), codec

    register(Encoder("nvfp4", encode_nvfp4, describe=lambda s: "nvfp4"))


_register_nvfp4()


def encoded_nbytes(parts: Mapping[str, torch.Tensor]) -> int:
    """Storage bytes of one encoded weight (what a unit holds and moves)."""
    return sum(t.numel() * t.element_size() for t in parts.values())


def bits_per_weight(spec: EncodeSpec | QuantSpec, shape: tuple[int, int] = (512, 512)) -> float:
    """Stored bits per weight of ``spec`` on a weight of ``shape`` (scales included)."""
    if isinstance(spec, QuantSpec):
        from kinject.engine.quant import quantized_nbytes

        return 8 * quantized_nbytes(shape, spec) / math.prod(shape)
    parts, _ = encode(torch.zeros(shape, dtype=torch.bfloat16), spec)
    return 8 * encoded_nbytes(parts) / math.prod(shape)

