"""HQQ weight quantization for offloaded tensors (Klotski §7 "Compression").

Weights that travel between tiers (experts above all) can be kept as packed HQQ
tensors: they take ~1/4 of the bytes in the store, on disk and on the PCIe bus, and
are dequantized on the compute device right before use.

The quantization math is the ``hqq`` package's: :func:`quantize` calls
``hqq.core.quantize.Quantizer.quantize`` with the parameters of
``hqq.core.quantize.BaseQuantizeConfig`` (HQQ's proximal solver included), exactly as
``HQQLinear`` does; :meth:`QuantizedTensor.dequantize` uses hqq's bit unpacking
(``Quantizer.unpack``) and then hqq's ``(W_q - zero) * scale`` step, done in place to
save one full-size temporary. It is bit-identical to ``Quantizer.dequantize`` (tested).
transformers' ``HqqConfig`` is not used: it only replaces ``nn.Linear`` modules and
never sees the fused 3-D expert parameters of transformers 5.

What is kept (:class:`QuantizedTensor`) is three plain tensors, so the store can pin
them, move them ``non_blocking`` and save them with safetensors:

* ``packed`` -- the bit-packed integer codes, hqq's format (``uint8``; ``int32`` for
  3-bit): for 8/4/2/1 bits, ``8 // nbits`` codes per byte; 3-bit packs 10 codes per
  ``int32`` and pads the packed dimension to a multiple of 10.
* ``scale``, ``zero`` -- one float per group, stored as float16 (hqq's default compute
  dtype; float32 only if a value does not fit float16). hqq 0.2.8 no longer supports
  quantizing scale/zero (``quant_scale``/``quant_zero`` are deprecated and ignored by
  ``HQQLinear``), so the paper's "zero/scale group size 128" has no equivalent here.

Bytes for nbits in {1, 2, 4, 8}: ``numel * nbits / 8 + 4 * numel / group_size``
(see :func:`quantized_nbytes`); 4-bit, group 64: 0.5625 bytes per weight, i.e.
9/32 = 0.28125 of float16/bfloat16 bytes (4.5 bits per weight).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch

from kinject.engine.formats.base import FormatError, StoredFormat
from kinject.errors import KinjectError, LoadError

logger = logging.getLogger(__name__)

__all__ = [
    "HQQFormat",
    "QuantError",
    "QuantSpec",
    "QuantizedTensor",
    "quantize",
    "quantize_experts",
    "quantized_nbytes",
    "save_quantized",
    "load_quantized",
    "relative_error",
]

SUPPORTED_NBITS = (1, 2, 3, 4, 8)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# hqq packing per bit width: (name in Quantizer.pack/unpack, codes per packed element
# along the packed dimension, packed dtype). 3-bit pads the packed dim to a multiple of 10.
_PACKING = {
    8: ("8bit_u8", 1, torch.uint8),
    4: ("4bit_u8", 2, torch.uint8),
    3: ("3bit_32", 10, torch.int32),
    2: ("2bit_u8", 4, torch.uint8),
    1: ("1bit_u8", 8, torch.uint8),
}

_META_DTYPE = torch.float16           # dtype of stored scale/zero (hqq's default)
_FILE_KEY = "kinject.engine.quant"           # safetensors metadata key of our JSON header
_FILE_FORMAT = 1
_PARTS = ("packed", "scale", "zero")


class QuantError(KinjectError, ValueError):
    """A quantization setting or a tensor does not fit HQQ (bad spec, shape, dtype)."""


# --------------------------------------------------------------------------- spec


@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized with HQQ.

    nbits: bits per weight, one of 1, 2, 3, 4, 8 (hqq's 5/6/1.58 "bits" are stored
        as 8 or 2 bits unpacked, so they save nothing and are refused).
    group_size: weights sharing one (scale, zero) pair; a multiple of 8 (hqq's
        ``BaseQuantizeConfig`` rule) that divides the tensor's element count.
    axis: hqq's grouping convention. The tensor is flattened row-major and viewed as
        ``[numel // group_size, group_size]`` (axis=1, default) -- each group is
        ``group_size`` consecutive elements, i.e. a slice along the input dimension of
        an ``nn.Linear`` weight ``[out, in]`` when ``in % group_size == 0``; scale/zero
        are ``[numel // group_size, 1]`` -- or as ``[group_size, numel // group_size]``
        (axis=0) -- each group is one column of that view, elements
        ``numel // group_size`` apart; scale/zero are ``[1, numel // group_size]``.
        axis=1 is hqq's default and the layout its fast kernels expect.
    optimize: run HQQ's proximal solver on the zero points (default, as hqq);
        ``False`` gives plain min-max (round-to-nearest) quantization, faster to build.
    """

    nbits: int = 4
    group_size: int = 64
    axis: int = 1
    optimize: bool = True

    def __post_init__(self) -> None:
        _check_int("nbits", self.nbits)
        if self.nbits not in SUPPORTED_NBITS:
            raise QuantError(f"quant key 'nbits': {self.nbits!r} is not supported; "
                             f"use one of {list(SUPPORTED_NBITS)}")
        _check_int("group_size", self.group_size)
        if self.group_size <= 0 or self.group_size % 8:
            raise QuantError(f"quant key 'group_size': {self.group_size!r} must be a "
                             "positive multiple of 8 (hqq's rule), e.g. 64 or 128")
        _check_int("axis", self.axis)
        if self.axis not in (0, 1):
            raise QuantError(f"quant key 'axis': {self.axis!r} must be 0 or 1 "
                             "(hqq's grouping axis; 1 groups along rows of [out, in])")
        if not isinstance(self.optimize, bool):
            raise QuantError(f"quant key 'optimize': {self.optimize!r} must be true or false")

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | QuantSpec | None) -> QuantSpec | None:
        """Build a spec from a rule's ``quant:`` kwarg; ``None`` (no quantization) -> None.

        Missing keys take the defaults (4 bits, group 64, axis 1, optimize).
        Unknown keys or bad values raise :class:`QuantError` (a ``ValueError``) naming the key.
        """
        if d is None or isinstance(d, QuantSpec):
            return d
        if not isinstance(d, Mapping):
            raise QuantError(f"quant: expected a mapping such as "
                             f"{{nbits: 4, group_size: 64}} or null, got {d!r}")
        known = [f.name for f in dataclasses.fields(cls)]
        unknown = [k for k in d if k not in known]
        if unknown:
            raise QuantError(f"quant key {unknown[0]!r} is unknown; known keys: {known}")
        return cls(**dict(d))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _check_int(key: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise QuantError(f"quant key {key!r}: {value!r} must be an integer")


# --------------------------------------------------------------------------- layout


def _layout(shape: tuple[int, ...], spec: QuantSpec) -> tuple[tuple[int, int], tuple[int, int], int]:
    """(packed shape, scale/zero shape, rows of the unpacked view) for a tensor of `shape`."""
    numel = math.prod(shape)
    groups = numel // spec.group_size
    _, per, _ = _PACKING[spec.nbits]
    if spec.axis == 1:                       # view [groups, group_size], packed along dim 0
        rows, cols, meta = groups, spec.group_size, (groups, 1)
    else:                                    # view [group_size, groups], packed along dim 0
        rows, cols, meta = spec.group_size, groups, (1, groups)
    return (math.ceil(rows / per), cols), meta, rows


def _check_shape(shape: tuple[int, ...], spec: QuantSpec, what: str = "tensor") -> None:
    numel = math.prod(shape)
    if len(shape) == 0 or numel == 0:
        raise QuantError(f"cannot quantize {what} of shape {tuple(shape)}: it is empty or a scalar")
    if numel % spec.group_size:
        raise QuantError(f"cannot quantize {what} of shape {tuple(shape)} ({numel} elements) "
                         f"with group_size={spec.group_size}: group_size must divide the "
                         "element count")
    _, per, _ = _PACKING[spec.nbits]
    rows = numel // spec.group_size if spec.axis == 1 else spec.group_size
    if spec.nbits != 3 and rows % per:
        # hqq's packers split the packed dim in `per` equal slices; a remainder is
        # silently dropped or broadcast, so refuse it here.
        raise QuantError(f"cannot quantize {what} of shape {tuple(shape)} with nbits="
                         f"{spec.nbits}, group_size={spec.group_size}, axis={spec.axis}: "
                         f"hqq packs {per} codes per byte and the {rows} "
                         f"{'groups' if spec.axis == 1 else 'rows of a group'} are not "
                         f"a multiple of {per}")


def quantized_nbytes(shape: tuple[int, ...], spec: QuantSpec) -> int:
    """Bytes a :class:`QuantizedTensor` of `shape` takes (float16 scale/zero), without quantizing.

    nbits in {1, 2, 4, 8}: ``numel * nbits / 8 + 2 * 2 * numel / group_size``.
    """
    shape = tuple(int(s) for s in shape)
    _check_shape(shape, spec)
    (pr, pc), (mr, mc), _ = _layout(shape, spec)
    _, _, pdtype = _PACKING[spec.nbits]
    itemsize = torch.empty((), dtype=pdtype).element_size()
    meta_itemsize = torch.empty((), dtype=_META_DTYPE).element_size()
    return pr * pc * itemsize + 2 * mr * mc * meta_itemsize


def _hqq_quantizer():
    try:
        from hqq.core.quantize import BaseQuantizeConfig, Quantizer
    except ImportError as e:  # pragma: no cover - hqq is a dependency
        raise KinjectError("HQQ quantization needs the 'hqq' package (pip install hqq)") from e
    return Quantizer, BaseQuantizeConfig


# --------------------------------------------------------------------------- tensor


@dataclass
class QuantizedTensor:
    """Packed HQQ weight: what the store keeps and transfers.

    Plain tensors only (no hqq objects), so it can be pinned, moved non_blocking and
    saved with safetensors. ``packed``: hqq bit-packed codes (see module docstring);
    ``scale``/``zero``: per-group float16 (``[groups, 1]`` for axis=1, ``[1, groups]``
    for axis=0); ``shape``/``dtype``: the original tensor's.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor
    shape: tuple[int, ...]
    dtype: torch.dtype
    spec: QuantSpec

    def tensors(self) -> dict[str, torch.Tensor]:
        """The plain tensors, keyed ``packed``/``scale``/``zero`` (for the store / safetensors)."""
        return {"packed": self.packed, "scale": self.scale, "zero": self.zero}

    @classmethod
    def from_tensors(cls, tensors: Mapping[str, torch.Tensor], shape, dtype: torch.dtype,
                     spec: QuantSpec) -> QuantizedTensor:
        """Rebuild from :meth:`tensors`; checks keys, shapes and dtypes (:class:`LoadError`)."""
        shape = tuple(int(s) for s in shape)
        missing = [k for k in _PARTS if k not in tensors]
        if missing:
            raise LoadError(f"quantized tensor of shape {shape}: missing part(s) {missing}; "
                            f"got {sorted(tensors)}")
        _check_shape(shape, spec)
        if dtype not in SUPPORTED_DTYPES:
            raise LoadError(f"quantized tensor of shape {shape}: original dtype {dtype} "
                            f"is not one of {list(SUPPORTED_DTYPES)}")
        (pshape, mshape, _), (_, _, pdtype) = _layout(shape, spec), _PACKING[spec.nbits]
        expect = {"packed": (pshape, (pdtype,)),
                  "scale": (mshape, (torch.float16, torch.float32)),
                  "zero": (mshape, (torch.float16, torch.float32))}
        for k, (eshape, edtypes) in expect.items():
            t = tensors[k]
            if tuple(t.shape) != eshape or t.dtype not in edtypes:
                raise LoadError(f"quantized tensor of shape {shape} ({spec}): part '{k}' is "
                                f"{t.dtype} {tuple(t.shape)}, expected "
                                f"{' or '.join(map(str, edtypes))} {eshape}")
        return cls(tensors["packed"], tensors["scale"], tensors["zero"], shape, dtype, spec)

    def _map(self, fn) -> QuantizedTensor:
        return dataclasses.replace(self, packed=fn(self.packed), scale=fn(self.scale),
                                   zero=fn(self.zero))

    def to(self, device, non_blocking: bool = False) -> QuantizedTensor:
        """Same data on `device` (a new object; tensors already there are shared)."""
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> QuantizedTensor:
        """Copy to page-locked host memory, for async host->device copies.

        Without an accelerator pinning is impossible (and pointless): returns ``self``.
        """
        if not _accelerator_available():
            logger.debug("pin_memory: no accelerator available, leaving tensors pageable")
            return self
        return self._map(lambda t: t if t.is_pinned() else t.pin_memory())

    def is_pinned(self) -> bool:
        return all(t.is_pinned() for t in (self.packed, self.scale, self.zero))

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def dequantize(self, device=None) -> torch.Tensor:
        """Full-precision tensor of ``shape``/``dtype`` on `device` (default: where ``packed`` is).

        Runs as ordinary torch ops on the current stream (no synchronize): hqq's bit
        unpacking, then ``(W_q - zero) * scale`` in float16 for float16 weights and in
        float32 otherwise (bfloat16 arithmetic would double the 8-bit error), then a
        cast to ``dtype``. Parts not yet on `device` are copied there first
        (non_blocking for an accelerator target, ordered on the current stream).
        """
        Quantizer, _ = _hqq_quantizer()
        dev = self.packed.device if device is None else torch.device(device)
        non_blocking = dev.type != "cpu"
        packed, scale, zero = (t.to(dev, non_blocking=non_blocking)
                               for t in (self.packed, self.scale, self.zero))
        compute = torch.float16 if self.dtype == torch.float16 else torch.float32
        packing, _, _ = _PACKING[self.spec.nbits]
        _, _, rows = _layout(self.shape, self.spec)
        w = Quantizer.unpack[packing](packed, dtype=compute)   # [rows(+pad), cols]
        if w.shape[0] != rows:                                  # 3-bit padding
            w = w[:rows]
        w.sub_(zero).mul_(scale)                                # hqq: (W_q - zero) * scale
        return w.reshape(self.shape).to(self.dtype)

    def __repr__(self) -> str:
        return (f"QuantizedTensor(shape={self.shape}, dtype={self.dtype}, nbits="
                f"{self.spec.nbits}, group_size={self.spec.group_size}, axis={self.spec.axis}, "
                f"nbytes={self.nbytes}, device={self.device})")


class HQQFormat(StoredFormat):
    """HQQ (kinject quantizing a bf16 checkpoint at load) as a stored format, beside the formats
    checkpoints ship in (:mod:`kinject.engine.formats`): storage ``packed`` / ``scale`` / ``zero``
    (:class:`QuantizedTensor`), dequantized on the compute device by :meth:`QuantizedTensor.dequantize`.

    One per weight shape: hqq's packed codes do not say the weight's shape. Not in the chain
    :func:`kinject.engine.formats.format_for` reads checkpoints with: the store builds it when a
    rule's ``quant:`` asks for HQQ."""

    method = "hqq"
    storage_suffixes = tuple(f".{p}" for p in _PARTS)

    def __init__(self, spec: QuantSpec, shape: tuple[int, ...]):
        self.spec, self.shape = spec, tuple(int(d) for d in shape)

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> HQQFormat:
        """``qconfig``: a rule's ``quant:`` settings plus the weight's ``shape``."""
        settings = dict(qconfig)
        shape = settings.pop("shape", None)
        try:
            spec = QuantSpec.from_dict(settings)
            _check_shape(tuple(shape or ()), spec)
        except (QuantError, TypeError) as exc:
            raise FormatError(f"{where}: {exc}") from None
        return cls(spec, shape)

    def describe(self) -> str:
        return f"hqq {self.spec.nbits}-bit, group {self.spec.group_size}"

    def storage_keys(self, name: str) -> dict[str, str]:
        return {part: f"{name}.{part}" for part in _PARTS}

    def check(self, name: str, parts, shape) -> None:
        metas = {k: torch.empty(s, dtype=d, device="meta") for k, (s, d) in parts.items()}
        try:
            QuantizedTensor.from_tensors(metas, shape, torch.float32, self.spec)
        except LoadError as exc:
            raise FormatError(f"tensor '{name}': {exc}") from None

    def dequantize(self, parts: Mapping[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        return QuantizedTensor.from_tensors(parts, self.shape, dtype, self.spec).dequantize()


def _accelerator_available() -> bool:
    acc = getattr(torch, "accelerator", None)
    if acc is not None:
        return acc.is_available()
    return torch.cuda.is_available()  # pragma: no cover - older torch


# --------------------------------------------------------------------------- quantize


def quantize(weight: torch.Tensor, spec: QuantSpec, *, device=None) -> QuantizedTensor:
    """HQQ-quantize `weight` (any shape; grouping follows hqq's flattening, see QuantSpec.axis).

    Same parameters as hqq's ``BaseQuantizeConfig(nbits, group_size, axis=axis)`` (so
    ``round_zero`` for 4 bits) and HQQ's proximal solver when ``spec.optimize``.
    `device`: where hqq's solver runs (default: the weight's device). hqq solves in
    float32 on CPU and float16 on CUDA, so results differ slightly between the two.
    The result lives on the weight's device; float16/bfloat16/float32 accepted.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"quantize: spec must be a QuantSpec, got {type(spec).__name__} "
                        "(use QuantSpec.from_dict for a rule's quant: mapping)")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"quantize: expected a torch.Tensor, got {type(weight).__name__}")
    shape = tuple(weight.shape)
    if weight.dtype not in SUPPORTED_DTYPES:
        raise QuantError(f"cannot quantize tensor of shape {shape} and dtype {weight.dtype}: "
                         f"expected one of {list(SUPPORTED_DTYPES)}")
    _check_shape(shape, spec)
    Quantizer, BaseQuantizeConfig = _hqq_quantizer()
    params = dict(BaseQuantizeConfig(nbits=spec.nbits, group_size=spec.group_size,
                                     axis=spec.axis)["weight_quant_params"])
    params["optimize"] = spec.optimize
    solver_device = weight.device if device is None else torch.device(device)
    with torch.no_grad():
        # hqq casts to float32 itself (W = tensor.float()); `device` is its solver's.
        packed, meta = Quantizer.quantize(weight.detach(), device=solver_device, **params)
        scale, zero = meta["scale"], meta["zero"]               # float32, already 1/scale
        scale_h, zero_h = scale.to(_META_DTYPE), zero.to(_META_DTYPE)
        if bool(torch.isfinite(scale_h).all()) and bool(torch.isfinite(zero_h).all()):
            scale, zero = scale_h, zero_h
        else:
            logger.warning("quantize: scale/zero of tensor %s overflow float16; keeping "
                           "float32 metadata", shape)
    dev = weight.device
    packed, scale, zero = (_plain(t, dev) for t in (packed, scale, zero))
    return QuantizedTensor(packed, scale, zero, shape, weight.dtype, spec)


def _plain(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Contiguous, normal (not inference-mode) tensor on `device`."""
    t = t.to(device).contiguous()
    return t.clone() if t.is_inference() else t


def quantize_experts(weight: torch.Tensor, spec: QuantSpec, *, device=None) -> list[QuantizedTensor]:
    """Fused 3-D expert parameter ``[E, a, b]`` -> one QuantizedTensor per expert (``weight[e]``).

    One expert at a time, so peak extra memory is one expert's float32 copy.
    """
    if not isinstance(weight, torch.Tensor) or weight.ndim != 3:
        got = tuple(weight.shape) if isinstance(weight, torch.Tensor) else type(weight).__name__
        raise QuantError(f"quantize_experts expects a fused expert tensor [E, a, b], got {got}")
    _check_shape(tuple(weight.shape[1:]), spec, what=f"expert slice of {tuple(weight.shape)}")
    return [quantize(weight[e], spec, device=device) for e in range(weight.shape[0])]


def relative_error(weight: torch.Tensor, qt: QuantizedTensor) -> float:
    """``||W - deq(Q(W))||_F / ||W||_F`` computed in float32 on the weight's device."""
    if tuple(weight.shape) != tuple(qt.shape):
        raise QuantError(f"relative_error: weight shape {tuple(weight.shape)} != "
                         f"quantized shape {qt.shape}")
    w = weight.detach().float()
    d = qt.dequantize(w.device).float()
    num, den = float(torch.linalg.vector_norm(w - d)), float(torch.linalg.vector_norm(w))
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return num / den


# --------------------------------------------------------------------------- files


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dtype


def _json_normal(obj: Any, what: str) -> Any:
    try:
        return json.loads(json.dumps(obj))
    except (TypeError, ValueError) as e:
        raise QuantError(f"{what} must be JSON-serialisable (str/int/float/bool/list/dict): {e}") from e


def save_quantized(path, tensors: Mapping[str, QuantizedTensor], meta: Mapping[str, Any]) -> None:
    """Write `tensors` to a safetensors file at `path`, atomically (temp file + rename).

    Each tensor ``name`` becomes ``name.packed``/``name.scale``/``name.zero``; a JSON
    header in the safetensors metadata (key ``kinject.engine.quant``) keeps every tensor's
    shape, dtype and spec plus `meta` (e.g. the source checkpoint's fingerprint),
    which :func:`load_quantized` compares against.
    """
    path = Path(path)
    header = {"format": _FILE_FORMAT, "meta": _json_normal(dict(meta), "save_quantized meta"),
              "tensors": {}}
    flat: dict[str, torch.Tensor] = {}
    for name, qt in tensors.items():
        if not isinstance(name, str) or not name:
            raise QuantError(f"save_quantized: tensor names must be non-empty strings, got {name!r}")
        if not isinstance(qt, QuantizedTensor):
            raise TypeError(f"save_quantized: {name!r} is a {type(qt).__name__}, "
                            "expected a QuantizedTensor")
        header["tensors"][name] = {"shape": list(qt.shape), "dtype": _dtype_name(qt.dtype),
                                   "spec": qt.spec.to_dict()}
        for part, t in qt.tensors().items():
            flat[f"{name}.{part}"] = t.detach().to("cpu").contiguous()
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(flat, str(tmp), metadata={_FILE_KEY: json.dumps(header)})
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def load_quantized(path, expect_meta: Mapping[str, Any] | None = None
                   ) -> dict[str, QuantizedTensor] | None:
    """Read a file written by :func:`save_quantized` into CPU tensors.

    Returns None -- a cache miss, the caller re-quantizes -- when the file is missing,
    when `expect_meta` is given and differs from the stored meta (compared after a JSON
    round trip, so tuples equal lists), or when the file is unreadable, of another
    format or inconsistent (logged as a warning).
    """
    path = Path(path)
    if not path.is_file():
        return None
    from safetensors import SafetensorError, safe_open

    expect = None if expect_meta is None else _json_normal(dict(expect_meta),
                                                           "load_quantized expect_meta")
    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            header = json.loads((f.metadata() or {})[_FILE_KEY])
            if header.get("format") != _FILE_FORMAT:
                logger.warning("load_quantized: %s has format %r, expected %r; ignoring it",
                               path, header.get("format"), _FILE_FORMAT)
                return None
            if expect is not None and header.get("meta") != expect:
                logger.info("load_quantized: %s was made for other settings; ignoring it", path)
                return None
            out = {}
            for name, info in header["tensors"].items():
                parts = {p: f.get_tensor(f"{name}.{p}") for p in _PARTS}
                out[name] = QuantizedTensor.from_tensors(
                    parts, info["shape"], _dtype_from_name(info["dtype"]),
                    QuantSpec.from_dict(info["spec"]))
            return out
    except (OSError, SafetensorError, KeyError, TypeError, ValueError, LoadError) as e:
        logger.warning("load_quantized: cannot read %s (%s: %s); ignoring it",
                       path, type(e).__name__, e)
        return None
