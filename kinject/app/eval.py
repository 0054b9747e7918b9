"""``kinject eval``: what a placement or quantization choice costs in quality, beside its bytes.

Perplexity over a text, computed by the optimized model itself (its forward runs through the very
operators ``generate`` uses), by the standard sliding-window method (the Hugging Face perplexity
guide's): windows of ``context`` tokens every ``stride`` tokens; each window scores only the tokens
no earlier window scored, each with as much left context as the window gives (at least
``context - stride`` tokens past the first window). Against a base -- the untouched transformers
model, or the same checkpoint under ``--base`` rules -- it also reports, per scored token, the KL
divergence ``KL(base || evaluated)`` of the next-token distributions (mean and 99th percentile, as
``llama-perplexity --kl-divergence``), the share of tokens whose top-1 prediction agrees, and the
perplexity ratio, also on each half of the scored tokens so a reader can tell noise from loss.
Top-1 agreement counts a token as agreeing when the two models' top tokens are the same, or, where
either one's logits tie exactly at their maximum, when the tied sets share a token: a bfloat16
model's logits carry 8 significant bits, so its top two tie exactly at some positions (2.1 % on the
built-in model), and which of them ``argmax`` returns is its index, not a prediction.
``top1_agreement_strict`` (argmax against argmax) and the share of the base's tied positions
(``base_top1_ties``) are reported beside it.
Cost: bytes moved from the host / disk tiers per model forward (one step) and the peak device bytes
of the store's accounting, for the evaluated setting (docs/architecture.md, "Stored formats").

The base and the evaluated model are run on the same windows one batch after the other, so both are
loaded at once; the built-in corpus (``--corpus builtin``) is the held-out part of the text the
built-in model was trained on (``kinject/fixtures/tiny_moe/heldout.json``). Task benchmarks:
lm-evaluation-harness drives the same model through :mod:`kinject.app.lm_eval_adapter`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kinject.errors import KinjectError

CONTEXT = 256            # the built-in model's training window
STRIDE = 128
BATCH = 8
MAX_TOKENS = 8192        # of the corpus, by default (the built-in one has 97 177)


@dataclass
class Window:
    begin: int           # first token of the window in the stream
    end: int             # one past its last token
    scored_from: int     # first stream position whose token this window scores (>= begin + 1)


def sliding_windows(n_tokens: int, context: int, stride: int) -> list[Window]:
    """The Hugging Face guide's windows over ``n_tokens``: every token from position 1 on is scored
    exactly once, by the first window that reaches it."""
    if context < 2 or not 0 < stride < context:
        raise KinjectError(f"eval: need context >= 2 and 0 < stride < context (a window's first token is its "
                           f"context), got context {context}, stride {stride}")
    if n_tokens < 2:
        raise KinjectError(f"eval: the text has {n_tokens} token(s); at least 2 are needed")
    out, prev_end = [], 0
    for begin in range(0, n_tokens, stride):
        end = min(begin + context, n_tokens)
        out.append(Window(begin, end, max(prev_end, begin + 1)))
        prev_end = end
        if end == n_tokens:
            break
    return out


def builtin_corpus() -> list[str]:
    """The built-in model's held-out texts (never trained on), in the order they were split off."""
    from kinject.fixtures import tiny_moe_path

    path = Path(tiny_moe_path()) / "heldout.json"
    return [f["text"] for f in json.loads(path.read_text())["files"]]


def token_stream(tokenizer, texts: list[str]) -> torch.Tensor:
    """``<s> text </s>`` for every text, concatenated (how the built-in model saw its corpus)."""
    ids: list[int] = []
    eos = tokenizer.eos_token_id
    for enc in tokenizer(texts, add_special_tokens=True)["input_ids"]:
        ids.extend(enc)
        if eos is not None:
            ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@dataclass
