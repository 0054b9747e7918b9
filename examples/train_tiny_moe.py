#!/usr/bin/env python
"""Train the small Mixtral committed as ``kinject/fixtures/tiny_moe``.

Random-weight MoE models route almost uniformly, which hides what kinject's expert prefetcher
does. This script trains a small Mixtral (6 MoE layers, 8 experts, top-2, ~11.7 M parameters) on
the Python standard library's own sources, offline and on a CPU, so that its routing is skewed and
correlated across layers the way trained MoE models are.

Everything is local and deterministic except the wall-clock budget:

* **Corpus.** The ``*.py`` files under ``sysconfig.get_paths()["stdlib"]`` (site-packages, test
  suites, codec tables, ``pydoc_data`` and the build config excluded), sorted by relative path.
  Every ``HOLDOUT_EVERY``-th file is held out (validation loss, routing measurements); the rest
  is training text. The corpus is that of the running interpreter, so its SHA-256 is recorded.
* **Tokenizer.** A byte-level BPE (``--vocab`` tokens, default 4096) trained with ``tokenizers`` on
  the training files; special tokens ``<pad> <s> </s> <unk>`` are ids 0..3 as in
  :func:`kinject.testing.tiny_tokenizer`, and ``<s>`` is prepended on encode.
* **Training.** AdamW (lr ``--lr`` with linear warm-up and a cosine decay to 10 %), random windows
  of ``--seq-len`` tokens from the concatenated training stream (``<s> file </s>`` per file),
  cross-entropy plus the Mixtral load-balancing loss applied *per MoE layer* with a light
  coefficient (``--aux-coef``; see :func:`per_layer_aux_loss`).
* **Budget.** ``--minutes`` is a hard wall-clock budget for the whole run, counted from the start
  of the script: training stops early enough to evaluate and save within it. Without ``--steps``
  the cosine schedule follows the elapsed fraction of the budget (the result then depends on the
  machine's speed); with ``--steps N`` it follows the step count and, given the same interpreter
  and library versions and enough time, the run is reproducible.

Output (``--out``, default ``kinject/fixtures/tiny_moe``): ``model.safetensors`` (bfloat16,
transformers 5 fused-expert layout), ``config.json``, ``generation_config.json``, the tokenizer
files and ``training.json`` (command, versions, corpus hash, loss curve, wall time). Measure the
routing with ``examples/routing_skew.py`` afterwards.

    python examples/train_tiny_moe.py --minutes 20
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import math
import platform
import shutil
import sys
import sysconfig
import time
from pathlib import Path

import torch

log = logging.getLogger("train_tiny_moe")

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "kinject" / "fixtures" / "tiny_moe"

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
# Directories (any path component) left out of the corpus: installed packages, test suites
# (binary-ish data, huge generated cases), codec tables (hex dumps), pydoc's topic dump, demos.
EXCLUDED_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "encodings",
                           "pydoc_data", "__phello__", "turtledemo", "__pycache__"})
MAX_FILE_BYTES = 400_000
HOLDOUT_EVERY = 20      # file i is held out when i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1


# ------------------------------------------------------------------------------------------------
# corpus and tokenizer
# ------------------------------------------------------------------------------------------------


def stdlib_files() -> list[tuple[str, str]]:
    """``(relative path, text)`` of the corpus files, sorted by relative POSIX path."""
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES or path.stat().st_size == 0:
            continue
        out.append((rel.as_posix(), path.read_text(encoding="utf-8", errors="replace")))
    out.sort(key=lambda item: item[0])
    return out


def split_corpus(files: list[tuple[str, str]]) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """``(train, heldout)``: every ``HOLDOUT_EVERY``-th file (sorted order) is held out."""
    train = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY != HOLDOUT_EVERY - 1]
    heldout = [f for i, f in enumerate(files) if i % HOLDOUT_EVERY == HOLDOUT_EVERY - 1]
    return train, heldout


def corpus_sha256(files: list[tuple[str, str]]) -> str:
    h = hashlib.sha256()
    for rel, text in files:
        h.update(rel.encode())
        h.update(b"\0")
        h.update(text.encode("utf-8", errors="replace"))
        h.update(b"\0")
    return h.hexdigest()


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``texts`` (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [SPECIAL_TOKENS[k] for k in ("pad_token", "bos_token", "eos_token", "unk_token")]  # ids 0..3
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator(texts, trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))])
    return PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left",
                                   model_max_length=model_max_length, **SPECIAL_TOKENS)


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """``<s> text </s>`` for every text, concatenated: LongTensor [N]."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer(texts, add_special_tokens=True)["input_ids"]:
        ids.extend(enc)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


