"""HQQ through the rules: packed weights moved, dequantized before use, cached on disk."""

import pytest
import torch

import kinject
from kinject.errors import RuleError
from kinject.testing import FAMILIES, build_tiny_model, tiny_batch, tiny_tokenizer

HQQ = "vars.quant={nbits: 4, group_size: 64}"


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


def logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits[batch["attention_mask"].bool()]


@pytest.mark.parametrize("family", FAMILIES)
def test_quantized_klotski_rules_run_every_family(family, tok, tmp_path):
    model = build_tiny_model(family)
    batch = tiny_batch(tok, 8, min_tokens=16)
    ref = logits(model, batch)
    kinject.optimize(model, f"rules/{family}_klotski.yaml", [HQQ, f"pipeline.offload_dir={tmp_path}"])
    store = model.kinject.store
    quantized = [u for u in store.units.values() if u.quant]
    assert quantized, "no unit was quantized"
    out = model.generate(**batch, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == batch["input_ids"].shape[1] + 8
    # 4-bit g64 moves ~9/32 of the fp32 weight bytes... of fp16: 0.28125 -> of fp32: 0.140625 (+ unquantized biases)
    packed = sum(u.wire_nbytes for u in quantized)
    full = sum(u.nbytes - u.wire_nbytes for u in quantized)
    assert packed / full < 0.2
    # measured, not hidden: relative logit error of 4-bit weights on a random tiny model
    err = (logits(model, batch) - ref).norm() / ref.norm()
    assert 0 < err < 0.5, f"{family}: relative logit error {err:.3f}"
    kinject.restore(model)


def test_quantized_weights_are_cached_in_offload_dir(tok, tmp_path):
    model = build_tiny_model("mixtral")
    overrides = [HQQ, f"pipeline.offload_dir={tmp_path}", "vars.weights=disk"]
    kinject.optimize(model, "rules/mixtral_klotski.yaml", overrides)
    assert model.kinject.store.stats.get("quantized", 0) > 0
    batch = tiny_batch(tok, 4)
    first = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    kinject.restore(model)
    assert list(tmp_path.glob("*.hqq.safetensors"))
    kinject.optimize(model, "rules/mixtral_klotski.yaml", overrides)
    assert model.kinject.store.stats.get("quantized", 0) == 0          # second run: nothing re-quantized
    again = model.generate(**batch, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
    assert torch.equal(first, again)
    kinject.restore(model)


def test_bad_quant_setting_is_a_rule_error(tmp_path):
    model = build_tiny_model("mixtral")
    with pytest.raises(RuleError, match=r"key 'replace.kwargs.quant'.*nbits.*5"):
        kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.quant={nbits: 5}"])
    with pytest.raises(RuleError, match=r"quant key 'bits' is unknown"):
        kinject.optimize(model, "rules/mixtral_klotski.yaml", ["vars.quant={bits: 4}"])


def test_hqq_on_trained_fixture_stays_close_to_fp32(tmp_path):
    """Measured on the trained fixture (BENCHMARKS.md): rel. logit error 0.032, next-token
    agreement 0.973, KL 0.0033 nats. Floors with margin: 0.06, 0.93, 0.01."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kinject.bench.cpu import code_prompts
    from kinject.fixtures import tiny_moe_path

    path = tiny_moe_path()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    batch = code_prompts(tok, 8, 64)
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    quant = kinject.from_pretrained(path, "mixtral_klotski_hqq", [f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32, attn_implementation="eager")
    mask = batch["attention_mask"].bool()
    with torch.no_grad():
        lr, lq = ref(**batch).logits[mask], quant(**batch).logits[mask]
    rel = ((lq - lr).norm() / lr.norm()).item()
    agree = (lq.argmax(-1) == lr.argmax(-1)).float().mean().item()
    kl = torch.nn.functional.kl_div(lq.log_softmax(-1), lr.log_softmax(-1), log_target=True,
                                    reduction="batchmean").item()
    assert rel < 0.06 and agree > 0.93 and kl < 0.01, (rel, agree, kl)
