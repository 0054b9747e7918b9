"""Stored-format codecs (MXFP4, compressed-tensors) against transformers' own dequantizing load.

Each writer in :mod:`kinject.io.quantized_writers` makes a tiny checkpoint in a release's on-disk
layout; transformers' CPU ``from_pretrained`` dequantizes it, and the codec, given one expert's
storage tensors as the checkpoint holds them, must produce that parameter bit for bit. Each test
also checks the reference differs from the float original, so quantization really happened.
"""

from __future__ import annotations

import importlib.util
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kinject.engine.formats.compressed_tensors import CompressedTensorsFormat, unpack_int32
from kinject.engine.formats.mxfp4 import FormatError, MXFP4Format
from kinject.errors import LoadError
from kinject.io.quantized_writers import (
    KIMI_K2_IGNORE,
    compressed_tensors_config,
    pack_int32,
    quantize_int,
    quantize_mxfp4,
    save_compressed_tensors_checkpoint,
    save_mxfp4_checkpoint,
)
from kinject.testing import build_tiny_model

PROJECTIONS = ("gate_up_proj", "down_proj")


def _load_reference(path: Path):
    """transformers' own load of ``path`` on the CPU (it dequantizes every stored format), each
    parameter in its class's dtype (:func:`kinject.io.untouched.load_untouched`; a no-op where
    transformers already gives it, as 5.24 does)."""
    from transformers.utils import logging as hf_logging

    from kinject.io.untouched import load_untouched

    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_untouched(path)


def _stored(path: Path, keys: dict[str, str]) -> dict[str, torch.Tensor]:
    """The tensors ``keys`` names, read from the checkpoint's single shard."""
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return {part: f.get_tensor(key) for part, key in keys.items()}


def _header(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """key -> (shape, dtype) of the checkpoint's single shard, without reading data."""
    out = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():
            piece = f.get_slice(key)
            out[key] = (tuple(piece.get_shape()), getattr(torch, _ST_DTYPES[piece.get_dtype()]))
    return out


_ST_DTYPES = {"U8": "uint8", "I8": "int8", "I32": "int32", "I64": "int64", "BF16": "bfloat16", "F16": "float16", "F32": "float32"}


def _bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits (``-0.0`` vs ``0.0`` and NaN payloads count)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))


def _config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


# --------------------------------------------------------------------------------------------
# MXFP4 (gpt-oss)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def gpt_oss_mxfp4(tmp_path_factory):
    """(float model, checkpoint dir, transformers' load of it) for a bf16 tiny gpt-oss."""
    model = build_tiny_model("gpt_oss", dtype=torch.bfloat16)
    path = save_mxfp4_checkpoint(model, tmp_path_factory.mktemp("gpt_oss_mxfp4"))
    return model, path, _load_reference(path)


