"""Every scanned MoE family through kinject's KV cache: greedy tokens vs the untouched model.

For each family of :func:`kinject.families.moe_families` (tiny seeded model): attention and every
token mixer -> OffloadedAttention (KV in ``--tier``), router -> PrefetchGate, experts ->
GroupedExperts (both optional: families whose names differ keep theirs); 6 ragged prompts, micro-
batches of 2 (n_batches 3), 6 new tokens. Where the experts / router replacement fails (layouts
GroupedExperts does not read yet), the family is re-run with the attention rule only. One line per
family: its cache-layer kinds, the outcome and the operators that ran.

    python -m examples.kv_every_family --tier host [family ...]
"""

from __future__ import annotations

import argparse
import tempfile

import torch

import kinject
from kinject.families import build_tiny_family_model, moe_families
from kinject.testing import tiny_batch, tiny_tokenizer

MIXERS = r"(Attention|MLA|GatedDeltaNet|MambaLayer|Mamba2?Mixer|ShortConv)$"


def rules(tier: str, full: bool, offload_dir: str) -> dict:
    out = [{"match": {"class_name": MIXERS},
            "replace": {"class": "operators.attention.OffloadedAttention", "kwargs": {"kv_cache": tier}}}]
    if full:
        out += [{"match": {"name": r"^model\.layers\.\d+\.\w+\.(gate|router)$"},
                 "replace": {"class": "operators.gate.PrefetchGate"}, "optional": True},
                {"match": {"name": r"^model\.layers\.\d+\.\w+\.experts$"},
                 "replace": {"class": "operators.experts.GroupedExperts"}, "optional": True}]
    return {"pipeline": {"micro_batch_size": 2, "n_batches": 3, "offload_dir": offload_dir}, "rules": out}


def run(family: str, tier: str, batch: dict, tok, offload_dir: str) -> str:
    model = build_tiny_family_model(family)
    gen = dict(max_new_tokens=6, do_sample=False, pad_token_id=tok.pad_token_id)
    ref = model.generate(**batch, **gen)
    outcomes, kinds = [], None
    for full in (True, False):
        try:
            kinject.optimize(model, rules(tier, full, offload_dir))
        except Exception as exc:  # noqa: BLE001 - reported
            outcomes.append(f"{'full' if full else 'attention'}: {type(exc).__name__}: {str(exc)[:120]}")
            continue
        try:
            ops: dict[str, int] = {}
            for op in model.kinject.operators:
                ops[type(op).__name__] = ops.get(type(op).__name__, 0) + 1
            out = model.generate(**batch, **gen, return_dict_in_generate=True)
            cache = out.past_key_values
            kinds = cache.kinds() if hasattr(cache, "kinds") else f"its own {type(cache).__name__}"
            same = "identical" if torch.equal(out.sequences, ref) else "DIFFERENT"
            outcomes.append(f"{'full' if full else 'attention'}: {same} {ops}")
            if same == "identical":
                break
        except Exception as exc:  # noqa: BLE001 - reported
            outcomes.append(f"{'full' if full else 'attention'}: {type(exc).__name__}: {str(exc)[:120]}")
        finally:
            kinject.restore(model)
    return f"{family} {kinds} " + " | ".join(outcomes)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*")
    ap.add_argument("--tier", default="host", choices=["device", "host", "disk"])
    args = ap.parse_args()
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 6, min_tokens=8)
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.families or moe_families():
            print(run(family, args.tier, batch, tok, tmp), flush=True)


if __name__ == "__main__":
    main()
