"""``kinject bench host-experts``: decode with every expert computed on the host, against the memory bound.

A decode step with the experts on the host reads each routed expert's weights once: the step's
bound is its bytes over the machine's memory bandwidth (:func:`stream_bandwidth`: the best of
torch's streaming reads over a buffer far larger than the caches, at the bench's thread count).
Per contender and batch size (1 and 8 sequences, greedy, a ``--prompt-len`` prompt, ``--new-tokens``
new tokens) it reports decode and prefill tokens/s, the bytes a decode step reads (dense weights +
the experts the batch routes to: ``E * (1 - (1 - k/E)^B)`` per layer for a random router, in the
contender's format) and the share of the bound reached.

Contenders, on the same random Qwen3-MoE weights (``--hidden 1024 --experts 64 --top-k 8 --width
768 --layers 8`` by default: a ~1.2 B-parameter model whose experts stream far past the caches), each
loaded in turn (one model in memory at a time) and alternated repeat by repeat:

* transformers bf16 (``from_pretrained``, its ``grouped_mm`` experts);
* kinject ``rules/hybrid.yaml`` with ``vars.experts_compute=host``: the ``torch-host`` kernels in
  bf16, ``int8`` and ``int4`` (``vars.experts_host_format``; int8 and int4 through kinject's compiled
  grouped GEMV, ``pipeline.host_gemv: exact``: bf16 too where it has torch's bits, on AMX), int8 with torch's
  own int8 kernel (``host_gemv: torch``), bf16 through the chain's next kernel (``torch-grouped``,
  what the host computed with before), and, labelled tuned, bf16 and int8 with ``host_gemv: fast``
  (bf16 through the compiled GEMV also where its bits are not torch's);
* llama.cpp (``llama_cpp`` importable, and a GGUF writer): the same weights as GGUF BF16, Q8_0
  and Q4_K (Q4_K made by llama.cpp's own quantizer from the BF16 file), batch 1 only (its Python
  API decodes one sequence), on its repacked CPU weights (its default) where they run a whole prompt
  here, else on plain ones; and, labelled tuned, Q8_0 and Q4_K on repacked weights with the prompt fed
  one token at a time where only that survives (their fastest decode on such a CPU; an AMX-INT8 VM).
  Otherwise its rows say why they were not run. Those files quantize every matrix, the attention's and
  the output's too, while kinject's low-bit rows quantize the experts alone: at equal bytes
  (:func:`equal_bytes_gguf`) the same weights are also written with only the experts quantized (Q8_0
  from the weights; Q4_K: llama.cpp's own Q4_K_M experts, every other matrix the BF16 file's), and a
  kinject row is compared with that file where it ran (:func:`vs_llama`).

A llama.cpp row's bytes per step are its file's (:func:`gguf_step_bytes`: every tensor in its own type),
not the bytes kinject would read in that format: its bound and share are those of the bytes it reads.
The machine's streaming read moves with its neighbours (24-53 GB/s within an hour on the bench's VM),
so it is probed again right before each contender's timed repeat, and a row's bound is its best
repeat's bytes over the bandwidth probed beside that repeat.
"""

from __future__ import annotations

import gc
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BATCHES = (1, 8)
REPROBE_MIB = 512                 # the streaming read probed before each timed repeat (about 0.2 s on 2 cores)
# the llama.cpp format each kinject expert format is compared with (bytes per weight nearest)
LLAMA_COUNTERPART = {"bf16": "BF16", "int8": "Q8_0", "int4": "Q4_K"}
# a GGUF kind with only the experts quantized: the suffix of its name (kinject's low-bit rows' bytes)
EXPERTS_ONLY = "-experts"
# GGUF tensor-name substrings kept BF16 in an experts-only file (attention, output, token embedding)
DENSE_BF16 = {"attn_": "BF16", "output.weight": "BF16", "token_embd": "BF16"}
# bytes per weight of each expert format (values + scales), at the bench's shapes; int4: format_bytes
FORMAT_BYTES = {"bf16": 2.0, "int8": 1.0, "Q8_0": 34 / 32, "Q4_K": 144 / 256, "BF16": 2.0}


