"""Tiered tensor store: where every offloaded weight lives, and its device budget.

Operators see the store as a mapping of names to tensors (DESIGN §10.7): they ``acquire``
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
tier in host memory (:meth:`TensorStore._admit`): a disk unit read once is served from RAM
afterwards, the likeliest (owner's prediction, then recency) kept. Disk reads go out in batches
sorted by file offset, adjacent units coalesced into one request (:func:`disk_runs`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Protocol

import torch
from safetensors.torch import save_file

from kinject.engine.formats.base import FormatError
from kinject.engine.slabs import Slab, Specs, specs_of, stacks
from kinject.errors import BudgetError, LoadError
from kinject.engine.transfer import PartHandle, TransferEngine, TransferHandle

logger = logging.getLogger(__name__)

TIERS = ("device", "host", "disk")

# Largest run of adjacent disk units read as one job (one preadv per contiguous range): long enough
# for sequential throughput, short enough that the first experts of a batch land (and compute)
# before the whole batch is read, and that several disk workers share a large batch.
RUN_BYTES = 64 << 20


class DiskTensor(Protocol):
    """A lazy reference to a tensor on disk (``kinject.io.checkpoint.Source`` is one)."""

    shape: tuple
    dtype: torch.dtype
    nbytes: int

    def read(self, dtype: torch.dtype | None = None, out: torch.Tensor | None = None) -> torch.Tensor: ...


@dataclass(eq=False)
class Unit:
    """Tensors that move together. ``tensors``: role -> host tensor (device/host tier) or
    :class:`DiskTensor` (disk tier). ``dtype``: compute dtype of the materialised copy."""

    name: str
    tier: str
    tensors: dict[str, Any]
    layer: int | None = None
    dtype: torch.dtype | None = None
    nbytes: int = 0                                   # bytes when materialised on the device
    # --- state, guarded by the store's lock
    device: dict[str, torch.Tensor] | None = None     # materialised copy (resident units: always)
    handle: TransferHandle | None = None              # in-flight transfer producing ``device``
    refs: int = 0
    reserved: bool = False                            # bytes counted against the budget
    last_use: int = 0
    loads: int = 0                                    # times fetched from its tier
    wire_nbytes: int = 0                              # bytes moved from its tier per load (packed, if quantized)
    compute_nbytes: int = 0                           # bytes of the tensors acquire hands out (dequantized)
    quant: dict[str, tuple] | None = None             # role -> (shape, dtype, QuantSpec or StoredFormat) of stored roles
    stored: dict[str, Any] | None = None              # role -> how it is rebuilt from its parts (StoredSource, HQQFormat)
    dequantized: dict[str, torch.Tensor] | None = None  # device tensors after dequantization (while materialised)
    host_cache: dict[str, torch.Tensor] | None = None  # disk units: their tensors in host memory (cache or read-ahead)
    cached: bool = False                              # host_cache is (or will be, once read) a host cache entry
    reading_ahead: bool = False
    owner: str | None = None                          # who registered it (loads counted per owner)
    in_place: bool | None = None                      # host tensors usable on the device as they are (cached)
    extent: tuple | None = None                       # disk units: ((file, start, end), ...) of its bytes (cached)
    stack: tuple[str, int] | None = None              # (stack, index): units moved together share a slab
    slab: Slab | None = None                          # the landing slab its device tensors are views of
    workspace: Slab | None = None                     # the slab its dequantized tensors are views of
    holders: int = 1                                  # operators bound to it (weights tied across modules)
    tie_key: tuple | None = None                      # the tied tensor set it is registered for (TensorStore.tie)
    every_step: bool = False                          # its module runs every forward (not a routed expert)
    host_compute: bool = False                        # its operator can compute it where it lives (only
                                                      # activations cross the link when it is not kept)
    kept: bool = False                                # kept on the device by the residency plan (TensorStore.keep)
    offloaded: bool = field(init=False)               # not on the device tier (an attribute: asked per use)

    def __post_init__(self) -> None:
        self.offloaded = self.tier != "device"

    def __repr__(self) -> str:
        return f"Unit({self.name!r}, tier={self.tier}, {self.nbytes} B, refs={self.refs})"

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the tensors :meth:`TensorStore.acquire` hands out (stored roles dequantized)."""
        if self.dtype is not None:
            return self.dtype
        if self.quant:
            return next(iter(self.quant.values()))[1]
        return next(iter(self.tensors.values())).dtype


