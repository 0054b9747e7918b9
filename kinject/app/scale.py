"""``kinject run --ray``: the batch job on Ray Data, one kinject-optimized model per actor.

    kinject run --ray --actors 4 --gpus-per-actor 1 --model DIR --prompts prompts.jsonl --out out.jsonl

Same job, same output as :mod:`kinject.app.run`, spread over a Ray cluster (a local one when
``RAY_ADDRESS`` is unset and none is running):

* **Prompts** are read with Ray Data (``read_text`` for JSONL and text, ``read_parquet`` for
  Parquet with a ``prompt`` and an optional ``id`` column) and checked on the driver by the
  single-process job's own parser, so a malformed line is named by its line number.
* **Groups** are fixed by position exactly as in the single-process job (``n * bs`` prompts,
  the same members, the same padding), and a group is never split: each Ray Data row is one
  group, so greedy results equal ``kinject run`` without ``--ray``.
* **Actors**: ``map_batches`` with a callable class; each actor builds one model
  (:func:`kinject.from_pretrained` + rules + ``--set``) once and generates one group per call;
  ``--gpus-per-actor`` is Ray's ``num_gpus`` (the rule file's ``pipeline.device`` says which
  device the model computes on: ``cuda:0`` is the actor's own GPU, as Ray sets
  ``CUDA_VISIBLE_DEVICES`` per actor).
* **Output**: each finished group is appended to ``--out`` by the driver as its block arrives
  (fsync'ed, whole groups only); re-running skips every id already written, so a killed run
  loses at most the groups in flight. The summary adds up every actor.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

from kinject.app.run import (Prompt, RunConfig, RunInterrupted, RunStats, StopOnSignals, StopRequested, check_config,
                             check_prompts, config_from_args, default_model_path, default_rules, done_ids,
                             generate_group, generation_kwargs, load_tokenizer, model_type, output_file, parse_prompts,
                             pending_groups, render_chat_prompts, write_all)
from kinject.plan.groups import GroupPlan, plan_groups
from kinject.errors import KinjectError
from kinject.formatting import format_bytes

logger = logging.getLogger(__name__)

_BUILD_FAILED = "kinject actor could not build its model"


def _ray():
    try:
        import ray
        import ray.data  # noqa: F401
    except ImportError:
        raise KinjectError("--ray needs Ray Data: pip install 'kinject[ray]' (or pip install 'ray[data]')") from None
    return ray


def read_prompts_ray(path: str, fmt: str = "auto") -> list[Prompt]:
    """The prompts of ``path`` read with Ray Data, validated by the single-process parser (errors
    name the file and line, or the Parquet row)."""
    ray = _ray()
    local = Path(path).expanduser()
    if "://" not in path:
        if not local.exists():
            raise KinjectError(f"prompts file not found: {local}")
        if local.is_dir():
            raise KinjectError(f"prompts file is a directory: {local}")
        path = str(local)
    if fmt == "auto" and local.suffix.lower() == ".parquet":
        fmt = "parquet"
    if fmt == "parquet":
        rows = ray.data.read_parquet(path).take_all()
        prompts = []
        for i, row in enumerate(rows, 1):
            if "prompt" not in row or not isinstance(row["prompt"], str) or not row["prompt"]:
                raise KinjectError(f"{path}: row {i}: needs a non-empty string 'prompt' column (got {row.get('prompt')!r})")
            pid = row.get("id", i)
            pid = pid.item() if hasattr(pid, "item") else pid
            if isinstance(pid, bool) or not isinstance(pid, (str, int)):
                raise KinjectError(f"{path}: row {i}: 'id' must be a string or an integer, got {pid!r}")
            prompts.append(Prompt(pid, row["prompt"], i))
    else:
        lines = [r["text"] for r in ray.data.read_text(path, drop_empty_lines=False).take_all()]
        prompts = parse_prompts(local, lines, fmt)
    return check_prompts(path, prompts)


class GroupGenerator:
    """The ``map_batches`` callable: one optimized model per actor, one group per row."""

    def __init__(self, model_dir: str, rules: str, overrides: list[str], gen_kwargs: dict, dtype: str | None,
                 attn: str, threads: int):
        import torch

        import kinject

        if threads:
            torch.set_num_threads(threads)
        try:
            self.tok = load_tokenizer(Path(model_dir))
            self.model = kinject.from_pretrained(model_dir, rules, overrides, dtype=dtype, attn_implementation=attn)
        except Exception as exc:
            raise RuntimeError(f"{_BUILD_FAILED} on {socket.gethostname()} (pid {os.getpid()}): "
                               f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}") from None
        self.gen_kwargs = gen_kwargs
        self.actor = f"{socket.gethostname()}:{os.getpid()}"

    def __call__(self, batch: dict[str, Any]) -> dict[str, list]:
        import torch

        rt = self.model.kinject
        out: dict[str, list] = {"group": [], "records": [], "stats": []}
        for gi, raw in zip(batch["group"], batch["prompts"]):
            group = [Prompt(p["id"], p["prompt"], p["line"]) for p in json.loads(raw)]
            if self.gen_kwargs.get("do_sample"):
                torch.manual_seed(self.gen_kwargs["seed"] + int(gi))    # as the single-process job
            rt.store.reset_stats()
            rt.tracer.clear()
            started, t0 = time.time(), time.perf_counter()
            with torch.inference_mode():
                records = generate_group(self.model, self.tok, group,
                                         {k: v for k, v in self.gen_kwargs.items() if k != "seed"}, rt.device)
            dt = time.perf_counter() - t0
            out["group"].append(int(gi))
            out["records"].append(json.dumps(records, ensure_ascii=False))
            out["stats"].append(json.dumps({**self._stats(rt, records, dt), "started": started, "ended": time.time()}))
        return out

    def _stats(self, rt, records: list[dict], seconds: float) -> dict:
        from kinject.trace import union_seconds

        spans = [(e.start, e.end) for e in rt.tracer.events() if e.stream == "compute"] if rt.tracer.enabled else []
        pstats = rt.peek("prefetch_stats")
        precision = pstats.precision() if pstats is not None and hasattr(pstats, "precision") else None
        return {"actor": self.actor, "tokens": sum(r["new_tokens"] for r in records), "gen_s": seconds,
                "bytes": dict(rt.store.stats.get("bytes", {})),
                "compute_busy_s": union_seconds(spans) if spans else 0.0,
                "compute_span_s": (max(e for _, e in spans) - min(s for s, _ in spans)) if spans else 0.0,
                "prefetch_precision": precision}


def run_ray_job(cfg: RunConfig, *, actors: int = 1, gpus_per_actor: float = 0.0, threads: int = 0) -> dict:
    """The batch job of ``cfg`` on Ray Data; returns the summary :func:`format_ray_summary` prints.

    Raises :class:`~kinject.app.run.RunInterrupted` on SIGINT/SIGTERM after keeping every group written."""
    if actors < 1:
        raise KinjectError(f"--actors must be >= 1, got {actors}")
    if gpus_per_actor < 0:
        raise KinjectError(f"--gpus-per-actor must be >= 0, got {gpus_per_actor}")
    summary: dict[str, Any] = {}
    with StopOnSignals() as sig:
        try:
            return _run(cfg, sig, summary, actors, gpus_per_actor, threads)
        except StopRequested as stop:
            import signal

            name = signal.Signals(stop.signum).name
            raise RunInterrupted(f"interrupted by {name}: kept {summary.get('done_total', 0)}/"
                                 f"{summary.get('total', '?')} prompts in {cfg.out} (whole groups only); "
                                 "re-run the same command to resume", 128 + stop.signum) from None


def _run(cfg: RunConfig, sig: StopOnSignals, summary: dict, actors: int, gpus: float, threads: int) -> dict:
    from kinject.rules import load_rules, resolve_rules_path

    t_start = time.perf_counter()
    check_config(cfg)
    if cfg.trace or cfg.plot:
        raise KinjectError("--trace / --plot are single-process options (each actor has its own timeline)")
    ray = _ray()
    if not cfg.progress:
        ray.data.DataContext.get_current().enable_progress_bars = False
        logging.getLogger("ray.data").setLevel(logging.WARNING)
    model_dir = Path(cfg.model).expanduser() if cfg.model else default_model_path()
    model_type(model_dir)
    rules_path = resolve_rules_path(cfg.rules) if cfg.rules else default_rules(model_dir)
    ruleset = load_rules(rules_path, cfg.overrides)
    out = Path(cfg.out).expanduser()
    with output_file(out) as fd:
        if not ray.is_initialized():
            address = os.environ.get("RAY_ADDRESS")
            ray.init(address=address or None, include_dashboard=False, log_to_driver=False,
                     **({} if address else {"num_cpus": max(actors, os.cpu_count() or 1)}))
        if cfg.prompts:
            prompts = read_prompts_ray(cfg.prompts, cfg.prompts_format)
        else:
            from kinject.app.run import builtin_prompts

            prompts = builtin_prompts()
        if any(p.messages is not None for p in prompts):             # chat lines: rendered once, on the driver
            prompts = render_chat_prompts(prompts, load_tokenizer(model_dir), str(model_dir))
        plan: GroupPlan = plan_groups(ruleset.pipeline)            # n_batches: auto -> 1 on the driver
        done = done_ids(out)
        groups = pending_groups(prompts, plan.size, done)
        todo = sum(len(g) for _, g in groups)
        summary.update({"model": str(model_dir), "rules": str(rules_path), "out": str(out), "total": len(prompts),
                        "skipped": len(prompts) - todo, "done_total": len(prompts) - todo, "plan": plan,
                        "actors": actors, "gpus_per_actor": gpus})
        stats = RunStats()
        summary["stats"] = stats
        summary["per_actor"] = {}
        if not groups:
            summary["wall_s"] = time.perf_counter() - t_start
            return summary
        gen_kwargs = {**generation_kwargs(cfg, load_tokenizer(model_dir).pad_token_id), "seed": cfg.seed}
        rows = [{"group": gi, "prompts": json.dumps([{"id": p.id, "prompt": p.prompt, "line": p.line} for p in g])}
                for gi, g in groups]
        # one group in flight per actor, and the pool starts only when every actor has built its
        # model: otherwise the first actor up takes every group while the others still load
        ray.data.DataContext.get_current().wait_for_min_actors_s = 24 * 3600
        ds = ray.data.from_items(rows, override_num_blocks=len(rows)).map_batches(
            GroupGenerator, batch_size=1, num_gpus=gpus or None,
            compute=ray.data.ActorPoolStrategy(size=actors, max_tasks_in_flight_per_actor=1),
            fn_constructor_kwargs=dict(model_dir=str(model_dir), rules=str(rules_path), overrides=list(cfg.overrides),
                                       gen_kwargs=gen_kwargs, dtype=cfg.dtype, attn=cfg.attn, threads=threads))
        try:
            for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
                for records_json, stats_json in zip(batch["records"], batch["stats"]):
                    records, st = json.loads(str(records_json)), json.loads(str(stats_json))
                    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
                    with sig.critical():
                        write_all(fd, data)
                        summary["done_total"] += len(records)
                    _add_stats(summary, stats, st, len(records))
        except (KinjectError, StopRequested):
            raise
        except Exception as exc:       # a failing actor: one line, what is written stays
            raise KinjectError(_root_cause(exc) + f"; kept {summary['done_total']}/{len(prompts)} prompts in {out}") from None
        summary["wall_s"] = time.perf_counter() - t_start
        return summary


def _add_stats(summary: dict, stats: RunStats, st: dict, prompts: int) -> None:
    stats.groups += 1
    stats.prompts += prompts
    window = summary.setdefault("generate_window", [st["started"], st["ended"]])
    window[:] = [min(window[0], st["started"]), max(window[1], st["ended"])]
    stats.tokens += st["tokens"]
    stats.gen_s += st["gen_s"]
    stats.compute_busy_s += st["compute_busy_s"]
    stats.compute_span_s += st["compute_span_s"]
    mine = summary["per_actor"].setdefault(st["actor"], {"groups": 0, "tokens": 0, "gen_s": 0.0, "bytes": {},
                                                         "precision": []})
    mine["groups"] += 1
    mine["tokens"] += st["tokens"]
    mine["gen_s"] += st["gen_s"]
    for tier, b in st["bytes"].items():
        mine["bytes"][tier] = mine["bytes"].get(tier, 0) + b
        summary.setdefault("bytes_moved", {})[tier] = summary.get("bytes_moved", {}).get(tier, 0) + b
    if st["prefetch_precision"] is not None:
        mine["precision"].append(st["prefetch_precision"])


def _root_cause(exc: BaseException) -> str:
    """The first line that says what failed, from Ray's wrapped exceptions."""
    text = str(exc)
    for line in text.splitlines():
        if _BUILD_FAILED in line:
            return line[line.index(_BUILD_FAILED):].strip()
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return f"ray job failed: {type(exc).__name__}: {first[:300]}"


