"""Disk reads in file order: where a unit's bytes are, and which units one request reads.

The store reads a batch of disk units as runs of adjacent units (:func:`disk_runs`), one transfer
job per run and one ``preadv`` per contiguous byte range, in file order whatever order they were
asked in; :func:`read_density` decides whether the kernel's readahead helps such a batch
(``pipeline.disk_readahead: auto``). :func:`read_units` is what a disk worker runs for one run.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, ContextManager

import torch

from kinject.engine.disk_sources import Source, read_sources
from kinject.engine.page_cache import drop_read_ranges
from kinject.errors import LoadError

if TYPE_CHECKING:
    from kinject.engine.buffer_pool import BufferPool
    from kinject.engine.host_cache import HostCache
    from kinject.engine.transfer_handles import TransferHandle
    from kinject.engine.unit import Unit

# Largest run of adjacent disk units read as one job (one preadv per contiguous range): long enough
# for sequential throughput, short enough that the first experts of a batch land (and compute)
# before the whole batch is read, and that several disk workers share a large batch.
RUN_BYTES = 64 << 20


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


def read_run(run: list[Unit], keep: set[int], readahead: bool, *, device: torch.device, pool: BufferPool,
             lock: ContextManager, cache: HostCache, drop_ranges: bool) -> list[dict[str, torch.Tensor]]:
    """Disk worker: read a run's tensors into pooled buffers (CPU: those are the device copies;
    CUDA: pinned staging buffers, copied non_blocking on this channel's stream). Units in
    ``keep`` (ids admitted to the host cache) are read into (pinned) host tensors of their own
    instead, which become their cache entry: on a CPU device also their device copy, no copy made.
    The store hands in its device, read buffer pool, lock, host cache and ``drop_page_cache`` setting."""
    cpu, slabs = device.type == "cpu", [u.slab for u in run]     # (read once: a drop clears them)
    bufs = [host_tensors(u, pool.pin) if id(u) in keep else slab.views(u) if cpu and slab is not None else
            {k: pool.take(src.shape, u.dtype or src.dtype) for k, src in u.tensors.items()}
            for u, slab in zip(run, slabs)]
    pooled = [b for u, slab, outs in zip(run, slabs, bufs) if id(u) not in keep and not (cpu and slab is not None)
              for b in outs.values()]
    try:
        read_units(run, bufs, readahead)
    except Exception:
        for buf in pooled:
            pool.give(buf)
        with lock:
            for u in run:
                if id(u) in keep:
                    cache.forget(u)
        raise
    with lock:
        for u, outs in zip(run, bufs):
            if id(u) in keep and u.cached:
                u.host_cache = outs
    if device.type == "cpu":
        out = bufs
    else:
        out = [{k: buf.to(device, non_blocking=True) for k, buf in outs.items()} if slab is None else
               {k: slot[k].copy_(outs[k], non_blocking=True) for slot in (slab.views(u),) for k in outs}
               for u, slab, outs in zip(run, slabs, bufs)]
        event = torch.cuda.Event()
        event.record()                       # on the disk channel's stream (current here)
        for buf in pooled:
            pool.give(buf, event)
    if drop_ranges:
        drop_read_ranges(p for u in run for s in u.tensors.values() for p in getattr(s, "pieces", ()))
    return out


def read_units(run: list[Unit], outs: list[dict[str, torch.Tensor]], readahead: bool = True) -> None:
    """Read the units' tensors into ``outs``: checkpoint sources all in one :func:`read_sources`
    call (sorted by offset, back-to-back pieces coalesced into one ``preadv``), kernel readahead
    on or off; any other disk reference through its own reader."""
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

def host_tensors(unit: Unit, pin: bool) -> dict[str, torch.Tensor]:
    """Fresh (pinned) host tensors for a disk unit's data (a cache entry, a read-ahead)."""
    return {k: torch.empty(src.shape, dtype=unit.dtype or src.dtype, pin_memory=pin)
            for k, src in unit.tensors.items()}

def read_into_host(run: list[Unit], pin: bool, readahead: bool = True) -> list[dict[str, torch.Tensor]]:
    """Disk worker, host window: the units' tensors read straight into fresh (pinned) host memory."""
    outs = [host_tensors(u, pin) for u in run]
    read_units(run, outs, readahead)
    return outs


def settle_read_ahead(unit: Unit, handle: TransferHandle) -> None:
    """A read-ahead's transfer ended: its tensors are the unit's host copy (none if it failed)."""
    try:
        unit.host_cache = handle.wait(host=True)
    except Exception:   # read-ahead is best effort; the on-demand read will report the error
        unit.host_cache = None
    finally:
        unit.reading_ahead = False