class BufferPool:
    """Reusable read buffers keyed by (shape, dtype): steady-state disk reads allocate nothing.

    CPU device: the buffer a unit was read into *is* its device copy and comes back when the
    unit is dropped. CUDA: buffers are pinned staging areas; one comes back with the event of
    the host->device copy that read it, and is handed out again only after that event (the
    wait happens on the disk worker thread, never on the compute stream).

    Idle buffers are bounded: the pool keeps at most as many idle bytes as were ever out at once
    (:attr:`peak_out`), the oldest shapes given back first to go. Why: landing slabs are ``[n, ...]``
    buffers whose ``n`` changes with every batch of reads, so a pool keeping every shape it saw
    grew without bound (a 4-layer model with 9.4 MB experts reached 12 GB of idle buffers)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[tuple, list] = {}
        self._lock = threading.Lock()
        self.allocated = 0
        self.out = 0                 # bytes handed out and not given back
        self.peak_out = 0
        self.idle_bytes = 0

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        key = (tuple(shape), dtype)
        with self._lock:
            free = self._free.get(key)
            item = free.pop() if free else None
            if free is not None and not free:
                del self._free[key]
            n = _numel(key[0]) * dtype.itemsize
            if item is not None:
                self.idle_bytes -= n
            else:
                self.allocated += 1
            self.out += n
            self.peak_out = max(self.peak_out, self.out)
        if item is None:
            return torch.empty(key[0], dtype=dtype, pin_memory=self.pin)
        buf, event = item
        if event is not None:
            event.synchronize()
        return buf

    @property
    def idle(self) -> int:
        """Buffers in the pool now (equal to :attr:`allocated` when no unit holds one)."""
        with self._lock:
            return sum(len(free) for free in self._free.values())

    def give(self, buf: torch.Tensor, event=None) -> None:
        key, n = (tuple(buf.shape), buf.dtype), buf.numel() * buf.element_size()
        with self._lock:
            self.out = max(0, self.out - n)
            self._free.setdefault(key, []).append((buf, event))
            self.idle_bytes += n
            victims = []
            for k in list(self._free):                  # oldest shapes first; this one last
                if self.idle_bytes <= self.peak_out:
                    break
                free = self._free[k]
                while free and self.idle_bytes > self.peak_out and not (k == key and len(free) == 1):
                    b, ev = free.pop(0)
                    victims.append((b, ev))
                    self.idle_bytes -= b.numel() * b.element_size()
                    self.allocated -= 1
                if not free:
                    del self._free[k]
        for _, ev in victims:       # CUDA: each buffer is freed only after the copy that read it (its event)
            if ev is not None:
                ev.synchronize()
        victims.clear()             # (held until here: buffers freed while their copies could still read them)


def _nbytes(t: Any, dtype: torch.dtype | None) -> int:
    numel = 1
    for s in t.shape:
        numel *= int(s)
    return numel * (dtype or t.dtype).itemsize


class TensorStore:
    def __init__(self, device: torch.device | str, transfer: TransferEngine, *,
                 device_budget: int | None = None, offload_dir: str | os.PathLike | None = None,
                 policy: str = "free", drop_page_cache: bool = False, read_ahead_layers: int = 0,
                 readahead: bool | str = "auto", host_budget: int | None = None):
        if policy not in ("free", "cache"):
            raise ValueError(f"release policy must be 'free' or 'cache', got {policy!r}")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"   # (asked per acquire; torch.device.type builds a string)
        self.transfer = transfer
        self.budget = device_budget
        self.host_budget = host_budget
        self.host_cached = 0         # bytes of disk units held in the host cache (see _admit)
        self.host_cached_peak = 0
        # owner -> fn(unit) -> how likely the unit is needed again (None: no prediction); the host
        # cache keeps the likeliest (GroupedExperts: the correlation table's frequencies)
        self.cache_scores: dict[str, Any] = {}
        self._host_tier_bytes: int | None = None
        self.offload_dir = Path(offload_dir).expanduser() if offload_dir else None
        self._units_dir: Path | None = None       # this store's own files in offload_dir (see _write_offload)
        self.policy = policy
        self.drop_page_cache = drop_page_cache
        self.readahead = readahead
        self.read_ahead_layers = read_ahead_layers
        self.units: dict[str, Unit] = {}
        self.buffers = BufferPool(pin=self.device.type == "cuda")
        self._lock = threading.RLock()
        self._clock = 0
        self.used = 0                # bytes materialised on the device (store accounting)
        self.drops = 0               # device copies of offloaded units forgotten so far (see _drop)
        self.peak = 0
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
        (written to ``offload_dir``) or :class:`DiskTensor` references (read in place).

        ``quant`` (a :class:`kinject.engine.quant.QuantSpec` or :class:`kinject.engine.encode.EncodeSpec`):
        weights are stored and moved in that format (HQQ-packed, fp8, int4, mxfp4, ...) and dequantized on
        the compute device right before use
        (:meth:`acquire`); the packed form is cached in ``offload_dir``. ``owner``: a name the
        unit's loads and bytes are also counted under (:attr:`owner_loads`), so an operator with
        many units reads its transfers in O(1) instead of summing over its units. ``stack``: ``(key,
        index)``, units computed together in one grouped call (a MoE layer's experts): those of one
        key moved in one batch, or dequantized together, land in one :class:`~kinject.engine.slabs.Slab`.
        ``every_step``: its module runs in every forward (attention, routers, dense modules), so keeping
        it on the device saves its bytes every step (:mod:`kinject.engine.residency`).

        Tensors a quantized checkpoint stores quantized (``kinject.io.checkpoint.StoredSource``) keep
        their storage tensors (values + scales) in the host and disk tiers, are moved as stored and
        dequantized on the compute device right before use, like HQQ; in the device tier they are
        dequantized once, here. HQQ on top of them is refused (it would quantize twice)."""
        if tier not in TIERS:
            raise ValueError(f"unknown tier {tier!r}; tiers are {', '.join(TIERS)}")
        if name in self.units:
            raise ValueError(f"unit {name!r} is already in the store")
        qinfo = stored = None
        if any(_is_stored(v) for v in tensors.values()):
            if quant is not None:
                raise FormatError(_double_quantization(name, tensors))
            if tier == "device":
                tensors = {k: v.read(dtype) if _is_stored(v) else v for k, v in tensors.items()}
            else:
                tensors, qinfo, stored = _expand_stored(tensors, dtype)
        elif quant is not None:
            tensors, qinfo, stored = self._quantize(name, tensors, quant, dtype, tier)
        if tier == "host":   # checkpoint references are read now, straight into (pinned) host memory
            tensors = {k: self.transfer.pin(v if isinstance(v, torch.Tensor) else v.read(None if stored else dtype))
                       for k, v in tensors.items()}
        elif tier == "disk" and any(isinstance(v, torch.Tensor) for v in tensors.values()):
            tensors = self._write_offload(name, tensors)
        unit = Unit(name, tier, dict(tensors), layer=layer, dtype=None if qinfo else dtype, quant=qinfo, owner=owner,
                    stored=stored, stack=stack, every_step=every_step)
        unit.wire_nbytes = sum(_nbytes(t, unit.dtype) for t in tensors.values())
        logical = sum(_numel(shape) * dt.itemsize for shape, dt, _ in (qinfo or {}).values())
        # on the device a quantized unit holds its packed bytes and, while in use, the dequantized weights
        unit.nbytes = unit.wire_nbytes + logical
        parts = tuple(f"{role}." for role in qinfo or ())
        unit.compute_nbytes = logical + sum(_nbytes(t, unit.dtype) for k, t in tensors.items() if not k.startswith(parts))
        if tier == "device":
            unit.device = {k: self._to_device(v, dtype) for k, v in tensors.items()}
            self._reserve(unit, strict=True)
        self.units[name] = unit
        self._largest = self._host_tier_bytes = None
        return unit

    def remove(self, unit: Unit) -> None:
        """Forget ``unit`` once its last holder removes it (weights tied across modules)."""
        with self._lock:
            unit.holders -= 1
            if unit.holders > 0:
                return
            self._tied.pop(unit.tie_key, None)
            self._drop(unit)
            self._uncache(unit)
            self.units.pop(unit.name, None)
            self._largest = self._host_tier_bytes = None

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
                raise BudgetError(f"keeping {unit.name!r} ({_fmt(unit.nbytes)}) on the device exceeds device_budget "
                                  f"{_fmt(self.budget)} ({_fmt(self.used + self.resident_external)} in use)")
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

    def _quantize(self, name: str, tensors: dict[str, Any], spec, dtype, tier: str):
        """The unit's weights in the stored format a rule's ``quant:`` chose: any but HQQ encoded by
        :func:`kinject.engine.encode.encode_unit`; HQQ-packed here, reusing ``offload_dir``'s cache
        when the source matches."""
        from kinject.engine.encode import EncodeSpec, encode_unit
        from kinject.engine.quant import HQQFormat, load_quantized, quantize, save_quantized

        if isinstance(spec, EncodeSpec):
            out, info, stored = encode_unit(name, tensors, spec, dtype, tier)
            self.stats["quantized"] = self.stats.get("quantized", 0) + len(info)
            return out, info, stored
        roles = [k for k, v in tensors.items() if len(v.shape) >= 2 and v.dtype.is_floating_point
                 and _numel(v.shape) % spec.group_size == 0]
        # HQQ's solver runs on the compute device when it is a GPU (fp16 there, fp32 on CPU:
        # the results differ slightly, so the solver device is part of the cache key)
        solver = self.device if self.device.type == "cuda" else None
        meta = {"unit": name, "spec": spec.to_dict(), "dtype": str(dtype), "solver": str(solver or "cpu"),
                "sources": {k: _fingerprint(tensors[k]) for k in roles}}
        path = None
        if self.offload_dir is not None:
            self.offload_dir.mkdir(parents=True, exist_ok=True)
            path = self.offload_dir / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".hqq.safetensors")
        packed = load_quantized(path, meta) if path is not None else None
        if packed is None:
            packed = {}
            for k in roles:
                v = tensors[k]
                w = v if isinstance(v, torch.Tensor) else v.read(dtype)
                packed[k] = quantize(w.to(dtype) if dtype is not None else w, spec, device=solver)
            self.stats["quantized"] = self.stats.get("quantized", 0) + len(roles)
            if path is not None:
                save_quantized(path, packed, meta)
        out = {k: v for k, v in tensors.items() if k not in packed}
        info, stored = {}, {}
        for k, qt in packed.items():
            info[k] = (tuple(qt.shape), qt.dtype, qt.spec)
            stored[k] = HQQFormat(qt.spec, qt.shape)
            for part, t in qt.tensors().items():
                out[f"{k}.{part}"] = self._packed_source(path, f"{k}.{part}", t) if tier == "disk" else t
        return out, info, stored

    @staticmethod
    def _packed_source(path, key: str, t: torch.Tensor):
        from kinject.io.checkpoint import Piece, Source

        return Source(name=key, expert=None, shape=tuple(t.shape), dtype=t.dtype,
                      pieces=(Piece(str(path), key, None),), concat_dim=None, nbytes=_nbytes(t, None))

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
        from kinject.io.checkpoint import Piece, Source

        if self.offload_dir is None:
            raise ValueError(f"unit {name!r} is placed on disk but pipeline.offload_dir is not set")
        path = self._own_dir() / (re.sub(r"[^A-Za-z0-9_.-]+", "_", name) + ".safetensors")
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
        return {k: Source(name=f"{name}.{k}", expert=None, shape=tuple(v.shape), dtype=v.dtype,
                          pieces=(Piece(str(path), k, None),), concat_dim=None, nbytes=_nbytes(v, None))
                for k, v in tensors.items()}

    # ------------------------------------------------------------ budget

    def fits(self, nbytes: int, *, headroom: int = 0) -> bool:
        return self.budget is None or self.used + self.resident_external + nbytes + headroom <= self.budget

    def _reserve(self, unit: Unit, *, strict: bool, headroom: int = 0) -> bool:
        if unit.reserved:
            return True
        if not self.fits(unit.nbytes, headroom=headroom):     # a prefetch leaves what hold() keeps
            self._evict(unit.nbytes + headroom, keep=set(self._holding) if self._holding and not strict else (),
                        unclaimed=strict)
        if not self.fits(unit.nbytes, headroom=headroom):
            if not strict:
                return False
            raise BudgetError(
                f"device budget exceeded loading {unit.name!r}: {_fmt(self.used)} in use + {_fmt(unit.nbytes)} "
                f"> budget {_fmt(self.budget)} (units held: {', '.join(u.name for u in self._held()[:6])})")
        unit.reserved = True
        self._used_changed(unit.nbytes)
        return True

    def _used_changed(self, delta: int) -> None:
        """``delta`` bytes reserved (> 0) or given back (< 0) on the device."""
        self.used += delta
        if delta > 0:
            self.peak = max(self.peak, self.used + self.resident_external)
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
                f"{what} does not fit device_budget {_fmt(self.budget)}: resident units {_fmt(self.used)} + other "
                f"model tensors on the device {_fmt(self.resident_external)} + largest offloaded unit "
                f"{_fmt(self.largest_offloaded)} = {_fmt(need)}; offload more (weights: host/disk) or raise the budget")

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
        with self._lock:
            _, fitted = self._start_many(units, channel, headroom=self.largest_offloaded)
            if not fitted:
                self.stats["prefetch_skipped"] += 1
        return fitted

    def fetch(self, unit: Unit, channel: str = "ondemand") -> TransferHandle | None:
        """Like :meth:`prefetch` but must happen (BudgetError if it cannot fit); returns
        the in-flight handle (None when already materialised)."""
        with self._lock:
            if unit.device is None and unit.handle is None:
                self._reserve(unit, strict=True)
                self._start(unit, channel)
            return unit.handle

    def fetch_many(self, units: list[Unit], channel: str = "ondemand") -> int:
        """Start the loads of ``units`` in order, under one lock, each as far as the budget allows
        now (one that does not fit is skipped; ``cache`` evicts for it first). Returns how many
        were started or already there. What a caller queues per gate: one call, not one per expert."""
        with self._lock:
            return self._start_many(units, channel)[0]

    def _start_many(self, units: list[Unit], channel: str, *, headroom: int | None = None) -> tuple[int, bool]:
        """Start, in order, the loads of the offloaded units neither there nor on their way (lock held).
        ``headroom`` (prefetch): each must leave that much room, and the first that does not stops
        the batch; None (on-demand): one that does not fit is skipped (``cache`` evicts for it).
        With no budget the batch reserves its bytes once; host units used in place are counted
        together, and their copies go to the transfer engine as one batch. Returns (units started
        or already there, whether every one fitted)."""
        done, fitted, in_place, copies, reads, added = 0, True, [], [], [], 0
        unbounded, queued = self.budget is None, set()
        try:
            for unit in units:
                if unit.device is None and unit.handle is None and unit.offloaded and id(unit) not in queued:
                    if unbounded:
                        if not unit.reserved:
                            unit.reserved = True
                            added += unit.nbytes
                    elif not (self._reserve(unit, strict=False, headroom=headroom) if headroom is not None else
                              (self.policy == "cache" or self.fits(unit.nbytes)) and self._reserve(unit, strict=False)):
                        fitted = False
                        if headroom is not None:
                            break
                        continue
                    if self._usable_in_place(unit):
                        in_place.append(unit)
                    elif self._copied(unit) is not None:
                        copies.append(unit)
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
                out = _assembled(unit, unit.device)
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
        src = unit.tensors if unit.tier == "host" else unit.host_cache
        if src is None:
            read = None if unit.quant else unit.dtype
            src = {k: t.read(read) for k, t in unit.tensors.items()}
        if unit.quant:
            return _assembled(unit, src)
        dtype = unit.dtype
        if dtype is None or all(t.dtype == dtype for t in src.values()):
            return src
        return {k: t if t.dtype == dtype else t.to(dtype) for k, t in src.items()}

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
        ``generate``) drops it like any idle unit; with a budget it is dropped on release as usual."""
        return unit.device is unit.tensors and self._in_place_stays()

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

    def release_many(self, units: list[Unit]) -> None:
        """:meth:`release` of several units under one lock."""
        with self._lock:
            free, freed = self.policy == "free", 0
            in_place_stays = self._in_place_stays()
            for unit in units:
                if not unit.offloaded or in_place_stays and unit.refs == 0 and unit.device is unit.tensors:
                    continue
                refs = unit.refs = unit.refs - 1 if unit.refs > 0 else 0
                if refs == 0 and free and unit.handle is None and not (in_place_stays and unit.device is unit.tensors):
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

    def _start(self, unit: Unit, channel: str) -> None:
        if self._usable_in_place(unit):
            self._start_in_place([unit], channel)
            return
        if self._copied(unit) is not None:
            self._start_copies([unit], channel)
            return
        self._start_reads([unit])                # disk: read (+ copy) on the disk channel's worker

    def settled(self, unit: Unit) -> bool:
        """Nothing to start for ``unit``: on the device, on its way, or it never moves."""
        return unit.device is not None or unit.handle is not None or self.never_moves(unit)

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
        served = [u.wire_nbytes for u in units if u.tier == "disk"]
        if served:
            cache = self.stats["host_cache"]
            cache["hits"] += len(served)
            cache["ram_bytes"] += sum(served)
        for group, specs in stacks(units, self._copy_specs):   # one stack's units: one landing slab
            slab = Slab(group, specs, self.device, self._device_empty)
            for u in group:
                u.slab = slab
        handles = self.transfer.submit_many(channel, [(self._copy_fn(u, self._copied(u)), u.name, u.wire_nbytes, u.layer)
                                                      for u in units])
        for unit, handle in zip(units, handles):
            unit.handle = handle
        self._read_ahead_from(units)             # disk units read ahead already

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

    def _copy_specs(self, unit: Unit) -> Specs | None:
        """A copied unit's slot in a landing slab (None: it keeps tensors of its own: quantized
        units are dequantized into a workspace instead; tensors already on the device in the compute
        dtype, e.g. a CPU's host cache hits, are used as they are, no bytes copied)."""
        src, dtype = self._copied(unit), unit.dtype
        if unit.quant or all(t.device == self.device and (dtype is None or t.dtype == dtype) for t in src.values()):
            return None                           # nothing crosses: the tensors are used as they are
        return specs_of(src, dtype)

    def _start_reads(self, units: list[Unit]) -> None:
        """Read disk units (lock held): one batch in file order, whatever order they were asked in
        (hot-first, routing order). Each run of adjacent units (:func:`disk_runs`) is one job on the
        disk channel, read with one ``preadv`` per contiguous range; each unit lands when its run does."""
        self._count_loads(units)
        self._count_disk_reads(units)
        keep = {id(u) for u in sorted(units, key=self._cache_key, reverse=True) if self._admit(u)} \
            if self.host_cache_capacity else set()                  # the likeliest first: they get the room
        cpu = self.device.type == "cpu"          # (CPU: the slab comes from the read buffer pool, and goes back)
        for group, specs in stacks((u for u in units if id(u) not in keep and not u.quant),
                                   lambda u: specs_of(u.tensors, u.dtype)):
            slab = Slab(group, specs, self.device, self.buffers.take if cpu else self._device_empty,
                        self.buffers.give if cpu else None)
            for u in group:
                u.slab = slab
        for run, handle in zip(*self._submit_runs(units, lambda run, ra: self._read_run(run, keep, ra), "")):
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

    def _read_run(self, run: list[Unit], keep: set[int], readahead: bool = True) -> list[dict[str, torch.Tensor]]:
        """Disk worker: read a run's tensors into pooled buffers (CPU: those are the device copies;
        CUDA: pinned staging buffers, copied non_blocking on this channel's stream). Units in
        ``keep`` (ids admitted to the host cache) are read into (pinned) host tensors of their own
        instead, which become their cache entry: on a CPU device also their device copy, no copy made."""
        cpu, slabs = self.device.type == "cpu", [u.slab for u in run]     # (read once: a drop clears them)
        bufs = [self._host_tensors(u) if id(u) in keep else slab.views(u) if cpu and slab is not None else
                {k: self.buffers.take(src.shape, u.dtype or src.dtype) for k, src in u.tensors.items()}
                for u, slab in zip(run, slabs)]
        pooled = [b for u, slab, outs in zip(run, slabs, bufs) if id(u) not in keep and not (cpu and slab is not None)
                  for b in outs.values()]
        try:
            self._read_units(run, bufs, readahead)
        except Exception:
            for buf in pooled:
                self.buffers.give(buf)
            with self._lock:
                for u in run:
                    if id(u) in keep:
                        self._uncache(u)
            raise
        with self._lock:
            for u, outs in zip(run, bufs):
                if id(u) in keep and u.cached:
                    u.host_cache = outs
        if self.device.type == "cpu":
            out = bufs
        else:
            out = [{k: buf.to(self.device, non_blocking=True) for k, buf in outs.items()} if slab is None else
                   {k: slot[k].copy_(outs[k], non_blocking=True) for slot in (slab.views(u),) for k in outs}
                   for u, slab, outs in zip(run, slabs, bufs)]
            event = torch.cuda.Event()
            event.record()                       # on the disk channel's stream (current here)
            for buf in pooled:
                self.buffers.give(buf, event)
        if self.drop_page_cache:
            _drop_read_ranges(p for u in run for s in u.tensors.values() for p in getattr(s, "pieces", ()))
        return out

    def _read_units(self, run: list[Unit], outs: list[dict[str, torch.Tensor]], readahead: bool = True) -> None:
        """Read the units' tensors into ``outs``: checkpoint sources all in one :func:`read_sources`
        call (sorted by offset, back-to-back pieces coalesced into one ``preadv``), kernel readahead
        on or off; any other disk reference through its own reader."""
        from kinject.io.checkpoint import Source, read_sources

        try:
            if all(isinstance(src, Source) for u in run for src in u.tensors.values()):
                read_sources([(src, out[k]) for u, out in zip(run, outs) for k, src in u.tensors.items()],
                             readahead=readahead)
                return
            for u, out in zip(run, outs):
                for k, src in u.tensors.items():
                    src.read(u.dtype, out=out[k])
        except LoadError:
            raise
        except Exception as exc:
            names = ", ".join(u.name for u in run)
            raise LoadError(f"reading {names} from disk failed: {type(exc).__name__}: {exc}") from exc

    def _host_tensors(self, unit: Unit) -> dict[str, torch.Tensor]:
        """Fresh (pinned) host tensors for a disk unit's data (a cache entry, a read-ahead)."""
        return {k: torch.empty(src.shape, dtype=unit.dtype or src.dtype, pin_memory=self.buffers.pin)
                for k, src in unit.tensors.items()}

    def _read_into_host(self, run: list[Unit], readahead: bool = True) -> list[dict[str, torch.Tensor]]:
        """Disk worker, host window: the units' tensors read straight into fresh (pinned) host memory."""
        outs = [self._host_tensors(u) for u in run]
        self._read_units(run, outs, readahead)
        return outs

    # ------------------------------------------------------------ host cache of the disk tier

    # kinject keeps its own cache rather than leaving it to the page cache through mmap: what it
    # costs is deterministic and countable where timings are not. A hit is zero syscalls and, on a
    # CPU device, zero bytes copied (the cached tensors are the device copy); a miss is one preadv
    # per run. mmap views would also copy nothing on a hit, but fault pages in one readahead window
    # at a time, copy once more into pinned memory on a GPU, ignore host_budget and evict by the
    # kernel's LRU, not by the correlation table; and a drop-after-read benchmark would drop them.

    @property
    def host_cache_capacity(self) -> int:
        """Bytes the host cache may hold: ``host_budget`` less what the host tier holds (0 without one)."""
        if self.host_budget is None:
            return 0
        if self._host_tier_bytes is None:
            self._host_tier_bytes = sum(u.wire_nbytes for u in self.units.values() if u.tier == "host")
        return max(0, self.host_budget - self._host_tier_bytes)

    def _cache_key(self, unit: Unit) -> tuple[float, int]:
        """Eviction order, lowest first: the owner's prediction (how likely the unit is needed
        again), then least recently used; without a prediction LRU alone."""
        score = self.cache_scores.get(unit.owner)
        value = score(unit) if score is not None else None
        return (0.0 if value is None else float(value), unit.last_use)

    def _admit(self, unit: Unit) -> bool:
        """Reserve host cache room for a disk unit about to be read (lock held), evicting idle
        entries less likely to be needed than it if that makes room; False: it is not cached."""
        need, capacity = unit.wire_nbytes, self.host_cache_capacity
        if unit.cached or need > capacity:
            return False
        free = capacity - self.host_cached
        if need > free:
            mine = (self._cache_key(unit)[0], self._clock + 1)     # (it is about to be used)
            idle = sorted((u for u in self.units.values() if u.cached and u.host_cache is not None and u.refs == 0
                           and u.handle is None and u.device is None), key=self._cache_key)
            victims = []
            for u in idle:
                if free >= need or self._cache_key(u) >= mine:
                    break
                victims.append(u)
                free += u.wire_nbytes
            if free < need:
                return False
            for u in victims:
                self._uncache(u)
                self.stats["host_cache"]["evictions"] += 1
        unit.cached = True
        self.host_cached += need
        self.host_cached_peak = max(self.host_cached_peak, self.host_cached)
        return True

    def drop_host_cache(self) -> int:
        """Forget every host cache entry nobody holds (what dropping the page cache is to the kernel's
        cache: the next use reads from disk again; a benchmark's cold run). Returns the bytes freed."""
        with self._lock:
            before = self.host_cached
            for u in self.units.values():
                if u.cached and u.refs == 0 and u.handle is None and u.device is None:
                    self._uncache(u)
            return before - self.host_cached

    def _uncache(self, unit: Unit) -> None:
        """Forget a unit's host cache entry and give its bytes back (lock held)."""
        if unit.cached:
            unit.cached = False
            unit.host_cache = None
            self.host_cached -= unit.wire_nbytes

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
                h.add_done_callback(lambda h, u=u: _settle_read_ahead(u, h))

    # ------------------------------------------------------------ reporting

    def summary(self) -> dict:
        """Store accounting. ``tier_bytes``: what each tier holds (host and disk: the units' stored
        bytes, e.g. FP8 values + scales or HQQ-packed; device: resident units as they sit there)."""
        on_device = {t: sum(u.nbytes if t == "device" else u.wire_nbytes for u in self.units.values() if u.tier == t)
                     for t in TIERS}
        out = {"tier_bytes": on_device, "budget": self.budget, "peak_bytes": self.peak,
               "resident_external": self.resident_external, "units": len(self.units), **self.stats}
        out["host_cache"] = {**self.stats["host_cache"], "held_bytes": self.host_cached,
                             "peak_bytes": self.host_cached_peak, "capacity": self.host_cache_capacity}
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
    return {"bytes": {t: 0 for t in TIERS}, "loads": 0, "prefetch_skipped": 0, "evictions": 0,
            "host_cache": {"hits": 0, "misses": 0, "disk_bytes": 0, "ram_bytes": 0, "evictions": 0}}


