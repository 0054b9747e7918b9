"""``kinject bench serve``: the OpenAI interface against ``kinject run`` on the same prompts.

Contenders, same model, rules and greedy prompts (the built-in prompts, cycled), interleaved, best of
``--repeats`` after a warm-up:

* ``run``: ``kinject run`` in this process; tokens per second of its groups' ``generate``;
* ``run-batch``: ``kinject run-batch`` in this process on the same requests as a Batch file; tokens
  per second of its groups' ``generate`` (the same measure: what the OpenAI path costs per group);
* ``serve``: ``kinject serve`` in a subprocess (``--engines``: one server per engine kind, all
  interleaved; ``serve`` is the default engine process, ``serve-inprocess`` the worker thread in the
  server's own process), ``--clients`` concurrent streaming clients (one
  asyncio loop here) sending the requests; completion tokens (``usage``) per second of wall time
  from the first request sent to the last answer (and, beside it, per second inside the server's own
  ``generate``, from its /metrics: what run and run-batch are measured by); time to first token (first
  chunk with text) per request, p50 and p99.

Then one long serve run of ``--long-requests`` requests per server samples its RSS (the server and
its engine process together) every 100 answers (memory flat or not), and ``run`` / ``run-batch``
over the same number are timed once each.
Results and methodology: BENCHMARKS.md, "kinject bench serve".

It lives in the app layer, not in ``kinject/bench/``: what it measures are the app's own jobs (``run``,
``run-batch``, ``serve``), and benchmarks sit below the app (docs/architecture.md, "Layers").
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from kinject.errors import KinjectError


def add_arguments(p) -> None:
    p.add_argument("--model", help="model directory (default: the built-in model)")
    p.add_argument("--rules", help="rule file (default: rules/klotski.yaml)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a rule-file key")
    p.add_argument("--requests", type=int, default=256, help="requests per timed round (default: %(default)s)")
    p.add_argument("--long-requests", type=int, default=1000,
                   help="requests of the long run (server RSS every 100; run and run-batch timed once); 0: none "
                        "(default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=16, help="new tokens per request (default: %(default)s)")
    p.add_argument("--clients", type=int, default=32, help="concurrent clients of the server (default: %(default)s)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds, interleaved (default: %(default)s)")
    p.add_argument("--batch-wait-ms", type=float, default=5.0, help="the server's --batch-wait-ms (default: %(default)s)")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each contender (default: %(default)s)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype (default: the config's)")
    p.add_argument("--engines", default="process",
                   help="comma-separated kinject serve --engine kinds to run, one server each: process, "
                        "inprocess (default: %(default)s)")
    p.add_argument("--json", metavar="FILE", help="also write the results as JSON")


ENGINE_CONTENDER = {"process": "serve", "inprocess": "serve-inprocess"}


def _engines(spec: str) -> list[str]:
    engines = [e.strip() for e in spec.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINE_CONTENDER]
    if not engines or bad or len(set(engines)) != len(engines):
        raise KinjectError(f"--engines must name distinct kinds among {', '.join(ENGINE_CONTENDER)}, got {spec!r}")
    return engines


def _prompts(n: int) -> list[str]:
    from kinject.app.run import BUILTIN_PROMPTS

    return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(n)]


def _write_inputs(workdir: Path, n: int, max_tokens: int) -> tuple[Path, Path]:
    prompts = _prompts(n)
    run_in = workdir / f"prompts-{n}.jsonl"
    run_in.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(prompts)))
    batch_in = workdir / f"batch-{n}.jsonl"
    batch_in.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/completions",
                                            "body": {"model": "default", "prompt": p, "max_tokens": max_tokens,
                                                     "temperature": 0}}) + "\n" for i, p in enumerate(prompts)))
    return run_in, batch_in


def _run_contender(args, prompts_file: Path, workdir: Path) -> dict:
    from kinject.app.run import RunConfig, run_job

    out = workdir / f"run-out-{time.monotonic_ns()}.jsonl"
    s = run_job(RunConfig(model=args.model, rules=args.rules, overrides=list(args.set), prompts=str(prompts_file),
                          out=str(out), max_new_tokens=args.max_tokens, dtype=args.dtype, progress=False))
    out.unlink()
    st = s["stats"]
    return {"tokens": st.tokens, "seconds": st.gen_s, "tokens_per_s": st.tokens_per_s}


def _batch_contender(args, batch_file: Path, workdir: Path) -> dict:
    from kinject.app.run_batch import BatchConfig, run_batch

    out = workdir / f"batch-out-{time.monotonic_ns()}.jsonl"
    s = run_batch(BatchConfig(input=str(batch_file), output=str(out), model=args.model, rules=args.rules,
                              overrides=list(args.set), dtype=args.dtype, progress=False))
    bad = [ln for ln in out.read_text().splitlines() if json.loads(ln)["error"] is not None]
    out.unlink()
    if bad:
        raise KinjectError(f"run-batch answered {len(bad)} requests with an error: {bad[0][:200]}")
    st = s["stats"]
    return {"tokens": st.tokens, "seconds": st.gen_s, "tokens_per_s": st.tokens_per_s}


class _ServerProcess:
    def __init__(self, args, workdir: Path, engine: str = "process"):
        cmd = [sys.executable, "-m", "kinject", "serve", "--port", "0", "--threads", str(args.threads),
               "--batch-wait-ms", str(args.batch_wait_ms), "--engine", engine]
        for flag, value in (("--model", args.model), ("--rules", args.rules), ("--dtype", args.dtype)):
            if value:
                cmd += [flag, value]
        for kv in args.set:
            cmd += ["--set", kv]
        root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)}
        self.log = workdir / f"server-{engine}.log"
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=open(self.log, "w"), text=True, env=env)
        line = ""
        while True:
            line = self.proc.stdout.readline()
            if line.startswith("kinject serve:") or (not line and self.proc.poll() is not None):
                break
        if not line.startswith("kinject serve:"):
            raise KinjectError(f"kinject serve did not start: {self.log.read_text()[-500:]}")
        self.url = line.split(" on ")[1].split(" ")[0]

    def generate_counters(self) -> tuple[float, float]:
        """(tokens generated, seconds inside generate) from the server's /metrics."""
        import httpx

        values = {}
        for ln in httpx.get(self.url + "/metrics", timeout=60).text.splitlines():
            if ln.startswith(("kinject_generation_tokens_total ", "kinject_generate_seconds_total ")):
                name, value = ln.split()
                values[name] = float(value)
        return values["kinject_generation_tokens_total"], values["kinject_generate_seconds_total"]

    def rss(self) -> int:
        """Resident bytes of the server and every process under it (its engine process)."""
        total = 0
        for pid in _process_tree(self.proc.pid):
            try:
                with open(f"/proc/{pid}/statm") as f:
                    total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            except OSError:
                pass                             # gone meanwhile
        return total

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _process_tree(root: int) -> list[int]:
    """``root`` and its descendants, from /proc."""
    parent: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
    tree, todo = [root], [root]
    while todo:
        pid = todo.pop()
        kids = [c for c, p in parent.items() if p == pid]
        tree += kids
        todo += kids
    return tree


