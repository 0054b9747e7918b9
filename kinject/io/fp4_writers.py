"""Tiny FP4 checkpoints in the layouts releases ship (tests and benches): compressed-tensors
``nvfp4-pack-quantized`` / ``mxfp4-pack-quantized`` (the NVFP4A16 / MXFP4A16 presets of
compressed-tensors, its ``QuantizationConfig`` serialised) and NVIDIA ModelOpt NVFP4 (per-expert
``weight`` / ``weight_scale`` / ``weight_scale_2`` / ``input_scale``, ``hf_quant_config.json``).
The encoders are :mod:`kinject.engine.formats.fp4`'s; see :mod:`kinject.io.quantized_writers`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kinject.engine.formats.fp4 import (
    CompressedFP4Format,
    ModelOptNVFP4Format,
    quantize_modelopt_nvfp4,
    quantize_mxfp4_pack,
    quantize_nvfp4,
)
from kinject.io.quantized_writers import CT_DEFAULT_IGNORE, save_quantized

_PRESETS = {"nvfp4-pack-quantized": "NVFP4A16", "mxfp4-pack-quantized": "MXFP4A16"}
MODELOPT_EXCLUDE = ("lm_head", "*.mlp.gate", "model.embed_tokens")   # Linear layers only, not the router


def compressed_fp4_config(fmt: str, ignore: tuple[str, ...] = CT_DEFAULT_IGNORE, *, activations: bool = False) -> dict:
    """compressed-tensors' own ``quantization_config`` for its FP4 preset: weight-only (NVFP4A16,
    MXFP4A16), or with ``activations`` the W4A4 one (NVFP4, MXFP4)."""
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationScheme,
        preset_name_to_scheme,
    )

    preset = _PRESETS[fmt].removesuffix("A16") if activations else _PRESETS[fmt]
    scheme: QuantizationScheme = preset_name_to_scheme(preset, ["Linear"])
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, quantization_status="compressed",
                                ignore=list(ignore))
    out = json.loads(config.model_dump_json())
    out["quant_method"] = "compressed-tensors"
    return out


def save_compressed_fp4_checkpoint(model, path, fmt: str = "nvfp4-pack-quantized", *, tokenizer=None,
                                   ignore: tuple[str, ...] = CT_DEFAULT_IGNORE, activations: bool = False) -> Path:
    """``model`` as a compressed-tensors FP4 release (per-expert keys in the hub layout); with
    ``activations`` as a W4A4 one, which also stores each Linear's ``input_global_scale``."""
    qconfig = compressed_fp4_config(fmt, ignore, activations=activations)
    codec = CompressedFP4Format.from_config(qconfig, where=str(path)).bind(model)
    encode = quantize_nvfp4 if fmt.startswith("nvfp4") else quantize_mxfp4_pack

    def quantize(name: str, tensor: torch.Tensor):
        keys = codec.storage_keys(name)
        if keys is None:
            return None
        parts = {**encode(tensor), "input_global_scale": torch.tensor([448.0 * 6.0], dtype=torch.float32)}
        return {key: parts[part] for part, key in keys.items()}

    return save_quantized(model, Path(path), qconfig, quantize, tokenizer, None)


def save_modelopt_nvfp4_checkpoint(model, path, *, tokenizer=None, exclude: tuple[str, ...] = MODELOPT_EXCLUDE,
                                   in_config: bool = False) -> Path:
    """``model`` as ModelOpt exports NVFP4: ``hf_quant_config.json`` (or, ``in_config``, config.json's
    ``quantization_config``), per-expert packed ``weight`` + ``weight_scale`` + ``weight_scale_2``,
    and ``input_scale`` (for the activations, unused by weight dequantization)."""
    qconfig = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "exclude_modules": list(exclude),
               "kv_cache_quant_algo": None}
    codec = ModelOptNVFP4Format.from_config(qconfig, where=str(path))

    def quantize(name: str, tensor: torch.Tensor):
        keys = codec.storage_keys(name)
        if keys is None or tensor.dim() != 2:
            return None
        parts = {**quantize_modelopt_nvfp4(tensor), "input_scale": torch.tensor(1.0, dtype=torch.float32)}
        return {keys[part]: value for part, value in parts.items()}

    path = save_quantized(model, Path(path), qconfig, quantize, tokenizer, None)
    if not in_config:                                     # ModelOpt's own layout: the config in its own file
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        del config["quantization_config"]
        config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
        (path / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.37.0"},
             "quantization": {k: v for k, v in qconfig.items() if k != "quant_method"}}, indent=2) + "\n")
    return path


def decompressed_checkpoint(path, dst) -> Path:
    """A float copy of compressed-tensors FP4 checkpoint ``path`` at ``dst``: every packed module
    replaced by compressed-tensors' own decompression of it (``BaseCompressor.load_from_registry(format)
    .decompress``), no quantization config: what transformers loads as the reference, since its own
    load of the packed checkpoint (5.24) does not fill fused experts from per-expert packed keys."""
    import shutil

    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file, save_file

    path, dst = Path(path), Path(dst)
    shutil.copytree(path, dst)
    config = json.loads((path / "config.json").read_text())
    qconfig = QuantizationConfig.model_validate(config.pop("quantization_config"))
    scheme = next(iter(qconfig.config_groups.values()))
    compressor = BaseCompressor.load_from_registry(qconfig.format)
    for shard in sorted(dst.glob("*.safetensors")):
        tensors = load_file(str(shard))
        modules = {k.rsplit(".", 1)[0] for k in tensors if k.endswith(".weight_packed")}
        parts = ("weight_packed", "weight_scale", "weight_global_scale")
        out = {k: v for k, v in tensors.items()
               if k.rsplit(".", 1)[0] not in modules and not k.endswith(".input_global_scale")}
        for m in modules:
            stored = {p: tensors[f"{m}.{p}"] for p in parts if f"{m}.{p}" in tensors}
            out[f"{m}.weight"] = compressor.decompress(stored, scheme)["weight"]
        save_file({k: v.contiguous() for k, v in out.items()}, str(shard), metadata={"format": "pt"})
    (dst / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return dst