def test_mxfp4_checkpoint_has_the_release_layout(gpt_oss_mxfp4):
    model, path, _ = gpt_oss_mxfp4
    cfg = model.config
    E, H, I = cfg.num_local_experts, cfg.hidden_size, cfg.intermediate_size
    header = _header(path)
    prefix = "model.layers.0.mlp.experts."
    assert header[prefix + "gate_up_proj_blocks"] == ((E, 2 * I, H // 32, 16), torch.uint8)
    assert header[prefix + "gate_up_proj_scales"] == ((E, 2 * I, H // 32), torch.uint8)
    assert header[prefix + "down_proj_blocks"] == ((E, H, I // 32, 16), torch.uint8)
    assert header[prefix + "down_proj_scales"] == ((E, H, I // 32), torch.uint8)
    assert header[prefix + "gate_up_proj_bias"] == ((E, 2 * I), torch.bfloat16)
    assert prefix + "gate_up_proj" not in header
    codec = MXFP4Format.from_config(_config(path)["quantization_config"], where=str(path))
    stored = {key for key in header if codec.is_storage_key(key)}                # what the loader must consume
    assert stored == {f"model.layers.{i}.mlp.experts.{p}_{part}" for i in range(cfg.num_hidden_layers)
                      for p in PROJECTIONS for part in ("blocks", "scales")}
    assert _config(path)["quantization_config"] == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }


def test_mxfp4_dequantize_per_expert_is_transformers_load(gpt_oss_mxfp4):
    model, path, reference = gpt_oss_mxfp4
    codec = MXFP4Format.from_config(_config(path)["quantization_config"], where=str(path))
    header = _header(path)
    for layer in range(model.config.num_hidden_layers):
        for proj in PROJECTIONS:
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            keys = codec.storage_keys(name)
            assert keys == {"blocks": f"{name}_blocks", "scales": f"{name}_scales"}
            loaded = reference.get_parameter(name).detach()                       # [E, in, out]
            codec.check(name, {part: header[key] for part, key in keys.items()}, tuple(loaded.shape))
            stored = _stored(path, keys)
            for e in range(loaded.shape[0]):
                expert = codec.dequantize({part: t[e] for part, t in stored.items()}, loaded.dtype)
                assert _bitwise_equal(expert, loaded[e]), f"{name}[{e}]"
                codec.check(name, {part: (tuple(t[e].shape), t.dtype) for part, t in stored.items()},
                            tuple(loaded[e].shape))
            assert _bitwise_equal(codec.dequantize(stored, loaded.dtype), loaded)
            original = model.get_parameter(name).detach()
            assert not torch.equal(loaded, original), f"{name}: the reference was not quantized"


def test_mxfp4_weights_and_shapes_from_the_checkpoint_keys_alone(gpt_oss_mxfp4):
    """What a reader needs where the weight's name is no key: storage key -> weight, layout -> shape."""
    model, path, _ = gpt_oss_mxfp4
    codec = MXFP4Format.from_config(_config(path)["quantization_config"], where=str(path))
    header = _header(path)
    weights = {codec.weight_name(key) for key in header} - {None}
    assert weights == {f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in PROJECTIONS}
    assert codec.weight_name("model.layers.0.mlp.experts.gate_up_proj_bias") is None
    assert codec.weight_name("model.layers.0.self_attn.q_proj.weight") is None
    for name in weights:
        layout = {part: header[key] for part, key in codec.storage_keys(name).items()}
        assert codec.logical_shape(name, layout) == tuple(model.get_parameter(name).shape)
        one = {part: (shape[1:], dtype) for part, (shape, dtype) in layout.items()}
        assert codec.logical_shape(name, one) == tuple(model.get_parameter(name).shape[1:])


def test_mxfp4_sharded_checkpoint_indexes_the_stored_keys(gpt_oss_mxfp4, tmp_path):
    model, _, reference = gpt_oss_mxfp4
    path = save_mxfp4_checkpoint(model, tmp_path, max_shard_size="40KB")
    index = json.loads((path / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1
    keys, total = set(), 0
    for shard in shards:
        with safe_open(str(path / shard), framework="pt") as f:
            keys |= {(key, shard) for key in f.keys()}
            total += sum(f.get_tensor(key).nbytes for key in f.keys())
    assert keys == set(index["weight_map"].items()) and index["metadata"]["total_size"] == total
    assert "model.layers.1.mlp.experts.down_proj_scales" in index["weight_map"]
    assert "model.layers.1.mlp.experts.down_proj" not in index["weight_map"]
    sharded = _load_reference(path)
    for name, param in reference.named_parameters():
        assert _bitwise_equal(sharded.get_parameter(name).detach(), param.detach()), name


def test_mxfp4_dequantize_in_float32_is_transformers_load(tmp_path):
    """A float32 checkpoint dequantizes to float32 (transformers 5.24 uses the parameter's dtype; 5.17
    dequantizes to bfloat16 whatever the parameter's, and the reference loader casts that up: exact,
    as every MXFP4 value -- a 4-bit e2m1 value times a power of two -- is a bfloat16 value)."""
    model = build_tiny_model("gpt_oss", num_hidden_layers=1)
    path = save_mxfp4_checkpoint(model, tmp_path)
    reference = _load_reference(path)
    codec = MXFP4Format.from_config(_config(path)["quantization_config"], where=str(path))
    name = "model.layers.0.mlp.experts.down_proj"
    loaded = reference.get_parameter(name).detach()
    assert loaded.dtype == torch.float32
    stored = _stored(path, codec.storage_keys(name))
    assert _bitwise_equal(codec.dequantize({k: t[3] for k, t in stored.items()}, torch.float32), loaded[3])


def test_mxfp4_modules_to_not_convert_stay_float_as_transformers_reads_them(tmp_path):
    model = build_tiny_model("gpt_oss", dtype=torch.bfloat16)
    skip = ("model.layers.1.mlp.experts",)
    path = save_mxfp4_checkpoint(model, tmp_path, modules_to_not_convert=skip)
    codec = MXFP4Format.from_config(_config(path)["quantization_config"], where=str(path))
    header = _header(path)
    assert codec.storage_keys("model.layers.1.mlp.experts.gate_up_proj") is None
    assert codec.storage_keys("model.layers.0.mlp.experts.gate_up_proj") is not None
    assert codec.storage_keys("model.layers.0.mlp.experts.gate_up_proj_bias") is None
    assert codec.storage_keys("model.layers.0.self_attn.q_proj.weight") is None
    assert "model.layers.1.mlp.experts.gate_up_proj" in header
    assert "model.layers.1.mlp.experts.gate_up_proj_blocks" not in header
    reference = _load_reference(path)
    for proj in PROJECTIONS:
        kept = f"model.layers.1.mlp.experts.{proj}"
        assert _bitwise_equal(reference.get_parameter(kept).detach(), model.get_parameter(kept).detach())


def test_mxfp4_known_codes_decode_to_known_values():
    """Codes and exponents chosen by hand -> values computed by hand (low nibble first, 2**(s-127))."""
    codec = MXFP4Format()
    codes = torch.arange(32) % 16                                                 # e2m1 codes 0..15 twice
    blocks = (codes[0::2] | (codes[1::2] << 4)).to(torch.uint8).reshape(1, 1, 16)  # [R=1, G=1, 16]
    scales = torch.tensor([[127 + 2]], dtype=torch.uint8)                         # x 4
    values = [0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6] * 2
    expected = (torch.tensor(values) * 4).reshape(32, 1)                          # [C=32, R=1]
    assert _bitwise_equal(codec.dequantize({"blocks": blocks, "scales": scales}, torch.float32), expected)


def test_mxfp4_quantize_round_trips_representable_values():
    """Values already on the MXFP4 grid come back exactly from the writer's quantizer + the codec."""
    gen = torch.Generator().manual_seed(0)
    grid = torch.tensor([0, .5, 1, 1.5, 2, 3, 4, 6, -.5, -1, -1.5, -2, -3, -4, -6])
    idx = torch.randint(len(grid), (3, 64, 5), generator=gen)
    scale = torch.exp2(torch.randint(-6, 3, (3, 1, 5), generator=gen).float())  # one per expert and row
    weight = grid[idx] * scale                                                    # [E, C=64, R=5]
    weight[:, 0::32, :] = 6 * scale                                               # each block's amax is 6 x scale
    stored = quantize_mxfp4(weight)
    assert MXFP4Format().dequantize(stored, torch.float32).equal(weight)


def test_mxfp4_storage_bytes_per_expert_at_most_028_of_bf16(gpt_oss_mxfp4):
    model, path, _ = gpt_oss_mxfp4
    codec = MXFP4Format.from_config(_config(path)["quantization_config"], where=str(path))
    for proj in PROJECTIONS:
        name = f"model.layers.0.mlp.experts.{proj}"
        stored = _stored(path, codec.storage_keys(name))
        expert_bytes = codec.nbytes({part: t[0] for part, t in stored.items()})
        bf16_bytes = model.get_parameter(name)[0].numel() * 2
        assert expert_bytes == sum(t[0].numel() for t in stored.values())          # uint8: one byte each
        assert expert_bytes <= 0.28 * bf16_bytes, (proj, expert_bytes, bf16_bytes)


# MXFP4 bad input ----------------------------------------------------------------------------

GATE_UP = "model.layers.0.mlp.experts.gate_up_proj"


@pytest.mark.parametrize("parts, shape, message", [
    ({"blocks": ((8, 64, 2, 16), torch.int8), "scales": ((8, 64, 2), torch.uint8)}, (8, 64, 64),
     r"gate_up_proj_blocks': dtype int8, MXFP4 blocks are uint8"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 2), torch.float32)}, (8, 64, 64),
     r"gate_up_proj_scales': dtype float32"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 1), torch.uint8)}, (8, 64, 64),
     r"gate_up_proj_scales': shape \[8, 64, 1\] does not fit .*gate_up_proj_blocks \[8, 64, 2, 16\]"),
    ({"blocks": ((8, 64, 2, 8), torch.uint8), "scales": ((8, 64, 2), torch.uint8)}, (8, 64, 64),
     r"gate_up_proj_blocks': shape \[8, 64, 2, 8\], expected \[\.\.\., rows, n_blocks, 16\]"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 2), torch.uint8)}, (8, 64, 32),
     r"dequantizes to \[8, 64, 64\], but model.layers.0.mlp.experts.gate_up_proj is \[8, 64, 32\]"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 2), torch.uint8)}, (64, 8, 64),
     r"dequantizes to \[8, 64, 64\]"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8)}, (8, 64, 64), r"gate_up_proj_scales' is missing"),
])
def test_mxfp4_check_names_the_tensor_that_does_not_fit(parts, shape, message):
    with pytest.raises(FormatError, match=message):
        MXFP4Format().check(GATE_UP, parts, shape)


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "mxfp4", "block_size": 16}, r"cfg.json: key 'block_size' .* not supported .*supported keys"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, r"cfg.json: key 'modules_to_not_convert'"),
    ({"quant_method": "fp8"}, r"cfg.json: quant_method 'fp8' is not 'mxfp4'"),
])
def test_mxfp4_from_config_refuses_what_it_cannot_read(qconfig, message):
    with pytest.raises(FormatError, match=message) as info:
        MXFP4Format.from_config(qconfig, where="cfg.json")
    assert isinstance(info.value, LoadError)


