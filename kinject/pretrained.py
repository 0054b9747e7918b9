"""``kinject.from_pretrained``: build on meta, inject, stream each tensor into its tier.

The model is never whole in RAM: parameters are created on the meta device (buffers
stay real: rotary tables are computed, not stored), the checkpoint is indexed from its
headers and validated up front (missing, truncated or mis-shaped tensors fail here,
naming tensor and file, before anything runs), operators read their own weights straight
into their tier, and only what no rule claimed is read onto the compute device.

A checkpoint released quantized (config.json ``quantization_config``: FP8, MXFP4,
compressed-tensors) is read through its stored format (:mod:`kinject.engine.formats`), chosen
from the headers before any weight is read: its weights stay in their storage tensors in the
host and disk tiers and are dequantized on the compute device right before use; an unsupported
method or a malformed quantized checkpoint is a :class:`~kinject.engine.formats.FormatError`.
A GGUF checkpoint (a ``.gguf`` file, its directory, or its first shard) gives the config from its
metadata and keeps its GGML blocks the same way (:mod:`kinject.io.gguf`).
"""

from __future__ import annotations

import contextlib
import gc
import logging
from pathlib import Path

import torch
from torch import nn

from kinject.errors import LoadError
from kinject.inject import optimize
from kinject.io.checkpoint import CheckpointIndex
from kinject.io.gguf import GGUFIndex, open_gguf
from kinject.io.loading import config_dtype, parameters_on_meta

logger = logging.getLogger(__name__)


def _generative_class(config):
    """The class the checkpoint was saved from (``config.architectures``: a vision-language,
    omni or encoder-decoder model's own ``...ForConditionalGeneration``) when transformers has it
    and it can generate; None: the causal-LM auto class decides, as for any text checkpoint."""
    import transformers
    from transformers import GenerationMixin

    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if isinstance(cls, type) and (issubclass(cls, GenerationMixin) or callable(getattr(cls, "generate", None))):
            return cls
    return None


def from_pretrained(path: str | Path, rules, overrides: list[str] | None = None, *,
                    dtype: torch.dtype | str | None = None, attn_implementation: str | None = None) -> nn.Module:
    """Load a Hugging Face MoE checkpoint directly into kinject's tiers.

    ``dtype``: compute dtype of the model (default: the config's ``dtype``, else float32);
    checkpoint tensors of another dtype are converted as they are read.
    ``attn_implementation``: as in transformers (``"eager"``, ``"sdpa"``; default: theirs).
    """
    # tens of thousands of small objects (header entries, plans, sources, units) are made and kept:
    # the collector's passes over them cost ~30% of the set-up and find next to nothing to free
    # (at DeepSeek-V3's counts: 80 unreachable objects of ~820,000 tracked, freed after it)
    with _collector_paused():
        return _from_pretrained(Path(path).expanduser(), rules, overrides, dtype, attn_implementation)


@contextlib.contextmanager
def _collector_paused():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _from_pretrained(path: Path, rules, overrides, dtype, attn_implementation) -> nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    gguf = open_gguf(path)
    if gguf is None and not (path / "config.json").is_file():
        raise LoadError(f"{path}: no config.json (expected a Hugging Face model directory, or a .gguf file)")
    config = gguf.config() if gguf is not None else AutoConfig.from_pretrained(path)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    dtype = dtype or config_dtype(config)
    with parameters_on_meta():
        extra = {"attn_implementation": attn_implementation} if attn_implementation else {}
        cls = _generative_class(config)
        if cls is None:
            model = AutoModelForCausalLM.from_config(config, dtype=dtype, **extra)
        else:
            model = cls._from_config(config, dtype=dtype, **extra)
    model.eval()
    index = GGUFIndex(gguf, model) if gguf is not None else CheckpointIndex.open(path, model)
    optimize(model, rules, overrides, checkpoint=index)   # operators read their own weights;
                                                          # optimize reads the rest (materialise_rest)
    try:
        # the model's own generation config class (a diffusion family's carries its sampler's settings);
        # a GGUF file has none: the one built from its config stays, as in transformers' GGUF load
        own = getattr(model, "generation_config", None)
        if gguf is None:
            model.generation_config = (type(own) if own is not None else GenerationConfig).from_pretrained(path)
    except OSError:
        pass
    logger.info("kinject: loaded %s with %s", path, model.kinject.rules.path)
    return model
