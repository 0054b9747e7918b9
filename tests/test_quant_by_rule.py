"""Quantize by rule through optimize / from_pretrained: stored formats chosen per module by rules,
held and moved as stored, decoded by the shipped format's codec; bad settings refused up front."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

import kinject
from kinject.engine.encode import encode, parse_quant
from kinject.engine.formats.base import FormatError
from kinject.errors import RuleError
from kinject.testing import (
    build_tiny_model,
    save_tiny_model,
    tiny_batch,
    tiny_tokenizer,
)

FORMATS = ["{format: fp8, block: [32, 32]}", "{format: fp8, block: channel}", "{format: int4, group_size: 32}",
           "{format: mxfp4}", "{format: nvfp4}"]


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def _generate(model, tok, batch):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**batch, max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits[batch["attention_mask"].bool()]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
@pytest.mark.parametrize("quant", FORMATS)
def test_format_by_rule_runs_and_moves_stored_bytes(family, quant, tok, tmp_path):
    model = build_tiny_model(family)
    batch = tiny_batch(tok, 5, min_tokens=12)                 # 5 sequences: not a multiple of the micro-batch
    ref = _logits(model, batch)
    twin = copy.deepcopy(model)
    kinject.optimize(model, "rules/klotski.yaml", [f"vars.quant={quant}", f"pipeline.offload_dir={tmp_path}"])
    try:
        store = model.kinject.store
        units = [u for u in store.units.values() if u.quant]
        assert units and any(".self_attn" in u.name for u in units) and any("experts" in u.name for u in units)
        spec = parse_quant(kinject.rules.load_rules("rules/klotski.yaml", [f"vars.quant={quant}"])
                           .rules[0].kwargs["quant"])
        for u in units:
            for role, (shape, dtype, codec) in u.quant.items():
                parts = {k[len(role) + 1:]: t for k, t in u.tensors.items() if k.startswith(role + ".")}
                # the unit holds what the encoder makes of a weight of that shape, nothing else
                layout, _ = encode(torch.zeros(shape, dtype=dtype), spec)
                assert {k: (t.shape, t.dtype) for k, t in parts.items()} == \
                    {k: (t.shape, t.dtype) for k, t in layout.items()}
                assert codec.assemble(parts, dtype).shape == torch.Size(shape)
            assert u.wire_nbytes == sum(t.numel() * t.element_size() for t in u.tensors.values())
        wire = sum(u.wire_nbytes for u in units)
        logical = sum(u.nbytes - u.wire_nbytes for u in units)
        assert wire / logical < (0.3 if "fp8" in quant else 0.2)          # float32 model: fp8 ~1/4, 4-bit ~1/7
        assert store.summary()["tier_bytes"]["host"] == sum(u.wire_nbytes for u in store.units.values()
                                                             if u.tier == "host")
        # the untouched model with each stored weight replaced by its decoded value gives the logits
        # (so the operators compute with exactly the decoded weights), and greedy tokens
        for u in units:
            module, _, expert = u.name.partition("[")
            for role, (_, dtype, codec) in u.quant.items():
                parts = {k[len(role) + 1:]: t for k, t in u.tensors.items() if k.startswith(role + ".")}
                param = twin.get_parameter(f"{module}.{role}")
                (param.data[int(expert[:-1])] if expert else param.data).copy_(codec.assemble(parts, dtype))
        got = _logits(model, batch)
        torch.testing.assert_close(got, _logits(twin, batch), rtol=1e-4, atol=1e-5)
        assert 0 < ((got - ref).norm() / ref.norm()).item() < 0.6      # lossy, but not noise
        assert torch.equal(_generate(model, tok, batch), _generate(twin, tok, batch))
    finally:
        kinject.restore(model)


def test_optimize_and_from_pretrained_store_the_same_tensors(tmp_path, tok):
    path = save_tiny_model("mixtral", tmp_path / "ckpt")
    sets = ["vars.quant={format: int4, group_size: 32}", f"pipeline.offload_dir={tmp_path / 'off'}"]
    from transformers import AutoModelForCausalLM

    mem = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    kinject.optimize(mem, "rules/klotski.yaml", sets)
    loaded = kinject.from_pretrained(path, "rules/klotski.yaml", sets, dtype=torch.float32)
    try:
        a, b = mem.kinject.store.units, loaded.kinject.store.units
        assert sorted(a) == sorted(b)
        for name in a:
            assert sorted(a[name].tensors) == sorted(b[name].tensors)
            for k in a[name].tensors:
                assert torch.equal(a[name].tensors[k], b[name].tensors[k]), (name, k)
        batch = tiny_batch(tok, 3, min_tokens=10)
        assert torch.equal(_generate(mem, tok, batch), _generate(loaded, tok, batch))
    finally:
        mem.kinject.transfer.close()
        loaded.kinject.transfer.close()


def test_disk_tier_gives_the_host_tier_logits(tmp_path, tok):
    model = build_tiny_model("mixtral")
    batch = tiny_batch(tok, 3, min_tokens=10)
    quant = "vars.quant={format: fp8, block: channel}"
    kinject.optimize(model, "rules/klotski.yaml", [quant, f"pipeline.offload_dir={tmp_path}"])
    host = _logits(model, batch)
    kinject.restore(model)
    kinject.optimize(model, "rules/klotski.yaml", [quant, "vars.weights=disk", f"pipeline.offload_dir={tmp_path}"])
    try:
        assert {u.tier for u in model.kinject.store.units.values() if u.quant} == {"disk"}
        assert torch.equal(_logits(model, batch), host)
    finally:
        kinject.restore(model)


def test_mixed_precision_rules_pick_a_format_per_layer(tmp_path):
    from kinject.engine.encode import Transposed
    from kinject.engine.formats.fp8 import FP8Format
    from kinject.fixtures import tiny_moe_path

    model = kinject.from_pretrained(tiny_moe_path(), "rules/mixed_precision.yaml",
                                    [f"pipeline.offload_dir={tmp_path}"], dtype=torch.bfloat16)
    try:
        formats = {}
        for u in model.kinject.store.units.values():
            layer = u.layer
            kinds = {type(c).__name__ for _, _, c in (u.quant or {}).values()} or {"bf16"}
            formats.setdefault(("experts" if "experts" in u.name else "attention", layer), set()).update(kinds)
        for layer in range(6):
            want = FP8Format.__name__ if layer < 2 else Transposed.__name__
            assert formats[("experts", layer)] == {want}, (layer, formats)
            assert formats[("attention", layer)] == {"bf16"}
    finally:
        model.kinject.transfer.close()


@pytest.mark.parametrize("override, message", [
    ("vars.quant={format: fp9}", r"quant key 'format': 'fp9' is not a format kinject encodes"),
    ("vars.quant={format: int4, groupsize: 32}", r"quant key 'groupsize' is unknown for format 'int4'"),
    ("vars.quant={format: fp8, block: [128, 0]}", r"quant key 'block'"),
    ("vars.quant={bits: 4}", r"quant key 'bits' is unknown"),
])
def test_wrong_quant_is_a_rule_error_with_file_line_and_key(override, message):
    model = build_tiny_model("mixtral")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuleError, match=r"klotski\.yaml:\d+, rule \d+, key 'replace\.kwargs\.quant': .*" + message):
        kinject.optimize(model, "rules/klotski.yaml", [override])
    assert getattr(model, "kinject", None) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


def test_shape_the_format_cannot_hold_leaves_the_model_unchanged():
    model = build_tiny_model("mixtral")             # hidden 64: no 128 x 128 block fits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(kinject.errors.KinjectError, match=r"fp8 with block \[128, 128\] needs rows divisible by 128"):
        kinject.optimize(model, "rules/klotski.yaml", ["vars.quant={format: fp8}"])
    assert getattr(model, "kinject", None) is None
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.parametrize("quant", ["{format: int4, group_size: 32}", "{format: hqq, nbits: 4, group_size: 64}"])
def test_quantizing_a_quantized_checkpoint_is_refused(quant, tmp_path):
    from kinject.io.quantized_writers import save_fp8_checkpoint

    model = build_tiny_model("qwen3_moe", dtype=torch.bfloat16)
    path = save_fp8_checkpoint(model, tmp_path / "fp8", block=(32, 32))
    with pytest.raises(FormatError, match=r"already quantized .*does not quantize twice"):
        kinject.from_pretrained(path, "rules/klotski.yaml", [f"vars.quant={quant}"])


def test_per_expert_formats_by_regex(tok, tmp_path):
    from kinject.engine.formats.compressed_tensors import CompressedTensorsFormat
    from kinject.engine.formats.fp8 import FP8Format

    model = build_tiny_model("mixtral")
    batch = tiny_batch(tok, 3, min_tokens=10)
    twin = copy.deepcopy(model)
    quant = "{per_expert: {'[0-3]': {format: fp8, block: channel}, '[4-6]': {format: int4, group_size: 32}}}"
    kinject.optimize(model, "rules/klotski.yaml", [f"vars.experts_quant={quant}", f"pipeline.offload_dir={tmp_path}"])
    try:
        units = model.kinject.store.units
        for name, u in units.items():
            if "experts[" not in name:
                assert not u.quant, name                       # attention and the rest: untouched
                continue
            e = int(name.rpartition("[")[2][:-1])
            kinds = {type(c) for _, _, c in (u.quant or {}).values()}
            assert kinds == ({FP8Format} if e <= 3 else {CompressedTensorsFormat} if e <= 6 else set()), name
            module = name.partition("[")[0]
            for role, (_, dtype, codec) in (u.quant or {}).items():
                parts = {k[len(role) + 1:]: t for k, t in u.tensors.items() if k.startswith(role + ".")}
                twin.get_parameter(f"{module}.{role}").data[e].copy_(codec.assemble(parts, dtype))
        torch.testing.assert_close(_logits(model, batch), _logits(twin, batch), rtol=1e-4, atol=1e-5)
    finally:
        kinject.restore(model)


def test_per_expert_is_only_for_experts():
    model = build_tiny_model("mixtral")
    with pytest.raises(RuleError, match=r"key 'replace\.kwargs\.quant'.*'per_expert' is only for experts operators"):
        kinject.optimize(model, "rules/klotski.yaml", ["vars.attention_quant={per_expert: {'.*': {format: fp8}}}"])
    with pytest.raises(RuleError, match=r"per_expert' '\[0-3\]': quant key 'format': 'fp7'"):
        kinject.optimize(model, "rules/klotski.yaml", ["vars.experts_quant={per_expert: {'[0-3]': {format: fp7}}}"])