class Scores:
    """Per scored token: negative log-likelihood, and against a base its KL and top-1 agreement."""

    nll: list[torch.Tensor] = field(default_factory=list)
    base_nll: list[torch.Tensor] = field(default_factory=list)
    kl: list[torch.Tensor] = field(default_factory=list)
    agree: list[torch.Tensor] = field(default_factory=list)         # top tokens shared, ties counted either way
    agree_strict: list[torch.Tensor] = field(default_factory=list)  # argmax == argmax
    base_ties: list[torch.Tensor] = field(default_factory=list)     # the base's maximum reached by several tokens

    def add(self, logits: torch.Tensor, targets: torch.Tensor, base_logits: torch.Tensor | None) -> None:
        logp = torch.log_softmax(logits.float(), -1)
        self.nll.append(-logp.gather(-1, targets[:, None])[:, 0])
        if base_logits is not None:
            base = torch.log_softmax(base_logits.float(), -1)
            self.base_nll.append(-base.gather(-1, targets[:, None])[:, 0])
            self.kl.append((base.exp() * (base - logp)).sum(-1).clamp_min(0))
            self.agree_strict.append(logp.argmax(-1) == base.argmax(-1))
            mine, theirs = _top_set(logits), _top_set(base_logits)                         # [N, V] bool
            self.agree.append((mine & theirs).any(-1))
            self.base_ties.append(theirs.sum(-1) > 1)


def _top_set(logits: torch.Tensor) -> torch.Tensor:
    """Per row, the tokens whose logit equals the row's maximum (exactly, in the logits' own dtype)."""
    return logits == logits.max(-1, keepdim=True).values


def _ppl(nll: torch.Tensor) -> float:
    return math.exp(float(nll.double().mean()))


def summarize(scores: Scores) -> dict:
    nll = torch.cat(scores.nll)
    out = {"tokens_scored": int(nll.numel()), "perplexity": _ppl(nll), "nll": float(nll.double().mean())}
    half = nll.numel() // 2
    out["perplexity_halves"] = [_ppl(nll[:half]), _ppl(nll[half:])]
    if scores.kl:
        base, kl, agree = torch.cat(scores.base_nll), torch.cat(scores.kl), torch.cat(scores.agree)
        ratio = out["perplexity"] / _ppl(base)
        halves = [_ppl(nll[:half]) / _ppl(base[:half]), _ppl(nll[half:]) / _ppl(base[half:])]
        out.update(base_perplexity=_ppl(base), perplexity_ratio=ratio, perplexity_ratio_halves=halves,
                   ratio_spread=abs(halves[0] - halves[1]) / 2, kl_mean=float(kl.double().mean()),
                   kl_p99=float(torch.quantile(kl.double(), 0.99)), kl_max=float(kl.max()),
                   top1_agreement=float(agree.double().mean()),
                   top1_agreement_strict=float(torch.cat(scores.agree_strict).double().mean()),
                   base_top1_ties=float(torch.cat(scores.base_ties).double().mean()))
    return out


