"""The one interface every stored weight format implements (docs/architecture.md, "Stored formats").

A checkpoint released quantized stores each quantized weight as a few *storage tensors*
(FP8 values + float32 block scales; MXFP4 blocks + E8M0 scales; packed INT4 + scales ...).
kinject keeps and moves those tensors as they are stored and rebuilds the logical weight on
the compute device right before use. A :class:`StoredFormat` says, for one
``quantization_config.quant_method``:

* which checkpoint keys store a weight (:meth:`StoredFormat.storage_keys`, by role),
* whether their shapes and dtypes fit the weight (:meth:`StoredFormat.check`, before any read),
* how to rebuild it (:meth:`StoredFormat.dequantize`), in exactly the arithmetic transformers'
  own CPU ``from_pretrained`` uses, so tokens are identical to its load,
* its bytes (:meth:`StoredFormat.nbytes`).
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from kinject.errors import LoadError

Layout = dict[str, tuple[tuple[int, ...], torch.dtype]]   # role -> (shape, dtype) of a storage tensor


class FormatError(LoadError):
    """A quantized checkpoint kinject cannot read exactly: an unsupported method or variant, a
    storage tensor that does not fit its weight, a quantized key nothing uses. Raised before any
    weight is read; the message names the file, the tensor or key, and what is supported."""


class StoredFormat(abc.ABC):
    """One ``quant_method``'s codec: storage keys, checks, dequantize, bytes.

    Subclasses set :attr:`method` and :attr:`storage_suffixes` (the endings of the keys that are
    parts of a quantized weight besides the weight itself, e.g. ``weight_scale_inv``: a checkpoint
    key with such an ending that no weight uses is an error, never silently dropped).
    """

    method: ClassVar[str]
    storage_suffixes: ClassVar[tuple[str, ...]] = ()
    # the key named like the weight holds packed values of another shape (ModelOpt's uint8 ``weight``)
    packs_values: ClassVar[bool] = False

    @classmethod
    def accepts(cls, qconfig: dict) -> bool:
        """Whether this format reads a checkpoint of its ``method`` whose ``quantization_config`` is
        ``qconfig`` (several formats can share a method: compressed-tensors' INT and FP4 packings);
        the chain asks in order and takes the first that accepts."""
        return True

    @classmethod
    @abc.abstractmethod
    def from_config(cls, qconfig: dict, *, where: str) -> "StoredFormat":
        """The format for ``qconfig`` (a ``quantization_config`` dict from ``where``, the
        config.json path); an unsupported variant raises :class:`FormatError` naming the key."""

    @abc.abstractmethod
    def storage_keys(self, name: str) -> dict[str, str] | None:
        """Checkpoint keys storing the weight the checkpoint calls ``name``, by role, or None when
        the format never quantizes it. Whether the checkpoint holds them is the caller's question."""

    @abc.abstractmethod
    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        """Raise :class:`FormatError` naming ``name`` unless ``parts`` store a ``shape`` weight."""

    @abc.abstractmethod
    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """The logical weight in ``dtype``, bit-identical to transformers' CPU load of it. Parts may
        carry a leading expert dim (then so does the result)."""

    def assemble(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """One weight from its storage tensors: :meth:`dequantize` (what a store unit asks of a
        stored role, as of a checkpoint's ``StoredSource`` that may join several weights)."""
        return self.dequantize(parts, dtype)

    def nbytes(self, parts: dict[str, torch.Tensor]) -> int:
        """Storage bytes of one weight (values + scales): what a unit holds and moves."""
        return sum(t.numel() * t.element_size() for t in parts.values())

    def weight_name(self, key: str) -> str | None:
        """The tensor whose storage includes checkpoint key ``key`` (``x.weight`` for
        ``x.weight_scale_inv``, ``x.weight_packed``; ``experts.gate_up_proj`` for its ``_blocks``),
        or None: the key with a storage suffix cut off, or a ``weight`` / ``_part`` ending changed,
        whichever :meth:`storage_keys` names ``key`` for."""
        for suffix in self.storage_suffixes:
            if not key.endswith(suffix):
                continue
            stem = key[: -len(suffix)]
            for name in (stem, stem.rstrip("._"), stem + "weight", key.rpartition("_")[0]):
                keys = self.storage_keys(name) if name else None
                if keys and key in keys.values():
                    return name
        return None

    def logical_shape(self, name: str, parts: Layout) -> tuple[int, ...] | None:
        """The shape of weight ``name`` from its storage layout, where no model tensor tells it
        (a per-expert key of a fused parameter stored without its values); None: unknown."""
        return None

    def bind(self, model) -> "StoredFormat":
        """Resolve what the config names by module class against ``model`` (default: nothing to do)."""
        return self

    def is_storage_key(self, key: str) -> bool:
        """Whether checkpoint key ``key`` is a part of a quantized weight other than its values."""
        return any(key.endswith(suffix) for suffix in self.storage_suffixes)

    def describe(self) -> str:
        return self.method

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"


def check_keys(qconfig: dict, allowed: dict[str, tuple], *, method: str, where: str) -> None:
    """Refuse a ``quantization_config`` value outside ``allowed`` (key -> accepted values; a key
    not listed is not checked), naming the key, the value and what is supported."""
    for key, accepted in allowed.items():
        value = qconfig.get(key, accepted[0])
        if value not in accepted:
            shown = ", ".join(repr(a) for a in accepted)
            raise FormatError(f"{where}: quantization_config.{key} = {value!r} is not supported for "
                              f"quant_method {method!r} (supported: {shown})")
