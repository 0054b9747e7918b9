"""The trained tiny Mixtral fixture (kinject/fixtures/tiny_moe): it loads with plain transformers,
models Python text far better than chance, and routes tokens in a skewed, layer-correlated way.

The thresholds are loose versions of what examples/routing_skew.py measured (see ROUTING.md).
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from kinject.fixtures import tiny_moe_path
from kinject.engine.prefetch import CorrelationTable

# Written for this test (not a stdlib file, so not in the training text), in the stdlib's style.
HELD_OUT = '''"""Utilities for reading simple key/value configuration files."""

import os
import re

__all__ = ["ConfigError", "read_config"]

_LINE = re.compile(r"^\\s*(?P<key>[A-Za-z_][A-Za-z0-9_]*)\\s*=\\s*(?P<value>.*?)\\s*$")


class ConfigError(ValueError):
    """Raised when a configuration file cannot be parsed."""

    def __init__(self, filename, lineno, msg):
        super().__init__(f"{filename}:{lineno}: {msg}")
        self.filename = filename
        self.lineno = lineno


def read_config(filename, defaults=None):
    """Return a dictionary with the keys and values of *filename*.

    Empty lines and lines starting with '#' are ignored.  If *defaults*
    is given, it is used for the keys that the file does not define.
    """
    result = dict(defaults or {})
    if not os.path.exists(filename):
        return result
    with open(filename, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            match = _LINE.match(line)
            if match is None:
                raise ConfigError(filename, lineno, "expected 'key = value'")
            result[match.group("key")] = match.group("value")
    return result
'''


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_moe_path())


@pytest.fixture(scope="module")
def held_out(model, tokenizer):
    """Loss and per-layer top-k choices of the model on HELD_OUT."""
    ids = tokenizer(HELD_OUT, return_tensors="pt")["input_ids"]                    # [1, T]
    with torch.no_grad():
        out = model(input_ids=ids, labels=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    choices = [lg.float().softmax(-1).topk(k, dim=-1).indices for lg in out.router_logits]  # L x [T, k]
    return {"ids": ids, "loss": float(out.loss), "choices": choices}


def test_checkpoint_layout():
    from safetensors import safe_open

    path = tiny_moe_path()
    config = json.loads((path / "config.json").read_text())
    assert config["model_type"] == "mixtral"
    assert (config["num_local_experts"], config["num_experts_per_tok"]) == (8, 2)
    assert 4 <= config["num_hidden_layers"] <= 6
    files = sorted(path.glob("*.safetensors"))
    assert sum(f.stat().st_size for f in files) <= 25_000_000
    with safe_open(str(files[0]), framework="pt") as f:
        keys = list(f.keys())
    assert any(k.endswith("experts.gate_up_proj") for k in keys), "expected the fused (transformers 5) expert layout"
    assert not any(".experts.0." in k for k in keys)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == config["eos_token_id"] and gen["pad_token_id"] == config["pad_token_id"]
    for name in ("ROUTING.md", "correlation.json", "tokenizer.json"):
        assert (path / name).is_file(), name


def test_tokenizer(tokenizer, model):
    assert len(tokenizer) == model.config.vocab_size == 4096
    assert [tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id] == [0, 1, 2, 3]
    assert tokenizer.padding_side == "left"
    ids = tokenizer(HELD_OUT)["input_ids"]
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == HELD_OUT       # byte-level: lossless
    assert len(ids) < len(HELD_OUT) / 2.5                                     # a real code vocabulary, not bytes


def test_perplexity_far_below_uniform(held_out, model):
    uniform = math.log(model.config.vocab_size)                              # 8.32 nats
    # Measured: 3.73 nats on HELD_OUT, 4.17 on the held-out stdlib files; a random model sits near uniform.
    assert held_out["loss"] < 0.6 * uniform, held_out["loss"]


def test_greedy_generation_looks_like_python(model, tokenizer):
    prompts = ["import os\nimport sys\n\n\ndef ", "class Parser:\n    def __init__(self"]
    batch = tokenizer(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=24, do_sample=False)
    new = out[:, batch["input_ids"].shape[1]:]
    for row in new:
        tokens = [t for t in row.tolist() if t != tokenizer.pad_token_id]
        text = tokenizer.decode(tokens, skip_special_tokens=True)
        assert len(set(tokens)) >= 4, text                                   # not one token repeated
        assert any(c in text for c in "():=,."), text                        # Python punctuation
        assert tokenizer.unk_token_id not in tokens


def test_routing_is_skewed_and_alive(held_out, model):
    E = model.config.num_local_experts
    top2, used = [], torch.zeros(E, dtype=torch.long)
    for c in held_out["choices"]:
        counts = torch.bincount(c.flatten(), minlength=E)
        used += counts
        top2.append(float(counts.sort(descending=True).values[:2].sum() / counts.sum()))
    # uniform routing gives 0.25; measured max over layers 0.40 on HELD_OUT and on held-out stdlib files
    assert max(top2) > 0.3, top2
    assert bool((used > 0).all()), used                                      # no dead expert


def test_correlation_table_predicts_next_layer(held_out, model):
    L, E = model.config.num_hidden_layers, model.config.num_local_experts
    table = CorrelationTable.load(tiny_moe_path() / "correlation.json", num_layers=L, num_experts=E)
    choices = held_out["choices"]
    hits = total = 0
    for layer in range(1, L):
        prev, cur = choices[layer - 1], choices[layer]
        for t in range(0, prev.shape[0], 4):                                 # every 4th token keeps it fast
            pred = set(table.predict(layer, prev[t:t + 1], 2))
            hits += len(pred & set(cur[t].tolist()))
            total += 2
    chance_hits = total * 2 / E
    # measured: 0.56 here, 0.59 on the held-out stdlib files (ROUTING.md); chance is 2/8 = 0.25
    assert hits > 1.6 * chance_hits, (hits / total)
