"""Experts on disk read per expert, whatever the layout: a unit of expert ``e`` references exactly
``e``'s rows of the checkpoint tensor (``CheckpointIndex.rows_source``), set-up reads none of them,
and a fetch reads only its own bytes.

Every byte read from a checkpoint goes through ``kinject.engine.disk_sources.read_pieces``; the tests count
what it reads instead of measuring memory.
"""

from __future__ import annotations

import copy
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

import kinject
import kinject.engine.disk_sources as disk_sources
from kinject import families
from kinject.io.checkpoint import CheckpointIndex
from operators.experts import GroupedExperts
from test_any_family import _generate, _overrides, _rules


class _Reads:
    """Every piece ``read_pieces`` reads: (file, key, offset, nbytes)."""

    def __init__(self, monkeypatch):
        self.pieces: list[tuple[str, str, int, int]] = []
        original = disk_sources.read_pieces

        def counting(placed, **kwargs):
            for piece, _ in placed:
                p = piece.located()
                self.pieces.append((p.file, p.key, p.offset, p.nbytes))
            return original(placed, **kwargs)

        monkeypatch.setattr(disk_sources, "read_pieces", counting)

    def take(self) -> list[tuple[str, str, int, int]]:
        got, self.pieces = self.pieces, []
        return got


def _save_fused(model, path: Path) -> None:
    """The model's own state dict as one safetensors file (experts as the model holds them:
    3-D ``[E, ...]`` keys, not the family's per-expert conversion)."""
    path.mkdir(parents=True)
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target in tied:
        state.pop(target, None)
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    model.config.save_pretrained(path)
    if model.generation_config is not None:
        model.generation_config.save_pretrained(path)


@pytest.mark.parametrize("model_type,fmt", [("dbrx", "own"), ("longcat_flash", "own"), ("longcat_flash", "fused"),
                                            ("jetmoe", "own"), ("mixtral", "own")])
def test_disk_experts_read_only_their_rows(model_type, fmt, tmp_path, monkeypatch):
    """DBRX (2-D stacked ``w1[E*R, H]``: rows), LongCat (zero-compute experts beside 8 real ones;
    per-expert keys in its own format, ``[10, ...]`` / ``[8, ...]`` keys when saved fused), JetMoE
    (parallel experts), Mixtral (fused, the reference): the same tokens as the untouched model, no
    expert byte read at set-up, each unit of expert ``e`` covering exactly its part, and every
    expert read afterwards one unit's own pieces."""
    model = families.build_tiny_family_model(model_type)
    ref = _generate(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fmt == "own":
            model.save_pretrained(tmp_path / "ckpt")
        else:
            _save_fused(model, tmp_path / "ckpt")
    del model
    reads = _Reads(monkeypatch)
    ported = kinject.from_pretrained(tmp_path / "ckpt", copy.deepcopy(_rules()),
                                     _overrides(tmp_path, "vars.weights=disk"), attn_implementation="eager")
    setup = reads.take()
    experts = [op for op in ported.kinject.operators if isinstance(op, GroupedExperts)]
    assert experts and all(u.tier == "disk" for op in experts for u in op.units)

    unit_pieces: set[tuple[str, str, int, int]] = set()
    for op in experts:
        params = dict(op.binding.params)
        spans: dict[tuple[str, str], list[tuple[int, int]]] = {}
        for e, unit in enumerate(op.units):
            for name, src in unit.tensors.items():
                assert isinstance(src, disk_sources.Source), f"{unit.name}.{name} is not a lazy checkpoint reference"
                part = op.layout.part(name, torch.empty(params[name].shape, device="meta"), e)
                assert tuple(src.shape) == tuple(part.shape), (unit.name, name)
                located = [p.located() for p in src.pieces]
                assert sum(p.nbytes for p in located) == math.prod(part.shape) * src.dtype.itemsize
                for p in located:
                    unit_pieces.add((p.file, p.key, p.offset, p.nbytes))
                    spans.setdefault((p.file, p.key), []).append((p.offset, p.offset + p.nbytes))
        for ranges in spans.values():                          # no two experts share a byte
            ranges.sort()
            assert all(a[1] <= b[0] for a, b in zip(ranges, ranges[1:]))
    expert_keys = {(f, k) for f, k, _, _ in unit_pieces}
    assert not [r for r in setup if (r[0], r[1]) in expert_keys], "set-up read expert bytes"

    out = _generate(ported)
    assert torch.equal(out, ref)
    used = [r for r in reads.take() if (r[0], r[1]) in expert_keys]
    assert used, "no expert was read from disk"
    assert set(used) <= unit_pieces, "an expert read was not one unit's own piece"


def test_rows_source_reads_a_row_range(tmp_path):
    """Rows ``start .. stop`` of a key (and one row, squeezed): one contiguous byte range."""
    w = torch.arange(6 * 4 * 3, dtype=torch.float32).reshape(6 * 4, 3)       # [E*R, H], E=6, R=4
    save_file({"w": w, "x": torch.ones(5, 2, 3)}, str(tmp_path / "model.safetensors"))
    holder = nn.Module()
    holder.w = nn.Parameter(torch.empty(24, 3, device="meta"))
    holder.x = nn.Parameter(torch.empty(5, 2, 3, device="meta"))
    index = CheckpointIndex.open(tmp_path, holder)
    src = index.rows_source("w", 8, 12)
    assert src.shape == (4, 3) and src.nbytes == 4 * 3 * 4
    assert torch.equal(src.read(), w[8:12])
    one = index.rows_source("x", 3, 4, squeeze=True)
    assert one.shape == (2, 3) and one.nbytes == 2 * 3 * 4
    assert torch.equal(index.rows_source("w", 5, 6, squeeze=True).read(), w[5])
    with pytest.raises(IndexError):
        index.rows_source("w", 20, 25)
    header = json.loads((tmp_path / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (tmp_path / "model.safetensors").read_bytes()[:8], "little")])
    assert src.pieces[0].located().offset > header["w"]["data_offsets"][0]       # not from the key's start


