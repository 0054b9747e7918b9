"""What a transfer hands its consumer: the handle to wait on, and the clock of an emulated link.

A :class:`TransferHandle` is a future of one transfer (kinject/engine/transfer.py runs them): the
host blocks only until the job was issued, then the consumer's stream waits on the job's CUDA
event, so no global synchronize sits in the hot path; the device tensors of its result are
``record_stream``-ed on the waiting stream so the caching allocator keeps them alive.
:class:`TimedHandle` is a handle on an emulated link: done when its link time has passed, with
:class:`LinkTimer`, one thread that runs the done-callbacks of such handles in time order.
:func:`wait_landed` waits for a small transfer without oversleeping (docs/architecture.md,
"The data path of one decode step").
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from concurrent.futures import CancelledError, InvalidStateError
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any, Callable

import torch

from kinject.errors import TransferError

log = logging.getLogger("kinject.engine.transfer")

CLOSE_JOIN_S = 5.0                        # close() waits at most this long for workers in total

_PENDING, _RUNNING, _CANCELLED, _FINISHED = range(4)
_OUTCOME_LOCK = threading.Lock()           # every outcome's state change: a few assignments under it


class _Outcome:
    """The part of ``concurrent.futures.Future`` a handle uses, without a ``Condition`` (two locks)
    made per instance: a handle has one or two of these per unit per step, and making Futures was
    half the cost of a submit. A waiter that finds it pending makes the one ``Event`` it sleeps on; callbacks
    run in the thread that completes it (exceptions logged), as with a Future."""

    __slots__ = ("_state", "_result", "_exc", "_callbacks", "_event")

    def __init__(self):
        self._state = _PENDING
        self._result = self._exc = self._callbacks = self._event = None

    def done(self) -> bool:
        return self._state >= _CANCELLED

    def cancelled(self) -> bool:
        return self._state == _CANCELLED

    def set_running_or_notify_cancel(self) -> bool:
        """False if it was cancelled (the job must not run), else marks it running."""
        with _OUTCOME_LOCK:
            if self._state == _CANCELLED:
                return False
            if self._state != _PENDING:
                raise InvalidStateError(f"outcome already {('running', 'finished')[self._state == _FINISHED]}")
            self._state = _RUNNING
            return True

    def cancel(self) -> bool:
        """Cancel if not running or finished (True also when already cancelled)."""
        with _OUTCOME_LOCK:
            if self._state in (_RUNNING, _FINISHED):
                return False
            if self._state == _CANCELLED:
                return True
            self._state = _CANCELLED
        self._wake()
        return True

    def set_result(self, result: Any) -> None:
        self._finish(result, None)

    def _preset(self, result: Any, exc: BaseException | None) -> None:
        """Finished before any other thread can see it (no lock, no waiter, no callback yet)."""
        self._result, self._exc, self._state = result, exc, _FINISHED

    def set_exception(self, exc: BaseException) -> None:
        self._finish(None, exc)

    def _finish(self, result: Any, exc: BaseException | None) -> None:
        with _OUTCOME_LOCK:
            if self._state >= _CANCELLED:
                raise InvalidStateError("outcome already done")
            self._result, self._exc, self._state = result, exc, _FINISHED
        self._wake()

    def _wake(self) -> None:
        with _OUTCOME_LOCK:
            event, callbacks, self._callbacks = self._event, self._callbacks, None
        if event is not None:
            event.set()
        for fn in callbacks or ():
            _call_back(fn, self)

    def add_done_callback(self, fn: Callable[["_Outcome"], Any]) -> None:
        with _OUTCOME_LOCK:
            if self._state < _CANCELLED:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(fn)
                return
        _call_back(fn, self)

    def wait(self, timeout: float | None = None) -> bool:
        """Whether it is done, waiting up to ``timeout`` seconds (None: for ever)."""
        if self._state >= _CANCELLED:
            return True
        with _OUTCOME_LOCK:
            if self._state >= _CANCELLED:
                return True
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        return event.wait(timeout)

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self.wait(timeout):
            raise FutureTimeout()
        if self._state == _CANCELLED:
            raise CancelledError()
        return self._exc

    def result(self, timeout: float | None = None) -> Any:
        exc = self.exception(timeout)
        if exc is not None:
            raise exc
        return self._result


class TransferHandle:
    """A submitted job. ``done()`` never blocks; ``wait()`` returns the job's result.

    On CUDA "done" means the data has landed (the job's event completed); on CPU it means
    ``fn`` (and the emulated link time) finished.
    """

    __slots__ = ("label", "channel", "nbytes", "_device", "_issued", "_landed", "_settled", "_event")

    def __init__(self, label: str, channel: str, nbytes: int, device: torch.device):
        self.label = label
        self.channel = channel
        self.nbytes = nbytes
        self._device = device
        self._issued = _Outcome()         # fn returned (+ emulated link time): result or exception
        # data is really there: on CUDA when the job's event completes; elsewhere when it is issued
        self._landed = _Outcome() if device.type == "cuda" else self._issued
        self._settled: threading.Event | None = None   # made by synchronize(): set once settled
        self._event = None                # CUDA event recorded on the channel stream after fn

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"TransferHandle({self.label!r}, channel={self.channel!r}, nbytes={self.nbytes}, {state})"

    def done(self) -> bool:
        if self._landed.done():
            return True
        return self._issued.done() and self._event is not None and self._event.query()

    def wait(self, timeout: float | None = None, *, host: bool = False) -> Any:
        """Wait for the job and return its result.

        Blocks the host until the worker has issued the job (at most ``timeout`` seconds,
        else :class:`TransferError`). On CUDA the current stream then waits on the job's
        event (no host sync) and every CUDA tensor in the result is ``record_stream``-ed on
        it, so the caching allocator cannot reuse its memory early. ``host=True`` also
        blocks the host until the data has landed — needed before the host reads a
        device→host result (``copy_to_host``).
        """
        where = f"transfer '{self.label}' on channel '{self.channel}'"
        try:
            exc = self._issued.exception(timeout)
        except FutureTimeout:
            raise TransferError(f"{where} timed out after {timeout}s") from None
        except CancelledError:
            raise TransferError(f"{where} was cancelled (transfer engine closed)") from None
        if exc is not None:
            raise TransferError(f"{where} failed: {type(exc).__name__}: {exc}") from exc
        result = self._issued.result()
        if self._event is not None:
            cur = torch.cuda.current_stream(self._device)
            cur.wait_event(self._event)
            _record_stream(result, cur)
            if host:
                self._event.synchronize()
        return result

    def landed_result(self) -> Any:
        """The result if the job has landed without error, else None (never blocks)."""
        f = self._landed
        return f._result if f._state == _FINISHED and f._exc is None else None

    def add_done_callback(self, fn: Callable[["TransferHandle"], Any]) -> None:
        """Call ``fn(handle)`` once when done (or failed, or cancelled).

        Runs on an engine thread, or right away in the caller's thread if already done.
        Exceptions raised by ``fn`` are logged, not propagated.
        """
        self._landed.add_done_callback(lambda _f: fn(self))


class PartHandle:
    """One item of a job that produced several results at once (a run of adjacent disk units read
    with one request): the job's handle, answering with ``result[index]``. Consumers see a
    :class:`TransferHandle` (same methods): each unit lands when its run lands."""

    __slots__ = ("job", "index", "label", "channel", "nbytes")

    def __init__(self, job: TransferHandle, index: int, label: str, nbytes: int):
        self.job, self.index, self.label, self.nbytes = job, index, label, nbytes
        self.channel = job.channel

    def __repr__(self) -> str:
        return f"PartHandle({self.label!r}, item {self.index} of {self.job!r})"

    def done(self) -> bool:
        return self.job.done()

    def wait(self, timeout: float | None = None, *, host: bool = False) -> Any:
        return self.job.wait(timeout, host=host)[self.index]

    def landed_result(self) -> Any:
        result = self.job.landed_result()
        return None if result is None else result[self.index]

    def add_done_callback(self, fn: Callable[["PartHandle"], Any]) -> None:
        self.job.add_done_callback(lambda _h: fn(self))


class TimedHandle(TransferHandle):
    """A job of a timed engine (an emulated link on a CPU, see the module docstring): it ran when
    submitted and is done once its link time (``_at``, ``perf_counter()``) has passed."""

    __slots__ = ("_at", "_timer")

    def __init__(self, label: str, channel: str, nbytes: int, device: torch.device, timer: "LinkTimer"):
        # TransferHandle's fields set here (one per unit per step: no super() call); never CUDA,
        # so landing is issuing
        self.label, self.channel, self.nbytes, self._device = label, channel, nbytes, device
        self._issued = self._landed = _Outcome()
        self._settled = self._event = None
        self._at = 0.0
        self._timer = timer

    def done(self) -> bool:
        return time.perf_counter() >= self._at

    def wait(self, timeout: float | None = None, *, host: bool = False) -> Any:
        left = self._at - time.perf_counter()
        if left > 0:
            if timeout is not None and timeout < left:
                time.sleep(max(timeout, 0.0))
                raise TransferError(f"transfer '{self.label}' on channel '{self.channel}' timed out after {timeout}s")
            until(self._at)
        return super().wait(timeout)

    def landed_result(self) -> Any:
        return super().landed_result() if self.done() else None

    def add_done_callback(self, fn: Callable[["TransferHandle"], Any]) -> None:
        if self.done():
            _call_back(fn, self)
        else:
            self._timer.add(self._at, fn, self)


class LinkTimer:
    """One daemon thread calling ``fn(arg)`` at given ``perf_counter()`` times, in time order
    (started on first use): the done-callbacks of a timed engine's jobs."""

    def __init__(self):
        self._heap: list = []
        self._seq = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._busy = False                 # callbacks taken off the heap are running
        self._stopped = False

    def add(self, at: float, fn: Callable, arg: Any) -> None:
        with self._cv:
            if not self._stopped:
                heapq.heappush(self._heap, (at, self._seq, fn, arg))
                self._seq += 1
                if self._thread is None:
                    self._thread = threading.Thread(target=self._loop, daemon=True, name="kinject-link-timer")
                    self._thread.start()
                if self._heap[0][1] == self._seq - 1:
                    self._cv.notify_all()  # a new earliest time
                return
        _call_back(fn, arg)                # stopped: at once

    def _loop(self) -> None:
        cv = self._cv
        while True:
            with cv:
                while True:
                    if self._stopped and not self._heap:
                        return
                    left = self._heap[0][0] - time.perf_counter() if self._heap else None
                    if self._stopped or (left is not None and left <= 0):
                        break
                    cv.wait(left)
                now, due = time.perf_counter(), []
                while self._heap and (self._stopped or self._heap[0][0] <= now):
                    due.append(heapq.heappop(self._heap))
                self._busy = True
            for _, _, fn, arg in due:
                _call_back(fn, arg)
            with cv:
                self._busy = False
                cv.notify_all()            # drain() waiters

    def drain(self, deadline: float | None) -> bool:
        """Wait until every callback added so far has run (False at ``deadline``, monotonic)."""
        with self._cv:
            while self._heap or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def stop(self) -> None:
        """Run what is left at once, then end the thread."""
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=CLOSE_JOIN_S)


