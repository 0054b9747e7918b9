"""Stored weight formats of quantized checkpoints, chosen by ``quantization_config.quant_method``.

:data:`FORMATS` is the ordered chain (docs/architecture.md, "Ordered chains"): :func:`format_for` gives the first format
whose ``method`` is the checkpoint's, and refuses any other method, naming it, the file and what
is supported, before any weight is read. A new format is one small module whose
:class:`~kinject.engine.formats.base.StoredFormat` subclass is added to the chain.
"""

from __future__ import annotations

import importlib
import logging

from kinject.engine.formats.base import FormatError, StoredFormat

logger = logging.getLogger(__name__)

__all__ = ["FORMATS", "FormatError", "StoredFormat", "format_for"]

# the chain: format modules, in the order they are asked (a module not present is skipped)
FORMAT_MODULES: tuple[tuple[str, str], ...] = (
    ("kinject.engine.formats.fp8", "FP8Format"),
    ("kinject.engine.formats.mxfp4", "MXFP4Format"),
    ("kinject.engine.formats.fp4", "CompressedFP4Format"),            # compressed-tensors' FP4 packings first
    ("kinject.engine.formats.compressed_tensors", "CompressedTensorsFormat"),
    ("kinject.engine.formats.fp4", "ModelOptNVFP4Format"),
)


def _available(modules: tuple[tuple[str, str], ...]) -> tuple[type[StoredFormat], ...]:
    """The format classes of ``modules`` that this installation has, in chain order."""
    found = []
    for module, cls in modules:
        try:
            found.append(getattr(importlib.import_module(module), cls))
        except (ImportError, AttributeError):
            logger.debug("stored format %s.%s not available", module, cls)
    return tuple(found)


FORMATS: tuple[type[StoredFormat], ...] = _available(FORMAT_MODULES)


def format_for(qconfig, *, where: str) -> StoredFormat | None:
    """The stored format of a checkpoint whose config.json (``where``) has ``qconfig`` as its
    ``quantization_config`` (a dict, or a transformers config object); None when unquantized."""
    if qconfig is None:
        return None
    if not isinstance(qconfig, dict):
        qconfig = qconfig.to_dict() if hasattr(qconfig, "to_dict") else vars(qconfig)
    method = str(qconfig.get("quant_method", "")).lower().replace("_", "-")
    chain = FORMATS
    for cls in chain:
        if cls.method == method and cls.accepts(qconfig):
            return cls.from_config(qconfig, where=where)
    supported = ", ".join(dict.fromkeys(cls.method for cls in chain))
    raise FormatError(f"{where}: quantization_config.quant_method {qconfig.get('quant_method')!r} is not supported "
                      f"by kinject (supported: {supported}; or an unquantized checkpoint)")
