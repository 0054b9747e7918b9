"""How a unit's tensors are stored when they are not stored as the model holds them.

Three cases, all decided when the store adds a unit (:meth:`~kinject.engine.store.TensorStore.add`):
weights HQQ-packed by kinject (``quant``: :func:`quantize_unit`, cached in ``offload_dir``);
weights a quantized checkpoint stores quantized (:func:`expand_stored`: their storage tensors, FP8
values and scales, move as stored); and in-memory tensors placed on the disk tier
(:func:`write_unit_file`). Either quantized form is rebuilt on the compute device right before use
(:func:`assembled`).
"""

from __future__ import annotations

import math
import os
import re
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from kinject.engine.disk_sources import Source
from kinject.engine.quant import HQQFormat, load_quantized, quantize, save_quantized
from kinject.engine.safetensors_header import Piece
from kinject.engine.unit import Unit


def tensor_nbytes(t: Any, dtype: torch.dtype | None) -> int:
    """Bytes of ``t`` (a tensor or a disk reference) in ``dtype`` (None: its own)."""
    numel = 1
    for s in t.shape:
        numel *= int(s)
    return numel * (dtype or t.dtype).itemsize


def quantize_unit(name: str, tensors: dict[str, Any], spec, dtype, tier: str, *, device: torch.device,
                  cache_dir: Path | None, stats: dict):
    """HQQ-pack a unit's weights (``spec``: a :class:`~kinject.engine.quant.QuantSpec`); reuse the packed
    file in ``cache_dir`` (``offload_dir``) when its source matches. Returns (tensors with each packed role
    as its parts -- disk references into that file on the ``disk`` tier --, role -> (shape, dtype, spec),
    role -> :class:`~kinject.engine.quant.HQQFormat`); ``stats["quantized"]`` counts the roles solved."""
    roles = [k for k, v in tensors.items() if len(v.shape) >= 2 and v.dtype.is_floating_point
             and math.prod(v.shape) % spec.group_size == 0]
    # HQQ's solver runs on the compute device when it is a GPU (fp16 there, fp32 on CPU:
    # the results differ slightly, so the solver device is part of the cache key)
    solver = device if device.type == "cuda" else None
    meta = {"unit": name, "spec": spec.to_dict(), "dtype": str(dtype), "solver": str(solver or "cpu"),
            "sources": {k: fingerprint(tensors[k]) for k in roles}}
    path = None
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = cache_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".hqq.safetensors")
    packed = load_quantized(path, meta) if path is not None else None
    if packed is None:
        packed = {}
        for k in roles:
            v = tensors[k]
            w = v if isinstance(v, torch.Tensor) else v.read(dtype)
            packed[k] = quantize(w.to(dtype) if dtype is not None else w, spec, device=solver)
        stats["quantized"] = stats.get("quantized", 0) + len(roles)
        if path is not None:
            save_quantized(path, packed, meta)
    out = {k: v for k, v in tensors.items() if k not in packed}
    info, stored = {}, {}
    for k, qt in packed.items():
        info[k] = (tuple(qt.shape), qt.dtype, qt.spec)
        stored[k] = HQQFormat(qt.spec, qt.shape)
        for part, t in qt.tensors().items():
            out[f"{k}.{part}"] = packed_source(path, f"{k}.{part}", t) if tier == "disk" else t
    return out, info, stored

@staticmethod
def packed_source(path, key: str, t: torch.Tensor) -> Source:
    """The disk reference to the packed part ``key`` of an HQQ cache file."""
    return Source(name=key, expert=None, shape=tuple(t.shape), dtype=t.dtype,
                  pieces=(Piece(str(path), key, None),), concat_dim=None, nbytes=tensor_nbytes(t, None))


def write_unit_file(directory: Path, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Source]:
    """In-memory tensors placed on ``disk``: written once to a file of ``directory``, read back lazily."""
    path = directory / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".safetensors")
    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
    return {k: Source(name=f"{name}.{k}", expert=None, shape=tuple(v.shape), dtype=v.dtype,
                      pieces=(Piece(str(path), k, None),), concat_dim=None, nbytes=tensor_nbytes(v, None))
            for k, v in tensors.items()}


def assembled(unit: Unit, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized unit's weights from its storage tensors ``packed`` (on whichever device they
    are): each stored role rebuilt by its format, the other roles in the compute dtype."""
    prefixes = tuple(f"{role}." for role in unit.quant)
    dtype = next(iter(unit.quant.values()))[1]
    out = {k: v if dtype is None or not v.is_floating_point() else v.to(dtype)
           for k, v in packed.items() if not k.startswith(prefixes)}
    for role, (_, dtype, _) in unit.quant.items():
        parts = {k[len(role) + 1:]: v for k, v in packed.items() if k.startswith(f"{role}.")}
        out[role] = unit.stored[role].assemble(parts, dtype)
    return out


def is_stored(v: Any) -> bool:
    """A tensor a quantized checkpoint stores quantized (:class:`~kinject.engine.disk_sources.StoredSource`)."""
    return hasattr(v, "storage") and hasattr(v, "assemble")


def expand_stored(tensors: dict[str, Any], dtype: torch.dtype | None):
    """A unit's stored tensors as their storage tensors (``"<role>.<part>"``): (tensors, role ->
    (shape, compute dtype, format), role -> StoredSource)."""
    out, info, stored = {}, {}, {}
    for role, v in tensors.items():
        if not is_stored(v):
            out[role] = v
            continue
        out.update({f"{role}.{part}": src for part, src in v.storage().items()})
        info[role] = (tuple(v.shape), dtype or v.dtype, v.fmt)
        stored[role] = v
    return out, info, stored


def double_quantization(name: str, tensors: dict[str, Any]) -> str:
    fmt = next(v.fmt for v in tensors.values() if is_stored(v))
    return (f"unit {name!r}: quant on weights the checkpoint already stores quantized ({fmt.describe()}) "
            "would quantize them twice; kinject refuses it: drop the quant kwarg (vars.quant) for a quantized "
            "checkpoint (its weights already move in their low-bit storage format)")


def fingerprint(v: Any) -> list:
    """Cheap identity of a quantization source: shape, dtype and checksums (tensors) or the
    file pieces with their size and mtime (disk references)."""
    if isinstance(v, torch.Tensor):
        f = v.detach().float()
        return [list(v.shape), str(v.dtype), round(float(f.sum()), 4), round(float(f.abs().sum()), 4)]
    files = []
    for p in getattr(v, "pieces", ()):
        st = os.stat(p.file)
        files.append([p.file, p.key, list(p.index) if p.index else None, st.st_size, int(st.st_mtime)]
                     + ([list(p.rows)] if p.rows else []))
    return [list(v.shape), str(v.dtype), files]