# --------------------------------------------------------------------------------------------
# compressed-tensors pack-quantized (INT4 / INT8)
# --------------------------------------------------------------------------------------------

# hidden and expert width 128, so group 128 divides every in-dimension
CT_MODEL = dict(hidden_size=128, moe_intermediate_size=128)
EXPERT = "model.layers.{layer}.mlp.experts.{e}.{proj}.weight"
CT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def _ct_codec(path: Path, model) -> CompressedTensorsFormat:
    return CompressedTensorsFormat.from_config(_config(path)["quantization_config"], where=str(path)).bind(model)


def test_unpack_reads_compressed_tensors_bit_order():
    """Hand-built words: element i at bit (i % per_word) * bits, stored offset by 2**(bits-1)."""
    word4 = torch.tensor([[0x76543210, 0xFEDCBA98 - (1 << 32)]], dtype=torch.int32)   # nibbles 0..15
    assert unpack_int32(word4, 4, 16).tolist() == [list(range(-8, 8))]
    assert unpack_int32(word4, 4, 11).tolist() == [list(range(-8, 3))]
    word8 = torch.tensor([[0x03020100, 0xFFFE8180 - (1 << 32)]], dtype=torch.int32)
    assert unpack_int32(word8, 8, 8).tolist() == [[-128, -127, -126, -125, 0, 1, 126, 127]]
    assert pack_int32(torch.arange(-8, 8).reshape(1, 16), 4).equal(word4)


