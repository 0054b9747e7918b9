"""Quantized checkpoints from the user's side: ``kinject demo --model DIR``, ``kinject run --model DIR`` and
``kinject bench cpu --formats`` on FP8 and MXFP4 checkpoints (written by kinject's writers from the
built-in model and a tiny gpt-oss), tokens equal to transformers' own load of the same checkpoint."""

import json

import pytest
import torch

from helpers.cli_helpers import hf_reference, trimmed
from kinject import testing
from kinject.app.cli import main
from kinject.bench import formats
from kinject.errors import KinjectError
from kinject.fixtures import tiny_moe_path

PROMPTS = ["def add(a, b):", "import os, sys", "class Expert:", "for i in range("]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """format -> checkpoint dir: the built-in model as FP8 (128x128 blocks), a tiny gpt-oss of the bench's
    width (its embeddings alone would not fit the demo's budget at hidden 64) as MXFP4."""
    from kinject.io.quantized_writers import save_mxfp4_checkpoint

    root = tmp_path_factory.mktemp("quantized")
    oss = testing.build_tiny_model("gpt_oss", dtype=torch.bfloat16, **formats.GPT_OSS_SHAPE)
    return {"fp8": formats.fp8_checkpoint(tiny_moe_path(), root / "fp8"),
            "mxfp4": save_mxfp4_checkpoint(oss, root / "mxfp4", tokenizer=testing.tiny_tokenizer())}


def _expert_dtypes(runtime) -> set[torch.dtype]:
    unit = next(u for u in runtime.store.units.values() if "experts[" in u.name)
    return {t.dtype for t in unit.tensors.values()}


@pytest.mark.parametrize("fmt, stored", [("fp8", torch.float8_e4m3fn), ("mxfp4", torch.uint8)])
def test_demo_on_a_quantized_checkpoint(checkpoints, fmt, stored, capsys):
    """The reference row is transformers' load of the checkpoint; every kinject row gives its tokens
    while the experts stay in the stored format, accelerate and Klotski each at the batch the one
    device budget (weights, KV, activations) leaves them."""
    from kinject.app.demo import run_demo

    result = run_demo(model=checkpoints[fmt], batch=2, new_tokens=2, repeats=1, budget_share=0.4, plot=None)
    head = capsys.readouterr().out.splitlines()[0]
    assert str(checkpoints[fmt]) in head and f"stored {fmt}" in head
    assert result["identical"] and all(r.same_tokens for r in result["rows"][1:])
    klotski = result["rows"][-1]
    assert stored in _expert_dtypes(klotski.runtime) and klotski.bytes_moved > 0


@pytest.mark.parametrize("fmt", ["fp8", "mxfp4"])
def test_run_on_a_quantized_checkpoint(checkpoints, fmt, tmp_path, capsys):
    """``kinject run --model DIR``: the completions of transformers' load of DIR, per group."""
    path = checkpoints[fmt]
    prompts = tmp_path / "p.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", "-q", "--model", str(path), "--prompts", str(prompts), "--out", str(out),
                 "--max-new-tokens", "2", "--dtype", "float32", "--set", "pipeline.micro_batch_size=2",
                 "--set", "pipeline.n_batches=2"]) == 0
    assert str(path) in capsys.readouterr().out
    got = [json.loads(line)["completion_ids"] for line in out.read_text().splitlines()]
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    assert got == [trimmed(ids, eos) for ids in hf_reference(path, PROMPTS, 4, new=2)]


def test_bench_formats_table(tmp_path):
    """``--formats``: one row per format on the bench's model (FP8 moves <= 0.55x bf16's bytes per
    step, deterministic), MXFP4 in its own table on a tiny gpt-oss, tokens = transformers' load."""
    text = formats.main(tiny_moe_path(), ["fp8", "mxfp4"], bandwidth=50.0, new_tokens=2, prompt_len=16, repeats=1,
                        workdir=tmp_path)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| bf16", "| fp8", "| mxfp4"))]
    assert [r[0] for r in rows] == ["| bf16", "| fp8", "| bf16", "| mxfp4"]
    assert all(r[-1] == "✓ |" for r in rows)
    fp8_bytes, mxfp4_bytes = float(rows[1][3].rstrip("x")), float(rows[3][3].rstrip("x"))
    assert fp8_bytes <= formats.TARGET_BYTES and mxfp4_bytes < 0.5
    assert "EMULATED" in text and "tiny_moe is not gpt-oss" in text and "FP8 vs bf16: " in text
    assert "target <= 0.55x: met" in text
    assert not list(tmp_path.glob("**/*.safetensors"))          # the checkpoints lived in a temporary folder


