"""The host cache of the disk tier: disk units read once, kept in host memory for the next use.

With ``pipeline.host_budget`` set, what the host tier leaves of it holds disk units' tensors in
(pinned) host memory: a unit read from disk once is served from RAM afterwards. When room runs
out the cache keeps the units likeliest to be needed again: first by their owner's prediction
(:attr:`HostCache.scores`; the experts' correlation table), then the most recently used.

kinject keeps its own cache rather than leaving it to the page cache through mmap: what it costs
is deterministic and countable where timings are not. A hit is zero syscalls and, on a CPU device,
zero bytes copied (the cached tensors are the device copy); a miss is one preadv per run. mmap
views would also copy nothing on a hit, but fault pages in one readahead window at a time, copy
once more into pinned memory on a GPU, ignore host_budget and evict by the kernel's LRU, not by
the correlation table; and a drop-after-read benchmark would drop them.

The store owns one :class:`HostCache` and calls it with its lock held; a unit's entry is its
``host_cache`` field, ``cached`` saying that the entry belongs to this cache (not a read-ahead).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from kinject.engine.unit import Unit


class HostCache:
    """Room accounting and eviction order of the disk tier's host cache.

    ``budget``: ``pipeline.host_budget`` (None: no cache); ``units``: the store's units by name
    (the host tier's bytes come off the budget; idle entries are the eviction candidates); ``watch``:
    a :class:`kinject.engine.memory.MemoryWatch` (``host_budget: auto``): the cache holds no more
    than it holds plus what ``MemAvailable`` spares above the margin, and :meth:`fit` gives back
    the difference when memory drops (docs/architecture.md, Memory)."""

    def __init__(self, budget: int | None, units: Mapping[str, "Unit"], watch=None,
                 drop_device: Callable[["Unit"], Any] | None = None, lend: Callable[[], int] | None = None,
                 distance: Callable[["Unit"], int] | None = None, forgotten: Callable[[], Any] | None = None):
        self.budget = budget
        self.watch = watch
        # bytes of the device budget the cache may hold beyond its own (the store's: a CPU device, where
        # the device is this same memory, lends the room its budget has free now; None: nothing)
        self.lend = lend
        # the store's: layers until a unit's next use (0: the next layer to compute); None: not known
        self.distance = distance
        self._units = units
        # the store's: forget a unit's device copy that is its entry (a CPU device uses entries in place
        # and keeps them materialised between uses); an idle entry goes with its copy
        self._drop_device = drop_device
        # the store's: told each time an entry is forgotten (a unit its prefetch skipped as within
        # reach, :meth:`TensorStore.settled`, may need a read again)
        self._forgotten = forgotten
        self.held = 0                # bytes of disk units held (or being read) as cache entries
        self.peak = 0
        # owner -> fn(unit) -> how likely the unit is needed again (None: no prediction); the cache
        # keeps the likeliest (GroupedExperts: the correlation table's frequencies)
        self.scores: dict[str, Callable[["Unit"], Any]] = {}
        self._host_tier_bytes: int | None = None
        # idle entries, least likely needed first, kept while the store starts one batch of loads
        # (:meth:`batch`): sorting every entry per admitted or repaid unit cost ~40,000 key calls per step
        self._order: list | None = None
        self._batches = 0

    def units_changed(self) -> None:
        """A unit was added or removed: the host tier's bytes are counted again when next asked."""
        self._host_tier_bytes = None

    @property
    def capacity(self) -> int:
        """Bytes the cache may hold: ``budget`` less what the host tier holds (0 without a budget); with a
        watch no more than it holds plus what ``MemAvailable`` spares above the margin (less than it
        holds when memory dropped: :meth:`fit` gives the difference back)."""
        capacity = self.own_capacity + (self.lend() if self.lend is not None else 0)
        if capacity <= 0:
            return 0
        spare = self.watch.spare() if self.watch is not None else None
        return capacity if spare is None else max(0, min(capacity, self.held + spare))

    @property
    def own_capacity(self) -> int:
        """What ``budget`` leaves for the cache after the host tier (0 without a budget), before any loan."""
        if self.budget is None:
            return 0
        if self._host_tier_bytes is None:
            self._host_tier_bytes = sum(u.wire_nbytes for u in self._units.values() if u.tier == "host")
        return max(0, self.budget - self._host_tier_bytes)

    @property
    def borrowed(self) -> int:
        """Bytes held beyond :attr:`own_capacity`: the device budget's, on loan (:attr:`lend`)."""
        return max(0, self.held - self.own_capacity) if self.lend is not None else 0

    def repay(self, need: int, counters: dict, keep: set[int] = frozenset()) -> int:
        """Forget idle entries held on loan, least likely needed first, until ``need`` bytes of the loan
        are back (or no idle entry is left): the device needs its room. Units whose id is in ``keep``
        (about to be copied from their entry) stay. Returns the bytes given back."""
        before, floor = self.held, self.own_capacity
        order, stay, i = self._idle_order(), [], 0
        while i < len(order) and before - self.held < need and self.held > floor:
            u = order[i]
            i += 1
            if id(u) in keep:
                stay.append(u)
            elif self._idle(u):
                self.forget(u)
                counters["evictions"] += 1
        order[:i] = stay
        return before - self.held

    @contextlib.contextmanager
    def batch(self):
        """While the store starts one batch of loads: the eviction order is sorted once, not per unit."""
        self._batches += 1
        try:
            yield
        finally:
            self._batches -= 1
            if not self._batches:
                self._order = None

    def _idle_order(self) -> list:
        """Idle entries, least likely needed first (kept for the batch; entries forgotten are removed
        by the caller, stale ones skipped by it)."""
        order = self._order
        if order is None:
            order = sorted((u for u in self._units.values() if self._idle(u)), key=self.key)
            if self._batches:
                self._order = order
        return order

    def fit(self, counters: dict) -> int:
        """Forget idle entries, least likely needed first, until the cache fits :attr:`capacity`
        (``counters``: the store's host cache counters, ``evictions`` and ``shrunk_bytes``). Returns
        the bytes given back."""
        if self.watch is None or not self.held:
            return 0
        excess = self.held - self.capacity
        if excess <= 0:
            return 0
        before = self.held
        for u in sorted((u for u in self._units.values() if self._idle(u)), key=self.key):
            if before - self.held >= excess:
                break
            self.forget(u)
            counters["evictions"] += 1
        counters["shrunk_bytes"] += before - self.held
        return before - self.held

    def key(self, unit: "Unit") -> tuple[float, int]:
        """Eviction order, lowest first: how likely the unit is needed again (its owner's prediction;
        1 without one) over how soon (1 + the layers computing before its layer comes back: Belady's
        furthest next use first), then least recently used."""
        score = self.scores.get(unit.owner)
        value = score(unit) if score is not None else None
        soon = 1 + self.distance(unit) if self.distance is not None else 1
        return ((1.0 if value is None else float(value)) / soon, unit.last_use)

    def admit(self, unit: "Unit", now: int, counters: dict) -> bool:
        """Reserve room for a disk unit about to be read (``now``: the store's use clock), evicting
        idle entries less likely to be needed than it if that makes room (``counters["evictions"]``
        counts them); False: it is not cached."""
        need, capacity = unit.wire_nbytes, self.capacity
        if unit.cached or need > capacity:
            return False
        free = capacity - self.held
        if need > free:
            mine = (self.key(unit)[0], now + 1)     # (it is about to be used)
            order, victims, i = self._idle_order(), [], 0
            while i < len(order) and free < need:
                u = order[i]
                if u.host_cache is not None and self._idle(u):      # (else stale: gone since the sort)
                    if self.key(u) >= mine:
                        break
                    victims.append(u)
                    free += u.wire_nbytes
                i += 1
            if free < need:
                return False
            for u in victims:
                self.forget(u)
                counters["evictions"] += 1
            del order[:i]                           # (the victims, and stale entries before them)
        unit.cached = True
        self.held += need
        self.peak = max(self.peak, self.held)
        return True

    def drop_idle(self) -> int:
        """Forget every entry nobody holds; returns the bytes freed."""
        before = self.held
        for u in self._units.values():
            if self._idle(u):
                self.forget(u)
        return before - self.held

    @staticmethod
    def _idle(unit: "Unit") -> bool:
        """An entry nobody holds: not in use, not on its way, and not on the device unless its device
        copy is the entry itself (used in place and kept between uses: it goes with the entry)."""
        return unit.cached and unit.refs == 0 and unit.handle is None and \
            (unit.device is None or unit.device is unit.host_cache)

    def forget(self, unit: "Unit") -> None:
        """Forget a unit's entry and give its bytes back (and its device copy, where that is the entry)."""
        if unit.device is not None and unit.device is unit.host_cache and self._drop_device is not None:
            self._drop_device(unit)
        if unit.cached:
            unit.cached = False
            unit.host_cache = None
            self.held -= unit.wire_nbytes
            if self._forgotten is not None:
                self._forgotten()
