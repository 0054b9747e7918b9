"""TensorStore: batched starts of on-demand loads within the device budget (CPU, inline engine)."""

import torch

from kinject.engine.store import TensorStore
from kinject.engine.transfer import TransferEngine


def _store(budget_units: int, policy: str = "free"):
    engine = TransferEngine("cpu", inline=True)
    store = TensorStore("cpu", engine, device_budget=budget_units * 64 * 4, policy=policy)
    units = [store.add(f"e{i}", {"w": torch.full((64,), float(i))}, "host") for i in range(3)]
    return store, units


def test_fetch_many_starts_what_fits_and_skips_the_rest():
    store, (a, b, c) = _store(budget_units=2)
    assert store.fetch_many([a, b, c]) == 2
    assert a.device is a.tensors and b.device is b.tensors   # CPU, no link: the host tensors in place
    assert c.device is None and store.used == 2 * 256 and store.stats["loads"] == 2
    assert store.fetch_many([a, b]) == 2 and store.stats["loads"] == 2   # already there: nothing new
    store.acquire(a)
    store.release(a)                                         # used and released: the free policy drops it
    assert a.device is None and store.fetch_many([c]) == 1 and c.device is c.tensors


def test_fetch_many_under_the_cache_policy_evicts_least_recently_used():
    store, (a, b, c) = _store(budget_units=2, policy="cache")
    for unit in (a, b):
        store.acquire(unit)
        store.release(unit)                                  # kept (cache), unreferenced
    assert a.device is not None and b.device is not None
    assert store.fetch_many([c]) == 1
    assert a.device is None and b.device is not None and c.device is not None   # a was used first
    assert store.stats["evictions"] == 1 and store.used == 2 * 256


def test_discard_idle_drops_unheld_prefetches_only_under_the_free_policy():
    store, (a, b, c) = _store(budget_units=3)
    store.fetch_many([a, b])
    held = store.acquire(a)
    assert store.discard_idle() == 1                         # b: prefetched, never used
    assert b.device is None and a.device is held and store.used == 256
    store.release(a)
    assert store.discard_idle() == 0 and store.used == 0

    cached, (x, _, _) = _store(budget_units=3, policy="cache")
    cached.fetch_many([x])
    assert cached.discard_idle() == 0 and x.device is not None   # the cache policy keeps what it has
