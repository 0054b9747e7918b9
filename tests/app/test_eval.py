"""``kinject eval``: sliding-window perplexity through the optimized model, KL / top-1 / ratio
against a base, bytes per step; checked against a direct computation with transformers' loss."""

from __future__ import annotations

import json
import math

import pytest
import torch

import kinject
from kinject.app.eval import builtin_corpus, evaluate, sliding_windows, token_stream
from kinject.errors import KinjectError
from kinject.testing import build_tiny_model, save_tiny_model, tiny_tokenizer


@pytest.mark.parametrize("n, context, stride", [(100, 32, 16), (100, 32, 31), (97, 20, 7), (33, 64, 16), (2, 8, 4)])
def test_every_token_after_the_first_is_scored_once(n, context, stride):
    windows = sliding_windows(n, context, stride)
    scored = [t for w in windows for t in range(w.scored_from, w.end)]
    assert scored == list(range(1, n))
    for k, w in enumerate(windows):
        assert w.end - w.begin <= context and w.begin < w.scored_from
        if k:                                   # past the first window: at least context - stride tokens of context
            assert w.scored_from - w.begin >= min(context - stride, w.scored_from)


def test_bad_windows_are_refused():
    for stride in (0, 32):
        with pytest.raises(KinjectError, match="stride"):
            sliding_windows(100, 32, stride)
    with pytest.raises(KinjectError, match="at least 2"):
        sliding_windows(1, 32, 16)


