"""The tiny-model factory is the ground truth of every correctness test, so it is tested first."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from kinject.testing import (
    FAMILIES,
    LEGACY_LAYOUT_FAMILIES,
    build_tiny_model,
    save_tiny_model,
    tiny_batch,
    tiny_config,
    tiny_prompts,
    tiny_tokenizer,
)

# Per-expert key of the original hub layout, as transformers' conversion mapping expects it.
LEGACY_EXPERT_KEY = {
    "mixtral": "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
    "phimoe": "model.layers.{l}.block_sparse_moe.experts.{e}.w1.weight",
    "qwen2_moe": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "qwen3_moe": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "olmoe": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "deepseek_v2": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
    "deepseek_v3": "model.layers.{l}.mlp.experts.{e}.gate_proj.weight",
}


def _keys(path) -> set[str]:
    keys: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), framework="pt") as f:
            keys.update(f.keys())
    return keys


@torch.no_grad()
def _logits(model, batch) -> torch.Tensor:
    return model(**batch).logits


@functools.lru_cache(maxsize=None)
def _reference_logits(family: str) -> torch.Tensor:
    """Logits of the seed-0 model on ``tiny_batch(tok, 4)``, computed once per family."""
    return _logits(build_tiny_model(family), tiny_batch(tiny_tokenizer(), 4))


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Tiny GEMMs gain nothing from intra-op threads, and on a loaded 2-core box spinning OpenMP
    workers make this module ~5x slower (50 s vs 9 s measured)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 4)


# ---------------------------------------------------------------------------- tokenizer, prompts


def test_tokenizer_roundtrip(tok, tmp_path):
    text = "def route(x):\n    return x @ w.T  # ünïcode too"
    assert tok.decode(tok(text)["input_ids"], skip_special_tokens=True) == text
    assert tok.padding_side == "left"
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (0, 1, 2)
    assert 256 < len(tok) <= 1024
    tok.save_pretrained(tmp_path)
    again = AutoTokenizer.from_pretrained(tmp_path)
    assert again.padding_side == "left"
    prompts = tiny_prompts(3)
    assert again(prompts)["input_ids"] == tok(prompts)["input_ids"]
    assert tiny_tokenizer() is not tok  # a fresh, independent object per call
    assert tiny_tokenizer().backend_tokenizer.to_str() == tok.backend_tokenizer.to_str()


def test_prompts_and_batch(tok, batch):
    prompts = tiny_prompts(6, min_words=10, seed=3)
    assert prompts == tiny_prompts(6, min_words=10, seed=3)
    assert prompts != tiny_prompts(6, min_words=10, seed=4)
    assert all(len(p.split()) >= 10 for p in prompts)
    assert len({len(p.split()) for p in prompts}) > 1

    ids, mask = batch["input_ids"], batch["attention_mask"]
    assert ids.shape == mask.shape and ids.shape[0] == 4 and ids.dtype == torch.long
    lengths = mask.sum(dim=1)
    assert int(lengths.min()) >= 16 and len(set(lengths.tolist())) == 4  # ragged
    assert bool((mask[:, -1] == 1).all())  # left padding: every row ends with a real token
    assert bool((ids[mask == 0] == tok.pad_token_id).all())
    for row, n in zip(ids, lengths):
        assert int(row[-n]) == tok.bos_token_id
    again = tiny_batch(tok, 4)
    assert torch.equal(again["input_ids"], ids) and torch.equal(again["attention_mask"], mask)


# ---------------------------------------------------------------------------- models


@pytest.mark.parametrize("family", FAMILIES)
def test_build_generate_route(family, tok, batch):
    model = build_tiny_model(family)
    assert not model.training and model.dtype == torch.float32
    assert model.config.vocab_size == len(tok)
    for p in model.parameters():
        assert torch.isfinite(p).all()
    logits = _logits(model, batch)  # [4, L, V]
    assert torch.isfinite(logits).all()
    assert torch.equal(logits, _reference_logits(family))
    assert logits[:, -1].std(dim=-1).min() > 1e-2  # not all equal

    # Record the experts each MoE layer computes (every *Experts module gets the routing indices).
    touched: dict[str, set[int]] = {}
    for name, module in model.named_modules():
        if type(module).__name__.endswith("Experts"):
            module.register_forward_pre_hook(
                lambda m, args, name=name: touched.setdefault(name, set()).update(args[1].flatten().tolist())
            )
    kwargs = dict(max_new_tokens=16, do_sample=False)
    out = model.generate(**batch, **kwargs)
    prompt_len = batch["input_ids"].shape[1]
    assert out.shape == (4, prompt_len + 16)
    assert torch.equal(out[:, :prompt_len], batch["input_ids"])
    n_moe = sum(type(m).__name__.endswith("Experts") for m in model.modules())
    assert len(touched) == n_moe >= 2
    assert all(len(experts) >= 4 for experts in touched.values()), touched

    # Same seed -> the same weights and the same greedy tokens; another seed -> other weights.
    again = build_tiny_model(family)
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
    assert torch.equal(again.generate(**batch, **kwargs), out)
    other = build_tiny_model(family, seed=1)
    assert not torch.equal(_logits(other, batch), logits)


def test_family_features():
    qwen2 = build_tiny_model("qwen2_moe")
    mlp = qwen2.model.layers[0].mlp
    assert hasattr(mlp, "shared_expert") and hasattr(mlp, "shared_expert_gate")

    for family in ("deepseek_v2", "deepseek_v3"):
        cfg = tiny_config(family)
        assert cfg.num_hidden_layers == 3 and cfg.first_k_dense_replace == 1
        assert cfg.qk_nope_head_dim + cfg.qk_rope_head_dim != cfg.v_head_dim
        assert cfg.q_lora_rank and cfg.kv_lora_rank
        ds = build_tiny_model(family)
        assert not hasattr(ds.model.layers[0].mlp, "experts")
        assert hasattr(ds.model.layers[1].mlp, "shared_experts")
    v3 = tiny_config("deepseek_v3")
    assert v3.n_routed_experts % v3.n_group == 0 and v3.topk_group <= v3.n_group
    assert v3.n_routed_experts // v3.n_group >= 2  # V3 scores a group by its top-2 experts

    oss = build_tiny_model("gpt_oss")
    assert set(oss.config.layer_types) == {"sliding_attention", "full_attention"}
    assert oss.config.sliding_window < 32  # shorter than prompt + new tokens, so the window matters
    experts = oss.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 64, 2 * 32)  # [E, H, 2I], transposed and interleaved
    assert experts.gate_up_proj_bias.abs().sum() > 0 and experts.down_proj_bias.abs().sum() > 0
    assert oss.model.layers[0].mlp.router.bias.abs().sum() > 0
    assert oss.model.layers[0].self_attn.sinks.abs().sum() > 0

    mixtral = build_tiny_model("mixtral")
    experts = mixtral.model.layers[0].mlp.experts
    assert experts.gate_up_proj.shape == (8, 2 * 32, 64) and experts.down_proj.shape == (8, 64, 32)

    bf16 = build_tiny_model("mixtral", dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert torch.equal(bf16.lm_head.weight, mixtral.lm_head.weight.to(torch.bfloat16))

    assert tiny_config("mixtral", num_hidden_layers=4).num_hidden_layers == 4
    assert tiny_config("gpt_oss", num_hidden_layers=4).layer_types[:2] == ["sliding_attention", "full_attention"]
    with pytest.raises(ValueError, match="unknown family"):
        tiny_config("llama")


# ---------------------------------------------------------------------------- checkpoints


@pytest.mark.parametrize("family", FAMILIES)
def test_save_reload(family, batch, tmp_path):
    path = save_tiny_model(family, tmp_path / "fused")
    assert (path / "config.json").exists() and (path / "tokenizer.json").exists()
    assert any(".experts.gate_up_proj" in k or ".experts.down_proj" in k for k in _keys(path))
    config = json.loads((path / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (1, 2, 0)

    reference = _reference_logits(family)
    reloaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert torch.equal(_logits(reloaded, batch), reference)
    tok = AutoTokenizer.from_pretrained(path)
    assert torch.equal(tiny_batch(tok, 4)["input_ids"], batch["input_ids"])

    sharded = save_tiny_model(family, tmp_path / "sharded", max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    reloaded = AutoModelForCausalLM.from_pretrained(sharded, attn_implementation="eager").eval()
    assert torch.equal(_logits(reloaded, batch), reference)


@pytest.mark.parametrize("family", FAMILIES)
def test_legacy_expert_keys(family, batch, tmp_path):
    if family not in LEGACY_LAYOUT_FAMILIES:
        with pytest.raises(NotImplementedError):
            save_tiny_model(family, tmp_path, legacy_expert_keys=True)
        return
    path = save_tiny_model(family, tmp_path, legacy_expert_keys=True, max_shard_size="200KB")
    keys = _keys(path)
    first_moe = getattr(tiny_config(family), "first_k_dense_replace", 0) or 0
    for e in range(8):
        assert LEGACY_EXPERT_KEY[family].format(l=first_moe, e=e) in keys
    assert not any(k.endswith((".experts.gate_up_proj", ".experts.down_proj")) for k in keys)
    if family == "mixtral":
        assert "model.layers.0.block_sparse_moe.gate.weight" in keys
        assert {f"model.layers.1.block_sparse_moe.experts.7.{w}.weight" for w in ("w1", "w2", "w3")} <= keys

    reloaded = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    assert torch.equal(_logits(reloaded, batch), _reference_logits(family))
