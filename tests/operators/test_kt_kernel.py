"""kt-kernel as a host kernel of the chain: after torch-host by default, first with
``pipeline.host_kernel: kt-kernel``.

Here (CI): the chain says why kt-kernel was skipped and torch-grouped gives transformers' tokens.
A fake ``kt_kernel`` (its extension's API as learned from kt-kernel 0.7.2, computed with torch from
the pointers it is given) pins kinject's adapter to that call protocol: the weights handed over once
per layer, rows / ids / weights in, outputs combined to transformers' tokens. It proves the adapter,
not the kernel: the real kernel runs under ``@pytest.mark.gpu`` where kt-kernel is installed.
"""

from __future__ import annotations

import ctypes
import importlib.machinery
import importlib.util
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

import kinject
from kinject.fixtures import tiny_moe_path
from operators import kt_backend
from operators.experts import GroupedExperts

GEN = dict(max_new_tokens=6, do_sample=False)
HOST = ["vars.experts_compute=host", "pipeline.device_budget=6MiB", "pipeline.micro_batch_size=1", "pipeline.n_batches=1"]
KT = [*HOST, "pipeline.host_kernel=kt-kernel"]
FAST = {"avx2", "avx512f", "avx512bw", "amx_tile", "amx_bf16"}
INSTALLED = importlib.util.find_spec("kt_kernel") is not None


@pytest.fixture(scope="module")
def prompt(tok):
    return tok(["def parse(path):\n    with open(path) as f:"], return_tensors="pt")


def _experts(model) -> list[GroupedExperts]:
    return [op for op in model.kinject.operators if isinstance(op, GroupedExperts)]


@pytest.mark.skipif(INSTALLED, reason="kt-kernel is installed here: its own tests run instead")
def test_chain_says_kt_kernel_is_not_installed_and_falls_back(prompt, caplog, tmp_path):
    want = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.float32).generate(**prompt, **GEN)
    with caplog.at_level(logging.INFO, logger="operators.host_experts"):
        model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*HOST, f"pipeline.offload_dir={tmp_path}"],
                                        dtype=torch.float32)
    assert torch.equal(model.generate(**prompt, **GEN), want)
    assert all(op.host.backend.name == "torch-grouped" and op.host.stats["experts"] > 0 for op in _experts(model))
    assert any("host kernel torch-grouped (skipped torch-host: computes bfloat16 experts as they are" in r.message
               and "; kt-kernel: not installed (pip install 'kinject[kt]'" in r.message for r in caplog.records)


def test_skip_reasons_cpu_flags_dtype_and_layout(monkeypatch, tmp_path):
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*HOST, f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.float32)
    op = _experts(model)[0]
    monkeypatch.setattr(kt_backend, "_installed", lambda: True)
    monkeypatch.setattr(kt_backend, "cpu_flags", lambda: {"avx2", "fma"})
    assert kt_backend.skip(op.layout, False, op).startswith(
        "this CPU has neither AMX (amx_tile, amx_bf16) nor AVX-512 (avx512f, avx512bw) in /proc/cpuinfo")
    monkeypatch.setattr(kt_backend, "cpu_flags", lambda: FAST)
    assert kt_backend.skip(op.layout, False, op) == "computes bfloat16 experts only (these compute in torch.float32)"
    monkeypatch.setattr(op.layout, "params", [*op.layout.params, "gate_up_proj_bias"])
    assert kt_backend.skip(op.layout, False, op).startswith("computes unbiased experts only")
    monkeypatch.setattr(op.layout.module, "act_fn", torch.nn.GELU())
    monkeypatch.setattr(op.layout, "params", [p for p in op.layout.params if "bias" not in p])
    assert kt_backend.skip(op.layout, False, op).startswith("computes silu(gate) * up only")


def test_skip_reason_when_kt_kernel_does_not_import(monkeypatch, tmp_path):
    """An installed kt-kernel whose import fails (here: a dependency missing) is skipped with the
    error, and with the torch its wheel pins where that is not this torch."""
    pkg = tmp_path / "kt_kernel"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("raise ModuleNotFoundError(\"No module named 'gguf'\")\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(kt_backend, "cpu_flags", lambda: FAST)
    monkeypatch.setattr(kt_backend, "torch_pin", lambda: "torch==2.9.1")
    model = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.bfloat16)
    model = kinject.optimize(model, "rules/hybrid.yaml", [*HOST, f"pipeline.offload_dir={tmp_path}/off"])
    op = _experts(model)[0]
    assert op.host.backend.name == "torch-host"
    mine = torch.__version__.split("+")[0]
    assert kt_backend.skip(op.layout, False, op) == (
        f"import failed (ModuleNotFoundError: No module named 'gguf'; its wheel pins torch==2.9.1, this is torch {mine})")


