"""The ``kinject`` command line.

Every user error (a KinjectError) is printed as one line on stderr with exit code 2,
never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from pathlib import Path

from kinject.errors import KinjectError
from kinject.formatting import format_bytes, format_seconds

logger = logging.getLogger("kinject")


def meta_model(model_dir: str):
    """Build the model of ``model_dir``'s config on the meta device: no weights are read."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(model_dir)
    if not (path / "config.json").is_file():
        raise KinjectError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    config = AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def cmd_inspect(args) -> int:
    from kinject.inject import match_modules
    from kinject.rules import load_rules

    ruleset = load_rules(args.rules, args.set)
    model = meta_model(args.model)
    claims, report = match_modules(model, ruleset)
    print(f"model: {args.model} ({type(model).__name__}, weights not read)")
    print(report.format(max_names=args.max_names))
    layouts = experts_layouts(claims)
    if layouts:
        print("  experts layouts:")
        for line, names in layouts.items():
            print(f"    {line}: {len(names)}  [{', '.join(names[:args.max_names])}{', ...' if len(names) > args.max_names else ''}]")
    return 0


def experts_layouts(claims) -> dict[str, list[str]]:
    """For each module a GroupedExperts rule claimed: the experts layout it infers (or why none fits)."""
    from operators.expert_layouts import LayoutError, infer_layout
    from operators.experts import GroupedExperts

    out: dict[str, list[str]] = {}
    for c in claims:
        if isinstance(c.rule.replace_cls, type) and issubclass(c.rule.replace_cls, GroupedExperts):
            try:
                line = f"{type(c.module).__name__}: " + infer_layout(c.module, c.name, c.rule.kwargs.get("layout")).describe()
            except LayoutError as exc:
                line = f"{type(c.module).__name__}: NO LAYOUT ({exc})"
            out.setdefault(line, []).append(c.name)
    return out


def cmd_demo(args) -> int:
    from kinject.app.demo import run_demo

    for name in ("batch", "prompt_len", "max_new_tokens", "repeats", "threads"):
        if getattr(args, name) < 1:
            raise KinjectError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 < args.budget <= 1 or not args.bandwidth > 0:
        raise KinjectError(f"--budget must be in (0, 1] and --bandwidth > 0, got {args.budget}, {args.bandwidth}")
    result = run_demo(args.rules, args.set, model=args.model, batch=args.batch, prompt_len=args.prompt_len,
                      new_tokens=args.max_new_tokens,
                      budget_share=args.budget, bandwidth=args.bandwidth, repeats=args.repeats,
                      threads=args.threads, trace=args.trace, plot=args.plot or None, started=getattr(args, "started", None),
                      prefill=args.prefill)
    return 0 if result["identical"] else 1


def cmd_run(args) -> int:
    if args.ray:
        from kinject.app.scale import main as ray_main

        return ray_main(args)
    from kinject.app.run import main as run_main

    return run_main(args)


def cmd_eval(args) -> int:
    from kinject.app.eval import main as eval_main

    return eval_main(args)


def cmd_run_batch(args) -> int:
    from kinject.app.run_batch import main as batch_main

    return batch_main(args)


def cmd_serve(args) -> int:
    from kinject.app.serve_cli import main as serve_main

    return serve_main(args)


def cmd_bench_cpu(args) -> int:
    """The ladder; with ``--formats``, the stored-formats table(s) after it."""
    from kinject.bench import cpu, formats

    return formats.cli(args) if args.formats else cpu.main(args)


