"""Tiered tensor store: where every offloaded weight lives, and its device budget.

Operators see the store as a mapping of names to tensors (docs/architecture.md, "The store"): they ``acquire``
a :class:`Unit` (a group of tensors moved together: one module's weights, or one expert
of a fused 3-D expert parameter) and get device tensors back, whether the unit lives on
the device, in (pinned) host memory or on disk. ``release`` gives it back; with the
default ``free`` policy an offloaded unit's device copy is dropped right after use
(Klotski §5: peak memory), with ``cache`` it stays while the budget allows (LRU).

Budget: the store accounts every byte it materialises on the compute device (resident
units, in-flight and acquired offloaded units) against ``device_budget``. A prefetch that
does not fit is skipped (it always leaves room for one on-demand unit); an on-demand
acquire that cannot fit raises :class:`~kinject.errors.BudgetError` with the numbers.
On CPU-only machines the "device" copy of a host unit is the host tensor itself and the
accounting is the store's own; on CUDA ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` are reported too.

Tiers form a hierarchy: with ``host_budget`` set, what the host tier leaves of it caches the disk
tier in host memory (:class:`~kinject.engine.host_cache.HostCache`): a disk unit read once is served from RAM
afterwards, the likeliest (owner's prediction, then recency) kept. Disk reads go out in batches
sorted by file offset, adjacent units coalesced into one request (:func:`disk_runs`).
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from kinject.engine.formats.base import FormatError
from kinject.engine.buffer_pool import BufferPool
from kinject.engine.disk_runs import DENSE_READS, disk_runs, read_density, read_into_host, read_run, settle_read_ahead
from kinject.engine.host_cache import HostCache
from kinject.engine.slabs import Slab, Specs, specs_of, stacks
from kinject.errors import BudgetError
from kinject.formatting import format_bytes
from kinject.engine.encode import EncodeSpec, encode_unit
from kinject.engine.stored_units import (assembled, double_quantization, expand_stored, is_stored, quantize_unit,
                                         tensor_nbytes, write_unit_file)
from kinject.engine.transfer import TransferEngine
from kinject.engine.transfer_handles import PartHandle, TransferHandle
from kinject.engine.unit import Unit

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")


class TensorStore:
    def __init__(self, device: torch.device | str, transfer: TransferEngine, *,
                 device_budget: int | None = None, offload_dir: str | os.PathLike | None = None,
                 policy: str = "free", drop_page_cache: bool = False, read_ahead_layers: int = 0,
                 readahead: bool | str = "auto", host_budget: int | None = None, memory_watch=None):
        if policy not in ("free", "cache"):
            raise ValueError(f"release policy must be 'free' or 'cache', got {policy!r}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"   # (asked per acquire; torch.device.type builds a string)
        self.transfer = transfer
        self.budget = device_budget
        self.host_budget = host_budget
        self.offload_dir = Path(offload_dir).expanduser() if offload_dir else None
        self._units_dir: Path | None = None       # this store's own files in offload_dir (see _write_offload)
        self.policy = policy
        self.drop_page_cache = drop_page_cache
        self.readahead = readahead
        self.read_ahead_layers = read_ahead_layers
        self.units: dict[str, Unit] = {}
        # of the disk tier, in host_budget; with a memory watch (host_budget: auto) it also gives memory
        # back when MemAvailable drops (fit_host_cache)
        self.host_cache = HostCache(host_budget, self.units, watch=memory_watch, drop_device=self._drop,
                                    lend=self._device_room if self.device.type == "cpu" else None,
                                    distance=self._layers_until_use, forgotten=self._entry_forgotten)
        self._compute_layer = None   # the layer whose weights were acquired last (what computes now)
        self._layer_order: dict | None = None   # layer -> its position among the disk tier's layers
        # owner -> fn(unit) -> how likely the unit is needed again (the host cache keeps the likeliest)
        self.cache_scores = self.host_cache.scores
        self.buffers = BufferPool(pin=self.device.type == "cuda")
        self._lock = threading.RLock()
        self._clock = 0
        self.used = 0                # bytes materialised on the device (store accounting)
        self.drops = 0               # device copies and host cache entries forgotten so far (_drop, _entry_forgotten)
        self.peak = 0
        self.memory_peak = 0         # most bytes of weights held at once: device accounting + host cache entries
        self.resident_external = 0   # model bytes on the device that no unit owns (norms, embeddings ...)
        self.on_memory = None        # callback(device bytes) whenever the accounting changes (trace counter)
        self.stats = _new_stats()
        self.owner_loads: dict[str, list[int]] = {}   # owner -> [loads, wire bytes]
        self._largest: int | None = None              # largest_offloaded, until units change
        self._tied: dict[tuple, tuple[list[Unit], Any]] = {}  # tied tensor set -> (its units, who added them)
        self._holding: list[Unit] | None = None       # units released during hold(), dropped at its end

    # ------------------------------------------------------------ tied weights

    def tie(self, key: tuple, units: list[Unit], leader: Any) -> None:
        """Register ``units`` as the store's copy of the tensor set ``key`` (the identities of the
        tensors they were added from), added by ``leader``: another operator whose module holds the
        same tensors (weights tied across modules) shares them through :meth:`share`."""
        self._tied[key] = (list(units), leader)
        for unit in units:
            unit.tie_key = key

    def share(self, key: tuple) -> tuple[list[Unit], Any] | None:
        """The units of the tied tensor set ``key`` and their leader, each unit held once more (one
        copy, one transfer, its bytes counted once; :meth:`remove` drops it with its last holder);
        None when no operator added that set yet."""
        shared = self._tied.get(key)
        if shared is not None:
            for unit in shared[0]:
                unit.holders += 1
        return shared

    # ------------------------------------------------------------ registration

    def add(self, name: str, tensors: dict[str, Any], tier: str, *, layer: int | None = None,
            dtype: torch.dtype | None = None, quant=None, owner: str | None = None,
            stack: tuple[str, int] | None = None, every_step: bool = False) -> Unit:
        """Register a unit. ``device``/``host`` tiers take tensors; ``disk`` takes tensors
        (written to ``offload_dir``) or :class:`~kinject.engine.disk_sources.DiskTensor` references (read in place).

        ``quant`` (a :class:`kinject.engine.quant.QuantSpec` or :class:`kinject.engine.encode.EncodeSpec`):
        weights are stored and moved in that format (HQQ-packed, fp8, int4, mxfp4, ...) and dequantized on
        the compute device right before use
        (:meth:`acquire`); the HQQ-packed form is cached in ``offload_dir``. ``owner``: a name the
        unit's loads and bytes are also counted under (:attr:`owner_loads`), so an operator with
        many units reads its transfers in O(1) instead of summing over its units. ``stack``: ``(key,
        index)``, units computed together in one grouped call (a MoE layer's experts): those of one
        key moved in one batch, or dequantized together, land in one :class:`~kinject.engine.slabs.Slab`.
        ``every_step``: its module runs in every forward (attention, routers, dense modules), so keeping
        it on the device saves its bytes every step (:mod:`kinject.engine.residency`).

        Tensors a quantized checkpoint stores quantized (``kinject.engine.disk_sources.StoredSource``) keep
        their storage tensors (values + scales) in the host and disk tiers, are moved as stored and
        dequantized on the compute device right before use, like HQQ; in the device tier they are
        dequantized once, here. HQQ on top of them is refused (it would quantize twice)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")
        if name in self.units:
            raise ValueError(f"unit {name!r} is already in the store")
        qinfo = stored = None
        if any(is_stored(v) for v in tensors.values()):
            if quant is not None:
                raise FormatError(double_quantization(name, tensors))
            if tier == "device":
                tensors = {k: v.read(dtype) if is_stored(v) else v for k, v in tensors.items()}
            else:
                tensors, qinfo, stored = expand_stored(tensors, dtype)
        elif isinstance(quant, EncodeSpec):      # a stored format chosen by rule (kinject.engine.encode)
            tensors, qinfo, stored = encode_unit(name, tensors, quant, dtype, tier)
            self.stats["quantized"] = self.stats.get("quantized", 0) + len(qinfo)
        elif quant is not None:
            tensors, qinfo, stored = quantize_unit(name, tensors, quant, dtype, tier, device=self.device,
                                                   cache_dir=self.offload_dir, stats=self.stats)
        if tier == "host":   # checkpoint references are read now, straight into (pinned) host memory
            tensors = {k: self.transfer.pin(v if isinstance(v, torch.Tensor) else v.read(None if stored else dtype))
                       for k, v in tensors.items()}
        elif tier == "disk" and any(isinstance(v, torch.Tensor) for v in tensors.values()):
            tensors = self._write_offload(name, tensors)
        unit = Unit(name, tier, dict(tensors), layer=layer, dtype=None if qinfo else dtype, quant=qinfo, owner=owner,
                    stored=stored, stack=stack, every_step=every_step)
        unit.wire_nbytes = sum(tensor_nbytes(t, unit.dtype) for t in tensors.values())
        logical = sum(math.prod(shape) * dt.itemsize for shape, dt, _ in (qinfo or {}).values())
        # on the device a quantized unit holds its packed bytes and, while in use, the dequantized weights
        unit.nbytes = unit.wire_nbytes + logical
        parts = tuple(f"{role}." for role in qinfo or ())
        unit.compute_nbytes = logical + sum(tensor_nbytes(t, unit.dtype) for k, t in tensors.items() if not k.startswith(parts))
        if tier == "device":
            unit.device = {k: self._to_device(v, dtype) for k, v in tensors.items()}
            self._reserve(unit, strict=True)
        self.units[name] = unit
        self._largest = None
        self.host_cache.units_changed()
        self._layer_order = None
        return unit

    def remove(self, unit: Unit) -> None:
        """Forget ``unit`` once its last holder removes it (weights tied across modules)."""
        with self._lock:
            unit.holders -= 1
            if unit.holders > 0:
                return
            self._tied.pop(unit.tie_key, None)
            self._drop(unit)
            self.host_cache.forget(unit)
            self.units.pop(unit.name, None)
            self._largest = None
            self.host_cache.units_changed()
        self._layer_order = None

    def keep(self, unit: Unit) -> None:
        """Keep an offloaded unit on the device for the rest of the run (the residency plan): its
        tensors are materialised once (a disk unit read once, stored formats as stored) and counted
        against the budget; from then on it is used like a resident unit -- no load, no lock, no
        eviction -- while its tier keeps its data (:meth:`host_weights`, restore). Refused (and
        nothing changes) where it does not fit."""
        with self._lock:
            if not unit.offloaded:
                return
            if unit.refs or unit.handle is not None or unit.device is not None:
                raise ValueError(f"unit {unit.name!r} is in use; keep it before the first forward")
            if not self.fits(unit.nbytes):
                raise BudgetError(f"keeping {unit.name!r} ({format_bytes(unit.nbytes)}) on the device exceeds device_budget "
                                  f"{format_bytes(self.budget)} ({format_bytes(self.used + self.resident_external)} in use)")
            src = self._copied(unit)
            if src is None:
                src = {k: t.read(None if unit.quant else unit.dtype) for k, t in unit.tensors.items()}
            dtype = None if unit.quant else unit.dtype
            unit.device = {k: self._to_device(t, dtype) for k, t in src.items()}
            unit.reserved = unit.kept = True
            unit.offloaded = False
            self._used_changed(unit.nbytes)
            self._largest = None

    def _to_device(self, t: torch.Tensor, dtype) -> torch.Tensor:
        if isinstance(t, torch.Tensor):
            return t.to(self.device, dtype or t.dtype)
        return t.read(dtype).to(self.device)

    def _own_dir(self) -> Path:
        """A directory of this store's own in ``offload_dir``, removed with the store: shipped rule
        files share one ``offload_dir`` across models, and two models alive at once must not
        overwrite each other's unit files."""
        if self._units_dir is None:
            self.offload_dir.mkdir(parents=True, exist_ok=True)
            self._units_dir = Path(tempfile.mkdtemp(prefix=f"units-{os.getpid()}-", dir=self.offload_dir))
            weakref.finalize(self, shutil.rmtree, str(self._units_dir), True)
        return self._units_dir

    def _write_offload(self, name: str, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
        """In-memory tensors placed on ``disk``: written once to ``offload_dir``, read back lazily."""
        if self.offload_dir is None:
            raise ValueError(f"unit {name!r} is placed on disk but pipeline.offload_dir is not set")
        return write_unit_file(self._own_dir(), name, tensors)

    # ------------------------------------------------------------ budget

    def fits(self, nbytes: int, *, headroom: int = 0) -> bool:
        return self.budget is None or self._excess(nbytes + headroom) <= 0

    def _excess(self, nbytes: int) -> int:
        """Bytes by which ``nbytes`` more would overrun the device budget (the host cache's loan counted)."""
        return self.used + self.resident_external + self.host_cache.borrowed + nbytes - self.budget

    def _shares_memory(self) -> bool:
        """A CPU device under a budget, nothing crossing a link: the device *is* host memory, so the
        device budget and the host cache are one pool of RAM. The cache may hold the room the device
        budget has free (:meth:`_device_room`) and gives it back when the device needs it (:meth:`fits`
        counts the loan); a cache entry used in place is the cache's bytes, never reserved twice
        (docs/architecture.md, "Memory"). Equal memory: kinject holds no more than both budgets."""
        return self.budget is not None and self.device.type == "cpu" and self.transfer.inline

    def _layers_until_use(self, unit: Unit) -> int:
        """How many layers compute before ``unit``'s layer computes next, counted from the layer computing
        now (0: the next one; the layer computing now: the most, it comes back only next step). The host
        cache evicts the entries whose next use is furthest first (Belady), so a prefill's sweep over
        every expert does not push out the layers it has not reached yet. 0 where it cannot be told."""
        now, layer = self._compute_layer, unit.layer
        order = self._layer_order
        if order is None:
            layers = sorted({u.layer for u in self.units.values() if u.tier == "disk" and isinstance(u.layer, int)})
            order = self._layer_order = {layer: i for i, layer in enumerate(layers)}
        at, mine = order.get(now), order.get(layer)
        if at is None or mine is None:
            return 0
        return (mine - at - 1) % len(order)

    def _device_room(self) -> int:
        """Bytes of the device budget its device copies leave now: what the host cache may borrow
        (:meth:`_shares_memory`; what it holds on loan already is part of it)."""
        if not self._shares_memory():
            return 0
        return max(0, self.budget - self.used - self.resident_external)

    def _entry_in_place(self, unit: Unit) -> bool:
        """A disk unit whose host cache entry will be its device copy (:meth:`_serve_in_place`) where the
        device is host memory (:meth:`_shares_memory`): its bytes are the cache's, not reserved again."""
        return unit.cached and self._shares_memory() and self._entry_is_device_copy(unit)

    def _reserve(self, unit: Unit, *, strict: bool, headroom: int = 0, repay: bool = False,
                 starting: set[int] = frozenset()) -> bool:
        """Count ``unit``'s bytes against the device budget. ``repay`` (a load that must happen): the host
        cache first gives back room it borrowed (:meth:`_shares_memory`), not the entries of the units in
        ``starting`` (ids: copies of this batch about to start); a prefetch never takes it."""
        if unit.reserved or self._entry_in_place(unit):
            return True
        if repay and self.host_cache.borrowed and not self.fits(unit.nbytes, headroom=headroom):
            self._repay(unit.nbytes + headroom, starting)
        if not self.fits(unit.nbytes, headroom=headroom):     # a prefetch leaves what hold() keeps
            self._evict(unit.nbytes + headroom, keep=set(self._holding) if self._holding and not strict else (),
                        unclaimed=strict)
        if not self.fits(unit.nbytes, headroom=headroom):
            if not strict:
                return False
            raise BudgetError(
                f"device budget exceeded loading {unit.name!r}: {format_bytes(self.used)} in use + {format_bytes(unit.nbytes)} "
                f"> budget {format_bytes(self.budget)} (units held: {', '.join(u.name for u in self._held()[:6])})")
        unit.reserved = True
        self._used_changed(unit.nbytes)
        return True

    def _repay(self, need: int, starting: set[int] = frozenset()) -> None:
        """The device needs ``need`` more bytes of its budget: the host cache gives back what it borrowed
        (not the entries of the units in ``starting``)."""
        short = self._excess(need)
        if short > 0:
            self.host_cache.repay(short, self.stats["host_cache"], starting)

    def _used_changed(self, delta: int) -> None:
        """``delta`` bytes reserved (> 0) or given back (< 0) on the device."""
        self.used += delta
        if delta > 0:
            self.peak = max(self.peak, self.used + self.resident_external)
            self.memory_peak = max(self.memory_peak, self.peak_now())
        self._memory_changed()

    def _held(self) -> list[Unit]:
        return [u for u in self.units.values() if u.reserved and u.offloaded]

    def _evict(self, need: int, keep=(), unclaimed: bool = False) -> None:
        """``cache`` policy: drop unreferenced materialised units, least recently used first (not those in
        ``keep``). ``unclaimed`` (a load that must happen): also loads that landed unclaimed --
        prefetches nobody used yet; an inline transfer is done at submit and its handle is cleared
        only by an acquire -- after every used one. A prefetch never evicts another prefetch."""
        for u in sorted(self._held(), key=lambda u: (u.handle is not None, u.last_use)):
            if self.fits(need):
                return
            landed = u.device is not None if u.handle is None else unclaimed and u.handle.done()
            if u.refs == 0 and landed and u not in keep:                 # (not one still in flight)
                self._drop(u)
                self.stats["evictions"] += 1

    def _drop(self, unit: Unit, *, summed: bool = False) -> int:
        """Forget the unit's device copy and give back its reserved bytes. ``summed``: the caller
        gives the returned bytes back itself, together with others (one accounting update)."""
        if unit.kept:                    # (removed: its device copy goes with it)
            unit.device, unit.dequantized, unit.kept, unit.offloaded = None, None, False, True
        if unit.offloaded:
            self._leave_slabs(unit)
            if unit.tier == "disk" and self.device.type == "cpu" and unit.host_cache is None and unit.slab is None:
                # the pooled buffers it was read into; a discarded prefetch that landed unused
                # has them in its handle (losing them would make the pool allocate again)
                landed = unit.device or (unit.handle.landed_result() if unit.handle is not None else None)
                for t in (landed or {}).values():
                    self.buffers.give(t)
            unit.device = None
            unit.dequantized = None
            unit.handle = None
            unit.slab = None
            self.drops += 1              # a unit may now be missing: callers that saw none missing look again
        if not unit.reserved:
            return 0
        unit.reserved = False
        if not summed:
            self._used_changed(-unit.nbytes)
        return unit.nbytes

    @staticmethod
    def _leave_slabs(unit: Unit) -> None:
        """``unit``'s device copy is forgotten: it leaves its slabs (the last one out gives the allocation back)."""
        if unit.slab is not None:
            unit.slab.leave()
        if unit.workspace is not None:
            unit.workspace.leave()
            unit.workspace = None

    def _memory_changed(self) -> None:
        if self.on_memory is not None:
            self.on_memory(self.used + self.resident_external)

    @property
    def largest_offloaded(self) -> int:
        """Bytes of the largest offloaded unit (cached: every prefetch asks, units rarely change)."""
        if self._largest is None:
            self._largest = max((u.nbytes for u in self.units.values() if u.offloaded), default=0)
        return self._largest

    def check_fits(self, what: str = "placement") -> None:
        """Refuse up front a placement that cannot run: resident bytes plus the largest
        offloaded unit (what one on-demand load needs) must fit the budget."""
        if self.budget is None:
            return
        need = self.used + self.resident_external + self.largest_offloaded
        if need > self.budget:
            raise BudgetError(
                f"{what} does not fit device_budget {format_bytes(self.budget)}: resident units {format_bytes(self.used)} + other "
                f"model tensors on the device {format_bytes(self.resident_external)} + largest offloaded unit "
                f"{format_bytes(self.largest_offloaded)} = {format_bytes(need)}; offload more (weights: host/disk) or raise the budget")

    # ------------------------------------------------------------ movement

    def prefetch(self, unit: Unit, channel: str = "prefetch") -> bool:
        """Start bringing ``unit`` to the device if it is not there or on its way.
        Skipped (False) when it would not leave room for one on-demand unit."""
        if unit.device is not None or unit.handle is not None:
            return True                           # there or on its way (unlocked read: a racing drop only means an on-demand load later)
        with self._lock:
            if unit.device is not None or unit.handle is not None:
                return True
            if not self._reserve(unit, strict=False, headroom=self.largest_offloaded):
                self.stats["prefetch_skipped"] += 1
                return False
            self._start(unit, channel)
            return True

    def prefetch_many(self, units: list[Unit], channel: str = "prefetch") -> bool:
        """:meth:`prefetch` of several units in order, under one lock (what a scheduler step asks for:
        most are there or on their way already). False when one did not fit: it and the ones after
        it are skipped (they would not leave room for an on-demand unit either)."""
        for unit in units:                # most calls: every one there or on its way (unlocked read, as prefetch)
            if unit.device is None and unit.handle is None and unit.offloaded:
                break
        else:
            return True
        with self._lock, self.host_cache.batch():
            _, fitted = self._start_many(units, channel, headroom=self.largest_offloaded)
            if not fitted:
                self.stats["prefetch_skipped"] += 1
        return fitted

    def fetch(self, unit: Unit, channel: str = "ondemand") -> TransferHandle | None:
        """Like :meth:`prefetch` but must happen (BudgetError if it cannot fit); returns
        the in-flight handle (None when already materialised)."""
        with self._lock, self.host_cache.batch():
            if unit.device is None and unit.handle is None:
                self._reserve(unit, strict=True, repay=True)
                self._start(unit, channel)
            return unit.handle

    def fetch_many(self, units: list[Unit], channel: str = "ondemand") -> int:
        """Start the loads of ``units`` in order, under one lock, each as far as the budget allows
        now (one that does not fit is skipped; ``cache`` evicts for it first). Returns how many
        were started or already there. What a caller queues per gate: one call, not one per expert."""
        with self._lock, self.host_cache.batch():
            return self._start_many(units, channel)[0]

    def _start_many(self, units: list[Unit], channel: str, *, headroom: int | None = None) -> tuple[int, bool]:
        """Start, in order, the loads of the offloaded units neither there nor on their way (lock held).
        ``headroom`` (prefetch): each must leave that much room, and the first that does not stops
        the batch; None (on-demand): one that does not fit is skipped (``cache`` evicts for it).
        With no budget the batch reserves its bytes once; host units used in place are counted
        together, and their copies go to the transfer engine as one batch. Returns (units started
        or already there, whether every one fitted)."""
        done, fitted, in_place, copies, reads, added = 0, True, [], [], [], 0
        unbounded, queued, starting = self.budget is None, set(), set()
        try:
            for unit in units:
                if unit.device is None and unit.handle is None and unit.offloaded and id(unit) not in queued:
                    if unbounded:
                        if not unit.reserved:
                            unit.reserved = True
                            added += unit.nbytes
                    elif not (self._reserve(unit, strict=False, headroom=headroom) if headroom is not None else
                              (self.policy == "cache" or self.fits(unit.nbytes) or self.host_cache.borrowed or
                               self._entry_in_place(unit)) and
                              self._reserve(unit, strict=False, repay=True, starting=starting)):
                        fitted = False
                        if headroom is not None:
                            break
                        continue
                    if self._usable_in_place(unit):
                        in_place.append(unit)
                    elif self._copied(unit) is not None:
                        copies.append(unit)
                        starting.add(id(unit))
                    else:
                        reads.append(unit)        # read below, as one batch in file order
                        queued.add(id(unit))
                done += 1
        finally:                                  # (also when a start raised: what was reserved counts)
            if added:
                self._used_changed(added)
            if copies:
                self._start_copies(copies, channel)
            if reads:
                self._start_reads(reads)
        if in_place:
            self._start_in_place(in_place, channel)
        return done, fitted

    def acquire(self, unit: Unit, channel: str = "ondemand", *, dequantize: bool = True) -> dict[str, torch.Tensor]:
        """The unit's device tensors, waiting for (or starting) its transfer. Pair with release.
        Resident (device-tier) units never leave the device: no lock, no reference count; nor does
        a host unit used in place that stays (:meth:`_used_in_place`).
        ``dequantize`` off: a quantized unit's stored tensors as they landed (the caller dequantizes)."""
        if not unit.offloaded:
            return self._dequantized(unit) if unit.quant else unit.device
        if self._used_in_place(unit):
            return unit.device
        with self._lock:
            self.fetch(unit, channel)
            unit.refs += 1
            self._clock += 1
            unit.last_use = self._clock
            handle = unit.handle
        if handle is not None:
            try:
                result = handle.wait()
            except BaseException:
                with self._lock:
                    unit.refs -= 1
                    if unit.handle is handle:
                        self._drop(unit)
                raise
            with self._lock:
                if unit.handle is handle:
                    unit.device, unit.handle = result, None
        if unit.quant and dequantize:
            return self._dequantized(unit)
        return unit.device

    def _dequantized(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Stored roles (HQQ-packed, or as a quantized checkpoint stores them) -> weights on the
        compute device (once per materialisation), each rebuilt by its stored format from its
        storage tensors; the unit's other roles in the compute dtype."""
        if unit.dequantized is None:
            tracer = self.transfer.tracer               # compute work: the bubble and the bound count it
            with (tracer.span("compute", f"dequantize {unit.name}", layer=unit.layer) if tracer is not None
                  else contextlib.nullcontext()):
                out = assembled(unit, unit.device)
            if unit.workspace is not None:              # the group's stacked workspace: one copy per role
                slot = unit.workspace.views(unit)
                out = {k: slot[k].copy_(v) for k, v in out.items()}
            unit.dequantized = out
        return unit.dequantized

    def host_weights(self, unit: Unit) -> dict[str, torch.Tensor]:
        """The unit's weights in host memory, in its compute dtype, dequantized by its stored format
        (HQQ, FP8, MXFP4, INT4: the codecs :meth:`acquire` uses on the device): what a host kernel
        computes with when the unit computes where it lives (nothing crosses the link). Host tier:
        its host tensors themselves where no cast or dequantization is needed (so the experts keep
        their ``[E, ...]`` layout); disk tier: its host cache when it has one, else read now (real
        I/O, no link). Nothing is kept: a dequantized copy lives as long as its caller holds it."""
        if unit.tier == "device":
            raise ValueError(f"unit {unit.name!r} lives on the device tier: it has no host weights")
        if unit.tier == "host" and unit.host_as_is:       # (asked per expert per step: its answer is kept)
            return unit.tensors
        src = unit.tensors if unit.tier == "host" else unit.host_cache
        if src is None:
            read = None if unit.quant else unit.dtype
            src = {k: t.read(read) for k, t in unit.tensors.items()}
        if unit.quant:
            return assembled(unit, src)
        dtype = unit.dtype
        as_is = dtype is None or all(t.dtype == dtype for t in src.values())
        if unit.tier == "host":
            unit.host_as_is = as_is                       # (a host unit's tensors never change)
        return src if as_is else {k: t if t.dtype == dtype else t.to(dtype) for k, t in src.items()}

    def release(self, unit: Unit) -> None:
        if not unit.offloaded or unit.refs == 0 and self._used_in_place(unit):
            return
        with self._lock:
            unit.refs = max(0, unit.refs - 1)
            if unit.refs == 0 and self.policy == "free" and unit.handle is None and not self._keeps(unit):
                if self._holding is not None:
                    self._holding.append(unit)
                else:
                    self._drop(unit)

    @contextlib.contextmanager
    def hold(self):
        """Under the ``free`` policy, keep every unit released inside this block on the device until
        it ends, then drop the ones nobody acquired again. Why: a layer-wise prefill runs one decoder
        layer once per micro-batch; its weights (the experts any micro-batch routed to) should load
        once for the batch group, not once per micro-batch. Not reentrant (an inner hold is a no-op)."""
        with self._lock:
            outer = self._holding is None
            if outer:
                self._holding = []
        try:
            yield
        finally:
            if outer:
                with self._lock:
                    held, self._holding = self._holding, None
                    freed = sum(self._drop(u, summed=True) for u in dict.fromkeys(held)
                                if u.refs == 0 and u.handle is None and u.device is not None)
                    if freed:
                        self._used_changed(-freed)

    def _keeps(self, unit: Unit) -> bool:
        """``free`` policy exception: a host unit used in place (its "device copy" is its host tensors:
        a CPU device, no emulated link) stays materialised when no budget is kept. Dropping it would
        free nothing, only make the next step start it again. :meth:`discard_idle` (the end of a
        ``generate``) drops it like any idle unit; with a budget it is dropped on release as usual. So
        does a disk unit whose device copy is its host cache entry (a CPU device: :meth:`_serve_in_place`);
        the cache drops that copy when it evicts the entry (``HostCache(drop_device=...)``)."""
        return self._in_place_stays() and self._copy_is_own(unit)

    @staticmethod
    def _copy_is_own(unit: Unit) -> bool:
        """The unit's device copy is its own host tensors or its host cache entry (used in place)."""
        device = unit.device
        return device is not None and (device is unit.tensors or unit.cached and device is unit.host_cache)

    def _in_place_stays(self) -> bool:
        """:meth:`_keeps` for every unit used in place: no budget is kept and nothing crosses a link."""
        return self.budget is None and self.transfer.inline

    def _used_in_place(self, unit: Unit) -> bool:
        """A host unit whose host tensors are its device copy and that stays so (:meth:`_keeps`; only the
        end of a ``generate`` drops it, :meth:`discard_idle`): acquiring it waits for nothing and no
        release can free it, so neither takes the lock nor counts a reference (the common case on a
        CPU device with every weight in the host tier: the scheduler's per-layer calls cost nothing)."""
        return unit.device is unit.tensors and not unit.quant and self._in_place_stays()

    def acquire_many(self, units: list[Unit], channel: str = "ondemand") -> list[dict[str, torch.Tensor]]:
        """:meth:`acquire` of several units: the ones already materialised on the device are
        taken under one lock; any other one goes through :meth:`acquire` (settling, starting or
        waiting for its transfer). All or nothing: on an error every unit taken is released.
        Pair with :meth:`release_many`."""
        out: list = [None] * len(units)
        taken, slow = [], []
        if units:
            self._compute_layer = units[0].layer          # (the host cache's eviction order counts from it)
        settle_here = not self._cuda                      # (CUDA: wait() orders the streams)
        stays = self._in_place_stays()
        with self._lock:
            for i, unit in enumerate(units):
                if not unit.offloaded or stays and unit.device is unit.tensors and not unit.quant:
                    out[i] = unit.device                  # resident, or used in place (_used_in_place): off the store path
                    continue
                h = unit.handle
                if settle_here and h is not None and unit.device is None:
                    landed = h.landed_result()            # landed without error: settled here
                    if landed is not None:
                        unit.device, unit.handle = landed, None
                if unit.device is None or unit.handle is not None:
                    slow.append(i)                        # a transfer to wait for (or fail): one at a time
                else:
                    unit.refs += 1
                    self._clock += 1
                    unit.last_use = self._clock
                    taken.append(unit)
                    out[i] = unit.device
        try:
            for i in slow:
                out[i] = self.acquire(units[i], channel, dequantize=False)
                taken.append(units[i])
            self._stack_workspaces([u for u in units if u.quant and u.dequantized is None and u.offloaded])
            for i, unit in enumerate(units):
                if unit.quant:
                    out[i] = self._dequantized(unit)
        except BaseException:
            self.release_many(taken)
            raise
        return out

    def _stack_workspaces(self, units: list[Unit]) -> None:
        """Units of one stack dequantized together write their weights into one stacked workspace
        (:class:`~kinject.engine.slabs.Slab`): the same bytes as one tensor each, counted per unit as
        before (``compute_nbytes``), equally spaced so that they compute in one grouped call."""
        for group, specs in stacks(units, self._dequantized_specs):
            workspace = Slab(group, specs, self.device, self._device_empty)
            for u in group:
                u.workspace = workspace

    @staticmethod
    def _dequantized_specs(unit: Unit) -> Specs:
        """Role -> (shape, dtype) of the tensors :meth:`_dequantized` makes of ``unit`` (landed)."""
        prefixes = tuple(f"{role}." for role in unit.quant)
        dtype = next(iter(unit.quant.values()))[1]
        out = {k: (tuple(v.shape), v.dtype if dtype is None or not v.dtype.is_floating_point else dtype)
               for k, v in unit.device.items() if not k.startswith(prefixes)}
        out.update({role: (tuple(int(n) for n in shape), dt) for role, (shape, dt, _) in unit.quant.items()})
        return out

    def _device_empty(self, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device)

    def claim(self, units: list[Unit]) -> None:
        """Hold offloaded ``units`` for the caller without waiting for them: no eviction takes them
        until the matching :meth:`release_many` (an order policy's experts, from the start of its step
        until each has computed). They load as before; an acquire between holds them once more."""
        with self._lock:
            for unit in units:
                if unit.offloaded:
                    unit.refs += 1

    def release_many(self, units: list[Unit]) -> None:
        """:meth:`release` of several units under one lock."""
        with self._lock:
            free, freed = self.policy == "free", 0
            in_place_stays = self._in_place_stays()
            for unit in units:
                if not unit.offloaded or in_place_stays and unit.refs == 0 and unit.device is unit.tensors:
                    continue
                refs = unit.refs = unit.refs - 1 if unit.refs > 0 else 0
                if refs == 0 and free and unit.handle is None and not (in_place_stays and self._copy_is_own(unit)):
                    if self._holding is not None:
                        self._holding.append(unit)
                    else:
                        freed += self._drop(unit, summed=True)
            if freed:
                self._used_changed(-freed)

    def discard(self, unit: Unit, *, in_place: bool = False) -> bool:
        """Drop the device copy of an offloaded unit nobody holds (a prefetch that turned out
        unneeded). An in-flight transfer is dropped when it lands, unless acquired by then.
        False when there is nothing to drop (resident, acquired, or not on the device), and for
        a host unit used in place that stays (:meth:`_keeps`: dropping it frees nothing) unless
        ``in_place`` (the end of a ``generate``, :meth:`discard_idle`)."""
        with self._lock:
            if not unit.offloaded or unit.refs > 0 or (unit.device is None and unit.handle is None):
                return False
            if not in_place and self._keeps(unit):
                return False
            handle = unit.handle
            if handle is not None and not handle.done():
                handle.add_done_callback(lambda h, u=unit: self._discard_landed(u, h))
            else:
                self._drop(unit)
            return True

    def discard_idle(self) -> int:
        """``free`` policy: drop every offloaded unit nobody holds that is on the device or on its way
        (prefetches that found no use, e.g. the next step's first layers prefetched by the last step
        of a generate). Returns how many were dropped (in flight: when they land)."""
        if self.policy != "free":
            return 0
        with self._lock:
            idle = [u for u in self.units.values()
                    if u.offloaded and u.refs == 0 and (u.device is not None or u.handle is not None)]
            return sum(self.discard(u, in_place=True) for u in idle)

    def _discard_landed(self, unit: Unit, handle: TransferHandle) -> None:
        with self._lock:
            if unit.handle is handle and unit.refs == 0:
                self._drop(unit)

    def ready(self, unit: Unit) -> bool:
        """Materialised, or its transfer has completed (no waiting)."""
        h = unit.handle
        return unit.device is not None or (h is not None and h.done())

    # -- a unit's state as operators ask it: ``Unit.device / handle / offloaded`` are guarded by the store's
    # lock and read only here (unlocked reads, like ``ready``: a racing drop only means a load later)

    def placed(self, unit: Unit) -> bool:
        """On the device or on its way."""
        return unit.device is not None or unit.handle is not None

    def offloaded(self, unit: Unit) -> bool:
        """Not on the device tier (its tier never changes)."""
        return unit.offloaded

    def any_offloaded(self, units) -> bool:
        return any(u.offloaded for u in units)

    def cold_ids(self, units: list[Unit], ids) -> list[int]:
        """Of ``ids`` (indices into ``units``), those whose unit lives off the device and is neither on
        the device nor on its way (a load would have to start), in ``ids`` order."""
        return [i for i in ids if units[i].offloaded and units[i].device is None and units[i].handle is None]

    def ready_ids(self, units: list[Unit], ids) -> list[int]:
        """Of ``ids``, those whose unit is on the device now (:meth:`ready`), in ``ids`` order."""
        return [i for i in ids if units[i].device is not None or units[i].handle is not None and units[i].handle.done()]

    def on_landing(self, unit: Unit, fn) -> bool:
        """Call ``fn(handle)`` when ``unit``'s transfer in flight lands (at once if it has); False when
        there is none (the unit is on the device, or not fetched)."""
        handle = unit.handle
        if handle is None:
            return False
        handle.add_done_callback(fn)
        return True

    def own_tensors(self, unit: Unit) -> dict | None:
        """The tensors :meth:`acquire` hands out when it copies nothing: an offloaded unit's host tensors
        (used in place), a resident unit's device tensors."""
        return unit.tensors if unit.offloaded else unit.device

    def resident_tensors(self, unit: Unit) -> dict[str, torch.Tensor] | None:
        """The device tensors of a unit whose use needs no acquire, wait or release: a resident unit (a
        device-tier one, or one the residency plan keeps; not quantized) or a host unit a CPU uses in
        place and keeps (:meth:`_used_in_place`). They are what :meth:`acquire` hands out with no lock,
        wait or reference count, and :meth:`release` is a no-op for them; else None. A module bound
        to them has nothing to do per call."""
        if not unit.offloaded:
            return None if unit.quant else unit.device
        return unit.device if unit.refs == 0 and self._used_in_place(unit) else None

    def stays_bound(self, unit: Unit, tensors: dict) -> bool:
        """Whether ``tensors`` (what :meth:`acquire` handed out) are ``unit``'s own (:meth:`own_tensors`), so
        a module may stay bound to them after its call: they hold no memory of their own."""
        return tensors is unit.tensors or tensors is unit.device and not unit.offloaded

    def _start(self, unit: Unit, channel: str) -> None:
        if self._usable_in_place(unit):
            self._start_in_place([unit], channel)
            return
        if self._copied(unit) is not None:
            self._start_copies([unit], channel)
            return
        self._start_reads([unit])                # disk: read (+ copy) on the disk channel's worker

    def settled(self, unit: Unit) -> bool:
        """Nothing to start for ``unit``: on the device, on its way, it never moves, or a disk unit whose
        host cache entry is its device copy while the entry stays (a CPU device, no budget, no link:
        an acquire serves it in place, :meth:`_serve_in_place`; a prefetch would start nothing). A
        forgotten entry moves :attr:`drops`, so callers that saw every unit settled look again."""
        return unit.device is not None or unit.handle is not None or self.never_moves(unit) or \
            unit.cached and self._in_place_stays() and self._entry_is_device_copy(unit)

    def _entry_forgotten(self) -> None:
        """The host cache forgot an entry (:meth:`settled` may answer otherwise now)."""
        self.drops += 1

    def never_moves(self, unit: Unit) -> bool:
        """Whether ``unit`` can never need a transfer: resident, or a host unit used in place that
        stays (:meth:`_keeps`). Prefetching it, or learning what to prefetch, would buy nothing."""
        return not unit.offloaded or self._in_place_stays() and self._usable_in_place(unit)

    def _usable_in_place(self, unit: Unit) -> bool:
        """A host unit whose host tensors are its device copy (CPU engine, no emulated link, same dtype)."""
        return unit.tier == "host" and self.transfer.inline and self._in_place(unit)

    def _count_loads(self, units) -> int:
        """Count a load of each unit (its own, the store's, its owner's); returns their wire bytes."""
        wire, owners, by_tier = 0, self.owner_loads, self.stats["bytes"]
        for unit in units:
            unit.loads += 1
            n = unit.wire_nbytes
            wire += n
            by_tier[unit.tier] += n
            if unit.owner is not None:
                counts = owners.get(unit.owner)
                if counts is None:
                    counts = owners[unit.owner] = [0, 0]
                counts[0] += 1
                counts[1] += n
        self.stats["loads"] += len(units)
        return wire

    def _start_in_place(self, units: list[Unit], channel: str) -> None:
        """:meth:`_start` of host units usable in place: no job, no copy; their transfers are
        counted (and traced, when tracing) in one call."""
        for unit in units:
            unit.device = unit.tensors
        wire = self._count_loads(units)
        transfer = self.transfer
        if transfer.traced:
            transfer.count_inline_many(channel, [(u.name, u.wire_nbytes, u.layer) for u in units])
        else:
            transfer.count_inline_jobs(channel, len(units), wire)

    def _in_place(self, unit: Unit) -> bool:
        """Whether "moving" the unit's host tensors to the device is a no-op (same device, same
        dtype); kept on the unit (its tensors never change)."""
        if unit.in_place is None:
            dtype = unit.dtype
            unit.in_place = all(t.device == self.device and (dtype is None or t.dtype == dtype)
                                for t in unit.tensors.values())
        return unit.in_place

    @staticmethod
    def _copied(unit: Unit) -> dict[str, torch.Tensor] | None:
        """The host tensors a load of ``unit`` copies (host tier, or a disk unit read ahead), else None."""
        return unit.tensors if unit.tier == "host" else unit.host_cache

    def _start_copies(self, units: list[Unit], channel: str) -> None:
        """Start the host->device copies of ``units`` (:meth:`_copied`), one transfer batch."""
        self._count_loads(units)
        self.stats["copied_bytes"] += sum(u.wire_nbytes for u in units if not self._same_memory(u))
        served = [u.wire_nbytes for u in units if u.tier == "disk"]
        if served:
            cache = self.stats["host_cache"]
            cache["hits"] += len(served)
            cache["ram_bytes"] += sum(served)
        jobs = self._serve_in_place(units, channel) if self.transfer.inline else units
        for group, specs in stacks(jobs, self._copy_specs):    # one stack's units: one landing slab
            slab = Slab(group, specs, self.device, self._device_empty)
            for u in group:
                u.slab = slab
        if jobs:
            handles = self.transfer.submit_many(channel, [(self._copy_fn(u, self._copied(u)), u.name, u.wire_nbytes,
                                                           u.layer) for u in jobs])
            for unit, handle in zip(jobs, handles):
                unit.handle = handle
        self._read_ahead_from(units)             # disk units read ahead already (served in place or not)

    def _admit(self, units: list[Unit]) -> set[int]:
        """Ids of the disk units about to be read that the host cache takes (read into entries of their
        own), the likeliest first: they get the room. Where the device is host memory
        (:meth:`_shares_memory`) an admitted unit's device reservation is given back (its entry is its
        device copy: the cache's bytes), and is offered to the cache while it is asked."""
        cache, counters, shares = self.host_cache, self.stats["host_cache"], self._shares_memory()
        if not shares and not cache.capacity:
            return set()
        keep, given = set(), 0
        for u in sorted(units, key=cache.key, reverse=True):
            lent = shares and u.reserved and not u.quant
            if lent:                             # (its reserved room is the room it would take as an entry)
                u.reserved, self.used = False, self.used - u.nbytes
            if cache.admit(u, self._clock, counters):
                keep.add(id(u))
                given += lent
            elif lent:
                u.reserved, self.used = True, self.used + u.nbytes
        if given:
            self._memory_changed()
        if keep:
            self.memory_peak = max(self.memory_peak, self.peak_now())
        return keep

    def peak_now(self) -> int:
        """Bytes of weights held now: the device accounting (resident, device copies) and the host cache's
        entries. Where the device is host memory (:meth:`_shares_memory`) this is what both budgets bound."""
        return self.used + self.resident_external + self.host_cache.held

    def _serve_in_place(self, units: list[Unit], channel: str) -> list[Unit]:
        """Host cache hits whose cached tensors are the device copy (a CPU device, already in the compute
        dtype: :meth:`_same_memory`) on an inline engine: materialised here, like host units used in
        place (:meth:`_start_in_place`), without a transfer job each (a from-disk DeepSeek-V3 at its
        counts serves ~33,000 of them per generate). Returns the units that still need a job."""
        served, rest = [], []
        for unit in units:
            if self._entry_is_device_copy(unit):
                unit.device = unit.host_cache    # the entry itself: kept while the entry stays (:meth:`_keeps`)
                served.append(unit)
            else:
                rest.append(unit)
        if served:
            transfer = self.transfer
            if transfer.traced:
                transfer.count_inline_many(channel, [(u.name, u.wire_nbytes, u.layer) for u in served])
            else:
                transfer.count_inline_jobs(channel, len(served), sum(u.wire_nbytes for u in served))
        return rest

    def _read_ahead_from(self, units: list[Unit]) -> None:
        """Disk units of ``units`` started loading: read the layers after theirs ahead (host window)."""
        if self.read_ahead_layers:
            for layer in sorted({u.layer for u in units if u.tier == "disk" and u.layer is not None}):
                self._read_ahead(layer)

    def _copy_fn(self, unit: Unit, src: dict[str, torch.Tensor]):
        if src is unit.tensors and self._in_place(unit):
            # nothing to move (an emulated link on a CPU): the unit's own dict, so that the experts'
            # compute recognises their own [E, ...] layout by identity and runs one grouped GEMM
            return lambda: src
        dtype, slab = unit.dtype, unit.slab
        if slab is not None:
            def into_slab():
                slot = slab.views(unit)
                return {k: slot[k].copy_(t, non_blocking=True) for k, t in src.items()}

            return into_slab

        def fn():
            out = {}
            for k, t in src.items():
                t = t.to(self.device, non_blocking=True) if t.device != self.device else t
                out[k] = t if dtype is None or t.dtype == dtype else t.to(dtype)
            return out

        return fn

    def _entry_is_device_copy(self, unit: Unit) -> bool:
        """A disk unit whose host cache entry can serve as its device copy as it is: not quantized, on the
        compute device (:meth:`_same_memory`), already in the compute dtype."""
        cached = unit.host_cache
        return cached is not None and unit.tier == "disk" and not unit.quant and self._same_memory(unit) and \
            (unit.dtype is None or all(t.dtype == unit.dtype for t in cached.values()))

    def _same_memory(self, unit: Unit) -> bool:
        """Whether a copy of ``unit`` copies nothing: its host tensors are on the compute device in its
        compute dtype (a CPU device: the host tier and the host cache are used in place). Asked per
        load: a host unit's answer is kept on it (:meth:`_in_place`); a host cache entry is read in its
        compute dtype into host memory (``_host_tensors``), the device's own on a CPU."""
        return self._in_place(unit) if unit.tier == "host" else not self._cuda

    def _copy_specs(self, unit: Unit) -> Specs | None:
        """A copied unit's slot in a landing slab (None: it keeps tensors of its own: quantized
        units are dequantized into a workspace instead; tensors already on the device in the compute
        dtype, e.g. a CPU's host cache hits, are used as they are, no bytes copied)."""
        if unit.quant or self._same_memory(unit):
            return None                           # nothing crosses: the tensors are used as they are
        return specs_of(self._copied(unit), unit.dtype)

    def _start_reads(self, units: list[Unit]) -> None:
        """Read disk units (lock held): one batch in file order, whatever order they were asked in
        (hot-first, routing order). Each run of adjacent units (:func:`disk_runs`) is one job on the
        disk channel, read with one ``preadv`` per contiguous range; each unit lands when its run does."""
        self._count_loads(units)
        self._count_disk_reads(units)
        if self._cuda:                            # (read into pinned staging, then copied to the device)
            self.stats["copied_bytes"] += sum(u.wire_nbytes for u in units)
        self.host_cache.fit(self.stats["host_cache"])
        keep = self._admit(units)
        cpu = self.device.type == "cpu"          # (CPU: the slab comes from the read buffer pool, and goes back)
        for group, specs in stacks((u for u in units if id(u) not in keep and not u.quant),
                                   lambda u: specs_of(u.tensors, u.dtype)):
            slab = Slab(group, specs, self.device, self.buffers.take if cpu else self._device_empty,
                        self.buffers.give if cpu else None)
            for u in group:
                u.slab = slab
        def read(run: list[Unit], readahead: bool):
            return read_run(run, keep, readahead, device=self.device, pool=self.buffers, lock=self._lock,
                            cache=self.host_cache, drop_ranges=self.drop_page_cache)

        for run, handle in zip(*self._submit_runs(units, read, "")):
            for unit, h in zip(run, handle):
                unit.handle = h
        self._read_ahead_from(units)

    def _submit_runs(self, units: list[Unit], read, suffix: str) -> tuple[list[list[Unit]], list[list]]:
        """Submit ``read(run, readahead)`` (a list of results, one per unit) for each run of ``units`` in
        file order, kernel readahead on or off for the whole batch (``pipeline.disk_readahead``; ``auto``:
        on where the batch is dense, :func:`read_density`); returns the runs and, per run, one handle per unit."""
        runs, handles, emulated = disk_runs(units), [], self.transfer.emulated
        readahead = self.readahead if self.readahead != "auto" else read_density(units) >= DENSE_READS
        for run in runs:
            wire = sum(u.wire_nbytes for u in run)
            label = run[0].name + (f" (+{len(run) - 1} adjacent)" if len(run) > 1 else "") + suffix
            job = self.transfer.submit("disk", lambda run=run: read(run, readahead), label=label, nbytes=wire, tier="disk",
                                       layer=run[0].layer, link_bytes=wire if emulated and not suffix else 0)
            handles.append([PartHandle(job, i, u.name + suffix, u.wire_nbytes) for i, u in enumerate(run)])
        return runs, handles

    def _read_into_host(self, run: list[Unit], readahead: bool = True) -> list[dict[str, torch.Tensor]]:
        return read_into_host(run, self.buffers.pin, readahead)

    # ------------------------------------------------------------ host cache of the disk tier

    @property
    def host_cache_capacity(self) -> int:
        """Bytes the host cache may hold: ``host_budget`` less what the host tier holds (0 without one)."""
        return self.host_cache.capacity

    @property
    def host_cached(self) -> int:
        """Bytes of disk units held in the host cache now."""
        return self.host_cache.held

    @property
    def host_cached_peak(self) -> int:
        return self.host_cache.peak

    def fit_host_cache(self) -> int:
        """Give back idle host cache entries until the cache fits its capacity, which shrinks when
        ``MemAvailable`` drops under the margin (:meth:`HostCache.fit`): the cache never makes the
        machine swap. Returns the bytes given back."""
        if not self.host_cache.held or self.host_cache.watch is None:
            return 0
        with self._lock:
            return self.host_cache.fit(self.stats["host_cache"])

    def drop_host_cache(self) -> int:
        """Forget every host cache entry nobody holds (what dropping the page cache is to the kernel's
        cache: the next use reads from disk again; a benchmark's cold run). Returns the bytes freed."""
        with self._lock:
            return self.host_cache.drop_idle()

    def _count_disk_reads(self, units: list[Unit]) -> None:
        cache = self.stats["host_cache"]
        cache["misses"] += len(units)
        cache["disk_bytes"] += sum(u.wire_nbytes for u in units)

    def _read_ahead(self, layer: int) -> None:
        """Klotski §6.1 host window: read the next layers' disk units into host memory (one batch
        in file order, like on-demand reads)."""
        window = range(layer + 1, layer + 1 + self.read_ahead_layers)
        ahead: list[Unit] = []
        for u in self.units.values():
            if u.tier != "disk":
                continue
            if u.layer in window and u.host_cache is None and not u.reading_ahead and u.handle is None \
                    and u.device is None:
                u.reading_ahead = True
                ahead.append(u)
            elif u.layer is not None and u.layer < layer and u.host_cache and not u.cached:
                u.host_cache = None
        self._count_disk_reads(ahead)
        for run, handles in zip(*self._submit_runs(ahead, self._read_into_host, " (read-ahead)")):
            for u, h in zip(run, handles):
                h.add_done_callback(lambda h, u=u: settle_read_ahead(u, h))

    # ------------------------------------------------------------ reporting

    def summary(self) -> dict:
        """Store accounting. ``tier_bytes``: what each tier holds (host and disk: the units' stored
        bytes, e.g. FP8 values + scales or HQQ-packed; device: resident units as they sit there)."""
        on_device = {t: sum(u.nbytes if t == "device" else u.wire_nbytes for u in self.units.values() if u.tier == t)
                     for t in TIERS}
        out = {"tier_bytes": on_device, "budget": self.budget, "peak_bytes": self.peak,
               "memory_peak_bytes": self.memory_peak,
               "resident_external": self.resident_external, "units": len(self.units), **self.stats}
        out["host_cache"] = {**self.stats["host_cache"], "held_bytes": self.host_cached,
                             "peak_bytes": self.host_cached_peak, "capacity": self.host_cache.own_capacity,
                             "lendable_bytes": self._device_room()}
        if self.device.type == "cuda":
            out["cuda_max_allocated"] = torch.cuda.max_memory_allocated(self.device)
            # the caching allocator keeps one pool per stream (copies land on the channels' streams),
            # so what it holds can exceed what is allocated: the number to compare with the card
            out["cuda_max_reserved"] = torch.cuda.max_memory_reserved(self.device)
        return out

    def disk_files(self) -> list[str]:
        """Every file the disk-tier units read from (checkpoint shards, ``offload_dir`` files,
        HQQ caches): what a benchmark drops from the page cache to measure the disk."""
        return sorted({p.file for u in self.units.values() if u.tier == "disk"
                       for src in u.tensors.values() for p in getattr(src, "pieces", ())})

    def reset_stats(self) -> None:
        self.stats = _new_stats()
        self.owner_loads = {}
        self.peak = self.used + self.resident_external
        self.memory_peak = self.peak_now()
        for u in self.units.values():
            u.loads = 0

    def __getitem__(self, name: str) -> Unit:
        return self.units[name]

    def __contains__(self, name: str) -> bool:
        return name in self.units

    def __iter__(self):
        return iter(self.units)

    def __len__(self) -> int:
        return len(self.units)


def _new_stats() -> dict:
    """The store's counters. ``host_cache``: disk-unit loads served from host RAM (hits) or read
    from disk (misses, read-ahead included), and their bytes."""
    return {"bytes": {t: 0 for t in TIERS}, "copied_bytes": 0, "loads": 0, "prefetch_skipped": 0, "evictions": 0,
            "host_cache": {"hits": 0, "misses": 0, "disk_bytes": 0, "ram_bytes": 0, "evictions": 0,
                           "shrunk_bytes": 0}}
