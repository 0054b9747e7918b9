"""The disk tier: reads issued in file order and coalesced, whatever order experts are asked in."""

import io
from pathlib import Path

import pytest
import torch

import kinject
from kinject.engine import disk_runs, disk_sources
from kinject.engine.disk_runs import DENSE_READS, disk_extent, read_density
from kinject.engine.store import TensorStore
from kinject.engine.transfer import TransferEngine
from kinject.errors import KinjectError
from kinject.testing import build_tiny_model, save_tiny_model, tiny_batch

NEW = 6


def greedy(model, batch, tok):
    return model.generate(**batch, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id)


@pytest.fixture(scope="module")
def batch(tok):
    return tiny_batch(tok, 4, min_tokens=16)


@pytest.fixture(scope="module")
def ref(tok, batch):
    return greedy(build_tiny_model("mixtral"), batch, tok)


@pytest.fixture
def preadv_calls(monkeypatch):
    """Every ``preadv`` request kinject issues: (file, offset, bytes, pieces)."""
    calls, real = [], disk_sources._preadv

    def recording(fd, run):
        first = run[0][0]
        calls.append((first.file, first.offset, sum(len(view) for _, view in run), len(run)))
        real(fd, run)

    monkeypatch.setattr(disk_sources, "_preadv", recording)
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


@pytest.mark.parametrize("setting, dense, sparse", [("auto", True, False), ("true", True, True),
                                                  ("false", False, False)])
def test_readahead_per_batch_dense_reads_get_it_sparse_ones_read_exactly_their_bytes(tmp_path, monkeypatch, setting,
                                                                                      dense, sparse):
    """``pipeline.disk_readahead: auto``: a batch of units covering most of the bytes it spans (a
    prefill's whole layer) is read with kernel readahead, a sparse one (a decode step's few routed
    experts) without it (POSIX_FADV_RANDOM: exactly its bytes); true / false: every batch alike."""
    path = save_tiny_model("mixtral", tmp_path / "ckpt", legacy_expert_keys=True)
    model = _load(path, f"pipeline.disk_readahead={setting}")
    store = model.kinject.store
    seen, real = [], disk_runs.read_sources
    monkeypatch.setattr(disk_runs, "read_sources", lambda items, readahead=True: (seen.append(readahead),
                                                                                   real(items, readahead=readahead)))
    whole, few = _experts(store, 0, list(range(8))), _experts(store, 1, [0, 7])
    assert read_density(whole) == 1.0 and read_density(few) < DENSE_READS
    for units, want in ((whole, dense), (few, sparse)):
        seen.clear()
        assert store.fetch_many(units) == len(units)
        store.acquire_many(units)
        assert seen and set(seen) == {want}, (setting, seen)
        store.release_many(units)
    model.kinject.transfer.close()


@pytest.mark.parametrize("legacy", [True, False])
def test_tokens_identical_to_transformers_with_experts_on_disk(tmp_path, tok, batch, ref, legacy, preadv_calls):
    path = save_tiny_model("mixtral", tmp_path / "ckpt", legacy_expert_keys=legacy)
    model = _load(path)
    assert torch.equal(greedy(model, batch, tok), ref)
    assert preadv_calls and model.kinject.store.stats["bytes"]["disk"] > 0
    model.kinject.transfer.close()


# ---------------------------------------------------------------- the host cache of the disk tier

UNIT = 64 * 4                                             # bytes of one test unit


def _disk_store(tmp_path, host_budget: int | None, n: int = 5):
    store = TensorStore("cpu", TransferEngine("cpu", inline=True), offload_dir=tmp_path, host_budget=host_budget)
    units = [store.add(f"e{i}", {"w": torch.full((64,), float(i))}, "disk", owner="experts") for i in range(n)]
    return store, units


def _use(store, units) -> list[dict]:
    """One step's use of ``units`` as an experts layer does: start their loads as one batch, acquire,
    release (free policy: dropped from the device)."""
    store.fetch_many(units)
    got = store.acquire_many(units)
    store.release_many(units)
    return got


def _cached(store) -> list[str]:
    return sorted(u.name for u in store.units.values() if u.host_cache is not None)


