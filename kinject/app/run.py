"""``kinject run``: an offline batch job — prompts in, completions out, resumable.

    kinject run --model PATH --rules RULES --prompts prompts.jsonl --out out.jsonl

* Prompts: JSONL (``{"id": ..., "prompt": ...}``, or OpenAI-style ``{"id": ..., "messages": [...]}``
  rendered by the tokenizer's chat template, :mod:`kinject.app.chat`; ``id`` optional, defaults to the
  line number) or plain text (one prompt per line, blank lines skipped; ``id`` = line number).
* Batching: prompts are cut into **fixed groups** of ``n * bs`` by their position in the
  prompt file (``pipeline.n_batches`` x ``pipeline.micro_batch_size``; ``bs`` unset = 8,
  ``n_batches: auto`` = the planner's ``n`` when it has a profile, else 1 with a warning),
  one ``model.generate`` call per group.
* Output: one JSON line per prompt (``id``, ``prompt``, ``completion``, ``new_tokens``,
  ``finish_reason``, ``completion_ids``), appended when its whole group is finished, flushed
  and fsync'ed. A group is written whole or not at all: SIGINT/SIGTERM abort the running
  group (the write of a finished one is never cut), keep everything written and exit non-zero.
* Resume: re-running the same command skips every prompt whose id is already in the output.
  Groups are fixed by position, so a resumed run computes exactly the batches an
  uninterrupted one would have (same padding, same greedy tokens).
* With no ``--model``: the built-in default model (``kinject.fixtures.tiny_moe_path()`` when
  that module exists, else the tiny random Mixtral of :mod:`kinject.testing`, saved once to
  the cache and loaded with :func:`kinject.from_pretrained`) and built-in prompts. With no
  ``--rules``: the shipped family-agnostic ``rules/klotski.yaml``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kinject.errors import KinjectError
from kinject.formatting import format_bytes, format_duration
from kinject.paths import cache_dir
from kinject.plan.groups import GroupPlan, plan_groups

logger = logging.getLogger(__name__)

DEFAULT_NEW_TOKENS = 32

#: Built-in prompts of the default job (short, Python-ish).
BUILTIN_PROMPTS: tuple[str, ...] = (
    "def fibonacci(n):",
    "import torch\nimport torch.nn as nn\n\nclass",
    "for i in range(10):\n    print(",
    "# Mixture of experts models route every token to",
    "def load_config(path):\n    with open(path) as f:",
    "class Expert(nn.Module):\n    def __init__(self, hidden_size):",
    "The router looks at the hidden state and",
    "if __name__ == \"__main__\":",
    "def forward(self, x):\n    return",
    "weights = {name: tensor for name, tensor in",
    "# Hot experts are loaded first and",
    "try:\n    import numpy as np\nexcept ImportError:",
)


class RunInterrupted(KinjectError):
    """SIGINT/SIGTERM stopped the job; everything finished is written. ``exit_code``: 128 + signal."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class StopRequested(BaseException):
    """Raised by the signal handler (a BaseException: no ``except Exception`` swallows it)."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


# ============================================================================ prompts


@dataclass(frozen=True)
class Prompt:
    id: Any            # str or int, as given (or the 1-based line number)
    prompt: str        # a chat line's: its rendered text (render_chat_prompts), "" until then
    line: int          # 1-based line in the prompt file (0: built-in)
    messages: list | None = field(default=None, compare=False, hash=False)   # a chat line's messages

    @property
    def key(self) -> str:
        return id_key(self.id)


def id_key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def builtin_prompts() -> list[Prompt]:
    return [Prompt(i + 1, p, 0) for i, p in enumerate(BUILTIN_PROMPTS)]


def read_prompts(path: str | Path, fmt: str = "auto") -> list[Prompt]:
    """Prompts of ``path``: ``fmt`` is ``jsonl``, ``text`` or ``auto`` (by extension, else by
    whether the first non-blank line is a JSON object). Errors name the file and line."""
    path = Path(path).expanduser()
    return check_prompts(path, parse_prompts(path, read_input_text(path, "prompts file").splitlines(), fmt))


def read_input_text(path: Path, what: str) -> str:
    """The UTF-8 text of an input file; a missing, unreadable or non-UTF-8 file is one line naming
    ``what`` and ``path`` (``kinject run``'s prompts, ``kinject run-batch``'s requests)."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise KinjectError(f"{what} not found: {path}") from None
    except IsADirectoryError:
        raise KinjectError(f"{what} is a directory: {path}") from None
    except UnicodeDecodeError as exc:
        raise KinjectError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise KinjectError(f"cannot read {what} {path}: {exc.strerror}") from None


