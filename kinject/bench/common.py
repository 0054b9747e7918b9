"""What every benchmark suite shares: timing a greedy ``generate``, process memory and disk
counters, dropping files from the page cache, medians, and the provenance block (machine,
date, command, commit, versions) every report ends with."""

from __future__ import annotations

import os
import platform
import re
import shlex
import socket
import statistics
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

import torch
from torch import nn

from kinject.rules import builtin_rules_dir


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def disk_read_bytes() -> int | None:
    """Bytes this process made the kernel fetch from storage (page-cache misses), all threads."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


class PeakRSS:
    """Peak RSS over a block: the kernel's high-water mark (reset through ``/proc/self/clear_refs``),
    else a sampling thread (every 5 ms)."""

    def __init__(self):
        self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> "PeakRSS":
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            self._thread = threading.Thread(target=self._sample, daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss_bytes())

    def __exit__(self, *exc) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            return
        with open("/proc/self/status") as f:
            hwm = re.search(r"VmHWM:\s+(\d+)\s+kB", f.read())
        self.peak = int(hwm.group(1)) * 1024 if hwm else rss_bytes()


def override_groups(words: list[str]) -> list[tuple[str, ...]]:
    """Command-line words as groups of ``--set`` overrides separated by ``--`` (the ablation
    examples' variants); the first group, possibly empty, is the baseline; later empty groups go."""
    groups: list[tuple[str, ...]] = [()]
    for word in words:
        if word == "--":
            groups.append(())
        else:
            groups[-1] = (*groups[-1], word)
    return [g for i, g in enumerate(groups) if g or i == 0]


def drop_page_cache(files) -> None:
    from kinject.engine.page_cache import drop_page_cache

    drop_page_cache(str(f) for f in files)


def generate(model: nn.Module, batch: dict, new_tokens: int, pad_id: int) -> torch.Tensor:
    """Greedy, exactly ``new_tokens`` new tokens per row (EOS cannot end a row early)."""
    return model.generate(**batch, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                          pad_token_id=pad_id)


def same_prefix(out: torch.Tensor, reference: torch.Tensor, prompt_len: int) -> float:
    """Share of the generated tokens that equal the reference's before the first difference,
    averaged over the sequences: how far a lossy contender (4-bit weights) follows the model."""
    gen, ref = out[:, prompt_len:], reference[:, prompt_len:]
    if gen.shape != ref.shape or gen.shape[1] == 0:
        return 0.0
    diff = gen != ref
    first = torch.where(diff.any(1), diff.int().argmax(1), gen.shape[1])     # index of the first difference
    return float(first.float().mean() / gen.shape[1])


def failure_line(what: str, exc: BaseException) -> str:
    first = (str(exc).splitlines() or [""])[0][:160]
    return f"{what}: {type(exc).__name__}: {first}"


def median(xs):
    return statistics.median(xs) if xs else float("nan")


def sh(*cmd: str) -> str:
    """A command's stdout, or "" when it is missing or fails (provenance is best effort)."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def host_facts() -> dict:
    """What every benchmark report states about the machine and the code it ran."""
    repo = str(builtin_rules_dir().parent)
    cpu = next((ln.split(":", 1)[1].strip() for ln in sh("lscpu").splitlines() if ln.startswith("Model name")),
               platform.processor() or "?")
    return {"host": socket.gethostname(), "cpu": cpu, "cpus": os.cpu_count(),
            "mem_gib": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30,
            "commit": sh("git", "-C", repo, "rev-parse", "--short", "HEAD") or "?",
            "dirty": " (+ uncommitted changes)"
            if sh("git", "-C", repo, "status", "--porcelain", "--untracked-files=no") else ""}


def provenance() -> str:
    f = host_facts()
    return "\n".join([
        f"- machine: {f['host']}, {f['cpu']}, {f['cpus']} CPUs, {f['mem_gib']:.1f} GiB RAM, no GPU",
        f"- date: {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}",
        f"- command: `{command_line()}`",
        f"- commit: {f['commit']}{f['dirty']}; torch {package_version('torch')}, transformers {package_version('transformers')}, "
        f"accelerate {package_version('accelerate')}",
    ])


def command_line() -> str:
    argv = list(sys.argv)
    if argv and argv[0].endswith(("kinject/app/cli.py", "kinject/__main__.py")):
        argv[0:1] = ["python", "-m", "kinject"]
    elif argv and argv[0].endswith(".py"):
        argv.insert(0, "python")
    return " ".join(shlex.quote(a) for a in argv)


def package_version(pkg: str) -> str:
    try:
        from importlib.metadata import version

        return version(pkg)
    except Exception:
        return "?"


def checkpoint_files(path: Path) -> list[Path]:
    return sorted(path.glob("*.safetensors"))


def shared_weights_twin(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are new objects over the same tensors (kinject swaps the
    twin's parameters for placeholders and never writes a weight, so HF's stay as they are). Made
    while ``model`` is on the host: a twin of a CUDA model would put CUDA tensors in the host tier."""
    import copy

    memo = {id(p): torch.nn.Parameter(p.data, requires_grad=p.requires_grad) for p in model.parameters()}
    return copy.deepcopy(model, memo)