@pytest.mark.parametrize("dim", [0, 1])
def test_rows_source_of_concatenated_keys(dim, tmp_path):
    """A target that a conversion concatenates from several keys (``Concatenate(dim)``): each key
    gives its part of the rows, no other bytes."""
    from kinject.engine.safetensors_header import read_header
    from kinject.io.checkpoint import _Plan
    from kinject.io.conversions import Recipe

    a, b = torch.randn(4, 3), torch.randn(2 if dim == 0 else 4, 3 if dim == 0 else 5)
    save_file({"a": a, "b": b}, str(tmp_path / "model.safetensors"))
    whole = torch.cat([a, b], dim=dim)
    entries = read_header(str(tmp_path / "model.safetensors"))
    plan = _Plan("t", recipe=Recipe(False, dim, ("a", "b"), (None, None)), concat=[entries["a"], entries["b"]])
    index = CheckpointIndex(tmp_path, [str(tmp_path / "model.safetensors")], {"t": whole}, {"t": plan}, set())
    for start, stop in [(0, whole.shape[0]), (1, 3), (3, whole.shape[0])]:
        src = index.rows_source("t", start, stop)
        assert torch.equal(src.read(), whole[start:stop])
        assert src.nbytes == whole[start:stop].numel() * 4
    assert torch.equal(index.rows_source("t", 2, 3, squeeze=True).read(), whole[2])


@pytest.mark.parametrize("model_type", ["dbrx", "mixtral"])
@pytest.mark.parametrize("tier", ["host", "device"])
def test_loaded_host_and_device_experts_keep_one_stacked_tensor(model_type, tier, tmp_path):
    """Experts loaded by ``from_pretrained`` on the host or device tier are views of one tensor per
    parameter (one read of the checkpoint tensor, one pinned buffer on CUDA): their ``[E, ...]``
    layout stays, so the grouped GEMM runs over it; tokens as the untouched model's."""
    model = families.build_tiny_family_model(model_type)
    ref = _generate(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model.save_pretrained(tmp_path / "ckpt")
    del model
    ported = kinject.from_pretrained(tmp_path / "ckpt", copy.deepcopy(_rules()),
                                     _overrides(tmp_path, f"vars.weights={tier}"), attn_implementation="eager")
    experts = [op for op in ported.kinject.operators if isinstance(op, GroupedExperts)]
    assert experts and all(u.tier == tier for op in experts for u in op.units)
    for op in experts:
        own = [u.tensors if u.offloaded else u.device for u in op.units]
        for role in own[0]:
            assert len({d[role].untyped_storage().data_ptr() for d in own}) == 1, f"{op.key}.{role}: not one tensor"
        if model_type == "mixtral":      # fused [E, ...] experts: the grouped GEMM's layout
            views = op.layout.stacked_views(own)
            assert views is not None and all(torch.equal(views[r][e], own[e][r]) for r in views for e in range(len(own)))
    assert torch.equal(_generate(ported), ref)
