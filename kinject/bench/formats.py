"""``kinject bench cpu --formats bf16 fp8 nvfp4 gguf-q4_k mxfp4``: the same model stored as quantized releases ship it.

Each format is a checkpoint written in a temporary folder from the bench's own model by kinject's
writers (:mod:`kinject.io.quantized_writers`), so no file ships: ``bf16`` is the model as it is,
``fp8`` the fine-grained FP8 layout (float8_e4m3fn values + float32 128x128 block scales for every
attention and expert projection, as DeepSeek-V3 / Qwen3-FP8 releases store them) and ``mxfp4`` the
gpt-oss layout (experts as e2m1 ``_blocks`` + E8M0 ``_scales``; everything else bf16). MXFP4 exists
for gpt-oss experts only: when the bench's model is not gpt-oss, MXFP4 gets its own table on a tiny
gpt-oss (random weights) against that model in bf16, and the caption says so. ``nvfp4`` is
compressed-tensors' ``nvfp4-pack-quantized`` (every Linear but the router and lm_head; its tokens are
checked against transformers' load of compressed-tensors' own decompression of it, since transformers
does not fill fused experts from per-expert packed keys). ``gguf-q4_k`` is a llama.cpp GGUF with Q4_K
matrices: transformers' GGUF loading knows no Mixtral-style MoE, so it gets its own table on a tiny
Qwen3-MoE (random weights, expert width 768: the width transformers assumes) against that model in bf16.

Every format runs the Klotski rung of the ladder (``rules/klotski.yaml``, KV on the device) in
bfloat16 at the same EMULATED link, so kinject keeps each checkpoint's storage bytes in the host
tier and moves them; the table gives bytes per step (deterministic: what the store moved / model
forwards) and tokens/s. Tokens are checked against transformers' own load of the same checkpoint
(which dequantizes FP8 and MXFP4 on a CPU), not against bf16: quantization changes them.
"""

from __future__ import annotations

import logging
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from kinject.bench.cpu import KV_DEVICE, Row, Rung, mib, run
from kinject.bench.cpu import main as run_ladder

logger = logging.getLogger(__name__)

FORMATS = ("bf16", "fp8", "nvfp4", "gguf-q4_k", "mxfp4")
REFERENCE = "transformers' load of the checkpoint"
KLOTSKI = Rung("Klotski (+ hot-first order)", "klotski", (KV_DEVICE,))
# the tiny gpt-oss of the MXFP4 table: the fixture's width (hidden 256, 8 experts of 256, top-2, 4 heads of 64)
GPT_OSS_SHAPE = dict(hidden_size=256, intermediate_size=256, head_dim=64, num_attention_heads=4,
                     num_key_value_heads=2, num_hidden_layers=4)
# the tiny Qwen3-MoE of the GGUF table: K-quant rows need widths that are multiples of 256
GGUF_SHAPE = {"hidden_size": 256, "moe_intermediate_size": 768, "intermediate_size": 768, "num_attention_heads": 4,
              "num_key_value_heads": 2, "num_hidden_layers": 4}
GGUF_FAMILIES = ("qwen3_moe", "qwen2_moe", "minimax_m2")      # the writer's (kinject.io.gguf_writers.ARCHS)
TARGET_BYTES, TARGET_SPEED = 0.55, 1.6     # the FP8 rung vs bf16: bytes per step at most, tokens/s at least


@dataclass
class FormatRow:
    """One format's Klotski run and what the table reports of it."""

    fmt: str
    row: Row                    # the Klotski rung (tokens compared with REFERENCE)
    expert_bytes: int           # bytes one expert unit holds in its tier and moves per load
    tokens: int                 # new tokens of one timed run

    @property
    def per_step(self) -> float:
        return self.row.bytes_moved / max(self.row.steps, 1)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / statistics.median(self.row.times)

    def link_bound(self, bandwidth_gbs: float) -> bool:
        """The emulated link, not compute, sets the step: bytes per step / bandwidth > compute per step."""
        return self.per_step / (bandwidth_gbs * 1e9) > self.row.compute_s / max(self.row.steps, 1)


def check_formats(formats: list[str], model_dir: Path | None = None) -> list[str]:
    """The requested formats, ``bf16`` first (every ratio is against it), each once; an unknown one,
    or FP8 of a gpt-oss ``model_dir`` (whose fused experts have no per-expert FP8 layout that
    transformers loads), is an error."""
    from kinject.errors import KinjectError

    unknown = sorted(set(formats) - set(FORMATS))
    if unknown:
        raise KinjectError(f"--formats: unknown {', '.join(unknown)} (supported: {', '.join(FORMATS)})")
    if "fp8" in formats and model_dir is not None and is_gpt_oss(model_dir):
        raise KinjectError(f"--formats fp8: {model_dir} is a gpt-oss model, whose experts ship as MXFP4; there is "
                           "no FP8 layout of them that transformers loads to compare tokens with")
    return ["bf16"] + [f for f in FORMATS[1:] if f in formats]


