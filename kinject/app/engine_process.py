"""``kinject serve``'s engine in a process of its own: the model and its :class:`GroupWorker` in a child,
the HTTP server's event loop in the parent (vLLM's split of its API server and its engine core).

Why a process: in one process the event loop (parsing requests, writing stream chunks) and the
thread that generates share one interpreter lock, so every millisecond of loop work is a
millisecond generation waits (docs/architecture.md, "Serving"). Here the child owns the model and
runs the same :class:`~kinject.app.batcher.GroupWorker` (the one grouping policy) with a delivery
that writes its news to a pipe; the parent keeps only the tokenizer (to check requests and count
their tokens) and an :class:`EngineClient`, which has the worker's interface, so the app does not
know which engine it talks to.

The pipe (a ``multiprocessing`` ``Connection``, spawn context) carries small tuples of plain data:

* parent to engine: ``("submit", rid, prompt ids, [sampling params as tuples], stream)``,
  ``("drop", rid)``, ``("begin-shutdown",)``, ``("shutdown", grace seconds)``;
* engine to parent: ``("ready", n, bs, group size)`` or ``("load-failed", exception)`` once; then
  ``("started", rids, group stats)`` when a group starts, ``("step", [(rid, choice, text, finish
  reason, (ids, text) once finished or None)])`` once per step, ``("ended", rids, error body or None,
  group stats or None)`` when a group ends or waiting requests are dropped or refused, and
  ``("died", message)`` if the worker thread died.

The parent reads them on its event loop (``loop.add_reader`` on the pipe: no reader thread) and
hands them to the :class:`~kinject.app.batcher.Job` objects as the in-process worker does. The
engine exits when the pipe closes (the server died) and the server answers 503 once the engine is
gone (killed, crashed): never a request that hangs.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import signal
import sys
import threading
import time
from dataclasses import astuple, dataclass, field

from kinject.app.batcher import GroupWorker, Job, ServeMetrics
from kinject.app.openai_protocol import ProtocolError, error_body
from kinject.app.sequences import SamplingParams, Sequence, StepEvent
from kinject.errors import KinjectError

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5             # while the model loads, how often the engine checks that the server is alive
STOP_AFTER_S = 5.0              # after shutdown's grace, how long the engine may take to exit before it is killed


@dataclass(frozen=True)
class EngineOptions:
    """What the engine process needs to load and serve the model (picklable: it crosses to the child)."""

    model: str | None
    rules: str | None
    overrides: tuple[str, ...] = ()
    served_model_name: str | None = None
    dtype: str | None = None
    attn: str = "eager"
    threads: int = 0
    batch_wait_s: float = 0.005
    verbose: bool = False
    log_level: int = logging.WARNING


class EngineFailed(KinjectError):
    """The engine process died or its worker thread failed."""


# ============================================================================ the server's side


@dataclass(frozen=True)
class EnginePlan:
    """The engine's batch group as the server prints it: ``n`` micro-batches of ``bs``, ``size`` sequences."""

    n: int
    bs: int
    size: int


