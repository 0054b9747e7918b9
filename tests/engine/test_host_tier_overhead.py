"""Every expert in the host tier of a CPU device: kinject does the work transformers does, no more.

At the Qwen3-30B-A3B width, ``rules/klotski.yaml --set vars.experts=host`` cost
more than plain transformers because attention ran once per micro-batch (4x its matmuls at batch 8,
micro-batches of 2) with nothing to overlap: on a CPU with no link the host tier is the compute
memory, the KV is used in place, and no weight moves. Pinned here with exact aten op counts of one
``generate`` (a noisy machine cannot blur them) on a bfloat16 checkpoint in the per-expert hub layout
(the experts then compute through one grouped GEMM per projection on the stacked host tensors, as
transformers' ``grouped_mm`` experts do), against transformers loading the same checkpoint.
"""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import kinject
from kinject.testing import save_tiny_model, tiny_batch
from operators.attention import OffloadedAttention

LAYERS, NEW, ROWS = 2, 4, 8


class OpCounts(TorchDispatchMode):
    """aten op name -> calls, for everything run under it."""

    def __init__(self):
        super().__init__()
        self.calls: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def counted_generate(model, batch, tok) -> tuple[torch.Tensor, collections.Counter]:
    with OpCounts() as ops:
        out = model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             pad_token_id=tok.pad_token_id)
    return out, ops.calls


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return save_tiny_model("qwen3_moe", tmp_path_factory.mktemp("hub") / "ckpt", dtype=torch.bfloat16,
                           legacy_expert_keys=True, num_hidden_layers=LAYERS)


def test_host_tier_experts_on_a_cpu_run_hfs_matmuls_once_per_layer(checkpoint, tok, tmp_path):
    from transformers import AutoModelForCausalLM

    batch = tiny_batch(tok, ROWS, min_tokens=8)
    ref_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.bfloat16).eval()
    ref, hf = counted_generate(ref_model, batch, tok)
    # (pipeline.host_gemv=torch: kinject's own GEMV would take the decode projections off torch's mm counts)
    model = kinject.from_pretrained(checkpoint, "rules/klotski.yaml",
                                    ["vars.experts=host", f"pipeline.offload_dir={tmp_path}/off", "pipeline.host_gemv=torch"],
                                    dtype=torch.bfloat16)
    assert model.kinject.pipeline.micro_batch_size < ROWS               # the rule file asks for micro-batches
    out, kj = counted_generate(model, batch, tok)
    assert torch.equal(out, ref)
    forwards = NEW                                                       # prefill + NEW - 1 decode steps
    # attention once per layer and forward on the whole batch, as transformers: the same projections
    assert [op.kv.tier for op in model.kinject.operators if isinstance(op, OffloadedAttention)] == ["host"] * LAYERS
    assert kj["mm"] + kj["bmm"] == hf["mm"] + hf["bmm"]
    assert kj["_scaled_dot_product_flash_attention_for_cpu"] == \
        hf["_scaled_dot_product_flash_attention_for_cpu"] == LAYERS * forwards
    # the experts: one grouped GEMM per projection, layer and forward, on the stacked host tensors
    assert kj["_grouped_mm"] == hf["_grouped_mm"] == 2 * LAYERS * forwards
    # the KV appended in place (keys, values per layer and forward; the prompt's once more, from the
    # prefill's buffer into the store), nothing else copied (transformers' cache cats the whole KV instead)
    assert kj["copy_"] == 2 * LAYERS * (forwards + 1) and hf["copy_"] == 0 and hf["cat"] >= 2 * LAYERS * (forwards - 1)
    assert sum(kj.values()) <= 1.1 * sum(hf.values())
    model.kinject.transfer.close()
