"""Quantize by rule: each encoder gives bit-identical storage tensors to the quantizer that makes the
shipped format (transformers' Fp8Quantize; compressed-tensors' INT4 and MXFP4 compressors), and the
shipped format's codec decodes them."""

import pytest
import torch

from kinject.engine.encode import ENCODERS, EncodeSpec, encode, parse_quant
from kinject.engine.quant import QuantError, QuantSpec

SHAPES = [(256, 256), (384, 128), (128, 512)]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def weight(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=g) * 0.05
    w[0, :32] = 0.0                                   # an all-zero group / block row
    w[1, 3] = 1.5                                     # an outlier
    return w.to(dtype)


def transformers_fp8(w, block):
    from types import SimpleNamespace

    from transformers.integrations.finegrained_fp8 import Fp8Quantize

    cfg = SimpleNamespace(weight_block_size=block, scale_fmt="float")
    out = Fp8Quantize(SimpleNamespace(quantization_config=cfg)).convert({"x.weight": w})
    return out["x.weight"], out["x.weight_scale_inv"]


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block", [[128, 128], [64, 128], "channel"])
def test_fp8_matches_transformers_quantizer(shape, dtype, block):
    w = weight(shape, dtype)
    parts, codec = encode(w, parse_quant({"format": "fp8", "block": block}))
    ref_w, ref_s = transformers_fp8(w, [1, shape[1]] if block == "channel" else block)
    assert parts["weight"].dtype == torch.float8_e4m3fn
    assert torch.equal(parts["weight"].view(torch.uint8), ref_w.view(torch.uint8))
    assert torch.equal(parts["weight_scale_inv"], ref_s)
    # one decode path: the shipped format's codec, as transformers dequantizes a release
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    ref = Fp8Dequantize(None)._dequantize_one(ref_w, ref_s, output_dtype=dtype)
    assert torch.equal(codec.dequantize(parts, dtype), ref)
    rel = (codec.dequantize(parts, torch.float32) - w.float()).norm() / w.float().norm()
    assert 0 < rel < 0.05


def ct_int(w, bits, group):
    from compressed_tensors.compressors.pack_quantized.base import (
        PackedQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    strategy = "group" if group else "channel"
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, strategy=strategy, group_size=group)
    g = group or w.shape[1]
    groups = w.reshape(w.shape[0], -1, g)
    scale, zp = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    out = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zp}, scheme)
    return out, args


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("group", [32, 128, None])
def test_int4_matches_compressed_tensors(shape, dtype, group):
    w = weight(shape, dtype, seed=1)
    parts, codec = encode(w, parse_quant({"format": "int4", "group_size": group}))
    ref, args = ct_int(w, 4, group)
    assert torch.equal(parts["weight_packed"], ref["weight_packed"])
    assert torch.equal(parts["weight_scale"], ref["weight_scale"]) and parts["weight_scale"].dtype == dtype
    assert parts["weight_shape"].tolist() == ref["weight_shape"].tolist()
    # the shipped format's decode (compressed-tensors' own dequantization, through kinject's codec)
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    q = unpack_from_int32(ref["weight_packed"], 4, torch.Size(shape))
    deq = dequantize(q, ref["weight_scale"], args=args)
    assert torch.equal(codec.dequantize(parts, dtype), deq.to(dtype))