async def _serve_round(url: str, prompts: list[str], max_tokens: int, clients: int,
                       on_answer=None) -> dict:
    import httpx

    todo = iter(range(len(prompts)))
    ttft: list[float] = []
    tokens = 0
    answered = 0

    async def client(http):
        nonlocal tokens, answered
        for i in todo:
            body = {"model": "default", "prompt": prompts[i], "max_tokens": max_tokens, "temperature": 0,
                    "stream": True, "stream_options": {"include_usage": True}}
            t0 = time.perf_counter()
            first = None
            usage = None
            async with http.stream("POST", url + "/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise KinjectError(f"request {i}: HTTP {r.status_code}: {(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk["choices"] and chunk["choices"][0]["text"]:
                        first = time.perf_counter() - t0
                    usage = chunk.get("usage") or usage
            if usage is None:
                raise KinjectError(f"request {i}: the stream ended without its usage chunk")
            ttft.append(first if first is not None else time.perf_counter() - t0)
            tokens += usage["completion_tokens"]
            answered += 1
            if on_answer is not None:
                on_answer(answered)

    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(client(http) for _ in range(clients)))
        wall = time.perf_counter() - t0
    if answered != len(prompts):
        raise KinjectError(f"{answered} of {len(prompts)} requests answered")
    ttft.sort()
    pick = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))]  # noqa: E731
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall, "ttft_p50": pick(0.50),
            "ttft_p99": pick(0.99), "requests": answered}


