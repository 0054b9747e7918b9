"""``kinject.from_pretrained``: build on meta, inject, stream each tensor into its tier.

The model is never whole in RAM: parameters are created on the meta device (buffers
stay real: rotary tables are computed, not stored), the checkpoint is indexed from its
headers and validated up front (missing, truncated or mis-shaped tensors fail here,
naming tensor and file, before anything runs), operators read their own weights straight
into their tier, and only what no rule claimed is read onto the compute device.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from torch import nn

from kinject.errors import KinjectError, LoadError

logger = logging.getLogger(__name__)


@contextlib.contextmanager
def parameters_on_meta():
    """Create every ``nn.Parameter`` on the meta device, buffers where they would be.

    HF's ``__init__`` then allocates nothing big and its weight init runs on meta (free);
    non-persistent buffers such as rotary ``inv_freq`` are still computed for real.
    """
    original = nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not param.is_meta:
            param = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def from_pretrained(path: str | Path, rules, overrides: list[str] | None = None, *,
                    dtype: torch.dtype | str | None = None, attn_implementation: str | None = None) -> nn.Module:
    """Load a Hugging Face MoE checkpoint directly into kinject's tiers.

    ``dtype``: compute dtype of the model (default: the config's ``dtype``, else float32);
    checkpoint tensors of another dtype are converted as they are read.
    ``attn_implementation``: as in transformers (``"eager"``, ``"sdpa"``; default: theirs).
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from kinject.io.checkpoint import CheckpointIndex
    from kinject.inject import optimize

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise LoadError(f"{path}: no config.json (expected a Hugging Face model directory)")
    config = AutoConfig.from_pretrained(path)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or _config_dtype(config)
    with parameters_on_meta():
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
    model.eval()
    index = CheckpointIndex.open(path, model)
    optimize(model, rules, overrides, checkpoint=index)   # operators read their own weights;
                                                          # the runtime reads the rest (materialise_rest)
    try:
        model.generation_config = GenerationConfig.from_pretrained(path)
    except OSError:
        pass
    logger.info("kinject: loaded %s with %s", path, model.kinject.rules.path)
    return model


def _config_dtype(config) -> torch.dtype:
    d = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(d, str):
        d = getattr(torch, d, None)
    return d if isinstance(d, torch.dtype) else torch.float32


def original_modules(module: nn.Module, prefix: str = ""):
    """``(name, module)`` pairs with the names of the untouched model: an operator's
    ``base`` child takes the operator's own name, as checkpoint keys expect."""
    from operators.base import Operator

    yield prefix, module
    for attr, child in module.named_children():
        if isinstance(module, Operator) and child is module.base:
            yield from original_modules(child, prefix)
        else:
            yield from original_modules(child, f"{prefix}.{attr}" if prefix else attr)


def materialise_rest(model: nn.Module, index, device: torch.device, dtype: torch.dtype | None) -> None:
    """Read every parameter still on meta, and every persistent buffer the checkpoint has,
    onto the compute device; tied parameters once."""
    indexed = set(index.names)
    done: dict[int, nn.Parameter] = {}
    seen: set[int] = set()
    for prefix, module in original_modules(model):
        if id(module) in seen:
            continue
        seen.add(id(module))
        for leaf, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            full = f"{prefix}.{leaf}" if prefix else leaf
            new = done.get(id(param))
            if new is None:
                t = _read(index, full, (dtype or param.dtype) if param.dtype.is_floating_point else None)
                new = done[id(param)] = nn.Parameter(t.to(device), requires_grad=False)
            module._parameters[leaf] = new
        for leaf, buf in list(module._buffers.items()):
            full = f"{prefix}.{leaf}" if prefix else leaf
            if buf is None or leaf in module._non_persistent_buffers_set or full not in indexed:
                if buf is not None and buf.is_meta:
                    raise LoadError(f"buffer {full!r} is on the meta device and not in the checkpoint")
                continue
            module._buffers[leaf] = _read(index, full, buf.dtype).to(device)


def _read(index, name: str, dtype):
    try:
        return index.source(name).read(dtype)
    except KinjectError:
        raise
    except Exception as exc:
        raise LoadError(f"reading tensor {name!r} failed: {type(exc).__name__}: {exc}") from exc