def test_disk_units_read_once_are_served_from_host_memory_in_place(tmp_path, preadv_calls):
    """On a CPU device a cached unit's device copy is its cache entry: it stays materialised between uses
    (nothing to load again, no hit to count) until the end of a generate (``discard_idle``); after that
    a use is a hit served from RAM in place."""
    store, units = _disk_store(tmp_path, host_budget=10 * UNIT)
    first = _use(store, units)
    assert len(preadv_calls) == 5 and _cached(store) == [u.name for u in units]
    assert all(u.device is u.host_cache for u in units)  # kept: the entry itself
    preadv_calls.clear()
    again = _use(store, units[::-1])[::-1]
    assert preadv_calls == [] and store.stats["loads"] == 5    # nothing read from disk, nothing loaded again
    assert store.discard_idle() == 5 and all(u.device is None for u in units)
    third = _use(store, units)
    assert preadv_calls == []
    for i, (a, b, c, u) in enumerate(zip(first, again, third, units)):
        assert c["w"] is u.host_cache["w"] and a["w"] is b["w"] is c["w"]   # CPU device: the cached tensor, no copy
        assert torch.equal(c["w"], torch.full((64,), float(i)))
    c = store.summary()["host_cache"]
    assert (c["hits"], c["misses"], c["disk_bytes"], c["ram_bytes"]) == (5, 5, 5 * UNIT, 5 * UNIT)
    assert c["held_bytes"] == 5 * UNIT and c["capacity"] == 10 * UNIT


def test_host_cache_hits_on_a_cpu_are_materialised_without_a_transfer_job(tmp_path, preadv_calls):
    """A hit whose cached tensors are the device copy (CPU, compute dtype) is placed at once, as a host
    unit used in place is: no job, no handle; the load and its bytes are still counted."""
    store, units = _disk_store(tmp_path, host_budget=10 * UNIT)
    _use(store, units)
    store.discard_idle()                                  # (the end of a generate: kept copies dropped)
    jobs = sum(store.transfer.stats["jobs"].values())
    store.fetch_many(units)
    assert all(u.handle is None and u.device["w"] is u.host_cache["w"] for u in units)
    assert sum(store.transfer.stats["jobs"].values()) == jobs + len(units)
    assert store.stats["host_cache"]["hits"] == len(units) and store.stats["loads"] == 2 * len(units)
    got = store.acquire_many(units)
    store.release_many(units)
    assert all(g["w"] is u.host_cache["w"] and u.device is u.host_cache for g, u in zip(got, units))   # kept
    assert store.drop_host_cache() == 5 * UNIT and all(u.device is None for u in units)   # evicted with its entry


def test_a_cached_unit_used_in_place_is_settled_until_its_entry_is_forgotten(tmp_path, preadv_calls):
    """On a CPU device without a budget a cached disk unit's entry is its device copy: even after the
    end of a generate forgot that copy, a prefetch would start nothing for it (an acquire serves it in
    place), so it is settled; forgetting the entry moves ``drops`` (callers that saw it settled look
    again) and it is not settled any more. Unread units are not settled."""
    store, units = _disk_store(tmp_path, host_budget=10 * UNIT)
    assert not any(store.settled(u) for u in units)                    # never read: a prefetch would read
    _use(store, units[:3])
    store.discard_idle()                                  # (the end of a generate: kept copies dropped)
    assert all(u.device is None for u in units)
    assert [store.settled(u) for u in units] == [True, True, True, False, False]
    drops = store.drops
    assert store.drop_host_cache() == 3 * UNIT
    assert store.drops == drops + 3 and not any(store.settled(u) for u in units)
    preadv_calls.clear()
    _use(store, units[:1])
    assert len(preadv_calls) == 1                         # read again from disk


def test_dropping_the_host_cache_makes_the_next_use_read_from_disk(tmp_path, preadv_calls):
    store, units = _disk_store(tmp_path, host_budget=10 * UNIT)
    _use(store, units)
    held = store.acquire(units[0])                        # in use: its entry stays
    assert store.drop_host_cache() == 4 * UNIT and _cached(store) == ["e0"]
    store.release(units[0])
    preadv_calls.clear()
    got = _use(store, units[1:])
    assert len(preadv_calls) == 4 and _cached(store) == [u.name for u in units]   # each dropped one read again
    assert held["w"] is units[0].host_cache["w"] and torch.equal(got[3]["w"], torch.full((64,), 4.0))


def test_host_cache_keeps_the_experts_predicted_hot_within_the_budget(tmp_path, preadv_calls):
    store, units = _disk_store(tmp_path, host_budget=2 * UNIT)
    score = {"e0": 1.0, "e1": 5.0, "e2": 0.0, "e3": 3.0, "e4": 2.0}
    store.cache_scores["experts"] = lambda u: score[u.name]
    _use(store, units)
    assert _cached(store) == ["e1", "e3"]                 # the two likeliest of the batch
    preadv_calls.clear()
    _use(store, [units[4], units[1], units[0]])
    assert len(preadv_calls) == 2 and _cached(store) == ["e1", "e3"]   # e4, e0 less likely: read, not kept
    score["e4"] = 4.0                                     # the table now predicts e4 above e3
    _use(store, [units[4]])
    assert _cached(store) == ["e1", "e4"] and store.stats["host_cache"]["evictions"] == 1
    assert units[3].device is None and units[4].device is units[4].host_cache   # e3's kept copy went with its entry
    assert store.host_cached == 2 * UNIT and store.host_cached_peak <= 2 * UNIT