def main(args) -> int:
    from kinject.bench.common import provenance

    for name in ("requests", "max_tokens", "clients", "repeats"):
        if getattr(args, name) < 1:
            raise KinjectError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.long_requests < 0:
        raise KinjectError(f"--long-requests must be >= 0, got {args.long_requests}")
    engines = _engines(args.engines)
    from kinject.app.serve_cli import check_serve_extra

    check_serve_extra()
    import torch
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    load = lambda: os.getloadavg()[0]  # noqa: E731
    results: dict = {"rounds": [], "load": [], "serves": [ENGINE_CONTENDER[e] for e in engines]}
    with tempfile.TemporaryDirectory(prefix="kinject-bench-serve-") as tmp:
        work = Path(tmp)
        run_in, batch_in = _write_inputs(work, args.requests, args.max_tokens)
        servers: dict[str, _ServerProcess] = {}
        try:
            for engine in engines:
                servers[ENGINE_CONTENDER[engine]] = _ServerProcess(args, work, engine)
            prompts = _prompts(args.requests)
            # warm-up: every contender once on a short job
            w_run, w_batch = _write_inputs(work, args.clients, args.max_tokens)
            _run_contender(args, w_run, work)
            _batch_contender(args, w_batch, work)
            for server in servers.values():
                asyncio.run(_serve_round(server.url, prompts[:args.clients], args.max_tokens, args.clients))
            contenders = ["run", *servers, "run-batch"]
            for r in range(args.repeats):
                row = {}
                results["load"].append(load())
                # alternate the order between rounds so no contender always follows the same one
                order = contenders if r % 2 == 0 else contenders[::-1]
                for name in order:
                    if name == "run":
                        row[name] = _run_contender(args, run_in, work)
                    elif name == "run-batch":
                        row[name] = _batch_contender(args, batch_in, work)
                    else:
                        server = servers[name]
                        tok0, sec0 = server.generate_counters()
                        row[name] = asyncio.run(_serve_round(server.url, prompts, args.max_tokens, args.clients))
                        tok1, sec1 = server.generate_counters()
                        # the server's own generate, measured as run's and run-batch's are
                        row[name]["in_generate_tokens_per_s"] = (tok1 - tok0) / (sec1 - sec0) if sec1 > sec0 else 0.0
                    print(f"round {r + 1} {name:15s}: {row[name]['tokens_per_s']:7.1f} tokens/s "
                          f"({row[name]['tokens']} tokens in {row[name]['seconds']:.2f} s)", file=sys.stderr, flush=True)
                results["rounds"].append(row)
            results["load"].append(load())
            if args.long_requests:
                long_prompts = _prompts(args.long_requests)
                results["long_serve"], results["rss"] = {}, {}
                for name, server in servers.items():
                    rss: list[tuple[int, int]] = [(0, server.rss())]

                    def sample(done: int, server=server, rss=rss) -> None:
                        if done % 100 == 0:
                            rss.append((done, server.rss()))

                    results["long_serve"][name] = asyncio.run(_serve_round(server.url, long_prompts, args.max_tokens,
                                                                           args.clients, on_answer=sample))
                    results["rss"][name] = rss
                long_run, long_batch = _write_inputs(work, args.long_requests, args.max_tokens)
                results["long_run"] = _run_contender(args, long_run, work)
                results["long_batch"] = _batch_contender(args, long_batch, work)
                results["load"].append(load())
        finally:
            for server in servers.values():
                server.stop()
    print(format_results(args, results))
    print(provenance())
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def format_results(args, results: dict) -> str:
    serves = results["serves"]
    rounds = results["rounds"]
    names = ["run", "run-batch", *serves]
    best = {k: max(r[k]["tokens_per_s"] for r in rounds) for k in names}
    lines = [f"kinject bench serve: {args.requests} requests x {args.max_tokens} new tokens, greedy, "
             f"{args.clients} concurrent streaming clients, best of {args.repeats} interleaved rounds; "
             f"load {min(results['load']):.1f}-{max(results['load']):.1f}",
             "| contender | tokens/s (best) | per round | vs run (best) | vs run per round |",
             "| --- | ---: | --- | ---: | --- |"]
    for k in names:
        per = ", ".join(f"{r[k]['tokens_per_s']:.1f}" for r in rounds)
        ratios = ", ".join(f"{r[k]['tokens_per_s'] / r['run']['tokens_per_s']:.2f}" for r in rounds)
        lines.append(f"| {k} | {best[k]:.1f} | {per} | {best[k] / best['run']:.2f}x | {ratios} |")
    for k in serves:
        inside = [r[k]["in_generate_tokens_per_s"] for r in rounds]
        fastest = max((r[k] for r in rounds), key=lambda x: x["tokens_per_s"])
        lines.append(f"{k} inside its generate (as run and run-batch are measured): "
                     f"{', '.join(f'{x:.1f}' for x in inside)} tokens/s, best {max(inside) / best['run']:.2f}x run")
        lines.append(f"{k} time to first token: p50 {1000 * fastest['ttft_p50']:.0f} ms, "
                     f"p99 {1000 * fastest['ttft_p99']:.0f} ms (best round)")
    if "long_serve" in results:
        mib = lambda b: b / 2 ** 20  # noqa: E731
        long_run = results["long_run"]["tokens_per_s"]
        lines.append(f"long run, {args.long_requests} requests: run {long_run:.1f}, run-batch "
                     f"{results['long_batch']['tokens_per_s']:.1f} tokens/s (run-batch / run "
                     f"{results['long_batch']['tokens_per_s'] / long_run:.2f}x)")
        for k in serves:
            ls, rss = results["long_serve"][k], results["rss"][k]
            after_first = [b for n, b in rss if n >= 100] or [rss[-1][1]]
            lines.append(f"long run, {k}: {ls['tokens_per_s']:.1f} tokens/s ({ls['tokens_per_s'] / long_run:.2f}x run; "
                         f"TTFT p50 {1000 * ls['ttft_p50']:.0f} ms, p99 {1000 * ls['ttft_p99']:.0f} ms); RSS of the "
                         "server and its engine (MiB) by answered requests: "
                         + ", ".join(f"{n}: {mib(b):.0f}" for n, b in rss)
                         + f"; after the first 100: min {mib(min(after_first)):.0f}, max {mib(max(after_first)):.0f}")
    return "\n".join(lines)
