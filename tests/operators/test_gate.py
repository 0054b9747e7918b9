"""Where a router's output holds its top-k indices: found once per gate, then checked per call."""

from __future__ import annotations

import torch

from operators.expert_routing import indices_at, router_index_position


def test_router_index_position_in_each_output_shape():
    idx = torch.tensor([[1, 3], [0, 2]])
    scores = torch.rand(2, 4)
    assert router_index_position((scores, torch.rand(2, 2), idx)) == 2         # transformers 5: (logits, weights, ids)
    assert router_index_position([idx.to(torch.int32), scores]) == 0
    assert router_index_position(idx) == -1                                    # the output itself
    assert router_index_position((scores, idx.bool())) is None                # no integer [T, k]: none
    assert router_index_position((scores, idx.flatten())) is None             # 1-D: not top-k choices
    assert router_index_position(scores) is None


def test_indices_at_checks_the_remembered_position():
    idx = torch.tensor([[1, 3], [0, 2]])
    out = (torch.rand(2, 4), torch.rand(2, 2), idx)
    assert indices_at(out, 2) is idx and indices_at(idx, -1) is idx
    assert indices_at(out, 0) is None                                          # floats there: look again
    assert indices_at((torch.rand(2, 4),), 2) is None                         # a shorter output: look again
    assert indices_at(idx, 0) is None                                          # not a tuple any more
