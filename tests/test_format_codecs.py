"""Stored-format codecs (MXFP4, compressed-tensors) against transformers' own dequantizing load.

Each writer in :mod:`kinject.io.quantized_writers` makes a tiny checkpoint in a release's on-disk
layout; transformers' CPU ``from_pretrained`` dequantizes it, and the codec, given one expert's
storage tensors as the checkpoint holds them, must produce that parameter bit for bit. Each test
also checks the reference differs from the float original, so quantization really happened.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from kinject.engine.formats.mxfp4 import FormatError, Mxfp4Format
from kinject.errors import LoadError
from kinject.io.quantized_writers import quantize_mxfp4, save_mxfp4_checkpoint
from kinject.testing import build_tiny_model

PROJECTIONS = ("gate_up_proj", "down_proj")


def _load_reference(path: Path):
    """transformers' own load of ``path`` on the CPU (it dequantizes every stored format)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path)


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


_ST_DTYPES = {"U8": "uint8", "I8": "int8", "I32": "int32", "BF16": "bfloat16", "F16": "float16", "F32": "float32"}


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
    assert _config(path)["quantization_config"] == {
        "quant_method": "mxfp4",
        "modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                   "model.embed_tokens", "lm_head"],
    }


def test_mxfp4_dequantize_per_expert_is_transformers_load(gpt_oss_mxfp4):
    model, path, reference = gpt_oss_mxfp4
    codec = Mxfp4Format.from_config(_config(path)["quantization_config"], where=str(path))
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


def test_mxfp4_dequantize_in_float32_is_transformers_load(tmp_path):
    """A float32 checkpoint dequantizes to float32 (transformers uses the parameter's dtype)."""
    model = build_tiny_model("gpt_oss", num_hidden_layers=1)
    path = save_mxfp4_checkpoint(model, tmp_path)
    reference = _load_reference(path)
    codec = Mxfp4Format.from_config(_config(path)["quantization_config"], where=str(path))
    name = "model.layers.0.mlp.experts.down_proj"
    loaded = reference.get_parameter(name).detach()
    assert loaded.dtype == torch.float32
    stored = _stored(path, codec.storage_keys(name))
    assert _bitwise_equal(codec.dequantize({k: t[3] for k, t in stored.items()}, torch.float32), loaded[3])


def test_mxfp4_modules_to_not_convert_stay_float_as_transformers_reads_them(tmp_path):
    model = build_tiny_model("gpt_oss", dtype=torch.bfloat16)
    skip = ("model.layers.1.mlp.experts",)
    path = save_mxfp4_checkpoint(model, tmp_path, modules_to_not_convert=skip)
    codec = Mxfp4Format.from_config(_config(path)["quantization_config"], where=str(path))
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
    codec = Mxfp4Format()
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
    assert Mxfp4Format().dequantize(stored, torch.float32).equal(weight)


def test_mxfp4_storage_bytes_per_expert_at_most_028_of_bf16(gpt_oss_mxfp4):
    model, path, _ = gpt_oss_mxfp4
    codec = Mxfp4Format.from_config(_config(path)["quantization_config"], where=str(path))
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
     r"gate_up_proj_blocks: dtype int8, MXFP4 blocks are uint8"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 2), torch.float32)}, (8, 64, 64),
     r"gate_up_proj_scales: dtype float32"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 1), torch.uint8)}, (8, 64, 64),
     r"gate_up_proj_scales: shape \[8, 64, 1\] does not fit .*gate_up_proj_blocks \[8, 64, 2, 16\]"),
    ({"blocks": ((8, 64, 2, 8), torch.uint8), "scales": ((8, 64, 2), torch.uint8)}, (8, 64, 64),
     r"gate_up_proj_blocks: shape \[8, 64, 2, 8\], expected \[\.\.\., rows, n_blocks, 16\]"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 2), torch.uint8)}, (8, 64, 32),
     r"dequantizes to \[8, 64, 64\], but model.layers.0.mlp.experts.gate_up_proj is \[8, 64, 32\]"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8), "scales": ((8, 64, 2), torch.uint8)}, (64, 8, 64),
     r"dequantizes to \[8, 64, 64\]"),
    ({"blocks": ((8, 64, 2, 16), torch.uint8)}, (8, 64, 64), r"gate_up_proj_scales is missing"),
])
def test_mxfp4_check_names_the_tensor_that_does_not_fit(parts, shape, message):
    with pytest.raises(FormatError, match=message):
        Mxfp4Format().check(GATE_UP, parts, shape)


@pytest.mark.parametrize("qconfig, message", [
    ({"quant_method": "mxfp4", "block_size": 16}, r"cfg.json: key 'block_size' .* not supported .*supported keys"),
    ({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"}, r"cfg.json: key 'modules_to_not_convert'"),
    ({"quant_method": "fp8"}, r"cfg.json: quant_method 'fp8' is not 'mxfp4'"),
])
def test_mxfp4_from_config_refuses_what_it_cannot_read(qconfig, message):
    with pytest.raises(FormatError, match=message) as info:
        Mxfp4Format.from_config(qconfig, where="cfg.json")
    assert isinstance(info.value, LoadError)
