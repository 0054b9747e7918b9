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


def test_routing_reads_choices_of_any_shape_in_flat_order():
    """A decode step's ``[1, k]`` choices are read without a view operation; any other shape in
    ``view(-1)`` order, and the counts are those of a bincount over the ids in range."""
    from operators.expert_routing import _counts_per_expert, _flat_ids

    for choices in (torch.tensor([[3, 1, 2]]), torch.tensor([3, 1]), torch.tensor([[1, 2], [3, 1]]),
                    torch.tensor([[[1, 2]], [[3, 0]]])):
        assert _flat_ids(choices) == choices.view(-1).tolist()
        counts, _, in_range = _counts_per_expert(choices, 4)
        assert counts == torch.bincount(choices.view(-1), minlength=4).tolist() and in_range
    assert _counts_per_expert(torch.tensor([[5, 1]]), 4)[0] == [0, 1, 0, 0]
