"""``kinject bench host-experts`` at a tiny shape: its rows, identical tokens for the lossless
host kernels, and the llama.cpp contender's switch away from repacked weights (checked against a
stand-in ``llama_cpp`` module: llama-cpp-python builds from source and is no test dependency)."""

import sys
import types

import pytest

from kinject.app.cli import main
from kinject.bench import host_experts


def test_tiny_run_rows_and_identical_tokens(tmp_path, monkeypatch, capsys):
    probes = iter([10e9 * i for i in range(1, 20)])   # the start, then before each contender's timed repeat
    monkeypatch.setattr(host_experts, "stream_bandwidth", lambda threads, **kw: next(probes))   # (a 1 GiB probe)
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
    # each row's bound is its bytes over the bandwidth probed before its own timed repeat (20 and 30 GB/s)
    bound = {r.split(" | ")[0].strip("| "): float(r.split(" | ")[4]) for r in rows if r.split(" | ")[1] == "1"}
    hf, kin = bound["transformers bf16 (grouped_mm)"], bound["kinject bf16, torch-host"]
    assert kin / hf == pytest.approx(1.5, rel=0.01), bound
    assert "10.0 GB/s at the start, 20.0-" in text and " GB/s before the timed repeats" in text


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


def test_rows_compare_with_llama_cpp_in_the_counterpart_format():
    C = host_experts.Contender
    kin8 = C("kinject int8", "int8", "kinject", decode={1: [40.0, 50.0], 8: [90.0]}, prefill={1: [200.0], 8: [600.0]})
    kin16 = C("kinject bf16", "bf16", "kinject", decode={1: [30.0]}, prefill={1: [100.0]})
    kin4 = C("kinject int4", "int4", "kinject", decode={1: [30.0]}, prefill={1: [100.0]})
    q8 = C("llama.cpp Q8_0", "Q8_0", "llama", gguf="Q8_0", decode={1: [60.0, 62.5]}, prefill={1: [160.0]})
    bf = C("llama.cpp BF16", "BF16", "llama", gguf="BF16", decode={1: [40.0]}, prefill={1: [80.0]})
    q4 = C("llama.cpp Q4_K", "Q4_K", "llama", gguf="Q4_K", why_not="llama_cpp is not importable")
    cs = [kin8, kin16, kin4, q8, bf, q4]
    assert host_experts.vs_llama(kin8, cs, 1) == "0.80× / 1.25× Q8_0"       # best over best, Q8_0 for int8
    assert host_experts.vs_llama(kin16, cs, 1) == "0.75× / 1.25× BF16"
    assert host_experts.vs_llama(kin4, cs, 1) == ""                         # its llama.cpp row did not run
    assert host_experts.vs_llama(kin8, cs, 8) == ""                         # llama.cpp decodes one sequence
    assert host_experts.vs_llama(q8, cs, 1) == ""
    # where the file with only the experts quantized (kinject's bytes) ran, the low-bit rows compare with it
    q8e = C("llama.cpp Q8_0 experts", "Q8_0", "llama", gguf="Q8_0-experts", decode={1: [100.0]}, prefill={1: [400.0]})
    assert host_experts.vs_llama(kin8, [*cs, q8e], 1) == "0.50× / 0.50× Q8_0-experts"
    assert host_experts.vs_llama(kin16, [*cs, q8e], 1) == "0.75× / 1.25× BF16"
    q8e.why_not = "crashed"
    assert host_experts.vs_llama(kin8, [*cs, q8e], 1) == "0.80× / 1.25× Q8_0"


def _tensors(path):
    import gguf

    return {t.name: t for t in gguf.GGUFReader(path).tensors}


