"""``kinject bench overhead --counts`` per decode step, and ``--real-counts``: a real release's unit counts.

Per decode step (``decode_step_counts``): the Python calls (cProfile) and the wall milliseconds of one
decode step, for HF and for kinject, at batch 1 and batch 8. A decode step is what a chat waits for
per token, and on a GPU the same host work is what the kernels wait for; counted as the difference
between a generate of ``new`` tokens and one of 1 token (the prefill) divided by ``new - 1``, so the
prefill's one-off work does not blur it. Calls are exact; milliseconds are the best of the repeats.

``--real-counts deepseek_v3`` (:data:`REAL_COUNTS`): DeepSeek-V3's counts (61 layers, 256 routed
experts top-8, 1 shared expert, the first 3 layers dense: 14,848 routed expert units) at the tiny
width of :func:`kinject.testing.tiny_config`, every expert a store unit. Two rows, HF against
``rules/klotski.yaml``:

* in memory: one set of weights, HF's model and a kinject twin with every weight in the host tier;
* from disk: the checkpoint written in the hub's per-expert layout, HF ``from_pretrained`` (every
  weight in RAM) against ``kinject.from_pretrained(dir, "rules/klotski.yaml", ["vars.experts=disk"])``
  and nothing else (the budgets ``auto``), with each one's setup time.

Interleaved, best of the repeats after a warm-up, greedy tokens compared. Each generate's wall
seconds and the process's CPU seconds (``time.process_time``: all its threads; torch runs one) are
both reported: on a shared, loaded machine the wall ratio of a best of 3 moves by tens of percent
from run to run, the CPU ratio by a few.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

#: Config overrides giving a release's unit counts at the tiny width.
REAL_COUNTS = {
    "deepseek_v3": dict(num_hidden_layers=61, n_routed_experts=256, num_experts_per_tok=8, n_shared_experts=1,
                        first_k_dense_replace=3, n_group=8, topk_group=4, moe_intermediate_size=16,
                        intermediate_size=64),
}


def calls_per_decode_step(model, batch: dict, new: int, **gen) -> float:
    """Python calls (cProfile, C functions included) of one decode step of ``model`` on ``batch``:
    ``(generate(new) - generate(1)) / (new - 1)``, so the prefill's one-off work does not count.
    Warm the model up first (kinject learns its order on the first step)."""
    with torch.inference_mode():
        return (_calls(model, batch, new, **gen) - _calls(model, batch, 1, **gen)) / (new - 1)


def _calls(model, batch: dict, new: int, **gen) -> int:
    prof = cProfile.Profile()
    prof.enable()
    model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False, **gen)
    prof.disable()
    return sum(v[1] for v in pstats.Stats(prof).stats.values())


def _seconds(model, batch: dict, new: int) -> float:
    t0 = time.perf_counter()
    model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False)
    return time.perf_counter() - t0


def decode_step_counts(models: dict, batch: dict, *, new: int = 8, repeats: int = 3) -> dict:
    """Per decode step, per model (``{name: model}``): Python calls (exact) and milliseconds (best of
    ``repeats``, the models interleaved): ``(generate(new) - generate(1)) / (new - 1)``."""
    out = {}
    with torch.inference_mode():
        for m in models.values():
            m.generate(**batch, max_new_tokens=2, do_sample=False)          # warm-up (kinject learns its order)
        for name, m in models.items():
            out[name] = {"calls": (_calls(m, batch, new) - _calls(m, batch, 1)) / (new - 1)}
        best = {name: [float("inf"), float("inf")] for name in models}
        for _ in range(repeats):
            for name, m in models.items():
                best[name][0] = min(best[name][0], _seconds(m, batch, 1))
                best[name][1] = min(best[name][1], _seconds(m, batch, new))
        for name, (one, full) in best.items():
            out[name]["ms"] = 1e3 * max(0.0, full - one) / (new - 1)
        for name, m in models.items():
            rt = getattr(m, "kinject", None)
            if rt is not None:
                out[name]["untraced_ms"] = untraced_ms_per_step(m, batch, new)
    return out


def untraced_ms_per_step(model, batch: dict, new: int) -> float:
    """Milliseconds per decode step of a kinject ``model`` outside every traced compute span (the
    device's and the host's) and every wait for a transfer (one traced ``generate`` of ``new`` tokens;
    the median decode step): the engine's and ``generate``'s own host work between the kernels
    (``kinject.plan.profiler.untraced_step_s``), what a GPU would wait for at batch 1."""
    from kinject.plan.profiler import decode_windows, untraced_step_s

    rt = model.kinject
    was = rt.tracer.enabled
    rt.tracer.enabled = True
    rt.tracer.clear()
    try:
        with torch.inference_mode():
            model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False)
        return 1e3 * untraced_step_s(rt.tracer.events(), decode_windows(rt.tracer.steps()),
                                     streams=("compute", "stall", "host_compute"))
    finally:
        rt.tracer.enabled = was
        rt.tracer.clear()


def _prompts(vocab: int, batch: int, prompt: int) -> dict:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, vocab, (batch, prompt), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


def real_counts_rows(family: str = "deepseek_v3", *, batch: int = 8, prompt: int = 32, new_tokens: int = 8,
                     repeats: int = 3, workdir: str | None = None, dtype: torch.dtype = torch.bfloat16) -> list[dict]:
    """The in-memory and the from-disk rows at ``family``'s real counts (see the module docstring)."""
    import kinject
    from kinject.bench.common import shared_weights_twin
    from kinject.testing import no_progress_bars, build_tiny_model, save_tiny_model
    from transformers import AutoModelForCausalLM

    cfg = REAL_COUNTS[family]
    rows = []
    gen = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)
    with no_progress_bars(), torch.inference_mode():
        # in memory: one set of weights, kinject's twin with every weight on the host tier
        ref = build_tiny_model(family, dtype=dtype, draw_in_dtype=True, **cfg)
        inputs = _prompts(ref.config.vocab_size, batch, prompt)
        twin = shared_weights_twin(ref)
        t0 = time.perf_counter()
        kinject.optimize(twin, "rules/klotski.yaml", ["vars.weights=host"])
        setup = time.perf_counter() - t0
        rows.append(_timed_row(family, "in memory (host tier)", ref, twin, inputs, gen, repeats,
                               setup_hf=0.0, setup_kj=setup, units=len(twin.kinject.store.units)))
        twin.kinject.transfer.close()
        del twin
        gc.collect()
        # from disk: the hub's per-expert layout, each loaded as a user would
        with tempfile.TemporaryDirectory(prefix="kinject-real-counts-", dir=workdir) as tmp:
            path = Path(tmp) / family
            save_tiny_model(family, path, dtype=dtype, legacy_expert_keys=True,
                            build=lambda f, _built=ref, **kw: _built, **cfg)
            del ref
            gc.collect()
            t0 = time.perf_counter()
            hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
            setup_hf = time.perf_counter() - t0
            t0 = time.perf_counter()
            kj = kinject.from_pretrained(path, "rules/klotski.yaml", ["vars.experts=disk",
                                                                      f"pipeline.offload_dir={Path(tmp) / 'off'}"],
                                         dtype=dtype)
            setup_kj = time.perf_counter() - t0
            rows.append(_timed_row(family, "from disk (vars.experts=disk, budgets auto)", hf, kj, inputs, gen, repeats,
                                   setup_hf=setup_hf, setup_kj=setup_kj, units=len(kj.kinject.store.units),
                                   autos=[c.line() for c in kj.kinject.autos.values()],
                                   disk=kj.kinject.store.summary()["host_cache"]))
            kj.kinject.transfer.close()
    return rows