@pytest.mark.parametrize("num_bits, strategy, group_size, symmetric", [
    (4, "group", 32, True), (4, "group", 128, True), (4, "channel", None, True), (8, "channel", None, True),
    (4, "group", 32, False), (4, "channel", None, False), (8, "group", 64, False),
])
def test_ct_dequantize_is_codes_minus_zero_point_times_scale(num_bits, strategy, group_size, symmetric):
    """Known integer codes -> known weights: ``(q - z) * s`` in the scale's dtype, computed here directly."""
    gen = torch.Generator().manual_seed(num_bits + (group_size or 0))
    weight = torch.randn(24, 128, generator=gen).to(torch.bfloat16)               # [out, in]
    parts = quantize_int(weight, num_bits=num_bits, strategy=strategy, group_size=group_size,
                         symmetric=symmetric, scale_dtype=torch.bfloat16)
    codes = parts.pop("codes")                                                    # [out, in] int8
    size = group_size or 128
    assert -(1 << (num_bits - 1)) <= codes.min().item() and codes.max().item() < (1 << (num_bits - 1))
    scale = parts["weight_scale"].repeat_interleave(size, dim=1)                  # [out, in]
    zero = torch.zeros_like(scale)
    if not symmetric:
        zero = unpack_int32(parts["weight_zero_point"].t(), num_bits, 24).t().repeat_interleave(size, dim=1)
    expected = ((codes.to(torch.bfloat16) - zero.to(torch.bfloat16)) * scale).to(torch.float32)
    qconfig = compressed_tensors_config(num_bits=num_bits, strategy=strategy, group_size=group_size,
                                        symmetric=symmetric, targets=("re:.*",))
    codec = CompressedTensorsFormat.from_config(qconfig, where="cfg")
    assert set(codec.storage_keys("w.weight")) == set(parts)
    codec.check("w.weight", {k: (tuple(t.shape), t.dtype) for k, t in parts.items()}, (24, 128))
    assert _bitwise_equal(codec.dequantize(parts, torch.float32), expected)
    assert (expected - weight.float()).abs().max() < (0.5 if num_bits == 4 else 0.05)


@pytest.fixture(scope="module")
def qwen3_moe_bf16():
    return build_tiny_model("qwen3_moe", dtype=torch.bfloat16, **CT_MODEL)


