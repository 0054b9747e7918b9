"""``kinject serve``'s HTTP side: an OpenAI-compatible FastAPI app over a :class:`GroupWorker` or an
:class:`~kinject.app.engine_process.EngineClient` (the same interface; the model in another process).

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream:
true``: Server-Sent Events chunks ending with ``data: [DONE]``), ``GET /health``, ``GET /metrics``
(Prometheus text). Bodies are checked by :mod:`kinject.app.openai_protocol` (the parser ``kinject
run-batch`` uses); a refusal is OpenAI's JSON error with a 4xx status, a failed batch group a 500 for
its requests only. A client that disconnects cancels its request (:meth:`GroupWorker.drop`).

This module imports FastAPI at import time: :mod:`kinject.app.serve_cli` imports it only once it has
checked that the ``serve`` extra is installed.
"""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from kinject.app.batcher import END, GONE, Job, ServeMetrics
from kinject.app.openai_protocol import (CHAT, COMPLETIONS, SSE_DONE, ChunkEncoder, ProtocolError, error_body,
                                         parse_json, parse_request, response_body, sse, usage_chunk)

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25        # how often a waiting non-streamed request checks that its client is still there


def create_app(served, worker, metrics: ServeMetrics) -> FastAPI:
    """The app over ``served`` (anything with the served model's ``info``: a
    :class:`~kinject.app.served.Prepared` or :class:`~kinject.app.served.Served`) and ``worker`` (a
    :class:`GroupWorker` or an :class:`~kinject.app.engine_process.EngineClient`), which it starts and stops."""
    info = served.info

    @asynccontextmanager
    async def lifespan(app):
        worker.start()
        try:
            yield
        finally:
            await asyncio.get_running_loop().run_in_executor(None, worker.shutdown)

    app = FastAPI(title="kinject", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ProtocolError)
    async def _refused(request: Request, exc: ProtocolError):
        metrics.count(request.url.path, exc.status)
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException):
        message = (f"{request.method} {request.url.path} is not served" if exc.status_code in (404, 405)
                   else str(exc.detail))
        return JSONResponse(error_body(message, exc.status_code), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def _fault(request: Request, exc: Exception):
        logger.exception("kinject serve: %s %s failed", request.method, request.url.path)
        metrics.count(request.url.path, 500)
        return JSONResponse(error_body(f"internal error: {type(exc).__name__}: {exc}", 500), status_code=500)

    @app.get("/health")
    async def health():
        if not worker.alive:
            return JSONResponse({"status": "unavailable"}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return info.models()

    @app.get("/metrics")
    async def prometheus():
        seqs, requests = worker.queue_depth()
        return PlainTextResponse(metrics.prometheus(seqs, requests), media_type="text/plain; version=0.0.4")

    async def generate(request: Request, url: str):
        body = parse_json(await request.body())
        req = parse_request(url, body, info)
        job = Job(req, asyncio.get_running_loop())
        worker.submit(job)
        metrics.prompt_tokens += len(req.prompt_ids)
        if req.stream:
            return EventStream(_stream(job), job.client_gone)
        while not job.finished.done():
            await asyncio.wait({job.finished}, timeout=DISCONNECT_POLL_S)
            if not job.finished.done() and await request.is_disconnected():
                worker.drop(job)
                metrics.cancelled += 1
                return Response(status_code=499)
        if job.error is not None:
            status = job.error["error"]["code"]
            metrics.count(url, status)
            return JSONResponse(job.error, status_code=status)
        metrics.count(url, 200)
        return JSONResponse(response_body(req, job.seqs))

    async def _stream(job: Job):
        """The SSE body as ``(bytes, last)``: one write per wake-up with everything the queue holds (a
        step's chunk; the last chunk, the usage chunk and ``[DONE]`` together), so a request costs few
        socket writes."""
        req, events = job.request, job.events
        encoder = ChunkEncoder(req)
        first = [True] * len(job.seqs)
        open_choices = len(job.seqs)
        complete = False
        try:
            out: list[bytes] = []
            while open_choices:
                event = events.get_nowait() if out else await events.get()     # out: the queue holds more
                if event is END:
                    break
                if event is GONE:
                    return
                if isinstance(event, dict):                 # the group failed
                    out.append(sse(event))
                    complete = True
                    metrics.count(req.url, event["error"]["code"])
                    yield b"".join(out), True
                    return
                index, text, reason = event
                if text or reason is not None or first[index]:
                    out.append(encoder.encode(index, text, reason, first=first[index]))
                    first[index] = False
                if reason is not None:
                    open_choices -= 1
                if out and open_choices and events.empty():
                    yield b"".join(out), False
                    out = []
            if req.include_usage:
                out.append(sse(usage_chunk(req, job.seqs)))
            out.append(SSE_DONE)
            complete = True
            metrics.count(req.url, 200)
            yield b"".join(out), True
        finally:
            if not complete:                                 # the client went away (or the server stops)
                worker.drop(job)
                metrics.cancelled += 1

    @app.post(COMPLETIONS)
    async def completions(request: Request):
        return await generate(request, COMPLETIONS)

    @app.post(CHAT)
    async def chat_completions(request: Request):
        return await generate(request, CHAT)

    return app


class EventStream(Response):
    """A streamed answer (Server-Sent Events) written as its chunks come, the last one together with
    the end of the body. A client that hangs up calls ``on_disconnect`` (the chunks then stop). Leaner
    than Starlette's ``StreamingResponse``: no task group and one socket write less per request, on
    the event loop (which shares the interpreter lock with generation under ``--engine inprocess``,
    docs/architecture.md, "Serving")."""

    media_type = "text/event-stream"

    def __init__(self, chunks, on_disconnect):
        self.chunks, self.on_disconnect = chunks, on_disconnect
        self.status_code, self.background = 200, None
        self.init_headers({"Cache-Control": "no-cache"})

    async def __call__(self, scope, receive, send) -> None:
        last = False

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            if not last:
                self.on_disconnect()

        watcher = asyncio.get_running_loop().create_task(watch())
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data, last in self.chunks:
                await send({"type": "http.response.body", "body": data, "more_body": not last})
                if last:
                    break
            if not last:                        # the client went away: end the body all the same
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            watcher.cancel()
            await self.chunks.aclose()