def _timed_row(family, setting, hf, kj, inputs, gen, repeats, *, setup_hf, setup_kj, units, autos=(), disk=None):
    for m in (hf, kj):                                          # warm-up
        m.generate(**inputs, max_new_tokens=2, do_sample=False)
    times = {"hf": [], "kinject": []}
    cpu = {"hf": [], "kinject": []}       # the process's CPU seconds: what a loaded machine blurs least
    outs = {}
    for r in range(repeats):
        pair = (("hf", hf), ("kinject", kj)) if r % 2 == 0 else (("kinject", kj), ("hf", hf))
        for name, m in pair:
            t0, c0 = time.perf_counter(), time.process_time()
            outs[name] = m.generate(**inputs, **gen)
            times[name].append(time.perf_counter() - t0)
            cpu[name].append(time.process_time() - c0)
    row = {"family": family, "setting": setting, "units": units, "hf_best": min(times["hf"]),
           "kj_best": min(times["kinject"]), "hf_cpu": min(cpu["hf"]), "kj_cpu": min(cpu["kinject"]),
           "hf_median": statistics.median(times["hf"]),
           "kj_median": statistics.median(times["kinject"]), "setup_hf": setup_hf, "setup_kj": setup_kj,
           "same": bool(torch.equal(outs["hf"], outs["kinject"])), "autos": list(autos)}
    if disk is not None:
        row["disk_bytes_total"] = disk["disk_bytes"]
    return row


def real_counts_table(rows: list[dict]) -> str:
    lines = ["| release counts | setting | store units | HF s (best) | kinject s (best) | kinject / HF (best) "
             "| CPU s HF / kinject (best) | medians | setup s HF / kinject | tokens = HF |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|:---:|"]
    for r in rows:
        lines.append(f"| {r['family']} | {r['setting']} | {r['units']} | {r['hf_best']:.2f} | {r['kj_best']:.2f} | "
                     f"{r['kj_best'] / r['hf_best']:.2f}x | {r['hf_cpu']:.2f} / {r['kj_cpu']:.2f} "
                     f"({r['kj_cpu'] / r['hf_cpu']:.2f}x) | {r['hf_median']:.2f} / {r['kj_median']:.2f} | "
                     f"{r['setup_hf']:.2f} / {r['setup_kj']:.2f} | {'✓' if r['same'] else '✗'} |")
    for r in rows:
        lines.extend(f"- {r['setting']}: {a}" for a in r["autos"])
    return "\n".join(lines)


def decode_table(counts: dict[int, dict]) -> str:
    """``{batch: decode_step_counts(...)}`` as a table: per decode step, kinject and HF."""
    lines = ["| batch | Python calls / decode step HF | kinject | kinject / HF | ms / decode step HF (best) "
             "| kinject | kinject ms beyond HF | kinject untraced ms / decode step |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for b, c in sorted(counts.items()):
        hf, kj = c["hf"], c["kinject"]
        untraced = f"{kj['untraced_ms']:.2f}" if "untraced_ms" in kj else ""
        lines.append(f"| {b} | {hf['calls']:.0f} | {kj['calls']:.0f} | {kj['calls'] / max(hf['calls'], 1):.2f}x | "
                     f"{hf['ms']:.2f} | {kj['ms']:.2f} | {kj['ms'] - hf['ms']:.2f} | {untraced} |")
    return "\n".join(lines)
