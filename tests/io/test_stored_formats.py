"""Checkpoints released quantized (fine-grained FP8) load by rules, stay low-bit in every tier and
give transformers' own tokens; every unsupported or malformed quantized checkpoint is a located
error before any weight is read (kinject.engine.formats, kinject.io.checkpoint, kinject.engine.store).

Checkpoints are written in the releases' layout (per-expert 2-D FP8 keys + ``weight_scale_inv``,
``quantization_config: {quant_method: fp8, weight_block_size: ...}``) by
:func:`kinject.testing.save_tiny_fp8_model`; the reference is transformers' ``from_pretrained`` of
the same directory (on a CPU it dequantizes with its ``Fp8Dequantize``).
"""

from __future__ import annotations

import json
import warnings

import pytest
import torch
from safetensors.torch import load_file, save_file

import kinject
from kinject import testing
from kinject.engine.formats import FORMATS, FormatError, format_for
from kinject.errors import InjectionError
from kinject.families import build_tiny_family_model

RULES = "rules/klotski.yaml"
GEN = dict(max_new_tokens=6, do_sample=False)
# family -> writer settings: several blocks per weight (one file); one partial block per weight
# (deepseek_v3: MLA, dense layer 0, shared expert; sharded, with an index); a mixed-attention model (qwen3_next:
# gated-delta-net layer 0 with its in_proj_qkvz / out_proj in FP8, in_proj_ba float; attention layer 1;
# shared expert; expert intermediate 48, so blocks of 16)
CASES = {"qwen3_moe": dict(block=(32, 32)), "deepseek_v3": dict(block=(128, 128), max_shard_size="100KB"),
         "qwen3_next": dict(block=(16, 16))}


def _reference(path) -> torch.nn.Module:
    """transformers' own load of a quantized checkpoint, dequantized at load (with or without a GPU:
    :func:`kinject.io.untouched.dequantizing_config`), each parameter in its class's dtype
    (:func:`kinject.io.untouched.load_untouched`: transformers 5.17 leaves dequantized MXFP4 experts
    in bfloat16 in this float32 model, 5.24 gives them float32; the values are the same, as every
    MXFP4 value is exact in bfloat16)."""
    from kinject.io.untouched import load_untouched

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return load_untouched(path, torch.float32)


@pytest.fixture(scope="module")
def batch():
    return testing.tiny_batch(testing.tiny_tokenizer(), 8)    # 8 sequences: klotski's micro-batches of 2


@pytest.fixture(scope="module")
def fp8(tmp_path_factory, batch):
    """family -> (checkpoint dir, transformers' tokens); checked to differ from the unquantized model's."""
    out = {}
    for family, settings in CASES.items():
        path = testing.save_tiny_fp8_model(family, tmp_path_factory.mktemp(family), build=build_tiny_family_model,
                                           **settings)
        tokens = _reference(path).generate(**batch, **GEN)
        original = build_tiny_family_model(family).generate(**batch, **GEN)
        assert not torch.equal(tokens, original), "FP8 rounding changed no token: the test could not tell"
        out[family] = path, tokens
    return out


