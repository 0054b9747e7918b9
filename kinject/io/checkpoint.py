"""Lazy, headers-only index of a safetensors checkpoint against the model it is for.

The streaming loader never holds the whole model in RAM: it builds the model on the meta
device and asks this module, for every model tensor, *how to read it from disk*. The answer is
a :class:`Source` — a few byte ranges in a few files, plus how to assemble them — that the store
keeps as a lazy disk reference and reads when it places the tensor (DESIGN.md §3, §4).

Two checkpoint layouts work as they are, never converted:

* **fused** (what transformers 5 ``save_pretrained`` writes): one key per model tensor, experts as
  3-D ``experts.gate_up_proj[E, 2I, H]`` / ``experts.down_proj[E, H, I]`` (GPT-OSS transposed,
  interleaved and biased — stored exactly as the model holds it). One expert is the contiguous
  ``[e]`` block of the key, so :meth:`CheckpointIndex.expert_source` reads only its bytes; in
  general :meth:`CheckpointIndex.rows_source` is any row range of dim 0 (expert ``e``'s rows
  ``e*R .. (e+1)*R`` of a 2-D ``[E*R, H]`` key, DBRX), one byte range of the key.
* **per-expert** (the original hub layout): ``experts.E.w1/w3/w2.weight`` (Mixtral, PhiMoE) or
  ``experts.E.gate_proj/up_proj/down_proj.weight`` (Qwen2/3-MoE, DeepSeek-V2/V3, OLMoE, ...).
  Which keys make which fused parameter is not re-invented here: it is transformers' own
  checkpoint conversion mapping for the model (``transformers.conversion_mapping``), whose
  ``WeightRenaming`` entries are applied as they are (``core_model_loading.rename_source_key``)
  and whose ``WeightConverter`` operations are *interpreted* for lazy reading instead of being
  run on loaded tensors: ``MergeModulelist(dim=0)`` = "expert ``e`` is the key whose ``*`` is
  ``e``", ``Concatenate(dim=d)`` = "concatenate the per-expert pieces (gate, up) along ``d - 1``
  of one expert's slice", ``Split(dim=0)`` / ``Chunk(dim=0)`` of one key into several targets
  (a fused ``query_key_value``) = "each target is a row range of the key", sized as transformers
  sizes it (each target's own rows; equal parts), ``ErnieFuseAndSplitTextVisionExperts`` = "one
  list of per-expert keys cut in equal runs into several stacked targets" (ERNIE-4.5-VL's text and
  vision experts; read per expert as ``MergeModulelist``). Any other conversion is run *eagerly*, by
  transformers' own operations on the keys read whole, for every tensor but a fused expert
  parameter (read one expert at a time, never by converting all of them): those are refused
  with the operation named.

Nothing here reads tensor data at :meth:`CheckpointIndex.open`: the safetensors headers (8-byte
length + JSON) give names, shapes, dtypes and byte offsets, and every model tensor is validated
up front (missing, mis-shaped, truncated file), and so is every checkpoint key: one that no model
tensor uses is an error unless transformers' own loader ignores it for that model (its
``_keys_to_ignore_on_load_unexpected`` patterns, e.g. DeepSeek-V3's MTP layer; stale rotary
``inv_freq`` / ``position_ids`` buffers). :meth:`Source.read` then reads exactly the bytes
of its pieces (``readinto`` straight into the caller's buffer when dtype and layout allow, e.g. a
reusable pinned staging buffer) and converts the dtype.

    index = CheckpointIndex.open("ckpt/", meta_model)
    w = index.source("model.embed_tokens.weight").read(torch.float32)             # [V, H]
    src = index.expert_source("model.layers.0.mlp.experts.gate_up_proj", 3)       # one expert
    src.read(out=pinned_buffer)                                                   # [2I, H], src.nbytes bytes read
    index.rows_source("transformer.blocks.0.ffn.experts.mlp.w1", 3 * R, 4 * R)    # [R, H], expert 3's rows
"""

from __future__ import annotations

import dataclasses

import difflib
import json
import logging
import math
import os
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, NamedTuple

import torch

from kinject.engine.formats.base import FormatError
from kinject.errors import LoadError

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"

# safetensors dtype tags -> torch dtypes (the float8 ones exist only in recent torch builds)
_DTYPES: dict[str, str] = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "I32": "int32",
    "U32": "uint32", "I64": "int64", "U64": "uint64", "F16": "float16", "BF16": "bfloat16",
    "F32": "float32", "F64": "float64", "C64": "complex64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
}
_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))
_FROM_CONFIG = object()          # CheckpointIndex.open: the stored format config.json names
_MAX_HEADER = 100 * 1024 * 1024  # safetensors refuses headers above 100 MB too
_LIST_FILES = 8                  # file names quoted in an error message before "..."
_LIST_KEYS = 3                   # unexpected keys quoted (each with its closest model names) before "N more"


# --------------------------------------------------------------------------------------------
# public value types
# --------------------------------------------------------------------------------------------


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
        entry = _read_header(self.file).get(self.key)
        if entry is None:
            raise LoadError(f"tensor key '{self.key}' not found in {self.file}")
        return entry.piece(self.index, self.rows)


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
            raise ValueError(f"read('{self.name}'): out has shape {_fmt(out.shape)}, expected {_fmt(self.shape)}")
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
    """A tensor of a quantized checkpoint as its storage tensors (DESIGN.md §3 "Stored formats").

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
            raise ValueError(f"'{piece.key}' in {piece.file}: out has shape {_fmt(out.shape)}, "
                             f"piece {_fmt(piece.shape)}")
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


# --------------------------------------------------------------------------------------------
# safetensors headers
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Entry:
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
        rows ``start .. stop`` of the dim after ``index`` (contiguous too: only their bytes)."""
        if self.dtype is None:
            raise LoadError(
                f"tensor key '{self.key}' in {self.file} has dtype {self.dtype_tag}, which torch cannot read"
            )
        index = tuple(index or ())
        k = len(index)
        if k > len(self.shape) or any(not 0 <= i < n for i, n in zip(index, self.shape)):
            raise LoadError(f"index {index} is out of range for tensor '{self.key}' {_fmt(self.shape)} in {self.file}")
        shape = self.shape[k:]
        block = math.prod(shape) * self.dtype.itemsize
        flat = 0
        for i, n in zip(index, self.shape):
            flat = flat * n + i
        offset = self.begin + flat * block
        if rows is not None:
            start, stop = rows
            if not shape or not 0 <= start <= stop <= shape[0]:
                raise LoadError(f"rows {start}..{stop} are out of range for tensor '{self.key}' "
                                f"{_fmt(self.shape)}{f' at {index}' if index else ''} in {self.file}")
            row = block // shape[0] if shape[0] else 0
            shape = (stop - start,) + shape[1:]
            offset, block = offset + start * row, (stop - start) * row
        elif not index:
            return Piece(self.file, self.key, None, None, self.shape, self.dtype, self.begin, self.end - self.begin)
        return Piece(self.file, self.key, index or None, rows, shape, self.dtype, offset, block)