def cmd_plan(args) -> int:
    """Profile (cached), solve Klotski's inequalities for n, print the table and the bound."""
    from kinject.plan import planner, profiler
    from kinject.pretrained import from_pretrained
    from kinject.app.run import default_model_path, default_rules

    model_dir = Path(args.model) if args.model else default_model_path()
    rules = args.rules or default_rules(model_dir)
    model = from_pretrained(model_dir, rules, args.set, attn_implementation="eager")
    rt = model.kinject
    bs = args.bs or rt.pipeline.micro_batch_size or 8
    profile = profiler.measure_profile(model, bs=bs, refresh=args.refresh)
    coverage = profiler.hot_coverage(model)
    per_token = profile.meta.get("kv_bytes_per_token_layer", 0)      # measured when KV is offloaded
    constraints = planner.Constraints(device_budget=rt.pipeline.device_budget, host_budget=rt.pipeline.host_budget,
                                      resident_bytes=rt.store.resident_external + rt.store.used,
                                      kv_bytes_per_seq=int(per_token * profile.num_layers * args.target_len),
                                      target_len=args.target_len)
    plan = planner.solve(profile, constraints, bs=bs, hot_coverage=coverage, n_max=args.n_max,
                         kv_in_eq7=profile.kv_bytes > 0)
    print(f"model: {model_dir}  rules: {rules}  device: {profile.device}"
          + ("  [host->device link EMULATED]" if rt.transfer.emulated else ""))
    print(f"profile (bs={bs}, decode): attention {format_seconds(profile.t_attn)}, gate {format_seconds(profile.t_gate)}, "
          f"expert {format_seconds(profile.t_expert.fixed_s)} + {format_seconds(profile.t_expert.per_token_s)}/token; "
          f"loads: attention {format_bytes(profile.attn_bytes)} in {format_seconds(profile.t_load_attn or 0)}, "
          f"gate {format_bytes(profile.gate_bytes)}, expert {format_bytes(profile.expert_bytes)} in "
          f"{format_seconds(profile.t_load_expert or 0)}; link {format_bytes(profile.bandwidth or 0)}/s")
    print(planner.format_table(plan))
    print(f"paste into the rule file:  pipeline: {{n_batches: {plan.n}, micro_batch_size: {bs}}}")
    rt.transfer.close()
    return 0


