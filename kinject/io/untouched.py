"""The untouched transformers model of a checkpoint: ``from_pretrained``, each parameter in the dtype
its model class gives it.

kinject compares its tokens with transformers' own load of the same directory (the demo's reference
row, ``kinject bench``'s "HF in RAM", ``kinject eval``'s base). Some transformers releases leave a
parameter of a pre-quantized checkpoint in the dtype it was stored in, whatever ``dtype`` was asked
for: 5.17 loads every key its conversion mapping renames as stored (Mixtral's
``block_sparse_moe.gate`` -> ``mlp.gate``, bfloat16 in a float32 model: its router then raises on
the first forward) and dequantizes MXFP4 experts to bfloat16 always; 5.24 casts both to the
parameter's dtype. :func:`load_untouched` finds such parameters once, after the load, by comparing
each with the same model class built on the meta device, and casts them: what later releases load
(a stored bfloat16 or a dequantized MXFP4 value is exact in float32), and nothing changes where
transformers already gave every parameter its dtype (docs/architecture.md, "Correctness").
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn


def load_untouched(path: str | Path, dtype: torch.dtype | None = None, **kwargs) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)`` in eval mode, every
    floating parameter in its model class's dtype (:func:`cast_to_class_dtypes`). ``dtype`` None:
    transformers' choice (the checkpoint's). A ``.gguf`` file: loaded from its folder with ``gguf_file``."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if path.suffix == ".gguf":
        kwargs["gguf_file"], path = path.name, path.parent
    if dtype is not None:
        kwargs["dtype"] = dtype
    if "quantization_config" not in kwargs and path.is_dir():
        config = dequantizing_config(path)
        if config is not None:
            kwargs["quantization_config"] = config
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    cast_to_class_dtypes(model, dtype)
    return model


#: Pre-quantized formats whose transformers quantizer keeps its own quantized modules where a GPU is
#: present (their forward then needs optional kernels, even for a model left on the CPU) unless told
#: to dequantize at load, as it does on a machine without one.
DEQUANTIZED_AT_LOAD = ("fp8", "mxfp4")


def dequantizing_config(path: Path):
    """The quantization config of checkpoint ``path`` with ``dequantize=True`` when its format is one
    of :data:`DEQUANTIZED_AT_LOAD`, so the untouched model is the same dequantized model with or
    without a GPU; None for any other checkpoint."""
    import json

    from transformers.quantizers.auto import AutoQuantizationConfig

    file = path / "config.json"
    if not file.is_file():
        return None
    saved = json.loads(file.read_text()).get("quantization_config")
    if not isinstance(saved, dict) or saved.get("quant_method") not in DEQUANTIZED_AT_LOAD:
        return None
    return AutoQuantizationConfig.from_dict({**saved, "dequantize": True})


def cast_to_class_dtypes(model: nn.Module, dtype: torch.dtype | None = None) -> list[str]:
    """Cast each floating parameter of ``model`` whose dtype differs from the one its model class
    gives it when built with ``dtype`` (None: the config's) to that dtype; return their names. What
    the class keeps in float32 on purpose (``_keep_in_fp32_modules``, applied by ``from_pretrained``
    only) stays; names the class does not have (modules a quantizer put in) are left as loaded."""
    config = model.config
    dtype = dtype or getattr(config, "dtype", None) or torch.get_default_dtype()
    if isinstance(dtype, str):                      # a config read from JSON may hold the name
        dtype = getattr(torch, dtype)
    with torch.device("meta"):
        skeleton = type(model)._from_config(config, dtype=dtype)
    expected = {name: p.dtype for name, p in skeleton.named_parameters()}
    # what transformers keeps in float32 on purpose at load (not on a meta build): left so
    kept = [k for attr in ("_keep_in_fp32_modules", "_keep_in_fp32_modules_strict")
            for k in (getattr(model, attr, None) or ())]
    params = dict(model.named_parameters())         # a tied parameter once, under its first name
    cast = [name for name, p in params.items()
            if p.is_floating_point() and name in expected and expected[name].is_floating_point
            and p.dtype != expected[name] and not (p.dtype == torch.float32 and any(k in name for k in kept))]
    with torch.no_grad():
        for name in cast:
            params[name].data = params[name].data.to(expected[name])    # in place: ties stay tied
    return cast