def _copy(path, tmp_path):
    """A copy of checkpoint ``path`` to break (config and tensors as dicts)."""
    dst = tmp_path / "broken"
    dst.mkdir()
    for f in path.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _edit_tensors(path, fn) -> None:
    file = path / "model.safetensors"
    tensors = load_file(str(file))
    fn(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


def _edit_config(path, **quantization) -> None:
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"].update(quantization)
    (path / "config.json").write_text(json.dumps(config))


# ---- identical tokens, low-bit units --------------------------------------------------------


@pytest.mark.parametrize("family", list(CASES))
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_fp8_tokens_identical_to_transformers(fp8, batch, family, tier, tmp_path):
    path, reference = fp8[family]
    model = kinject.from_pretrained(path, RULES, [f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}"])
    assert model.kinject.rules.pipeline.micro_batch_size < batch["input_ids"].shape[0]
    assert torch.equal(model.generate(**batch, **GEN), reference)
    assert model.kinject.store.stats["loads"] > 0


@pytest.mark.parametrize("family", list(CASES))
def test_fp8_units_hold_and_move_storage_bytes(fp8, family):
    """Every offloaded unit holds float8 values + float32 scales: its bytes per load are the
    checkpoint's bytes for it, <= 0.52x of the same weights in bf16."""
    path, _ = fp8[family]
    model = kinject.from_pretrained(path, RULES, ["vars.experts=disk"])
    units = [u for u in model.kinject.store.units.values() if u.offloaded]
    experts = [u for u in units if "experts[" in u.name]
    assert experts and all(u.tier == "disk" for u in experts)
    for unit in units:
        if unit.quant is None:     # routers, Qwen's shared_expert_gate: not quantized in FP8 releases
            assert unit.name.endswith((".gate", ".shared_expert_gate")), unit.name
            continue
        stored = {k: src for k, src in unit.tensors.items() if k.startswith(tuple(f"{r}." for r in unit.quant))}
        values = {k: src for k, src in stored.items() if k.endswith(".weight")}
        scales = {k: src for k, src in stored.items() if k.endswith(".weight_scale_inv")}
        assert values and len(values) == len(scales), unit.name
        assert {src.dtype for src in values.values()} == {torch.float8_e4m3fn}
        assert {src.dtype for src in scales.values()} == {torch.float32}
        plain = sum(src.nbytes for k, src in unit.tensors.items() if k not in values and k not in scales)
        bf16 = sum(torch.Size(shape).numel() * 2 for shape, _, _ in unit.quant.values())
        assert unit.wire_nbytes == sum(s.nbytes for s in unit.tensors.values())
        assert unit.wire_nbytes - plain <= 0.52 * bf16, unit.name
    host = kinject.from_pretrained(path, RULES)       # experts in the host tier: float8 in host memory too
    unit = next(u for u in host.kinject.store.units.values() if "experts[" in u.name)
    assert unit.tier == "host" and {t.dtype for k, t in unit.tensors.items() if k.endswith(".weight")} == {torch.float8_e4m3fn}


def test_fp8_mixed_attention_checkpoint_layout(fp8):
    """The mixed-attention case's checkpoint is what it claims: per-expert keys, the gated-delta-net's
    in_proj_qkvz / out_proj stored FP8 with scales, its small in_proj_ba (beta/alpha) left float."""
    tensors = load_file(str(fp8["qwen3_next"][0] / "model.safetensors"))
    mixer = "model.layers.0.linear_attn."
    assert tensors["model.layers.0.mlp.experts.7.down_proj.weight"].dtype == torch.float8_e4m3fn
    for proj in ("in_proj_qkvz", "out_proj"):
        assert tensors[f"{mixer}{proj}.weight"].dtype == torch.float8_e4m3fn
        assert tensors[f"{mixer}{proj}.weight_scale_inv"].dtype == torch.float32
    assert tensors[f"{mixer}in_proj_ba.weight"].dtype == torch.float32 and f"{mixer}in_proj_ba.weight_scale_inv" not in tensors


def test_fp8_per_channel_scales(batch, tmp_path):
    """weight_block_size null, one scale per row (the per-channel variant transformers also reads)."""
    path = testing.save_tiny_fp8_model("qwen3_moe", tmp_path / "ckpt", block=None)
    assert load_file(str(path / "model.safetensors"))[EXPERT + "_scale_inv"].shape == (32, 1)
    reference = _reference(path).generate(**batch, **GEN)
    model = kinject.from_pretrained(path, RULES, ["vars.experts=disk"])
    assert torch.equal(model.generate(**batch, **GEN), reference)


def test_optimize_a_model_transformers_dequantized(fp8, batch):
    """On a CPU transformers dequantizes at load: kinject.optimize wraps that model as any other."""
    path, reference = fp8["qwen3_moe"]
    model = kinject.optimize(_reference(path), RULES)
    assert torch.equal(model.generate(**batch, **GEN), reference)


def test_optimize_refuses_transformers_fp8_modules():
    """A model transformers keeps quantized (FP8Linear / FP8Experts, as on a GPU): a clear error
    pointing at kinject.from_pretrained, model unchanged."""
    from transformers import FineGrainedFP8Config
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = testing.build_tiny_model("qwen3_moe")
    replace_with_fp8_linear(model, ["lm_head"], FineGrainedFP8Config(), pre_quantized=True)
    before = dict(model.named_modules())
    with pytest.raises(InjectionError, match=r"kinject\.from_pretrained.*model left unchanged"):
        kinject.optimize(model, RULES)
    assert dict(model.named_modules()) == before and getattr(model, "kinject", None) is None


# ---- the format chain ------------------------------------------------------------------------


def test_format_chain():
    assert format_for(None, where="c.json") is None
    assert FORMATS[0].method == "fp8"
    fmt = format_for({"quant_method": "fp8", "weight_block_size": [128, 128]}, where="c.json")
    assert fmt.storage_keys("model.layers.0.mlp.experts.3.gate_proj.weight") == {
        "weight": "model.layers.0.mlp.experts.3.gate_proj.weight",
        "weight_scale_inv": "model.layers.0.mlp.experts.3.gate_proj.weight_scale_inv"}
    skip = format_for({"quant_method": "fp8", "modules_to_not_convert": ["model.layers.0.self_attn"]}, where="c")
    assert skip.storage_keys("model.layers.0.self_attn.q_proj.weight") is None
    assert skip.storage_keys("model.layers.1.self_attn.q_proj.weight") is not None
    for bad, key in (({"quant_method": "fp8", "expert_dtype": "fp4"}, "expert_dtype"),
                     ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size"),
                     ({"quant_method": "fp8", "modules_to_convert": ["embed_tokens"]}, "modules_to_convert")):
        with pytest.raises(FormatError, match=rf"c\.json: quantization_config\.{key}"):
            format_for(bad, where="c.json")


def test_fp8_partial_blocks_transformers_would_misread_are_refused():
    """192 rows in blocks of 128 leave a partial block; transformers' dequantization derives the
    block from the scale grid (2 blocks of 96) and would scale 32 rows with the wrong scale."""
    fmt = format_for({"quant_method": "fp8", "weight_block_size": [128, 128]}, where="c")
    parts = {"weight": ((192, 64), torch.float8_e4m3fn), "weight_scale_inv": ((2, 1), torch.float32)}
    with pytest.raises(FormatError, match=r"tensor 'w': 192 rows in blocks of 128 leave a partial block"):
        fmt.check("w", parts, (192, 64))
    fmt.check("w", {**parts, "weight": ((256, 64), torch.float8_e4m3fn)}, (256, 64))    # whole blocks: fine


def test_fp8_dequantize_matches_the_writer():
    """values * block scale, blockwise: the codec rebuilds what quantize_fp8 stored (to fp8 rounding)."""
    w = torch.randn(64, 96)
    values, scale = testing.quantize_fp8(w, (32, 32))
    assert values.dtype == torch.float8_e4m3fn and scale.shape == (2, 3)
    fmt = format_for({"quant_method": "fp8", "weight_block_size": [32, 32]}, where="c")
    fmt.check("w", {"weight": (values.shape, values.dtype), "weight_scale_inv": (scale.shape, scale.dtype)}, w.shape)
    out = fmt.dequantize({"weight": values, "weight_scale_inv": scale}, torch.float32)
    by_block = values.float().reshape(2, 32, 3, 32) * scale[:, None, :, None]          # [2, 32, 3, 32]
    assert torch.equal(out, by_block.reshape(64, 96))
    assert (out - w).abs().max() <= w.abs().max() / 8


# ---- every malformed quantized checkpoint: a located error before any read --------------------


@pytest.mark.parametrize("method", ["gptq", "awq", "bitsandbytes", "gguf", "hqq"])
def test_unsupported_quant_method(fp8, tmp_path, nothing_read, method):
    path = _copy(fp8["qwen3_moe"][0], tmp_path)
    _edit_config(path, quant_method=method)
    with pytest.raises(FormatError, match=rf"config\.json: quantization_config\.quant_method '{method}' "
                                          r"is not supported by kinject \(supported: fp8"):
        kinject.from_pretrained(path, RULES)


EXPERT = "model.layers.0.mlp.experts.3.gate_proj.weight"


def _breakages():
    def wrong_scale(t):
        t[EXPERT + "_scale_inv"] = torch.ones(3, 3)

    def no_scale(t):
        del t[EXPERT + "_scale_inv"]

    def stray_scale(t):
        t["model.layers.0.mlp.experts.3.fc_proj.weight_scale_inv"] = torch.ones(1, 1)

    def scale_dtype(t):
        t[EXPERT + "_scale_inv"] = t[EXPERT + "_scale_inv"].to(torch.bfloat16).view(torch.int16)

    return {
        "scale shape": (wrong_scale, rf"tensor '{EXPERT}': scale has shape \[3, 3\].*expected \[1, 2\]"),
        "no scale": (no_scale, rf"tensor 'model\.layers\.0\.mlp\.experts\.gate_up_proj'.*'{EXPERT}'.*F8_E4M3 "
                               r"values without the scales"),
        "scale without values": (stray_scale, r"key 'model\.layers\.0\.mlp\.experts\.3\.fc_proj\.weight_scale_inv' .* "
                                              r"is part of tensor '.*fc_proj\.weight' stored fp8.*, but "
                                              r"'model\.layers\.0\.mlp\.experts\.3\.fc_proj\.weight' is not in "
                                              r"the checkpoint"),
        "scale dtype": (scale_dtype, rf"tensor '{EXPERT}': scale stored as torch\.int16, expected float32"),
    }


@pytest.mark.parametrize("case", list(_breakages()))
def test_malformed_fp8_checkpoint(fp8, tmp_path, nothing_read, case):
    edit, message = _breakages()[case]
    path = _copy(fp8["qwen3_moe"][0], tmp_path)
    _edit_tensors(path, edit)
    with pytest.raises(FormatError, match=message):
        kinject.from_pretrained(path, RULES)


def test_scale_of_a_module_the_config_does_not_convert(fp8, tmp_path, nothing_read):
    """modules_to_not_convert says q_proj is plain, the checkpoint quantized it: its scale is unused."""
    path = _copy(fp8["qwen3_moe"][0], tmp_path)
    _edit_config(path, modules_to_not_convert=["model.layers.1.self_attn.q_proj"])
    with pytest.raises(FormatError, match=r"'model\.layers\.1\.self_attn\.q_proj\.weight_scale_inv'"):
        kinject.from_pretrained(path, RULES)


def test_fp8_values_without_quantization_config(fp8, tmp_path, nothing_read):
    """A config without quantization_config cannot make kinject cast e4m3 values as weights."""
    path = _copy(fp8["qwen3_moe"][0], tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["quantization_config"]
    (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(FormatError, match=r"F8_E4M3 values but config\.json has no quantization_config"):
        kinject.from_pretrained(path, RULES)


def test_hqq_on_a_quantized_checkpoint_is_refused(fp8, nothing_read):
    with pytest.raises(FormatError, match=r"already quantized \(fp8.*does not quantize twice.*vars\.quant=null"):
        kinject.from_pretrained(fp8["qwen3_moe"][0], RULES, ["vars.quant={nbits: 4, group_size: 64}"])


# ---- accounting: storage bytes in the store, the reports and the planner -----------------------


def test_fp8_accounting_counts_storage_bytes(fp8, batch, tmp_path):
    """Bytes per expert load = the checkpoint's bytes for that expert (values + scales), in the
    store's counters, its tier summary and the planner's profile; the device budget counts what a
    unit holds while in use (stored + dequantized)."""
    from kinject.plan import profiler

    path, _ = fp8["qwen3_moe"]
    model = kinject.from_pretrained(path, RULES, ["vars.experts=disk", f"pipeline.offload_dir={tmp_path}",
                                                  "pipeline.emulate_bandwidth=1.0"])
    store = model.kinject.store
    store.reset_stats()
    model.generate(**batch, max_new_tokens=2, do_sample=False)
    disk = [u for u in store.units.values() if u.tier == "disk"]
    assert store.stats["bytes"]["disk"] == sum(u.loads * u.wire_nbytes for u in disk) > 0
    assert store.summary()["tier_bytes"]["disk"] == sum(u.wire_nbytes for u in disk)
    expert = store["model.layers.0.mlp.experts[0]"]
    assert expert.compute_nbytes == sum(torch.Size(s).numel() * 4 for s, _, _ in expert.quant.values())  # float32
    assert expert.nbytes == expert.wire_nbytes + expert.compute_nbytes
    assert expert.wire_nbytes <= 0.52 * expert.compute_nbytes / 2                                       # vs bf16
    prof = profiler.measure_profile(model, bs=2, decode_steps=2)
    assert (prof.expert_bytes, prof.expert_device_bytes) == (expert.wire_nbytes, expert.nbytes)
    assert prof.t_load_expert == pytest.approx(prof.expert_bytes / prof.bandwidth)


def test_hqq_is_a_stored_format_too():
    """HQQ (kinject quantizing at load) answers the same interface the store rebuilds units with."""
    from kinject.engine.quant import HQQFormat, QuantSpec, quantize

    w = torch.randn(16, 64)
    qt = quantize(w, QuantSpec(nbits=4, group_size=64, optimize=False))
    fmt = HQQFormat.from_config({"nbits": 4, "group_size": 64, "optimize": False, "shape": [16, 64]}, where="rule 2")
    parts = qt.tensors()
    assert fmt.storage_keys("w1") == {"packed": "w1.packed", "scale": "w1.scale", "zero": "w1.zero"}
    fmt.check("w1", {k: (t.shape, t.dtype) for k, t in parts.items()}, (16, 64))
    assert torch.equal(fmt.dequantize(parts, torch.float32), qt.dequantize())
    assert fmt.nbytes(parts) == qt.nbytes < w.numel() * 2 * 0.3
    with pytest.raises(FormatError, match=r"tensor 'w1': .*part 'packed'"):
        fmt.check("w1", {**{k: (t.shape, t.dtype) for k, t in parts.items()}, "packed": ((4, 64), torch.uint8)}, (16, 64))
    with pytest.raises(FormatError, match=r"rule 2: quant key 'nbits'"):
        HQQFormat.from_config({"nbits": 5, "shape": [16, 64]}, where="rule 2")


# ---- MXFP4 (gpt-oss): the same plumbing, another codec ----------------------------------------


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_mxfp4_gpt_oss_tokens_identical_to_transformers(batch, tier, tmp_path):
    """gpt-oss experts as gpt-oss-20b ships them (``*_blocks`` / ``*_scales``, no ``gate_up_proj`` key):
    identical greedy tokens to transformers' dequantizing load; each expert unit holds its slice of
    the blocks and scales (<= 0.28x bf16), read per expert."""

    from kinject.io.quantized_writers import save_mxfp4_checkpoint

    original = testing.build_tiny_model("gpt_oss")
    path = save_mxfp4_checkpoint(original, tmp_path / "ckpt", tokenizer=testing.tiny_tokenizer())
    reference = _reference(path).generate(**batch, **GEN)
    assert not torch.equal(reference, original.generate(**batch, **GEN))
    model = kinject.from_pretrained(path, RULES, [f"vars.experts={tier}", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    unit = model.kinject.store["model.layers.0.mlp.experts[0]"]
    assert unit.tier == tier and set(unit.stored) == {"gate_up_proj", "down_proj"}
    packed = {k: src for k, src in unit.tensors.items() if k.endswith((".blocks", ".scales"))}
    assert {src.dtype for src in packed.values()} == {torch.uint8}
    stored = sum(src.nbytes for src in packed.values())
    bf16 = sum(torch.Size(shape).numel() * 2 for shape, _, _ in unit.quant.values())
    assert stored <= 0.28 * bf16


# ---- compressed-tensors pack-quantized INT4 -------------------------------------------------------


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("tier", ["host", "disk"])
def test_compressed_tensors_int4_tokens_identical_to_transformers(batch, family, tier, tmp_path):
    """Per-expert ``weight_packed`` / ``weight_scale`` / ``weight_shape`` keys (no ``weight`` key, no
    model tensor of that name: its shape comes from the packed layout): Qwen3-MoE with experts and
    attention packed, DeepSeek-V3 with Kimi-K2-Thinking's scheme (routed experts only); identical
    greedy tokens to transformers' load (which needs the compressed-tensors package)."""
    pytest.importorskip("compressed_tensors")

    from kinject.io import quantized_writers as writers

    original = testing.build_tiny_model(family)
    ignore = {"ignore": writers.KIMI_K2_IGNORE} if family == "deepseek_v3" else {}
    path = writers.save_compressed_tensors_checkpoint(original, tmp_path / "ckpt", tokenizer=testing.tiny_tokenizer(),
                                                      num_bits=4, strategy="group", group_size=32, **ignore)
    reference = _reference(path).generate(**batch, **GEN)
    assert not torch.equal(reference, original.generate(**batch, **GEN))
    model = kinject.from_pretrained(path, RULES, [f"vars.weights={tier}", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    unit = next(u for name, u in model.kinject.store.units.items() if name.endswith("experts[0]"))
    assert {src.dtype for k, src in unit.tensors.items() if k.endswith(".weight_packed")} == {torch.int32}
    assert unit.wire_nbytes <= 0.33 * unit.compute_nbytes / 2          # group 32, float32 scales: 0.32x bf16


# ---- CUDA: the stored bytes cross the link, dequantized on the GPU ---------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_fp8_dequantized_on_the_device(fp8, batch):
    """Experts in pinned host memory as float8 + scales, copied as stored and dequantized on the GPU:
    the tokens of transformers' own dequantizing load on the same GPU."""
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    path, _ = fp8["deepseek_v3"]
    cuda_batch = {k: v.cuda() for k, v in batch.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref_model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                         quantization_config=FineGrainedFP8Config(dequantize=True)).cuda()
    try:
        reference = ref_model.generate(**cuda_batch, **GEN)
    except (RuntimeError, NotImplementedError):        # no float32 grouped_mm kernel: eager experts
        ref_model.set_experts_implementation("eager")
        reference = ref_model.generate(**cuda_batch, **GEN)
    model = kinject.from_pretrained(path, RULES, ["pipeline.device=cuda:0"])
    unit = model.kinject.store["model.layers.1.mlp.experts[0]"]
    values = [t for k, t in unit.tensors.items() if k.endswith(".weight")]
    assert unit.tier == "host" and all(t.is_pinned() and t.dtype == torch.float8_e4m3fn for t in values)
    assert torch.equal(model.generate(**cuda_batch, **GEN), reference)
    model.kinject.transfer.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_transformers_fp8_model_is_refused(fp8):
    """On a GPU transformers keeps FP8Linear modules: optimize refuses them, naming from_pretrained."""
    path, _ = fp8["qwen3_moe"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(path, device_map="cuda")
    if not any(p.dtype == torch.float8_e4m3fn for p in model.parameters()):
        pytest.skip("transformers dequantized the FP8 model on this GPU (compute capability < 8.9)")
    with pytest.raises(InjectionError, match=r"kinject\.from_pretrained"):
        kinject.optimize(model, RULES, ["pipeline.device=cuda:0"])


def test_fp8_experts_dequantize_into_one_workspace_and_compute_grouped(fp8, batch, monkeypatch):
    """FP8 experts in the host tier, dequantized together into one stacked workspace: every group
    of two or more experts computes in one grouped GEMM, tokens still transformers' own."""
    from helpers.expert_counts import count_backends

    path, reference = fp8["qwen3_moe"]
    seen = count_backends(monkeypatch)
    model = kinject.from_pretrained(path, RULES, ["vars.weights=host"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    assert seen["grouped"] and max(seen["grouped"]) > 1 and not seen["looped"], seen