class EngineClient:
    """The HTTP process's handle on the engine process, with :class:`GroupWorker`'s interface
    (``start``, ``alive``, ``submit``, ``queue_depth``, ``drop``, ``begin_shutdown``, ``shutdown``,
    ``failure``). Everything but :meth:`shutdown` and :meth:`close` runs on the event loop."""

    def __init__(self, process, conn, plan: EnginePlan, metrics: ServeMetrics, max_waiting: int = 4096):
        self.process, self.plan, self.metrics, self.max_waiting = process, plan, metrics, max_waiting
        self._conn = conn
        self._send_lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._jobs: dict[int, Job] = {}          # rid -> job not ended yet (waiting or generating)
        self._waiting: dict[int, Job] = {}       # rid -> job no group has taken yet
        self._rids: dict[Job, int] = {}
        self._next_rid = 0
        self._gone = False                       # the engine's pipe closed
        self._closing = False                    # shutdown asked for: the pipe closing is expected
        self.accepting = True
        self.failure: BaseException | None = None

    @classmethod
    def start_engine(cls, options: EngineOptions, metrics: ServeMetrics, *, max_waiting: int = 4096) -> EngineClient:
        """Start the engine process and wait until its model is loaded; a load error is raised here,
        as loading in this process would raise it."""
        ctx = multiprocessing.get_context("spawn")
        conn, child_conn = ctx.Pipe(duplex=True)
        process = ctx.Process(target=engine_main, args=(child_conn, options), name="kinject-engine")
        process.start()
        child_conn.close()                       # the child's end lives in the child only: its death is EOF here
        try:
            while True:
                if conn.poll(PARENT_POLL_S):
                    try:
                        msg = conn.recv()
                    except (EOFError, OSError):
                        msg = None
                    break
                if not process.is_alive():
                    msg = None
                    break
            if msg is None:
                process.join(STOP_AFTER_S)
                raise EngineFailed(f"the engine process exited (code {process.exitcode}) while loading the model")
            if msg[0] == "load-failed":
                raise msg[1]
            _, n, bs, size = msg
        except BaseException:
            _stop_process(process, conn, 0.0)
            raise
        return cls(process, conn, EnginePlan(n, bs, size), metrics, max_waiting)

    # -- the worker's interface
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._conn.fileno(), self._readable)

    @property
    def alive(self) -> bool:
        return self.accepting and not self._gone

    def submit(self, job: Job) -> None:
        if self._gone:
            raise ProtocolError("the engine process is not running", 503)
        if not self.accepting:
            raise ProtocolError("the server is shutting down", 503)
        if len(self._waiting) >= self.max_waiting:
            raise ProtocolError(f"{len(self._waiting)} requests already wait; try again later", 503)
        rid = self._next_rid
        self._next_rid += 1
        req = job.request
        self._send(("submit", rid, req.prompt_ids, [astuple(s.params) for s in job.seqs], req.stream))
        self._jobs[rid] = self._waiting[rid] = job
        self._rids[job] = rid

    def queue_depth(self) -> tuple[int, int]:
        """(sequences, requests) waiting."""
        return sum(len(j.seqs) for j in self._waiting.values()), len(self._waiting)

    def drop(self, job: Job) -> None:
        """Cancel ``job``: forgotten here at once; the engine takes it out of its queue or stops its
        sequences at the next step."""
        job.cancel()
        rid = self._rids.pop(job, None)
        if rid is None:
            return
        self._jobs.pop(rid, None)
        was_waiting = self._waiting.pop(rid, None) is not None
        if not self._gone:
            self._send(("drop", rid))
        if was_waiting:
            job._end()

    def begin_shutdown(self) -> None:
        """Refuse new requests; the engine answers the waiting ones 503 and finishes its running group.
        Safe from a signal handler: the message is sent from the event loop."""
        if not self.accepting:
            return
        self.accepting = False
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self._send, ("begin-shutdown",))
        else:
            self._send(("begin-shutdown",))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        """Stop: the engine cancels its running group (it ends at its next step) and exits; waits for it."""
        self.accepting = False
        self._closing = True
        _stop_process(self.process, self._conn, timeout_s, send=self._send)

    def close(self) -> None:
        """The engine process is gone when this returns (killed if it does not stop in time)."""
        self._closing = True
        _stop_process(self.process, self._conn, 0.0, send=self._send)

    # -- replies, on the event loop
    def _send(self, msg: tuple) -> None:
        _send_quietly(self._conn, self._send_lock, msg)          # (the engine gone: its EOF says so on the loop)

    def _readable(self) -> None:
        try:
            while self._conn.poll():
                self._handle(self._conn.recv())
        except (EOFError, OSError):
            self._engine_gone()

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "step":
            jobs = self._jobs
            for rid, index, text, reason, final in msg[1]:
                job = jobs.get(rid)
                if job is None:
                    continue
                if final is not None:
                    seq = job.seqs[index]
                    seq.ids, seq.text = final
                    seq.finish_reason = reason
                job._news(index, text, reason)
        elif kind == "started":
            for rid in msg[1]:
                self._waiting.pop(rid, None)
            self.metrics.set_group_stats(msg[2])
        elif kind == "ended":
            _, rids, error, stats = msg
            if stats is not None:
                self.metrics.set_group_stats(stats)
            for rid in rids:
                self._end(rid, error)
        elif kind == "died":
            self.failure = EngineFailed(f"the engine's generate thread failed: {msg[1]}")
            logger.error("kinject serve: %s", self.failure)
        else:
            logger.error("kinject serve: unknown message from the engine process: %r", kind)

    def _end(self, rid: int, error: dict | None) -> None:
        job = self._jobs.pop(rid, None)
        self._waiting.pop(rid, None)
        if job is None:
            return
        self._rids.pop(job, None)
        if error is not None:
            job._fail(error)
        else:
            job._end()

    def _engine_gone(self) -> None:
        """The pipe closed: every open request is answered 503, /health says 503 from now on."""
        if self._gone:
            return
        self._gone = True
        self.accepting = False
        if self._loop is not None:
            self._loop.remove_reader(self._conn.fileno())
        if not self._closing:
            self.process.join(1.0)
            if self.failure is None:
                self.failure = EngineFailed(f"the engine process exited (code {self.process.exitcode})")
            logger.error("kinject serve: %s; answering 503 from now on", self.failure)
        body = error_body("the server is shutting down" if self._closing else "the engine process is not running", 503)
        for rid in list(self._jobs):
            self._end(rid, body)


