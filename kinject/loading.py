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
                    dtype: torch.dtype | str | None = None) -> nn.Module:
    """Load a Hugging Face MoE checkpoint directly into kinject's tiers.

    ``dtype``: compute dtype of the model (default: the config's ``dtype``, else float32);
    checkpoint tensors of another dtype are converted as they are read.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from kinject.checkpoint import CheckpointIndex
    from kinject.inject import optimize

    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        raise LoadError(f"{path}: no config.json (expected a Hugging Face model directory)")
    config = AutoConfig.from_pretrained(path)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or _config_dtype(config)
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
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


def materialise_rest(model: nn.Module, index, device: torch.device, dtype: torch.dtype | None) -> None:
    """Read every parameter still on meta onto the compute device; tied parameters once."""
    done: dict[int, nn.Parameter] = {}
    for full, param in list(model.named_parameters(remove_duplicate=False)):
        if not param.is_meta:
            continue
        owner_name, _, leaf = full.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        new = done.get(id(param))
        if new is None:
            try:
                t = index.source(full).read((dtype or param.dtype) if param.dtype.is_floating_point else None)
            except KinjectError:
                raise
            except Exception as exc:
                raise LoadError(f"reading tensor {full!r} failed: {type(exc).__name__}: {exc}") from exc
            new = nn.Parameter(t.to(device), requires_grad=False)
            done[id(param)] = new
        owner._parameters[leaf] = new
    for name, buf in model.named_buffers():
        if buf.is_meta:
            raise LoadError(f"buffer {name!r} is still on the meta device after loading")