def _call_back(fn: Callable, arg: Any) -> None:
    try:
        fn(arg)
    except Exception:                      # as Future: a callback's error is logged, not raised
        log.exception("transfer callback failed")


def wait_landed(handle: TransferHandle | None) -> None:
    """Wait for a small transfer (a few kilobytes of activations): ``time.sleep`` wakes up tens of
    microseconds late, longer than such a transfer holds an emulated link, so a timed handle's last
    200 µs are spun out on the clock instead. Not by ``sleep(0)``: on a loaded machine yielding the
    CPU deschedules the thread for milliseconds, hundreds of times the transfer."""
    if handle is None:
        return
    if not isinstance(handle, TimedHandle):
        handle.wait()
        return
    until(handle._at)


def until(at: float) -> None:
    """Return at ``perf_counter() == at``: sleep to 200 µs before, spin the rest (see :func:`wait_landed`)."""
    left = at - time.perf_counter()
    if left > 2e-4:
        time.sleep(left - 2e-4)
    while time.perf_counter() < at:
        pass


def for_each_tensor(obj: Any, visit: Callable[[torch.Tensor], Any]) -> None:
    """Call ``visit`` on every tensor in ``obj`` (tensors, lists / tuples, dict values), in order."""
    if isinstance(obj, torch.Tensor):
        visit(obj)
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            for_each_tensor(x, visit)
    elif isinstance(obj, dict):
        for x in obj.values():
            for_each_tensor(x, visit)


def _record_stream(obj: Any, stream) -> None:
    """``record_stream`` every CUDA tensor in ``obj``."""
    for_each_tensor(obj, lambda t: t.record_stream(stream) if t.is_cuda else None)