def parse_prompts(path: Path, lines: list[str], fmt: str = "auto") -> list[Prompt]:
    """The prompts of ``lines`` (the text of ``path``, which errors name) in ``fmt`` (``jsonl``,
    ``text``, or ``auto``: :func:`read_prompts` says how it is told)."""
    if fmt == "auto":
        fmt = _sniff_format(path, lines)
    return _parse_jsonl(path, lines) if fmt == "jsonl" else _parse_text(lines)


def check_prompts(path, prompts: list[Prompt]) -> list[Prompt]:
    """``prompts`` if there are any and no id repeats; else the error naming file and line."""
    if not prompts:
        raise KinjectError(f"{path}: no prompts")
    seen: dict[str, int] = {}
    for p in prompts:
        if p.key in seen:
            raise KinjectError(f"{path}:{p.line}: duplicate id {p.id!r} (first on line {seen[p.key]})")
        seen[p.key] = p.line
    return prompts


def pending_groups(prompts: list[Prompt], size: int, done: set[str]) -> list[tuple[int, list[Prompt]]]:
    """``(group index, prompts not yet done)`` per group of ``size`` prompts by position, empty ones
    dropped: fixed by position, so a resumed (or distributed) run computes exactly the batches an
    uninterrupted one would have."""
    groups = [(gi, [p for p in prompts[i:i + size] if p.key not in done])
              for gi, i in enumerate(range(0, len(prompts), size))]
    return [(gi, g) for gi, g in groups if g]


def generation_kwargs(cfg: "RunConfig", pad_token_id: int | None) -> dict[str, Any]:
    """``generate`` arguments of the job (greedy unless ``do_sample``)."""
    kw: dict[str, Any] = dict(max_new_tokens=cfg.max_new_tokens, do_sample=cfg.do_sample, pad_token_id=pad_token_id)
    if cfg.do_sample:
        kw.update({k: v for k, v in (("temperature", cfg.temperature), ("top_p", cfg.top_p)) if v is not None})
    else:   # a sampling generation_config must not leak temperature/top_p warnings into greedy runs
        kw.update(temperature=None, top_p=None, top_k=None)
    return kw


def _sniff_format(path: Path, lines: list[str]) -> str:
    suffix = path.suffix.lower()
    if suffix in (".jsonl", ".ndjson", ".json"):
        return "jsonl"
    if suffix == ".txt":
        return "text"
    first = next((ln for ln in lines if ln.strip()), "")
    try:
        return "jsonl" if isinstance(json.loads(first), dict) else "text"
    except ValueError:
        return "text"


def _parse_text(lines: list[str]) -> list[Prompt]:
    return [Prompt(i, ln, i) for i, ln in enumerate(lines, 1) if ln.strip()]