def format_bytes(fmt: str, hidden: int, width: int) -> float:
    """Bytes per expert weight of ``fmt`` as kinject holds it here: int4 in kinject's own layout (a
    bfloat16 scale per 32 codes) where its kernel takes the widths, else in torch's packing (a scale and
    a zero point per 32)."""
    if fmt != "int4":
        return FORMAT_BYTES[fmt]
    from kinject.engine import host_gemv

    g = host_gemv.load()
    own = g is not None and g.int4_takes(hidden) and g.int4_takes(width)
    return 0.5 + (2 if own else 4) / 32


def stream_bandwidth(threads: int, mib: int = 1024, repeats: int = 5) -> float:
    """Bytes/s of the best streaming read torch does here at ``threads`` threads: the max over a
    float32 sum and a bfloat16 matrix-vector product over a ``mib`` MiB buffer (a reduction whose
    arithmetic hides under the reads), best of ``repeats``."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = mib * 2**20
        buf = torch.ones(n // 4, dtype=torch.float32)
        rows = 8192
        mat = torch.ones(n // 2 // rows, rows, dtype=torch.bfloat16)
        vec = torch.ones(rows, dtype=torch.bfloat16)
        best = 0.0
        for fn in (lambda: buf.sum(), lambda: torch.mv(mat, vec)):
            fn()
            for _ in range(repeats):
                t0 = time.perf_counter()
                fn()
                best = max(best, n / (time.perf_counter() - t0))
        return best
    finally:
        torch.set_num_threads(old)


@dataclass
class Shape:
    hidden: int
    experts: int
    top_k: int
    width: int
    layers: int
    vocab: int = 0
    dense_params: int = 0            # every parameter outside the experts (embeddings, attention, norms, router)

    def expert_params(self) -> int:
        return 3 * self.hidden * self.width

    def routed_share(self, batch: int) -> float:
        """The share of a layer's experts a random router picks for ``batch`` rows: ``1 - (1 - k/E)^B``."""
        return 1 - (1 - self.top_k / self.experts) ** batch

    def step_bytes(self, batch: int, fmt: str) -> float:
        """Bytes one decode step reads: the dense weights (bf16; the embedding row only) and the
        experts a random router picks for ``batch`` rows, in ``fmt``."""
        unique = self.experts * self.routed_share(batch)
        dense = (self.dense_params - self.vocab * self.hidden) * 2      # the embedding table is not read whole
        return dense + self.layers * unique * self.expert_params() * format_bytes(fmt, self.hidden, self.width)