class Progress:
    """tqdm where installed, else rich, else a plain line on stderr."""

    def __init__(self, total: int, desc: str, enabled: bool = True):
        self.total, self.n, self.desc, self.enabled, self._bar, self._rich = total, 0, desc, enabled, None, None
        if not enabled:
            return
        try:
            from tqdm import tqdm

            self._bar = tqdm(total=total, desc=desc, unit="window", file=sys.stderr)
            return
        except ImportError:
            pass
        try:
            from rich.progress import Progress as RichProgress

            self._rich = RichProgress(transient=True)
            self._rich.start()
            self._task = self._rich.add_task(desc, total=total)
        except ImportError:
            self._rich = None

    def update(self, k: int) -> None:
        self.n += k
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(k)
        elif self._rich is not None:
            self._rich.update(self._task, advance=k)
        else:
            print(f"\r{self.desc}: {self.n}/{self.total} windows", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.close()
        elif self._rich is not None:
            self._rich.stop()
        else:
            print(file=sys.stderr)


def evaluate(model, stream: torch.Tensor, *, base=None, context: int = CONTEXT, stride: int = STRIDE,
             batch: int = BATCH, progress: bool = True) -> dict:
    """Perplexity of ``model`` over ``stream`` (and KL / agreement / ratio against ``base``), with the
    store's bytes per step and peak device bytes where ``model`` is optimized by kinject."""
    windows = sliding_windows(int(stream.numel()), context, stride)
    rt = getattr(model, "kinject", None)
    if rt is not None:
        rt.store.reset_stats()
        steps0 = rt.scheduler.step
    scores = Scores()
    bar = Progress(len(windows), "eval", progress)
    seconds = {"model": 0.0, "base": 0.0}
    i = 0
    with torch.no_grad():
        while i < len(windows):
            size = windows[i].end - windows[i].begin
            group = [windows[i]]
            while len(group) < batch and i + len(group) < len(windows) and \
                    windows[i + len(group)].end - windows[i + len(group)].begin == size:
                group.append(windows[i + len(group)])
            ids = torch.stack([stream[w.begin:w.end] for w in group])
            t0 = time.perf_counter()
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
            seconds["model"] += time.perf_counter() - t0
            base_logits = None
            if base is not None:
                t0 = time.perf_counter()
                base_logits = base(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
                seconds["base"] += time.perf_counter() - t0
            rows, targets, base_rows = [], [], []
            for j, w in enumerate(group):
                first = w.scored_from - w.begin - 1          # logits row predicting stream[w.scored_from]
                last = w.end - w.begin - 1
                rows.append(logits[j, first:last])
                targets.append(stream[w.scored_from:w.end])
                if base_logits is not None:
                    base_rows.append(base_logits[j, first:last])
            scores.add(torch.cat(rows), torch.cat(targets), torch.cat(base_rows) if base_rows else None)
            bar.update(len(group))
            i += len(group)
    bar.close()
    out = summarize(scores)
    out.update(context=context, stride=stride, windows=len(windows), batch=batch, seconds=seconds)
    if rt is not None:
        steps = max(rt.scheduler.step - steps0, 1)
        out.update(steps=steps, bytes_per_step=sum(rt.store.stats["bytes"].values()) / steps,
                   peak_device_bytes=int(rt.store.peak), stored_bytes=_stored_bytes(rt.store))
    return out


def _stored_bytes(store) -> dict:
    """Bytes the store's units hold, by tier (quantized units: their stored bytes)."""
    return {t: int(b) for t, b in store.summary()["tier_bytes"].items()}


def load_models(model_dir: Path, rules, sets: list[str], base_rules, base_sets: list[str], dtype):
    from kinject.io.untouched import load_untouched
    from kinject.pretrained import from_pretrained

    model = from_pretrained(model_dir, rules, sets, dtype=dtype)
    if base_rules is not None:
        base = from_pretrained(model_dir, base_rules, base_sets, dtype=dtype)
    else:
        base = load_untouched(model_dir, dtype)
    return model, base


def main(args) -> int:
    from transformers import AutoTokenizer

    from kinject.app.run import default_model_path, default_rules

    model_dir = Path(args.model) if args.model else default_model_path()
    rules = args.rules or default_rules(model_dir)
    if args.text and args.corpus:
        raise KinjectError("eval: give --text FILE or --corpus builtin, not both")
    if args.text:
        path = Path(args.text)
        if not path.is_file():
            raise KinjectError(f"eval: --text {args.text}: no such file")
        texts = [path.read_text(encoding="utf-8", errors="replace")]
        corpus = str(path)
    else:
        if args.model and args.corpus != "builtin":
            raise KinjectError("eval: --model DIR needs --text FILE (the built-in corpus is the built-in model's)")
        texts, corpus = builtin_corpus(), "builtin (tiny_moe held-out stdlib files)"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    stream = token_stream(tokenizer, texts)
    if args.max_tokens:
        stream = stream[:args.max_tokens]
    dtype = getattr(torch, args.dtype) if args.dtype else None
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    model, base = load_models(model_dir, rules, args.set, args.base, args.base_set, dtype)
    load_s = time.perf_counter() - t0
    try:
        result = evaluate(model, stream, base=base, context=args.context, stride=args.stride, batch=args.batch,
                          progress=not args.no_progress)
    finally:
        for m in (model, base):
            rt = getattr(m, "kinject", None)
            if rt is not None:
                rt.transfer.close()
    result.update(model=str(model_dir), rules=str(rules), set=list(args.set), corpus=corpus,
                  base=str(args.base) if args.base else "untouched transformers model", base_set=list(args.base_set),
                  dtype=str(next(iter(base.parameters())).dtype).removeprefix("torch."), load_seconds=load_s,
                  wall_seconds=time.perf_counter() - t0)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print(format_result(result))
    return 0


def format_result(r: dict) -> str:
    mib = 1 << 20
    lines = [f"model {r['model']}  rules {r['rules']}" + (f"  --set {' '.join(r['set'])}" if r["set"] else ""),
             (f"corpus {r['corpus']}: {r['tokens_scored']} tokens scored, sliding windows of {r['context']} tokens, "
              f"stride {r['stride']} ({r['windows']} windows)"),
             f"perplexity {r['perplexity']:.4f}  (halves {r['perplexity_halves'][0]:.4f} / {r['perplexity_halves'][1]:.4f})"]
    if "kl_mean" in r:
        lines += [f"base ({r['base']}): perplexity {r['base_perplexity']:.4f}",
                  (f"perplexity ratio {r['perplexity_ratio']:.4f}  (halves {r['perplexity_ratio_halves'][0]:.4f} / "
                   f"{r['perplexity_ratio_halves'][1]:.4f}, spread +-{r['ratio_spread']:.4f})"),
                  (f"KL(base || model) mean {r['kl_mean']:.5f}  p99 {r['kl_p99']:.5f} nats; top-1 agreement "
                   f"{r['top1_agreement']:.2%} (strict argmax {r['top1_agreement_strict']:.2%}; the base's top "
                   f"logits tie at {r['base_top1_ties']:.2%} of tokens)")]
    if "bytes_per_step" in r:
        lines.append(f"bytes per step {r['bytes_per_step'] / mib:.2f} MiB; peak device {r['peak_device_bytes'] / mib:.2f} MiB; "
                     "stored " + ", ".join(f"{t} {b / mib:.2f} MiB" for t, b in r["stored_bytes"].items()))
    lines.append(f"time: load {r['load_seconds']:.1f} s, model {r['seconds']['model']:.1f} s, base "
                 f"{r['seconds']['base']:.1f} s, wall {r['wall_seconds']:.1f} s")
    return "\n".join(lines)


def add_arguments(s) -> None:
    s.add_argument("--model", default=None, metavar="DIR", help="model directory (default: the built-in model)")
    s.add_argument("--rules", default=None, help="rule file of the evaluated setting (default: rules/klotski.yaml)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a rule-file key, e.g. 'vars.quant={format: fp8, block: [128, 128]}'")
    s.add_argument("--text", default=None, metavar="FILE", help="evaluate on this UTF-8 text")
    s.add_argument("--corpus", default=None, choices=("builtin",),
                   help="the built-in model's held-out corpus (the default without --text)")
    s.add_argument("--base", default=None, metavar="RULES",
                   help="base rule file to compare against (default: the untouched transformers model)")
    s.add_argument("--base-set", action="append", default=[], metavar="KEY=VALUE", help="override a key of --base")
    s.add_argument("--context", type=int, default=CONTEXT, help=f"tokens per window (default {CONTEXT})")
    s.add_argument("--stride", type=int, default=STRIDE, help=f"tokens between window starts (default {STRIDE})")
    s.add_argument("--batch", type=int, default=BATCH, help=f"windows per forward (default {BATCH})")
    s.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help=f"evaluate the first N tokens of the text (default {MAX_TOKENS}; 0: all)")
    s.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"),
                   help="compute dtype (default: the checkpoint's)")
    s.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    s.add_argument("--json", action="store_true", help="print the result as JSON")
    s.add_argument("--no-progress", action="store_true", help="no progress bar")


__all__ = [
    "Window",
    "add_arguments",
    "builtin_corpus",
    "evaluate",
    "main",
    "sliding_windows",
    "summarize",
    "token_stream",
]
