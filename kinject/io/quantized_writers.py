"""Tiny checkpoints in the exact on-disk layouts of quantized releases.

kinject reads quantized checkpoints as they ship (docs/architecture.md, "Stored formats") and must give the
tokens of transformers' own dequantizing load. Testing that needs checkpoints in those layouts
without downloading a release: these writers take a float model (e.g. from
:func:`kinject.testing.build_tiny_model`), save it as transformers would write its hub layout
(``save_original_format=True``: per-expert keys where the hub has them), then replace the weights a
release quantizes by their storage tensors and add the release's ``quantization_config``.

    model = build_tiny_model("gpt_oss", dtype=torch.bfloat16)
    save_mxfp4_checkpoint(model, path)          # experts.*_blocks / *_scales, like gpt-oss-20b
    AutoModelForCausalLM.from_pretrained(path)  # transformers dequantizes it on a CPU

The quantizers here are simple round-to-nearest ones; the point is the layout and the arithmetic
of the stored values, not the quality of the rounding.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import torch

from kinject.engine.formats.compressed_tensors import CompressedTensorsFormat
from kinject.engine.formats.mxfp4 import BLOCK, E8M0_BIAS, FP4_VALUES, FormatError, MXFP4Format

logger = logging.getLogger(__name__)

# gpt-oss-20b / -120b's config.json: everything but the experts stays bf16.
GPT_OSS_MODULES_TO_NOT_CONVERT: tuple[str, ...] = (
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head",
)

# The W4A16 Qwen3-MoE conversions: every Linear weight but lm_head and the router
# (a Linear in the modeling code those releases were made with).
CT_DEFAULT_IGNORE: tuple[str, ...] = ("lm_head", "re:.*mlp.gate$")
# Kimi-K2-Thinking (DeepSeek-V3 architecture): only the routed experts are INT4, group 32.
KIMI_K2_IGNORE: tuple[str, ...] = (
    "lm_head", "re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
)

# name, tensor -> the stored tensors replacing it (by key), or None to keep it as it is
Quantizer = Callable[[str, torch.Tensor], "dict[str, torch.Tensor] | None"]


def quantize_mxfp4(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """Pack a weight ``[..., C, R]`` (transformers' orientation) as a release stores it.

    Per 32 consecutive values along ``C``: the shared exponent is ``floor(log2(amax)) - 2`` (OCP
    MX: e2m1's largest exponent is 2), each value is rounded to the nearest e2m1 value after
    scaling (saturating at 6). Returns ``{"blocks": [..., R, C/32, 16], "scales": [..., R, C/32]}``.
    """
    w = weight.detach().transpose(-1, -2).to(torch.float32)                       # [..., R, C]
    if w.shape[-1] % BLOCK:
        raise FormatError(f"MXFP4 packs {BLOCK} values per scale; a dimension of {w.shape[-1]} does not divide")
    groups = w.reshape(*w.shape[:-1], w.shape[-1] // BLOCK, BLOCK)                # [..., R, G, 32]
    amax = groups.abs().amax(dim=-1)                                              # [..., R, G]
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.full_like(amax, -E8M0_BIAS))
    exponent = exponent.clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)                          # [..., R, G, 32]
    magnitudes = torch.tensor(FP4_VALUES[:8])
    index = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)        # [..., R, G, 32]
    codes = (index | ((scaled < 0).to(torch.long) << 3)).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)                           # [..., R, G, 16]
    scales = (exponent + E8M0_BIAS).to(torch.uint8)
    return {"blocks": blocks.contiguous(), "scales": scales.contiguous()}


def save_mxfp4_checkpoint(model, path, *,
                          modules_to_not_convert: tuple[str, ...] = GPT_OSS_MODULES_TO_NOT_CONVERT,
                          tokenizer=None, max_shard_size: int | str | None = None) -> Path:
    """Save a gpt-oss model as gpt-oss-20b ships: fused experts as ``*_blocks`` / ``*_scales``.

    Every ``gate_up_proj`` / ``down_proj`` outside ``modules_to_not_convert`` is packed by
    :func:`quantize_mxfp4`; the rest (attention, router, biases, embeddings) stays in the model's
    dtype. ``max_shard_size`` (e.g. ``"100KB"``) writes shards and their index. Returns ``path``.
    """
    qconfig = {"quant_method": MXFP4Format.method, "modules_to_not_convert": list(modules_to_not_convert)}
    codec = MXFP4Format.from_config(qconfig, where=str(path))

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        keys = codec.storage_keys(name)
        if keys is None:
            return None
        stored = quantize_mxfp4(tensor)
        return {keys[part]: stored[part] for part in keys}

    return save_quantized(model, Path(path), qconfig, quantize, tokenizer, max_shard_size)


# What fine-grained FP8 releases (DeepSeek-V3, Qwen3-*-FP8) keep in their float dtype: embeddings,
# lm_head, routers and norms; every other 2-D weight (attention, experts, shared experts, dense MLPs)
# is stored as float8 values + block scales.
FP8_KEEP = re.compile(r"(embed_tokens|lm_head|\.gate|\.router|norm)\.weight$")


def save_fp8_checkpoint(model, path, *, block: tuple[int, int] | None = (128, 128), keep: re.Pattern = FP8_KEEP,
                        tokenizer=None, max_shard_size: int | str | None = None) -> Path:
    """Save ``model`` as a fine-grained FP8 release ships: every 2-D ``<name>.weight`` that ``keep``
    does not match as ``float8_e4m3fn`` values + float32 ``<name>.weight_scale_inv`` (one scale per
    ``block``, ``None``: one per row), ``quantization_config: {quant_method: fp8, ...}``.

    Experts must be written per expert (``experts.N.<proj>.weight``), the layout of the releases and
    the only one transformers' FP8 loader dequantizes: a model built from its config saves so
    (``save_pretrained`` reverts transformers' load-time fusing); one loaded from a fused checkpoint
    saves fused 3-D experts, which this refuses rather than leaving them unquantized. Returns ``path``.
    """
    from kinject.testing import quantize_fp8

    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic",
               "weight_block_size": list(block) if block is not None else None}

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        if tensor.ndim > 2 and tensor.is_floating_point() and ".experts." in name:
            raise FormatError(f"{path}: {name} {list(tensor.shape)} is a fused experts tensor; FP8 releases store "
                              "one 2-D weight per expert (save a model built from its config)")
        if not name.endswith(".weight") or tensor.ndim != 2 or keep.search(name):
            return None
        values, scale = quantize_fp8(tensor, block)
        return {name: values, name + "_scale_inv": scale}

    return save_quantized(model, Path(path), qconfig, quantize, tokenizer, max_shard_size)


def quantize_int(weight: torch.Tensor, *, num_bits: int, strategy: str, group_size: int | None,
                 symmetric: bool, scale_dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Round-to-nearest INT quantization of ``W [out, in]`` in compressed-tensors' stored form.

    Scales per group of ``group_size`` inputs (``"group"``) or per output row (``"channel"``),
    stored in ``scale_dtype``; the integer codes are computed against the stored scale, so
    ``(q - zero_point) * scale`` is what the checkpoint means. Returns the parts
    ``weight_packed`` / ``weight_scale`` / ``weight_shape`` (+ ``weight_zero_point``), plus
    ``codes`` (the signed integers, ``[out, in]`` int8) for tests to compute expectations from.
    """
    out, cols = weight.shape
    size = group_size if strategy == "group" else cols
    if cols % size:
        raise FormatError(f"in-features {cols} is not a multiple of group_size {size}")
    q_min, q_max = -(1 << (num_bits - 1)), (1 << (num_bits - 1)) - 1
    groups = weight.detach().to(torch.float32).unflatten(-1, (cols // size, size))   # [out, G, g]
    if symmetric:
        scale = groups.abs().amax(-1) / q_max                                     # [out, G]
        zero = torch.zeros_like(scale)
    else:
        low, high = groups.amin(-1).clamp(max=0), groups.amax(-1).clamp(min=0)
        scale = (high - low) / (q_max - q_min)
        zero = torch.round(q_min - low / scale.clamp(min=torch.finfo(torch.float32).tiny)).clamp(q_min, q_max)
    scale = scale.clamp(min=torch.finfo(scale_dtype).tiny).to(scale_dtype)
    codes = torch.round(groups / scale.float().unsqueeze(-1) + zero.unsqueeze(-1)).clamp(q_min, q_max)
    codes = codes.flatten(-2).to(torch.int8)                                     # [out, in]
    parts = {"weight_packed": pack_int32(codes, num_bits), "weight_scale": scale.contiguous(),
             "weight_shape": torch.tensor([out, cols], dtype=torch.int64)}
    if not symmetric:
        parts["weight_zero_point"] = pack_int32(zero.to(torch.int8).t(), num_bits).t().contiguous()
    return {**parts, "codes": codes}


def pack_int32(values: torch.Tensor, num_bits: int) -> torch.Tensor:
    """``[rows, cols]`` signed ints -> ``[rows, ceil(cols*bits/32)]`` int32, compressed-tensors' packing.

    Each value is offset by ``2**(bits-1)``; element ``i`` of a row goes to bit ``(i % per_word) *
    bits`` of word ``i // per_word``. Built in int64 and wrapped to int32 explicitly.
    """
    per_word = 32 // num_bits
    rows, cols = values.shape
    unsigned = values.to(torch.int64) + (1 << (num_bits - 1))
    unsigned = torch.nn.functional.pad(unsigned, (0, -cols % per_word))
    shifts = torch.arange(per_word, dtype=torch.int64) * num_bits
    words = (unsigned.reshape(rows, -1, per_word) << shifts).sum(-1)           # [rows, words] in [0, 2**32)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


def compressed_tensors_config(*, num_bits: int = 4, strategy: str = "group", group_size: int | None = 128,
                              symmetric: bool = True, targets: tuple[str, ...] = ("Linear",),
                              ignore: tuple[str, ...] = CT_DEFAULT_IGNORE) -> dict:
    """The ``quantization_config`` a W4A16 / W8A16 ``pack-quantized`` release carries."""
    weights = {"num_bits": num_bits, "type": "int", "symmetric": symmetric, "strategy": strategy,
               "group_size": group_size if strategy == "group" else None, "dynamic": False,
               "actorder": None, "block_structure": None, "observer": "minmax", "observer_kwargs": {}}
    return {
        "quant_method": CompressedTensorsFormat.method, "format": "pack-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None, "sparsity_config": {},
        "config_groups": {"group_0": {"targets": list(targets), "weights": weights, "input_activations": None,
                                      "output_activations": None, "format": "pack-quantized"}},
        "ignore": list(ignore),
    }


def save_compressed_tensors_checkpoint(model, path, *, tokenizer=None, max_shard_size: int | str | None = None,
                                       **scheme) -> Path:
    """Save ``model`` as a vLLM-targeted INT release: per-expert ``weight_packed`` / ``_scale`` / ``_shape``.

    ``scheme`` is :func:`compressed_tensors_config`'s (bits, strategy, group size, symmetry,
    targets, ignore). Weights are written in the hub layout (per-expert keys where the family's
    hub checkpoints have them); scales in the model's dtype. ``max_shard_size`` writes shards and
    their index. Returns ``path``.
    """
    qconfig = compressed_tensors_config(**scheme)
    codec = CompressedTensorsFormat.from_config(qconfig, where=str(path)).bind(model)
    group = codec.groups[0]

    def quantize(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor] | None:
        keys = codec.storage_keys(name)
        if keys is None:
            return None
        if tensor.ndim != 2:
            raise FormatError(f"{name}: shape {list(tensor.shape)} matches {group['name']}, but only 2-D "
                              "weights pack")
        stored = quantize_int(tensor, num_bits=group["num_bits"], strategy=group["strategy"],
                              group_size=group["group_size"], symmetric=group["symmetric"],
                              scale_dtype=tensor.dtype)
        return {keys[part]: stored[part] for part in keys}

    return save_quantized(model, Path(path), qconfig, quantize, tokenizer, max_shard_size)


def save_quantized(model, path: Path, qconfig: dict, quantize: Quantizer, tokenizer,
                    max_shard_size: int | str | None) -> Path:
    """``save_pretrained`` in the hub layout, then rewrite every shard through ``quantize``."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(path, save_original_format=True, **kwargs)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()
    renamed: dict[str, list[str]] = {}
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        shard_renamed, shard_bytes = _rewrite_shard(shard, quantize)
        renamed.update(shard_renamed)
        total += shard_bytes
    if not renamed:
        raise FormatError(f"{path}: {qconfig['quant_method']} matched no weight of {type(model).__name__}")
    _rewrite_index(path, renamed, total)
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["quantization_config"] = qconfig
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save_pretrained(path)
    logger.info("wrote %s checkpoint %s (%d weights quantized)", qconfig["quant_method"], path, len(renamed))
    return path


def _rewrite_shard(shard: Path, quantize: Quantizer) -> tuple[dict[str, list[str]], int]:
    """Replace the tensors ``quantize`` takes by their stored ones; returns (name -> new keys, bytes)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shard))
    out: dict[str, torch.Tensor] = {}
    renamed: dict[str, list[str]] = {}
    for name, tensor in tensors.items():
        stored = quantize(name, tensor)
        if stored is None:
            out[name] = tensor
        else:
            out.update(stored)
            renamed[name] = list(stored)
    save_file({k: v.contiguous() for k, v in out.items()}, str(shard), metadata={"format": "pt"})
    return renamed, sum(t.numel() * t.element_size() for t in out.values())


def _rewrite_index(path: Path, renamed: dict[str, list[str]], total_size: int) -> None:
    """Point a sharded checkpoint's ``weight_map`` at the stored keys that replaced each weight."""
    index_file = path / "model.safetensors.index.json"
    if not index_file.exists():
        return
    index = json.loads(index_file.read_text())
    weight_map = index["weight_map"]
    for name, keys in renamed.items():
        shard = weight_map.pop(name)
        weight_map.update({key: shard for key in keys})
    index.setdefault("metadata", {})["total_size"] = total_size
    index_file.write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