def fp8_checkpoint(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s model in the fine-grained FP8 layout (128x128 blocks), per-expert keys.

    Rebuilt from its config first: ``save_pretrained`` then writes the hub layout (one key per
    expert), which a model loaded from a fused checkpoint would not."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kinject.io.quantized_writers import save_fp8_checkpoint

    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    model.generation_config = loaded.generation_config
    return save_fp8_checkpoint(model.eval(), out, tokenizer=AutoTokenizer.from_pretrained(model_dir))


def mxfp4_checkpoint(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s gpt-oss in gpt-oss-20b's layout (MXFP4 experts, the rest as it is)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kinject.io.quantized_writers import save_mxfp4_checkpoint

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    return save_mxfp4_checkpoint(model, out, tokenizer=AutoTokenizer.from_pretrained(model_dir))


def nvfp4_checkpoint(model_dir: Path, out: Path) -> tuple[Path, Path]:
    """``model_dir``'s model as a compressed-tensors NVFP4 (weight-only) release, and the float
    checkpoint of compressed-tensors' own decompression of it (the reference)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kinject.io.fp4_writers import (
        decompressed_checkpoint,
        save_compressed_fp4_checkpoint,
    )

    loaded = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_config(loaded.config, dtype=torch.bfloat16)
    model.load_state_dict(loaded.state_dict())
    path = save_compressed_fp4_checkpoint(model.eval(), out, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                                          ignore=("lm_head", "re:.*gate$"))
    return path, decompressed_checkpoint(path, out.with_name(out.name + "_reference"))


def gguf_checkpoint(model_dir: Path, out: Path) -> Path:
    """``model_dir``'s model (a family transformers' GGUF loading supports) as a Q4_K GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from kinject.io.gguf_writers import save_gguf

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return save_gguf(model, out / "model-Q4_K.gguf", "Q4_K", tokenizer=AutoTokenizer.from_pretrained(model_dir))


def model_type(model_dir: Path) -> str:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).model_type


def is_gpt_oss(model_dir: Path) -> bool:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).model_type == "gpt_oss"


def run_format(fmt: str, path: Path | tuple[Path, Path], *, bandwidth: float, new_tokens: int, prompt_len: int,
               repeats: int, workdir: Path) -> FormatRow:
    """transformers' load of ``path`` (the reference tokens; of the second path when a pair), then the
    Klotski rung on it, bfloat16."""
    path, reference = path if isinstance(path, tuple) else (path, None)
    rows, meta = run(path, bandwidth=bandwidth, new_tokens=new_tokens, prompt_len=prompt_len, repeats=repeats,
                     workdir=workdir / fmt, ladder=[Rung(REFERENCE, kind="hf"), KLOTSKI], dtype=torch.bfloat16,
                     close=False, reference=reference)
    row = rows[1]
    try:
        expert = next(u for u in row.runtime.store.units.values() if "experts[" in u.name)
        return FormatRow(fmt, row, expert.wire_nbytes, meta["sequences"] * new_tokens)
    finally:
        row.runtime.transfer.close()


def table(caption: str, rows: list[FormatRow], bandwidth: float) -> list[str]:
    """One Markdown table, every ratio against its ``bf16`` row (the first)."""
    base = rows[0]
    lines = [caption, "",
             "| format | expert unit | moved / step | vs bf16 | tokens/s | vs bf16 | compute bubble | link-bound step "
             f"| tokens = {REFERENCE} |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | :---: | :---: |"]
    for r in rows:
        lines.append(f"| {r.fmt} | {mib(r.expert_bytes)} | {mib(r.per_step)} | {r.per_step / base.per_step:.2f}x | "
                     f"{r.tokens_per_s:.1f} | {r.tokens_per_s / base.tokens_per_s:.2f}x | {r.row.bubble:.0%} | "
                     f"{'yes' if r.link_bound(bandwidth) else 'no'} | {'✓' if r.row.same_tokens else '✗'} |")
    return lines