# ---- a fake kt_kernel: the extension's API, computed with torch from the pointers it is given ----


def _at(ptr: int, shape, dtype) -> torch.Tensor:
    """The memory at ``ptr`` as a tensor (no copy), as the C++ kernel reads it."""
    n = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_uint8 * n).from_address(ptr), dtype=dtype).view(shape)


class _Calls:
    loads = 0
    forwards = 0
    rows = 0


class _MOEConfig:
    def __init__(self, experts, k, hidden, inter, mask_ptr):
        self.shape = (experts, k, hidden, inter)
        self.mask = _at(mask_ptr, (experts,), torch.bool).clone()


class _BF16MOE:
    """Repacks (copies) the weights at load, like the real kernel; forward: sum_j w * down(silu(g x) * u x)."""

    def __init__(self, cfg):
        self.cfg, self.w = cfg, None

    def load_weights_task(self, order_ptr):
        def run():
            E, _, H, I = self.cfg.shape
            _Calls.loads += 1
            self.w = [(torch.cat([_at(g, (I, H), torch.bfloat16), _at(u, (I, H), torch.bfloat16)]).clone(),
                       _at(d, (H, I), torch.bfloat16).clone())
                      for g, u, d in zip(self.cfg.gate_projs[0], self.cfg.up_projs[0], self.cfg.down_projs[0])]
        return run

    def forward_task(self, bsz_ptr, k, ids_ptr, w_ptr, x_ptr, out_ptr, incremental):
        def run():
            E, _, H, I = self.cfg.shape
            n = int(_at(bsz_ptr, (1,), torch.int32)[0])
            ids, ws = _at(ids_ptr, (n, k), torch.int64), _at(w_ptr, (n, k), torch.float32)
            x, out = _at(x_ptr, (n, H), torch.bfloat16), _at(out_ptr, (n, H), torch.bfloat16)
            _Calls.forwards += 1
            _Calls.rows += n
            acc = torch.zeros(n, H, dtype=torch.bfloat16)
            for e in ids.unique().tolist():
                r, j = torch.where(ids == e)
                if self.cfg.mask[e]:
                    continue
                gu, down = self.w[e]
                gate, up = F.linear(x[r], gu).chunk(2, dim=-1)
                acc[r] += F.linear(F.silu(gate) * up, down) * ws[r, j, None].to(torch.bfloat16)
            out.copy_(acc)
        return run


class _CPUInfer:
    def __init__(self, cfg):
        self.backend_, self.queue = object(), []

    def submit(self, task):
        self.queue.append(task)

    def sync(self, allow_pending=0):
        while self.queue:
            self.queue.pop(0)()


@pytest.fixture
def fake_kt(monkeypatch):
    moe = types.SimpleNamespace(MOEConfig=_MOEConfig, AMXBF16_MOE=_BF16MOE)
    ext = types.SimpleNamespace(WorkerPoolConfig=types.SimpleNamespace, CPUInfer=_CPUInfer, moe=moe)
    mod = types.ModuleType("kt_kernel")
    mod.__spec__ = importlib.machinery.ModuleSpec("kt_kernel", None)
    mod.kt_kernel_ext = ext
    mod.__cpu_variant__ = "amx"
    monkeypatch.setitem(sys.modules, "kt_kernel", mod)
    monkeypatch.setattr(kt_backend, "cpu_flags", lambda: FAST)
    monkeypatch.setattr(kt_backend, "_POOLS", {})
    _Calls.loads = _Calls.forwards = _Calls.rows = 0
    return _Calls