def _stop_process(process, conn, grace_s: float, send=None) -> None:
    """Ask the engine to stop (``grace_s`` for its running group), then terminate and kill it if it stays."""
    if process.is_alive():
        try:
            (send or conn.send)(("shutdown", grace_s))
        except (OSError, ValueError):
            pass                                 # exiting already
        process.join(grace_s + STOP_AFTER_S)
    if process.is_alive():
        logger.warning("kinject serve: the engine process did not stop; terminating it")
        process.terminate()
        process.join(STOP_AFTER_S)
    if process.is_alive():
        process.kill()
        process.join()


# ============================================================================ the engine's side


class _EngineJob:
    """A request in the engine: its sequences (tagged ``(this job, choice index)``), no HTTP."""

    def __init__(self, rid: int, prompt_ids: list[int], params: list[tuple], stream: bool):
        self.rid = rid
        self.seqs = [Sequence(prompt_ids, SamplingParams(*p), stream=stream, tag=(self, i))
                     for i, p in enumerate(params)]
        self.arrived = time.perf_counter()
        self.cancelled = False

    def cancel(self) -> None:
        self.cancelled = True
        for s in self.seqs:
            s.cancelled = True


@dataclass
class _PipeDelivery:
    """The :class:`~kinject.app.batcher.Delivery` of the engine: each call is one message to the server."""

    conn: object
    jobs: dict = field(default_factory=dict)      # rid -> _EngineJob not ended yet
    lock: threading.Lock = field(default_factory=threading.Lock)

    def send(self, msg: tuple) -> None:
        _send_quietly(self.conn, self.lock, msg)     # (the server gone: the reader sees EOF and stops us)

    def step(self, events: list[StepEvent]) -> None:
        self.send(("step", [(seq.tag[0].rid, seq.tag[1], text, reason,
                             None if reason is None else (seq.ids, seq.text)) for seq, text, reason in events]))

    def group_started(self, group: list, metrics: ServeMetrics) -> None:
        self.send(("started", [j.rid for j in group], metrics.group_stats()))

    def group_ended(self, group: list, error: dict | None, metrics: ServeMetrics) -> None:
        self._ended(group, error, metrics.group_stats())

    def ended(self, jobs: list) -> None:
        self._ended(jobs, None, None)

    def failed(self, jobs: list, body: dict) -> None:
        self._ended(jobs, body, None)

    def _ended(self, jobs: list, error: dict | None, stats: dict | None) -> None:
        for job in jobs:
            self.jobs.pop(job.rid, None)
        self.send(("ended", [j.rid for j in jobs], error, stats))


