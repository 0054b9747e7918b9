"""``kinject bench host-experts`` at a tiny shape: its rows, identical tokens for the lossless
host kernels, and the llama.cpp contender's switch away from repacked weights (checked against a
stand-in ``llama_cpp`` module: llama-cpp-python builds from source and is no test dependency)."""

import sys
import types

import pytest

from kinject.app.cli import main
from kinject.bench import host_experts


def test_tiny_run_rows_and_identical_tokens(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(host_experts, "stream_bandwidth", lambda threads, **kw: 10e9)   # (a 1 GiB probe)
    out = tmp_path / "host.md"
    argv = ["bench", "host-experts", "--hidden", "64", "--experts", "8", "--top-k", "2", "--width", "32",
            "--layers", "2", "--batches", "1", "3", "--prompt-len", "8", "--new-tokens", "5", "--repeats", "1",
            "--threads", "1", "--only", "transformers", "torch-host", "--workdir", str(tmp_path / "work"),
            "--out", str(out)]
    assert main(argv) == 0
    text = out.read_text()
    rows = [line for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:]
    names = {r.split(" | ")[0].strip("| ") for r in rows}
    assert {"transformers bf16 (grouped_mm)", "kinject bf16, torch-host"} <= names, names
    assert len(rows) == 2 * len(names)                                 # batches 1 and 3
    bf16 = [r for r in rows if r.startswith("| kinject bf16, torch-host |")]
    assert bf16 and all(r.rstrip(" |").endswith("yes") for r in bf16), bf16    # lossless: transformers' tokens


class _FakeLlama:
    seen: list = []

    def __init__(self, **kwargs):
        api = sys.modules["llama_cpp.llama"]
        _FakeLlama.seen.append(api.llama_cpp.llama_model_default_params().use_extra_bufts)


def _fake_llama_cpp(monkeypatch):
    low = types.SimpleNamespace(llama_model_default_params=lambda: types.SimpleNamespace(use_extra_bufts=True))
    top = types.ModuleType("llama_cpp")
    top.Llama = _FakeLlama
    api = types.ModuleType("llama_cpp.llama")
    api.llama_cpp = low
    top.llama = api
    monkeypatch.setitem(sys.modules, "llama_cpp", top)
    monkeypatch.setitem(sys.modules, "llama_cpp.llama", api)
    return low


def test_llama_contender_runs_without_repacked_weights_only_when_told(monkeypatch, tmp_path):
    low = _fake_llama_cpp(monkeypatch)
    default = low.llama_model_default_params
    _FakeLlama.seen = []
    host_experts.LlamaModel(tmp_path / "m.gguf", 1, 64)
    host_experts.LlamaModel(tmp_path / "m.gguf", 1, 64, repacked=False)
    assert _FakeLlama.seen == [True, False]
    assert low.llama_model_default_params is default                   # put back after the load


@pytest.mark.parametrize("code, runs", [(0, True), (-11, False)])
def test_repacked_probe_reads_the_child_process(monkeypatch, tmp_path, code, runs):
    import subprocess

    monkeypatch.setattr(subprocess, "run", lambda *a, **kw: types.SimpleNamespace(returncode=code))
    assert host_experts.repacked_runs(tmp_path / "m.gguf", 2) is runs
