"""A family kinject ships no tiny factory or file for (GLM-4-MoE), placed by the family-agnostic rules alone."""

import torch
from transformers import AutoModelForCausalLM, Glm4MoeConfig

import kinject
from kinject.app.cli import main
from kinject.testing import tiny_batch, tiny_tokenizer


def test_glm4_moe_ported_by_rules_gives_identical_tokens(tmp_path, capsys):
    cfg = Glm4MoeConfig(vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, n_routed_experts=8,
                        num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
                        topk_group=1, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model.save_pretrained(tmp_path / "glm")
    assert main(["inspect", str(tmp_path / "glm"), "rules/klotski.yaml"]) == 0
    assert "no rule touched" not in capsys.readouterr().out          # every MoE piece is placed
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 8)
    kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = model.generate(**batch, **kw)
    ported = kinject.from_pretrained(tmp_path / "glm", "rules/klotski.yaml",
                                     ["vars.weights=disk", f"pipeline.offload_dir={tmp_path}/o"],
                                     attn_implementation="eager")
    assert torch.equal(ported.generate(**batch, **kw), ref)
    assert ported.kinject.store.stats["bytes"]["disk"] > 0
