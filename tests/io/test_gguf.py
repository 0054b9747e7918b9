"""GGUF checkpoints load by rules, stay in their GGML blocks in the host and disk tiers and give
transformers' own tokens; every GGUF kinject cannot read exactly is a located error before any
tensor is read (kinject.io.gguf, kinject.engine.formats.ggml / gguf).

Files are written by :func:`kinject.io.gguf_writers.save_gguf` with llama.cpp's tensor names and
metadata keys; the reference is transformers' ``from_pretrained(dir, gguf_file=...)`` of the same
file, or, where transformers' metadata mapping is wrong (it ignores ``expert_feed_forward_length``),
the transformers model class built from the file's complete metadata with the tensors transformers'
GGUF loader dequantizes with gguf-py (``load_gguf_checkpoint``). For gpt-oss, whose experts
transformers' GGUF map gets wrong, it is the transformers model class with gguf-py's own
dequantization of the file, mapped in the test as llama.cpp's converter wrote it.
"""

from __future__ import annotations

import sys
import warnings

import numpy as np
import pytest
import torch

import kinject
from kinject import testing
from kinject.engine.formats import ggml
from kinject.engine.formats.base import FormatError
from kinject.errors import LoadError

gguf = pytest.importorskip("gguf")

from kinject.io import gguf as gguf_io  # noqa: E402 (needs the gguf package the skip checks)
from kinject.io.gguf_writers import save_gguf  # noqa: E402

RULES = "rules/klotski.yaml"
GEN = {"max_new_tokens": 6, "do_sample": False}
# transformers 5.24 reads no expert width from a Qwen-MoE GGUF and keeps its default (768 for
# qwen3_moe): files transformers itself loads right have that width
HF_WIDTH = 768


def _model(family: str = "qwen3_moe", seed: int = 0, **overrides):
    from transformers import AutoModelForCausalLM

    config = testing.tiny_config(family, hidden_size=256, **overrides)   # K-quant rows: 256 values
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).eval()


def _transformers(path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()


def _model_class_reference(path) -> torch.nn.Module:
    """The transformers model class of the file's complete config, with the tensors transformers'
    GGUF loader dequantizes with gguf-py (its own reading of each tensor)."""
    from transformers import AutoModelForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    config = gguf_io.open_gguf(path).config()
    model = AutoModelForCausalLM.from_config(config).eval()
    tensors = load_gguf_checkpoint(str(path), return_tensors=True, model_to_load=model)["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"} - set(tensors)
    return model


@pytest.fixture(scope="module")
def batch():
    return testing.tiny_batch(testing.tiny_tokenizer(), 5)       # 5 sequences: micro-batches of 2 and a 1


@pytest.fixture(scope="module")
def files(tmp_path_factory, batch):
    """qtype -> (file, transformers' tokens); each checked to differ from the float model's."""
    original = _model(moe_intermediate_size=HF_WIDTH)
    plain = original.generate(**batch, **GEN)
    out = {}
    for qtype in ("Q8_0", "Q4_K", "Q6_K", "IQ4_XS"):
        path = save_gguf(original, tmp_path_factory.mktemp(qtype) / f"tiny-{qtype}.gguf", qtype,
                         tokenizer=testing.tiny_tokenizer())
        tokens = _transformers(path).generate(**batch, **GEN)
        assert not torch.equal(tokens, plain) or qtype == "Q8_0"
        out[qtype] = path, tokens
    return out


def _expert_ratio(model) -> float:
    """Bytes an expert unit holds over its experts' bf16 bytes."""
    unit = model.kinject.store["model.layers.0.mlp.experts[0]"]
    stored = sum(src.nbytes for src in unit.tensors.values())
    return stored / sum(torch.Size(shape).numel() * 2 for shape, _, _ in unit.quant.values())


# ---- the dequantizers: bit-identical to gguf-py --------------------------------------------------


@pytest.mark.parametrize("qtype", list(ggml.BLOCKS))
@pytest.mark.parametrize("shape", [(3, 2), (2, 5, 1)])           # (rows, blocks); (experts, rows, blocks)
def test_dequantizer_is_bit_identical_to_gguf_py(qtype, shape):
    from kinject.io.gguf_writers import random_blocks

    rng = np.random.default_rng(hash((qtype, shape)) % 2**32)
    block, _ = ggml.BLOCKS[qtype]
    cols = shape[-1] * max(block, 32)
    if qtype in ("F32", "F16", "BF16"):
        values = rng.standard_normal((*shape[:-1], cols)).astype(np.float32)
        data = gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])
        data = np.ascontiguousarray(data).view(np.uint8).reshape(*shape[:-1], -1)
    elif qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"):
        data = rng.integers(0, 256, (*shape[:-1], ggml.row_bytes(qtype, cols)), dtype=np.uint8)
        if qtype != "MXFP4":                                       # finite float16 scales
            blocks = data.reshape(-1, ggml.BLOCKS[qtype][1])
            for at in (0, 2) if qtype in ("Q4_1", "Q5_1") else (0,):
                blocks[:, at:at + 2] = (rng.standard_normal((len(blocks), 1)) * 0.1).astype(np.float16).view(np.uint8)
    else:
        data = random_blocks((*shape[:-1], cols), qtype, 0.05, rng)
    with np.errstate(over="ignore"):                                # MXFP4's largest exponents are inf
        want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    got = ggml.dequantize(torch.from_numpy(data), qtype)
    assert got.shape == want.shape
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(want)).view(torch.int32))
    assert torch.equal(ggml.dequantize(torch.from_numpy(data), qtype, torch.bfloat16), got.to(torch.bfloat16))