def fixed_windows(stream: torch.Tensor, seq_len: int, n: int) -> torch.Tensor:
    """``n`` evenly spaced, non-overlapping windows of ``seq_len`` tokens: LongTensor [n', seq_len]."""
    total = stream.numel() // seq_len
    if total == 0:
        raise ValueError(f"stream of {stream.numel()} tokens is shorter than one window of {seq_len}")
    idx = torch.linspace(0, total - 1, steps=min(n, total)).round().long().unique()
    return torch.stack([stream[i * seq_len:(i + 1) * seq_len] for i in idx.tolist()])


# ------------------------------------------------------------------------------------------------
# model and loss
# ------------------------------------------------------------------------------------------------


def build_config(tokenizer, args):
    from transformers import MixtralConfig

    return MixtralConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // args.head_dim,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        num_local_experts=args.experts,
        num_experts_per_tok=args.top_k,
        max_position_embeddings=args.max_positions,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        router_aux_loss_coef=args.aux_coef,
        output_router_logits=False,
        initializer_range=0.02,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )


def per_layer_aux_loss(router_logits, num_experts: int, top_k: int) -> torch.Tensor:
    """Mean over MoE layers of Mixtral's load-balancing loss, each layer on its own.

    ``transformers``' :func:`load_balancing_loss_func` sums the token fractions and router
    probabilities over *all* layers before multiplying them, so a layer that sends every token to
    expert 0 is not penalised while another layer favours expert 1. Calling it once per layer keeps
    every layer's experts alive (the point here) while a light coefficient leaves room for skew.
    Balanced routing gives ``top_k``; a collapsed layer gives up to ``num_experts``.
    """
    from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

    losses = [load_balancing_loss_func((logits,), num_experts, top_k) for logits in router_logits]
    return torch.stack(losses).mean()


def routing_shares(router_logits, top_k: int, num_experts: int) -> torch.Tensor:
    """Share of token-expert assignments per expert, per layer: FloatTensor [layers, E]."""
    rows = []
    for logits in router_logits:
        idx = logits.float().topk(top_k, dim=-1).indices.flatten()
        rows.append(torch.bincount(idx, minlength=num_experts).float() / idx.numel())
    return torch.stack(rows)