def format_ray_summary(summary: dict) -> str:
    stats: RunStats = summary["stats"]
    plan: GroupPlan | None = summary.get("plan")
    rows = [("output", f"{summary['out']}: {summary['done_total']}/{summary['total']} prompts "
                       f"({stats.prompts} new, {summary['skipped']} already there)"),
            ("model", summary["model"]), ("rules", summary["rules"]),
            ("ray", f"{summary['actors']} actor(s), {summary['gpus_per_actor']:g} GPU(s) each")]
    if plan is not None:
        rows.append(("plan", f"n={plan.n} x bs={plan.bs} = {plan.size} prompts per generate ({plan.source}); "
                             f"{stats.groups} group(s) run"))
    if stats.groups:
        start, end = summary["generate_window"]
        wall = max(end - start, 1e-9)
        rows.append(("tokens/s", f"{stats.tokens / wall:.1f} all actors together ({stats.tokens} new tokens from the "
                                 f"first generate's start to the last one's end, {wall:.2f} s); "
                                 f"{stats.tokens_per_s:.1f} per actor-second of generate"))
        bubble = stats.bubble_fraction
        rows.append(("bubble fraction", "not measured (no trace: --set pipeline.trace=true records one per actor)"
                     if bubble is None else f"{100 * bubble:.1f}% of the compute streams"))
        rows.append(("bytes moved", ", ".join(f"from {t} {format_bytes(b)}" for t, b in summary.get("bytes_moved", {}).items())
                     or "n/a"))
        for actor, a in sorted(summary["per_actor"].items()):
            prec = f", prefetch precision {100 * sum(a['precision']) / len(a['precision']):.1f}%" if a["precision"] else ""
            moved = ", ".join(f"{t} {format_bytes(b)}" for t, b in a["bytes"].items())
            rows.append((f"actor {actor}", f"{a['groups']} group(s), {a['tokens']} tokens, "
                                           f"{a['tokens'] / a['gen_s']:.1f} tokens/s, moved {moved or 'nothing'}{prec}"))
    rows.append(("wall time", f"{summary.get('wall_s', 0.0):.2f} s (Ray start and model loads included)"))
    w = max(len(k) for k, _ in rows)
    return "kinject run --ray summary\n" + "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


def main(args) -> int:
    """``kinject run --ray`` from parsed arguments; returns the exit code (interruption: 128 + signal)."""
    cfg = config_from_args(args)
    try:
        summary = run_ray_job(cfg, actors=args.actors, gpus_per_actor=args.gpus_per_actor, threads=args.threads)
    except RunInterrupted as exc:
        print(f"kinject: {exc}", file=sys.stderr)
        return exc.exit_code
    print(format_ray_summary(summary))
    return 0
