"""GGUF checkpoints (llama.cpp, Ollama): metadata, tensor index and storage sources, no tensor read.

``kinject.from_pretrained`` takes a ``.gguf`` file, a directory holding one GGUF model, or the first
of its ``-00001-of-0000N.gguf`` shards. :class:`GGUFCheckpoint` reads the metadata and tensor index
of every shard with gguf-py's memory-mapped ``GGUFReader`` (headers only) and refuses, before
anything is built, a tensor of a type kinject does not dequantize (naming tensor and type), one
whose bytes do not fit its type and shape or the file, a missing shard, an architecture
transformers' GGUF loading does not support as a MoE family, and a metadata key kinject does not
understand (read completely: transformers 5.24 ignores ``qwen3moe.expert_feed_forward_length``,
kinject reads it).

:class:`GGUFIndex` has :class:`~kinject.io.checkpoint.CheckpointIndex`'s interface: every model
tensor is a :class:`~kinject.engine.disk_sources.StoredSource` over byte ranges of the file(s) (a matrix,
kept in its GGML blocks) or a plain :class:`~kinject.engine.disk_sources.Source` (1-D norms and biases).
An expert of a 3-D GGUF expert tensor ``blk.N.ffn_{gate,up,down}_exps.weight`` is its own
contiguous rows, so one store unit per expert holds and moves only its packed bytes and
dequantizes them on the compute device (docs/architecture.md "Stored formats"). Which GGUF tensor
is which model tensor is transformers' own map (``get_gguf_hf_weights_map`` over gguf-py's tensor
name tables), with its processors' rules: gate and up experts concatenated into ``gate_up_proj``,
a 1-D tensor read as the ``[1, n]`` the model holds.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from pathlib import Path
from typing import Any

import torch

from kinject.engine.disk_sources import Source, StoredSource
from kinject.engine.formats import ggml
from kinject.engine.formats.base import FormatError
from kinject.engine.safetensors_header import Piece
from kinject.errors import LoadError
from kinject.io import gguf_gpt_oss

log = logging.getLogger(__name__)

EXTRA = "gguf"                       # pip install 'kinject[gguf]'
_SHARD = re.compile(r"^(?P<stem>.*)-(?P<no>\d{5})-of-(?P<count>\d{5})\.gguf$")
# GGUF architecture -> transformers model_type: the MoE families transformers' GGUF loading maps
MOE_FAMILIES = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "minimax-m2": "minimax_m2",
                gguf_gpt_oss.ARCH: gguf_gpt_oss.MODEL_TYPE}
# architectures transformers' GGUF loading lists but whose MoE tensors it does not map from a
# llama.cpp file (no reference to be equal to): arch -> reason
_REFUSED: dict[str, str] = {}
# architectures whose tensors transformers' GGUF map gets wrong, mapped by kinject as llama.cpp's
# converter wrote them: arch -> (config -> (GGUF name -> model name, model name -> join))
_TENSOR_MAPS = {gguf_gpt_oss.ARCH: gguf_gpt_oss.tensor_map}
# completions of transformers' parse of the metadata: arch -> (checkpoint, parsed) -> parsed
_COMPLETE = {gguf_gpt_oss.ARCH: gguf_gpt_oss.config_dict}
# architectures transformers' metadata parse fails on: arch -> checkpoint -> its generic parse
_PARSE = {gguf_gpt_oss.ARCH: gguf_gpt_oss.parse}
# metadata transformers' GGUF_CONFIG_MAPPING does not read, read here: arch key -> config attribute
_READ_HERE = {
    "qwen2moe": {"expert_feed_forward_length": "moe_intermediate_size",
                 "expert_shared_feed_forward_length": "shared_expert_intermediate_size"},
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "minimax-m2": {"expert_feed_forward_length": "intermediate_size"},
    gguf_gpt_oss.ARCH: gguf_gpt_oss.READ_HERE,      # None: read by its _COMPLETE function
}
# metadata that must agree with the config transformers builds: arch key -> attribute (or a rule)
_MUST_AGREE = {"rope.dimension_count": "head_dim", "attention.key_length": "head_dim",
               "attention.value_length": "head_dim", "expert_shared_count": None}
_NOT_CONFIG = ("general.", "tokenizer.", "split.", "GGUF.", "quantize.")


def _require_gguf():
    try:
        import gguf
    except ImportError as err:
        raise LoadError(f"reading a GGUF file needs the 'gguf' package: pip install 'kinject[{EXTRA}]'") from err
    return gguf


def gguf_files(path: str | Path) -> list[Path] | None:
    """The GGUF files of checkpoint ``path`` (all shards, in order), or None when it is no GGUF
    checkpoint. A directory holding a config.json is a Hugging Face checkpoint, not a GGUF one."""
    path = Path(path).expanduser()
    if path.is_dir():
        if (path / "config.json").is_file():
            return None
        found = sorted(path.glob("*.gguf"))
        if not found:
            return None
        firsts = [f for f in found if not _SHARD.match(f.name) or _SHARD.match(f.name)["no"] == "00001"]
        if len(firsts) != 1:
            raise LoadError(f"{path}: holds {len(firsts)} GGUF models ({', '.join(f.name for f in firsts[:4])}); "
                            "pass the .gguf file to load")
        path = firsts[0]
    elif path.suffix != ".gguf":
        return None
    if not path.is_file():
        raise LoadError(f"{path}: no such GGUF file")
    m = _SHARD.match(path.name)
    if not m:
        return [path]
    if m["no"] != "00001":
        raise LoadError(f"{path}: shard {int(m['no'])} of {int(m['count'])}; pass the first shard "
                        f"({m['stem']}-00001-of-{m['count']}.gguf)")
    count = int(m["count"])
    files = [path.with_name(f"{m['stem']}-{i:05d}-of-{m['count']}.gguf") for i in range(1, count + 1)]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise LoadError(f"{path}: shard {missing[0]} of this {count}-shard GGUF model is missing")
    return files


def _reader_class():
    """gguf-py's ``GGUFReader`` that refuses, naming the tensor, what it would misread: a type
    kinject does not dequantize, a row that is no whole number of blocks, bytes past the file."""
    gguf = _require_gguf()

    class CheckedReader(gguf.GGUFReader):
        def __init__(self, path):
            self.path = path
            super().__init__(path)

        def _build_tensors(self, start_offs, fields):
            size = len(self.data)
            spans = []
            for field in fields:
                _, name_data, _, dims, raw_dtype, offset = field.parts
                name = bytes(name_data).decode("utf-8", "replace")
                where = f"GGUF file {self.path}: tensor '{name}'"
                try:
                    qtype = gguf.GGMLQuantizationType(int(raw_dtype[0])).name
                except ValueError:
                    raise FormatError(f"{where} has GGML type id {int(raw_dtype[0])}, which gguf does not know") from None
                if qtype not in ggml.BLOCKS:
                    raise FormatError(f"{where} has GGML type {qtype}, which kinject does not dequantize "
                                      f"(supported: {', '.join(ggml.BLOCKS)})")
                block, type_size = ggml.BLOCKS[qtype]
                ne = [int(d) for d in dims]
                if not ne or ne[0] % block:
                    raise FormatError(f"{where}: {qtype} rows of {ne[0] if ne else 0} values are no whole number "
                                      f"of {block}-value blocks")
                n = 1
                for d in ne:
                    n *= d
                begin = int(start_offs + offset[0])
                spans.append((begin, begin + n // block * type_size, name, qtype, ne))
            spans.sort()
            for (b0, e0, n0, t0, s0), nxt in zip(spans, spans[1:] + [(size, size, None, None, None)]):
                if e0 > nxt[0]:
                    what = f"tensor '{nxt[2]}' starts at byte {nxt[0]}" if nxt[2] else f"the file ends at byte {size}"
                    raise FormatError(f"GGUF file {self.path}: tensor '{n0}' ({t0} {list(reversed(s0))}) needs bytes "
                                      f"{b0}..{e0}, but {what}: its byte size disagrees with its type and shape")
            super()._build_tensors(start_offs, fields)

    return CheckedReader


class GGUFCheckpoint:
    """A GGUF model's metadata and tensor index, from every shard's header (no tensor read)."""

    def __init__(self, files: list[Path]):
        reader_class = _reader_class()
        self.files = files
        self.readers = []
        for file in files:
            try:
                reader = reader_class(str(file))
            except (LoadError, FormatError):
                raise
            except (ValueError, OSError, IndexError) as err:
                raise LoadError(f"GGUF file {file} cannot be read: {err}") from err
            self.readers.append(reader)
        self.fields = self.readers[0].fields
        count = self.value("split.count", 1)
        if count != len(files):
            raise LoadError(f"GGUF file {files[0]}: split.count is {count}, found {len(files)} shard files")
        self.tensors: dict[str, tuple[Path, Any]] = {}
        for file, reader in zip(files, self.readers):
            for t in reader.tensors:
                if t.name in self.tensors:
                    raise LoadError(f"GGUF tensor '{t.name}' is in both {self.tensors[t.name][0]} and {file}")
                self.tensors[t.name] = (file, t)
        expected = self.value("split.tensors.count", None)
        if expected is not None and expected != len(self.tensors):
            raise LoadError(f"GGUF file {files[0]}: split.tensors.count is {expected}, the shards hold "
                            f"{len(self.tensors)} tensors")
        self.arch = self.value("general.architecture", None)
        if self.arch is None:
            raise LoadError(f"GGUF file {files[0]}: no general.architecture")

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.files[0])!r}, {self.arch}, {len(self.tensors)} tensors, {len(self.files)} files)"

    def value(self, key: str, default: Any = LoadError):
        field = self.fields.get(key)
        if field is None:
            if default is LoadError:
                raise LoadError(f"GGUF file {self.files[0]}: metadata key '{key}' is missing")
            return default
        from transformers.integrations.ggml import _gguf_parse_value

        values = [_gguf_parse_value(field.parts[i], field.types) for i in field.data]
        return values[0] if len(values) == 1 else values

    def qtypes(self) -> tuple[str, ...]:
        return tuple(sorted({t.tensor_type.name for _, t in self.tensors.values()}))

    # ---- config and tokenizer -----------------------------------------------------------------

    def config(self):
        """The transformers config of the model, from the metadata, read completely: what
        transformers' GGUF mapping reads, plus what it leaves out (:data:`_READ_HERE`), every other
        architecture key checked against the result or refused."""
        from transformers import CONFIG_MAPPING
        from transformers.integrations.ggml import GGUF_CONFIG_MAPPING
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        if self.arch in _REFUSED:
            raise LoadError(f"GGUF file {self.files[0]}: architecture {self.arch!r} is not supported: {_REFUSED[self.arch]}")
        if self.arch not in MOE_FAMILIES:
            raise LoadError(f"GGUF file {self.files[0]}: architecture {self.arch!r} is not a MoE family transformers' "
                            f"GGUF loading supports (supported: {', '.join(MOE_FAMILIES)})")
        if self.arch in _PARSE:
            parsed = _PARSE[self.arch](self)
        else:
            parsed = load_gguf_checkpoint(str(self.files[0]), return_tensors=False)["config"]
        # transformers looks for output.weight in the one file it reads; a split model's may be in any shard
        parsed["tie_word_embeddings"] = "output.weight" not in self.tensors
        model_type = MOE_FAMILIES[self.arch]
        mapped = GGUF_CONFIG_MAPPING.get(model_type, {})
        read_here = _READ_HERE.get(self.arch, {})
        checks = []
        for key in self.fields:
            if key.startswith(_NOT_CONFIG):
                continue
            suffix = key[len(self.arch) + 1:] if key.startswith(self.arch + ".") else None
            if suffix in read_here:
                if read_here[suffix] is not None:
                    parsed[read_here[suffix]] = self.value(key)
            elif suffix in _MUST_AGREE:
                checks.append((key, suffix))
            elif suffix is None or mapped.get(suffix) is None:
                raise LoadError(f"GGUF file {self.files[0]}: metadata key '{key}' = {self.value(key)!r} is not "
                                f"understood by kinject for architecture {self.arch!r}; refusing to guess its meaning")
        if self.arch in _COMPLETE:
            parsed = _COMPLETE[self.arch](self, parsed)
        config = CONFIG_MAPPING[model_type].from_dict(parsed)
        for key, suffix in checks:
            self._agree(config, key, suffix)
        return config

    def _agree(self, config, key: str, suffix: str) -> None:
        value = self.value(key)
        if suffix == "expert_shared_count":
            want, attr = (1 if getattr(config, "shared_expert_intermediate_size", 0) else 0), "one shared expert"
        else:
            attr = _MUST_AGREE[suffix]
            if suffix == "rope.dimension_count" and getattr(config, "rotary_dim", None):
                attr = "rotary_dim"
            want = getattr(config, attr, None)
            if want is None:
                want = config.hidden_size // config.num_attention_heads
        if value != want:
            raise LoadError(f"GGUF file {self.files[0]}: metadata key '{key}' = {value!r} disagrees with the "
                            f"{type(config).__name__} built from it ({attr} = {want!r}); kinject does not load it")

    def tokenizer(self):
        """The tokenizer stored in the file (transformers' GGUF tokenizer conversion)."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(self.files[0].parent), gguf_file=self.files[0].name)


# ------------------------------------------------------------------------------------------------


class GGUFIndex:
    """The model tensors of a GGUF checkpoint as sources (``CheckpointIndex``'s interface)."""

    def __init__(self, checkpoint: GGUFCheckpoint, model: torch.nn.Module):
        from transformers.modeling_gguf_pytorch_utils import (
            TENSOR_PROCESSORS,
            get_gguf_hf_weights_map,
        )

        from kinject.engine.formats.gguf import GGUFFormat

        self.checkpoint = checkpoint
        self.root = checkpoint.files[0].parent
        self.files = [str(f) for f in checkpoint.files]
        self.format = GGUFFormat(checkpoint.qtypes(), where=f"GGUF file {checkpoint.files[0]}")
        targets = dict(model.state_dict(keep_vars=True))
        if checkpoint.arch in _TENSOR_MAPS:
            to_hf, self._joins = _TENSOR_MAPS[checkpoint.arch](model.config)
        else:
            processor = TENSOR_PROCESSORS.get(checkpoint.arch, TENSOR_PROCESSORS["llama"])(model.config.to_dict())
            to_hf, self._joins = get_gguf_hf_weights_map(model, processor), {}
        self._keys: dict[str, list[str]] = {}                  # model tensor -> GGUF tensors, in concat order
        unused = []
        for key in checkpoint.tensors:
            hf = to_hf.get(key) or to_hf.get(key.rsplit(".", 1)[0])
            if hf is None or hf not in targets:
                unused.append(key)
                continue
            self._keys.setdefault(hf, []).append(key)
        for hf, keys in self._keys.items():              # gate before up, as transformers fuses them
            keys.sort(key=lambda k: 0 if "_gate_" in k else 1 if "_up_" in k else 2)
        if unused:
            close = difflib.get_close_matches(unused[0], list(to_hf), n=2, cutoff=0.6)
            raise LoadError(f"GGUF tensor '{unused[0]}' ({self._file(unused[0])}) is no tensor of "
                            f"{type(model).__name__}" + (f"; closest GGUF names it maps: {', '.join(close)}" if close else "")
                            + (f"; {len(unused) - 1} more unused" if len(unused) > 1 else ""))
        first: dict[int, str] = {}
        for name, t in targets.items():                  # tied weights: whichever the file holds
            owner = first.setdefault(id(t), name)
            if name not in self._keys and owner in self._keys:
                self._keys[name] = self._keys[owner]
            elif owner not in self._keys and name in self._keys:
                self._keys[owner] = self._keys[name]
        missing = [n for n, t in targets.items() if n not in self._keys and t.is_meta]
        if missing:
            raise LoadError(f"tensor '{missing[0]}' of {type(model).__name__} is in no tensor of GGUF checkpoint "
                            f"{checkpoint.files[0]}" + (f" ({len(missing) - 1} more missing)" if len(missing) > 1 else ""))
        self._targets = {n: targets[n] for n in self._keys}
        self.names = list(self._targets)
        self._fused = {n for n, keys in self._keys.items()
                       if self._targets[n].dim() == 3 and all(len(self._tensor(k).shape) == 3 for k in keys)}
        self._fused |= set(self._joins) & set(self._keys)
        for name in self.names:
            self._check(name)

    def __repr__(self) -> str:
        return f"GGUFIndex({str(self.checkpoint.files[0])!r}, {len(self.names)} tensors, {len(self.files)} files)"

    def __contains__(self, name: str) -> bool:
        return name in self._keys

    def __len__(self) -> int:
        return len(self.names)

    # ---- layout -----------------------------------------------------------------------------

    def _tensor(self, key: str):
        return self.checkpoint.tensors[key][1]

    def _file(self, key: str) -> str:
        return os.path.basename(self.checkpoint.tensors[key][0])

    def _shape(self, key: str) -> tuple[int, ...]:
        """The tensor's shape in torch order (GGUF lists dims innermost first)."""
        return tuple(int(d) for d in reversed(self._tensor(key).shape.tolist()))

    def _check(self, name: str) -> None:
        """Refuse a model tensor its GGUF tensors do not make, naming both."""
        keys, shape = self._keys[name], tuple(self._targets[name].shape)
        shapes = [self._shape(k) for k in keys]
        if name in self._joins:
            experts = [(s[1], s[2]) if len(s) == 3 else (1, s[1]) for s in shapes if len(s) in (2, 3)]
            found = self._joins[name].shape(experts) if len(experts) == len(keys) else None
            if (len(set(shapes)) != 1 or shapes[0][0] != shape[0] or found is None
                    or tuple(d for d in found if d != 1) != tuple(d for d in shape[1:] if d != 1)):
                raise LoadError(f"tensor '{name}': expected shape {list(shape)}, GGUF tensors {' + '.join(keys)} "
                                f"({self._file(keys[0])}) are {shapes}")
            return
        if len(keys) == 1:
            found = shapes[0]
            if found != shape and tuple(d for d in shape if d != 1) != found:
                raise LoadError(f"tensor '{name}': expected shape {list(shape)}, GGUF tensor '{keys[0]}' "
                                f"({self._file(keys[0])}) is {list(found)}")
            return
        if name not in self._fused or len({s for s in shapes}) != 1:
            raise LoadError(f"tensor '{name}' would join GGUF tensors {', '.join(keys)} of shapes {shapes}; kinject "
                            "joins only equal 3-D expert tensors (gate and up into gate_up_proj)")
        found = (shapes[0][0], shapes[0][1] * len(keys), shapes[0][2])
        if found != shape:
            raise LoadError(f"tensor '{name}': expected shape {list(shape)}, GGUF tensors {' + '.join(keys)} make "
                            f"{list(found)}")

    # ---- the CheckpointIndex interface ---------------------------------------------------------

    def is_fused_expert(self, name: str) -> bool:
        self._keys_of(name)
        return name in self._fused

    def is_stored(self, name: str) -> bool:
        """Whether ``name`` stays in its GGML blocks (every tensor but a 1-D float one)."""
        return name in self._fused or isinstance(self.source(name), StoredSource)

    def num_experts(self, name: str) -> int:
        if not self.is_fused_expert(name):
            raise ValueError(f"'{name}' is not a fused expert parameter")
        return int(self._targets[name].shape[0])

    def source(self, name: str) -> Source | StoredSource:
        keys = self._keys_of(name)
        shape = tuple(self._targets[name].shape)
        if name in self._fused:
            parts = tuple(self.expert_source(name, e) for e in range(shape[0]))
            return StoredSource(name, None, shape, self._targets[name].dtype, self.format, parts=parts)
        return self._source(name, None, keys, shape)

    def expert_source(self, name: str, expert: int) -> StoredSource:
        n = self.num_experts(name)
        if not 0 <= expert < n:
            raise IndexError(f"expert {expert} out of range for '{name}' ({n} experts)")
        return self._source(name, expert, self._keys[name], tuple(self._targets[name].shape[1:]))

    def rows_source(self, name: str, start: int, stop: int, *, squeeze: bool = False):
        """Rows ``start .. stop`` of dim 0: one expert of a fused expert tensor (``squeeze``), or
        those rows of it; another tensor's rows are cut from the whole (GGUF rows are blocks)."""
        if self.is_fused_expert(name):
            if squeeze:
                return self.expert_source(name, start)
            parts = tuple(self.expert_source(name, e) for e in range(start, stop))
            return StoredSource(name, None, (stop - start,) + parts[0].shape, self._targets[name].dtype,
                                self.format, parts=parts)
        raise FormatError(f"tensor '{name}': rows {start}..{stop} of a GGUF tensor that is no expert tensor; "
                          "kinject reads GGUF tensors whole or per expert")

    # ---- sources ---------------------------------------------------------------------------

    def _keys_of(self, name: str) -> list[str]:
        keys = self._keys.get(name)
        if keys is None:
            close = difflib.get_close_matches(name, self.names, n=3, cutoff=0.6)
            raise KeyError(f"'{name}' is not a tensor of the indexed model" + (f"; closest: {', '.join(close)}" if close else ""))
        return keys

    def _piece(self, key: str, expert: int | None) -> tuple[Piece, str]:
        """The bytes of GGUF tensor ``key`` (or of its expert ``expert``): uint8 ``[rows, row_bytes]``."""
        file, t = self.checkpoint.tensors[key]
        qtype = t.tensor_type.name
        shape = self._shape(key)
        rb = ggml.row_bytes(qtype, shape[-1])
        rows = 1
        for d in shape[:-1]:
            rows *= d
        offset, index = int(t.data_offset), None
        if expert is not None:
            rows //= shape[0]
            offset += expert * rows * rb
            index = (expert,)
        return Piece(str(file), key, index, None, (rows, rb), torch.uint8, offset, rows * rb), qtype

    def _source(self, name: str, expert: int | None, keys: list[str], shape: tuple[int, ...]):
        """Tensor ``name`` (or one expert of it, ``shape`` without dim 0) from its GGUF tensors: kept
        in their blocks when a matrix, read as a plain tensor when 1-D (norms, biases)."""
        dtype = self._targets[name].dtype
        pieces = [self._piece(k, expert) for k in keys]
        if len(shape) - shape.count(1) <= 1 and expert is None and len(keys) == 1:
            piece, qtype = pieces[0]
            if qtype in ("F32", "F16", "BF16"):
                plain = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
                piece = Piece(piece.file, piece.key, None, None, shape, plain, piece.offset, piece.nbytes)
                return Source(name, None, shape, plain, (piece,), None, piece.nbytes)
        stored = []
        for piece, qtype in pieces:
            rows = piece.shape[0]
            logical = (rows, ggml.row_values(qtype, piece.shape[1]))
            src = Source(f"{name}[{qtype}]", expert, piece.shape, torch.uint8, (piece,), None, piece.nbytes)
            self.format.check(name, {qtype: (piece.shape, torch.uint8)}, logical)
            stored.append({qtype: src})
        if name in self._joins:
            return gguf_gpt_oss.joined(name, expert, shape, dtype, self.format, tuple(stored), self._joins[name])
        if len(stored) == 1:
            return _Reshaped(name, expert, shape, dtype, self.format, tuple(stored), None)
        return _Reshaped(name, expert, shape, dtype, self.format, tuple(stored), 0)


class _Reshaped(StoredSource):
    """A :class:`StoredSource` whose dequantized rows are reshaped to the model tensor's shape
    (a GGUF 1-D tensor the model holds as ``[1, n]``; an expert's ``[rows, cols]`` is already its own)."""

    def assemble(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        return super().assemble(tensors, dtype).reshape(self.shape)


def open_gguf(path: str | Path) -> GGUFCheckpoint | None:
    """The GGUF checkpoint at ``path``, or None when ``path`` is no GGUF checkpoint."""
    files = gguf_files(path)
    return None if files is None else GGUFCheckpoint(files)
