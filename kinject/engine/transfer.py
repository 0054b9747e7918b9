"""Transfer engine: moves bytes in the background, one FIFO worker per channel (``disk``: several).

Klotski (§8) overlaps I/O with compute on four CUDA streams: weight prefetch, on-demand
experts, KV load and KV store. kinject has those four channels plus ``disk`` (reads from
the disk tier). Each channel is one worker thread running jobs in submission order, like
a CUDA stream (``disk`` has ``disk_workers`` threads, so several reads are in the device
queue at once); on CUDA each channel also owns one CUDA stream, the job's ``fn`` runs with
that stream current, and an event recorded right after ``fn`` tells consumers when the
data has landed. Consumers wait with :meth:`TransferHandle.wait`, which blocks the host
only until the job was *issued*, then makes the consumer's current stream wait on the
event — never a global synchronize in the hot path.

On CPU there is no device copy: with ``inline=True`` (what the runtime uses) and no emulated
link, jobs of the host->device and KV channels run in the submitting thread (a thread
hand-off would be pure overhead), done when ``submit`` returns. With an emulated link they
run there too and are done once their link time has passed (``timed``): no thread runs them,
so the engine's Python never competes with the compute thread for the GIL (with a worker
thread per channel, a 1000 GB/s emulated link cost 14 % against no link; without, 7 %:
BENCHMARKS.md at 42891ad); one timer thread runs the done-callbacks of jobs that have some, when they land.

``emulate_bandwidth`` (GB/s, 1e9 bytes/s) throttles an emulated host→device link so overlap
can be measured without a GPU: after ``fn`` the job holds the link for ``link_bytes /
bandwidth`` (+ ``emulate_latency``) seconds. The link is shared by all host→device channels
(one PCIe direction); ``kv_store`` uses the other direction (PCIe is full duplex); ``disk`` jobs
do real I/O and use no link unless given ``link_bytes``. The link keeps its own schedule, like a
DMA engine that needs no CPU: a job holds it from ``max(link free, submitted + fn time)`` for its
seconds, and its worker (if it has one) sleeps until then; a worker that wakes late (a busy
machine) delays that job's completion, not the link's later transfers (``time.sleep`` per
transfer made a loaded 2-core box's 1 GB/s link ~2.4x slower for many small transfers). A job
never starts on the link before the previous job of its channel ended there (channels are
FIFO). Everything measured this way is emulation and is labelled so (``engine.emulated``,
``stats["emulated"]``, trace args ``emulated: true``).

Failures: a job whose ``fn`` raises leaves its worker alive; later jobs still run, and
``wait()`` raises :class:`~kinject.errors.TransferError` naming the label and channel.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch

from kinject.errors import TransferError
from kinject.engine.transfer_handles import CLOSE_JOIN_S, LinkTimer, TimedHandle, TransferHandle, until, wait_landed

if TYPE_CHECKING:
    from kinject.trace import Tracer

log = logging.getLogger(__name__)

CHANNELS = ("prefetch", "ondemand", "kv_load", "kv_store", "disk")
_D2H_CHANNELS = frozenset({"kv_store"})    # device->host direction of the link
_NO_LINK_CHANNELS = frozenset({"disk"})    # real I/O: no emulated link time by default


@dataclass
class _Job:
    handle: TransferHandle
    fn: Callable[[], Any]
    tier: str
    layer: int | None
    link_bytes: int
    after: Any = None                      # CUDA event the channel stream waits on first
    submitted: float = 0.0                 # time.perf_counter() at submit


class TransferEngine:
    """Background transfers on per-channel workers (+ CUDA streams on GPU).

    ``emulate_bandwidth``: GB/s of the emulated host→device link; ``emulate_latency``:
    seconds added per transfer that uses the link. Either one makes ``emulated`` true.
    """

    def __init__(self, device: torch.device | str = "cpu", *, emulate_bandwidth: float | None = None,
                 tracer: "Tracer | None" = None, emulate_latency: float = 0.0, disk_workers: int = 1,
                 inline: bool = False):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        if emulate_bandwidth is not None and not emulate_bandwidth > 0:
            raise ValueError(f"emulate_bandwidth must be > 0 GB/s, got {emulate_bandwidth!r}")
        if not emulate_latency >= 0:
            raise ValueError(f"emulate_latency must be >= 0 s, got {emulate_latency!r}")
        if not (isinstance(disk_workers, int) and disk_workers >= 1):
            raise ValueError(f"disk_workers must be an integer >= 1, got {disk_workers!r}")
        self.disk_workers = disk_workers
        self.device = device
        self.emulate_bandwidth = emulate_bandwidth
        self.emulate_latency = float(emulate_latency)
        self.emulated = emulate_bandwidth is not None or self.emulate_latency > 0
        # ``inline`` (the runtime asks for it): on a CPU device with no emulated link a
        # host->device "copy" is the host tensor itself, so handing it to a worker thread only
        # costs a thread switch (measured ~0.4 ms each on 2 cores: the GIL hand-off); such jobs
        # run in the caller's thread, done when submit returns. Disk reads (real I/O) keep
        # their workers; so does every channel on CUDA.
        self.inline = inline and device.type != "cuda" and not self.emulated
        # ``timed``: the same with an emulated link: jobs run in the caller's thread and hold
        # the link on its schedule, done when their link time has passed (see the module docstring)
        self.timed = inline and device.type != "cuda" and self.emulated
        self._timer = LinkTimer()
        self.tracer = tracer
        self._cuda = device.type == "cuda"
        # GPU-timed trace spans only when the tracer times CUDA and no emulation is mixed in.
        self._gpu_timing = (tracer is not None and tracer.device.type == "cuda" and self._cuda
                            and not self.emulated)
        self._streams = {c: torch.cuda.Stream(device=device) for c in CHANNELS} if self._cuda else {}
        self._links = {"h2d": threading.Lock(), "d2h": threading.Lock()}
        self._link_free = {"h2d": 0.0, "d2h": 0.0}        # perf_counter() each emulated link is free from
        self._channel_free = dict.fromkeys(CHANNELS, 0.0)   # ... and each channel's last link job ended
        self._lock = threading.Lock()
        self._queues: dict[tuple[str, str], queue.SimpleQueue] = {}
        self._workers: dict[tuple[str, str], int] = {}   # threads serving each queue
        self._threads: list[threading.Thread] = []
        self._pending: set[TransferHandle] = set()
        self._closed = False
        self._warned_unpinned = False
        self.stats: dict = {
            "bytes": dict.fromkeys(CHANNELS, 0), "jobs": dict.fromkeys(CHANNELS, 0),
            "errors": dict.fromkeys(CHANNELS, 0), "emulated_s": 0.0, "emulated": self.emulated,
        }
        # Stops the workers when the engine is closed, garbage-collected or at exit.
        self._finalizer = weakref.finalize(self, _stop_workers, self._queues, self._workers, self._timer)

    def __repr__(self) -> str:
        emu = f", emulated {self.emulate_bandwidth} GB/s" if self.emulated else ""
        return f"TransferEngine(device={self.device}{emu}{', closed' if self._closed else ''})"

    def __enter__(self) -> "TransferEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------ submitting

    def submit(self, channel: str, fn: Callable[[], Any], *, label: str, nbytes: int = 0,
               tier: str = "host", layer: int | None = None, link_bytes: int | None = None,
               wait_current: bool = False) -> TransferHandle:
        """Run ``fn()`` on ``channel``'s worker, after every job submitted there before (on
        ``disk`` with ``disk_workers`` > 1: started in submission order, run concurrently).

        ``link_bytes``: bytes over the emulated link (default ``nbytes``; 0 on ``disk``).
        ``wait_current`` (CUDA): the channel stream first waits for the work queued so far
        on the caller's current stream — needed when ``fn`` reads device tensors the caller
        just produced (device→host copies); off by default so prefetches never wait on compute.
        """
        if channel not in CHANNELS:
            raise TransferError(f"unknown transfer channel {channel!r}; channels are {', '.join(CHANNELS)}")
        if link_bytes is None:
            link_bytes = 0 if channel in _NO_LINK_CHANNELS else nbytes
        if self.timed and channel not in _NO_LINK_CHANNELS:
            return self._submit_timed(channel, [(fn, label, int(nbytes), layer, int(link_bytes))], tier)[0]
        handle = TransferHandle(label, channel, nbytes, self.device)
        if self.inline and channel not in _NO_LINK_CHANNELS:
            if self._closed:
                raise TransferError(f"cannot submit transfer '{label}': the transfer engine is closed")
            job = _Job(handle, fn, tier, layer, int(link_bytes), submitted=time.perf_counter())
            with self._lock:
                self._pending.add(handle)
            handle._issued.set_running_or_notify_cancel()
            self._execute(job)             # done (or failed) when submit returns
            return handle
        job = _Job(handle, _in_callers_mode(fn), tier, layer, int(link_bytes), submitted=time.perf_counter())
        if self._cuda and wait_current:
            job.after = torch.cuda.Event()
            job.after.record(torch.cuda.current_stream(self.device))
        self._hand_over(channel, self._run, job, (handle,))
        return handle

    def submit_many(self, channel: str, items: list[tuple[Callable[[], Any], str, int, int | None]], *,
                    tier: str = "host") -> list[TransferHandle]:
        """:meth:`submit` of the jobs ``(fn, label, nbytes, layer)`` in this order, handed to the
        channel's worker at once: one hand-off (queue, lock, worker wake-up) per batch instead of
        one per job, e.g. the tens of experts a layer prefetches per step. Each job still lands and
        runs its callbacks as soon as its own data is there, exactly as if submitted alone. The
        ``disk`` channel (several workers reading in parallel) takes them one by one."""
        if channel not in CHANNELS:
            raise TransferError(f"unknown transfer channel {channel!r}; channels are {', '.join(CHANNELS)}")
        if self.timed and channel not in _NO_LINK_CHANNELS:
            return self._submit_timed(channel, [(fn, label, int(nbytes), layer, int(nbytes)) for fn, label, nbytes, layer in items],
                                      tier) if items else []
        if (self.inline and channel not in _NO_LINK_CHANNELS) or channel == "disk":
            return [self.submit(channel, fn, label=label, nbytes=nbytes, tier=tier, layer=layer)
                    for fn, label, nbytes, layer in items]
        now = time.perf_counter()
        handles, jobs = [], []
        for fn, label, nbytes, layer in items:
            h = TransferHandle(label, channel, nbytes, self.device)
            handles.append(h)
            jobs.append(_Job(h, fn, tier, layer, int(nbytes), submitted=now))
        if jobs:   # the batch runs under the caller's grad / inference mode, entered once (see _in_callers_mode)
            self._hand_over(channel, self._run_many, (jobs, _callers_mode()), handles)
        return handles

    def _submit_timed(self, channel: str, items: list[tuple[Callable[[], Any], str, int, int | None, int]],
                      tier: str) -> list[TransferHandle]:
        """A timed engine's jobs ``(fn, label, nbytes, layer, link_bytes)``: each ``fn`` now, in the
        caller's thread; then, in order, the link from when it is free (and the channel's previous
        job has ended) for each job's seconds. One link booking and one count for the batch."""
        if self._closed:
            raise TransferError(f"cannot submit transfer '{items[0][1]}': the transfer engine is closed")
        t0 = time.perf_counter()
        device, timer = self.device, self._timer
        handles, outcomes = [], []
        for fn, label, nbytes, _, _ in items:
            handles.append(TimedHandle(label, channel, nbytes, device, timer))
            try:
                outcomes.append((fn(), None))
            except BaseException as e:     # noqa: BLE001 - reported through wait()
                outcomes.append((None, e))
        now = time.perf_counter()
        bw = self.emulate_bandwidth * 1e9 if self.emulate_bandwidth is not None else None
        latency = self.emulate_latency
        slots, total, moved, errors = [], 0.0, 0, 0
        direction = "d2h" if channel in _D2H_CHANNELS else "h2d"
        with self._links[direction]:
            free = max(self._link_free[direction], self._channel_free[channel], now)
            for (_, _, nbytes, _, link_bytes), (_, exc) in zip(items, outcomes):
                if exc is not None:
                    errors += 1
                    slots.append(None)
                    continue
                moved += nbytes
                if link_bytes > 0:         # (_link_seconds, inlined: once per unit per step)
                    secs = latency + (link_bytes / bw if bw is not None else 0.0)
                    slots.append((free, free + secs))
                    free += secs
                    total += secs
                else:
                    slots.append(None)
            if total:
                self._link_free[direction] = self._channel_free[channel] = free
        with self._lock:
            stats = self.stats
            stats["emulated_s"] += total
            stats["jobs"][channel] += len(items)
            stats["bytes"][channel] += moved
            stats["errors"][channel] += errors
        tr = self.tracer if self.tracer is not None and self.tracer.enabled else None
        for h, item, (result, exc), slot in zip(handles, items, outcomes, slots):
            h._at = slot[1] if slot is not None else now
            if tr is not None:
                job = _Job(h, None, tier, item[3], item[4])
                self._trace(tr, job, tr.at(t0), tr.at(h._at), (tr.at(slot[0]), tr.at(slot[1])) if slot else None,
                            error=exc)
            h._issued._preset(result, exc)         # (no other thread has seen the handle yet)
        return handles

    def _hand_over(self, channel: str, run: Callable, arg: Any, handles) -> None:
        """Queue ``run(arg)`` on ``channel``'s worker, the ``handles`` pending until they settle."""
        with self._lock:
            if self._closed:
                raise TransferError(f"cannot submit transfer '{handles[0].label}': the transfer engine is closed")
            work = self._queue("work", channel)
            if self._cuda:
                self._queue("land", channel)
            self._pending.update(handles)
            work.put((run, arg))

    @property
    def traced(self) -> bool:
        """Whether transfers are traced (a caller may skip building what only the trace reads)."""
        return self.tracer is not None and self.tracer.enabled

    def count_inline_jobs(self, channel: str, jobs: int, nbytes: int) -> None:
        """:meth:`count_inline_many` of ``jobs`` transfers of ``nbytes`` in all, when not tracing."""
        with self._lock:
            self.stats["jobs"][channel] += jobs
            self.stats["bytes"][channel] += nbytes

    def count_inline_many(self, channel: str, items: list[tuple[str, int, int | None]], *, tier: str = "host") -> None:
        """Account (and trace, when tracing) transfers ``(label, nbytes, layer)`` the caller did in
        place: on an :attr:`inline` engine a host unit's "copy" is its host tensors, no job is made."""
        with self._lock:
            self.stats["jobs"][channel] += len(items)
            self.stats["bytes"][channel] += sum(n for _, n, _ in items)
        tr = self.tracer
        if tr is not None and tr.enabled:
            t = tr.now()
            for label, nbytes, layer in items:
                tr.record(channel, label, t, t, kind="transfer", layer=layer, nbytes=nbytes, tier=tier)

    def cross_link(self, nbytes: int, *, channel: str, label: str, layer: int | None = None,
                   wait: bool = False) -> None:
        """Activations that cross the link beside the weights (the rows of experts computed where they
        live, in on ``ondemand``, out on ``kv_store``): a timed engine books the emulated link for
        them like any transfer (``wait``: returns once they have landed, as a consumer of the result
        must); otherwise the caller moved them (CUDA: its own copies) or nothing moves (a CPU device),
        and they are counted (and traced) here. Tier ``activations`` in the trace."""
        if nbytes <= 0:
            return
        if self.timed:
            if self.tracer is not None and self.tracer.enabled:
                h = self._submit_timed(channel, [(_nothing, label, int(nbytes), layer, int(nbytes))], "activations")[0]
                if wait:
                    wait_landed(h)
                return
            at = self._book_crossing(channel, int(nbytes))
            if wait:
                until(at)
            return
        if self.tracer is not None and self.tracer.enabled:
            self.count_inline_many(channel, [(label, int(nbytes), layer)], tier="activations")
            return
        with self._lock:                     # (untraced: counted, twice per layer per step)
            stats = self.stats
            stats["jobs"][channel] += 1
            stats["bytes"][channel] += int(nbytes)

    def _book_crossing(self, channel: str, nbytes: int) -> float:
        """:meth:`_submit_timed` of one activation crossing, untraced (twice per layer per step at
        batch 1): the same link booking and counts, without a job, a handle or a batch; returns when
        (``perf_counter``) it has landed."""
        if self._closed:
            raise TransferError(f"cannot book a crossing of {nbytes} bytes on '{channel}': the transfer engine is closed")
        secs = self._link_seconds(nbytes)
        direction = "d2h" if channel in _D2H_CHANNELS else "h2d"
        now = time.perf_counter()
        with self._links[direction]:
            start = self._link_free[direction]
            if self._channel_free[channel] > start:
                start = self._channel_free[channel]
            at = (start if start > now else now) + secs
            if secs:
                self._link_free[direction] = self._channel_free[channel] = at
        with self._lock:
            stats = self.stats
            stats["emulated_s"] += secs
            stats["jobs"][channel] += 1
            stats["bytes"][channel] += nbytes
        return at

    def copy_to_device(self, src: torch.Tensor, *, channel: str, label: str, layer: int | None = None,
                       tier: str = "host", out: torch.Tensor | None = None,
                       wait_current: bool = False) -> TransferHandle:
        """Host→device copy of ``src`` (into ``out`` if given); the handle's result is the copy.

        CUDA: ``non_blocking`` copy on the channel stream; ``src`` should be pinned
        (:meth:`pin`) for a truly asynchronous copy. ``out`` must not be in use by pending
        device work (or pass ``wait_current=True``). CPU device: the result is ``src``
        itself (or ``out`` after copying into it), still paying emulated link time.
        """
        nbytes = src.numel() * src.element_size()
        if not self._cuda or src.device == self.device:
            link = nbytes if src.device.type == "cpu" else 0

            def fn():
                if out is not None and out is not src:
                    return out.copy_(src)
                return src
        else:
            link = nbytes
            if src.device.type == "cpu" and not src.is_pinned() and not self._warned_unpinned:
                self._warned_unpinned = True
                log.warning("copy_to_device('%s'): source is not pinned, so the host->device copy "
                            "is synchronous; pin host tensors (TransferEngine.pin) for overlap "
                            "(warned once)", label)

            def fn():
                dst = out if out is not None else torch.empty_like(src, device=self.device)
                dst.copy_(src, non_blocking=True)
                return dst
        return self.submit(channel, fn, label=label, nbytes=nbytes, tier=tier, layer=layer,
                           link_bytes=link, wait_current=wait_current)

    def copy_to_host(self, src: torch.Tensor, *, label: str, channel: str = "kv_store",
                     layer: int | None = None, out: torch.Tensor | None = None) -> TransferHandle:
        """Device→host copy of ``src`` into pinned memory (or ``out``); result is the copy.

        CUDA: the channel stream first waits for the caller's current stream (``src`` was
        probably just computed there), then copies ``non_blocking``; ``src`` is
        ``record_stream``-ed so it may be freed right after submitting. Read the result on
        the host only after ``wait(host=True)``. CPU device: the result is ``src`` itself
        (or ``out`` after copying into it).
        """
        nbytes = src.numel() * src.element_size()
        if not self._cuda or src.device.type == "cpu":
            def fn():
                if out is not None and out is not src:
                    return out.copy_(src)
                return src
        else:
            def fn():
                dst = out if out is not None else torch.empty(src.shape, dtype=src.dtype, pin_memory=True)
                dst.copy_(src, non_blocking=True)
                src.record_stream(torch.cuda.current_stream(self.device))   # read on this stream
                return dst
        return self.submit(channel, fn, label=label, nbytes=nbytes, tier="device", layer=layer,
                           wait_current=True)

    def empty_host(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """An empty host tensor, pinned when the device is CUDA (what :meth:`pin` would make of one)."""
        return torch.empty(tuple(shape), dtype=dtype, pin_memory=self._cuda)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        """A pinned copy of a host tensor when the device is CUDA; otherwise ``t`` itself."""
        if self._cuda and t.device.type == "cpu" and not t.is_pinned():
            return t.pin_memory()
        return t

    # ------------------------------------------------------------------ lifecycle

    def synchronize(self, timeout: float | None = None) -> None:
        """Wait until every job submitted so far has finished (not for the hot path).

        Does not raise for failed jobs (their ``wait()`` does); raises
        :class:`TransferError` if jobs are still running after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if self.timed:                     # the link's booked time, then the callbacks due in it
            left = max(self._link_free.values()) - time.perf_counter()
            if left > 0:
                if timeout is not None and left > timeout:
                    raise TransferError(f"transfers still on the emulated link after {timeout}s")
                time.sleep(left)
            if not self._timer.drain(deadline):
                raise TransferError(f"transfer callbacks still running after {timeout}s")
        with self._lock:                   # (a handle still pending gets the event its settling sets)
            pending = list(self._pending)
            for h in pending:
                if h._settled is None:
                    h._settled = threading.Event()
        for h in pending:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not h._settled.wait(left):
                break
        labels = sorted(h.label for h in pending if not h._settled.is_set())
        if labels:
            raise TransferError(f"{len(labels)} transfer(s) still running after {timeout}s: "
                                f"{', '.join(labels[:8])}{' ...' if len(labels) > 8 else ''}")
        for s in self._streams.values():
            s.synchronize()

    def close(self) -> None:
        """Cancel jobs not started yet, let running ones finish, stop the threads. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pending = list(self._pending)
        for h in pending:
            if h._issued.cancel():         # not started: the worker will skip it
                self._settle(h, cancel=True)
        self._finalizer()                  # sentinels to every queue
        deadline = time.monotonic() + CLOSE_JOIN_S
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ worker side

    def _queue(self, kind: str, channel: str) -> queue.SimpleQueue:
        """The queue of ``(kind, channel)``, starting its daemon thread(s) on first use (lock held).
        The disk channel's work queue has ``disk_workers`` threads: reads of different units
        then overlap in the device queue (the data lands in order of completion, not submission)."""
        q = self._queues.get((kind, channel))
        if q is None:
            q = queue.SimpleQueue()
            n = self.disk_workers if (kind, channel) == ("work", "disk") else 1
            for i in range(n):
                t = threading.Thread(target=_worker_loop, args=(q, self.device if self._cuda else None), daemon=True,
                                     name=f"kinject-{kind}-{channel}" + (f"-{i}" if n > 1 else ""))
                t.start()
                self._threads.append(t)
            self._queues[(kind, channel)] = q
            self._workers[(kind, channel)] = n
        return q

    def _run(self, job: _Job) -> None:
        """Worker thread: run one job, then hand it to landing (CUDA) or finish it (CPU)."""
        h = job.handle
        if not h._issued.set_running_or_notify_cancel():
            return                          # cancelled by close()
        try:
            self._execute(job)
        except BaseException as exc:       # noqa: BLE001 - an engine bug: never leave a waiter hanging
            log.exception("transfer '%s': internal error in the transfer engine", h.label)
            if not h._issued.done():
                h._issued.set_exception(exc)
            self._settle(h, exc=exc)

    def _run_many(self, batch: tuple[list[_Job], tuple[bool, bool] | None]) -> None:
        """Worker thread: :meth:`_run` each job of a :meth:`submit_many` batch, in order, under
        the submitter's modes (``None``: the worker's own, the defaults)."""
        jobs, mode = batch
        if mode is None:
            for job in jobs:
                self._run(job)
            return
        with torch.inference_mode(mode[0]), torch.set_grad_enabled(mode[1]):
            for job in jobs:
                self._run(job)

    def _execute(self, job: _Job) -> None:
        h = job.handle
        tr = self.tracer if self.tracer is not None and self.tracer.enabled else None
        clock = tr.now if tr is not None else time.perf_counter
        t0 = clock()
        link = None
        try:
            if self._cuda:
                result, event = self._issue_cuda(job, tr)
            else:
                result, event = job.fn(), None
            secs = 0.0
            if self.emulated and job.link_bytes > 0:
                start, end, secs = self._occupy_link(job, fn_s=clock() - t0)
                link = (tr.at(start), tr.at(end)) if tr is not None else (start, end)
                t0 = min(t0, link[0])      # the link may have started it while this worker was not running
        except BaseException as exc:       # noqa: BLE001 - reported through wait()
            self._count(job, ok=False)
            if tr is not None and not self._gpu_timing:
                self._trace(tr, job, t0, clock(), link, error=exc)
            h._issued.set_exception(exc)
            self._settle(h, exc=exc)
            return
        h._event = event
        self._count(job, ok=True, emulated_s=secs)
        if tr is not None and not self._gpu_timing:
            self._trace(tr, job, t0, clock(), link)
        h._issued.set_result(result)
        if event is None:
            self._settle(h, result)
            return
        with self._lock:
            inline = self._closed          # landing threads are stopping: land here
            if not inline:
                self._queues[("land", h.channel)].put((self._land, h))
        if inline:
            self._land(h)

    def _issue_cuda(self, job: _Job, tr: "Tracer | None"):
        """Run ``fn`` with the channel stream current; record the completion event on it."""
        stream = self._streams[job.handle.channel]
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            if job.after is not None:
                stream.wait_event(job.after)
            if tr is not None and self._gpu_timing:   # GPU-timed: events on the channel stream
                with tr.span(job.handle.channel, job.handle.label, kind="transfer", layer=job.layer,
                             nbytes=job.handle.nbytes, tier=job.tier):
                    result = job.fn()
            else:
                result = job.fn()
            event = torch.cuda.Event(blocking=True)   # blocking: the landing thread sleeps, not spins
            event.record(stream)
        return result, event

    def _occupy_link(self, job: _Job, fn_s: float) -> tuple[float, float, float]:
        """Hold the emulated link for the job's bytes on the link's own schedule (see the module
        docstring); sleeps until the job's link time ends. Returns that (start, end), perf_counter,
        and its seconds."""
        secs = self._link_seconds(job.link_bytes)
        direction = "d2h" if job.handle.channel in _D2H_CHANNELS else "h2d"
        channel = job.handle.channel
        with self._links[direction]:
            start = max(self._link_free[direction], max(job.submitted, self._channel_free[channel]) + fn_s)
            end = start + secs
            self._link_free[direction] = self._channel_free[channel] = end
        now = time.perf_counter()
        if end > now:
            time.sleep(end - now)
        return start, end, secs

    def _link_seconds(self, link_bytes: int) -> float:
        """Seconds a job of ``link_bytes`` holds the emulated link."""
        bw = self.emulate_bandwidth
        return self.emulate_latency + (link_bytes / (bw * 1e9) if bw is not None else 0.0)

    def _land(self, h: TransferHandle) -> None:
        """Landing thread (CUDA): wait for the job's event, then mark the handle done."""
        try:
            h._event.synchronize()
        except BaseException as exc:       # noqa: BLE001
            self._settle(h, exc=exc)
            return
        self._settle(h, h._issued.result())

    def _settle(self, h: TransferHandle, result: Any = None, *, exc: BaseException | None = None,
                cancel: bool = False) -> None:
        """Mark ``h`` landed (running its callbacks here), then forget it. Off CUDA landing is
        issuing: the outcome is set (and its callbacks ran) already. Idempotent."""
        try:
            landed = h._landed
            if not landed.done():
                if cancel:
                    landed.cancel()
                elif exc is not None:
                    landed.set_exception(exc)
                else:
                    landed.set_result(result)
        finally:
            with self._lock:
                self._pending.discard(h)
                settled = h._settled
            if settled is not None:
                settled.set()

    def _count(self, job: _Job, ok: bool, emulated_s: float = 0.0) -> None:
        ch = job.handle.channel
        with self._lock:
            self.stats["emulated_s"] += emulated_s
            self.stats["jobs"][ch] += 1
            if ok:
                self.stats["bytes"][ch] += job.handle.nbytes
            else:
                self.stats["errors"][ch] += 1

    def _trace(self, tr: "Tracer", job: _Job, start: float, end: float,
               link: tuple[float, float] | None, error: BaseException | None = None) -> None:
        args: dict = {}
        if self.emulated:
            args["emulated"] = True
            if link is not None:
                args["link_start"], args["link_end"] = link
        if self._cuda:
            args["timing"] = "host (issue)"
        if error is not None:
            args["error"] = f"{type(error).__name__}: {error}"
        h = job.handle
        try:
            tr.record(h.channel, h.label, start, end, kind="transfer", layer=job.layer,
                      nbytes=0 if error is not None else h.nbytes, tier=job.tier, args=args)
        except Exception:                  # tracing must never break a transfer
            log.exception("tracing transfer '%s' failed", h.label)


def _nothing() -> None:
    return None


def reading_syncs(t: torch.Tensor) -> bool:
    """Whether reading ``t``'s values on the host (``torch.equal``, ``bool()``, ``item()``) makes the
    host wait for a device: hot paths queue such a check on the device and read it later, once."""
    return t.device.type != "cpu"


def host_to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small tensor the host just built (group offsets, row indices) on ``device``, without the
    host waiting for the device: CUDA stages a copy from pageable memory itself and "may
    synchronize with the stream" to do so (CUDA runtime API, API synchronization behavior), which
    would stall the compute thread once per expert group. So the copy goes ``non_blocking`` from a
    pinned copy; torch's caching host allocator records the copy's event on it and reuses that
    memory only after the copy has run. On the tensor's own device: ``t`` itself."""
    if t.device == device:
        return t
    if device.type == "cuda" and t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def _in_callers_mode(fn: Callable[[], Any]) -> Callable[[], Any]:
    """Run ``fn`` on a worker under the submitter's grad / inference mode: both are
    thread-local, and tensors made under ``torch.inference_mode()`` (as in a generate
    called inside it) may only be updated in place inside it."""
    mode = _callers_mode()
    if mode is None:
        return fn
    inference, grad = mode

    def wrapped():
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):
            return fn()

    return wrapped


def _callers_mode() -> tuple[bool, bool] | None:
    """The caller's (inference mode, grad mode), or None when they are a new thread's defaults."""
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()
    return None if not inference and grad else (inference, grad)


def _worker_loop(q: queue.SimpleQueue, device: torch.device | None = None) -> None:
    """Body of every engine thread: run ``(fn, arg)`` items until a ``None`` sentinel. ``device``
    (CUDA): the thread's current device, set once, so that what a job or a landing does without a
    device guard (``Event.synchronize``, a tensor made without ``device=``) is on the engine's GPU,
    not on GPU 0, where it would also create a CUDA context."""
    if device is not None:
        torch.cuda.set_device(device)
    while True:
        item = q.get()
        if item is None:
            return
        fn, arg = item
        try:
            fn(arg)
        except Exception:                  # keep the worker alive whatever happens
            log.exception("kinject transfer worker: unexpected error")
        del item, fn, arg                  # hold no engine reference while idle


def _stop_workers(queues: dict, workers: dict, timer: "LinkTimer | None" = None) -> None:
    if timer is not None:
        timer.stop()
    for key, q in list(queues.items()):
        for _ in range(workers.get(key, 1)):
            q.put(None)