def build_model(workdir: Path, shape: Shape) -> Path:
    """The random Qwen3-MoE of ``shape`` in bfloat16, saved once under ``workdir`` (transformers'
    own layout, the fixture's tokenizer)."""
    from kinject.testing import save_tiny_model

    out = workdir / f"qwen3moe_h{shape.hidden}_e{shape.experts}_k{shape.top_k}_i{shape.width}_l{shape.layers}"
    if not (out / "config.json").is_file():
        heads = max(1, shape.hidden // 64)
        save_tiny_model("qwen3_moe", out, dtype=torch.bfloat16, draw_in_dtype=True, hidden_size=shape.hidden,
                        num_hidden_layers=shape.layers, num_attention_heads=heads,
                        num_key_value_heads=max(1, heads // 4), intermediate_size=4 * shape.hidden,
                        num_experts=shape.experts, num_experts_per_tok=shape.top_k,
                        moe_intermediate_size=shape.width, max_position_embeddings=2048)
    return out


@dataclass
class Contender:
    name: str
    fmt: str                                    # the experts' format (bytes per weight)
    kind: str                                   # hf | kinject | llama
    sets: tuple[str, ...] = ()
    gguf: str | None = None
    decode: dict[int, list[float]] = field(default_factory=dict)
    prefill: dict[int, list[float]] = field(default_factory=dict)
    tokens: dict[int, torch.Tensor] = field(default_factory=dict)
    why_not: str | None = None
    repacked: bool | None = None                # llama.cpp: its repacked CPU weights run here (None: not probed)
    prompt_batch: int = 512                     # llama.cpp: tokens per decode call (1: the prompt one token at a time)
    step_bytes: dict[int, float] = field(default_factory=dict)   # llama.cpp: its file's bytes a step (gguf_step_bytes)
    bandwidth: list[float] = field(default_factory=list)          # the streaming read probed before each timed repeat


def contenders() -> list[Contender]:
    host = ("vars.experts_compute=host",)
    return [Contender("transformers bf16 (grouped_mm)", "bf16", "hf"),
            Contender("kinject bf16, torch-grouped (previous host kernel)", "bf16", "kinject",
                      (*host, "pipeline.host_kernel=torch-grouped")),
            Contender("kinject bf16, torch-host", "bf16", "kinject", host),
            Contender("kinject int8, torch-host", "int8", "kinject", (*host, "vars.experts_host_format=int8")),
            Contender("kinject int4 (group 32), torch-host", "int4", "kinject", (*host, "vars.experts_host_format=int4")),
            Contender("kinject int8, host_gemv: torch (torch's int8 kernel)", "int8", "kinject",
                      (*host, "vars.experts_host_format=int8", "pipeline.host_gemv=torch")),
            Contender("kinject bf16, host_gemv: fast (tuned)", "bf16", "kinject",
                      (*host, "pipeline.host_gemv=fast")),
            Contender("kinject int8, host_gemv: fast (tuned)", "int8", "kinject",
                      (*host, "vars.experts_host_format=int8", "pipeline.host_gemv=fast")),
            Contender("llama.cpp BF16", "BF16", "llama", gguf="BF16"),
            Contender("llama.cpp Q8_0", "Q8_0", "llama", gguf="Q8_0"),
            Contender("llama.cpp Q4_K", "Q4_K", "llama", gguf="Q4_K"),
            Contender("llama.cpp Q8_0 experts, the rest BF16 (kinject's bytes)", "Q8_0", "llama",
                      gguf="Q8_0" + EXPERTS_ONLY),
            Contender("llama.cpp Q4_K_M experts, the rest BF16 (kinject's bytes)", "Q4_K", "llama",
                      gguf="Q4_K" + EXPERTS_ONLY),
            # where llama.cpp's repacked weights (its default) crash on a prompt of several tokens: the
            # same weights with the prompt fed one token at a time, its fastest decode on such a CPU
            Contender("llama.cpp Q8_0, repacked, prompt one token at a time (tuned)", "Q8_0", "llama", gguf="Q8_0",
                      prompt_batch=1),
            Contender("llama.cpp Q4_K, repacked, prompt one token at a time (tuned)", "Q4_K", "llama", gguf="Q4_K",
                      prompt_batch=1)]


def _load(c: Contender, model_dir: Path, threads: int):
    import kinject
    from kinject.rules import builtin_rules_dir

    torch.set_num_threads(threads)
    if c.kind == "hf":
        from transformers import AutoModelForCausalLM
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    model = kinject.from_pretrained(str(model_dir), str(builtin_rules_dir() / "hybrid.yaml"), list(c.sets))
    ids = torch.tensor([[1, 2, 3]])
    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, do_sample=False)  # kernels built
    return model


def _time_generate(model, batch: dict, new_tokens: int, pad: int) -> tuple[float, float, torch.Tensor]:
    """(prefill seconds, decode seconds for ``new_tokens - 1`` tokens, the tokens), from one ``generate``:
    a streamer stamps the time each token is chosen (the first: the prefill's), so no difference of two
    runs (which a loaded machine can make negative) enters the numbers. The decode loop is the one
    llama.cpp's contender runs: greedy, ``new_tokens`` tokens whatever they are (no end-of-sequence
    token: ``eos_token_id=None``), and no logits processor (``min_new_tokens`` or a stamping one is one
    ``inspect.signature`` per processor per step in transformers, about a tenth of a millisecond a
    token that neither a chat nor llama.cpp pays)."""
    from transformers.generation.streamers import BaseStreamer

    stamps: list[float] = []

    class Stamp(BaseStreamer):
        def put(self, value):
            stamps.append(time.perf_counter())    # the prompt (before the prefill), then each new token

        def end(self):
            pass

    t0 = time.perf_counter()
    out = model.generate(**batch, max_new_tokens=new_tokens, do_sample=False, pad_token_id=pad, eos_token_id=None,
                         streamer=Stamp())
    if len(stamps) != new_tokens + 1:
        raise RuntimeError(f"generate made {len(stamps) - 1} tokens, not the {new_tokens} asked")
    return stamps[1] - t0, stamps[-1] - stamps[1], out


def _batch(batch: int, prompt_len: int, vocab: int) -> dict:
    gen = torch.Generator().manual_seed(batch)
    ids = torch.randint(3, vocab, (batch, prompt_len), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


# ---------------------------------------------------------------- llama.cpp


def _llama_skip() -> str | None:
    import importlib.util
    if importlib.util.find_spec("llama_cpp") is None:
        return "llama_cpp is not importable (pip install llama-cpp-python: it builds llama.cpp from source)"
    if importlib.util.find_spec("kinject.io.gguf_writers") is None:
        return "no GGUF writer in this kinject (kinject.io.gguf_writers)"
    return None


def _gguf_file(model_dir: Path, qtype: str) -> Path:
    """``model_dir``'s weights as GGUF ``qtype``: BF16 and Q8_0 written from the weights; Q4_K by
    llama.cpp's own quantizer from the BF16 file (the same weights, llama.cpp's rounding)."""
    path = model_dir / f"model-{qtype}.gguf"
    if path.is_file():
        return path
    if qtype.endswith(EXPERTS_ONLY):
        base = qtype[: -len(EXPERTS_ONLY)]
        if base == "Q4_K":                      # (llama.cpp's quantizer quantizes every matrix: swapped back)
            return equal_bytes_gguf(_gguf_file(model_dir, base), _gguf_file(model_dir, "BF16"), path)
    if qtype == "Q4_K":
        import llama_cpp
        src = _gguf_file(model_dir, "BF16")
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
        params.nthread = torch.get_num_threads()
        rc = llama_cpp.llama_model_quantize(str(src).encode(), str(path).encode(), params)
        if rc != 0:
            raise RuntimeError(f"llama_model_quantize to Q4_K_M failed ({rc})")
        return path
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kinject.io.gguf_writers import save_gguf
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    experts_only = qtype.endswith(EXPERTS_ONLY)
    save_gguf(model, path, qtype[: -len(EXPERTS_ONLY)] if experts_only else qtype,
              tokenizer=AutoTokenizer.from_pretrained(model_dir), types=DENSE_BF16 if experts_only else None)
    return path


def equal_bytes_gguf(quantized: Path, bf16: Path, out: Path) -> Path:
    """``quantized`` (a GGUF file llama.cpp's quantizer wrote: every matrix quantized) with every tensor
    but the experts' (``*_exps``) taken from ``bf16``, the same model's BF16 file, written to ``out``:
    llama.cpp's own quantized experts beside the BF16 attention, output and embedding that kinject's
    low-bit rows read. The metadata are ``quantized``'s; a tensor missing from ``bf16`` is an error."""
    import gguf

    q, b = gguf.GGUFReader(quantized), gguf.GGUFReader(bf16)
    dense = {t.name: t for t in b.tensors}
    tensors = []
    for t in q.tensors:
        if "_exps" in t.name:
            tensors.append(t)
        elif t.name in dense:
            tensors.append(dense[t.name])
        else:
            raise ValueError(f"{bf16}: no tensor {t.name!r} to stand for {quantized}'s")
    arch = q.get_field(gguf.Keys.General.ARCHITECTURE)
    tmp = out.with_name(out.name + ".partial")
    writer = gguf.GGUFWriter(tmp, arch.contents())
    for f in q.fields.values():
        if f.name == gguf.Keys.General.ARCHITECTURE or f.name.startswith("GGUF."):
            continue                            # (the writer writes these itself)
        kind = f.types[0]
        writer.add_key_value(f.name, f.contents(), kind,
                             sub_type=f.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)
    for t in tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in tensors:
        writer.write_tensor_data(t.data, tensor_endianess=q.endianess)
    writer.close()
    tmp.replace(out)                            # (a run killed while writing leaves no half file behind)
    return out


def gguf_step_bytes(path: Path, shape: "Shape", batch: int) -> float:
    """Bytes a decode step of ``batch`` sequences reads from the GGUF file ``path``, each tensor in its
    own type: the experts' (``*_exps``) for the share a random router picks (as :meth:`Shape.step_bytes`),
    every other tensor whole but the token embedding (one row a sequence, not counted there either)."""
    import gguf

    share = shape.routed_share(batch)
    total = 0.0
    for t in gguf.GGUFReader(path).tensors:
        if t.name.startswith("token_embd."):
            continue
        total += int(t.n_bytes) * (share if "_exps" in t.name else 1.0)
    return total


_PROBE = ("import sys, llama_cpp; llm = llama_cpp.Llama(model_path=sys.argv[1], n_threads=int(sys.argv[2]), "
          "n_ctx=64, n_batch=int(sys.argv[3]), verbose=False); llm.eval(list(range(1, 17)))")


def _llama_buffers(c: Contender, path: Path, threads: int, probed: dict) -> str | None:
    """Sets ``c.repacked`` (llama.cpp's repacked weights, its default, where they run whole prompts here)
    and says why ``c`` is not run, if it is not: the one-token-at-a-time row runs only where the default
    crashes on a whole prompt and repacked weights survive one token at a time. ``probed`` caches the
    probes (one child process each) by file and prompt batch."""
    def runs(batch: int) -> bool:
        if (path, batch) not in probed:
            probed[path, batch] = repacked_runs(path, threads, prompt_batch=batch)
        return probed[path, batch]

    whole = runs(64)
    if c.prompt_batch > 1:
        c.repacked = whole
        if not whole:
            c.name += " (no repacked weights: they crash here)"
        return None
    if whole:
        return "its repacked weights take whole prompts here: the row above uses them"
    c.repacked = runs(1)
    return None if c.repacked else "its repacked weights crash here even one token at a time"


def repacked_runs(path: Path, threads: int, prompt_batch: int = 64) -> bool:
    """Whether llama.cpp's extra CPU buffer types (weights repacked for its AMX / AVX-512 kernels,
    its default) run ``path`` on this CPU: probed in a child process, because where they fail
    (an AMX_INT8 CPU in a VM: Q8_0 and Q4_K prefills crashed with a segmentation fault) the whole
    process dies. ``prompt_batch``: tokens per decode call of the probe's 16-token prompt (1: one at a time)."""
    import subprocess
    import sys

    try:
        done = subprocess.run([sys.executable, "-c", _PROBE, str(path), str(threads), str(prompt_batch)],
                              capture_output=True, timeout=900)
    except subprocess.TimeoutExpired:
        return False
    return done.returncode == 0


class LlamaModel:
    """llama.cpp on one GGUF file through llama-cpp-python: prefill and greedy decode of one sequence.
    ``repacked``: llama.cpp's default extra CPU buffer types (False: plain ones, see :func:`repacked_runs`);
    ``prompt_batch``: tokens per decode call (1: the prompt one token at a time)."""

    def __init__(self, path: Path, threads: int, ctx: int, repacked: bool = True, prompt_batch: int = 512):
        import llama_cpp
        import llama_cpp.llama as api

        default = api.llama_cpp.llama_model_default_params

        def plain():                      # llama-cpp-python builds its model params from this function
            params = default()
            params.use_extra_bufts = False
            return params

        if not repacked:
            api.llama_cpp.llama_model_default_params = plain
        try:
            self.llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_threads_batch=threads, n_ctx=ctx,
                                       n_batch=prompt_batch, verbose=False, logits_all=False)
        finally:
            api.llama_cpp.llama_model_default_params = default

    def time(self, ids: list[int], new_tokens: int) -> tuple[float, float, list[int]]:
        """(prefill seconds, decode seconds, the greedy tokens). Each next token is the argmax of the
        logits llama.cpp computed for the last position (``llama_get_logits_ith(ctx, -1)``): without
        ``logits_all`` llama-cpp-python leaves ``Llama.scores`` unwritten, and reading it fed one
        constant token at every step instead of llama.cpp's own greedy choice."""
        import llama_cpp
        import numpy as np

        llm = self.llm
        vocab = llm.n_vocab()
        llm.reset()
        t0 = time.perf_counter()
        llm.eval(ids)
        t1 = time.perf_counter()
        out = []
        for _ in range(new_tokens):
            tok = int(np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm.ctx, -1), shape=(vocab,)).argmax())
            out.append(tok)
            llm.eval([tok])
        return t1 - t0, time.perf_counter() - t1, out