# ---- tokens identical to transformers' GGUF load ------------------------------------------------


@pytest.mark.parametrize("qtype,tier", [("Q8_0", "host"), ("Q4_K", "disk"), ("Q4_K", "host"), ("Q6_K", "disk"),
                                        ("IQ4_XS", "host"), ("Q4_K", "device")])
def test_tokens_identical_to_transformers(files, batch, qtype, tier, tmp_path):
    """Klotski rules, experts in the host or disk tier as their GGML blocks (one unit per expert:
    its rows of the 3-D ``ffn_*_exps`` tensors): transformers' own greedy tokens."""
    path, reference = files[qtype]
    model = kinject.from_pretrained(path, RULES, [f"vars.experts={tier}", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    unit = model.kinject.store["model.layers.0.mlp.experts[0]"]
    if tier == "device":                                    # dequantized once, at load
        assert unit.tier == "device" and not unit.stored
        return
    assert unit.tier == tier and set(unit.stored) == {"gate_up_proj", "down_proj"}
    assert {src.dtype for src in unit.tensors.values()} == {torch.uint8}
    assert set(unit.tensors) == {f"gate_up_proj.0.{qtype}", f"gate_up_proj.1.{qtype}", f"down_proj.0.{qtype}"}
    limit = {"Q8_0": 0.55, "Q4_K": 0.30, "IQ4_XS": 0.30, "Q6_K": 0.42}[qtype]
    assert _expert_ratio(model) <= limit


def test_directory_and_split_shards(files, batch, tmp_path):
    """A model split into ``-0000N-of-0000M`` shards (llama.cpp's gguf-split layout, gguf-py's
    writer): from the first shard or from its directory, the tokens of the single file."""
    path, reference = files["Q8_0"]
    shards = save_gguf(_model(moe_intermediate_size=HF_WIDTH), tmp_path / "split" / "tiny.gguf", "Q8_0",
                       tokenizer=testing.tiny_tokenizer(), split_max_tensors=9)
    all_shards = sorted(shards.parent.glob("*.gguf"))
    assert shards.name == "tiny-00001-of-00003.gguf" and len(all_shards) == 3
    checkpoint = gguf_io.open_gguf(shards.parent)
    assert len(checkpoint.files) == 3 and len(checkpoint.tensors) == len(gguf_io.open_gguf(path).tensors)
    # output.weight is in the last shard: untied, though transformers' reading of the first shard alone says tied
    assert "output.weight" not in {t.name for t in gguf.GGUFReader(shards).tensors}
    assert not checkpoint.config().tie_word_embeddings
    model = kinject.from_pretrained(shards, RULES, ["vars.experts=disk", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    files_read = {src.pieces[0].file for unit in model.kinject.store.units.values() if unit.tier == "disk"
                  for src in unit.tensors.values()}
    assert len(files_read) >= 2                                      # experts read from several shards
    with pytest.raises(LoadError, match=r"shard 2 of 3; pass the first shard \(tiny-00001-of-00003.gguf\)"):
        gguf_io.open_gguf(all_shards[1])
    (shards.parent / "other.gguf").write_bytes(path.read_bytes())
    with pytest.raises(LoadError, match=r"holds 2 GGUF models \(other.gguf, tiny-00001-of-00003.gguf\); pass the .gguf"):
        gguf_io.open_gguf(shards.parent)
    all_shards[2].unlink()
    with pytest.raises(LoadError, match="shard tiny-00003-of-00003.gguf of this 3-shard GGUF model is missing"):
        kinject.from_pretrained(shards, RULES)


@pytest.mark.parametrize("family", ["qwen3_moe", "qwen2_moe"])
def test_expert_width_transformers_ignores(family, batch, tmp_path):
    """``<arch>.expert_feed_forward_length`` (and Qwen2-MoE's shared expert width) are metadata
    transformers does not read: its own load of a file of any other width fails in 5.24 (a size
    mismatch), and in 5.17 -- which skips the shape check under its GGUF quantizer -- gives a model
    whose config keeps the default width beside the file's tensors. kinject reads them; the
    reference is the model class of that config with gguf-py's dequantization."""
    original = _model(family, moe_intermediate_size=256, **({"shared_expert_intermediate_size": 512}
                                                             if family == "qwen2_moe" else {}))
    path = save_gguf(original, tmp_path / "tiny.gguf", "Q4_K", tokenizer=testing.tiny_tokenizer(),
                     types={"ffn_down_exps": "Q6_K"})
    try:
        ignored = _transformers(path).config
    except Exception as exc:  # noqa: BLE001 -- 5.24: the shapes of the file refused
        assert "mismatch" in str(exc), exc
    else:                     # 5.17: loaded as stored, the widths of the metadata not read
        assert ignored.moe_intermediate_size != 256
        if family == "qwen2_moe":
            assert ignored.shared_expert_intermediate_size != 512
    config = gguf_io.open_gguf(path).config()
    assert config.moe_intermediate_size == 256
    if family == "qwen2_moe":
        assert config.shared_expert_intermediate_size == 512
    reference = _model_class_reference(path).generate(**batch, **GEN)
    model = kinject.from_pretrained(path, RULES, ["vars.experts=disk", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    unit = model.kinject.store["model.layers.1.mlp.experts[7]"]
    assert set(unit.tensors) == {"gate_up_proj.0.Q4_K", "gate_up_proj.1.Q4_K", "down_proj.0.Q6_K"}


def test_minimax_m2(batch, tmp_path):
    """MiniMax-M2 (sigmoid routing with ``exp_probs_b`` correction bias, partial rotary, full-width
    q/k norms), Q4_K with Q6_K down experts, experts on disk: transformers' own GGUF load's tokens."""
    from transformers import AutoConfig, AutoModelForCausalLM

    tiny = testing.tiny_config("qwen3_moe")
    config = AutoConfig.for_model("minimax_m2", hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=64, rotary_dim=32,
                                  num_local_experts=8, num_experts_per_tok=2, vocab_size=tiny.vocab_size,
                                  bos_token_id=tiny.bos_token_id, eos_token_id=tiny.eos_token_id,
                                  pad_token_id=tiny.pad_token_id, max_position_embeddings=512)
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, bias in original.named_buffers():
            if name.endswith("e_score_correction_bias"):
                bias.normal_(0, 0.5)                       # the bias changes which experts are chosen
    path = save_gguf(original, tmp_path / "tiny-minimax.gguf", "Q4_K", tokenizer=testing.tiny_tokenizer(),
                     types={"ffn_down_exps": "Q6_K"})
    reference = _transformers(path).generate(**batch, **GEN)
    assert not torch.equal(reference, original.generate(**batch, **GEN))
    model = kinject.from_pretrained(path, RULES, ["vars.experts=disk", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    assert model.config.intermediate_size == 256 and model.config.rotary_dim == 32


def test_tokenizer_from_the_file(files):
    """The tokenizer is the file's, converted by transformers' GGUF tokenizer conversion."""
    from transformers import AutoTokenizer

    path, _ = files["Q8_0"]
    tok = gguf_io.open_gguf(path).tokenizer()
    theirs = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    text = "the experts of a mixture stay packed in their blocks"
    assert tok(text)["input_ids"] == theirs(text)["input_ids"] and tok.decode(tok(text)["input_ids"]).endswith(text)
    assert tok.vocab_size == testing.tiny_config("qwen3_moe").vocab_size


# ---- refusals: located, before any tensor is read --------------------------------------------------


def _write(path, arch: str, tensors: dict, keys: dict | None = None):
    """A GGUF file of raw tensors: name -> (uint8 or float array, ggml type name)."""
    writer = gguf.GGUFWriter(path, arch)
    for key, value in (keys or {}).items():
        writer.add_uint32(key, value)
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[qtype])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("qtype", ["IQ2_XXS", "Q8_1", "TQ1_0"])
def test_unsupported_type_is_refused_naming_tensor_and_type(tmp_path, qtype, nothing_read):
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    data = np.zeros((4, size * (256 // block)), dtype=np.uint8)
    path = _write(tmp_path / "m.gguf", "qwen3moe", {"blk.0.attn_q.weight": (data, qtype)})
    with pytest.raises(FormatError, match=rf"tensor 'blk.0.attn_q.weight' has GGML type {qtype}, which kinject "
                                          "does not dequantize"):
        kinject.from_pretrained(path, RULES)


def test_byte_size_disagreeing_with_type_and_shape_is_refused(files, tmp_path, nothing_read):
    """A file cut short: the last tensor's bytes run past its end."""
    path, _ = files["Q4_K"]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(FormatError, match=r"tensor '.*' \(Q4_K \[.*\]\) needs bytes \d+\.\.\d+, but the file ends "
                                          r"at byte \d+: its byte size disagrees with its type and shape"):
        kinject.from_pretrained(cut, RULES)


def test_unsupported_architectures_are_refused_with_the_reason(tmp_path, nothing_read):
    x = np.zeros((4, 32), dtype=np.float32)
    with pytest.raises(LoadError, match=r"architecture 'llama' is not a MoE family transformers' GGUF loading "
                                        r"supports \(supported: qwen2moe, qwen3moe, minimax-m2, gpt-oss\)"):
        kinject.from_pretrained(_write(tmp_path / "a.gguf", "llama", {"token_embd.weight": (x, "F32")}), RULES)


def test_metadata_kinject_does_not_understand_is_refused(files, tmp_path, nothing_read):
    """Read completely: an architecture key neither transformers nor kinject reads is refused."""
    path, _ = files["Q8_0"]
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(tmp_path / "odd.gguf", "qwen3moe")
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, value)
        else:
            writer.add_key_value(name, value, vtype)
    writer.add_float32("qwen3moe.rope.scaling.factor", 4.0)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(LoadError, match=r"metadata key 'qwen3moe.rope.scaling.factor' = 4.0 is not understood"):
        kinject.from_pretrained(tmp_path / "odd.gguf", RULES)


def test_without_the_gguf_package_the_extra_is_named(files, monkeypatch):
    path, _ = files["Q8_0"]
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(LoadError, match=r"needs the 'gguf' package: pip install 'kinject\[gguf\]'"):
        kinject.from_pretrained(path, RULES)


def test_kinject_run_on_a_gguf_file(files, tmp_path):
    """``kinject run --model FILE.gguf``: the file's tokenizer, its model, transformers' GGUF load's tokens."""
    import json

    from kinject.app.cli import main

    path, _ = files["Q4_K"]
    prompts = ["the experts of a mixture", "a model bigger than the device"]
    (tmp_path / "p.txt").write_text("\n".join(prompts) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", "-q", "--model", str(path), "--prompts", str(tmp_path / "p.txt"), "--out", str(out),
                 "--max-new-tokens", "3", "--dtype", "float32", "--set", "pipeline.micro_batch_size=2",
                 "--set", "pipeline.n_batches=1"]) == 0
    got = [json.loads(line)["completion_ids"] for line in out.read_text().splitlines()]
    tok = gguf_io.open_gguf(path).tokenizer()
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    enc = tok(prompts, return_tensors="pt", padding=True)
    ref = _transformers(path).generate(**enc, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert got == [row[enc["input_ids"].shape[1]:].tolist() for row in ref]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("qtype", list(ggml.BLOCKS))
def test_cuda_dequantizer_is_bit_identical_to_gguf_py(qtype):
    """The blocks cross the link as stored and are dequantized on the GPU: the same bits as gguf-py."""
    from kinject.io.gguf_writers import random_blocks

    rng = np.random.default_rng(7)
    block, _ = ggml.BLOCKS[qtype]
    cols = 4 * max(block, 32)
    if qtype in ("F32", "F16", "BF16"):
        values = rng.standard_normal((6, cols)).astype(np.float32)
        data = np.ascontiguousarray(gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype])).view(np.uint8)
        data = data.reshape(6, -1)
    elif qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4"):
        data = gguf.quants.quantize(rng.standard_normal((6, cols)).astype(np.float32), gguf.GGMLQuantizationType[qtype])
    else:
        data = random_blocks((6, cols), qtype, 0.05, rng)
    want = gguf.quants.dequantize(data, gguf.GGMLQuantizationType[qtype]).astype(np.float32)
    got = ggml.dequantize(torch.from_numpy(np.ascontiguousarray(data)).cuda(non_blocking=True), qtype).cpu()
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(want)).view(torch.int32))


# ---- gpt-oss: transformers' GGUF map is wrong; the reference is its model class + gguf-py ------------


def _gpt_oss_reference(path, *, interleave: bool = True) -> torch.nn.Module:
    """GptOssForCausalLM of the config kinject derives, every weight gguf-py's dequantization of the
    file mapped as llama.cpp's converter wrote it (written here, independently of kinject):
    ``gate_up_proj[e]`` is ``ffn_gate_exps[e].T`` and ``ffn_up_exps[e].T`` interleaved column by column
    (``interleave=False``: concatenated instead, a wrong map the tokens must notice)."""
    from transformers import AutoModelForCausalLM

    config = gguf_io.open_gguf(path).config()
    model = AutoModelForCausalLM.from_config(config).eval()
    w = {t.name: torch.from_numpy(np.array(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32))
         for t in gguf.GGUFReader(path).tensors}

    def join(gate, up):
        return torch.stack([gate, up], -1).flatten(-2) if interleave else torch.cat([gate, up], -1)

    sd = {"model.embed_tokens.weight": w.pop("token_embd.weight"), "model.norm.weight": w.pop("output_norm.weight"),
          "lm_head.weight": w.pop("output.weight")}
    for i in range(config.num_hidden_layers):
        b, layer = f"blk.{i}.", f"model.layers.{i}."
        sd[layer + "mlp.experts.gate_up_proj"] = join(w.pop(b + "ffn_gate_exps.weight").transpose(1, 2),
                                                      w.pop(b + "ffn_up_exps.weight").transpose(1, 2))
        sd[layer + "mlp.experts.gate_up_proj_bias"] = join(w.pop(b + "ffn_gate_exps.bias"), w.pop(b + "ffn_up_exps.bias"))
        sd[layer + "mlp.experts.down_proj"] = w.pop(b + "ffn_down_exps.weight").transpose(1, 2)
        sd[layer + "mlp.experts.down_proj_bias"] = w.pop(b + "ffn_down_exps.bias")
        sd[layer + "self_attn.sinks"] = w.pop(b + "attn_sinks.weight")
        sd[layer + "input_layernorm.weight"] = w.pop(b + "attn_norm.weight")
        sd[layer + "post_attention_layernorm.weight"] = w.pop(b + "post_attention_norm.weight")
        for kind in ("weight", "bias"):
            sd[layer + f"mlp.router.{kind}"] = w.pop(b + f"ffn_gate_inp.{kind}")
            for g, h in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
                sd[layer + f"self_attn.{h}.{kind}"] = w.pop(b + f"{g}.{kind}")
    assert not w, f"GGUF tensors the reference does not map: {sorted(w)}"
    model.load_state_dict(sd, strict=True)
    return model


@pytest.fixture(scope="module")
def gpt_oss_files(tmp_path_factory):
    """MXFP4 experts (as gpt-oss GGUF releases store them) over Q8_0, and all Q8_0; 3 layers (sliding,
    full, sliding; window 16 < prompt + new tokens), yarn rope, sinks, biases."""
    from transformers import AutoModelForCausalLM

    config = testing.tiny_config("gpt_oss", num_hidden_layers=3)
    torch.manual_seed(0)
    original = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, p in original.named_parameters():
            if name.endswith(("sinks", "_bias")):
                p.normal_(0, 0.5)                        # sinks and biases that change the tokens
    out = {}
    for name, qtype, types in (("MXFP4", "Q8_0", {"_exps": "MXFP4"}), ("Q8_0", "Q8_0", None)):
        out[name] = save_gguf(original, tmp_path_factory.mktemp(f"oss-{name}") / f"tiny-gpt-oss-{name}.gguf", qtype,
                              tokenizer=testing.tiny_tokenizer(), types=types)
    return original, out


@pytest.mark.parametrize("variant,tier", [("MXFP4", "host"), ("MXFP4", "disk"), ("Q8_0", "disk")])
def test_gpt_oss_tokens_identical_to_model_class_with_gguf_py(gpt_oss_files, batch, variant, tier, tmp_path):
    """A gpt-oss GGUF in llama.cpp's layout: experts stay MXFP4 / Q8_0 blocks (biases F32) in the
    host or disk tier, and kinject's tokens equal the transformers model class filled by gguf-py."""
    original, files = gpt_oss_files
    path = files[variant]
    reference = _gpt_oss_reference(path).generate(**batch, **GEN)
    if variant == "MXFP4":
        assert not torch.equal(reference, original.generate(**batch, **GEN))
        assert not torch.equal(reference, _gpt_oss_reference(path, interleave=False).generate(**batch, **GEN))
    model = kinject.from_pretrained(path, RULES, [f"vars.experts={tier}", f"pipeline.offload_dir={tmp_path}"])
    assert torch.equal(model.generate(**batch, **GEN), reference)
    unit = model.kinject.store["model.layers.2.mlp.experts[5]"]
    assert unit.tier == tier and {src.dtype for src in unit.tensors.values()} == {torch.uint8}
    assert set(unit.tensors) == {f"gate_up_proj.0.{variant}", f"gate_up_proj.1.{variant}", f"down_proj.0.{variant}",
                                 "gate_up_proj_bias.0.F32", "gate_up_proj_bias.1.F32", "down_proj_bias.0.F32"}
    config = model.config
    assert config.layer_types == ["sliding_attention", "full_attention", "sliding_attention"]
    assert config.sliding_window == 16 and config.head_dim == 16
    assert config.rope_parameters["rope_type"] == "yarn" and config.rope_parameters["factor"] == 4.0
    assert config.rope_parameters["original_max_position_embeddings"] == 128


def _rewrite(path, out, arch: str, extra: dict, drop: tuple[str, ...] = ()):
    """``path`` copied to ``out`` with metadata ``extra`` (key -> (value, GGUFValueType)) set and ``drop`` left out."""
    reader = gguf.GGUFReader(path)
    writer = gguf.GGUFWriter(out, arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name in extra or name in drop:
            continue
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(name, field.contents())
        else:
            writer.add_key_value(name, field.contents(), vtype)
    for name, (value, vtype) in extra.items():
        writer.add_key_value(name, value, vtype)
    for t in reader.tensors:
        writer.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


@pytest.mark.parametrize("extra,drop,message", [
    ({"gpt-oss.rope.scaling.type": ("linear", gguf.GGUFValueType.STRING)}, (),
     r"'gpt-oss.rope.scaling.type' = 'linear'; kinject reads gpt-oss with yarn rope scaling only"),
    ({"gpt-oss.rope.scaling.attn_factor": (2.0, gguf.GGUFValueType.FLOAT32)}, (),
     r"metadata key 'gpt-oss.rope.scaling.attn_factor' = 2.0 is not understood"),
    ({"gpt-oss.expert_feed_forward_length": (64, gguf.GGUFValueType.UINT32)}, (),
     r"'gpt-oss.expert_feed_forward_length' = 64 differs from 'gpt-oss.feed_forward_length' = 32"),
    ({}, ("gpt-oss.attention.sliding_window",), r"metadata key 'gpt-oss.attention.sliding_window' is missing"),
])
def test_gpt_oss_metadata_kinject_cannot_map_is_refused(gpt_oss_files, tmp_path, extra, drop, message, nothing_read):
    _, files = gpt_oss_files
    odd = _rewrite(files["Q8_0"], tmp_path / "odd.gguf", "gpt-oss", extra, drop)
    with pytest.raises(LoadError, match=message):
        kinject.from_pretrained(odd, RULES)
