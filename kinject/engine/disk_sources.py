"""Lazy references to tensors on disk, and the reader that fills them with as few calls as it can.

A :class:`Source` says how to produce one tensor (or one expert's slice of a fused tensor) from
:class:`~kinject.engine.safetensors_header.Piece` byte ranges; a :class:`StoredSource` is a tensor
a quantized checkpoint stores as several storage tensors. The store keeps either as a disk-tier
unit's tensors and reads them with :func:`read_sources` when the unit is placed: every piece of a
batch sorted by file offset, back-to-back pieces read with one ``preadv`` (docs/architecture.md,
"The data path of one decode step"). The checkpoint index (:mod:`kinject.io.checkpoint`) builds
them from a model's checkpoint; the store builds them for the files it writes itself.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from kinject.engine.safetensors_header import Piece
from kinject.errors import LoadError
from kinject.formatting import format_shape


class DiskTensor(Protocol):
    """A lazy reference to a tensor on disk (:class:`Source` and :class:`StoredSource` are two;
    the store reads any other through its own ``read``)."""

    shape: tuple
    dtype: torch.dtype
    nbytes: int

    def read(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(frozen=True)
class Source:
    """How to produce one target tensor (or one expert's slice of a fused target) from disk.

    The produced tensor is ``pieces[0]`` alone, or the pieces concatenated along ``concat_dim``
    (gate and up of one expert). When ``parts`` is non-empty the produced tensor is instead
    ``torch.stack`` of the parts (one per expert) along a new dim 0, and ``pieces`` lists every
    part's pieces in order (what a whole fused parameter is in a per-expert checkpoint).
    ``dtype`` is the dtype on disk; ``nbytes`` the bytes read.

    With ``convert`` the pieces are whole checkpoint keys that a transformers conversion kinject
    cannot read lazily combines: they are read into their own tensors and ``convert`` (those
    tensors, in ``pieces`` order) makes the produced tensor, of ``shape``/``dtype``.
    """

    name: str
    expert: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    pieces: tuple[Piece, ...]
    concat_dim: int | None
    nbytes: int
    parts: tuple[Source, ...] = ()
    interleave: int | None = None   # transformers' Interleave(dim): halves of this dim stored interleaved
    convert: Callable[[list[torch.Tensor]], torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def read(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read this tensor (only these pieces' bytes) as ``dtype`` (default: the disk dtype).

        With ``out`` (shape ``self.shape``, any device/dtype, e.g. a reusable pinned buffer) the
        data is written into it and ``out`` is returned; a contiguous CPU ``out`` of the disk
        dtype is filled straight from the file, without a staging copy.
        """
        if out is None:
            result = torch.empty(self.shape, dtype=self.dtype)  # [*shape], disk dtype
            self._read_into(result)
            return result if dtype is None or dtype == self.dtype else result.to(dtype)
        if tuple(out.shape) != tuple(self.shape):
            raise ValueError(f"read('{self.name}'): out has shape {format_shape(out.shape)}, expected {format_shape(self.shape)}")
        if dtype is not None and dtype != out.dtype:
            raise ValueError(f"read('{self.name}'): dtype={dtype} but out is {out.dtype}")
        with torch.no_grad():
            self._read_into(out.detach())
        return out

    def _read_into(self, out: torch.Tensor) -> None:
        read_sources([(self, out)])

    def placements(self, out: torch.Tensor) -> list[tuple[Piece, torch.Tensor]]:
        """(piece, the view of ``out`` it fills) for every piece of this source."""
        if self.convert is not None:
            raise ValueError(f"'{self.name}' is converted after reading its keys whole: "
                             "read it with read() or read_sources()")
        if self.parts:
            return [pv for e, part in enumerate(self.parts) for pv in part.placements(out[e])]
        if self.interleave is not None:   # stored [.., a0, b0, a1, b1, ..] along d; wanted [.., a.., b..]
            piece, d = self.pieces[0].located(), self.interleave
            half = piece.shape[d] // 2
            view = out.unflatten(d, (2, half)).transpose(d, d + 1)                 # [.., half, 2, ..] of out
            return [(dataclasses.replace(piece, shape=piece.shape[:d] + (half, 2) + piece.shape[d + 1:]), view)]
        if self.concat_dim is None:
            return [(self.pieces[0], out)]
        placed, start = [], 0
        for piece in self.pieces:
            piece = piece.located()
            size = piece.shape[self.concat_dim]
            placed.append((piece, out.narrow(self.concat_dim, start, size)))
            start += size
        return placed


def read_sources(items: list[tuple["Source", torch.Tensor]], *, readahead: bool = True) -> None:
    """Fill every ``out`` with its source's data, with as few system calls as possible: the
    pieces of all sources are sorted by file offset and every run of back-to-back pieces is
    one ``preadv`` scattering into the outputs (one expert's w1/w2/w3 in a hub checkpoint:
    one 22 MB request instead of three; with two disk workers +15-32 % throughput for scattered
    expert reads, BENCHMARKS.md "Disk read patterns"). A source with ``convert`` has its keys read
    whole into their own tensors in the same requests, then converted into ``out``.
    ``readahead=False``: see :func:`read_pieces`."""
    with torch.no_grad():
        placed, converted = [], []
        for src, out in items:
            if src.convert is None:
                placed += src.placements(out.detach())
                continue
            keys = [piece.located() for piece in src.pieces]
            whole = [torch.empty(piece.shape, dtype=piece.dtype) for piece in keys]
            placed += zip(keys, whole)
            converted.append((src, out, whole))
        read_pieces(placed, readahead=readahead)
        for src, out, whole in converted:
            out.detach().copy_(src.convert(whole))


@dataclass(frozen=True)
class StoredSource:
    """A tensor of a quantized checkpoint as its storage tensors (docs/architecture.md, "Stored formats").

    The tensor is ``fmt.dequantize`` of each of ``pieces`` (role -> the :class:`Source` of one
    storage tensor: FP8 values and their scales), concatenated along ``concat_dim`` when there are
    several (gate and up of one expert), or, with ``parts``, those parts stacked along a new dim 0
    (a whole fused ``[E, ...]`` parameter). ``shape``/``dtype``: the logical tensor's (the model's
    dtype); ``nbytes``: storage bytes. A store unit holds :meth:`storage` and rebuilds the tensor on
    the compute device with :meth:`assemble`; :meth:`read` does both at once.
    """

    name: str
    expert: int | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: Any = field(repr=False)
    pieces: tuple[dict[str, Source], ...] = ()
    concat_dim: int | None = None
    parts: tuple[StoredSource, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(src.nbytes for src in self.storage().values())

    def storage(self) -> dict[str, Source]:
        """Storage tensor name (``"<piece>.<role>"``, ``"<expert>.<piece>.<role>"`` when stacked) -> Source."""
        if self.parts:
            return {f"{e}.{k}": src for e, part in enumerate(self.parts) for k, src in part.storage().items()}
        return {f"{i}.{role}": src for i, piece in enumerate(self.pieces) for role, src in piece.items()}

    def assemble(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        """The logical tensor from ``tensors`` (:meth:`storage`'s names, on any device), in ``dtype``."""
        dtype = dtype or self.dtype
        if self.parts:
            return torch.stack([part.assemble(_under(tensors, f"{e}."), dtype) for e, part in enumerate(self.parts)])
        values = [self.fmt.dequantize({role: tensors[f"{i}.{role}"] for role in piece}, dtype)
                  for i, piece in enumerate(self.pieces)]
        return values[0] if len(values) == 1 else torch.cat(values, self.concat_dim)   # [*shape]

    def read(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read the storage tensors and rebuild the tensor (into ``out`` when given)."""
        storage = self.storage()
        bufs = {k: torch.empty(src.shape, dtype=src.dtype) for k, src in storage.items()}
        read_sources([(src, bufs[k]) for k, src in storage.items()])
        tensor = self.assemble(bufs, out.dtype if out is not None else dtype)
        if out is None:
            return tensor
        with torch.no_grad():
            out.detach().copy_(tensor)
        return out


def _under(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}


# --------------------------------------------------------------------------------------------
# reading bytes
# --------------------------------------------------------------------------------------------


_IOV_MAX = 512                   # buffers per preadv call (Linux allows 1024)


def read_pieces(placed: list[tuple[Piece, torch.Tensor]], *, readahead: bool = True) -> None:
    """Fill each view with its piece's data (any dtype/device/layout; straight from the file
    into contiguous CPU views of the disk dtype, through a staging tensor otherwise).

    ``readahead=False`` opens the files ``POSIX_FADV_RANDOM``: the kernel reads only the bytes
    asked for. With readahead, a lone 22 MB expert read also pulls the next ~8 MB of the file
    (``read_ahead_kb``), wasted when that is an expert nobody routed to; whether skipping it is
    faster depends on the disk (BENCHMARKS.md "Offload on CPU")."""
    jobs, copies = [], []
    for piece, out in placed:
        piece = piece.located()
        if tuple(out.shape) != tuple(piece.shape):
            raise ValueError(f"'{piece.key}' in {piece.file}: out has shape {format_shape(out.shape)}, "
                             f"piece {format_shape(piece.shape)}")
        if piece.nbytes == 0:
            continue
        direct = out.device.type == "cpu" and out.dtype == piece.dtype and out.is_contiguous()
        target = out if direct else torch.empty(piece.shape, dtype=piece.dtype)
        jobs.append((piece, memoryview(target.reshape(-1).view(torch.uint8).numpy()).cast("B")))
        if not direct:
            copies.append((out, target))
    by_file: dict[str, list] = {}
    for job in jobs:
        by_file.setdefault(job[0].file, []).append(job)
    for file, group in by_file.items():
        group.sort(key=lambda j: j[0].offset)
        try:
            fd = os.open(file, os.O_RDONLY)
        except OSError as err:
            raise LoadError(f"cannot read tensor '{group[0][0].key}' from {file}: {err}") from err
        try:
            if not readahead and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            run = [group[0]]
            for job in group[1:]:
                last = run[-1][0]
                if job[0].offset == last.offset + last.nbytes and len(run) < _IOV_MAX:
                    run.append(job)
                else:
                    _preadv(fd, run)
                    run = [job]
            _preadv(fd, run)
        finally:
            os.close(fd)
    for out, staging in copies:
        out.copy_(staging)


def _preadv(fd: int, run: list[tuple[Piece, memoryview]]) -> None:
    """Read back-to-back pieces with ``preadv`` calls (a call may return less: go on from there)."""
    views = [view for _, view in run]
    offset = run[0][0].offset
    i = 0
    while i < len(views):
        try:
            n = os.preadv(fd, views[i:i + _IOV_MAX], offset)
        except OSError as err:
            piece = run[i][0]
            raise LoadError(f"cannot read tensor '{piece.key}' from {piece.file}: {err}") from err
        if n == 0:
            piece = run[i][0]
            done = offset - piece.offset
            raise LoadError(
                f"checkpoint file {piece.file} is truncated: tensor '{piece.key}' needs bytes "
                f"{piece.offset}..{piece.offset + piece.nbytes}, the file ends at {piece.offset + done}")
        offset += n
        while i < len(views) and n >= len(views[i]):   # fully read views are done
            n -= len(views[i])
            i += 1
        if n:                                          # partly read view: the rest of it next
            views[i] = views[i][n:]
