"""Every multimodal MoE family transformers registers, ported by ``rules/klotski.yaml`` alone.

The families come from scanning transformers' generative auto mappings beyond causal LM
(:func:`kinject.modal_families.modal_moe_families`; the encoder-decoder ones run in
``tests/test_stacks.py``). For each: a tiny model with its towers shrunk, a batch of 3 left-padded
prompts (not a multiple of the micro-batch of 2) with one real image each through the family's own
image processor where transformers has a PIL one (text prompts otherwise), then the same greedy
tokens as the untouched model with attention, routers and experts taken by kinject (weights on the
host tier, and on the disk tier written from the model), every experts module a ``GroupedExperts``,
and the stacks in the order they run.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

import kinject
from kinject import modal_families
from kinject.stacks import find_stacks
from operators.experts import GroupedExperts

RULES = Path(__file__).resolve().parents[1] / "rules" / "klotski.yaml"
FAMILIES = [m for m, modality in modal_families.modal_moe_families().items() if modality != "seq2seq"]


def _generate(model, batch) -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return model.generate(**batch, max_new_tokens=3, do_sample=False)


def _reference(model_type: str):
    """(model, batch, tokens) of the untouched model, or None for a listed failure."""
    try:
        model = modal_families.build_tiny_modal_model(model_type)
        batch = modal_families.image_batch(model, model_type) if hasattr(model.config, "vision_config") else None
        batch = batch or modal_families.text_batch()
        return model, batch, _generate(model, batch)
    except Exception as exc:  # noqa: BLE001
        assert model_type in modal_families.KNOWN_FAILURES, f"{model_type} fails untouched and is not listed: {exc!r}"
        return None


def _run_order(model, batch) -> list[str]:
    """The stacks whose blocks ran in one forward, in the order they first ran."""
    ran: list[str] = []
    stacks = find_stacks(model)
    hooks = [block.register_forward_pre_hook(lambda *_, p=s.path: ran.append(p))
             for s in stacks for block in model.get_submodule(s.path)]
    try:
        with torch.no_grad():
            model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return list(dict.fromkeys(ran))


@pytest.mark.parametrize("tier", ["host", "disk"])
@pytest.mark.parametrize("model_type", FAMILIES)
def test_multimodal_family_ports_with_klotski_rules(model_type, tier, tmp_path):
    if model_type in modal_families.NOT_BUILT:
        pytest.skip(modal_families.NOT_BUILT[model_type])
    got = _reference(model_type)
    if got is None:
        return
    assert model_type not in modal_families.KNOWN_FAILURES, f"{model_type} runs; drop it from KNOWN_FAILURES"
    model, batch, ref = got
    stacks = [s.path for s in find_stacks(model)]
    ran = _run_order(model, batch)
    assert ran == [s for s in stacks if s in ran]                       # stacks numbered in run order
    if "pixel_values" in batch:
        assert len(ran) >= 2, ran                                       # the tower ran, then the decoder
        blank = {**batch, "pixel_values": torch.zeros_like(batch["pixel_values"])}
        with torch.no_grad():
            assert not torch.equal(model(**batch).logits, model(**blank).logits)   # the image matters
    experts = sorted(n for n, m in model.named_modules() if type(m).__name__.endswith("Experts"))
    kinject.optimize(model, RULES, ["pipeline.micro_batch_size=2", "pipeline.n_batches=2", "pipeline.emulate_bandwidth=1000",
                                    f"pipeline.offload_dir={tmp_path}/off", f"vars.weights={tier}"])
    ops = [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]
    assert experts and sorted(op.key for op in ops) == experts
    assert all(len(op.units) == op.stored > 0 and {u.tier for u in op.units} == {tier} for op in ops)
    called: set[str] = set()
    hooks = [op.register_forward_hook(lambda m, *_: called.add(m.key)) for op in ops]
    assert torch.equal(_generate(model, batch), ref)
    for h in hooks:
        h.remove()
    if "pixel_values" in batch:             # per-modality experts too (ERNIE-4.5-VL's vision_moe)
        assert called == set(experts)
    kinject.restore(model)