# ``disk_readahead: auto``: a batch of reads whose units cover at least this share of the bytes they
# span gets kernel readahead (a prefill's whole layer: the bytes after one run are the next run's);
# a sparser one reads exactly its bytes (a decode step's routed experts: readahead past each run reads
# experts nobody routed to). Measured on the Qwen3-30B-A3B-shaped bench (BENCHMARKS.md, offload).
DENSE_READS = 0.5


def read_density(units: list[Unit]) -> float:
    """The share of the bytes between the first and the last byte ``units`` read (per file) that they
    read; 1.0 where nothing can be located."""
    spans: dict[str, list[int]] = {}
    for u in units:
        for f, start, end in disk_extent(u):
            span = spans.setdefault(f, [start, end, 0])
            span[0], span[1] = min(span[0], start), max(span[1], end)
            span[2] += end - start
    spanned = sum(hi - lo for lo, hi, _ in spans.values())
    return sum(n for *_, n in spans.values()) / spanned if spanned else 1.0


def disk_runs(units: list[Unit]) -> list[list[Unit]]:
    """``units`` in file order, grouped into runs of adjacent units: sorted by (file, offset) of
    their bytes, a unit joins the run before it when each of its byte ranges starts where the
    previous unit's range ends (per-expert keys of one checkpoint file; or experts ``e``, ``e+1``
    of fused ``[E, ...]`` tensors, each range in its own tensor), up to :data:`RUN_BYTES`. Units
    whose bytes cannot be located (another disk reader) come last, each alone."""
    located = sorted((u for u in units if disk_extent(u)), key=lambda u: u.extent[0][:2])
    runs: list[list[Unit]] = []
    size = 0
    for u in located:
        if runs and size + u.wire_nbytes <= RUN_BYTES and _follows(runs[-1][-1].extent, u.extent):
            runs[-1].append(u)
            size += u.wire_nbytes
        else:
            runs.append([u])
            size = u.wire_nbytes
    return runs + [[u] for u in units if not u.extent]