def test_host_cache_without_a_prediction_evicts_least_recently_used(tmp_path):
    store, units = _disk_store(tmp_path, host_budget=2 * UNIT)
    for u in units[:3]:
        _use(store, [u])
    assert _cached(store) == ["e1", "e2"] and store.host_cached_peak == 2 * UNIT


def test_host_tier_counts_against_host_budget_and_no_budget_caches_nothing(tmp_path):
    store, units = _disk_store(tmp_path, host_budget=3 * UNIT)
    store.add("resident_in_ram", {"w": torch.zeros(64)}, "host")
    assert store.host_cache_capacity == 2 * UNIT
    _use(store, units)
    assert len(_cached(store)) == 2
    store, units = _disk_store(tmp_path / "none", host_budget=None)
    _use(store, units)
    assert _cached(store) == [] and store.host_cache_capacity == 0


def test_second_generate_reads_nothing_from_disk_when_the_host_budget_holds_every_expert(
        tmp_path, tok, batch, ref, preadv_calls):
    model = _load(save_tiny_model("mixtral", tmp_path / "ckpt"), "pipeline.host_budget=64MiB")
    store = model.kinject.store
    assert torch.equal(greedy(model, batch, tok), ref)
    assert store.stats["host_cache"]["disk_bytes"] > 0
    preadv_calls.clear()
    store.reset_stats()
    assert torch.equal(greedy(model, batch, tok), ref)
    c = store.summary()["host_cache"]
    assert preadv_calls == [] and c["disk_bytes"] == 0 and c["misses"] == 0 and c["hits"] > 0
    assert "host cache of the disk tier" in model.kinject.report(file=io.StringIO())
    model.kinject.transfer.close()


def test_host_budget_for_a_few_experts_keeps_tokens_and_the_budget(tmp_path, tok, batch, ref):
    path = save_tiny_model("mixtral", tmp_path / "ckpt")
    probe = _load(path)
    host_tier = probe.kinject.store.summary()["tier_bytes"]["host"]    # attention, router: host RAM too
    probe.kinject.transfer.close()
    model = _load(path, f"pipeline.host_budget={host_tier + 3 * 24576}")   # + 3 of 16 experts (24 KiB each)
    store = model.kinject.store
    assert store.host_cache_capacity == 3 * 24576
    for _ in range(2):
        assert torch.equal(greedy(model, batch, tok), ref)
    assert store.host_cached_peak <= 3 * 24576 and len(_cached(store)) == 3
    assert store.stats["host_cache"]["hits"] > 0
    model.kinject.transfer.close()


def test_a_failed_read_gives_its_host_cache_room_back(tmp_path):
    store, units = _disk_store(tmp_path, host_budget=10 * UNIT)      # one offload file per unit: one run each
    Path(disk_extent(units[1])[0][0]).unlink()              # e1's file is gone
    with pytest.raises(KinjectError, match=r"e1"):
        _use(store, units[:3])
    assert all(u.refs == 0 for u in units)                  # acquire_many gave back what it had taken
    units[2].handle.wait(timeout=10)                        # (not waited for: e1 failed first)
    assert not units[1].cached and _cached(store) == ["e0", "e2"] and store.host_cached == 2 * UNIT


def test_cache_policy_with_a_budget_below_one_layers_experts_keeps_tokens(tmp_path, tok, batch, ref):
    """``release_policy: cache`` with room for a few experts of a layer: a prefill routes to all of them,
    so the step loads them in turns; an expert that landed and waits for its turn is not evicted by
    the others' loads (it was, and the step then found no room to load it again: BudgetError).
    Tokens as transformers', generate after generate."""
    path = save_tiny_model("mixtral", tmp_path / "ckpt")
    probe = _load(path)
    units = probe.kinject.store.units.values()
    expert = max(u.nbytes for u in units if ".experts[" in u.name)
    other = max(u.nbytes for u in units if ".experts[" not in u.name)
    budget = probe.kinject.store.resident_external + 2 * other + 3 * expert    # (of 8 experts a layer)
    probe.kinject.transfer.close()
    model = _load(path, "pipeline.release_policy=cache", f"pipeline.device_budget={budget}")
    for _ in range(3):
        assert torch.equal(greedy(model, batch, tok), ref)
    store = model.kinject.store
    assert store.peak <= budget and all(u.refs == 0 for u in store.units.values())
    model.kinject.transfer.close()


