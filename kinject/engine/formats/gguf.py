"""GGUF tensors as a stored format (docs/architecture.md "Stored formats").

A GGUF file (llama.cpp, Ollama) stores each weight as rows of GGML blocks of one type
(Q4_K, Q8_0, IQ4_XS ...; :mod:`kinject.engine.formats.ggml`). :class:`GGUFFormat` keeps them so:
a weight's storage tensor is ``uint8 [..., rows, row_bytes]`` under the role named by its type
(``"Q4_K"``), so one format object rebuilds any tensor of the file. The file names the tensors
itself (there is no ``quantization_config``): :mod:`kinject.io.gguf` builds the storage sources
from its tensor index and hands them to the store like any checkpoint's.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from kinject.engine.formats import ggml
from kinject.engine.formats.base import FormatError, Layout, StoredFormat
from kinject.formatting import format_shape

SUPPORTED_TYPES: tuple[str, ...] = tuple(ggml.BLOCKS)


class GGUFFormat(StoredFormat):
    """Codec of a GGUF file's tensors: each stored under one role, its GGML type's name."""

    method: ClassVar[str] = "gguf"

    def __init__(self, types: tuple[str, ...] = (), where: str = "GGUF file"):
        unknown = sorted(set(types) - set(SUPPORTED_TYPES))
        if unknown:
            raise FormatError(f"{where}: GGML type {unknown[0]} is not supported "
                              f"(supported: {', '.join(SUPPORTED_TYPES)})")
        self.types = tuple(types)
        self.where = where

    @classmethod
    def from_config(cls, qconfig: dict, *, where: str) -> GGUFFormat:
        raise FormatError(f"{where}: quant_method 'gguf' is not a config.json setting; pass the .gguf file "
                          "(or its directory) to kinject.from_pretrained")

    def storage_keys(self, name: str) -> dict[str, str] | None:
        return None              # the GGUF index names every tensor's storage itself

    def check(self, name: str, parts: Layout, shape: tuple[int, ...]) -> None:
        """Refuse a storage tensor whose bytes per row do not hold ``shape``'s rows of its type."""
        if len(parts) != 1 or next(iter(parts)) not in SUPPORTED_TYPES:
            raise FormatError(f"tensor '{name}': GGUF storage roles {sorted(parts)}; expected one of "
                              f"{', '.join(SUPPORTED_TYPES)}")
        (qtype, (stored, dtype)), = parts.items()
        block, _ = ggml.BLOCKS[qtype]
        shape, stored = tuple(shape), tuple(stored)
        if dtype != torch.uint8 or not shape or shape[-1] % block:
            raise FormatError(f"tensor '{name}': {format_shape(shape)} cannot be stored as {qtype} "
                              f"(rows of whole {block}-value blocks, uint8 bytes)")
        expected = shape[:-1] + (ggml.row_bytes(qtype, shape[-1]),)
        if stored != expected:
            raise FormatError(f"tensor '{name}': {qtype} bytes {format_shape(stored)} do not hold {format_shape(shape)} "
                              f"(expected {format_shape(expected)})")

    def dequantize(self, parts: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
        """``{type: uint8 [..., rows, row_bytes]}`` -> ``[..., rows, cols]`` in ``dtype``, as gguf-py computes it."""
        (qtype, data), = parts.items()
        return ggml.dequantize(data, qtype, dtype)

    def describe(self) -> str:
        return "gguf " + ", ".join(self.types) if self.types else "gguf"


def quantize(weight: torch.Tensor, qtype: str = "Q8_0") -> dict[str, torch.Tensor]:
    """``[..., rows, cols]`` float weight -> ``{qtype: uint8 [..., rows, row_bytes]}``, by gguf-py's
    own encoder (``gguf.quants.quantize``: Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, BF16, F16, F32)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    values = weight.detach().to(torch.float32).cpu().numpy()
    packed = quants.quantize(values, GGMLQuantizationType[qtype])
    packed = np.ascontiguousarray(packed).view(np.uint8).reshape(*values.shape[:-1], -1)
    return {qtype: torch.from_numpy(packed.copy())}