def _read_header(file: str) -> dict[str, _Entry]:
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
    entries: dict[str, _Entry] = {}
    needed = data_start
    for key, meta in header.items():
        if key == "__metadata__":
            continue
        try:
            tag, shape = meta["dtype"], tuple(int(d) for d in meta["shape"])
            begin, end = (int(x) for x in meta["data_offsets"])
        except (KeyError, TypeError, ValueError) as err:
            raise LoadError(f"checkpoint file {file} has a corrupt header entry for '{key}': {meta!r}") from err
        dtype = getattr(torch, _DTYPES[tag], None) if tag in _DTYPES else None
        if not 0 <= begin <= end or dtype is not None and end - begin != math.prod(shape) * dtype.itemsize:
            raise LoadError(
                f"checkpoint file {file} has a corrupt header entry for '{key}': "
                f"{end - begin} bytes for {tag} {_fmt(shape)}"
            )
        entries[key] = _Entry(file, key, shape, dtype, tag, data_start + begin, data_start + end)
        needed = max(needed, data_start + end)
    if size < needed:
        raise LoadError(
            f"checkpoint file {file} is truncated: its header needs {needed} bytes, the file has {size}"
        )
    return entries


def _validate_with_safetensors(file: str) -> None:
    """Let the ``safetensors`` library check what it checks (tensors' byte ranges contiguous and
    disjoint, covering the data exactly, known dtype tags): a header it refuses -- two tensors
    sharing bytes, say, where one expert would silently read another's -- is refused here too,
    with its reason. Opening maps the file; no tensor data is read."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(file, framework="pt"):
            pass
    except SafetensorError as err:
        raise LoadError(f"checkpoint file {file} is not a valid safetensors file: {err}") from err


def _checkpoint_files(path: Path) -> tuple[Path, list[str]]:
    """(directory, safetensors files) of a checkpoint directory or a single ``.safetensors`` file."""
    if path.is_file():
        return path.parent, [str(path)]
    if not path.is_dir():
        raise LoadError(f"checkpoint {path} does not exist")
    index_file = path / INDEX_FILE
    if index_file.is_file():
        try:
            weight_map = json.loads(index_file.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise LoadError(f"cannot read checkpoint index {index_file}: {err}") from err
        files = [str(path / name) for name in dict.fromkeys(weight_map.values())]
        for file in files:
            if not os.path.isfile(file):
                raise LoadError(f"checkpoint file {file} listed in {index_file} does not exist")
        return path, files
    if (path / SINGLE_FILE).is_file():
        return path, [str(path / SINGLE_FILE)]
    files = sorted(str(p) for p in path.glob("*.safetensors"))
    if not files:
        raise LoadError(f"no safetensors checkpoint in {path} (expected {SINGLE_FILE} or {INDEX_FILE})")
    return path, files


# --------------------------------------------------------------------------------------------
# transformers' checkpoint conversion mapping, interpreted for lazy reads
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Recipe:
    """What a transformers ``WeightConverter`` means for lazy reading.

    ``stack``: the target is ``[E, ...]`` and expert ``e`` comes from the keys whose ``*`` is ``e``
    (``MergeModulelist(dim=0)``); ``concat_dim``: the converter's source patterns are concatenated,
    in their order, along this dim of one expert's slice (or of the whole target when not stacked);
    ``split``: one key cut along dim 0 into the converter's several targets, each a row range of it
    (``"sizes"``: ``Split``, each target as many rows as it has; ``"chunks"``: ``Chunk``, equal parts).
    """

    stack: bool
    concat_dim: int | None
    patterns: tuple[str, ...]
    index_regex: tuple[re.Pattern | None, ...]  # per pattern: extracts the expert index from the key
    interleave: int | None = None  # ``Interleave(dim)`` of one key: its halves along dim are interleaved on disk
    split: str | None = None       # "sizes" (``Split(dim=0)``) or "chunks" (``Chunk(dim=0)``) into several targets
    experts_split: bool = False    # stacked experts cut in equal runs into the targets (text / vision experts)


def _recipes_of(converter) -> dict[str, _Recipe | str]:
    """Source pattern -> how its keys are read (a ``_Recipe``), or why they cannot be (a message).

    Operations that hand a lone source tensor through unchanged are dropped first (asked of the
    operation itself, :func:`_passes_lone_source_through`): e.g. a dequantization that combines a
    weight with scale keys, run on a checkpoint that holds only the weight (as ``save_pretrained``
    writes it). The weight's key is then read by the rest of the recipe, and a key of any other
    pattern (a scale the operation would combine) cannot be read lazily."""
    ops = list(converter.operations)
    patterns = tuple(converter.source_patterns)
    kept = list(ops)
    while kept and len(converter.target_patterns) == 1 and _passes_lone_source_through(kept[0], converter):
        kept.pop(0)
    if len(kept) == len(ops) or len(patterns) == 1:
        recipe = _interpret(converter, kept)
        return dict.fromkeys(patterns, recipe)
    lone = _interpret(converter, kept, patterns[:1])
    described = ", ".join(repr(op) for op in ops)
    why = f"operations [{described}] combining it with the key of '{patterns[0]}'"
    return {patterns[0]: lone, **{p: why for p in patterns[1:]}}


def _passes_lone_source_through(op, converter) -> bool:
    """Whether ``op.convert`` returns its only source tensor itself when given just one (a probe of
    one element: cheap, and any error or new tensor means no)."""
    probe = torch.zeros(1)
    try:
        out = op.convert({converter.source_patterns[0]: [probe]}, list(converter.source_patterns),
                         list(converter.target_patterns), model=None, full_layer_name=None)
    except Exception:  # noqa: BLE001 - an operation that needs more than one source: not a pass-through
        return False
    return isinstance(out, dict) and len(out) == 1 and next(iter(out.values())) is probe


def _interpret(converter, ops: list | None = None, patterns: tuple[str, ...] | None = None) -> _Recipe | str:
    """A ``_Recipe`` for a converter whose operations (``ops``, default all) on its source
    ``patterns`` (default all) kinject reads lazily, else why not (a message)."""
    from transformers.core_model_loading import Chunk, Concatenate, Interleave, MergeModulelist, Transpose
    try:
        from transformers.core_model_loading import Split     # (5.24; 5.17 has no Split)
    except ImportError:
        Split = None

    ops = list(converter.operations) if ops is None else ops
    patterns = tuple(converter.source_patterns) if patterns is None else patterns
    described = ", ".join(repr(op) for op in converter.operations)
    if not ops and len(patterns) == 1 and len(converter.target_patterns) == 1:
        return _Recipe(False, None, patterns, (None,))                          # the key as it is
    if len(ops) == 1 and type(ops[0]) in (Split, Chunk) and ops[0].dim == 0 and len(patterns) == 1 \
            and len(converter.target_patterns) > 1 and not getattr(ops[0], "num_shards_attribute", None):
        split = "sizes" if type(ops[0]) is Split else "chunks"
        return _Recipe(False, None, patterns, (None,), split=split)             # row ranges of one key
    if len(ops) == 1 and isinstance(ops[0], Interleave) and not ops[0].inverse and ops[0].dim > 0 \
            and len(patterns) == 1 and len(converter.target_patterns) == 1:
        return _Recipe(False, None, patterns, (None,), interleave=ops[0].dim)   # a strided read of one key
    split_experts = _experts_split_recipe(ops, patterns, converter)
    if split_experts is not None:
        return split_experts
    stack = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    rest = ops[1:] if stack else ops
    concat_dim = None
    if len(rest) == 1 and isinstance(rest[0], Concatenate) and not getattr(rest[0], "num_shards_attribute", None):
        concat_dim = rest[0].dim - (1 if stack else 0)
        rest = []
    if len(converter.target_patterns) != 1 or rest or (concat_dim is not None and concat_dim < 0):
        if len(ops) == 1 and isinstance(ops[0], Transpose) and ops[0].check_dims:
            return _Recipe(False, None, patterns, (None,) * len(patterns))  # no-op when the shape already fits
        return f"operations [{described}]"
    if stack and any(p.count("*") != 1 for p in patterns):
        return f"operations [{described}] on patterns {list(patterns)} without one '*' each"
    if not stack and len(patterns) > 1 and concat_dim is None:
        return f"operations [{described}] on several patterns"
    regexes = tuple(re.compile(p.replace("*", r"(\d+)")) if stack else None for p in patterns)
    return _Recipe(stack, concat_dim, patterns, regexes)


def _experts_split_recipe(ops: list, patterns: tuple[str, ...], converter) -> _Recipe | None:
    """The recipe of ``ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=d)`` (ERNIE-4.5-VL:
    one list of per-expert keys holds the text experts, then the vision experts), or None for any
    other operation. It cuts the list into as many equal runs as there are targets (the first runs
    ``ceil(N / targets)`` long), stacks each run and concatenates the source patterns along ``d``:
    so target ``t``'s expert ``e`` is the keys whose ``*`` is ``t * run + e``, concatenated along
    ``d - 1`` of one expert's slice, which reads lazily per expert like ``MergeModulelist``."""
    try:
        from transformers.core_model_loading import ErnieFuseAndSplitTextVisionExperts as Op
    except ImportError:  # transformers without it: no checkpoint needs it
        return None
    if len(ops) != 1 or type(ops[0]) is not Op or ops[0].stack_dim != 0 or ops[0].concat_dim < 1 \
            or any(p.count("*") != 1 for p in patterns):
        return None
    regexes = tuple(re.compile(p.replace("*", r"(\d+)")) for p in patterns)
    return _Recipe(True, ops[0].concat_dim - 1, patterns, regexes, experts_split=len(converter.target_patterns) > 1)


