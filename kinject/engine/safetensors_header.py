"""The safetensors file format as kinject reads it: a header, and pieces of the bytes after it.

A safetensors file is an 8-byte header length, a JSON header (name -> dtype, shape, byte range)
and the tensors' bytes. :func:`read_header` parses the header alone (no tensor data);
a :class:`HeaderEntry` is one tensor of it, and :meth:`HeaderEntry.piece` the exact byte range of
the whole tensor, of one block of its leading dims (expert ``e`` of a fused ``[E, ...]`` key) or of
a range of rows. A :class:`Piece` is what the byte reader (:mod:`kinject.engine.disk_sources`)
reads. Checkpoints and the store's own ``offload_dir`` files are both safetensors files, which is
why this lives in the engine, below the checkpoint index (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass, field

import torch

from kinject.errors import LoadError
from kinject.formatting import format_shape

# safetensors dtype tags -> torch dtypes (the float8 ones exist only in recent torch builds)
DTYPES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
_TORCH_DTYPES = {tag: getattr(torch, name) for tag, name in DTYPES.items() if hasattr(torch, name)}
_MAX_HEADER = 100 * 1024 * 1024  # safetensors refuses headers above 100 MB too


@dataclass(frozen=True)
class Piece:
    """One read from one file: checkpoint key ``key`` of ``file`` (whole, or its block ``index``,
    or a range of rows of it).

    ``index`` is a tuple of leading integer indices, e.g. ``(e,)`` for expert ``e`` of a fused
    ``[E, ...]`` key, or ``None`` for the whole tensor; ``rows`` (``(start, stop)``) then keeps
    only those rows of the next dim (expert ``e``'s rows ``e*R .. (e+1)*R`` of a 2-D ``[E*R, H]``
    key): still one contiguous byte range. ``shape``/``dtype``/``offset``/``nbytes``
    locate exactly the bytes read (absolute offset in the file); :class:`CheckpointIndex` fills
    them from the header. A hand-made ``Piece(file, key, index)`` leaves them unset and they are
    looked up in the file's header when read.
    """

    file: str
    key: str
    index: tuple[int, ...] | None = None
    rows: tuple[int, int] | None = None
    shape: tuple[int, ...] | None = field(default=None, compare=False)
    dtype: torch.dtype | None = field(default=None, compare=False)
    offset: int | None = field(default=None, compare=False)
    nbytes: int | None = field(default=None, compare=False)

    def located(self) -> Piece:
        """This piece with ``shape``/``dtype``/``offset``/``nbytes`` filled in (reads the header if needed)."""
        if self.offset is not None:
            return self
        entry = read_header(self.file).get(self.key)
        if entry is None:
            raise LoadError(f"tensor key '{self.key}' not found in {self.file}")
        return entry.piece(self.index, self.rows)


@dataclass(frozen=True)
class HeaderEntry:
    """One tensor as a safetensors header describes it (absolute byte range in the file)."""

    file: str
    key: str
    shape: tuple[int, ...]
    dtype: torch.dtype | None  # None: a dtype tag this torch cannot represent
    dtype_tag: str
    begin: int
    end: int

    def piece(self, index: tuple[int, ...] | None = None, rows: tuple[int, int] | None = None) -> Piece:
        """The piece reading the whole tensor, its contiguous block ``index`` (leading dims), or
        rows ``start .. stop`` of the dim after ``index`` (contiguous too: only their bytes).
        The whole tensor's piece is made once (every per-expert key of a checkpoint is read whole:
        tens of thousands of them at set-up)."""
        if self.dtype is None:
            raise LoadError(
                f"tensor key '{self.key}' in {self.file} has dtype {self.dtype_tag}, which torch cannot read"
            )
        if not index and rows is None:
            whole = self.__dict__.get("_whole")
            if whole is None:
                whole = Piece(self.file, self.key, None, None, self.shape, self.dtype, self.begin, self.end - self.begin)
                object.__setattr__(self, "_whole", whole)    # (frozen: a cache, not a field)
            return whole
        index = tuple(index or ())
        k = len(index)
        in_range, flat = k <= len(self.shape), 0
        for i, n in zip(index, self.shape):
            if not 0 <= i < n:
                in_range = False
                break
            flat = flat * n + i
        if not in_range:
            raise LoadError(f"index {index} is out of range for tensor '{self.key}' {format_shape(self.shape)} in {self.file}")
        shape = self.shape[k:]
        block = math.prod(shape) * self.dtype.itemsize
        offset = self.begin + flat * block
        if rows is not None:
            start, stop = rows
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise LoadError(f"rows {start}..{stop} are out of range for tensor '{self.key}' "
                                f"{format_shape(self.shape)}{f' at {index}' if index else ''} in {self.file}")
            row = block // shape[0] if shape[0] else 0
            shape = (stop - start,) + shape[1:]
            offset, block = offset + start * row, (stop - start) * row
        return Piece(self.file, self.key, index or None, rows, shape, self.dtype, offset, block)


def read_header(file: str) -> dict[str, HeaderEntry]:
    """Parse a safetensors header (no tensor data); refuse unreadable, corrupt or truncated files."""
    try:
        size = os.path.getsize(file)
        with open(file, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise LoadError(f"checkpoint file {file} is truncated or not a safetensors file ({size} bytes)")
            (n,) = struct.unpack("<Q", head)
            if n > min(_MAX_HEADER, size - 8):
                raise LoadError(
                    f"checkpoint file {file} is truncated or not a safetensors file: "
                    f"header length {n} does not fit in {size} bytes"
                )
            raw = f.read(n)
    except OSError as err:
        raise LoadError(f"cannot read checkpoint file {file}: {err}") from err
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("header is not a JSON object")
    except (ValueError, UnicodeDecodeError) as err:
        raise LoadError(f"checkpoint file {file} has a corrupt safetensors header: {err}") from err

    data_start = 8 + n
    entries: dict[str, HeaderEntry] = {}
    needed = data_start
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            tag, shape = meta["dtype"], tuple(map(int, meta["shape"]))
            begin, end = map(int, meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise LoadError(f"checkpoint file {file} has a corrupt header entry for '{key}': {meta!r}") from err
        dtype = _TORCH_DTYPES.get(tag)
        if not 0 <= begin <= end or dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise LoadError(
                f"checkpoint file {file} has a corrupt header entry for '{key}': "
                f"{end - begin} bytes for {tag} {format_shape(shape)}"
            )
        entries[key] = HeaderEntry(file, key, shape, dtype, tag, data_start + begin, data_start + end)
        needed = max(needed, data_start + end)
    if size < needed:
        raise LoadError(
            f"checkpoint file {file} is truncated: its header needs {needed} bytes, the file has {size}"
        )
    return entries