def engine_main(conn, options: EngineOptions) -> None:
    """The engine process: load the model, say ready (or why not), serve the pipe until told to stop
    or the server is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)        # Ctrl-C reaches the server, which stops us
    logging.basicConfig(level=options.log_level, format="%(message)s")
    loaded = threading.Event()
    threading.Thread(target=_exit_with_parent, args=(os.getppid(), loaded), name="kinject-engine-parent",
                     daemon=True).start()
    try:
        if options.threads:
            import torch

            torch.set_num_threads(options.threads)
        if not options.verbose:
            from transformers.utils import logging as hf_logging

            hf_logging.set_verbosity_error()
        from kinject.app.served import load_served, prepare

        prepared = prepare(options.model, options.rules, list(options.overrides),
                           served_model_name=options.served_model_name)
        served = load_served(prepared, dtype=options.dtype, attn=options.attn)
    except BaseException as exc:                         # noqa: BLE001 - the server raises it
        try:
            try:
                conn.send(("load-failed", exc))
            except OSError:
                raise
            except Exception:                            # noqa: BLE001 - not picklable: its text
                conn.send(("load-failed", KinjectError(f"{type(exc).__name__}: {exc}")))
        except OSError:
            pass                                         # the server died while the model loaded
        conn.close()
        sys.exit(1)
    loaded.set()
    try:
        try:
            conn.send(("ready", served.plan.n, served.plan.bs, served.plan.size))
        except OSError:                                  # the server died while the model loaded
            code = 1
        else:
            code = _serve(conn, served, options)
    finally:
        served.close()
        conn.close()
    sys.exit(code)


def _exit_with_parent(ppid: int, loaded: threading.Event) -> None:
    """While the model loads nobody reads the pipe: if the server dies meanwhile, exit."""
    while not loaded.wait(PARENT_POLL_S):
        if os.getppid() != ppid:
            os._exit(1)


def _serve(conn, served, options: EngineOptions) -> int:
    """Run the worker; a reader thread feeds it the server's messages. Returns the exit code."""
    delivery = _PipeDelivery(conn)
    worker = GroupWorker(served, group_size=served.plan.size, batch_wait_s=options.batch_wait_s,
                         metrics=ServeMetrics(), max_waiting=sys.maxsize, delivery=delivery)
    worker.start()
    reader = threading.Thread(target=_read, args=(conn, worker, delivery), name="kinject-engine-reader", daemon=True)
    reader.start()
    worker.join()
    if worker.failure is not None:
        delivery.send(("died", f"{type(worker.failure).__name__}: {worker.failure}"))
        return 1
    # the worker also ends after ``begin-shutdown`` once its group is done; the engine stays until
    # the server says ``shutdown`` (or is gone), so that its exit is never taken for a crash
    reader.join()
    return 0


def _read(conn, worker: GroupWorker, delivery: _PipeDelivery) -> None:
    """The server's messages into the worker, until ``shutdown`` or the server is gone (EOF)."""
    jobs = delivery.jobs
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            worker.shutdown(0.0)                 # the server died: nobody waits for an answer
            return
        kind = msg[0]
        if kind == "submit":
            _, rid, prompt_ids, params, stream = msg
            job = _EngineJob(rid, prompt_ids, params, stream)
            jobs[rid] = job
            try:
                worker.submit(job)
            except ProtocolError as exc:
                delivery.failed([job], exc.body())
        elif kind == "drop":
            job = jobs.get(msg[1])
            if job is not None:
                worker.drop(job)
        elif kind == "begin-shutdown":
            worker.begin_shutdown()
        elif kind == "shutdown":
            worker.shutdown(msg[1])
            return
        else:
            logger.error("kinject engine: unknown message from the server: %r", kind)


def _send_quietly(conn, lock: threading.Lock, msg: tuple) -> None:
    """Send ``msg`` on the pipe, one sender at a time; a pipe whose other end is gone drops it (that end's
    EOF is how each side learns the other died, not a failed send)."""
    with lock:
        try:
            conn.send(msg)
        except (OSError, ValueError):
            pass
