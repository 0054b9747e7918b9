"""FP4 checkpoints (NVFP4 and MXFP4 as compressed-tensors ships them, NVFP4 as NVIDIA ModelOpt
exports it) load by rules, stay packed in the host and disk tiers and give the tokens of their
reference dequantization (kinject.engine.formats.fp4, kinject.io.fp4_writers).

References: compressed-tensors' own decompression (``BaseCompressor.load_from_registry(format)
.decompress``) of every packed module, written as a float checkpoint that transformers loads
(:func:`kinject.io.fp4_writers.decompressed_checkpoint`: transformers 5.24's own load of the packed
checkpoint leaves the fused experts' parameters unfilled by their per-expert packed keys, and fails
in a float32 model on the bfloat16 weights it decompresses); for
ModelOpt, NVIDIA's documented formula ``e2m1 * (weight_scale * weight_scale_2)`` written out here.
"""

from __future__ import annotations

import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import kinject
from kinject import testing
from kinject.engine.formats import FormatError, format_for, fp4
from kinject.io.fp4_writers import (
    compressed_fp4_config,
    decompressed_checkpoint,
    save_compressed_fp4_checkpoint,
    save_modelopt_nvfp4_checkpoint,
)

pytest.importorskip("compressed_tensors")

RULES = "rules/klotski.yaml"
GEN = {"max_new_tokens": 6, "do_sample": False}
# NVIDIA's e2m1 code table (sign bit 3), as its NVFP4 documentation lists it
NVIDIA_E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]


@pytest.fixture(scope="module")
def batch():
    return testing.tiny_batch(testing.tiny_tokenizer(), 5)


@pytest.fixture(scope="module")
def original():
    return testing.build_tiny_model("qwen3_moe")


def _with_weights(path: Path, dst: Path, weights) -> Path:
    """A float copy of checkpoint ``path``: ``weights(tensors)`` gives module -> float weight for
    every packed module (the rest is kept), without the quantization config."""
    shutil.copytree(path, dst)
    tensors = load_file(str(path / "model.safetensors"))
    replaced = weights(tensors)
    out = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[0] not in replaced}
    out.update({f"{m}.weight": w for m, w in replaced.items()})
    save_file(out, str(dst / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config))
    (dst / "hf_quant_config.json").unlink(missing_ok=True)
    return dst


def _nvidia_formula(path: Path, dst: Path) -> Path:
    """ModelOpt NVFP4 by NVIDIA's formula, element by element from the bytes (independent of kinject)."""
    table = torch.tensor(NVIDIA_E2M1)

    def weights(tensors):
        out = {}
        for key in [k for k in tensors if k.endswith(".weight_scale_2")]:
            m = key[: -len(".weight_scale_2")]
            packed = tensors[f"{m}.weight"]
            codes = torch.empty(packed.shape[0], packed.shape[1] * 2, dtype=torch.long)
            codes[:, 0::2], codes[:, 1::2] = packed & 0xF, packed >> 4      # low nibble: even column
            scale = tensors[f"{m}.weight_scale"].float() * tensors[key].float()   # [out, in/16]
            out[m] = table[codes] * scale.repeat_interleave(16, dim=1)
        return out

    return _with_weights(path, dst, weights)


