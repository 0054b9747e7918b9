"""``kinject demo``: the built-in default job, offline, on CPU, in seconds.

Builds the tiny Mixtral of :mod:`kinject.testing`, generates with the untouched model,
then again after ``kinject.optimize`` with a shipped rule file, checks that the greedy
tokens are identical, and prints the runtime report (tokens/s, bubbles, bytes moved).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

DEFAULT_RULES = "mixtral_offload.yaml"


def run_demo(rules: str | None = None, overrides: list[str] | None = None, *, batch: int = 8,
             new_tokens: int = 16, trace: str | None = None, plot: str | None = None) -> dict:
    import kinject
    from kinject.rules import resolve_rules_path
    from kinject.testing import build_tiny_model, tiny_batch, tiny_tokenizer

    rules_path = resolve_rules_path(rules or DEFAULT_RULES)
    model = build_tiny_model("mixtral")
    tok = tiny_tokenizer()
    inputs = tiny_batch(tok, batch, min_tokens=16)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    t0 = time.perf_counter()
    reference = model.generate(**inputs, **kw)
    t_ref = time.perf_counter() - t0

    kinject.optimize(model, rules_path, overrides)
    model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)  # learn order
    model.kinject.tracer.clear()
    model.kinject.store.reset_stats()
    t0 = time.perf_counter()
    out = model.generate(**inputs, **kw)
    t_opt = time.perf_counter() - t0

    same = torch.equal(out, reference)
    generated = batch * new_tokens
    print(f"kinject demo: tiny Mixtral ({sum(p.numel() for p in model.parameters()):,} params), "
          f"batch {batch}, {new_tokens} new tokens, rules {rules_path}")
    print(f"  untouched HF : {generated / t_ref:8.1f} tokens/s")
    print(f"  kinject      : {generated / t_opt:8.1f} tokens/s   greedy tokens identical: {'yes' if same else 'NO'}")
    model.kinject.report()
    if trace:
        model.kinject.tracer.to_chrome(trace)
        print(f"  trace written to {trace} (open in https://ui.perfetto.dev)")
    if plot:
        model.kinject.tracer.plot(plot, title=f"kinject demo: {Path(rules_path).name}")
        print(f"  pipeline plot written to {plot}")
    sample = tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    print(f"  sample continuation (random weights): {sample!r}")
    return {"identical": same, "tokens_per_s": generated / t_opt, "reference_tokens_per_s": generated / t_ref}
