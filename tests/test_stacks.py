"""Stacks, not layer numbers: positions found from the module tree, in the order the model runs.

Pure checks of :mod:`kinject.stacks` on small module trees (several MoE blocks in one layer are
distinct positions; a router-looking module that scores no experts is not claimed), then every
encoder-decoder MoE family transformers registers (:func:`kinject.modal_families.seq2seq_families`)
under ``rules/klotski.yaml``: encoder and decoder stacks in execution order (measured with hooks),
every experts module a ``GroupedExperts`` whose container loop is replayed in Klotski's order,
identical greedy tokens to the untouched model.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import kinject
from kinject.modal_families import build_tiny_seq2seq_model, seq2seq_families
from kinject.stacks import Position, find_stacks
from operators.experts import GroupedExperts
from operators.gate import PrefetchGate

RULES = Path(__file__).resolve().parents[1] / "rules" / "klotski.yaml"


class _Experts(nn.Module):
    """Fused experts ``[E, 2I, H]`` / ``[E, H, I]`` (the fused layout)."""

    def __init__(self, n: int = 4, hidden: int = 8, inter: int = 6):
        super().__init__()
        self.num_experts = n
        self.gate_up_proj = nn.Parameter(torch.randn(n, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.randn(n, hidden, inter))


class _Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4, bias=False)
        self.experts = _Experts()


class _TwoMoeBlock(nn.Module):
    """One decoder layer routing two modalities to two MoE blocks (ERNIE-4.5-VL's shape)."""

    def __init__(self):
        super().__init__()
        self.self_attn = nn.Linear(8, 8)
        self.mlp = nn.Module()
        self.mlp.text_moe, self.mlp.vision_moe = _Moe(), _Moe()


class _Tree(nn.Module):
    def __init__(self):
        super().__init__()
        self.visual = nn.Module()
        self.visual.blocks = nn.ModuleList([nn.Sequential(nn.Linear(8, 8)) for _ in range(2)])
        self.language_model = nn.Module()
        self.language_model.layers = nn.ModuleList([_TwoMoeBlock() for _ in range(2)])
        self.lm_head = nn.Linear(8, 8)


def test_stacks_in_tree_order_and_several_moe_blocks_in_one_layer_are_distinct_positions():
    stacks = find_stacks(_Tree())
    assert [(s.path, s.length) for s in stacks] == [("visual.blocks", 2), ("language_model.layers", 2)]
    moe = [f"language_model.layers.{i}.mlp.{part}.{leaf}" for i in range(2)
           for part in ("vision_moe", "text_moe") for leaf in ("experts", "gate")]
    for key in moe:
        stacks.declare(key)
    assert stacks.position(moe[2], moe=True) == Position("language_model.layers", 0, "mlp.text_moe")
    ordinals = {key: stacks.ordinal(key, moe=True) for key in moe}
    # tower blocks 0, 1; layer 0: text_moe 2 (tree order first), vision_moe 3; layer 1: 4, 5
    assert ordinals == {moe[0]: 3, moe[1]: 3, moe[2]: 2, moe[3]: 2, moe[4]: 5, moe[5]: 5, moe[6]: 4, moe[7]: 4}
    assert stacks.ordinal("visual.blocks.1.0") == 1
    assert stacks.ordinal("language_model.layers.1.self_attn") == 4        # a block's first position
    assert stacks.ordinal("lm_head") is None
    with pytest.raises(RuntimeError, match="declared after positions were numbered"):
        stacks.declare("language_model.layers.0.mlp.gate")


def test_block_level_experts_operator_shares_its_routers_position():
    """A layout that runs the MoE block itself (its key is the block) pairs with the router inside it."""
    stacks = find_stacks(_Tree())
    stacks.declare("language_model.layers.1.mlp.text_moe")            # experts operator on the block
    stacks.declare("language_model.layers.1.mlp.text_moe.gate")
    assert stacks.ordinal("language_model.layers.1.mlp.text_moe", moe=True) == \
        stacks.ordinal("language_model.layers.1.mlp.text_moe.gate", moe=True) == 3


class _ResidualGate(nn.Module):
    """Looks like a router by its class name; mixes a residual, scores no experts."""

    def __init__(self, hidden: int = 8):
        super().__init__()
        self.gate = nn.Parameter(torch.zeros(hidden))


def test_a_module_that_only_looks_like_a_router_is_not_claimed():
    layer = _TwoMoeBlock()
    layer.post_attention_residual_gate = _ResidualGate()
    assert PrefetchGate.accepts(layer.mlp.text_moe.gate, layer.mlp.text_moe)
    assert not PrefetchGate.accepts(layer.post_attention_residual_gate, layer)


def _encoder_batch(vocab: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(5, vocab, (3, 9), generator=g)                  # 3 rows: not a multiple of 2
    mask = torch.ones_like(ids)
    mask[0, :3] = 0                                                     # a padded encoder sequence
    return {"input_ids": ids, "attention_mask": mask}


def _generate(model, batch, **kwargs) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**batch, max_new_tokens=4, do_sample=False, **kwargs)


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("model_type", seq2seq_families())
def test_encoder_decoder_moe_family_ports_with_klotski_rules(model_type, tier, tmp_path):
    model = build_tiny_seq2seq_model(model_type)
    batch = _encoder_batch(model.config.vocab_size)
    ref, ref_beams = _generate(model, batch), _generate(model, batch, num_beams=2)
    ran: list[str] = []
    stacks = find_stacks(model)
    hooks = [block.register_forward_pre_hook(lambda *_, p=s.path: ran.append(p))
             for s in stacks for block in model.get_submodule(s.path)]
    model(**batch, decoder_input_ids=ref[:, :1])
    for h in hooks:
        h.remove()
    first_run = list(dict.fromkeys(ran))
    assert first_run == [s.path for s in stacks] and len(stacks) == 2, (first_run, stacks)

    expected = sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Experts"))
    kinject.optimize(model, RULES, ["pipeline.micro_batch_size=2", "pipeline.n_batches=2", "pipeline.emulate_bandwidth=1000",
                                    f"pipeline.offload_dir={tmp_path}/off", f"vars.weights={tier}"])
    rt = model.kinject
    experts = [op for op in rt.operators if isinstance(op, GroupedExperts)]
    assert sorted(op.key for op in experts) == expected and expected
    assert all(op.layout.name == "module_list" and len(op.units) == model.config.num_experts for op in experts)
    assert {u.tier for op in experts for u in op.units} == {tier}
    layers = [op.layer for op in experts]
    assert layers == sorted(layers) and len(set(layers)) == len(layers)     # one position each, run order
    gates = {op.layer for op in rt.operators if isinstance(op, PrefetchGate)}
    assert gates == set(layers)
    called: set[str] = set()
    scheduled: set[str] = set()              # the container's own loop is replayed: Klotski's order, not the loop's
    hooks = [op.register_forward_hook(lambda m, *_: called.add(m.key)) for op in experts]
    for op in experts:
        op.order_policy.schedule = lambda *a, op=op, schedule=op.order_policy.schedule, **k: \
            scheduled.add(op.key) or schedule(*a, **k)
    assert all(op.calls.replays for op in experts)
    assert torch.equal(_generate(model, batch), ref)
    assert torch.equal(_generate(model, batch, num_beams=2), ref_beams)
    assert called == set(expected) == scheduled          # every MoE block's experts ran through its operator
    for h in hooks:
        h.remove()
    for op in experts:
        del op.order_policy.schedule
    kinject.restore(model)
    assert torch.equal(_generate(model, batch), ref)
