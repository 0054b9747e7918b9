"""``kinject demo``: the built-in default job, offline, on CPU, in seconds.

Loads the built-in model (the trained tiny MoE fixture) twice — untouched with
transformers, and streamed into kinject's tiers with its Klotski rules — generates the
same prompts with both, checks that the greedy tokens are identical, prints the runtime
report (tokens/s, bubbles, bytes moved, prefetch precision) and draws the pipeline.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

def run_demo(rules: str | None = None, overrides: list[str] | None = None, *, batch: int = 8,
             new_tokens: int = 16, trace: str | None = None, plot: str | None = "kinject-demo.png") -> dict:
    import kinject
    from kinject.rules import resolve_rules_path
    from kinject.app.run import BUILTIN_PROMPTS, _load_tokenizer, default_model_path, default_rules
    from transformers import AutoModelForCausalLM

    model_dir = default_model_path()
    rules_path = resolve_rules_path(rules) if rules else default_rules(model_dir)
    tok = _load_tokenizer(model_dir)
    prompts = list(BUILTIN_PROMPTS)[:batch]
    inputs = tok(prompts, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=new_tokens, do_sample=False, pad_token_id=tok.pad_token_id)

    untouched = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    t0 = time.perf_counter()
    reference = untouched.generate(**inputs, **kw)
    t_ref = time.perf_counter() - t0

    model = kinject.from_pretrained(model_dir, rules_path, overrides, dtype=torch.float32, attn_implementation="eager")
    model.generate(**inputs, max_new_tokens=1, do_sample=False, pad_token_id=tok.pad_token_id)  # learn order
    model.kinject.tracer.clear()
    model.kinject.store.reset_stats()
    t0 = time.perf_counter()
    out = model.generate(**inputs, **kw)
    t_opt = time.perf_counter() - t0

    same = torch.equal(out, reference)
    generated = batch * new_tokens
    print(f"kinject demo: {model_dir.name} ({sum(p.numel() for p in untouched.parameters()):,} params), "
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
    print(f"  sample continuation: {sample!r}")
    model.kinject.transfer.close()
    return {"identical": same, "tokens_per_s": generated / t_opt, "reference_tokens_per_s": generated / t_ref}