#: The bench suites whose module gives ``add_arguments(parser)`` and ``main(args) -> exit code``:
#: (subcommand, module, help). ``offload``, ``cpu``, ``kv`` and ``plan`` have entry points of their own.
BENCH_SUITES = (
    ("hybrid", "kinject.bench.hybrid",
     "experts computed where they live vs moved (Klotski), accelerate and resident, batch 1..64 (emulated link)"),
    ("speculative", "kinject.bench.speculative",
     "prompt-lookup decoding vs plain decoding at batch 1 under hybrid / klotski rules (emulated link)"),
    ("host-experts", "kinject.bench.host_experts",
     "decode with every expert on the host (bf16, int8, int4) vs transformers and llama.cpp, against the "
     "memory-bandwidth bound"),
    ("overhead", "kinject.bench.overhead",
     "kinject's bookkeeping cost vs plain HF as the number of experts grows (all weights on the host tier, no "
     "emulated link; CUDA: launches per step)"),
    ("serve", "kinject.app.bench_serve",
     "kinject serve (32 concurrent clients) and run-batch vs kinject run on the same prompts: tokens/s, time to "
     "first token, server memory over 1,000 requests"),
    ("gpu", "kinject.bench.gpu",
     "the Klotski ladder + HQQ vs accelerate on a CUDA GPU, Mixtral-8x7B-shaped random model (--device cpu: dry run)"),
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kinject", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="store_true", help="log at INFO level")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("inspect", help="show which module each rule matches, without loading weights")
    s.add_argument("model", help="Hugging Face model directory (config.json is enough)")
    s.add_argument("rules", help="rule file (YAML)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a rule-file key")
    s.add_argument("--max-names", type=int, default=4, help="module names shown per rule")
    s.set_defaults(func=cmd_inspect)

    s = sub.add_parser("plan", help="profile the model, solve Klotski's inequalities for n, print the bound")
    s.add_argument("model", nargs="?", default=None, help="model directory (default: the built-in model)")
    s.add_argument("rules", nargs="?", default=None, help="rule file with GroupedExperts (default: rules/klotski.yaml)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a rule-file key")
    s.add_argument("--bs", type=int, default=None, help="micro-batch size (default: pipeline.micro_batch_size)")
    s.add_argument("--n-max", type=int, default=64, help="largest n to consider")
    s.add_argument("--target-len", type=int, default=544, help="prompt + generated tokens the KV is sized for")
    s.add_argument("--refresh", action="store_true", help="re-profile even if a cached profile matches")
    s.set_defaults(func=cmd_plan)

    s = sub.add_parser("demo", help="built-in tiny model under one device budget counting weights, KV and "
                                     "activations: untouched HF, accelerate at its largest batch, Klotski at the "
                                     "planner's, side by side, same greedy tokens")
    s.add_argument("--model", default=None, metavar="DIR",
                   help="model directory instead of the built-in model, also a quantized checkpoint (FP8, MXFP4, "
                        "compressed-tensors): the reference row is transformers' own load of it")
    s.add_argument("--rules", default=None, help="rule file of the Klotski row (default: rules/klotski.yaml)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a rule-file key of the Klotski row")
    s.add_argument("--batch", type=int, default=32, help="prompts of the built-in corpus (default 32)")
    s.add_argument("--prompt-len", type=int, default=128, help="tokens per prompt (default 128)")
    s.add_argument("--max-new-tokens", type=int, default=8)
    s.add_argument("--budget", type=float, default=0.5, help="device budget for weights, KV and activations, as a "
                                                             "share of the weights (default 0.5)")
    s.add_argument("--bandwidth", type=float, default=1.0, help="emulated host->device GB/s (default 1)")
    s.add_argument("--repeats", type=int, default=3, help="timed runs per contender, interleaved, after a warm-up; "
                                                          "the best counts (default 3)")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads (default 1: a tiny model)")
    s.add_argument("--prefill", choices=("layer", "micro_batch"), default="layer",
                   help="Klotski's prefill: layer (each layer runs every micro-batch, its weights loaded once; "
                        "default) or micro_batch (one micro-batch at a time through the whole model)")
    s.add_argument("--trace", metavar="FILE.json", help="write the Klotski run's Chrome/Perfetto trace")
    s.add_argument("--plot", metavar="FILE.png", default="kinject-demo.png",
                   help="draw the Klotski run's pipeline (default kinject-demo.png; '' for none)")
    s.set_defaults(func=cmd_demo)

    s = sub.add_parser("eval", help="perplexity, KL and top-1 agreement against a base, beside bytes per step, "
                                     "of one setting (quantization / placement) on a text or the built-in corpus")
    from kinject.app.eval import add_arguments as add_eval_arguments
    add_eval_arguments(s)
    s.set_defaults(func=cmd_eval)

    s = sub.add_parser("run", help="batch job: prompts file in, completions JSONL out (resumable)")
    from kinject.app.run import add_arguments as add_run_arguments
    add_run_arguments(s)
    s.set_defaults(func=cmd_run)

    s = sub.add_parser("run-batch", help="OpenAI Batch file in, its output file out (as vllm run-batch; resumable)")
    from kinject.app.run_batch import add_arguments as add_batch_arguments
    add_batch_arguments(s)
    s.set_defaults(func=cmd_run_batch)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server; concurrent requests share batch groups "
                                     "(pip install 'kinject[serve]')")
    from kinject.app.serve_cli import add_arguments as add_serve_arguments
    add_serve_arguments(s)
    s.set_defaults(func=cmd_serve)

    s = sub.add_parser("bench", help="benchmarks (results and methodology: BENCHMARKS.md)")
    bench = s.add_subparsers(dest="bench", required=True)
    from kinject.bench.offload import add_offload_arguments
    add_offload_arguments(bench.add_parser("offload", help="kinject's disk offload vs accelerate's, on CPU"))
    from kinject.bench import cpu as bench_cpu
    c = bench.add_parser("cpu", help="the Klotski ablation ladder + HQQ on the trained fixture (emulated link)")
    bench_cpu.add_arguments(c)
    c.set_defaults(func=cmd_bench_cpu)
    c = bench.add_parser("kv", help="long context: KV offloaded per micro-batch vs KV resident (emulated link)")
    bench_cpu.add_kv_arguments(c)
    c.set_defaults(func=lambda a: bench_cpu.bench_kv(a))
    c = bench.add_parser("plan", help="the planner's predicted step time vs measured, per n (emulated link)")
    bench_cpu.add_plan_arguments(c)
    c.set_defaults(func=lambda a: bench_cpu.bench_plan(a))
    for name, module, help_ in BENCH_SUITES:
        suite = importlib.import_module(module)
        c = bench.add_parser(name, help=help_)
        suite.add_arguments(c)
        c.set_defaults(func=suite.main)
    return p


def main(argv: list[str] | None = None) -> int:
    started = time.perf_counter()            # the demo's wall-time breakdown starts here
    parser = build_parser()                  # imports torch (the bench suites' options)
    args = parser.parse_args(argv)
    args.started = started
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(message)s")
    try:
        return args.func(args)
    except KinjectError as exc:
        print(f"kinject: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("kinject: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