def test_on_a_cpu_the_host_cache_borrows_the_device_budgets_free_room_and_gives_it_back(tmp_path):
    """A CPU device under a budget is host memory: with no host budget of its own the cache holds disk
    units in the room the device budget has free (entries used in place, reserved once), and a load
    that must happen gets that room back (idle borrowed entries forgotten) instead of a BudgetError."""
    store = TensorStore("cpu", TransferEngine("cpu", inline=True), offload_dir=tmp_path, host_budget=None,
                        device_budget=4 * UNIT)
    units = [store.add(f"e{i}", {"w": torch.full((64,), float(i))}, "disk", owner="experts") for i in range(6)]
    got = _use(store, units[:3])
    assert [float(g["w"][0]) for g in got] == [0.0, 1.0, 2.0]
    assert _cached(store) == ["e0", "e1", "e2"] and store.host_cache.borrowed == 3 * UNIT and store.used == 0
    got = _use(store, units[:3])                          # hits, in place: nothing reserved twice
    assert store.stats["host_cache"]["hits"] == 3 and store.used == 0
    big = store.add("big", {"w": torch.zeros(3 * 64)}, "host", owner="attention")   # 3 units' bytes, must load
    store.acquire(big)
    assert store.used == 3 * UNIT and store.host_cache.borrowed <= UNIT          # the loan went back
    assert store.memory_peak <= 4 * UNIT
    store.release(big)
    assert [float(g["w"][0]) for g in _use(store, units[3:])] == [3.0, 4.0, 5.0]
    assert store.memory_peak <= 4 * UNIT and store.host_cache.borrowed <= 4 * UNIT


@pytest.mark.parametrize("rows", [4, 3])
def test_device_budget_room_caches_experts_on_a_cpu_fewer_disk_reads_same_tokens(tmp_path, tok, rows):
    """Equal memory on a CPU: with a device budget beside a small host budget, the experts the budget's
    room can hold stay in RAM between steps (the cache borrows it), so a generate reads less from disk
    than with the host budget alone, tokens as transformers', weights held within both budgets."""
    batch = tiny_batch(tok, rows, min_tokens=16)
    new = 2 * NEW                                          # more new tokens than the other tests
    ref = build_tiny_model("mixtral").generate(**batch, max_new_tokens=new, do_sample=False,
                                               pad_token_id=tok.pad_token_id)
    path = save_tiny_model("mixtral", tmp_path / "ckpt")
    probe = _load(path)
    units = probe.kinject.store.units.values()
    expert = max(u.nbytes for u in units if ".experts[" in u.name)
    other = max(u.nbytes for u in units if ".experts[" not in u.name)
    host_tier = probe.kinject.store.summary()["tier_bytes"]["host"]
    device_budget = probe.kinject.store.resident_external + 2 * other + 8 * expert
    probe.kinject.transfer.close()
    read = {}
    for name, extra in (("host budget alone", []), ("with the device budget", [f"pipeline.device_budget={device_budget}"])):
        model = _load(path, f"pipeline.host_budget={host_tier + 2 * expert}", *extra)
        store = model.kinject.store
        for _ in range(2):
            store.reset_stats()
            out = model.generate(**batch, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
            assert torch.equal(out, ref), name
        read[name] = store.stats["host_cache"]["disk_bytes"]
        if extra:
            assert store.host_cached_peak > store.host_cache.own_capacity          # it borrowed
            assert store.memory_peak <= device_budget + store.host_cache.own_capacity + host_tier
            assert all(u.refs == 0 for u in store.units.values())
        model.kinject.transfer.close()
    assert read["with the device budget"] < read["host budget alone"]


@pytest.mark.parametrize("furthest_first", [True, False])
def test_host_cache_keeps_what_a_sweep_over_every_layer_needs_soonest(tmp_path, furthest_first):
    """A prefill (or a step routing to most experts) sweeps every layer in order, more than the cache
    holds. Least recently used would evict each layer just before the sweep comes back to it (no hit
    at all); evicting the entry whose layer computes again furthest away (the layer just computed)
    keeps a fixed part of the model cached, and every later sweep hits it."""
    store = TensorStore("cpu", TransferEngine("cpu", inline=True), offload_dir=tmp_path, host_budget=6 * UNIT)
    layers = [[store.add(f"l{layer}e{i}", {"w": torch.full((64,), float(i))}, "disk", layer=layer, owner="experts")
               for i in range(4)] for layer in range(3)]
    if not furthest_first:
        store.host_cache.distance = None                   # what the order was without it: recency alone
    reads = []                                             # disk reads per sweep (12 units a sweep)
    for _ in range(3):
        store.reset_stats()
        for units in layers:
            assert [float(g["w"][0]) for g in _use(store, units)] == [0.0, 1.0, 2.0, 3.0]
        reads.append(store.stats["host_cache"]["misses"])
    assert store.host_cached <= 6 * UNIT
    if furthest_first:
        assert reads[0] == 12 and max(reads[1:]) <= 10 and sum(reads[1:]) <= 18, reads
    else:
        assert reads == [12, 12, 12], reads