# ---------------------------------------------------------------- the run


def run(args) -> str:
    from transformers import AutoConfig

    from kinject.bench.common import provenance

    torch.set_num_threads(args.threads)
    shape = Shape(args.hidden, args.experts, args.top_k, args.width, args.layers)
    model_dir = build_model(Path(args.workdir), shape)
    cfg = AutoConfig.from_pretrained(model_dir)
    shape.vocab = cfg.vocab_size
    total = 0
    from safetensors import safe_open
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            for k in fh.keys():
                if ".experts." not in k:
                    n = 1
                    for d in fh.get_slice(k).get_shape():
                        n *= d
                    total += n
    shape.dense_params = total
    load = open("/proc/loadavg").read().split()[:3]
    bandwidth = stream_bandwidth(args.threads)
    batches = tuple(args.batches)
    cs = [c for c in contenders() if not args.only or any(o in c.name for o in args.only)]
    why = _llama_skip()
    for c in cs:
        if c.kind == "llama" and why:
            c.why_not = why
    pad = cfg.pad_token_id if cfg.pad_token_id is not None else 0
    prompts = {b: _batch(b, args.prompt_len, cfg.vocab_size) for b in batches}
    probed: dict = {}                                          # (GGUF file, prompt batch) -> repacked weights run
    for rep in range(args.repeats + 1):                        # repeat 0 warms up (files, kernels, caches)
        new = args.new_tokens if rep else min(args.new_tokens, args.warmup_tokens)
        for c in cs:
            if c.why_not:
                continue
            if rep:
                c.bandwidth.append(stream_bandwidth(args.threads, mib=REPROBE_MIB, repeats=3))
            try:
                if c.kind == "llama":
                    path = _gguf_file(model_dir, c.gguf)
                    if not c.step_bytes:
                        c.step_bytes = {1: gguf_step_bytes(path, shape, 1)}
                    if c.repacked is None:
                        c.why_not = _llama_buffers(c, path, args.threads, probed)
                        if c.why_not:
                            continue
                    llm = LlamaModel(path, args.threads, args.prompt_len + args.new_tokens + 8, repacked=c.repacked,
                                     prompt_batch=c.prompt_batch)
                    p, d, toks = llm.time(prompts[1]["input_ids"][0].tolist(), new)
                    if rep:
                        c.prefill.setdefault(1, []).append(args.prompt_len / p)
                        c.decode.setdefault(1, []).append(args.new_tokens / d)     # new_tokens evaluated one by one
                    del llm
                else:
                    model = _load(c, model_dir, args.threads)
                    for b in batches:
                        p, d, out = _time_generate(model, prompts[b], new, pad)
                        if rep:
                            c.tokens[b] = out
                            c.prefill.setdefault(b, []).append(b * args.prompt_len / p)
                            c.decode.setdefault(b, []).append(b * (args.new_tokens - 1) / d)
                    del model
            except Exception as exc:                     # noqa: BLE001 - a contender's failure is its row
                c.why_not = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}"
                logger.exception("%s failed", c.name)
            gc.collect()
            print(f"repeat {rep}: {c.name} done", flush=True)
    load_after = open("/proc/loadavg").read().split()[:3]
    probes = [v for c in cs for v in c.bandwidth] or [bandwidth]
    ref = next((c for c in cs if c.kind == "hf" and c.tokens), None)
    lines = [f"kinject bench host-experts — Qwen3-MoE random weights, hidden {shape.hidden}, {shape.experts} experts "
             f"top-{shape.top_k} of width {shape.width}, {shape.layers} layers, vocab {shape.vocab}; every expert on the "
             f"host; {args.threads} threads, prompt {args.prompt_len}, {args.new_tokens} new tokens, greedy, best of "
             f"{args.repeats} after a warm-up, contenders alternated",
             f"memory bandwidth (best streaming read, {args.threads} threads): {bandwidth / 1e9:.1f} GB/s at the start, "
             f"{min(probes) / 1e9:.1f}-{max(probes) / 1e9:.1f} GB/s before the timed repeats; "
             f"load average before {' '.join(load)}, after {' '.join(load_after)}", "",
             "| contender | batch | decode tok/s | bytes / step | bound tok/s | share of bound | prefill tok/s | "
             "vs llama.cpp (decode / prefill) | tokens = transformers |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | :---: |"]
    for b in batches:
        for c in cs:
            if c.why_not:
                if b == batches[0]:
                    lines.append(f"| {c.name} | - | not run: {c.why_not} | | | | | | |")
                continue
            if b not in c.decode:
                continue
            tps, pre = max(c.decode[b]), max(c.prefill[b])
            nbytes = c.step_bytes.get(b) or shape.step_bytes(b, c.fmt)
            best = c.decode[b].index(tps)
            bound = b * (c.bandwidth[best] if best < len(c.bandwidth) else bandwidth) / nbytes
            same = ""
            if ref is not None and b in c.tokens and b in ref.tokens:
                same = "yes" if torch.equal(c.tokens[b], ref.tokens[b]) else "no"
            lines.append(f"| {c.name} | {b} | {tps:.1f} | {nbytes / 2**20:.0f} MiB | {bound:.1f} | {tps / bound:.0%} | "
                         f"{pre:.1f} | {vs_llama(c, cs, b)} | {same} |")
    lines += ["", provenance()]
    return "\n".join(lines)


