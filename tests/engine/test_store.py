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


def test_prefetch_many_starts_in_order_and_stops_where_the_budget_ends():
    # an emulated link (loads in flight, not evictable); a prefetch leaves room for one on-demand
    # unit (the largest offloaded): a budget of 3 units prefetches 2 and stops at the third
    engine = TransferEngine("cpu", emulate_bandwidth=100.0)
    store = TensorStore("cpu", engine, device_budget=3 * 256)
    a, b, c = (store.add(f"e{i}", {"w": torch.full((64,), float(i))}, "host") for i in range(3))
    assert store.prefetch_many([a, b, c]) is False
    assert a.handle is not None and b.handle is not None and c.handle is None and c.device is None
    assert store.stats["prefetch_skipped"] == 1 and store.stats["loads"] == 2
    assert store.prefetch_many([a, b]) is True and store.stats["loads"] == 2    # on their way: nothing new
    assert torch.equal(store.acquire(b)["w"], b.tensors["w"])
    store.release(b)
    engine.close()
    unbounded = TensorStore("cpu", TransferEngine("cpu", inline=True))
    units = [unbounded.add(f"u{i}", {"w": torch.zeros(4)}, "host") for i in range(3)]
    assert unbounded.prefetch_many(units) is True and all(u.device is u.tensors for u in units)


def test_loads_of_a_batch_are_one_transfer_batch_each_landing_alone():
    """prefetch_many / fetch_many hand their host copies to the engine as one batch (one
    ``submit_many``); each unit still gets its own handle and lands by itself. A "copy" that moves
    nothing (an emulated link on a CPU) hands out the unit's own tensors, by identity."""
    engine = TransferEngine("cpu", emulate_bandwidth=100.0)
    store = TensorStore("cpu", engine)
    units = [store.add(f"e{i}", {"w": torch.full((64,), float(i))}, "host") for i in range(4)]
    batches, real = [], engine.submit_many
    engine.submit_many = lambda channel, items, **kw: batches.append((channel, [i[1] for i in items])) or real(channel, items, **kw)
    assert store.prefetch_many(units[:3]) is True
    assert store.fetch_many(units) == 4
    assert batches == [("prefetch", ["e0", "e1", "e2"]), ("ondemand", ["e3"])]
    assert len({id(u.handle) for u in units}) == 4
    got = store.acquire_many(units)
    assert [g is u.tensors for g, u in zip(got, units)] == [True] * 4
    store.release_many(units)
    assert store.used == 0 and all(u.device is None for u in units)
    engine.close()


def test_acquire_many_settles_landed_loads_in_one_pass():
    """Loads that have landed (here: on a timed emulated link) are settled and taken under the one
    lock of acquire_many, not one acquire() each; one still on the link is waited for."""
    engine = TransferEngine("cpu", emulate_bandwidth=0.001, inline=True)      # 1 MB/s
    store = TensorStore("cpu", engine)
    sizes = (64, 64, 256 * 1024)                                               # 0.26 ms, 0.26 ms, 1 s
    units = [store.add(f"e{i}", {"w": torch.full((n,), float(i))}, "host") for i, n in enumerate(sizes)]
    store.prefetch_many(units[:2])
    engine.synchronize(timeout=5)                                              # landed, not settled
    assert all(u.handle is not None and u.handle.done() and u.device is None for u in units[:2])
    store.fetch_many(units[2:])                                                # on the link now
    one_by_one = []
    real = store.acquire
    store.acquire = lambda unit, *a, **k: one_by_one.append(unit.name) or real(unit, *a, **k)
    got = store.acquire_many(units)
    assert one_by_one == ["e2"] and [g["w"][0].item() for g in got] == [0.0, 1.0, 2.0]
    assert all(u.handle is None and u.refs == 1 for u in units)
    store.release_many(units)
    assert store.used == 0 and all(u.device is None for u in units)
    engine.close()



def test_free_policy_keeps_host_units_used_in_place_only_without_a_budget():
    """A host unit a CPU uses in place (its "device copy" is its host tensors) stays materialised
    after release when no budget is kept: dropping it frees nothing. discard_idle (the end of a
    generate) drops it; with a budget, or over an emulated link, release drops it as before."""
    unbounded = TensorStore("cpu", TransferEngine("cpu", inline=True))
    a, b = (unbounded.add(f"u{i}", {"w": torch.zeros(4)}, "host") for i in range(2))
    unbounded.acquire_many([a, b])
    unbounded.release_many([a, b])
    assert a.device is a.tensors and b.device is b.tensors and unbounded.stats["loads"] == 2
    unbounded.acquire(a)
    unbounded.release(a)
    assert a.device is a.tensors and unbounded.stats["loads"] == 2        # not started again
    assert unbounded.discard_idle() == 2 and a.device is None and b.device is None

    budgeted, (c, _, _) = _store(budget_units=3)
    budgeted.acquire(c)
    budgeted.release(c)
    assert c.device is None and budgeted.used == 0

    with TransferEngine("cpu", emulate_bandwidth=1000.0, inline=True) as engine:
        linked = TensorStore("cpu", engine)
        d = linked.add("d", {"w": torch.zeros(4)}, "host")
        linked.acquire(d)
        linked.release(d)
        assert d.device is None                                            # every use loads it again


def test_buffer_pool_keeps_no_more_idle_bytes_than_were_ever_out_at_once():
    """Landing slabs are ``[n, ...]`` read buffers whose ``n`` changes with every batch of disk
    reads: the pool reuses a shape it has, and drops the oldest idle shapes beyond the most bytes
    ever out at once (it used to keep every shape it saw, growing without bound)."""
    from kinject.engine.buffer_pool import BufferPool

    pool, one = BufferPool(pin=False), 4 * 8 * 4              # bytes of one [4, 8] float32 slot
    for n in range(1, 33):                                    # slabs of 1..32 slots, one batch at a time
        buf = pool.take((n, 4, 8), torch.float32)
        pool.give(buf)
        assert pool.idle_bytes <= pool.peak_out == max(pool.peak_out, n * one)
    assert pool.peak_out == 32 * one and pool.idle_bytes <= 32 * one and pool.out == 0
    assert pool.idle == pool.allocated <= 2                  # not 32 buffers
    again = pool.take((32, 4, 8), torch.float32)             # the shape kept is reused, nothing allocated
    assert pool.allocated <= 2 and pool.out == 32 * one
    pool.give(again)


def test_buffer_pool_frees_an_evicted_buffer_only_after_its_copy_event():
    """CUDA: a buffer comes back with the event of the host->device copy that reads it. One the
    pool drops (bounded idle bytes) must stay alive until that event is synchronized -- also when
    several go at once (a fake event checks its buffer is still referenced when it is waited on)."""
    import gc
    import weakref

    from kinject.engine.buffer_pool import BufferPool

    class Event:
        def __init__(self, buf):
            self.ref, self.alive_at_wait = weakref.ref(buf), None

        def synchronize(self):
            gc.collect()
            self.alive_at_wait = self.ref() is not None

    pool = BufferPool(pin=False)
    a1, a2 = pool.take((4,), torch.float32), pool.take((4,), torch.float32)   # 32 bytes out at once
    events = [Event(a1), Event(a2)]
    pool.give(a1, events[0])
    pool.give(a2, events[1])
    del a1, a2                                                # only the pool holds them now
    c = pool.take((8,), torch.float32)
    pool.give(c)                                              # 64 idle bytes > 32: both [4] buffers go
    assert pool.idle_bytes == 32 and all(e.alive_at_wait is True for e in events)
    gc.collect()
    assert all(e.ref() is None for e in events)               # and are freed afterwards
