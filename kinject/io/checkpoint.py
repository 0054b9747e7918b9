"""Lazy, headers-only index of a safetensors checkpoint against the model it is for.

The streaming loader never holds the whole model in RAM: it builds the model on the meta
device and asks this module, for every model tensor, *how to read it from disk*. The answer is
a :class:`Source` — a few byte ranges in a few files, plus how to assemble them — that the store
keeps as a lazy disk reference and reads when it places the tensor (docs/architecture.md, "The data path of one decode step").

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

import difflib
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kinject.engine.disk_sources import Source, StoredSource
from kinject.engine.formats.base import FormatError
from kinject.engine.safetensors_header import HeaderEntry, Piece, read_header
from kinject.errors import LoadError
from kinject.formatting import format_shape
from kinject.io.checkpoint_files import checkpoint_files, validate_with_safetensors
from kinject.io.conversions import KeyMapper, MappedKey, Recipe

log = logging.getLogger(__name__)

_FLOAT8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))
_FROM_CONFIG = object()          # CheckpointIndex.open: the stored format config.json names
_LIST_FILES = 8                  # file names quoted in an error message before "..."
_LIST_KEYS = 3                   # unexpected keys quoted (each with its closest model names) before "N more"


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
    entry: HeaderEntry | None = None
    recipe: Recipe | None = None
    experts: dict[int, list[HeaderEntry | None]] = field(default_factory=dict)
    concat: list[HeaderEntry | None] = field(default_factory=list)
    unsupported: tuple[str, str] | None = None  # (checkpoint key, why) when a needed conversion is not lazy
    interleave: int | None = None  # the entry's halves along this dim are interleaved on disk
    split: _Split | None = None
    converter: Any = None
    layer_name: str | None = None  # the target transformers names the converter's keys after (its first)
    inputs: list[tuple[str, HeaderEntry]] = field(default_factory=list)

    def keys(self) -> list[HeaderEntry]:
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
                 fmt=None, stored: dict[str, dict[str, HeaderEntry]] | None = None):
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
        root, files = checkpoint_files(Path(path))
        if fmt is _FROM_CONFIG:
            fmt = _config_format(root)
        entries: dict[str, HeaderEntry] = {}
        for file in files:
            header = read_header(file)
            validate_with_safetensors(file)           # once per file; lazy header reads skip it
            for key, entry in header.items():
                if key in entries:
                    log.warning("checkpoint key '%s' is in both %s and %s; using the first",
                                key, entries[key].file, file)
                    continue
                entries[key] = entry
        targets = dict(model.state_dict(keep_vars=True))  # name -> meta tensor
        stored = _split_storage(entries, fmt and fmt.bind(model), targets)
        mapper = KeyMapper(model, targets)
        plans, unexpected = _plan(entries, targets, mapper)
        _refuse_unused_storage(unexpected, stored, fmt, model, root)
        _alias_tied(model, targets, plans)
        fused = fused_expert_names(model, targets, plans)
        index = cls(root, files, targets, plans, fused, model, fmt, stored)
        index._validate(entries)     # missing / mis-shaped / undecodable tensors: the more precise errors first
        _refuse_unexpected(unexpected, entries, targets, mapper, model, root)
        log.debug("indexed %s: %d tensors from %d files", root, len(index.names), len(files))
        return index

    def _validate(self, entries: dict[str, HeaderEntry]) -> None:
        missing = [n for n in self.names if n not in self._plans]
        if missing:
            raise LoadError(self._missing_message(missing[0], entries, missing[1:]))
        for name in self.names:
            self._check(name, self._plans[name])

    def _missing_message(self, name: str, entries: dict[str, HeaderEntry], more: list[str] = (), detail: str = "") -> str:
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
                    f"tensor '{name}': expected shape {format_shape(expected)}, found {format_shape(found)} (rows {start}..{stop} "
                    f"of key '{plan.entry.key}' {format_shape(plan.entry.shape)} in {plan.entry.file}, "
                    f"split into {self._describe_targets(plan.split.targets)})"
                )
            return
        if plan.entry is not None:
            if plan.entry.shape != expected:
                raise LoadError(
                    f"tensor '{name}': expected shape {format_shape(expected)}, found {format_shape(plan.entry.shape)} "
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
                    f"tensor '{name}': expected shape {format_shape(expected)}, found {format_shape(found)} "
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

    def _check_parts(self, name: str, parts: list[HeaderEntry | None], recipe: Recipe,
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
            keys = " + ".join(f"'{x.key}' {format_shape(x.shape)}" for x in parts)
            raise LoadError(
                f"tensor '{name}'{where}: expected shape {format_shape(expected)}, "
                f"found {format_shape(found) if found else 'incompatible shapes'} "
                f"(keys {keys} in {self._files_of(parts)})"
            )

    @staticmethod
    def _files_of(parts: list[HeaderEntry | None]) -> str:
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
                             f"out of range for '{name}' {format_shape(full)}")
        expert = start if squeeze else None
        if plan.unsupported is not None:
            return self._converted_source(name, plan, (start, stop), squeeze)
        if plan.entry is not None:
            at = self._split_rows(name, plan)[0] if plan.split is not None else 0   # the target's first row
            piece = plan.entry.piece((at + start,)) if squeeze else plan.entry.piece(None, (at + start, at + stop))
            inter = plan.interleave - 1 if squeeze and plan.interleave is not None else plan.interleave
            return _make_source(name, expert, [piece], None, inter)
        recipe = plan.recipe
        if recipe.stack and squeeze:            # one expert: its keys (a store unit's tensor, made per expert)
            return _make_source(name, start, [x.piece() for x in plan.experts[start]], recipe.concat_dim)
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
        where = (f"tensor '{name}': checkpoint key '{entry.key}' {format_shape(entry.shape)} in {entry.file} "
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
        return ", ".join(f"'{t}' {format_shape(self._targets[t].shape)}" if t in self._targets
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
    def _conversion_inputs(plan: _Plan) -> list[tuple[str, HeaderEntry]]:
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
            raise LoadError(f"tensor '{name}': expected shape {format_shape(expected)}, found {format_shape(tensor.shape)} "
                            f"(transformers conversion {self._describe_conversion(plan)})")
        return tensor

    def _describe_conversion(self, plan: _Plan) -> str:
        inputs = self._conversion_inputs(plan)
        keys = ", ".join(f"'{entry.key}' {format_shape(entry.shape)}" for _, entry in inputs)
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


def _split_storage(entries: dict[str, HeaderEntry], fmt, targets: dict[str, torch.Tensor]) -> dict[str, dict[str, HeaderEntry]]:
    """Name of a quantized tensor -> its storage entries by role, each set checked by ``fmt``.

    The name is a checkpoint key holding its values (FP8: ``x.weight`` beside ``x.weight_scale_inv``)
    or, when no key holds them (MXFP4: ``experts.gate_up_proj`` as ``_blocks`` + ``_scales``), a model
    tensor the storage keys are named after; such a tensor gets a stand-in entry of the model's shape
    in ``entries`` (read only through its storage). The storage keys besides the values leave
    ``entries``: they make no tensor of their own. A tensor of which only some storage keys exist
    is refused."""
    if fmt is None:
        return {}
    stored: dict[str, dict[str, HeaderEntry]] = {}
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
            entries[name] = HeaderEntry(next(iter(parts.values())).file, name, shapes[name], dtype, "STORED", 0, 0)
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


def _refuse_unexpected(unexpected: list[str], entries: dict[str, HeaderEntry], targets: dict[str, torch.Tensor],
                       mapper: KeyMapper, model, root: Path) -> None:
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
        piece = pieces[0]
        return Source(name, expert, piece.shape, piece.dtype, (piece,), None, piece.nbytes, interleave=interleave)
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


def _plan(entries: dict[str, HeaderEntry], targets: dict[str, torch.Tensor],
          mapper: KeyMapper) -> tuple[dict[str, _Plan], list[str]]:
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


def _assign(plan: _Plan, entry: HeaderEntry, mapped: MappedKey, part: int) -> None:
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


def fused_expert_names(model: torch.nn.Module, targets: dict[str, torch.Tensor], plans: dict[str, _Plan]) -> set[str]:
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
