"""Which files make a safetensors checkpoint, and whether the ``safetensors`` library accepts them.

A checkpoint is a directory with ``model.safetensors``, or with ``model.safetensors.index.json``
naming its shards, or any ``*.safetensors`` files; or a single ``.safetensors`` file. The checkpoint
index (:mod:`kinject.io.checkpoint`) asks this module for the files and reads their headers with
:func:`kinject.engine.safetensors_header.read_header`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from kinject.errors import LoadError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def validate_with_safetensors(file: str) -> None:
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


def checkpoint_files(path: Path) -> tuple[Path, list[str]]:
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
