"""kinject.io.untouched: the untouched reference model, each parameter in its model class's dtype.

transformers 5.17 leaves some parameters of a pre-quantized checkpoint in their stored dtype (renamed
keys, dequantized MXFP4 experts), 5.24 casts them; the quantized-checkpoint tests
(tests/app/test_formats_cli.py, tests/io/test_stored_formats.py) load through it on both. Here the
cast itself: what it changes, and what it must leave.
"""

from __future__ import annotations

import torch

from kinject.io.untouched import cast_to_class_dtypes, load_untouched
from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer

GATE = "model.layers.0.mlp.gate.weight"


def test_a_float32_checkpoint_loads_unchanged(tmp_path):
    model = build_tiny_model("mixtral")
    model.save_pretrained(tmp_path)
    loaded = load_untouched(tmp_path, torch.float32)
    assert not loaded.training and {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert cast_to_class_dtypes(loaded, torch.float32) == []
    for name, p in model.named_parameters():
        assert torch.equal(loaded.get_parameter(name), p), name


def test_a_parameter_left_in_its_stored_dtype_is_cast_exactly_and_runs():
    """A bfloat16 router in a float32 model (5.17's load of an FP8 Mixtral): the forward raises; cast
    to float32 it gives the tokens of the float32 model holding the same (bfloat16-exact) values."""
    model, rounded = build_tiny_model("mixtral"), build_tiny_model("mixtral")
    with torch.no_grad():
        for layer in range(model.config.num_hidden_layers):
            name = f"model.layers.{layer}.mlp.gate.weight"
            model.get_parameter(name).data = model.get_parameter(name).data.to(torch.bfloat16)
            rounded.get_parameter(name).copy_(model.get_parameter(name).float())
    batch = tiny_batch(tiny_tokenizer(), 3)
    try:
        model(**batch)
    except RuntimeError as exc:
        assert "dtype" in str(exc)
    else:
        raise AssertionError("a bfloat16 router in a float32 model ran")
    cast = cast_to_class_dtypes(model, torch.float32)
    assert cast == [f"model.layers.{i}.mlp.gate.weight" for i in range(model.config.num_hidden_layers)]
    assert model.get_parameter(GATE).dtype == torch.float32
    gen = dict(max_new_tokens=4, do_sample=False)
    assert torch.equal(model.generate(**batch, **gen), rounded.generate(**batch, **gen))


def test_tied_weights_stay_tied_and_kept_float32_modules_stay():
    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16, tie_word_embeddings=True)
    embed, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert head.weight is embed.weight
    embed.weight.data = embed.weight.data.float()                       # left as stored
    model._keep_in_fp32_modules = ["mlp.gate"]                          # what transformers keeps on purpose
    model.get_parameter(GATE).data = model.get_parameter(GATE).data.float()
    assert cast_to_class_dtypes(model, torch.bfloat16) == ["model.embed_tokens.weight"]
    assert head.weight is embed.weight and embed.weight.dtype == torch.bfloat16
    assert model.get_parameter(GATE).dtype == torch.float32


def test_fp8_and_mxfp4_checkpoints_load_dequantized_whatever_the_machine(tmp_path):
    """A GPU present makes transformers keep FP8 / MXFP4 modules unless told to dequantize: the
    untouched model asks for ``dequantize=True`` for those formats and nothing for any other."""
    import json

    from kinject.io.untouched import dequantizing_config

    def config(qc):
        d = tmp_path / (qc or {}).get("quant_method", "plain")
        d.mkdir(exist_ok=True)
        (d / "config.json").write_text(json.dumps({"model_type": "mixtral", **({"quantization_config": qc} if qc else {})}))
        return d

    fp8 = dequantizing_config(config({"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic"}))
    assert fp8 is not None and fp8.dequantize and list(fp8.weight_block_size) == [128, 128]
    mx = dequantizing_config(config({"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn"]}))
    assert mx is not None and mx.dequantize and mx.modules_to_not_convert == ["model.layers.*.self_attn"]
    assert dequantizing_config(config({"quant_method": "compressed-tensors"})) is None
    assert dequantizing_config(config(None)) is None
