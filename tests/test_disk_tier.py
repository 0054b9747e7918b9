"""The disk tier: reads issued in file order and coalesced, whatever order experts are asked in."""

import pytest
import torch

import kinject
from kinject.io import checkpoint
from kinject.engine.store import disk_extent
from kinject.testing import build_tiny_model, save_tiny_model, tiny_batch, tiny_tokenizer

NEW = 6


def greedy(model, batch, tok):
    return model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 4, min_tokens=16)


@pytest.fixture(scope="module")
def ref(tok, batch):
    return greedy(build_tiny_model("mixtral"), batch, tok)


@pytest.fixture
def preadv_calls(monkeypatch):
    """Every ``preadv`` request kinject issues: (file, offset, bytes, pieces)."""
    calls, real = [], checkpoint._preadv

    def recording(fd, run):
        first = run[0][0]
        calls.append((first.file, first.offset, sum(len(view) for _, view in run), len(run)))
        real(fd, run)

    monkeypatch.setattr(checkpoint, "_preadv", recording)
    return calls


def _load(path, *extra):
    return kinject.from_pretrained(path, "rules/klotski.yaml", ["vars.experts=disk", "pipeline.disk_workers=1", *extra],
                                   attn_implementation="eager")


def _experts(store, layer: int, ids: list[int]):
    return [store[f"model.layers.{layer}.mlp.experts[{e}]"] for e in ids]


def _fetch_and_check(store, units, calls: list) -> list:
    """Start ``units`` as one batch and wait for them; returns the requests that read them (each
    unit is then checked against a read of its own)."""
    calls.clear()
    assert store.fetch_many(units) == len(units)
    tensors = store.acquire_many(units)
    batch_calls = list(calls)
    for unit, got in zip(units, tensors):
        for role, src in unit.tensors.items():
            assert torch.equal(got[role], src.read(unit.dtype)), (unit.name, role)
    store.release_many(units)
    return batch_calls


def test_per_expert_checkpoint_reads_a_hot_first_batch_in_file_order_adjacent_in_one_request(tmp_path, preadv_calls):
    path = save_tiny_model("mixtral", tmp_path / "ckpt", legacy_expert_keys=True)   # experts.{e}.w1/w2/w3 keys
    model = _load(path)
    store = model.kinject.store
    units = _experts(store, 0, [6, 1, 3, 2, 4])                  # hot-first: 6 first, 1..4 adjacent in the file
    starts = {u.name: disk_extent(u)[0][1] for u in units}
    assert all(len(u.extent) == 1 for u in units)               # w1, w2, w3 of one expert: back to back
    calls = _fetch_and_check(store, units, preadv_calls)
    file, size = disk_extent(units[0])[0][0], units[0].wire_nbytes
    # experts 1-4 in one request of their 12 tensors, then expert 6: ascending offsets, nothing else read
    assert calls == [(file, starts[units[1].name], 4 * size, 12), (file, starts[units[0].name], size, 3)]
    model.kinject.transfer.close()


def test_fused_checkpoint_reads_each_tensor_in_file_order(tmp_path, preadv_calls):
    path = save_tiny_model("mixtral", tmp_path / "ckpt")          # fused gate_up_proj / down_proj [E, ...]
    model = _load(path)
    store = model.kinject.store
    units = _experts(store, 1, [5, 2, 3, 0])
    calls = _fetch_and_check(store, units, preadv_calls)
    # runs [0], [2, 3], [5]: per run one request per fused tensor (2 and 3 together), runs in file order
    assert [c[3] for c in calls] == [1, 1, 2, 2, 1, 1]
    offsets = [c[1] for c in calls]
    assert offsets[0::2] == sorted(offsets[0::2]) and offsets[1::2] == sorted(offsets[1::2])
    model.kinject.transfer.close()


@pytest.mark.parametrize("legacy", [True, False])
def test_tokens_identical_to_transformers_with_experts_on_disk(tmp_path, tok, batch, ref, legacy, preadv_calls):
    path = save_tiny_model("mixtral", tmp_path / "ckpt", legacy_expert_keys=legacy)
    model = _load(path)
    assert torch.equal(greedy(model, batch, tok), ref)
    assert preadv_calls and model.kinject.store.stats["bytes"]["disk"] > 0
    model.kinject.transfer.close()