def test_fake_kt_kernel_avx2_build_is_skipped(fake_kt, monkeypatch, tmp_path, caplog):
    monkeypatch.setattr(sys.modules["kt_kernel"], "__cpu_variant__", "avx2")
    with caplog.at_level(logging.WARNING, logger="operators.host_experts"):
        model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*KT, f"pipeline.offload_dir={tmp_path}"],
                                        dtype=torch.bfloat16)
    assert any(r.levelno == logging.WARNING and "host kernel torch-host (skipped kt-kernel: kt-kernel loaded its avx2"
               in r.message for r in caplog.records)        # the kernel asked for, not used: a warning says why
    op = _experts(model)[0]
    assert op.host.backend.name == "torch-host"
    assert kt_backend.skip(op.layout, False, op) == "kt-kernel loaded its avx2 build (no AMX / AVX-512 build loads on this CPU)"


@pytest.fixture(scope="module")
def want_bf16(prompt):
    return AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.bfloat16).generate(**prompt, **GEN)


def test_default_chain_prefers_torch_host_over_an_installed_kt_kernel(fake_kt, prompt, want_bf16, tmp_path):
    """Installed is not chosen: torch-host gives transformers' bits and was the faster on the bench machine."""
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*HOST, f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.bfloat16)
    assert torch.equal(model.generate(**prompt, **GEN), want_bf16)
    assert all(op.host.backend.name == "torch-host" for op in _experts(model)) and fake_kt.loads == 0


def test_fake_kt_kernel_call_protocol_gives_transformers_tokens(fake_kt, prompt, want_bf16, tmp_path):
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*KT, f"pipeline.offload_dir={tmp_path}"],
                                    dtype=torch.bfloat16)
    assert torch.equal(model.generate(**prompt, **GEN), want_bf16)
    hosts = [op.host for op in _experts(model)]
    assert all(h.backend.name == "kt-kernel" for h in hosts)
    assert fake_kt.loads == len(hosts)                                   # weights handed over once per layer
    assert fake_kt.rows == sum(h.stats["rows"] for h in hosts) > 0       # every host row through the kernel
    assert fake_kt.forwards >= len(hosts) * GEN["max_new_tokens"]
    assert "kt-kernel" in model.kinject.report()


@pytest.mark.gpu
@pytest.mark.skipif(not INSTALLED, reason="kt-kernel not installed (pip install 'kinject[kt]')")
def test_real_kt_kernel_beside_the_gpu(prompt, tmp_path):
    """The real kernel (AMX / AVX-512 host) computes the host experts of a bf16 model beside the GPU:
    transformers' greedy tokens on the same GPU. (Its bf16 accumulation order is not torch's; on the
    trained fixture the greedy margins are wide enough that the tokens are the same, as they are for
    its AVX2 build through this adapter on a CPU runtime.)"""
    op_probe = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml", [*HOST, f"pipeline.offload_dir={tmp_path}"],
                                       dtype=torch.bfloat16)
    op = _experts(op_probe)[0]
    if (why := kt_backend.skip(op.layout, True, op)) is not None:
        pytest.skip(f"kt-kernel skipped here: {why}")
    ref = AutoModelForCausalLM.from_pretrained(tiny_moe_path(), dtype=torch.bfloat16).to("cuda")
    batch = {k: v.to("cuda") for k, v in prompt.items()}
    want = ref.generate(**batch, **GEN)
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    ["pipeline.device=cuda", *KT, "pipeline.host_threads=4",
                                     f"pipeline.offload_dir={tmp_path}/gpu"], dtype=torch.bfloat16)
    assert torch.equal(model.generate(**batch, **GEN), want)
    assert all(op.host.backend.name == "kt-kernel" and op.host.stats["experts"] > 0 for op in _experts(model))


def test_fake_kt_kernel_leaves_disk_tier_experts_to_torch(fake_kt, prompt, want_bf16, tmp_path):
    """kt-kernel would hold a repacked copy of every expert in host memory: not for the disk tier."""
    model = kinject.from_pretrained(tiny_moe_path(), "rules/hybrid.yaml",
                                    [*KT, "vars.weights=disk", f"pipeline.offload_dir={tmp_path}"], dtype=torch.bfloat16)
    assert torch.equal(model.generate(**prompt, **GEN), want_bf16)
    op = _experts(model)[0]
    assert op.host.backend.name == "torch-host" and fake_kt.loads == 0
    assert kt_backend.skip(op.layout, False, op).startswith("keeps its own repacked copy of every expert in host memory")