def disk_extent(unit: Unit) -> tuple:
    """The unit's bytes on disk as ``((file, start, end), ...)``, its pieces sorted and contiguous
    ones merged (cached on the unit); ``()`` when they cannot be located (not checkpoint sources, or
    a key missing from its file: the read reports that)."""
    if unit.extent is None:
        segs: list[list] = []
        try:
            pieces = sorted((p.located() for src in unit.tensors.values() for p in src.pieces),
                            key=lambda p: (p.file, p.offset))
        except (AttributeError, LoadError, OSError):
            pieces = []
        for p in pieces:
            if segs and segs[-1][0] == p.file and segs[-1][2] == p.offset:
                segs[-1][2] = p.offset + p.nbytes
            else:
                segs.append([p.file, p.offset, p.offset + p.nbytes])
        unit.extent = tuple(tuple(seg) for seg in segs)
    return unit.extent


def _follows(before: tuple, after: tuple) -> bool:
    """Whether each byte range of ``after`` starts where the same range of ``before`` ends."""
    return len(before) == len(after) and all(a[0] == b[0] and a[1] == b[2] for b, a in zip(before, after))


def _assembled(unit: Unit, packed: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A quantized unit's weights from its storage tensors ``packed`` (on whichever device they
    are): each stored role rebuilt by its format, the other roles in the compute dtype."""
    prefixes = tuple(f"{role}." for role in unit.quant)
    dtype = next(iter(unit.quant.values()))[1]
    out = {k: v if dtype is None or not v.is_floating_point() else v.to(dtype)
           for k, v in packed.items() if not k.startswith(prefixes)}
    for role, (_, dtype, _) in unit.quant.items():
        parts = {k[len(role) + 1:]: v for k, v in packed.items() if k.startswith(f"{role}.")}
        out[role] = unit.stored[role].assemble(parts, dtype)
    return out


def _is_stored(v: Any) -> bool:
    """A tensor a quantized checkpoint stores quantized (``kinject.io.checkpoint.StoredSource``)."""
    return hasattr(v, "storage") and hasattr(v, "assemble")


def _expand_stored(tensors: dict[str, Any], dtype: torch.dtype | None):
    """A unit's stored tensors as their storage tensors (``"<role>.<part>"``): (tensors, role ->
    (shape, compute dtype, format), role -> StoredSource)."""
    out, info, stored = {}, {}, {}
    for role, v in tensors.items():
        if not _is_stored(v):
            out[role] = v
            continue
        out.update({f"{role}.{part}": src for part, src in v.storage().items()})
        info[role] = (tuple(v.shape), dtype or v.dtype, v.fmt)
        stored[role] = v
    return out, info, stored


def _double_quantization(name: str, tensors: dict[str, Any]) -> str:
    fmt = next(v.fmt for v in tensors.values() if _is_stored(v))
    return (f"unit {name!r}: quant on weights the checkpoint already stores quantized ({fmt.describe()}) "
            "would quantize them twice; kinject refuses it: drop the quant kwarg (vars.quant) for a quantized "
            "checkpoint (its weights already move in their low-bit storage format)")


def _settle_read_ahead(unit: Unit, handle: TransferHandle) -> None:
    try:
        unit.host_cache = handle.wait(host=True)
    except Exception:   # read-ahead is best effort; the on-demand read will report the error
        unit.host_cache = None
    finally:
        unit.reading_ahead = False


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n


def _fingerprint(v: Any) -> list:
    """Cheap identity of a quantization source: shape, dtype and checksums (tensors) or the
    file pieces with their size and mtime (disk references)."""
    if isinstance(v, torch.Tensor):
        f = v.detach().float()
        return [list(v.shape), str(v.dtype), round(float(f.sum()), 4), round(float(f.abs().sum()), 4)]
    files = []
    for p in getattr(v, "pieces", ()):
        st = os.stat(p.file)
        files.append([p.file, p.key, list(p.index) if p.index else None, st.st_size, int(st.st_mtime)]
                     + ([list(p.rows)] if p.rows else []))
    return [list(v.shape), str(v.dtype), files]


def _drop_page_cache(files: Iterable[str]) -> None:
    """posix_fadvise(DONTNEED) on whole files: the next read hits the disk, not the page cache."""
    _fadvise_dontneed({f: [(0, 0)] for f in files})


def _drop_read_ranges(pieces) -> None:
    """posix_fadvise(DONTNEED) on exactly the byte ranges just read. Dropping whole files
    instead would also throw away the kernel's readahead of the next unit's bytes (measured:
    half the read throughput on a single-file checkpoint, see BENCHMARKS.md)."""
    by_file: dict[str, list] = {}
    for p in pieces:
        p = p.located()
        by_file.setdefault(p.file, []).append((p.offset, p.nbytes))
    _fadvise_dontneed(by_file)


def _fadvise_dontneed(ranges: dict[str, list[tuple[int, int]]]) -> None:
    """file -> [(offset, length)] (length 0: to the end); best effort, errors ignored."""
    if not hasattr(os, "posix_fadvise"):
        return
    for f, spans in ranges.items():
        try:
            fd = os.open(f, os.O_RDONLY)
            try:
                for offset, length in spans:
                    os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        except OSError:
            pass


def _fmt(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n} B"