def vs_llama(c: Contender, cs: list[Contender], batch: int) -> str:
    """A kinject row's decode and prefill tokens/s over llama.cpp's in its counterpart format
    (:data:`LLAMA_COUNTERPART`; the untuned llama.cpp row of that format with only the experts quantized,
    kinject's bytes, where it ran, else the first untuned row of that format), each the best of its
    repeats: the batch-1 comparison this bench is read by. Empty where there is no such llama.cpp row
    at ``batch`` (llama.cpp decodes one sequence)."""
    want = LLAMA_COUNTERPART.get(c.fmt) if c.kind == "kinject" else None
    ran = [o for o in cs if o.kind == "llama" and o.prompt_batch > 1 and batch in o.decode and not o.why_not]
    # (never the tuned one-token-at-a-time row); at kinject's bytes where that file ran: only experts quantized
    ref = next((o for o in ran if want and o.gguf == want + EXPERTS_ONLY), None) or \
        next((o for o in ran if o.gguf == want), None)
    if ref is None or batch not in c.decode:
        return ""
    return (f"{max(c.decode[batch]) / max(ref.decode[batch]):.2f}× / "
            f"{max(c.prefill[batch]) / max(ref.prefill[batch]):.2f}× {ref.gguf}")


def main(args) -> int:
    text = run(args)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 0


def add_arguments(s) -> None:
    s.add_argument("--hidden", type=int, default=1024)
    s.add_argument("--experts", type=int, default=64)
    s.add_argument("--top-k", type=int, default=8)
    s.add_argument("--width", type=int, default=768, help="each expert's intermediate width")
    s.add_argument("--layers", type=int, default=8)
    s.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    s.add_argument("--prompt-len", type=int, default=32)
    s.add_argument("--new-tokens", type=int, default=64)
    s.add_argument("--repeats", type=int, default=3)
    s.add_argument("--warmup-tokens", type=int, default=4, help="new tokens of the warm-up round (default 4)")
    s.add_argument("--threads", type=int, default=2)
    s.add_argument("--only", nargs="+", default=None, help="contenders whose name contains one of these words")
    s.add_argument("--workdir", default="/tmp/kinject-bench/host-experts")
    s.add_argument("--out", default=None, help="write the Markdown table here")