def _reference(path: Path, dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def _ratio(model) -> float:
    """Bytes an expert unit holds over its weights' bf16 bytes."""
    unit = next(u for name, u in model.kinject.store.units.items() if name.endswith("experts[0]"))
    return unit.wire_nbytes / sum(torch.Size(shape).numel() * 2 for shape, _, _ in unit.quant.values())


# ---- compressed-tensors nvfp4-pack-quantized / mxfp4-pack-quantized ------------------------------


@pytest.mark.parametrize("fmt", ["nvfp4-pack-quantized", "mxfp4-pack-quantized"])
@pytest.mark.parametrize("tier,dtype", [("host", torch.float32), ("disk", torch.bfloat16)])
def test_compressed_tensors_fp4_tokens_identical(original, batch, fmt, tier, dtype, tmp_path):
    path = save_compressed_fp4_checkpoint(original, tmp_path / "ckpt", fmt, tokenizer=testing.tiny_tokenizer())
    reference = _reference(decompressed_checkpoint(path, tmp_path / "float"), dtype).generate(**batch, **GEN)
    assert not torch.equal(reference, original.generate(**batch, **GEN))
    model = kinject.from_pretrained(path, RULES, [f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}"],
                                    dtype=dtype)
    assert torch.equal(model.generate(**batch, **GEN), reference)
    assert _ratio(model) <= 0.30


@pytest.mark.parametrize("fmt", ["nvfp4-pack-quantized", "mxfp4-pack-quantized"])
@pytest.mark.parametrize("lead", [(), (3,)])                          # one weight; three experts stacked
def test_fp4_dequantize_is_compressed_tensors_decompression(fmt, lead):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig

    qconfig = compressed_fp4_config(fmt)
    codec = format_for(qconfig, where="config.json")
    scheme = next(iter(QuantizationConfig.model_validate(qconfig).config_groups.values()))
    compressor = BaseCompressor.load_from_registry(fmt)
    torch.manual_seed(len(lead))
    weights = torch.randn(*lead, 24, 96) * torch.logspace(-3, 1, 96)
    encode = fp4.quantize_nvfp4 if fmt.startswith("nvfp4") else fp4.quantize_mxfp4_pack
    flat = [encode(w) for w in weights.reshape(-1, 24, 96)]
    want = torch.stack([compressor.decompress(parts, scheme)["weight"] for parts in flat]).reshape(*lead, 24, 96)
    stacked = {k: torch.stack([p[k] for p in flat]).reshape(*lead, *flat[0][k].shape) for k in flat[0]}
    got = codec.dequantize(stacked, torch.bfloat16)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    assert (got.float() - weights).abs().max() < weights.abs().max() / 2     # the encoder is a quantizer


def test_quantize_by_format_name():
    w = torch.randn(8, 64)
    assert set(fp4.quantize(w, "nvfp4-pack-quantized")) == {"weight_packed", "weight_scale", "weight_global_scale"}
    assert set(fp4.quantize(w, "modelopt-nvfp4")) == {"weight", "weight_scale", "weight_scale_2"}
    with pytest.raises(FormatError, match=r"mxfp4-pack-quantized: weight of shape \[8, 48\] is not 2-D with"):
        fp4.quantize(w[:, :48], "mxfp4-pack-quantized")
    with pytest.raises(FormatError, match=r"FP4 format 'int3' has no encoder"):
        fp4.quantize(w, "int3")


# ---- NVIDIA ModelOpt NVFP4 --------------------------------------------------------------------


@pytest.mark.parametrize("tier,in_config", [("host", False), ("disk", True)])
def test_modelopt_nvfp4_tokens_identical_to_nvidia_formula(original, batch, tier, in_config, tmp_path):
    """Per-expert ``weight`` (uint8) / ``weight_scale`` (e4m3) / ``weight_scale_2`` / ``input_scale``,
    the config in hf_quant_config.json (ModelOpt's export) or in config.json."""
    path = save_modelopt_nvfp4_checkpoint(original, tmp_path / "ckpt", tokenizer=testing.tiny_tokenizer(),
                                          in_config=in_config)
    assert (path / "hf_quant_config.json").is_file() != in_config
    reference = _reference(_nvidia_formula(path, tmp_path / "float"), torch.float32).generate(**batch, **GEN)
    assert not torch.equal(reference, original.generate(**batch, **GEN))
    model = kinject.from_pretrained(path, RULES, [f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    unit = next(u for name, u in model.kinject.store.units.items() if name.endswith("experts[0]"))
    assert {k.rsplit(".", 1)[1] for k in unit.tensors} == {"weight", "weight_scale", "weight_scale_2", "input_scale"}
    assert _ratio(model) <= 0.30


# ---- refusals, before any weight is read ------------------------------------------------------------


def _edit(path: Path, fn) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(file), metadata={"format": "pt"})


EXPERT = "model.layers.0.mlp.experts.3.down_proj"


@pytest.mark.parametrize("layout,edit,message", [
    ("nvfp4-pack-quantized", lambda t: t.__setitem__(f"{EXPERT}.weight_scale", t[f"{EXPERT}.weight_scale"][:, :-1]),
     rf"tensor '{EXPERT}.weight_scale': shape \[64, 1\] does not fit {EXPERT}.weight \(expected \[64, 2\]\)"),
    ("nvfp4-pack-quantized", lambda t: t.pop(f"{EXPERT}.weight_global_scale"),
     rf"'{EXPERT}.weight_packed' .* is part of tensor '{EXPERT}.weight' .*but '{EXPERT}.weight_global_scale' is not"),
    ("mxfp4-pack-quantized", lambda t: t.__setitem__(f"{EXPERT}.weight_scale", t[f"{EXPERT}.weight_scale"].float()),
     rf"tensor '{EXPERT}.weight_scale': dtype float32, expected uint8"),
    ("modelopt", lambda t: t.__setitem__(f"{EXPERT}.weight_scale", t[f"{EXPERT}.weight_scale"][:32]),
     rf"tensor '{EXPERT}.weight_scale': shape \[32, 2\] does not fit {EXPERT}.weight \(expected \[64, 2\]\)"),
    ("modelopt", lambda t: t.pop(f"{EXPERT}.weight_scale_2"),
     rf"is part of tensor '{EXPERT}.weight' stored modelopt NVFP4, but '{EXPERT}.weight_scale_2' is not"),
])
def test_malformed_fp4_checkpoints_are_refused(original, tmp_path, nothing_read, layout, edit, message):
    if layout == "modelopt":
        path = save_modelopt_nvfp4_checkpoint(original, tmp_path / "ckpt")
    else:
        path = save_compressed_fp4_checkpoint(original, tmp_path / "ckpt", layout)
    _edit(path, edit)
    with pytest.raises(FormatError, match=message):
        kinject.from_pretrained(path, RULES)


def test_fp4_configs_refused_naming_the_key():
    with pytest.raises(FormatError, match=r"quant_algo = 'FP8' is not supported for quant_method 'modelopt'"):
        format_for({"quant_method": "modelopt", "quant_algo": "FP8"}, where="hf_quant_config.json")
    qconfig = compressed_fp4_config("nvfp4-pack-quantized")
    qconfig["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "float"}
    with pytest.raises(FormatError, match=r"config_groups.group_0: key 'input_activations' = .*only FP4 activation"):
        format_for(qconfig, where="config.json")


def test_nvfp4_w4a4_release_reads_its_weights(original, batch, tmp_path):
    """An NVFP4 (W4A4) release, each Linear with its ``input_global_scale``: the weights are
    compressed-tensors' decompression, the activations stay in the model dtype (as weight-only FP4
    kernels run these releases); the input scales are kept as parts, never read."""
    path = save_compressed_fp4_checkpoint(original, tmp_path / "ckpt", "nvfp4-pack-quantized", activations=True,
                                          tokenizer=testing.tiny_tokenizer())
    config = json.loads((path / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["input_activations"]["num_bits"] == 4
    reference = _reference(decompressed_checkpoint(path, tmp_path / "float"), torch.float32).generate(**batch, **GEN)
    model = kinject.from_pretrained(path, RULES, ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    unit = next(u for name, u in model.kinject.store.units.items() if name.endswith("experts[0]"))
    assert any(k.endswith(".input_global_scale") for k in unit.tensors)
