"""Concurrent requests into Klotski batch groups: one worker thread owns the model.

Generation is per batch group (one ``model.generate`` for ``n x bs`` sequences, docs/architecture.md,
"Serving"), so a server gets its throughput by letting concurrent requests share a group rather
than generating each alone. :class:`GroupWorker` keeps the waiting requests in arrival order; a
group starts when ``n x bs`` sequences wait or when the oldest has waited ``batch_wait`` seconds,
whichever comes first, and takes whole requests (a request's ``n`` choices stay together) up to
``n x bs`` sequences. While the group runs, each step's news (streamed text, finished sequences)
reaches the event loop in one ``call_soon_threadsafe`` per step (:mod:`kinject.app.sequences`): a
sequence's request is answered the step it finishes, its slot is given back when the group ends.
A request whose client went away is dropped if still waiting, or stops generating at the next step.

Where the news goes is the worker's :class:`Delivery`: :class:`LoopDelivery` hands it to the event
loop of the same process (``kinject serve --engine inprocess``, tests); the engine process of
:mod:`kinject.app.engine_process` runs this same worker with a delivery that writes it to a pipe, so
the grouping policy lives here alone.

Nothing here knows HTTP: :mod:`kinject.app.serve` puts :class:`Job` objects in and reads their
events; :class:`ServeMetrics` is what ``GET /metrics`` prints.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

from kinject.app.openai_protocol import ParsedRequest, ProtocolError, error_body
from kinject.app.run import RunStats, harvest_trace
from kinject.app.sequences import Sequence, StepEvent, generate_sequences

logger = logging.getLogger(__name__)

END = object()          # a job's last event
GONE = object()         # the client hung up (put by the server, :meth:`Job.client_gone`)


class Job:
    """One request on its way through the worker; lives on the event loop, fed by the worker.

    ``events`` gets ``(choice index, text, finish reason or None)`` per step that has news for it,
    an error body if its group failed, and :data:`END` (or :data:`GONE`, from the server, when its
    client hung up); ``finished`` resolves when every choice has finished (or failed)."""

    def __init__(self, request: ParsedRequest, loop: asyncio.AbstractEventLoop):
        self.request = request
        self.loop = loop
        self.seqs: list[Sequence] = request.sequences(owner=self)
        self.events: asyncio.Queue = asyncio.Queue()
        self.finished: asyncio.Future = loop.create_future()
        self.error: dict | None = None
        self.arrived = time.perf_counter()
        self.open = len(self.seqs)              # choices not finished yet
        self.cancelled = False

    def cancel(self) -> None:
        """The client went away: stop its sequences at the next step (safe from any thread)."""
        self.cancelled = True
        for s in self.seqs:
            s.cancelled = True

    # -- called on the event loop
    def client_gone(self) -> None:
        """The client hung up: whoever reads ``events`` gets :data:`GONE` (and then drops the job)."""
        self.events.put_nowait(GONE)

    def _news(self, index: int, text: str, reason: str | None) -> None:
        self.events.put_nowait((index, text, reason))
        if reason is not None:
            self.open -= 1
            if self.open == 0 and not self.finished.done():
                self.finished.set_result(None)

    def _fail(self, body: dict) -> None:
        self.error = body
        self.events.put_nowait(body)
        self._end()

    def _end(self) -> None:
        self.events.put_nowait(END)
        if not self.finished.done():
            self.finished.set_result(None)


@dataclass
class ServeMetrics:
    """Counters for ``GET /metrics``; written by the worker (group stats) and the event loop (requests)."""

    requests: dict = field(default_factory=dict)          # (endpoint, status) -> count
    prompt_tokens: int = 0
    generated_tokens: int = 0
    groups: int = 0
    generate_s: float = 0.0
    cancelled: int = 0
    running: int = 0                                      # sequences in the running group
    bytes_moved: dict = field(default_factory=dict)       # tier -> bytes read from it (runtime store)
    tier_bytes: dict = field(default_factory=dict)        # tier -> bytes it holds
    trace: RunStats = field(default_factory=RunStats)    # compute busy time and span of traced groups

    def count(self, endpoint: str, status: int) -> None:
        key = (endpoint, status)
        self.requests[key] = self.requests.get(key, 0) + 1

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.generate_s if self.generate_s else 0.0

    def group_stats(self) -> dict:
        """The counters the worker writes, as plain data (the engine process sends them to the server's)."""
        return {"running": self.running, "groups": self.groups, "generate_s": self.generate_s,
                "generated_tokens": self.generated_tokens, "bytes_moved": dict(self.bytes_moved),
                "tier_bytes": dict(self.tier_bytes),
                "trace": (self.trace.compute_busy_s, self.trace.compute_span_s)}

    def set_group_stats(self, stats: dict) -> None:
        """Take the worker's counters from :meth:`group_stats` of another process's metrics."""
        for name in ("running", "groups", "generate_s", "generated_tokens", "bytes_moved", "tier_bytes"):
            setattr(self, name, stats[name])
        self.trace.compute_busy_s, self.trace.compute_span_s = stats["trace"]

    def prometheus(self, queue_depth: int, waiting: int) -> str:
        """The Prometheus text exposition of every counter."""
        out: list[str] = []

        def metric(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            out.append(f"# HELP kinject_{name} {help_}")
            out.append(f"# TYPE kinject_{name} {kind}")
            out.extend(f"kinject_{name}{labels} {value:.6g}" if isinstance(value, float) else
                       f"kinject_{name}{labels} {value}" for labels, value in samples)

        metric("requests_total", "counter", "Requests answered, by endpoint and HTTP status.",
               [(f'{{endpoint="{e}",status="{s}"}}', n) for (e, s), n in sorted(self.requests.items())] or [("", 0)])
        metric("requests_cancelled_total", "counter", "Requests whose client went away.", [("", self.cancelled)])
        metric("queue_depth", "gauge", "Sequences waiting for a batch group.", [("", queue_depth)])
        metric("requests_waiting", "gauge", "Requests waiting for a batch group.", [("", waiting)])
        metric("sequences_running", "gauge", "Sequences in the running batch group.", [("", self.running)])
        metric("prompt_tokens_total", "counter", "Prompt tokens of accepted requests.", [("", self.prompt_tokens)])
        metric("generation_tokens_total", "counter", "Tokens generated.", [("", self.generated_tokens)])
        metric("batch_groups_total", "counter", "Batch groups run (one generate each).", [("", self.groups)])
        metric("generate_seconds_total", "counter", "Seconds spent in generate.", [("", float(self.generate_s))])
        metric("tokens_per_second", "gauge", "Generated tokens per second of generate.", [("", float(self.tokens_per_s))])
        metric("bytes_moved_total", "counter", "Bytes the store moved to the compute device, by source tier.",
               [(f'{{tier="{t}"}}', b) for t, b in sorted(self.bytes_moved.items())] or [("", 0)])
        metric("tier_bytes", "gauge", "Bytes each tier holds.",
               [(f'{{tier="{t}"}}', b) for t, b in sorted(self.tier_bytes.items())] or [("", 0)])
        if self.trace.bubble_fraction is not None:
            metric("compute_bubble_fraction", "gauge", "Share of the compute stream's span it waited "
                   "(traced runs: --set pipeline.trace=true).", [("", float(self.trace.bubble_fraction))])
        return "\n".join(out) + "\n"


class Delivery(Protocol):
    """Where a :class:`GroupWorker` sends its news; called on the worker thread, except ``ended`` of a
    dropped job and ``failed`` of waiting ones, called by whoever drops or shuts down. A job here is
    anything with ``seqs``, ``arrived``, ``cancelled`` and ``cancel()`` (:class:`Job` in-process)."""

    def step(self, events: list[StepEvent]) -> None:
        """One step's news; each sequence's ``tag`` is ``(job, choice index)``."""

    def group_started(self, group: list, metrics: ServeMetrics) -> None:
        """``group`` left the queue and generates now (``metrics.running`` counts its sequences)."""

    def group_ended(self, group: list, error: dict | None, metrics: ServeMetrics) -> None:
        """The group's generate returned (``error``: None) or failed; ``metrics`` holds its stats."""

    def ended(self, jobs: list) -> None:
        """``jobs`` (dropped while waiting) end without an answer."""

    def failed(self, jobs: list, body: dict) -> None:
        """``jobs`` are answered ``body`` (an error)."""


class LoopDelivery:
    """The news of :class:`Job` objects to their event loop, one ``call_soon_threadsafe`` per step."""

    def step(self, events: list[StepEvent]) -> None:
        news = [(seq.tag[0], seq.tag[1], text, reason) for seq, text, reason in events]
        news[0][0].loop.call_soon_threadsafe(_deliver, news)

    def group_started(self, group: list[Job], metrics: ServeMetrics) -> None:
        pass                                    # metrics is the server's own

    def group_ended(self, group: list[Job], error: dict | None, metrics: ServeMetrics) -> None:
        if error is not None:
            self.failed(group, error)
        else:
            self.ended(group)

    def ended(self, jobs: list[Job]) -> None:
        for job in jobs:
            job.loop.call_soon_threadsafe(job._end)

    def failed(self, jobs: list[Job], body: dict) -> None:
        for job in jobs:
            job.loop.call_soon_threadsafe(job._fail, body)


class GroupWorker:
    """The one thread that runs the model: waiting jobs in, one ``generate`` per batch group."""

    def __init__(self, served, *, group_size: int, batch_wait_s: float, metrics: ServeMetrics,
                 max_waiting: int = 4096, delivery: Delivery | None = None):
        self.served = served
        self.delivery: Delivery = delivery or LoopDelivery()
        self.group_size = max(1, group_size)
        self.batch_wait_s = max(0.0, batch_wait_s)
        self.metrics = metrics
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._waiting: deque[Job] = deque()
        self._running: list[Job] = []
        self._stopping = False
        self.accepting = True
        self._thread = threading.Thread(target=self._loop, name="kinject-generate", daemon=True)
        self.failure: BaseException | None = None

    # -- event loop side
    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.accepting

    def submit(self, job: Job) -> None:
        with self._cond:
            if not self.accepting:
                raise ProtocolError("the server is shutting down", 503)
            if len(self._waiting) >= self.max_waiting:
                raise ProtocolError(f"{len(self._waiting)} requests already wait; try again later", 503)
            self._waiting.append(job)
            self._cond.notify()

    def queue_depth(self) -> tuple[int, int]:
        """(sequences, requests) waiting."""
        with self._cond:
            return sum(len(j.seqs) for j in self._waiting), len(self._waiting)

    def drop(self, job: Job) -> None:
        """Cancel ``job``: out of the queue if it still waits, else its sequences stop at the next step."""
        job.cancel()
        with self._cond:
            try:
                self._waiting.remove(job)
            except ValueError:
                return
        self.delivery.ended([job])

    def begin_shutdown(self) -> None:
        """Refuse new requests and answer the waiting ones 503; the running group goes on."""
        with self._cond:
            self.accepting = False
            waiting, self._waiting = list(self._waiting), deque()
            self._stopping = True
            self._cond.notify_all()
        for job in waiting:
            job.cancel()
        if waiting:
            self.delivery.failed(waiting, error_body("the server is shutting down", 503))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop: cancel the running group's sequences (it ends at its next step) and join the thread."""
        self.begin_shutdown()
        with self._cond:
            running = list(self._running)
        for job in running:
            job.cancel()
        self._thread.join(timeout_s)

    def join(self, timeout_s: float | None = None) -> None:
        """Wait until the worker thread ends (after :meth:`shutdown`, or when it died)."""
        self._thread.join(timeout_s)

    # -- worker thread
    def _loop(self) -> None:
        try:
            while True:
                group = self._next_group()
                if group is None:
                    return
                if group:
                    self._run(group)
        except BaseException as exc:      # noqa: BLE001 - the server answers 503 from now on, never hangs
            self.failure = exc
            logger.exception("kinject serve: the generate thread died")
            self.begin_shutdown()

    def _next_group(self) -> list[Job] | None:
        dropped: list[Job] = []
        try:
            return self._take_group(dropped)
        finally:
            if dropped:              # cancelled while :meth:`drop` waited for the lock: they end here
                self.delivery.ended(dropped)

    def _take_group(self, dropped: list[Job]) -> list[Job] | None:
        with self._cond:
            while not self._waiting and not self._stopping:
                self._cond.wait()
            if self._stopping:
                return None
            # the group fills up, or the oldest request has waited long enough
            while not self._stopping:
                waiting_seqs = sum(len(j.seqs) for j in self._waiting if not j.cancelled)
                left = self._waiting[0].arrived + self.batch_wait_s - time.perf_counter() if self._waiting else 0
                if waiting_seqs >= self.group_size or left <= 0:
                    break
                self._cond.wait(left)
            group: list[Job] = []
            size = 0
            while self._waiting:
                job = self._waiting[0]
                if job.cancelled:
                    dropped.append(self._waiting.popleft())
                    continue
                if group and size + len(job.seqs) > self.group_size:
                    break
                group.append(self._waiting.popleft())
                size += len(job.seqs)
            self._running = group
            return group

    def _run(self, group: list[Job]) -> None:
        served, metrics = self.served, self.metrics
        rt = served.runtime
        seqs = [s for job in group for s in job.seqs]
        metrics.running = len(seqs)
        self.delivery.group_started(group, metrics)
        since = rt.tracer.now()
        t0 = time.perf_counter()
        error = None
        try:
            generate_sequences(served.model, served.tok, seqs, rt.device, on_step=self.delivery.step)
        except Exception as exc:  # noqa: BLE001 - a failed group fails its requests, not the server
            logger.exception("kinject serve: a batch group failed")
            error = error_body(f"generation failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                               500)
        finally:
            dt = time.perf_counter() - t0
            with self._cond:
                self._running = []
            metrics.running = 0
            metrics.groups += 1
            metrics.generate_s += dt
            metrics.generated_tokens += sum(len(s.ids) for s in seqs)
            self._harvest(rt, since)
        self.delivery.group_ended(group, error, metrics)

    def _harvest(self, rt, since: float) -> None:
        """Group stats the runtime keeps: bytes moved per tier, what each tier holds, the compute bubble."""
        st = rt.store.summary()
        self.metrics.bytes_moved = dict(st.get("bytes", {}))
        self.metrics.tier_bytes = dict(st.get("tier_bytes", {}))
        harvest_trace(rt.tracer, since, self.metrics.trace, False)


def _deliver(news: list[tuple[Job, int, str, str | None]]) -> None:
    for job, index, text, reason in news:
        job._news(index, text, reason)
