"""``kinject serve``: the OpenAI-compatible server on the command line.

    kinject serve [--model DIR] [--rules R] [--set k=v] [--host 127.0.0.1] [--port 8000] [--batch-wait-ms 5]
                  [--engine process|inprocess]

Loads the model as ``kinject run`` does (built-in model and ``rules/klotski.yaml`` by default), then
serves it with uvicorn (:mod:`kinject.app.serve`). The model and its batch groups run in an engine
process of their own (``--engine process``, the default: :mod:`kinject.app.engine_process`), so the
event loop's work per request and per streamed chunk never holds the interpreter lock generation
needs; rule file, model folder and tokenizer are checked here first, before any process starts.
``--engine inprocess`` runs the worker as a thread of this process instead (one process, one
interpreter lock: the loop's CPU time is time generation waits; kept for comparison and debugging).
FastAPI and uvicorn are the ``serve`` extra (``pip install 'kinject[serve]'``), imported only here,
so core kinject does not need them; the extra also brings uvloop and httptools, which uvicorn picks
when installed: less event-loop CPU per streamed token (docs/architecture.md, "Serving"). Without
them it runs on asyncio and h11.
SIGTERM / Ctrl-C: new requests are refused (503), waiting ones answered 503, the running batch group
finishes (cancelled after ``--shutdown-grace-s``), the engine process exits and so does this one, 0.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import signal
import sys
import threading

from kinject.errors import KinjectError

logger = logging.getLogger(__name__)

DEFAULT_BATCH_WAIT_MS = 5.0
ENGINES = ("process", "inprocess")


def check_serve_extra() -> None:
    """A clear error naming the extra when FastAPI or uvicorn is missing."""
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise KinjectError(f"kinject serve needs {' and '.join(missing)}: pip install 'kinject[serve]'")


def add_arguments(s) -> None:
    """The ``kinject serve`` options (registered by :mod:`kinject.app.cli`)."""
    from kinject.app.served import add_served_model_arguments

    add_served_model_arguments(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: %(default)s)")
    s.add_argument("--port", type=int, default=8000, help="port (default: %(default)s; 0: any free port)")
    s.add_argument("--batch-wait-ms", type=float, default=DEFAULT_BATCH_WAIT_MS,
                   help="a batch group starts when n x bs sequences wait or the oldest has waited this long "
                        "(default: %(default)s)")
    s.add_argument("--max-waiting", type=int, default=4096,
                   help="requests that may wait for a group; more are answered 503 (default: %(default)s)")
    s.add_argument("--shutdown-grace-s", type=float, default=5.0,
                   help="on SIGTERM, seconds in-flight requests get to finish before they are cancelled "
                        "(default: %(default)s)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype (default: the config's)")
    s.add_argument("--attn", default="eager", help="attn_implementation (default: eager, for exactness)")
    s.add_argument("--threads", type=int, default=0,
                   help="torch intra-op threads of the process that generates (default: torch's)")
    s.add_argument("--engine", choices=ENGINES, default="process",
                   help="where generation runs: 'process', a process of its own (the HTTP event loop never "
                        "holds its interpreter lock), or 'inprocess', a thread of the server's process "
                        "(default: %(default)s)")
    s.add_argument("--log-level", default="warning", choices=("critical", "error", "warning", "info", "debug"),
                   help="uvicorn's log level (default: %(default)s)")


def _check_args(args) -> None:
    if not 0 <= args.port <= 65535:
        raise KinjectError(f"--port must be in [0, 65535], got {args.port}")
    if args.batch_wait_ms < 0:
        raise KinjectError(f"--batch-wait-ms must be >= 0, got {args.batch_wait_ms}")
    if args.max_waiting < 1:
        raise KinjectError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if args.shutdown_grace_s < 0:
        raise KinjectError(f"--shutdown-grace-s must be >= 0, got {args.shutdown_grace_s}")
    if args.threads < 0:
        raise KinjectError(f"--threads must be >= 0, got {args.threads}")


def main(args) -> int:
    _check_args(args)
    check_serve_extra()
    import uvicorn

    from kinject.app.batcher import ServeMetrics
    from kinject.app.serve import create_app
    from kinject.app.served import prepare

    verbose = getattr(args, "verbose", False)
    if not verbose:
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    prepared = prepare(args.model, args.rules, args.set, served_model_name=args.served_model_name)
    metrics = ServeMetrics()
    worker, plan, close = _start_engine(args, prepared, metrics, verbose)
    try:
        app = create_app(prepared, worker, metrics)
        config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                                timeout_graceful_shutdown=args.shutdown_grace_s, access_log=False)

        class Server(uvicorn.Server):
            """uvicorn's server; its exit signal also stops new batch groups at once."""

            def handle_exit(self, sig, frame) -> None:
                worker.begin_shutdown()
                super().handle_exit(sig, frame)

            @contextlib.contextmanager
            def capture_signals(self):
                """SIGINT/SIGTERM shut down gracefully and the process exits 0 (uvicorn's own would
                raise the signal again once shut down, dying by it before the model is closed)."""
                if threading.current_thread() is not threading.main_thread():
                    yield
                    return
                previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
                try:
                    yield
                finally:
                    for sig, handler in previous.items():
                        signal.signal(sig, handler)

            async def startup(self, sockets=None) -> None:
                await super().startup(sockets)
                if self.started:
                    port = next((s.getsockname()[1] for srv in self.servers for s in srv.sockets), args.port)
                    # one machine-readable line: scripts and tests wait for it (and read the port of --port 0)
                    print(f"kinject serve: {prepared.info.name} on http://{args.host}:{port} (batch group "
                          f"n={plan.n} x bs={plan.bs}, wait {args.batch_wait_ms:g} ms, engine {args.engine})",
                          flush=True)

        server = Server(config)
        server.run()
        if not server.started:
            raise KinjectError(f"cannot listen on {args.host}:{args.port} (in use, or not an address of this machine)")
        if worker.failure is not None:
            print(f"kinject: generation failed: {worker.failure}", file=sys.stderr)
            return 1
        return 0
    finally:
        close()


def _start_engine(args, prepared, metrics, verbose: bool):
    """(worker, its group plan, how to release it): the engine process once its model loaded, or the
    model loaded here with its worker thread."""
    if args.engine == "process":
        from kinject.app.engine_process import EngineClient, EngineOptions

        options = EngineOptions(args.model, args.rules, tuple(args.set), served_model_name=args.served_model_name,
                                dtype=args.dtype, attn=args.attn, threads=args.threads,
                                batch_wait_s=args.batch_wait_ms / 1000, verbose=verbose,
                                log_level=logging.getLogger().getEffectiveLevel())
        client = EngineClient.start_engine(options, metrics, max_waiting=args.max_waiting)
        return client, client.plan, client.close
    from kinject.app.batcher import GroupWorker
    from kinject.app.served import load_served

    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    served = load_served(prepared, dtype=args.dtype, attn=args.attn)
    worker = GroupWorker(served, group_size=served.plan.size, batch_wait_s=args.batch_wait_ms / 1000,
                         metrics=metrics, max_waiting=args.max_waiting)
    return worker, served.plan, served.close