def _parse_jsonl(path: Path, lines: list[str]) -> list[Prompt]:
    out = []
    for i, ln in enumerate(lines, 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except ValueError as exc:
            raise KinjectError(f"{path}:{i}: malformed JSON line ({exc})") from None
        if not isinstance(rec, dict):
            raise KinjectError(f"{path}:{i}: expected a JSON object like {{\"id\": ..., \"prompt\": ...}}, "
                               f"got {type(rec).__name__}")
        if "prompt" not in rec and "messages" not in rec:
            raise KinjectError(f"{path}:{i}: no 'prompt' key, nor 'messages' (keys: {', '.join(sorted(rec)) or 'none'})")
        if "prompt" in rec and "messages" in rec:
            raise KinjectError(f"{path}:{i}: both 'prompt' and 'messages': give one")
        messages = None
        if "messages" in rec:
            from kinject.app.chat import MessagesError, check_messages

            try:
                messages = check_messages(rec["messages"])
            except MessagesError as exc:
                raise KinjectError(f"{path}:{i}: {exc}") from None
            prompt = ""
        else:
            prompt = rec["prompt"]
            if not isinstance(prompt, str) or not prompt:
                raise KinjectError(f"{path}:{i}: 'prompt' must be a non-empty string, got {prompt!r}")
        pid = rec.get("id", i)
        if isinstance(pid, bool) or not isinstance(pid, (str, int)):
            raise KinjectError(f"{path}:{i}: 'id' must be a string or an integer, got {pid!r}")
        out.append(Prompt(pid, prompt, i, messages))
    return out


def render_chat_prompts(prompts: list[Prompt], tok, model_name: str) -> list[Prompt]:
    """``prompts`` with every chat line's text rendered by ``tok``'s chat template (add_generation_prompt);
    a model without one is an error naming the model and the first chat line."""
    from dataclasses import replace

    from kinject.app.chat import ChatTemplateError, render_chat

    out = []
    for p in prompts:
        if p.messages is not None:
            try:
                p = replace(p, prompt=render_chat(tok, p.messages, model_name))
            except ChatTemplateError as exc:
                raise KinjectError(f"line {p.line} (id {p.id!r}): {exc}") from None
        out.append(p)
    return out


# ============================================================================ output file


def done_ids(out: Path, key: str = "id") -> set[str]:
    """Ids (the ``key`` field: ``custom_id`` in a Batch output) already in the output (as :func:`id_key`).
    A torn last line (no newline, not JSON:
    a write cut by a hard kill) is dropped from the file with a warning."""
    if not out.is_file():
        return set()
    data = out.read_bytes()
    if data and not data.endswith(b"\n"):
        cut = data.rfind(b"\n") + 1
        tail = data[cut:]
        try:
            json.loads(tail)
            data += b"\n"
            with open(out, "ab") as f:
                f.write(b"\n")
        except ValueError:
            logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted write", out, len(tail))
            os.truncate(out, cut)
            data = data[:cut]
    keys = set()
    for i, ln in enumerate(data.decode("utf-8", errors="replace").splitlines(), 1):
        if not ln.strip():
            continue
        try:
            rec = json.loads(ln)
        except ValueError as exc:
            raise KinjectError(f"{out}:{i}: output file has a malformed line ({exc}); "
                               "fix or remove it, or pick another --out") from None
        if not isinstance(rec, dict) or key not in rec:
            raise KinjectError(f"{out}:{i}: output line without an '{key}' (is this a kinject run output?)")
        keys.add(id_key(rec[key]))
    return keys


def open_output(out: Path) -> int:
    """Create the output's folder and open it for appending: fails early, before any model load."""
    if out.is_dir():
        raise KinjectError(f"cannot write output {out}: is a directory")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return os.open(out, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    except OSError as exc:
        raise KinjectError(f"cannot write output {out}: {exc.strerror or exc}") from None


@contextlib.contextmanager
def output_file(out: Path):
    """A job's output, opened for appending (:func:`open_output`) for the job's life: closed at the
    end, and removed when the job is refused (a :class:`KinjectError`) before it wrote a byte to a file
    it created, so a refused job leaves no trace."""
    created = not out.exists()
    fd = open_output(out)
    try:
        yield fd
    except KinjectError:
        if created and out.is_file() and out.stat().st_size == 0:
            out.unlink()
        raise
    finally:
        os.close(fd)


def _check_writable_dir(path: str | None, what: str) -> None:
    if not path:
        return
    p = Path(path).expanduser()
    if p.is_dir():
        raise KinjectError(f"cannot write {what} {p}: is a directory")
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise KinjectError(f"cannot write {what} {p}: {exc.strerror or exc}") from None
    if not os.access(p.parent, os.W_OK):
        raise KinjectError(f"cannot write {what} {p}: folder not writable")


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
    os.fsync(fd)


# ============================================================================ model and rules


def default_model_path() -> Path:
    """The built-in model: ``kinject.fixtures.tiny_moe_path()`` when that module exists, else
    the tiny random Mixtral of :mod:`kinject.testing`, saved once under the cache."""
    if importlib.util.find_spec("kinject.fixtures") is not None:
        try:
            from kinject.fixtures import tiny_moe_path

            return Path(tiny_moe_path())
        except Exception as exc:  # noqa: BLE001 - a broken fixture must not break the default job
            logger.warning("kinject.fixtures.tiny_moe_path() failed (%s: %s); using the tiny random Mixtral",
                           type(exc).__name__, exc)
    return tiny_mixtral_path()


def tiny_mixtral_path() -> Path:
    """``kinject.testing``'s tiny Mixtral (seed 0) saved under the cache; built on first use.

    Keyed by the torch and transformers versions (their init decides the weights). Written to a
    temporary folder and renamed, so concurrent first runs never see half a checkpoint."""
    import torch
    import transformers

    from kinject.testing import save_tiny_model

    name = f"tiny-mixtral-s0-tf{transformers.__version__}-torch{torch.__version__.split('+')[0]}"
    final = cache_dir() / name
    marker = final / ".kinject-complete"
    if marker.is_file():
        return final
    tmp = final.with_name(f"{name}.tmp{os.getpid()}")
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        logger.info("building the built-in tiny Mixtral in %s (once)", final)
        save_tiny_model("mixtral", tmp)
        (tmp / ".kinject-complete").touch()
        if final.exists() and not marker.is_file():     # a broken leftover
            shutil.rmtree(final, ignore_errors=True)
        try:
            os.rename(tmp, final)
        except OSError:
            if not marker.is_file():
                raise
    except OSError as exc:
        raise KinjectError(f"cannot write the built-in model to {final}: {exc.strerror or exc} "
                           "(set KINJECT_CACHE to a writable folder)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def model_type(model_dir: Path) -> str:
    from kinject.io.gguf import MOE_FAMILIES, open_gguf

    gguf = open_gguf(model_dir)                 # a .gguf file, its directory or first shard: its metadata
    if gguf is not None:
        return MOE_FAMILIES.get(gguf.arch, gguf.arch)
    cfg = model_dir / "config.json"
    if not cfg.is_file():
        raise KinjectError(f"{model_dir}: no config.json (expected a Hugging Face model directory)")
    try:
        return str(json.loads(cfg.read_text()).get("model_type", ""))
    except ValueError as exc:
        raise KinjectError(f"{cfg}: not valid JSON ({exc})") from None


def default_rules(model_dir: Path) -> Path:
    """The shipped family-agnostic ``rules/klotski.yaml`` (any MoE family; ``model_dir`` is
    read only to fail early on a directory that is not a model)."""
    from kinject.rules import builtin_rules_dir

    model_type(model_dir)
    return builtin_rules_dir() / "klotski.yaml"


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    from kinject.io.gguf import open_gguf

    try:
        gguf = open_gguf(model_dir)             # a GGUF model carries its tokenizer in its metadata
        tok = gguf.tokenizer() if gguf is not None else AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as exc:
        raise KinjectError(f"{model_dir}: cannot load a tokenizer ({str(exc).splitlines()[0]})") from None
    tok.padding_side = "left"           # decoder-only generation
    if tok.pad_token_id is None:
        if tok.eos_token_id is None:
            raise KinjectError(f"{model_dir}: the tokenizer has neither a pad nor an eos token")
        tok.pad_token = tok.eos_token
    return tok


# ============================================================================ plan


# ============================================================================ progress and signals


class Progress:
    """tqdm on a terminal when installed, else one log line per group; tokens/s and ETA."""

    def __init__(self, total: int, enabled: bool = True):
        self.total, self.done, self.tokens, self.gen_s = total, 0, 0, 0.0
        self.t0 = time.perf_counter()
        self.bar = None
        self.enabled = enabled
        if enabled and sys.stderr.isatty() and importlib.util.find_spec("tqdm") is not None:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=total, unit="prompt", desc="kinject run", file=sys.stderr, dynamic_ncols=True)

    def update(self, prompts: int, tokens: int, gen_s: float) -> None:
        self.done += prompts
        self.tokens += tokens
        self.gen_s += gen_s
        tps = self.tokens / self.gen_s if self.gen_s else 0.0
        if self.bar is not None:
            self.bar.set_postfix_str(f"{tps:.1f} tok/s", refresh=False)
            self.bar.update(prompts)
        elif self.enabled:
            wall = time.perf_counter() - self.t0
            eta = wall / self.done * (self.total - self.done) if self.done else 0.0
            logger.info("kinject run: %d/%d prompts, %d tokens, %.1f tokens/s, ETA %s",
                        self.done, self.total, self.tokens, tps, format_duration(eta))

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class StopOnSignals:
    """SIGINT/SIGTERM raise :class:`StopRequested`, except inside :meth:`critical` (the write of a
    finished group), where they are remembered and raised right after it."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.pending: int | None = None
        self.writing = False
        self.stopping = False
        self._old: dict = {}

    def _handler(self, signum, frame) -> None:
        if self.stopping:           # already on the way out: a second Ctrl-C must not cut the clean-up
            return
        if self.writing:
            self.pending = signum
            return
        self.stopping = True
        raise StopRequested(signum)

    def __enter__(self):
        try:
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handler)
        except ValueError:          # not the main thread: keep Python's default (KeyboardInterrupt)
            self._restore()
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, old in self._old.items():
            signal.signal(s, old)
        self._old.clear()

    @contextlib.contextmanager
    def critical(self):
        self.writing = True
        try:
            yield
        finally:
            self.writing = False
        if self.pending is not None:
            self.stopping = True
            raise StopRequested(self.pending)


# ============================================================================ generation


@dataclass
class RunStats:
    prompts: int = 0
    groups: int = 0
    tokens: int = 0
    gen_s: float = 0.0
    compute_busy_s: float = 0.0
    compute_span_s: float = 0.0
    wall_s: float = 0.0
    extra: dict = field(default_factory=dict)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.gen_s if self.gen_s else 0.0

    @property
    def bubble_fraction(self) -> float | None:
        if not self.compute_span_s:
            return None
        return max(0.0, 1.0 - self.compute_busy_s / self.compute_span_s)


_UNTRACED = "not measured (no trace: --trace, --plot or --set pipeline.trace=true record one)"



def generate_group(model, tok, group: list[Prompt], gen_kwargs: dict, device) -> list[dict]:
    """One ``generate`` call on the left-padded group; one output record per prompt."""
    from kinject.app.sequences import eos_ids

    enc = tok([p.prompt for p in group], return_tensors="pt", padding=True)
    enc = {k: v.to(device) for k, v in enc.items()}
    out = model.generate(**enc, **gen_kwargs)                       # [G, L + new]
    new = out[:, enc["input_ids"].shape[1]:].cpu().tolist()
    eos = eos_ids(model, tok)
    records = []
    for p, ids in zip(group, new):
        stop = next((i for i, t in enumerate(ids) if t in eos), None)
        kept = ids if stop is None else ids[: stop + 1]
        records.append({"id": p.id, "prompt": p.prompt, **({"messages": p.messages} if p.messages is not None else {}),
                        "completion": tok.decode(kept, skip_special_tokens=True),
                        "new_tokens": len(kept), "finish_reason": "length" if stop is None else "stop",
                        "completion_ids": kept})
    return records


def harvest_trace(tracer, since: float, stats: RunStats, keep: bool) -> None:
    """Add this group's compute busy time and span to ``stats``; drop the events unless kept."""
    from kinject.trace import union_seconds

    if not tracer.enabled:
        return
    spans = [(e.start, e.end) for e in tracer.events() if e.stream == "compute" and e.start >= since]
    if spans:
        stats.compute_busy_s += union_seconds(spans)
        stats.compute_span_s += max(e for _, e in spans) - min(s for s, _ in spans)
    if not keep:
        tracer.clear()


# ============================================================================ the job


@dataclass
class RunConfig:
    model: str | None = None
    rules: str | None = None
    overrides: list[str] = field(default_factory=list)
    prompts: str | None = None
    prompts_format: str = "auto"
    out: str = "kinject-run.jsonl"
    max_new_tokens: int = DEFAULT_NEW_TOKENS
    do_sample: bool = False
    temperature: float | None = None
    top_p: float | None = None
    seed: int = 0
    trace: str | None = None
    plot: str | None = None
    attn: str = "eager"
    dtype: str | None = None
    progress: bool = True


def check_config(cfg: RunConfig) -> None:
    if cfg.max_new_tokens < 1:
        raise KinjectError(f"--max-new-tokens must be >= 1, got {cfg.max_new_tokens}")
    if not cfg.do_sample and (cfg.temperature is not None or cfg.top_p is not None):
        raise KinjectError("--temperature / --top-p need --do-sample (greedy decoding ignores them)")
    if cfg.temperature is not None and cfg.temperature <= 0:
        raise KinjectError(f"--temperature must be > 0, got {cfg.temperature}")
    if cfg.top_p is not None and not 0 < cfg.top_p <= 1:
        raise KinjectError(f"--top-p must be in (0, 1], got {cfg.top_p}")
    if cfg.prompts and Path(cfg.prompts).expanduser().resolve() == Path(cfg.out).expanduser().resolve():
        raise KinjectError(f"--prompts and --out are the same file: {cfg.out}")


def run_job(cfg: RunConfig) -> dict:
    """Run the batch job of ``cfg``; returns the summary (also what :func:`format_summary` prints).

    Raises :class:`RunInterrupted` on SIGINT/SIGTERM after keeping every finished group."""
    summary: dict[str, Any] = {}
    with StopOnSignals() as sig:
        try:
            return _run(cfg, sig, summary)
        except StopRequested as stop:
            name = signal.Signals(stop.signum).name
            what = (f"{summary['done_total']}/{summary['total']} prompts in {cfg.out}" if "total" in summary
                    else "nothing generated yet")
            raise RunInterrupted(f"interrupted by {name}: kept {what} (no partial group); "
                                 "re-run the same command to resume", 128 + stop.signum) from None


def _run(cfg: RunConfig, sig: StopOnSignals, summary: dict) -> dict:
    import torch

    import kinject
    from kinject.rules import load_rules, resolve_rules_path

    t_start = time.perf_counter()
    check_config(cfg)
    # -- everything a user can get wrong is checked before the model is loaded
    prompts = read_prompts(cfg.prompts, cfg.prompts_format) if cfg.prompts else builtin_prompts()
    out = Path(cfg.out).expanduser()
    with output_file(out) as fd:
        _check_writable_dir(cfg.trace, "trace")
        _check_writable_dir(cfg.plot, "plot")
        model_dir = Path(cfg.model).expanduser() if cfg.model else default_model_path()
        model_type(model_dir)                                           # config.json present
        rules_path = resolve_rules_path(cfg.rules) if cfg.rules else default_rules(model_dir)
        overrides = list(cfg.overrides) + (["pipeline.trace=true"] if cfg.trace or cfg.plot else [])
        ruleset = load_rules(rules_path, overrides)
        done = done_ids(out)
        todo = [p for p in prompts if p.key not in done]
        summary.update({"model": str(model_dir), "rules": str(rules_path), "out": str(out),
                        "total": len(prompts), "skipped": len(prompts) - len(todo),
                        "done_total": len(prompts) - len(todo)})
        if not todo:
            logger.info("kinject run: all %d prompts already in %s; nothing to do", len(prompts), out)
            summary.update(stats=RunStats(), plan=None, wall_s=time.perf_counter() - t_start)
            return summary

        # -- load
        tok = load_tokenizer(model_dir)
        prompts = render_chat_prompts(prompts, tok, str(model_dir))
        model = kinject.from_pretrained(model_dir, ruleset, dtype=cfg.dtype, attn_implementation=cfg.attn)
        rt = model.kinject
        try:
            plan = plan_groups(ruleset.pipeline, model)
            summary["plan"] = plan
            summary["model_class"] = type(model).__name__
            summary["dtype"] = str(model.dtype).replace("torch.", "")
            gen_kwargs = generation_kwargs(cfg, tok.pad_token_id)
            groups = pending_groups(prompts, plan.size, done)
            keep_trace = bool(cfg.trace or cfg.plot)
            rt.store.reset_stats()
            rt.tracer.clear()
            if rt.device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(rt.device)
            stats = RunStats()
            summary["stats"] = stats
            progress = Progress(len(todo), cfg.progress)
            try:
                for gi, group in groups:
                    if cfg.do_sample:
                        torch.manual_seed(cfg.seed + gi)        # per group: resumed runs sample the same
                    since = rt.tracer.now()
                    t0 = time.perf_counter()
                    with torch.inference_mode():
                        records = generate_group(model, tok, group, gen_kwargs, rt.device)
                    dt = time.perf_counter() - t0
                    data = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode("utf-8")
                    with sig.critical():
                        write_all(fd, data)
                        stats.groups += 1
                        stats.prompts += len(group)
                        summary["done_total"] += len(group)
                    n_tok = sum(r["new_tokens"] for r in records)
                    stats.tokens += n_tok
                    stats.gen_s += dt
                    harvest_trace(rt.tracer, since, stats, keep_trace)
                    progress.update(len(group), n_tok, dt)
            finally:
                progress.close()
            _collect_runtime(rt, summary)
            if cfg.trace:
                rt.tracer.to_chrome(cfg.trace)
                summary["trace"] = cfg.trace
            if cfg.plot and rt.tracer.plot(cfg.plot, title=f"kinject run: {Path(rules_path).name}, n={plan.n} x "
                                                        f"bs={plan.bs}, {stats.prompts} prompts, {cfg.max_new_tokens} new tokens",
                                           budget=rt.store.budget):
                summary["plot"] = cfg.plot
        finally:
            rt.transfer.close()
        summary["wall_s"] = time.perf_counter() - t_start
        return summary


def _collect_runtime(rt, summary: dict) -> None:
    st = rt.store.summary()
    summary["bytes_moved"] = dict(st.get("bytes", {}))
    summary["tier_bytes"] = dict(st.get("tier_bytes", {}))
    if "cuda_max_allocated" in st:
        summary["peak_device"] = (st["cuda_max_allocated"],
                                  f"CUDA max allocated; the allocator held up to {format_bytes(st['cuda_max_reserved'])}")
    else:
        summary["peak_device"] = (st.get("peak_bytes"), "store accounting")
    summary["emulated_bandwidth"] = rt.pipeline.emulate_bandwidth if rt.transfer.emulated else None
    pstats = rt.peek("prefetch_stats")
    if pstats is not None and getattr(pstats, "precision", None) and pstats.precision() is not None:
        summary["prefetch"] = {"precision": pstats.precision(), "hot_accuracy": pstats.hot_accuracy(),
                               "coverage": pstats.coverage()}
    elif pstats is not None:
        summary["prefetch"] = "none"          # experts, but nothing predicted
    summary["bytes_by_stream"] = rt.tracer.bytes_by_stream() if rt.tracer.enabled else {}


# ============================================================================ summary


def format_summary(summary: dict) -> str:
    stats: RunStats = summary["stats"]
    plan: GroupPlan | None = summary.get("plan")
    pct = lambda x: "n/a" if x is None else f"{100 * x:.1f}%"  # noqa: E731
    rows = [("output", f"{summary['out']}: {summary['done_total']}/{summary['total']} prompts "
                       f"({stats.prompts} new, {summary['skipped']} already there)"),
            ("model", summary["model"] + (f" ({summary['model_class']}, {summary['dtype']})"
                                          if "model_class" in summary else "")),
            ("rules", summary["rules"])]
    if plan is not None:
        rows.append(("plan", f"n={plan.n} x bs={plan.bs} = {plan.size} prompts per generate ({plan.source}); "
                             f"{stats.groups} group(s) run"))
    if stats.groups:
        rows += [("tokens/s", f"{stats.tokens_per_s:.1f} ({stats.tokens} new tokens in {stats.gen_s:.2f} s "
                              "of generate)"),
                 ("bubble fraction", pct(stats.bubble_fraction) + " of the compute stream"
                  if stats.bubble_fraction is not None else _UNTRACED)]
        moved = summary.get("bytes_moved", {})
        rows.append(("bytes moved", ", ".join(f"from {t} {format_bytes(b)}" for t, b in moved.items()) or "n/a"))
        tiers = summary.get("tier_bytes", {})
        if tiers:
            rows.append(("bytes per tier", ", ".join(f"{t} {format_bytes(b)}" for t, b in tiers.items())))
        peak, how = summary.get("peak_device", (None, ""))
        rows.append(("peak device mem", f"{format_bytes(peak)} ({how})" if peak is not None else "n/a"))
        pf = summary.get("prefetch")
        if pf == "none":
            rows.append(("prefetch", "no expert predicted: none needed a transfer (each stayed on the device or "
                                     "was used in place), or prefetch is off"))
        elif pf:
            rows.append(("prefetch", f"precision {pct(pf['precision'])}, hot-expert accuracy "
                                     f"{pct(pf['hot_accuracy'])}, token coverage {pct(pf['coverage'])}"))
        if summary.get("emulated_bandwidth"):
            rows.append(("NOTE", f"host->device link EMULATED at {summary['emulated_bandwidth']:g} GB/s"))
    for key in ("trace", "plot"):
        if summary.get(key):
            rows.append((key, summary[key]))
    rows.append(("wall time", f"{summary.get('wall_s', 0.0):.2f} s (load included)"))
    w = max(len(k) for k, _ in rows)
    return "kinject run summary\n" + "\n".join(f"  {k.ljust(w)}  {v}" for k, v in rows)


# ============================================================================ CLI glue


def add_arguments(s) -> None:
    """The ``kinject run`` options (registered by :mod:`kinject.app.cli`)."""
    s.add_argument("--model", help="Hugging Face model directory or GGUF file (default: the built-in tiny MoE)")
    s.add_argument("--rules", help="rule file (default: rules/klotski.yaml)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a rule-file key")
    s.add_argument("--prompts", metavar="FILE", help="JSONL ({\"id\", \"prompt\"}) or text, one prompt per line "
                                                     "(default: built-in prompts)")
    s.add_argument("--format", dest="prompts_format", choices=("auto", "jsonl", "text", "parquet"), default="auto",
                   help="format of --prompts (auto: by extension, else by the first line; parquet: with --ray)")
    s.add_argument("--out", default="kinject-run.jsonl", metavar="FILE.jsonl",
                   help="output JSONL, appended per finished group; re-running resumes (default: %(default)s)")
    s.add_argument("--max-new-tokens", type=int, default=DEFAULT_NEW_TOKENS)
    s.add_argument("--do-sample", action="store_true", help="sample instead of greedy decoding")
    s.add_argument("--temperature", type=float, help="sampling temperature (with --do-sample)")
    s.add_argument("--top-p", type=float, help="nucleus sampling (with --do-sample)")
    s.add_argument("--seed", type=int, default=0, help="sampling seed; group i uses seed + i")
    s.add_argument("--trace", metavar="FILE.json", help="write a Chrome/Perfetto trace of the run")
    s.add_argument("--plot", metavar="FILE.png", help="draw the pipeline timeline")
    s.add_argument("--attn", default="eager", help="attn_implementation (default: eager, for exactness)")
    s.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="compute dtype (default: the config's)")
    s.add_argument("--threads", type=int, default=0, help="torch intra-op threads (default: torch's)")
    s.add_argument("-q", "--quiet", action="store_true", help="no progress bar or lines")
    r = s.add_argument_group("scale-out on Ray Data (pip install 'kinject[ray]'; RAY_ADDRESS for a cluster)")
    r.add_argument("--ray", action="store_true", help="run the groups on Ray Data actors, one model per actor")
    r.add_argument("--actors", type=int, default=1, help="number of actors (models) (default: 1)")
    r.add_argument("--gpus-per-actor", type=float, default=0.0, help="Ray num_gpus of each actor (default: 0)")


def config_from_args(args) -> RunConfig:
    """The job's :class:`RunConfig` from ``kinject run``'s parsed arguments (logging and threads set)."""
    if not args.quiet:
        logging.getLogger(__name__).setLevel(logging.INFO)
    if args.threads < 0:
        raise KinjectError(f"--threads must be >= 0, got {args.threads}")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    if not getattr(args, "verbose", False):
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
    return RunConfig(model=args.model, rules=args.rules, overrides=list(args.set), prompts=args.prompts,
                     prompts_format=args.prompts_format, out=args.out, max_new_tokens=args.max_new_tokens,
                     do_sample=args.do_sample, temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                     trace=args.trace, plot=args.plot, attn=args.attn, dtype=args.dtype, progress=not args.quiet)


def main(args) -> int:
    """``kinject run`` (one process) from parsed arguments; returns the exit code (interruption: 128 + signal)."""
    if args.prompts_format == "parquet":
        raise KinjectError("--format parquet needs --ray (Parquet prompts are read with Ray Data)")
    cfg = config_from_args(args)
    try:
        summary = run_job(cfg)
    except RunInterrupted as exc:
        print(f"kinject: {exc}", file=sys.stderr)
        return exc.exit_code
    print(format_summary(summary))
    return 0