def test_experts_only_files_and_the_bytes_a_step_reads_from_them(tmp_path):
    """The equal-bytes llama.cpp files: Q8_0 written with only the experts quantized, and a quantized
    file's experts beside another file's BF16 rest (what the Q4_K_M row gets: here a Q8_0 file stands for
    llama.cpp's quantizer); a step's bytes are each tensor's own, the experts' routed share."""
    np = pytest.importorskip("numpy")
    gguf = pytest.importorskip("gguf")
    import torch

    from kinject import testing
    from kinject.io.gguf_writers import save_gguf

    shape = host_experts.Shape(hidden=256, experts=8, top_k=2, width=64, layers=2)
    model_dir = testing.save_tiny_model("qwen3_moe", tmp_path / "m", dtype=torch.bfloat16, hidden_size=256,
                                        num_hidden_layers=2, num_experts=8, num_experts_per_tok=2,
                                        moe_intermediate_size=64)
    experts_only = host_experts._gguf_file(model_dir, "Q8_0" + host_experts.EXPERTS_ONLY)
    kinds = {n: t.tensor_type.name for n, t in _tensors(experts_only).items()}
    assert {k for n, k in kinds.items() if "_exps" in n} == {"Q8_0"}
    assert all(k == "BF16" for n, k in kinds.items() if n.endswith(("attn_q.weight", "attn_output.weight")) or
               n in ("output.weight", "token_embd.weight")), kinds
    share = 1 - (1 - shape.top_k / shape.experts)          # one sequence: the routed share of each layer's experts
    want = 0.0
    for n, t in _tensors(experts_only).items():
        values = int(np.prod(t.shape))
        per = {"Q8_0": 34 / 32, "BF16": 2, "F32": 4}[t.tensor_type.name]
        want += 0 if n.startswith("token_embd.") else values * per * (share if "_exps" in n else 1)
    assert host_experts.gguf_step_bytes(experts_only, shape, 1) == pytest.approx(want)
    assert host_experts.gguf_step_bytes(experts_only, shape, 1) > \
        host_experts.gguf_step_bytes(host_experts._gguf_file(model_dir, "Q8_0"), shape, 1)   # its attention is BF16

    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    quantized = save_gguf(model, tmp_path / "q.gguf", "Q8_0", tokenizer=testing.tiny_tokenizer())
    bf16 = host_experts._gguf_file(model_dir, "BF16")
    swapped = host_experts.equal_bytes_gguf(quantized, bf16, tmp_path / "swapped.gguf")
    got, q, b = _tensors(swapped), _tensors(quantized), _tensors(bf16)
    assert list(got) == list(q)
    for n, t in got.items():
        src = q[n] if "_exps" in n else b[n]
        assert t.tensor_type == src.tensor_type and np.array_equal(t.data, src.data), n
    fields = lambda p: {f.name: f.contents() for f in gguf.GGUFReader(p).fields.values()  # noqa: E731
                        if not f.name.startswith("GGUF.")}
    assert fields(swapped) == fields(quantized)
    assert not (tmp_path / "swapped.gguf.partial").exists()


def test_llama_decode_feeds_back_the_argmax_of_its_last_logits(monkeypatch):
    """Each decode step's input is the argmax of the logits llama.cpp computed for the last position
    (not ``Llama.scores``, which llama-cpp-python leaves unwritten without ``logits_all``)."""
    import ctypes

    _fake_llama_cpp(monkeypatch)
    vocab = 7
    logits = (ctypes.c_float * vocab)()

    class Llm:
        ctx = object()

        def __init__(self):
            self.fed = []

        def n_vocab(self):
            return vocab

        def reset(self):
            self.fed = []

        def eval(self, tokens):
            self.fed.append(list(tokens))
            for i in range(vocab):                          # the next "logits": peak at (last token + 3) % vocab
                logits[i] = 1.0 if i == (tokens[-1] + 3) % vocab else 0.0

    def get_logits_ith(ctx, i):
        assert ctx is Llm.ctx and i == -1
        return ctypes.cast(logits, ctypes.POINTER(ctypes.c_float))

    monkeypatch.setattr(sys.modules["llama_cpp"], "llama_get_logits_ith", get_logits_ith, raising=False)
    model = host_experts.LlamaModel.__new__(host_experts.LlamaModel)
    model.llm = Llm()
    _, _, out = model.time([1, 2], 4)
    assert out == [5, 1, 4, 0]                                   # 2+3, 5+3, 1+3, 4+3 (mod 7)
    assert model.llm.fed == [[1, 2], [5], [1], [4], [0]]


def test_prompt_batch_reaches_llama_cpp_and_its_probe(monkeypatch, tmp_path):
    import subprocess

    _fake_llama_cpp(monkeypatch)
    got = {}
    monkeypatch.setattr(_FakeLlama, "__init__", lambda self, **kw: got.update(kw))   # (put back after the test)
    host_experts.LlamaModel(tmp_path / "m.gguf", 1, 64, prompt_batch=1)
    assert got["n_batch"] == 1
    argv = []
    monkeypatch.setattr(subprocess, "run", lambda a, **kw: argv.append(a) or types.SimpleNamespace(returncode=0))
    host_experts.repacked_runs(tmp_path / "m.gguf", 2, prompt_batch=1)
    assert argv[-1][-1] == "1"


@pytest.mark.parametrize("whole, one, plain_row, tuned_row", [
    (True, True, (True, None), (None, "take whole prompts")),        # the default works: no tuned row
    (False, True, (False, None), (True, None)),                      # an AMX-INT8 VM: plain + tuned rows
    (False, False, (False, None), (False, "even one token at a time")),
])
def test_which_llama_rows_run_on_which_buffers(tmp_path, monkeypatch, whole, one, plain_row, tuned_row):
    calls = []

    def probe(path, threads, prompt_batch=64):
        calls.append(prompt_batch)
        return whole if prompt_batch > 1 else one

    monkeypatch.setattr(host_experts, "repacked_runs", probe)
    probed = {}
    plain = host_experts.Contender("llama.cpp Q8_0", "Q8_0", "llama", gguf="Q8_0")
    tuned = host_experts.Contender("llama.cpp Q8_0 tuned", "Q8_0", "llama", gguf="Q8_0", prompt_batch=1)
    for c, (repacked, why) in ((plain, plain_row), (tuned, tuned_row)):
        said = host_experts._llama_buffers(c, tmp_path / "m.gguf", 2, probed)
        assert c.repacked is repacked
        assert (said is None) if why is None else (why in said), said
    assert calls.count(64) == 1                                         # each probe once per file
    assert plain.name.endswith("(no repacked weights: they crash here)") is (not whole)
