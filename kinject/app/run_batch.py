"""``kinject run-batch``: an OpenAI Batch file in, its output file out, as ``vllm run-batch`` does.

    kinject run-batch -i requests.jsonl -o results.jsonl [--model DIR] [--rules R] [--set k=v]

* Input lines: ``{"custom_id", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
  "body": {...}}``; the body is checked by the server's own parser (:mod:`kinject.app.openai_protocol`).
* Output lines: ``{"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error"}``;
  ``body`` is the ``text_completion`` or ``chat.completion`` with ``usage``. A request kinject refuses
  (an unserved URL, an invalid body, another model's name) is an error line for its ``custom_id``
  (``error``: the error body the server would answer, ``body`` null); a line that is not a request
  (malformed JSON, no ``custom_id``, a repeated one) is an error line with ``custom_id`` null naming
  its line number, also said on stderr. The rest run. Error lines come first, then the answers,
  one batch group at a time: match lines by ``custom_id``.
* Groups: the valid requests, in file order, cut into ``kinject run``'s fixed groups of ``n * bs``
  (:func:`kinject.app.run.pending_groups`), one ``generate`` per group whatever each request's settings
  (:mod:`kinject.app.sequences`). A group is appended whole, fsync'ed; SIGINT/SIGTERM keep every
  finished group. Re-running the same command skips every ``custom_id`` already in the output (and
  every malformed line already reported), as ``kinject run`` resumes by id.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinject.app.openai_protocol import (URLS, ParsedRequest, ProtocolError, batch_line, error_body, parse_request,
                                         response_body)
from kinject.app.run import (Progress, read_input_text, Prompt, RunInterrupted, RunStats, StopOnSignals, StopRequested, done_ids,
                             harvest_trace, id_key, output_file, pending_groups, write_all)
from kinject.app.sequences import generate_sequences
from kinject.errors import KinjectError

logger = logging.getLogger(__name__)


@dataclass
class BatchEntry:
    """One line of the input: a checked request, or the error line it gets instead."""

    line: int
    custom_id: str | None
    request: ParsedRequest | None = None
    error: dict | None = None            # an error body (openai_protocol.error_body)
    status: int = 400


@dataclass
class BatchConfig:
    input: str
    output: str
    model: str | None = None
    rules: str | None = None
    overrides: list[str] = field(default_factory=list)
    served_model_name: str | None = None
    dtype: str | None = None
    attn: str = "eager"
    progress: bool = True


def read_batch(path: Path, info) -> list[BatchEntry]:
    """Every non-blank line of the Batch file ``path``, checked against the served model ``info``."""
    text = read_input_text(path, "batch input file")
    entries: list[BatchEntry] = []
    first_line: dict[str, int] = {}
    for i, ln in enumerate(text.splitlines(), 1):
        if not ln.strip():
            continue
        entry = _entry(path, i, ln, first_line, info)
        entries.append(entry)
        if entry.error is not None and entry.custom_id is None:
            logger.warning("%s", entry.error["error"]["message"])
    if not entries:
        raise KinjectError(f"{path}: no requests")
    return entries


def _entry(path: Path, i: int, ln: str, first_line: dict[str, int], info) -> BatchEntry:
    def malformed(why: str) -> BatchEntry:
        err = error_body(f"{path}:{i}: {why}", 400)
        err["error"]["line"] = i
        return BatchEntry(i, None, error=err)

    try:
        rec = json.loads(ln)
    except ValueError as exc:
        return malformed(f"malformed JSON line ({exc})")
    if not isinstance(rec, dict):
        return malformed(f"expected a JSON object {{\"custom_id\", \"method\", \"url\", \"body\"}}, "
                         f"got {type(rec).__name__}")
    cid = rec.get("custom_id")
    if not isinstance(cid, str) or not cid:
        return malformed(f"'custom_id' must be a non-empty string, got {json.dumps(cid)}")
    if cid in first_line:
        return malformed(f"duplicate custom_id {cid!r} (first on line {first_line[cid]})")
    first_line[cid] = i
    method, url = rec.get("method"), rec.get("url")
    if method != "POST":
        return BatchEntry(i, cid, error=error_body(f"line {i}: method must be POST, got {json.dumps(method)}", 400,
                                                   "method"))
    if url not in URLS:
        return BatchEntry(i, cid, error=error_body(f"line {i}: URL {json.dumps(url)} is not served; "
                                                   f"kinject run-batch serves {', '.join(URLS)}", 400, "url"))
    body = rec.get("body")
    if isinstance(body, dict) and body.get("stream"):
        return BatchEntry(i, cid, error=error_body(f"line {i}: a batch request must not ask for stream mode", 400,
                                                   "stream"))
    if body is None:
        return BatchEntry(i, cid, error=error_body(f"line {i}: no 'body'", 400, "body"))
    try:
        return BatchEntry(i, cid, request=parse_request(url, body, info))
    except ProtocolError as exc:
        return BatchEntry(i, cid, error=error_body(f"line {i}: {exc.message}", exc.status, exc.param),
                          status=exc.status)


def reported_lines(out: Path) -> set[int]:
    """Line numbers of the malformed input lines the output already reports (``custom_id`` null)."""
    if not out.is_file():
        return set()
    lines = set()
    for ln in out.read_text(encoding="utf-8", errors="replace").splitlines():
        rec = json.loads(ln) if ln.strip() else None
        if isinstance(rec, dict) and rec.get("custom_id") is None and isinstance(rec.get("error"), dict):
            line = (rec["error"].get("error") or {}).get("line")
            if isinstance(line, int):
                lines.add(line)
    return lines


def run_batch(cfg: BatchConfig) -> dict:
    """Run the Batch file of ``cfg``; returns the summary. SIGINT/SIGTERM: :class:`RunInterrupted`
    after keeping every finished group."""
    summary: dict[str, Any] = {}
    with StopOnSignals() as sig:
        try:
            return _run(cfg, sig, summary)
        except StopRequested as stop:
            name = signal.Signals(stop.signum).name
            raise RunInterrupted(f"interrupted by {name}: kept {summary.get('answered', 0)} answers of this run in "
                                 f"{cfg.output} (no partial group); re-run the same command to resume",
                                 128 + stop.signum) from None


def _run(cfg: BatchConfig, sig: StopOnSignals, summary: dict) -> dict:
    from kinject.app.served import load_served, prepare

    t_start = time.perf_counter()
    src, out = Path(cfg.input).expanduser(), Path(cfg.output).expanduser()
    if src.resolve() == out.resolve():
        raise KinjectError(f"-i and -o are the same file: {cfg.output}")
    prepared = prepare(cfg.model, cfg.rules, cfg.overrides, served_model_name=cfg.served_model_name)
    entries = read_batch(src, prepared.info)
    with output_file(out) as fd:
        done = done_ids(out, key="custom_id")
        seen_lines = reported_lines(out)
        fresh = [e for e in entries if (e.line not in seen_lines if e.custom_id is None else id_key(e.custom_id) not in done)]
        errors = [e for e in fresh if e.error is not None]
        valid = [e for e in entries if e.request is not None]
        summary.update(model=str(prepared.model_dir), name=prepared.info.name, rules=str(prepared.rules), out=str(out),
                       total=len(entries), skipped=len(entries) - len(fresh), errors=len(errors), answered=0,
                       stats=RunStats(), plan=None)
        if errors:
            data = "".join(json.dumps(batch_line(e.custom_id, error=e.error, status=e.error["error"]["code"]),
                                      ensure_ascii=False) + "\n" for e in errors).encode("utf-8")
            with sig.critical():
                write_all(fd, data)
        by_key = {id_key(e.custom_id): e.request for e in valid}
        prompts = [Prompt(e.custom_id, e.request.prompt, e.line) for e in valid]
        todo = [p for p in prompts if p.key not in done]
        if not todo:
            summary["wall_s"] = time.perf_counter() - t_start
            return summary
        served = load_served(prepared, dtype=cfg.dtype, attn=cfg.attn)
        rt = served.runtime
        try:
            summary["plan"] = served.plan
            groups = pending_groups(prompts, served.plan.size, done)
            stats: RunStats = summary["stats"]
            rt.store.reset_stats()
            rt.tracer.clear()
            progress = Progress(len(todo), cfg.progress)
            try:
                for _, group in groups:
                    requests = [by_key[p.key] for p in group]
                    seqs = [s for r in requests for s in r.sequences(stream=False)]
                    since = rt.tracer.now()
                    t0 = time.perf_counter()
                    generate_sequences(served.model, served.tok, seqs, rt.device)
                    dt = time.perf_counter() - t0
                    lines, k = [], 0
                    for p, req in zip(group, requests):
                        mine = seqs[k:k + len(req.params)]
                        k += len(req.params)
                        lines.append(json.dumps(batch_line(p.id, body=response_body(req, mine)), ensure_ascii=False))
                    with sig.critical():
                        write_all(fd, ("\n".join(lines) + "\n").encode("utf-8"))
                        summary["answered"] += len(group)
                    n_tok = sum(len(s.ids) for s in seqs)
                    stats.groups += 1
                    stats.prompts += len(group)
                    stats.tokens += n_tok
                    stats.gen_s += dt
                    harvest_trace(rt.tracer, since, stats, False)
                    progress.update(len(group), n_tok, dt)
            finally:
                progress.close()
        finally:
            served.close()
        summary["wall_s"] = time.perf_counter() - t_start
        return summary


def format_summary(summary: dict) -> str:
    stats: RunStats = summary["stats"]
    plan = summary.get("plan")
    rows = [("output", f"{summary['out']}: {summary['answered']} answered, {summary['errors']} error lines, "
                       f"{summary['skipped']} of {summary['total']} lines already there"),
            ("model", f"{summary['model']} (served as {summary['name']!r})"), ("rules", summary["rules"])]
    if plan is not None:
        rows.append(("plan", f"n={plan.n} x bs={plan.bs} = {plan.size} requests per generate ({plan.source}); "
                             f"{stats.groups} group(s) run"))
    if stats.groups:
        rows.append(("tokens/s", f"{stats.tokens_per_s:.1f} ({stats.tokens} new tokens in {stats.gen_s:.2f} s "
                                 "of generate)"))
        if stats.bubble_fraction is not None:
            rows.append(("bubble fraction", f"{100 * stats.bubble_fraction:.1f}% of the compute stream"))
    rows.append(("wall time", f"{summary.get('wall_s', 0.0):.2f} s (load included)"))
    w = max(len(k) for k, _ in rows)
    return "kinject run-batch summary\n" + "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def add_arguments(s) -> None:
    """The ``kinject run-batch`` options (registered by :mod:`kinject.app.cli`)."""
    s.add_argument("-i", "--input-file", required=True, metavar="IN.jsonl", help="OpenAI Batch input file")
    s.add_argument("-o", "--output-file", required=True, metavar="OUT.jsonl",
                   help="Batch output file, appended per finished group; re-running resumes by custom_id")
    from kinject.app.served import add_served_model_arguments

    add_served_model_arguments(s)
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype (default: the config's)")
    s.add_argument("--attn", default="eager", help="attn_implementation (default: eager, for exactness)")
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def main(args) -> int:
    if args.threads < 0:
        raise KinjectError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if not args.quiet:
        logging.getLogger("kinject.app").setLevel(logging.INFO)
    if not getattr(args, "verbose", False):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    cfg = BatchConfig(input=args.input_file, output=args.output_file, model=args.model, rules=args.rules,
                      overrides=list(args.set), served_model_name=args.served_model_name, dtype=args.dtype,
                      attn=args.attn, progress=not args.quiet)
    try:
        summary = run_batch(cfg)
    except RunInterrupted as exc:
        print(f"kinject: {exc}", file=sys.stderr)
        return exc.exit_code
    print(format_summary(summary))
    return 0