@torch.no_grad()
def evaluate(model, windows: torch.Tensor, batch: int) -> float:
    """Mean next-token cross-entropy (nats) over ``windows`` [n, T]."""
    model.eval()
    total, count = 0.0, 0
    for i in range(0, windows.shape[0], batch):
        x = windows[i:i + batch]
        out = model(input_ids=x, labels=x, output_router_logits=False)
        n = x.numel() - x.shape[0]
        total += float(out.loss) * n
        count += n
    model.train()
    return total / count


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory (replaced)")
    p.add_argument("--minutes", type=float, default=20.0, help="hard wall-clock budget of the whole run")
    p.add_argument("--reserve-s", type=float, default=30.0, help="part of the budget kept for the final eval and save")
    p.add_argument("--steps", type=int, default=None, help="schedule by steps (reproducible) instead of by time")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (on a 2-core machine shared with other jobs, 1 measured ~1.6x faster than 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--max-positions", type=int, default=1024)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--min-lr-ratio", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=40, help="warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.05)
    p.add_argument("--aux-coef", type=float, default=0.005, help="per-layer load-balancing loss coefficient")
    p.add_argument("--log-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=32)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16", help="dtype of the saved weights")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    t0 = time.monotonic()
    deadline = t0 + args.minutes * 60.0 - args.reserve_s
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    from transformers import MixtralForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()

    # ---- corpus, tokenizer, token streams
    files = stdlib_files()
    train_files, heldout_files = split_corpus(files)
    sha = corpus_sha256(files)
    log.info("corpus: %d stdlib files (%.1f MB), %d train / %d held out, sha256 %s", len(files),
             sum(len(t) for _, t in files) / 1e6, len(train_files), len(heldout_files), sha[:16])
    tokenizer = train_tokenizer([t for _, t in train_files], args.vocab, args.max_positions)
    train_stream = token_stream(tokenizer, [t for _, t in train_files])
    heldout_stream = token_stream(tokenizer, [t for _, t in heldout_files])
    val = fixed_windows(heldout_stream, args.seq_len, args.eval_windows)
    log.info("tokenizer: %d tokens; train stream %d tokens (%.2f chars/token), held-out %d tokens; "
             "setup %.1fs", len(tokenizer), train_stream.numel(),
             sum(len(t) for _, t in train_files) / train_stream.numel(), heldout_stream.numel(), time.monotonic() - t0)

    # ---- model
    config = build_config(tokenizer, args)
    model = MixtralForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    model.router_aux_loss_coef = 0.0   # the aux loss is added per layer below, not by HF's forward
    model.train()
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    log.info("model: %d layers, hidden %d, %d experts x intermediate %d, top-%d: %.2fM parameters (%.2fM in experts)",
             args.layers, args.hidden, args.experts, args.intermediate, args.top_k, n_params / 1e6, n_expert / 1e6)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    gen = torch.Generator().manual_seed(args.seed + 1)
    max_start = train_stream.numel() - args.seq_len
    train_t0 = time.monotonic()

    def progress(step: int) -> float:
        if args.steps:
            return step / args.steps
        return (time.monotonic() - train_t0) / max(deadline - train_t0, 1e-9)

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        frac = min(max(progress(step), 0.0), 1.0)
        return args.lr * (args.min_lr_ratio + (1 - args.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))

    curve: list[dict] = []
    evals: list[dict] = []
    step, tokens, ce_acc, aux_acc, n_acc = 0, 0, 0.0, 0.0, 0
    stop_reason = "steps"
    window_t = time.monotonic()
    while args.steps is None or step < args.steps:
        if time.monotonic() >= deadline:
            stop_reason = "time budget"
            break
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        starts = torch.randint(0, max_start + 1, (args.batch,), generator=gen)
        x = torch.stack([train_stream[s:s + args.seq_len] for s in starts.tolist()])    # [B, T]
        out = model(input_ids=x, labels=x, output_router_logits=True)
        aux = per_layer_aux_loss(out.router_logits, args.experts, args.top_k)
        loss = out.loss + args.aux_coef * aux
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        ce_acc += out.loss.item()
        aux_acc += aux.item()
        n_acc += 1
        if step % args.log_every == 0:
            shares = routing_shares(out.router_logits, args.top_k, args.experts)           # [L, E]
            top2 = shares.sort(dim=-1, descending=True).values[:, :2].sum(-1)
            now = time.monotonic()
            rate = args.log_every * x.numel() / (now - window_t)
            window_t = now
            entry = {"step": step, "tokens": tokens, "elapsed_s": round(now - t0, 1), "loss": round(ce_acc / n_acc, 4),
                     "aux": round(aux_acc / n_acc, 4), "lr": lr_at(step - 1)}
            curve.append(entry)
            log.info("step %5d  tokens %8d  loss %.4f  aux %.3f  lr %.2e  %5.0f tok/s  %5.0fs  "
                     "top-2 share/layer %s  min expert share %.3f", step, tokens, entry["loss"], entry["aux"],
                     entry["lr"], rate, now - t0, " ".join(f"{v:.2f}" for v in top2.tolist()), float(shares.min()))
            ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
        if step % args.eval_every == 0:
            v = evaluate(model, val, args.batch)
            evals.append({"step": step, "tokens": tokens, "val_loss": round(v, 4)})
            log.info("step %5d  held-out loss %.4f (ppl %.1f)", step, v, math.exp(v))
            window_t = time.monotonic()
    train_s = time.monotonic() - train_t0
    final_val = evaluate(model, val, args.batch)
    evals.append({"step": step, "tokens": tokens, "val_loss": round(final_val, 4)})
    log.info("stopped (%s) after %d steps, %d tokens, %.0fs of training; held-out loss %.4f (ppl %.1f, "
             "uniform would be %.2f)", stop_reason, step, tokens, train_s, final_val, math.exp(final_val),
             math.log(len(tokenizer)))

    # ---- save
    out_dir = args.out.resolve()
    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    model.eval()
    model.router_aux_loss_coef = args.aux_coef
    model.to(getattr(torch, args.dtype))
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.generation_config, attr, getattr(tokenizer, attr))
    model.generation_config.do_sample = False
    model.generation_config.max_new_tokens = 64
    model.save_pretrained(out_dir, save_original_format=False)   # fused experts: gate_up_proj [E, 2I, H], down_proj [E, H, I]
    tokenizer.save_pretrained(out_dir)
    wall = time.monotonic() - t0
    meta = {
        "command": "python examples/train_tiny_moe.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "versions": {"python": platform.python_version(), "torch": torch.__version__,
                     "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__},
        "corpus": {"stdlib": sysconfig.get_paths()["stdlib"], "files": len(files), "train_files": len(train_files),
                   "heldout_files": len(heldout_files), "sha256": sha, "train_tokens": int(train_stream.numel()),
                   "heldout_tokens": int(heldout_stream.numel()), "excluded_dirs": sorted(EXCLUDED_DIRS),
                   "holdout_every": HOLDOUT_EVERY, "max_file_bytes": MAX_FILE_BYTES},
        "parameters": n_params,
        "expert_parameters": n_expert,
        "steps": step,
        "tokens_seen": tokens,
        "stop_reason": stop_reason,
        "train_seconds": round(train_s, 1),
        "wall_seconds": round(wall, 1),
        "final_heldout_loss": round(final_val, 4),
        "uniform_loss": round(math.log(len(tokenizer)), 4),
        "curve": curve,
        "evals": evals,
    }
    (out_dir / "training.json").write_text(json.dumps(meta, indent=1) + "\n")
    size = sum(f.stat().st_size for f in out_dir.glob("*.safetensors"))
    log.info("saved %s (%s, %.1f MB of safetensors) in %.0fs wall", out_dir, args.dtype, size / 1e6, wall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