def test_bench_formats_nvfp4_and_gguf(tmp_path):
    """``--formats nvfp4 gguf-q4_k``: NVFP4 on the bench's model (tokens = transformers' load of
    compressed-tensors' decompression), GGUF Q4_K in its own table on a tiny Qwen3-MoE (the fixture
    is Mixtral, which transformers' GGUF loading does not map), tokens = transformers' GGUF load."""
    pytest.importorskip("gguf")
    pytest.importorskip("compressed_tensors")
    text = formats.main(tiny_moe_path(), ["nvfp4", "gguf-q4_k"], bandwidth=50.0, new_tokens=2, prompt_len=16,
                        repeats=1, workdir=tmp_path)
    rows = [line.split(" | ") for line in text.splitlines() if line.startswith(("| bf16", "| nvfp4", "| gguf"))]
    assert [r[0] for r in rows] == ["| bf16", "| nvfp4", "| bf16", "| gguf-q4_k"]
    assert all(r[-1] == "✓ |" for r in rows)
    assert float(rows[1][3].rstrip("x")) <= 0.35 and float(rows[3][3].rstrip("x")) <= 0.35   # bytes per step
    assert "tiny Qwen3-MoE" in text


def test_bench_formats_errors(checkpoints, tmp_path):
    with pytest.raises(KinjectError, match=r"--formats: unknown int3 \(supported: bf16, fp8, nvfp4, gguf-q4_k, mxfp4\)"):
        formats.check_formats(["fp8", "int3"])
    assert formats.check_formats(["mxfp4", "fp8"], tiny_moe_path()) == ["bf16", "fp8", "mxfp4"]
    with pytest.raises(KinjectError, match=r"--formats fp8: .* is a gpt-oss model"):
        formats.check_formats(["fp8"], checkpoints["mxfp4"])
    assert main(["bench", "cpu", "--formats", "fp4", "--workdir", str(tmp_path)]) == 2   # before the ladder runs


def test_fp8_writer_refuses_fused_experts(tmp_path):
    """A model loaded from a fused checkpoint saves 3-D experts: the FP8 writer names the tensor
    rather than leave the experts unquantized in an "fp8" checkpoint."""
    from transformers import AutoModelForCausalLM

    from kinject.engine.formats import FormatError
    from kinject.io.quantized_writers import save_fp8_checkpoint

    fused = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.bfloat16)
    with pytest.raises(FormatError, match=r"model\.layers\.0\.mlp\.experts\.\w+_proj \[8, \d+, 256\] is a fused"):
        save_fp8_checkpoint(fused, tmp_path / "fp8")


def test_transformers_ignores_the_scales_of_fused_fp8_experts(tmp_path):
    """What the README says of fused FP8 experts (no release layout): transformers 5.24 lists their
    ``*_scale_inv`` as unexpected and keeps the raw float8 values as the weights. When a release of
    transformers dequantizes them, this fails and the README's sentence goes."""
    from transformers import AutoModelForCausalLM

    from kinject.io.quantized_writers import save_quantized

    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.bfloat16)   # saves fused, as loaded

    def fused(name, tensor):                                     # every expert of a layer: one 3-D tensor
        if tensor.ndim != 3:
            return None
        values, scales = zip(*(testing.quantize_fp8(w, (128, 128)) for w in tensor))
        return {name: torch.stack(values), name + "_scale_inv": torch.stack(scales)}

    qconfig = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    path = save_quantized(model, tmp_path / "fused", qconfig, fused, None, None)
    from safetensors import safe_open

    name = "model.layers.0.mlp.experts.gate_up_proj"
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        stored = f.get_tensor(name)
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).get_parameter(name)
    assert stored.dtype == torch.float8_e4m3fn and torch.equal(loaded, stored.float())     # no scale applied
    # so kinject, which has no reference to match for this layout, refuses it before reading a weight
    import kinject
    import kinject.engine.disk_sources as disk_sources
    from kinject.engine.formats import FormatError

    def refuse(*_a, **_k):
        raise AssertionError("a checkpoint byte was read before the error")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(disk_sources, "read_pieces", refuse)
        with pytest.raises(FormatError, match=r"'model\.layers\.\d+\.mlp\.experts\.\w+_proj': FP8 values stored fused"):
            kinject.from_pretrained(path, "klotski", [f"pipeline.offload_dir={tmp_path}"])