CT_SCHEMES = {
    "int4-group128": dict(num_bits=4, strategy="group", group_size=128),
    "int4-group32": dict(num_bits=4, strategy="group", group_size=32),
    "int4-channel": dict(num_bits=4, strategy="channel"),
    "int8-channel": dict(num_bits=8, strategy="channel"),
    "int8-group128": dict(num_bits=8, strategy="group", group_size=128),
}


def test_ct_checkpoint_has_the_release_layout(qwen3_moe_bf16, tmp_path):
    model = qwen3_moe_bf16
    path = save_compressed_tensors_checkpoint(model, tmp_path, **CT_SCHEMES["int4-group128"])
    header = _header(path)
    expert = "model.layers.0.mlp.experts.5.down_proj"
    assert header[expert + ".weight_packed"] == ((128, 128 // 8), torch.int32)
    assert header[expert + ".weight_scale"] == ((128, 1), torch.bfloat16)
    assert header[expert + ".weight_shape"] == ((2,), torch.int64)
    assert expert + ".weight" not in header and expert + ".weight_zero_point" not in header
    assert header["model.layers.0.self_attn.q_proj.weight_packed"][1] == torch.int32
    for kept in ("lm_head.weight", "model.embed_tokens.weight", "model.layers.0.mlp.gate.weight",
                 "model.layers.0.input_layernorm.weight"):
        assert kept in header, kept
    codec = _ct_codec(path, model)
    packed = {key for key in header if codec.is_storage_key(key)}
    assert packed == {key for key in header if key.rpartition(".")[2] in ("weight_packed", "weight_scale",
                                                                           "weight_shape")}
    assert len(packed) == 3 * (3 * model.config.num_experts + 4) * model.config.num_hidden_layers
    qconfig = _config(path)["quantization_config"]
    assert (qconfig["quant_method"], qconfig["format"]) == ("compressed-tensors", "pack-quantized")
    assert qconfig["ignore"] == ["lm_head", "re:.*mlp.gate$"]
    assert qconfig["config_groups"]["group_0"]["weights"]["group_size"] == 128


@pytest.mark.parametrize("scheme", list(CT_SCHEMES))
def test_ct_dequantize_per_expert_is_transformers_load(qwen3_moe_bf16, tmp_path, scheme):
    """transformers 5 reads compressed-tensors only with the ``compressed-tensors`` package installed."""
    pytest.importorskip("compressed_tensors")
    model = qwen3_moe_bf16
    path = save_compressed_tensors_checkpoint(model, tmp_path, **CT_SCHEMES[scheme])
    reference = _load_reference(path)
    codec = _ct_codec(path, model)
    header = _header(path)
    I = model.config.moe_intermediate_size
    for layer in range(model.config.num_hidden_layers):
        experts = reference.model.layers[layer].mlp.experts
        fused = {"gate_proj": lambda e: experts.gate_up_proj[e, :I], "up_proj": lambda e: experts.gate_up_proj[e, I:],
                 "down_proj": lambda e: experts.down_proj[e]}
        for e in range(model.config.num_experts):
            for proj in CT_PROJECTIONS:
                name = EXPERT.format(layer=layer, e=e, proj=proj)
                keys = codec.storage_keys(name)
                loaded = fused[proj](e).detach()
                codec.check(name, {part: header[key] for part, key in keys.items()}, tuple(loaded.shape))
                got = codec.dequantize(_stored(path, keys), loaded.dtype)
                assert _bitwise_equal(got, loaded), name
        original = model.model.layers[layer].mlp.experts.gate_up_proj.detach()
        assert not torch.equal(experts.gate_up_proj.detach(), original), "the reference was not quantized"
    # a dense Linear: transformers keeps it packed and decompresses it in the first forward
    with torch.no_grad():
        reference(torch.tensor([[1, 2, 3]]))
    name = "model.layers.0.self_attn.q_proj.weight"
    loaded = reference.get_parameter(name).detach()
    assert _bitwise_equal(codec.dequantize(_stored(path, codec.storage_keys(name)), loaded.dtype), loaded)


@pytest.mark.parametrize("num_bits, strategy, group_size", [(4, "group", 32), (4, "channel", None), (8, "group", 128)])
def test_ct_asymmetric_is_compressed_tensors_decompress(num_bits, strategy, group_size):
    """With zero points: the reference is the package's own decompress (transformers 5.24 calls it for
    dense modules; its fused-experts path drops ``weight_zero_point`` and cannot load these)."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    gen = torch.Generator().manual_seed(7)
    weight = (torch.randn(40, 128, generator=gen) + 0.3).to(torch.bfloat16)
    parts = quantize_int(weight, num_bits=num_bits, strategy=strategy, group_size=group_size,
                         symmetric=False, scale_dtype=torch.bfloat16)
    parts.pop("codes")
    qconfig = compressed_tensors_config(num_bits=num_bits, strategy=strategy, group_size=group_size,
                                        symmetric=False, targets=("re:.*",))
    group = qconfig["config_groups"]["group_0"]
    scheme = QuantizationScheme.model_validate({**group, "format": None})
    reference = PackedQuantizationCompressor.decompress(dict(parts), scheme)["weight"].to(torch.bfloat16)
    codec = CompressedTensorsFormat.from_config(qconfig, where="cfg")
    assert _bitwise_equal(codec.dequantize(parts, torch.bfloat16), reference)
    assert not torch.equal(reference, weight)


def test_ct_kimi_k2_layout_on_deepseek_v3_quantizes_only_routed_experts(tmp_path):
    """Kimi-K2-Thinking's scheme on the DeepSeek-V3 architecture (MLA, dense first layer, shared expert)."""
    model = build_tiny_model("deepseek_v3", dtype=torch.bfloat16)
    path = save_compressed_tensors_checkpoint(model, tmp_path, group_size=32, ignore=KIMI_K2_IGNORE)
    header = _header(path)
    codec = _ct_codec(path, model)
    for float_key in ("model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.shared_experts.up_proj.weight",
                      "model.layers.1.self_attn.q_a_proj.weight", "model.layers.1.self_attn.kv_b_proj.weight"):
        assert float_key in header and codec.storage_keys(float_key) is None, float_key
    packed = {key.rpartition(".")[0] for key in header if key.endswith(".weight_packed")}
    assert packed == {f"model.layers.{i}.mlp.experts.{e}.{p}" for i in (1, 2) for e in range(8) for p in CT_PROJECTIONS}
    if importlib.util.find_spec("compressed_tensors") is None:
        return                                            # the reference below needs the package
    reference = _load_reference(path)
    I = model.config.moe_intermediate_size
    experts = reference.model.layers[2].mlp.experts
    for e in range(8):
        for proj, loaded in (("gate_proj", experts.gate_up_proj[e, :I]), ("up_proj", experts.gate_up_proj[e, I:]),
                             ("down_proj", experts.down_proj[e])):
            name = EXPERT.format(layer=2, e=e, proj=proj)
            assert _bitwise_equal(codec.dequantize(_stored(path, codec.storage_keys(name)), loaded.dtype),
                                  loaded.detach()), name
    dense = "model.layers.0.mlp.down_proj.weight"
    assert _bitwise_equal(reference.get_parameter(dense).detach(), model.get_parameter(dense).detach())


def test_ct_targets_and_ignore_follow_compressed_tensors_matching(qwen3_moe_bf16):
    qconfig = compressed_tensors_config(symmetric=False, ignore=("lm_head", "re:.*mlp.gate$", "re:.*layers.1.*"))
    codec = CompressedTensorsFormat.from_config(qconfig, where="cfg").bind(qwen3_moe_bf16)
    expert = "model.layers.0.mlp.experts.3.gate_proj"
    assert codec.storage_keys(expert + ".weight") == {
        part: f"{expert}.{part}" for part in ("weight_packed", "weight_scale", "weight_shape", "weight_zero_point")}
    assert codec.storage_keys("model.layers.0.self_attn.o_proj.weight") is not None        # a Linear
    assert codec.storage_keys("model.layers.1.mlp.experts.3.gate_proj.weight") is None     # ignored by regex
    assert codec.storage_keys("lm_head.weight") is None                                    # ignored by name
    assert codec.storage_keys("model.layers.0.mlp.gate.weight") is None                    # ignored router
    assert codec.storage_keys("model.embed_tokens.weight") is None                         # an Embedding
    assert codec.storage_keys("model.layers.0.input_layernorm.weight") is None             # a norm
    assert codec.storage_keys("model.layers.0.self_attn.o_proj.bias") is None              # not a weight
    unbound = CompressedTensorsFormat.from_config(qconfig, where="cfg")                    # no module classes:
    assert unbound.storage_keys(expert + ".weight") is not None                            # experts still match
    assert unbound.storage_keys("model.layers.0.self_attn.o_proj.weight") is None
    by_regex = CompressedTensorsFormat.from_config(
        compressed_tensors_config(targets=("re:.*experts.*",), ignore=()), where="cfg")
    assert by_regex.storage_keys(expert + ".weight") is not None
    assert by_regex.storage_keys("model.layers.0.self_attn.o_proj.weight") is None


@pytest.mark.parametrize("scheme", ["int4-group32", "int8-channel"])
def test_ct_weights_and_shapes_from_the_checkpoint_keys_alone(qwen3_moe_bf16, tmp_path, scheme):
    """Per-expert keys a transformers 5 model fuses: storage key -> weight name, layout -> [out, in]."""
    model = qwen3_moe_bf16
    path = save_compressed_tensors_checkpoint(model, tmp_path, **CT_SCHEMES[scheme])
    codec, header = _ct_codec(path, model), _header(path)
    weights = {codec.weight_name(key) for key in header} - {None}
    experts = {EXPERT.format(layer=i, e=e, proj=p) for i in range(2) for e in range(8) for p in CT_PROJECTIONS}
    attention = {f"model.layers.{i}.self_attn.{p}.weight" for i in range(2) for p in ("q_proj", "k_proj", "v_proj",
                                                                                      "o_proj")}
    assert weights == experts | attention
    assert codec.weight_name("model.layers.0.mlp.gate.weight") is None
    for name in weights:
        layout = {part: header[key] for part, key in codec.storage_keys(name).items()}
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            stored_shape = f.get_tensor(codec.storage_keys(name)["weight_shape"]).tolist()
        assert list(codec.logical_shape(name, layout)) == stored_shape, name


def test_ct_storage_bytes_int4_group128_at_most_030_of_bf16(qwen3_moe_bf16, tmp_path):
    model = qwen3_moe_bf16
    path = save_compressed_tensors_checkpoint(model, tmp_path, **CT_SCHEMES["int4-group128"])
    codec = _ct_codec(path, model)
    stored = [_stored(path, codec.storage_keys(EXPERT.format(layer=0, e=2, proj=p))) for p in CT_PROJECTIONS]
    expert_bytes = sum(codec.nbytes(parts) for parts in stored)
    bf16_bytes = 3 * 128 * 128 * 2
    assert expert_bytes == sum(t.numel() * t.element_size() for parts in stored for t in parts.values())
    assert expert_bytes <= 0.30 * bf16_bytes, (expert_bytes, bf16_bytes)


# compressed-tensors bad input ---------------------------------------------------------------

W = "model.layers.0.mlp.experts.0.up_proj.weight"
GOOD_PARTS = {"weight_packed": ((64, 16), torch.int32), "weight_scale": ((64, 4), torch.bfloat16),
              "weight_shape": ((2,), torch.int64)}


@pytest.mark.parametrize("change, message", [
    ({"weight_packed": ((64, 16), torch.int8)}, r"up_proj.weight_packed': dtype int8, expected int32"),
    ({"weight_packed": ((64, 8), torch.int32)}, r"up_proj.weight_packed': shape \[64, 8\] does not fit "
                                                r".*up_proj.weight \[64, 128\] \(int4 group 32: expected \[64, 16\]\)"),
    ({"weight_scale": ((64, 1), torch.bfloat16)}, r"up_proj.weight_scale': shape \[64, 1\] does not fit"),
    ({"weight_scale": ((64, 4), torch.int32)}, r"up_proj.weight_scale': dtype int32, expected bfloat16 or"),
    ({"weight_shape": ((3,), torch.int64)}, r"up_proj.weight_shape': shape \[3\]"),
    ({"weight_shape": None}, r"up_proj.weight_shape' is missing"),
])
def test_ct_check_names_the_tensor_that_does_not_fit(change, message):
    codec = CompressedTensorsFormat.from_config(compressed_tensors_config(group_size=32), where="cfg")
    parts = {k: v for k, v in {**GOOD_PARTS, **change}.items() if v is not None}
    codec.check(W, GOOD_PARTS, (64, 128))
    with pytest.raises(FormatError, match=message):
        codec.check(W, parts, (64, 128))


def test_ct_check_asymmetric_needs_the_packed_zero_point():
    codec = CompressedTensorsFormat.from_config(compressed_tensors_config(group_size=32, symmetric=False),
                                                where="cfg")
    with pytest.raises(FormatError, match=r"up_proj.weight_zero_point' is missing"):
        codec.check(W, GOOD_PARTS, (64, 128))
    with pytest.raises(FormatError, match=r"weight_zero_point': shape \[64, 4\] .* expected \[8, 4\]"):
        codec.check(W, {**GOOD_PARTS, "weight_zero_point": ((64, 4), torch.int32)}, (64, 128))
    codec.check(W, {**GOOD_PARTS, "weight_zero_point": ((8, 4), torch.int32)}, (64, 128))


def test_ct_dequantize_refuses_a_weight_shape_that_does_not_fit_the_packed_tensor():
    codec = CompressedTensorsFormat.from_config(compressed_tensors_config(group_size=32), where="cfg")
    parts = {"weight_packed": torch.zeros(4, 4, dtype=torch.int32), "weight_scale": torch.ones(4, 1),
             "weight_shape": torch.tensor([4, 64])}
    with pytest.raises(FormatError, match=r"cfg: weight_packed has 4 int32 words per row for 64 values, which fits "
                                          r"none of the configured widths \[4\]"):
        codec.dequantize(parts, torch.float32)
    with pytest.raises(FormatError, match=r"cfg: weight_shape \[5, 32\] does not fit weight_packed \[4, 4\]"):
        codec.dequantize({**parts, "weight_shape": torch.tensor([5, 32])}, torch.float32)


def test_ct_dequantize_reads_the_bit_width_off_the_packed_tensor_and_stacks_experts():
    """Two groups (int4 experts, int8 attention): each weight's parts say which; a leading expert dim stays."""
    config = compressed_tensors_config(targets=("re:.*experts.*",), group_size=32)
    config["config_groups"]["group_1"] = compressed_tensors_config(
        num_bits=8, strategy="channel", targets=("re:.*self_attn.*",))["config_groups"]["group_0"]
    codec = CompressedTensorsFormat.from_config(config, where="cfg")
    gen = torch.Generator().manual_seed(3)
    for name, bits, strategy, size in (("m.experts.0.up_proj.weight", 4, "group", 32),
                                       ("m.self_attn.q_proj.weight", 8, "channel", None)):
        assert codec.group_of(name)["num_bits"] == bits
        experts = [quantize_int(torch.randn(16, 64, generator=gen), num_bits=bits, strategy=strategy,
                                group_size=size, symmetric=True, scale_dtype=torch.float32) for _ in range(3)]
        singles = [codec.dequantize({k: v for k, v in e.items() if k != "codes"}, torch.float32) for e in experts]
        stacked = {k: torch.stack([e[k] for e in experts]) for k in ("weight_packed", "weight_scale", "weight_shape")}
        assert _bitwise_equal(codec.dequantize(stacked, torch.float32), torch.stack(singles))
        for single, e in zip(singles, experts):
            scale = e["weight_scale"].repeat_interleave(64 // e["weight_scale"].shape[1], dim=1)
            assert _bitwise_equal(single, e["codes"].float() * scale)


def _group(**weights) -> dict:
    config = compressed_tensors_config()
    config["config_groups"]["group_0"]["weights"].update(weights)
    return config


@pytest.mark.parametrize("qconfig, message", [
    ({**compressed_tensors_config(), "format": "int-quantized"}, r"key 'format' = 'int-quantized' .*'pack-quantized'"),
    ({**compressed_tensors_config(), "format": "float-quantized"}, r"key 'format' = 'float-quantized'"),
    ({**compressed_tensors_config(), "quantization_status": "frozen"}, r"key 'quantization_status' = 'frozen'"),
    ({**compressed_tensors_config(), "kv_cache_scheme": {"num_bits": 8}}, r"key 'kv_cache_scheme'"),
    ({**compressed_tensors_config(), "config_groups": {}}, r"key 'config_groups' is empty"),
    (_group(num_bits=2), r"config_groups.group_0: key 'weights.num_bits' = 2 .*supported: 4, 8"),
    (_group(type="float", num_bits=8), r"key 'weights.type' = 'float'"),
    (_group(strategy="tensor"), r"key 'weights.strategy' = 'tensor' .*'group', 'channel'"),
    (_group(strategy="block", block_structure=[128, 128]), r"key 'weights.strategy' = 'block'"),
    (_group(actorder="group"), r"key 'weights.actorder' = 'group' \(activation-order"),
    (_group(dynamic=True), r"key 'weights.dynamic' = True"),
    (_group(group_size=None), r"key 'weights.group_size' = None"),
])
def test_ct_from_config_refuses_what_it_cannot_read(qconfig, message):
    with pytest.raises(FormatError, match=message) as info:
        CompressedTensorsFormat.from_config(qconfig, where="cfg.json")
    assert str(info.value).startswith("cfg.json")


def test_ct_from_config_refuses_activation_quantization():
    config = compressed_tensors_config()
    config["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int", "dynamic": True,
                                                              "strategy": "token"}
    with pytest.raises(FormatError, match=r"key 'input_activations' is set .*weight-only"):
        CompressedTensorsFormat.from_config(config, where="cfg.json")
