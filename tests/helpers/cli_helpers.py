"""Helpers shared by tests: running kinject's command line in a subprocess as a user would."""

import os
import subprocess
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
NEW = 8                                   # new tokens per prompt in the `kinject run` tests


def cli_without_matplotlib(args: list[str], cwd) -> subprocess.CompletedProcess:
    """``kinject ARGS`` in a fresh interpreter where ``import matplotlib`` fails, on this checkout's code."""
    code = f"import sys; sys.modules['matplotlib'] = None; from kinject.app.cli import main; sys.exit(main({args!r}))"
    # this checkout's kinject, whatever is installed; the caller's PYTHONPATH after it (e.g. another
    # transformers the suite runs against: the subprocess must see the same one)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=cwd, env=env)


def hf_reference(model_dir, prompts, group_size, new=NEW):
    """Plain transformers, no kinject: the same left-padded groups, greedy."""
    from transformers import AutoTokenizer

    from kinject.io.untouched import load_untouched

    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model = load_untouched(model_dir, torch.float32, attn_implementation="eager")
    out = []
    for i in range(0, len(prompts), group_size):
        enc = tok(prompts[i:i + group_size], return_tensors="pt", padding=True)
        gen = model.generate(**enc, max_new_tokens=new, do_sample=False, pad_token_id=tok.pad_token_id)
        out.extend(gen[:, enc["input_ids"].shape[1]:].tolist())
    return out


def trimmed(ids, eos):
    return ids[: ids.index(eos) + 1] if eos in ids else ids