def verdict(rows: list[FormatRow], bandwidth: float) -> list[str]:
    """The FP8 rung against the acceptance target (bytes per step, and tokens/s where the link bounds)."""
    by = {r.fmt: r for r in rows}
    if "fp8" not in by:
        return []
    base, fp8 = by["bf16"], by["fp8"]
    nbytes, speed = fp8.per_step / base.per_step, fp8.tokens_per_s / base.tokens_per_s
    bound = base.link_bound(bandwidth)
    return ["", f"FP8 vs bf16: {nbytes:.2f}x the bytes per step (target <= {TARGET_BYTES}x: "
                f"{'met' if nbytes <= TARGET_BYTES else 'NOT met'}), {speed:.2f}x the tokens/s (target >= "
                f"{TARGET_SPEED}x where the link bounds the step; the bf16 step is "
                + (f"link-bound: {'met' if speed >= TARGET_SPEED else 'NOT met'})" if bound else
                   "compute-bound here, so the target does not apply: lower --formats-bandwidth)")]


def main(model_dir: Path, formats: list[str], *, bandwidth: float, new_tokens: int, prompt_len: int, repeats: int,
         workdir: Path) -> str:
    """Write each format's checkpoint in a temporary folder, run it, return the table(s)."""
    from kinject.testing import save_tiny_model

    formats = check_formats(formats, model_dir)
    kw = dict(bandwidth=bandwidth, new_tokens=new_tokens, prompt_len=prompt_len, repeats=repeats)
    head = (f"link EMULATED at {bandwidth} GB/s, bfloat16, Klotski rules (KV on the device), median of {repeats} "
            "repeats; formats run one after another")
    out: list[str] = []
    with tempfile.TemporaryDirectory(prefix="kinject-formats-") as tmp:
        tmp = Path(tmp)
        gpt_oss = is_gpt_oss(model_dir)
        writers = {"bf16": lambda src, dst: src, "fp8": fp8_checkpoint, "mxfp4": mxfp4_checkpoint,
                   "nvfp4": nvfp4_checkpoint, "gguf-q4_k": gguf_checkpoint}
        gguf_ready = model_type(model_dir) in GGUF_FAMILIES
        own = [f for f in formats if (f != "mxfp4" or gpt_oss) and (f != "gguf-q4_k" or gguf_ready)]
        paths = {f: writers[f](model_dir, tmp / f) for f in own}          # every writer's errors before a run
        rows = [run_format(f, path, workdir=workdir / "formats", **kw) for f, path in paths.items()]
        out += table(f"Stored formats — model {model_dir.name}, {head}", rows, bandwidth) + verdict(rows, bandwidth)
        if "nvfp4" in paths:
            out += ["", ("nvfp4: its tokens are checked against transformers' load of compressed-tensors' own "
                         "decompression of the checkpoint (transformers does not fill fused experts from per-expert "
                         "packed keys).")]
        def stand_in(family: str, shape: dict, fmt: str, workdir_name: str) -> tuple[list, str]:
            """bf16 and ``fmt`` rows of a tiny random ``family`` model (for a format the model cannot
            take), and its shape as the table's title says it."""
            model = save_tiny_model(family, tmp / family, dtype=torch.bfloat16, **shape)
            rows = [run_format(f, writers[f](model, tmp / f"{family}_{f}"), workdir=workdir / workdir_name, **kw)
                    for f in ("bf16", fmt)]
            return rows, ", ".join(f"{k} {v}" for k, v in shape.items())

        if "mxfp4" in formats and not gpt_oss:
            rows, shape = stand_in("gpt_oss", GPT_OSS_SHAPE, "mxfp4", "formats_gpt_oss")
            out += ["", *table(f"MXFP4 — {model_dir.name} is not gpt-oss and MXFP4 stores gpt-oss experts only, so this "
                               f"table is a tiny gpt-oss with random weights ({shape}, 8 experts, top-2) in bf16 and "
                               f"as gpt-oss-20b ships (MXFP4 experts, the rest bf16); {head}", rows, bandwidth)]
        if "gguf-q4_k" in formats and not gguf_ready:
            rows, shape = stand_in("qwen3_moe", GGUF_SHAPE, "gguf-q4_k", "formats_gguf")
            out += ["", *table(f"GGUF Q4_K — transformers' GGUF loading knows no {model_type(model_dir)} MoE, so this "
                               f"table is a tiny Qwen3-MoE with random weights ({shape}, 8 experts, top-2) in bf16 and "
                               f"as a llama.cpp Q4_K file (norms and router F32); {head}", rows, bandwidth)]
    return "\n".join(out)


def cli(args) -> int:
    """``kinject bench cpu --formats ...``: the ladder, then the formats table(s) on its model.
    Bad formats fail before the ladder runs."""
    check_formats(args.formats, Path(args.model) if args.model else None)
    return run_ladder(args, lambda model_dir: main(model_dir, args.formats,
                                                   bandwidth=args.formats_bandwidth or args.bandwidth,
                                                   new_tokens=args.new_tokens, prompt_len=args.prompt_len,
                                                   repeats=args.repeats, workdir=Path(args.workdir)))