def _stream(n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(4, 512, (n,), generator=g)


def hf_guide_perplexity(model, stream, context, stride):
    """The Hugging Face perplexity guide's loop, verbatim in substance."""
    nll_sum, n_tokens, prev_end, n = 0.0, 0, 0, stream.numel()
    for begin in range(0, n, stride):
        end = min(begin + context, n)
        trg_len = end - prev_end
        ids = stream[None, begin:end]
        target = ids.clone()
        target[:, :-trg_len] = -100
        with torch.no_grad():
            loss = model(input_ids=ids, labels=target).loss
        valid = int((target[:, 1:] != -100).sum())         # tokens the shifted loss averages over
        nll_sum += float(loss) * valid
        n_tokens += valid
        prev_end = end
        if end == n:
            break
    return math.exp(nll_sum / n_tokens), n_tokens


@pytest.mark.parametrize("context, stride, batch", [(64, 32, 3), (50, 17, 4)])
def test_perplexity_is_the_hugging_face_guides(context, stride, batch):
    model = build_tiny_model("mixtral").eval()
    stream = _stream(256)
    r = evaluate(model, stream, context=context, stride=stride, batch=batch, progress=False)
    ppl, n_tokens = hf_guide_perplexity(model, stream, context, stride)
    assert r["tokens_scored"] == n_tokens == 255
    assert r["perplexity"] == pytest.approx(ppl, rel=1e-4) and "kl_mean" not in r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_top1_agreement_counts_an_exact_tie_either_way_and_reports_the_strict_share(dtype):
    """Rows: the same top token; a base whose top two tie exactly (argmax says token 1, the model says
    token 3: both are the base's top); a real disagreement; a model whose own top two tie with one of
    them the base's. Tie-aware agreement 3 of 4, strict argmax 1 of 4, the base tied at 1 of 4."""
    from kinject.app.eval import Scores, summarize

    base = torch.tensor([[0.0, 5.0, 1.0, 2.0], [0.0, 4.0, 1.0, 4.0], [3.0, 0.0, 0.0, 1.0], [0.0, 2.0, 6.0, 0.0]])
    model = torch.tensor([[0.0, 6.0, 1.0, 2.0], [0.0, 3.0, 1.0, 5.0], [0.0, 0.0, 3.0, 1.0], [0.0, 6.0, 6.0, 0.0]])
    s = Scores()
    s.add(model.to(dtype), torch.tensor([1, 1, 0, 2]), base.to(dtype))
    r = summarize(s)
    assert r["top1_agreement"] == 0.75 and r["top1_agreement_strict"] == 0.25 and r["base_top1_ties"] == 0.25


def test_against_itself_and_against_a_quantized_setting(tmp_path):
    model = build_tiny_model("qwen3_moe").eval()
    stream = _stream(203, seed=1)                              # last window shorter than the others
    same = evaluate(model, stream, base=model, context=48, stride=24, batch=4, progress=False)
    assert same["kl_mean"] == 0 and same["top1_agreement"] == same["top1_agreement_strict"] == 1
    assert same["perplexity_ratio"] == 1
    base = build_tiny_model("qwen3_moe").eval()
    kinject.optimize(model, "rules/klotski.yaml", ["vars.quant={format: int4, group_size: 32}",
                                                   f"pipeline.offload_dir={tmp_path}"])
    try:
        r = evaluate(model, stream, base=base, context=48, stride=24, batch=4, progress=False)
    finally:
        kinject.restore(model)
    assert r["tokens_scored"] == 202
    assert r["kl_mean"] > 0 and r["kl_p99"] >= r["kl_mean"] and 0 < r["top1_agreement_strict"] <= r["top1_agreement"] <= 1
    assert 0 <= r["base_top1_ties"] < 1
    assert r["perplexity_ratio"] == pytest.approx(r["perplexity"] / r["base_perplexity"])
    lo, hi = r["perplexity_ratio_halves"]
    assert r["ratio_spread"] == pytest.approx(abs(lo - hi) / 2)
    assert r["bytes_per_step"] > 0 and r["peak_device_bytes"] > 0 and r["steps"] >= r["windows"] // 4


def test_cli_json_on_a_text_file(tmp_path, capsys):
    from kinject.app.cli import main

    path = save_tiny_model("mixtral", tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("def f(x):\n    return x + 1\n" * 40)
    rc = main(["eval", "--model", str(path), "--text", str(text), "--context", "32", "--stride", "16",
               "--max-tokens", "150", "--set", "vars.quant={format: fp8, block: channel}", "--json", "--no-progress",
               "--set", f"pipeline.offload_dir={tmp_path / 'off'}", "--dtype", "float32"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["tokens_scored"] == 149 and r["context"] == 32 and r["stride"] == 16
    assert r["base"] == "untouched transformers model" and 0 < r["top1_agreement"] <= 1
    assert r["bytes_per_step"] > 0 and r["stored_bytes"]["host"] > 0


def test_cli_base_rules_and_errors(tmp_path, capsys):
    from kinject.app.cli import main

    path = save_tiny_model("mixtral", tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("import os\nprint(os.getcwd())\n" * 30)
    common = ["eval", "--model", str(path), "--text", str(text), "--context", "24", "--stride", "12", "--max-tokens",
              "100", "--json", "--no-progress", "--dtype", "float32"]
    # base: the same rules unquantized; evaluated: those rules with bf16 -> identical to its base
    rc = main(common + ["--base", "rules/klotski.yaml"])
    assert rc == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kl_mean"] == 0 and r["top1_agreement"] == 1
    assert main(common + ["--set", "vars.quant={format: int5}"]) == 2
    assert "quant key 'format': 'int5'" in capsys.readouterr().err
    assert main(["eval", "--model", str(path), "--no-progress"]) == 2
    assert "needs --text FILE" in capsys.readouterr().err


def test_builtin_corpus_is_the_held_out_text():
    from transformers import AutoTokenizer

    from kinject.fixtures import tiny_moe_path

    texts = builtin_corpus()
    assert len(texts) == 29
    info = json.loads((tiny_moe_path() / "training.json").read_text())["corpus"]
    stream = token_stream(AutoTokenizer.from_pretrained(tiny_moe_path()), texts)
    assert stream.numel() == info["heldout_tokens"]
    assert tiny_tokenizer is not None


def test_cli_text_report(tmp_path, capsys):
    from kinject.app.cli import main

    path = save_tiny_model("qwen3_moe", tmp_path / "m")
    text = tmp_path / "t.txt"
    text.write_text("for i in range(10):\n    print(i)\n" * 20)
    rc = main(["eval", "--model", str(path), "--text", str(text), "--context", "24", "--stride", "8", "--max-tokens",
               "90", "--no-progress", "--dtype", "float32", "--set", "vars.quant={format: mxfp4}",
               "--set", f"pipeline.offload_dir={tmp_path / 'off'}"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "89 tokens scored, sliding windows of 24 tokens, stride 8" in out
    assert "perplexity ratio" in out and "top-1 agreement" in out and "bytes per step" in out