class _Mapped(NamedTuple):
    """Where one checkpoint key goes (:meth:`_KeyMapper.map`)."""

    targets: tuple[str, ...]           # what it makes: several when a converter cuts it into several targets
    recipe: _Recipe | str | None       # how it is read lazily, why it cannot be (a message), None: as it is
    position: int = 0                  # position of the matched source pattern in the recipe
    expert: int | None = None          # the expert a per-expert key belongs to
    pattern: str | None = None         # the converter source pattern it matched
    converter: Any = None              # that transformers ``WeightConverter``


class _KeyMapper:
    """Checkpoint key -> the target(s) it makes and how (:class:`_Mapped`), as transformers maps it."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, torch.Tensor]):
        self._targets = targets
        self._prefix = getattr(model, "base_model_prefix", None) or None
        self._renamings: list = []
        self._converters: list = []
        self._recipes: dict[str, _Recipe | str] = {}  # converter source pattern -> recipe
        self._converters_of: dict[str, Any] = {}        # converter source pattern -> its converter
        self._rename_source_key = self._apply_renamings = None
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        except ImportError:  # pragma: no cover - transformers without conversion mappings
            log.debug("transformers has no checkpoint conversion mapping; checkpoint keys are used as they are")
            return
        if not isinstance(model, PreTrainedModel):
            return
        self._apply_renamings, self._rename_source_key = _apply_renamings, rename_source_key
        mapping = get_model_conversion_mapping(model)  # fresh deep copies: the state they keep is ours
        self._renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self._converters = [t for t in mapping if isinstance(t, WeightConverter)]
        for converter in self._converters:   # a pattern of two converters: the last, as transformers picks
            self._recipes.update(_recipes_of(converter))
            self._converters_of.update(dict.fromkeys(converter.source_patterns, converter))

    def map(self, key: str) -> _Mapped:
        """The target(s) ``key`` makes, and how it is read."""
        if self._rename_source_key is None:  # not a transformers model: keys are used as they are
            return _Mapped((key,), None)
        target, pattern = self._rename_source_key(key, self._renamings, self._converters, self._prefix, self._targets)
        if target not in self._targets and key in self._targets:  # as transformers: keep a key that already fits
            return _Mapped((key,), None)
        if pattern is None:
            return _Mapped((target,), None)
        recipe, converter = self._recipes[pattern], self._converters_of[pattern]
        targets = _sibling_targets(target, converter)
        if isinstance(recipe, str):
            return _Mapped(targets, recipe, pattern=pattern, converter=converter)
        position = recipe.patterns.index(pattern)
        expert = None
        if recipe.stack:
            match = recipe.index_regex[position].search(self._apply_renamings(key, self._renamings))
            if match is None:
                why = f"pattern '{pattern}' without an expert index in '{key}'"
                return _Mapped(targets, why, pattern=pattern, converter=converter)
            expert = int(match.group(1))
            if recipe.experts_split:
                return self._split_expert(targets, recipe, position, expert, pattern, converter)
        return _Mapped(targets, recipe, position, expert, pattern, converter)

    def _split_expert(self, targets: tuple[str, ...], recipe: _Recipe, position: int, expert: int,
                      pattern: str, converter) -> _Mapped:
        """Checkpoint expert ``expert`` of a list cut in equal runs into ``targets``: the one target
        whose run holds it, and its index there. The run is the first target's number of experts
        (transformers' ``ceil(N / targets)``: the first run is never the short one)."""
        first = self._targets.get(targets[0])
        if first is None or first.dim() < 1 or first.shape[0] == 0:
            return _Mapped(targets, recipe, position, expert, pattern, converter)   # unused: reported as such
        run = int(first.shape[0])
        part = min(expert // run, len(targets) - 1)
        return _Mapped((targets[part],), recipe, position, expert - part * run, pattern, converter)


def _apply_renamings(key: str, renamings: list) -> str:
    """``key`` through every ``WeightRenaming`` in turn, as transformers renames before converting
    (its own ``apply_renamings`` exists only from 5.2x; each renaming's method since 5.0)."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def _sibling_targets(target: str, converter) -> tuple[str, ...]:
    """Every target a converter makes of the key that ``rename_source_key`` named ``target``.

    transformers names such a key after the converter's first target pattern only; its operations
    then name the others by putting each target pattern in its place (``Split``, and the
    unexpected-key report of ``convert_and_load_state_dict_in_model``): the same here."""
    first = converter.target_patterns[0]
    if len(converter.target_patterns) == 1 or first not in target:
        return (target,)
    return tuple(target.replace(first, pattern) for pattern in converter.target_patterns)


# --------------------------------------------------------------------------------------------
# the index
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Split:
    """The target is one row range of its plan's key, which a ``Split``/``Chunk(dim=0)`` cuts into
    ``targets`` (in the converter's target order; the ranges follow from their shapes)."""

    targets: tuple[str, ...]
    part: int      # which of ``targets`` this one is
    equal: bool    # ``Chunk``: equal parts as ``torch.chunk`` cuts them; ``Split``: each target's own rows


@dataclass
class _Plan:
    """How one target is laid out in the checkpoint.

    ``entry``: one key holding the whole target (fused layout, or any plain tensor), or, with
    ``split``, the fused key the target is a row range of.
    ``experts``: per expert, the entries (one per source pattern) assembled into its slice.
    ``concat``: entries (one per source pattern) concatenated into the whole target.
    ``converter`` / ``inputs``: the transformers converter the target's keys matched and every such
    key with the pattern it matched; with ``unsupported`` set, the target is read eagerly through
    the converter's own operations instead (unless it is a fused expert parameter).
    """

    target: str
    entry: _Entry | None = None
    recipe: _Recipe | None = None
    experts: dict[int, list[_Entry | None]] = field(default_factory=dict)
    concat: list[_Entry | None] = field(default_factory=list)
    unsupported: tuple[str, str] | None = None  # (checkpoint key, why) when a needed conversion is not lazy
    interleave: int | None = None  # the entry's halves along this dim are interleaved on disk
    split: _Split | None = None
    converter: Any = None
    layer_name: str | None = None  # the target transformers names the converter's keys after (its first)
    inputs: list[tuple[str, _Entry]] = field(default_factory=list)

    def keys(self) -> list[_Entry]:
        if self.unsupported is not None and self.inputs:
            return [entry for _, entry in self.inputs]
        if self.entry is not None:
            return [self.entry]
        if self.recipe is not None and self.recipe.stack:
            return [x for e in sorted(self.experts) for x in self.experts[e] if x is not None]
        return [x for x in self.concat if x is not None]


class CheckpointIndex:
    """Headers-only map from every model tensor name to how it is read from a safetensors checkpoint.

    Build it with :meth:`open`; ``names`` are the model's state-dict names (parameters and
    persistent buffers, tied aliases included), ``files`` the checkpoint's safetensors files.
    """

    def __init__(self, root: Path, files: list[str], targets: dict[str, torch.Tensor],
                 plans: dict[str, _Plan], fused_experts: set[str], model: torch.nn.Module | None = None,
                 fmt=None, stored: dict[str, dict[str, _Entry]] | None = None):
        self.root = root
        self.format = fmt                 # the checkpoint's StoredFormat (kinject.engine.formats), None: unquantized
        self._stored = stored or {}       # checkpoint key of quantized values -> role -> storage key
        self.files: list[str] = files
        self.names: list[str] = list(targets)
        self._targets = targets
        self._plans = plans
        self._fused = fused_experts
        self._model = model   # what transformers' conversion operations are given (eager conversions)
        self._converted: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}  # target -> converted shape, dtype

    def __repr__(self) -> str:
        return f"CheckpointIndex({str(self.root)!r}, {len(self.names)} tensors, {len(self.files)} files)"

    def __contains__(self, name: str) -> bool:
        return name in self._plans

    def __len__(self) -> int:
        return len(self.names)

    # ---- building -----------------------------------------------------------------------

    @classmethod
    def open(cls, path, model: torch.nn.Module, *, fmt: Any = _FROM_CONFIG) -> CheckpointIndex:
        """Index the checkpoint at ``path`` (directory or ``.safetensors`` file) for ``model``.

        Reads headers only. Raises :class:`LoadError` when any model tensor is missing or
        mis-shaped, when a file is unreadable or shorter than its header says, or when a fused
        expert parameter needs a conversion kinject cannot read lazily. Any other tensor that
        needs such a conversion is read eagerly, through transformers' own operations (given
        ``model``, kept for that: it may stay on the meta device). A checkpoint key no model tensor
        uses is a :class:`LoadError` naming it, its file and the closest model names, unless
        transformers itself ignores it on load for this model (:func:`_ignored_on_load`): then it
        is logged at debug level. Tied weights (e.g. ``lm_head.weight`` with ``tie_word_embeddings``) read
        whichever tied tensor the checkpoint holds.

        ``fmt``: the checkpoint's stored format (:mod:`kinject.engine.formats`; default: the one its
        config.json's ``quantization_config`` names, refused there if unsupported). A quantized
        weight's storage tensors (values + scales) are validated against each other here, its
        tensor is then a :class:`StoredSource`; an unused checkpoint key that is part of a quantized
        weight, or float8 values without their scales, are errors, never dropped or cast.
        """
        root, files = _checkpoint_files(Path(path))
        if fmt is _FROM_CONFIG:
            fmt = _config_format(root)
        entries: dict[str, _Entry] = {}
        for file in files:
            header = _read_header(file)
            _validate_with_safetensors(file)           # once per file; lazy header reads skip it
            for key, entry in header.items():
                if key in entries:
                    log.warning("checkpoint key '%s' is in both %s and %s; using the first",
                                key, entries[key].file, file)
                    continue
                entries[key] = entry
        targets = dict(model.state_dict(keep_vars=True))  # name -> meta tensor
        stored = _split_storage(entries, fmt and fmt.bind(model), targets)
        mapper = _KeyMapper(model, targets)
        plans, unexpected = _plan(entries, targets, mapper)
        _refuse_unused_storage(unexpected, stored, fmt, model, root)
        _alias_tied(model, targets, plans)
        fused = _fused_expert_names(model, targets, plans)
        index = cls(root, files, targets, plans, fused, model, fmt, stored)
        index._validate(entries)     # missing / mis-shaped / undecodable tensors: the more precise errors first
        _refuse_unexpected(unexpected, entries, targets, mapper, model, root)
        log.debug("indexed %s: %d tensors from %d files", root, len(index.names), len(files))
        return index

    def _validate(self, entries: dict[str, _Entry]) -> None:
        missing = [n for n in self.names if n not in self._plans]
        if missing:
            raise LoadError(self._missing_message(missing[0], entries, missing[1:]))
        for name in self.names:
            self._check(name, self._plans[name])

    def _missing_message(self, name: str, entries: dict[str, _Entry], more: list[str] = (), detail: str = "") -> str:
        msg = f"tensor '{name}' not found in checkpoint {self.root} (files: {self._file_list()})"
        if detail:
            msg += f": {detail}"
        else:
            close = difflib.get_close_matches(name, list(entries), n=3, cutoff=0.6)
            if close:
                msg += f"; closest checkpoint keys: {', '.join(close)}"
        if more:
            msg += f"; {len(more)} more missing: {', '.join(more[:5])}" + (", ..." if len(more) > 5 else "")
        return msg

    def _file_list(self) -> str:
        names = [os.path.basename(f) for f in self.files]
        return ", ".join(names[:_LIST_FILES]) + (f", ... ({len(names)} files)" if len(names) > _LIST_FILES else "")

    def _check(self, name: str, plan: _Plan) -> None:
        """Raise LoadError unless ``plan`` produces exactly ``name``'s shape from readable keys."""
        expected = tuple(self._targets[name].shape)
        if plan.unsupported is not None and (name in self._fused or plan.converter is None or self._model is None):
            key, why = plan.unsupported   # one expert at a time: never by converting all of them
            raise LoadError(
                f"tensor '{name}': checkpoint key '{key}' needs transformers conversion {why}, "
                "which kinject cannot read lazily from disk"
            )
        for entry in plan.keys():
            entry.piece()  # refuses dtypes torch cannot represent
        self._check_storage(name, plan)
        if plan.unsupported is not None:
            self._converted_layout(name, plan)   # the conversion run on meta tensors: its shape
            return
        if plan.split is not None:
            start, stop = self._split_rows(name, plan)
            found = (stop - start,) + plan.entry.shape[1:]
            if found != expected:
                raise LoadError(
                    f"tensor '{name}': expected shape {_fmt(expected)}, found {_fmt(found)} (rows {start}..{stop} "
                    f"of key '{plan.entry.key}' {_fmt(plan.entry.shape)} in {plan.entry.file}, "
                    f"split into {self._describe_targets(plan.split.targets)})"
                )
            return
        if plan.entry is not None:
            if plan.entry.shape != expected:
                raise LoadError(
                    f"tensor '{name}': expected shape {_fmt(expected)}, found {_fmt(plan.entry.shape)} "
                    f"(key '{plan.entry.key}' in {plan.entry.file})"
                )
            return
        recipe = plan.recipe
        if recipe.stack:
            n_experts = expected[0] if expected else 0
            extra = sorted(e for e in plan.experts if e >= n_experts)
            if extra:
                found = (max(plan.experts) + 1,) + expected[1:]
                sample = next(x for x in plan.experts[extra[-1]] if x is not None)
                raise LoadError(
                    f"tensor '{name}': expected shape {_fmt(expected)}, found {_fmt(found)} "
                    f"(per-expert keys up to expert {extra[-1]}, e.g. '{sample.key}' in {sample.file})"
                )
            for e in range(n_experts):
                parts = plan.experts.get(e, [None] * len(recipe.patterns))
                self._check_parts(name, parts, recipe, expected[1:], e)
        else:
            self._check_parts(name, plan.concat, recipe, expected, None)

    def _check_storage(self, name: str, plan: _Plan) -> None:
        """Refuse what would read quantized values as weights: float8 keys without their scales, a
        target mixing quantized and plain keys, and quantized keys read through a layout kinject
        does not dequantize piecewise (row ranges of one key, interleaved halves, eager conversions)."""
        keys = plan.keys()
        quantized = [entry for entry in keys if entry.key in self._stored]
        target_dtype = self._targets[name].dtype
        for entry in keys:
            if entry.key not in self._stored and entry.dtype in _FLOAT8 and target_dtype not in _FLOAT8:
                raise FormatError(
                    f"tensor '{name}': checkpoint key '{entry.key}' in {entry.file} holds {entry.dtype_tag} values "
                    + (f"without the scales {self.format.describe()} stores them with" if self.format is not None
                       else "but config.json has no quantization_config saying how to scale them")
                    + "; kinject never casts quantized values as weights")
        if not quantized:
            return
        how = ("several keys of which only some are quantized" if len(quantized) != len(keys) else
               "an eager transformers conversion" if plan.unsupported is not None else
               "a row range of a key split into several tensors" if plan.split is not None else
               "interleaved halves" if plan.interleave is not None else None)
        if how:
            raise FormatError(f"tensor '{name}' is read from {how} (quantized key '{quantized[0].key}' in "
                              f"{quantized[0].file}): kinject does not dequantize that layout")

    def _stored_or(self, src: Source) -> Source | StoredSource:
        """``src``, or the :class:`StoredSource` of it when its keys hold quantized values."""
        if not self._stored or not any(p.key in self._stored for p in src.pieces):
            return src
        dtype = self._targets[src.name].dtype
        if src.parts:
            return StoredSource(src.name, None, src.shape, dtype, self.format,
                                parts=tuple(self._stored_or(part) for part in src.parts))
        pieces = []
        for piece in src.pieces:
            if piece.rows is not None:
                raise FormatError(f"tensor '{src.name}': rows {piece.rows[0]}..{piece.rows[1]} of quantized key "
                                  f"'{piece.key}' in {piece.file}: kinject reads quantized keys whole or per expert")
            pieces.append({role: _make_source(f"{src.name}[{role}]", src.expert, [entry.piece(piece.index)], None)
                           for role, entry in self._stored[piece.key].items()})
        return StoredSource(src.name, src.expert, src.shape, dtype, self.format, tuple(pieces), src.concat_dim)

    def _check_parts(self, name: str, parts: list[_Entry | None], recipe: _Recipe,
                     expected: tuple[int, ...], expert: int | None) -> None:
        where = f" expert {expert}" if expert is not None else ""
        for pattern, entry in zip(recipe.patterns, parts):
            if entry is None:
                raise LoadError(self._missing_message(
                    name, {}, detail=f"no checkpoint key for{where} (pattern '{pattern}')"))
        dtypes = {entry.dtype for entry in parts}
        if len(dtypes) > 1:
            raise LoadError(f"tensor '{name}'{where}: checkpoint keys have different dtypes "
                            + ", ".join(f"'{x.key}' {x.dtype_tag}" for x in parts))
        found = _concat_shape([x.shape for x in parts], recipe.concat_dim)
        if found != expected:
            keys = " + ".join(f"'{x.key}' {_fmt(x.shape)}" for x in parts)
            raise LoadError(
                f"tensor '{name}'{where}: expected shape {_fmt(expected)}, "
                f"found {_fmt(found) if found else 'incompatible shapes'} "
                f"(keys {keys} in {self._files_of(parts)})"
            )

    @staticmethod
    def _files_of(parts: list[_Entry | None]) -> str:
        return ", ".join(dict.fromkeys(x.file for x in parts if x is not None))

    # ---- queries --------------------------------------------------------------------------

    def _plan_of(self, name: str) -> _Plan:
        plan = self._plans.get(name)
        if plan is None:
            close = difflib.get_close_matches(name, self.names, n=3, cutoff=0.6)
            hint = f"; closest: {', '.join(close)}" if close else ""
            raise KeyError(f"'{name}' is not a tensor of the indexed model{hint}")
        return plan

    def is_fused_expert(self, name: str) -> bool:
        """``name`` is a fused ``[E, ...]`` expert parameter: :meth:`expert_source` reads one expert of it."""
        self._plan_of(name)
        return name in self._fused

    def is_stored(self, name: str) -> bool:
        """Whether the checkpoint stores tensor ``name`` quantized (its sources are :class:`StoredSource`)."""
        return any(entry.key in self._stored for entry in self._plan_of(name).keys())

    def num_experts(self, name: str) -> int:
        """Number of experts (dim 0) of the fused expert parameter ``name``."""
        if not self.is_fused_expert(name):
            raise ValueError(f"'{name}' is not a fused expert parameter")
        return int(self._targets[name].shape[0])

    def source(self, name: str) -> Source | StoredSource:
        """The whole tensor ``name`` (a fused expert parameter gives all experts, stacked); a
        :class:`StoredSource` when the checkpoint stores it quantized."""
        return self._stored_or(self._source(name))

    def _source(self, name: str) -> Source:
        plan = self._plan_of(name)
        if plan.unsupported is not None:
            return self._converted_source(name, plan)
        if plan.split is not None:
            return _make_source(name, None, [plan.entry.piece(None, self._split_rows(name, plan))], None)
        if plan.entry is not None:
            return _make_source(name, None, [plan.entry.piece()], None, plan.interleave)
        if plan.recipe.stack:
            parts = tuple(self._rows_source(name, e, e + 1, squeeze=True) for e in range(self.num_experts(name)))
            shape = (len(parts),) + parts[0].shape if parts else tuple(self._targets[name].shape)
            pieces = tuple(p for part in parts for p in part.pieces)
            dtype = parts[0].dtype if parts else plan.keys()[0].dtype
            return Source(name, None, shape, dtype, pieces, None, sum(p.nbytes for p in parts), parts)
        return _make_source(name, None, [x.piece() for x in plan.concat], plan.recipe.concat_dim)

    def expert_source(self, name: str, expert: int) -> Source:
        """Expert ``expert``'s slice of the fused expert parameter ``name``, reading only its bytes."""
        n = self.num_experts(name)
        if not 0 <= expert < n:
            raise IndexError(f"expert {expert} out of range for '{name}' ({n} experts)")
        return self.rows_source(name, expert, expert + 1, squeeze=True)

    def rows_source(self, name: str, start: int, stop: int, *, squeeze: bool = False) -> Source | StoredSource:
        """:meth:`_rows_source`; a :class:`StoredSource` of those rows when the checkpoint stores them quantized."""
        return self._stored_or(self._rows_source(name, start, stop, squeeze=squeeze))

    def _rows_source(self, name: str, start: int, stop: int, *, squeeze: bool = False) -> Source:
        """Rows ``start .. stop`` of dim 0 of tensor ``name`` (``t[start:stop]``; with ``squeeze``,
        ``stop == start + 1`` and dim 0 dropped: ``t[start]``), reading only their bytes, whatever
        the checkpoint's layout: one key (a byte range of it; of its own rows when a ``Split`` cuts
        the key into several targets), per-expert keys stacked along dim 0 (those experts' keys), or
        keys concatenated along some dim (each key's part of the rows); a target converted eagerly
        reads its keys whole and keeps those rows of the result.
        What a store unit of one expert references: expert ``e`` of a fused ``[E, ...]`` parameter,
        rows ``e*R .. (e+1)*R`` of a 2-D ``[E*R, H]`` one (:meth:`ExpertLayout.rows`)."""
        plan = self._plan_of(name)
        full = tuple(self._targets[name].shape)
        if not full or not 0 <= start < stop <= full[0] or squeeze and stop != start + 1:
            raise IndexError(f"rows {start}..{stop}{' (one, squeezed)' if squeeze else ''} "
                             f"out of range for '{name}' {_fmt(full)}")
        expert = start if squeeze else None
        if plan.unsupported is not None:
            return self._converted_source(name, plan, (start, stop), squeeze)
        if plan.entry is not None:
            at = self._split_rows(name, plan)[0] if plan.split is not None else 0   # the target's first row
            piece = plan.entry.piece((at + start,)) if squeeze else plan.entry.piece(None, (at + start, at + stop))
            inter = plan.interleave - 1 if squeeze and plan.interleave is not None else plan.interleave
            return _make_source(name, expert, [piece], None, inter)
        recipe = plan.recipe
        if recipe.stack:                        # dim 0 is the experts: those experts' keys
            parts = tuple(_make_source(name, e, [x.piece() for x in plan.experts[e]], recipe.concat_dim)
                          for e in range(start, stop))
            if squeeze:
                return parts[0]
            return Source(name, None, (len(parts),) + parts[0].shape, parts[0].dtype,
                          tuple(p for part in parts for p in part.pieces), None, sum(p.nbytes for p in parts), parts)
        dim = recipe.concat_dim
        pieces, at = [], 0
        for entry in plan.concat:               # keys concatenated along ``dim`` of the whole target
            if dim != 0:
                pieces.append(entry.piece((start,)) if squeeze else entry.piece(None, (start, stop)))
                continue
            lo, hi = max(start - at, 0), min(stop - at, entry.shape[0])
            if lo < hi:
                pieces.append(entry.piece((lo,)) if squeeze else entry.piece(None, (lo, hi)))
            at += entry.shape[0]
        return _make_source(name, expert, pieces, dim - 1 if squeeze and dim else dim)

    # ---- targets cut from one key, targets converted eagerly ------------------------------

    def _split_rows(self, name: str, plan: _Plan) -> tuple[int, int]:
        """Rows ``start .. stop`` of the plan's key that target ``name`` is, as transformers cuts it:
        ``Split`` gives each target, in target order, as many rows as it has (its parameter's
        shape); ``Chunk`` the parts of ``torch.chunk`` into as many as there are targets."""
        split, entry = plan.split, plan.entry
        where = (f"tensor '{name}': checkpoint key '{entry.key}' {_fmt(entry.shape)} in {entry.file} "
                 f"is split along dim 0 into {self._describe_targets(split.targets)}")
        absent = [t for t in split.targets if t not in self._targets or not self._targets[t].dim()]
        if absent or not entry.shape:
            raise LoadError(f"{where}, but " + (f"'{absent[0]}' is not a tensor of the model with rows" if absent
                                               else "the key has no rows"))
        rows = entry.shape[0]
        if split.equal:
            sizes = [len(c) for c in torch.empty(rows, device="meta").chunk(len(split.targets))]
            if len(sizes) != len(split.targets):
                raise LoadError(f"{where} (equal parts): torch.chunk cuts its {rows} rows into {len(sizes)} parts")
        else:
            sizes = [int(self._targets[t].shape[0]) for t in split.targets]
            if sum(sizes) != rows:
                raise LoadError(f"{where}: their rows add up to {sum(sizes)}, the key has {rows}")
        start = sum(sizes[:split.part])
        return start, start + sizes[split.part]

    def _describe_targets(self, names: tuple[str, ...]) -> str:
        return ", ".join(f"'{t}' {_fmt(self._targets[t].shape)}" if t in self._targets
                         else f"'{t}' (not a tensor of the model)" for t in names)

    def _converted_source(self, name: str, plan: _Plan, rows: tuple[int, int] | None = None,
                          squeeze: bool = False) -> Source:
        """Target ``name`` (or rows of it) read eagerly: the converter's keys read whole, then its
        operations run on them as transformers runs them."""
        shape, dtype = self._converted_layout(name, plan)
        pieces = tuple(entry.piece() for _, entry in self._conversion_inputs(plan))

        def convert(tensors: list[torch.Tensor]) -> torch.Tensor:
            try:
                produced = self._run_conversion(plan, tensors)
            except Exception as exc:  # noqa: BLE001 - any failure of a foreign operation, named
                raise LoadError(f"tensor '{name}': transformers conversion {self._describe_conversion(plan)} "
                                f"failed: {type(exc).__name__}: {exc}") from exc
            result = self._converted_result(name, plan, produced)
            if rows is not None:
                result = result[rows[0]] if squeeze else result[rows[0]:rows[1]]
            return result

        if rows is not None:
            shape = shape[1:] if squeeze else (rows[1] - rows[0],) + shape[1:]
        return Source(name, rows[0] if rows is not None and squeeze else None, shape, dtype, pieces, None,
                      sum(p.nbytes for p in pieces), convert=convert)

    def _converted_layout(self, name: str, plan: _Plan) -> tuple[tuple[int, ...], torch.dtype]:
        """Shape and dtype of target ``name`` converted eagerly, found (and checked against the
        model's) by running the conversion on meta tensors: no data read. An operation that
        needs the data (torch says so: ``NotImplementedError``, or an error naming meta tensors)
        leaves the check to the read; any other failure is the keys' shapes, refused now."""
        if name not in self._converted:
            metas = [torch.empty(entry.shape, dtype=entry.dtype, device="meta")
                     for _, entry in self._conversion_inputs(plan)]
            try:
                produced = self._run_conversion(plan, metas)
            except Exception as exc:  # noqa: BLE001 - any failure of a foreign operation, named
                if not isinstance(exc, NotImplementedError) and "meta" not in str(exc).lower():
                    raise LoadError(f"tensor '{name}': transformers conversion {self._describe_conversion(plan)} "
                                    f"fails: {type(exc).__name__}: {exc}") from exc
                log.debug("tensor '%s': conversion %s does not run on meta tensors (%s); checked when read",
                          name, self._describe_conversion(plan), exc)
                self._converted[name] = tuple(self._targets[name].shape), self._conversion_dtype(plan)
            else:
                result = self._converted_result(name, plan, produced)
                self._converted[name] = tuple(result.shape), result.dtype
        return self._converted[name]

    @staticmethod
    def _conversion_inputs(plan: _Plan) -> list[tuple[str, _Entry]]:
        """(pattern, key) of the converter's keys, in the order transformers collects them."""
        from transformers.core_model_loading import dot_natural_key

        return sorted(plan.inputs, key=lambda pattern_entry: dot_natural_key(pattern_entry[1].key))

    def _conversion_dtype(self, plan: _Plan) -> torch.dtype:
        """transformers casts a converter's keys to the dtype of the parameter it names them after."""
        return self._targets.get(plan.layer_name, self._targets[plan.target]).dtype

    def _run_conversion(self, plan: _Plan, tensors: list[torch.Tensor]) -> dict[str, Any]:
        """The converter's operations on ``tensors`` (one per input, in order), as
        ``WeightConverter.convert`` runs them: target pattern -> tensor."""
        converter, dtype = plan.converter, self._conversion_dtype(plan)
        collected: dict[str, list[torch.Tensor]] = {}
        for (pattern, _), tensor in zip(self._conversion_inputs(plan), tensors):
            collected.setdefault(pattern, []).append(tensor.to(dtype))
        model = _ConversionModel(self._model, self._targets)
        with torch.no_grad():
            for op in converter.operations:
                collected = op.convert(collected, source_patterns=converter.source_patterns,
                                       target_patterns=converter.target_patterns, full_layer_name=plan.layer_name,
                                       model=model, config=getattr(self._model, "config", None), missing_keys=None)
        return collected

    def _converted_result(self, name: str, plan: _Plan, produced: dict[str, Any]) -> torch.Tensor:
        """Target ``name``'s tensor among what the operations made (named as transformers names
        them: the target patterns in place of the first one's), checked against the model's shape."""
        full = plan.layer_name.replace("*.", "0.")
        named = produced
        for pattern in produced:
            if pattern in full:
                prefix, _, suffix = full.partition(pattern)
                named = {prefix + p + suffix: tensor for p, tensor in produced.items()}
                break
        tensor = named.get(plan.target)
        if tensor is None:
            raise LoadError(f"tensor '{name}': transformers conversion {self._describe_conversion(plan)} "
                            f"makes {', '.join(repr(n) for n in named) or 'nothing'}, not '{plan.target}'")
        tensor = tensor[0] if isinstance(tensor, list) else tensor
        expected = tuple(self._targets[name].shape)
        if tuple(tensor.shape) != expected:
            raise LoadError(f"tensor '{name}': expected shape {_fmt(expected)}, found {_fmt(tensor.shape)} "
                            f"(transformers conversion {self._describe_conversion(plan)})")
        return tensor

    def _describe_conversion(self, plan: _Plan) -> str:
        inputs = self._conversion_inputs(plan)
        keys = ", ".join(f"'{entry.key}' {_fmt(entry.shape)}" for _, entry in inputs)
        ops = ", ".join(repr(op) for op in plan.converter.operations)
        return f"[{ops}] of key{'s' if len(inputs) > 1 else ''} {keys} in {self._files_of([e for _, e in inputs])}"


class _ConversionModel:
    """The model as transformers' conversion operations ask about it (``get_parameter(name)``'s
    shape and dtype): its tensors as they were indexed (meta tensors are enough), since kinject
    replaces modules and parameters after indexing but reads eagerly converted targets later, as
    they are placed; anything else is the model's own."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, torch.Tensor]):
        self._model, self._targets = model, targets

    def get_parameter(self, name: str) -> torch.Tensor:
        tensor = self._targets.get(name)
        return tensor if tensor is not None else self._model.get_parameter(name)

    def get_buffer(self, name: str) -> torch.Tensor:
        tensor = self._targets.get(name)
        return tensor if tensor is not None else self._model.get_buffer(name)

    def __getattr__(self, attr: str):
        return getattr(self._model, attr)


def _config_format(root: Path):
    """The stored format config.json in ``root`` names (None: no config, or not quantized)."""
    from kinject.engine.formats import format_for

    config = root / "config.json"
    if not config.is_file():
        return None
    try:
        qconfig = json.loads(config.read_text()).get("quantization_config")
        modelopt = root / "hf_quant_config.json"      # ModelOpt's own file, where config.json has none
        if qconfig is None and modelopt.is_file():
            config = modelopt
            qconfig = {"quant_method": "modelopt", **json.loads(modelopt.read_text())["quantization"]}
    except (OSError, ValueError, AttributeError, KeyError, TypeError) as err:
        raise LoadError(f"cannot read {config}: {err}") from err
    return format_for(qconfig, where=str(config))


def _split_storage(entries: dict[str, _Entry], fmt, targets: dict[str, torch.Tensor]) -> dict[str, dict[str, _Entry]]:
    """Name of a quantized tensor -> its storage entries by role, each set checked by ``fmt``.

    The name is a checkpoint key holding its values (FP8: ``x.weight`` beside ``x.weight_scale_inv``)
    or, when no key holds them (MXFP4: ``experts.gate_up_proj`` as ``_blocks`` + ``_scales``), a model
    tensor the storage keys are named after; such a tensor gets a stand-in entry of the model's shape
    in ``entries`` (read only through its storage). The storage keys besides the values leave
    ``entries``: they make no tensor of their own. A tensor of which only some storage keys exist
    is refused."""
    if fmt is None:
        return {}
    stored: dict[str, dict[str, _Entry]] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    derived = {fmt.weight_name(k) for k in entries if fmt.is_storage_key(k)} - {None}
    for name in dict.fromkeys([*entries, *sorted(derived - set(entries)), *(t for t in targets if t not in entries)]):
        keys = fmt.storage_keys(name)
        if not keys:
            continue
        others = [k for k in keys.values() if k != name]
        missing = [k for k in others if k not in entries]
        if len(missing) == len(others):
            continue                                  # not quantized: a plain tensor (checked when planned)
        present = next(k for k in others if k in entries)
        file = entries[present].file
        if missing or name not in entries and name in keys.values():
            absent = missing[0] if missing else name
            raise FormatError(f"checkpoint key '{present}' in {file} is part of tensor '{name}' stored "
                              f"{fmt.describe()}, but '{absent}' is not in the checkpoint")
        parts = {role: entries[k] for role, k in keys.items()}
        layout = {role: (e.shape, e.dtype) for role, e in parts.items()}
        shape = (entries[name].shape if name in entries and not fmt.packs_values else tuple(targets[name].shape)
                 if name in targets else fmt.logical_shape(name, layout))
        if shape is None:
            raise FormatError(f"tensor '{name}' is stored {fmt.describe()} in {file}, and neither the model nor "
                              "its storage tensors tell its shape")
        try:
            fmt.check(name, layout, shape)
        except FormatError as err:
            raise FormatError(f"{err} (checkpoint {', '.join(dict.fromkeys(e.file for e in parts.values()))})") from None
        stored[name] = parts
        shapes[name] = tuple(shape)
    for name, parts in stored.items():
        for e in parts.values():
            if e.key not in stored:
                entries.pop(e.key, None)
        if name not in entries or fmt.packs_values:   # stand-in: the tensor's shape, no bytes of its own
            dtype = targets[name].dtype if name in targets else torch.float32   # (read as its StoredSource's)
            entries[name] = _Entry(next(iter(parts.values())).file, name, shapes[name], dtype, "STORED", 0, 0)
    return stored


def _ignored_on_load(model) -> re.Pattern | None:
    """The unexpected-key rule of transformers 5's loader for ``model``
    (``PreTrainedModel._adjust_missing_and_unexpected_keys``): its ``_keys_to_ignore_on_load_unexpected``
    patterns (the class's and its submodules'), plus ``rotary_emb.inv_freq`` when the model has such a
    buffer and ``position_ids`` when it has one (both once persistent, now computed). Searched in the
    key as transformers renames it; None when nothing is ignored."""
    patterns = set(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ())
    buffers = [name for name, _ in model.named_buffers()]
    if any(b.endswith("rotary_emb.inv_freq") for b in buffers):
        patterns.add(r"rotary_emb\.inv_freq")
    if any(b.endswith("position_ids") for b in buffers):
        patterns.add(r"(^|\.)position_ids$")
    return re.compile("|".join(f"({p})" for p in patterns)) if patterns else None


def _refuse_unexpected(unexpected: list[str], entries: dict[str, _Entry], targets: dict[str, torch.Tensor],
                       mapper: _KeyMapper, model, root: Path) -> None:
    """A checkpoint key that no tensor of the model uses is a :class:`LoadError` (a key kinject does
    not understand may be a weight the model needs under another name: dropping it could give a
    silent wrong answer), raised before any weight is read. Keys transformers ignores on load
    for this model (:func:`_ignored_on_load`, matched on every target the key is renamed to, as
    transformers matches them) are only logged."""
    ignore = _ignored_on_load(model)
    refused = [k for k in unexpected
               if ignore is None or not all(ignore.search(t) for t in mapper.map(k).targets)]
    ignored = [k for k in unexpected if k not in refused]
    if ignored:
        log.debug("checkpoint %s: %d key(s) transformers ignores for %s: %s", root, len(ignored),
                  type(model).__name__, ", ".join(ignored[:5]) + (", ..." if len(ignored) > 5 else ""))
    if not refused:
        return
    shown = []
    for key in refused[:_LIST_KEYS]:
        close = difflib.get_close_matches(mapper.map(key).targets[0], list(targets), n=3, cutoff=0.6)
        hint = f"; closest model names: {', '.join(close)}" if close else ""
        shown.append(f"'{key}' (in {os.path.basename(entries[key].file)}{hint})")
    more = f"; {len(refused) - len(shown)} more" if len(refused) > len(shown) else ""
    files = sorted({os.path.basename(entries[k].file) for k in refused})
    files = files[:_LIST_FILES] + (["..."] if len(files) > _LIST_FILES else [])
    raise LoadError(f"checkpoint {root}: {len(refused)} key(s) in {', '.join(files)} that no tensor of "
                    f"{type(model).__name__} uses and transformers does not ignore: {'; '.join(shown)}{more}. "
                    "Is the checkpoint for this model and config?")


def _refuse_unused_storage(unexpected: list[str], stored: dict, fmt, model, root: Path) -> None:
    """An unused checkpoint key that is part of a quantized weight (its values, a scale without its
    weight) is an error: dropping it would leave some weight wrong. Keys the model itself says to
    ignore (``_keys_to_ignore_on_load_unexpected``, e.g. DeepSeek-V3's MTP layer) are not."""
    if fmt is None:
        return
    ignore = _ignored_on_load(model)
    unused = [k for k in unexpected if (k in stored or fmt.is_storage_key(k)) and not (ignore and ignore.search(k))]
    if unused:
        more = f" and {len(unused) - 1} more" if len(unused) > 1 else ""
        raise FormatError(f"checkpoint {root}: key '{unused[0]}'{more} is part of a quantized weight "
                          f"({fmt.describe()}) that no tensor of {type(model).__name__} uses")


def _make_source(name: str, expert: int | None, pieces: list[Piece], concat_dim: int | None,
                 interleave: int | None = None) -> Source:
    if len(pieces) == 1:
        concat_dim = None
    shape = _concat_shape([p.shape for p in pieces], concat_dim)
    return Source(name, expert, shape, pieces[0].dtype, tuple(pieces), concat_dim, sum(p.nbytes for p in pieces),
                  interleave=interleave)


def _concat_shape(shapes: list[tuple[int, ...]], dim: int | None) -> tuple[int, ...] | None:
    """Shape of ``torch.cat`` of ``shapes`` along ``dim`` (one shape: itself); None if incompatible."""
    if len(shapes) == 1 or dim is None:
        return shapes[0] if len(shapes) == 1 else None
    first = shapes[0]
    if dim >= len(first) or any(len(s) != len(first) or s[:dim] + s[dim + 1:] != first[:dim] + first[dim + 1:]
                                for s in shapes):
        return None
    return first[:dim] + (sum(s[dim] for s in shapes),) + first[dim + 1:]


def _plan(entries: dict[str, _Entry], targets: dict[str, torch.Tensor],
          mapper: _KeyMapper) -> tuple[dict[str, _Plan], list[str]]:
    """Assign every checkpoint key to the target it makes; return the plans and the unused keys."""
    plans: dict[str, _Plan] = {}
    unexpected: list[str] = []
    for key in sorted(entries, key=_natural_key):
        mapped = mapper.map(key)
        if not any(target in targets for target in mapped.targets):
            unexpected.append(key)
            continue
        for part, target in enumerate(mapped.targets):
            if target in targets:
                _assign(plans.setdefault(target, _Plan(target)), entries[key], mapped, part)
    return plans, unexpected


def _assign(plan: _Plan, entry: _Entry, mapped: _Mapped, part: int) -> None:
    """Add checkpoint key ``entry`` to the plan of its ``part``-th target."""
    key, target, recipe = entry.key, plan.target, mapped.recipe
    if mapped.converter is not None:   # kept for an eager conversion, whatever the recipe says
        plan.converter, plan.layer_name = mapped.converter, mapped.targets[0]
        plan.inputs.append((mapped.pattern, entry))
    if isinstance(recipe, str):
        plan.unsupported = plan.unsupported or (key, recipe)
    elif recipe is None or not recipe.stack and recipe.concat_dim is None:
        if plan.entry is not None or plan.recipe is not None:
            log.warning("checkpoint keys '%s' and '%s' both map to '%s'; using the first",
                        (plan.entry or plan.keys()[0]).key, key, target)
            return
        plan.entry = entry
        plan.interleave = recipe.interleave if recipe is not None else None
        if recipe is not None and recipe.split is not None:
            plan.split = _Split(mapped.targets, part, recipe.split == "chunks")
    else:
        if plan.entry is not None:
            log.warning("checkpoint key '%s' and per-expert key '%s' both map to '%s'; using the first",
                        plan.entry.key, key, target)
            return
        plan.recipe = recipe
        slots = plan.experts.setdefault(mapped.expert, [None] * len(recipe.patterns)) if recipe.stack else plan.concat
        if not recipe.stack and not slots:
            slots.extend([None] * len(recipe.patterns))
        slots[mapped.position] = entry


def _natural_key(key: str) -> list:
    """Sort ``layers.10`` after ``layers.9`` (log messages and duplicate resolution are stable)."""
    return [(0, int(t)) if t.isdigit() else (1, t) for t in key.split(".")]


def _alias_tied(model: torch.nn.Module, targets: dict[str, torch.Tensor], plans: dict[str, _Plan]) -> None:
    """Let every tied tensor the checkpoint lacks read the tied tensor it has (e.g. lm_head <- embed_tokens)."""
    groups: dict[int, list[str]] = {}
    for name, tensor in targets.items():  # tied parameters are one tensor under several names
        groups.setdefault(id(tensor), []).append(name)
    pairs = [names for names in groups.values() if len(names) > 1]
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    pairs += [[t, s] for t, s in tied.items() if t in targets and s in targets]
    for names in pairs:
        present = [n for n in names if n in plans]
        for name in names:
            if name not in plans and present:
                plans[name] = plans[present[0]]
                log.debug("tied tensor '%s' reads checkpoint tensor of '%s'", name, present[0])


def _fused_expert_names(model: torch.nn.Module, targets: dict[str, torch.Tensor], plans: dict[str, _Plan]) -> set[str]:
    """Targets laid out ``[E, ...]`` with one slice per expert.

    Those are the parameters of transformers' fused experts modules (``@use_experts_implementation``
    classes, or any module named ``experts`` with ``num_experts``) whose dim 0 is the number of
    experts and that have at least 2 dims, and every target assembled from per-expert keys.
    """
    fused = {name for name, plan in plans.items() if plan.recipe is not None and plan.recipe.stack}
    for module_name, module in model.named_modules():
        n = getattr(module, "num_experts", None)
        is_experts = hasattr(module, "is_concatenated") or module_name.rsplit(".", 1)[-1] == "experts"
        if not is_experts or not isinstance(n, int):
            continue
        for pname, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            name = f"{module_name}.{pname}" if module_name else pname
            if name in targets and tensor.dim() >= 2 and tensor.shape[0] == n:
                fused.add(name)
    return fused


def _fmt(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"