def ct_mxfp4(w):
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs(num_bits=4, type="float", symmetric=True, strategy="group", group_size=32,
                            scale_dtype=torch.uint8)
    groups = w.reshape(w.shape[0], -1, 32)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return MXFP4PackedCompressor.compress({"weight": w, "weight_scale": scale}, scheme)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp4_matches_compressed_tensors(shape, dtype):
    w = weight(shape, dtype, seed=2)
    w[2, 32:64] = torch.tensor([1.75, 3.5, 2.5, 0.25, 5.0] * 6 + [0.75, 1.25], dtype=dtype)   # ties
    parts, codec = encode(w, parse_quant({"format": "mxfp4"}))
    ref = ct_mxfp4(w)
    rows, cols = shape
    assert torch.equal(parts["blocks"].reshape(rows, cols // 2), ref["weight_packed"])
    assert torch.equal(parts["scales"], ref["weight_scale"])
    from compressed_tensors.compressors.mxfp4.base import MXFP4PackedCompressor  # noqa: F401
    out = codec.dequantize(parts, torch.float32)
    assert out.shape == shape
    rel = (out - w.float()).norm() / w.float().norm()
    assert 0 < rel < 0.2


def test_mxfp4_codec_is_the_release_codec():
    """The rule's blocks decode through MXFP4Format (the gpt-oss release codec), transposed back."""
    from kinject.engine.formats.mxfp4 import MXFP4Format

    w = weight((64, 128), torch.bfloat16)
    parts, codec = encode(w, parse_quant({"format": "mxfp4"}))
    assert isinstance(codec.inner, MXFP4Format)
    assert torch.equal(codec.dequantize(parts, torch.bfloat16), MXFP4Format().dequantize(parts, torch.bfloat16).T)


def test_parse_quant_forms():
    assert parse_quant(None) is None
    assert parse_quant({"nbits": 4, "group_size": 64}) == QuantSpec(4, 64)
    assert parse_quant({"format": "hqq", "nbits": 2, "group_size": 32}) == QuantSpec(2, 32)
    spec = parse_quant({"format": "int4", "group_size": 32})
    assert isinstance(spec, EncodeSpec) and spec.options == {"group_size": 32, "symmetric": True}
    assert parse_quant(spec) is spec
    assert parse_quant({"format": "fp8"}).to_dict() == {"format": "fp8", "block": [128, 128]}
    assert set(ENCODERS) >= {"fp8", "int4", "mxfp4"}


@pytest.mark.parametrize("bad, message", [
    ({"format": "fp9"}, r"quant key 'format': 'fp9' is not a format kinject encodes; formats: hqq, "),
    ({"format": "fp8", "group_size": 32}, r"quant key 'group_size' is unknown for format 'fp8'"),
    ({"format": "fp8", "block": [128]}, r"quant key 'block'"),
    ({"format": "int4", "group_size": 0}, r"quant key 'group_size': 0"),
    ({"format": "int4", "symmetric": False}, r"quant key 'symmetric'"),
    ({"format": "hqq", "nbits": 5}, r"quant key 'nbits'"),
    ({"format": "mxfp4", "block": 32}, r"quant key 'block' is unknown for format 'mxfp4'"),
    ("fp8", r"quant: expected a mapping"),
])
def test_bad_quant_is_refused_naming_the_key(bad, message):
    with pytest.raises(QuantError, match=message):
        parse_quant(bad)


@pytest.mark.parametrize("spec, shape, message", [
    ({"format": "fp8", "block": [128, 128]}, (192, 256), r"fp8 with block \[128, 128\] needs rows divisible by 128"),
    ({"format": "int4", "group_size": 32}, (64, 48), r"int4 with group_size 32"),
    ({"format": "mxfp4"}, (64, 40), r"mxfp4 \(blocks of 32\)"),
])
def test_shape_the_format_cannot_hold_is_refused(spec, shape, message):
    with pytest.raises(QuantError, match=message):
        encode(torch.zeros(shape), parse_quant(spec))


def ct_nvfp4(w):
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16
    from compressed_tensors.quantization.utils.helpers import (
        calculate_qparams,
        generate_gparam,
    )

    args = NVFP4A16["weights"]                                   # the preset: e4m3 scales
    global_scale = generate_gparam(w.amin(), w.amax())
    groups = w.reshape(w.shape[0], -1, 16)
    scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), args, global_scale=global_scale)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    return NVFP4PackedCompressor.compress({"weight": w, "weight_scale": scale, "weight_global_scale": global_scale},
                                          scheme)


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_parts_match_compressed_tensors(shape, dtype):
    from kinject.engine.encode import nvfp4_parts

    w = weight(shape, dtype, seed=3)
    parts = nvfp4_parts(w)
    ref = ct_nvfp4(w)
    assert torch.equal(parts["weight_packed"], ref["weight_packed"])
    assert torch.equal(parts["weight_scale"].view(torch.uint8), ref["weight_scale"].view(torch.uint8))
    assert torch.equal(parts["weight_global_scale"], ref["weight_global_scale"])


def test_nvfp4_by_rule_decodes_with_the_compressed_tensors_fp4_codec():
    """Runs where the FP4 stored formats (``kinject.engine.formats.fp4``) are installed."""
    pytest.importorskip("kinject.engine.formats.fp4")
    from compressed_tensors.compressors.nvfp4.base import NVFP4PackedCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.quant_scheme import NVFP4A16

    w = weight((128, 256), torch.bfloat16, seed=4)
    parts, codec = encode(w, parse_quant({"format": "nvfp4"}))
    scheme = QuantizationScheme(targets=["Linear"], weights=NVFP4A16["weights"])
    ref = NVFP4PackedCompressor.decompress({**parts, "weight_shape": torch.tensor([128, 256])}, scheme)["weight"]
    assert torch.equal(codec.dequantize(parts, torch.bfloat16), ref.to(torch.bfloat16))
