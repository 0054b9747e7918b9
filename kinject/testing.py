"""Tiny, deterministic Hugging Face MoE models for tests, examples and CI.

Every kinject operator must reproduce the stock HF model's greedy tokens (docs/architecture.md, "Correctness"). Checking
that needs real HF model classes with realistic module trees (shared experts, MLA, sinks, sliding
windows, fused 3-D experts) but small enough to build in milliseconds on a CPU, with no hub access.
This module builds them: one tiny configuration per supported family, a tokenizer trained locally
on an embedded text, deterministic prompts and left-padded ragged batches, and checkpoints on disk
in either the transformers 5 (fused experts) or the original hub (per-expert keys) layout.

    model = build_tiny_model("mixtral")                  # eval(), float32, seeded
    tok = tiny_tokenizer()
    batch = tiny_batch(tok, 4)                           # {"input_ids", "attention_mask"}, left-padded
    out = model.generate(**batch, max_new_tokens=16, do_sample=False)
    path = save_tiny_model("mixtral", tmp_path, legacy_expert_keys=True)
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import json
import logging
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # transformers is imported lazily: importing kinject.testing stays cheap
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerFast

logger = logging.getLogger(__name__)

FAMILIES: tuple[str, ...] = (
    "mixtral",
    "qwen2_moe",
    "qwen3_moe",
    "deepseek_v2",
    "deepseek_v3",
    "olmoe",
    "phimoe",
    "gpt_oss",
)

# Families whose original hub checkpoints keep one key per expert and for which transformers 5 has
# a checkpoint conversion mapping (transformers/conversion_mapping.py) that fuses them at load.
# GPT-OSS is absent: its hub checkpoints already store fused (MXFP4) experts, so there is no
# per-expert layout to reproduce.
LEGACY_LAYOUT_FAMILIES: frozenset[str] = frozenset(FAMILIES) - {"gpt_oss"}
# Mixed-attention MoE families (linear-attention / state-space mixers between attention layers) with the
# same per-expert hub layout; built by :func:`kinject.families.build_tiny_family_model` (Qwen3-Next:
# gated-delta-net + full attention, transformers fuses its experts with qwen2_moe's mapping).
LEGACY_LAYOUT_MIXED: frozenset[str] = frozenset({"qwen3_next"})

SPECIAL_TOKENS: dict[str, str] = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}
TOKENIZER_VOCAB_SIZE = 512

# Weights are drawn with this std (HF's default 0.02 gives a near-bigram model whose attention is
# almost uniform, so a broken KV cache could still produce the same greedy tokens).
_INIT_STD = 0.1
# Routers get a decisive spread so float rounding differences (micro-batching, other GEMM shapes)
# do not flip top-k choices.
_ROUTER_STD = 0.1
# Zero-initialised biases and unit norm weights are perturbed so that an operator that drops a
# bias or a norm weight changes the logits.
_BIAS_STD = 0.02
_NORM_STD = 0.1

# The built-in training text for the tokenizer and the source of tiny_prompts(): plain English
# about the project plus some Python, so prompts look like both.
_CORPUS = r'''
Mixture of experts models route every token to a few experts out of many. The router looks at the
hidden state of the token and picks the experts with the highest scores. Only the selected experts
run, so the model has many parameters but each token pays for a small part of them. When the model
does not fit in the memory of one device, the experts can live in host memory or on disk and move
to the device only when a token needs them. The hard part is to hide the time of those transfers
behind useful work. A pipeline that splits the batch into several micro batches can compute one
micro batch while the weights for the next one are still on their way. Attention runs once per
micro batch, then the gate routes all tokens of the group, then the experts run in the order in
which their weights arrive. Hot experts that many tokens share are loaded first and stay resident.
Cold experts are fetched on demand and released right after use.

The quick brown fox jumps over the lazy dog. A small cat sleeps in the warm sun near the open
window. The weather today is cold and the wind is strong, but the sky is clear and blue. We walked
along the river to the old bridge and watched the boats go by. She reads a book every week and
writes short notes about the ideas she likes. The train leaves the station at seven in the
morning and arrives in the city before noon. Good tests are small, fast and deterministic; they
fail for one reason and say which one. Numbers are hard to read when they have many digits, so
we round them and report the unit.

def route(hidden_states, weight, top_k=2):
    """Return the indices and weights of the top_k experts for every token."""
    logits = hidden_states @ weight.T
    scores = logits.softmax(dim=-1)
    top_weights, top_index = scores.topk(top_k, dim=-1)
    return top_index, top_weights / top_weights.sum(dim=-1, keepdim=True)


class ExpertStore:
    """Keep one tensor per expert and move it between tiers on request."""

    def __init__(self, experts, device="cpu"):
        self.experts = list(experts)
        self.device = device
        self.resident = set()

    def fetch(self, index):
        if index not in self.resident:
            self.experts[index] = self.experts[index].to(self.device, non_blocking=True)
            self.resident.add(index)
        return self.experts[index]

    def release(self, index):
        self.resident.discard(index)


for step in range(10):
    batch = next(loader)
    output = model.generate(batch["input_ids"], max_new_tokens=32, do_sample=False)
    print(step, output.shape, tokenizer.decode(output[0], skip_special_tokens=True))
'''


# --------------------------------------------------------------------------------------------
# tokenizer and prompts
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _trained_backend():
    """Train the byte-level BPE once per process; the trainer breaks count ties on pair ids, so
    every process gets the same vocabulary and merges (checked across fresh interpreters)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    backend = Tokenizer(models.BPE(unk_token=None))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    specials = [SPECIAL_TOKENS[k] for k in ("pad_token", "bos_token", "eos_token", "unk_token")]  # ids 0..3
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator([_CORPUS], trainer=trainer)
    bos = SPECIAL_TOKENS["bos_token"]
    # Prepend BOS like Llama-style tokenizers do, so position 0 is never a padded or content token.
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, backend.token_to_id(bos))]
    )
    return backend


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    """A fresh byte-level BPE tokenizer (512 tokens) trained locally on the embedded corpus.

    Byte-level, so any text round-trips through encode/decode without ``<unk>``. Prepends ``<s>``,
    pads on the left (decoder-only generation). Saves and reloads with ``save_pretrained`` /
    ``AutoTokenizer.from_pretrained``. A new object per call, since tokenizers are mutable.
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_object=copy.deepcopy(_trained_backend()),
        padding_side="left",
        model_max_length=512,
        **SPECIAL_TOKENS,
    )


@functools.lru_cache(maxsize=1)
def _corpus_words() -> tuple[str, ...]:
    return tuple(_CORPUS.split())


def _spread(rng: random.Random, n: int, span: int) -> list[int]:
    """``n`` offsets in ``[0, span)``, all distinct while ``n <= span`` (so batches are ragged)."""
    offsets = rng.sample(range(span), min(n, span))
    return offsets + [rng.randrange(span) for _ in range(n - len(offsets))]


def tiny_prompts(n: int, min_words: int = 16, seed: int = 0) -> list[str]:
    """``n`` deterministic prompts of ``min_words`` to ``2 * min_words`` words, lengths distinct while possible.

    Each prompt is a window of the embedded corpus (English prose and Python), so the same seed
    always gives the same text.
    """
    if n < 0 or min_words < 1:
        raise ValueError(f"tiny_prompts needs n >= 0 and min_words >= 1, got n={n}, min_words={min_words}")
    words = _corpus_words()
    rng = random.Random(seed)
    prompts = []
    for extra in _spread(rng, n, min_words + 1):
        length = min_words + extra
        if length >= len(words):
            raise ValueError(f"min_words={min_words} is too long for the built-in corpus ({len(words)} words)")
        start = rng.randint(0, len(words) - length)
        prompts.append(" ".join(words[start : start + length]))
    return prompts


def tiny_batch(tokenizer, n: int, min_tokens: int = 16, seed: int = 0) -> dict[str, torch.Tensor]:
    """A left-padded batch of ``n`` prompts with ``min_tokens`` to ``2 * min_tokens`` real tokens each.

    Returns ``{"input_ids": LongTensor[n, L], "attention_mask": LongTensor[n, L]}`` ready for
    ``model(**batch)`` / ``model.generate(**batch)``. Every row starts with ``<s>``; row lengths
    are all different while ``n <= min_tokens + 1``, so padding paths are always exercised.
    """
    if min_tokens < 2:
        raise ValueError(f"tiny_batch needs min_tokens >= 2 (BOS + one token), got {min_tokens}")
    # Byte-level BPE never merges across the space before a word, so a prompt of 2 * min_tokens
    # words has at least that many tokens; each row is then cut to its target length.
    prompts = tiny_prompts(n, min_words=2 * min_tokens, seed=seed)
    offsets = _spread(random.Random(seed), n, min_tokens + 1)
    rows = [tokenizer(p)["input_ids"][: min_tokens + o] for p, o in zip(prompts, offsets)]
    width = max((len(r) for r in rows), default=0)
    input_ids = torch.full((n, width), tokenizer.pad_token_id, dtype=torch.long)  # [n, L]
    attention_mask = torch.zeros((n, width), dtype=torch.long)  # [n, L]
    for i, row in enumerate(rows):
        if len(row) < min_tokens:
            raise RuntimeError(f"tiny_batch: prompt {i} has only {len(row)} < {min_tokens} tokens")
        input_ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
        attention_mask[i, width - len(row) :] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask}


# --------------------------------------------------------------------------------------------
# configs and models
# --------------------------------------------------------------------------------------------

_COMMON: dict[str, Any] = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=_INIT_STD,
    tie_word_embeddings=False,
)

# Per-family arguments, spelled as in transformers 5's configuration_<family>.py.
_FAMILY_KWARGS: dict[str, dict[str, Any]] = {
    "mixtral": dict(
        head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
    ),
    "qwen2_moe": dict(  # shared_expert + shared_expert_gate come with shared_expert_intermediate_size > 0
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=64,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=False, qkv_bias=True,
    ),
    "qwen3_moe": dict(  # head_dim is not a Qwen3MoeConfig field; the model derives 64 / 4 = 16
        intermediate_size=128, moe_intermediate_size=32,
        num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
    ),
    "deepseek_v2": dict(  # MLA: q/k heads are 16 + 8 = 24 wide, v heads 16; layer 0 is a dense MLP
        num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, topk_method="greedy",
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    ),
    "deepseek_v3": dict(  # 4 groups of 2 experts, pick top-2 within the best 2 groups
        num_hidden_layers=3, first_k_dense_replace=1, num_key_value_heads=4,
        intermediate_size=128, moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1,
        num_experts_per_tok=2, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
    ),
    "olmoe": dict(
        intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False,
    ),
    "phimoe": dict(  # Phi-3.5-MoE has biased attention and lm_head
        intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        attention_bias=True, lm_head_bias=True,
    ),
    "gpt_oss": dict(  # layer 0 sliding (window 16 < prompt + new tokens), layer 1 full; sinks in both
        head_dim=16, intermediate_size=32, num_local_experts=8, num_experts_per_tok=2,
        sliding_window=16, layer_types=["sliding_attention", "full_attention"],
        rope_parameters={
            "rope_type": "yarn", "rope_theta": 150000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 128,
        },
    ),
}


def _check_family(family: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; expected one of {', '.join(FAMILIES)}")


def tiny_config(family: str, **overrides) -> PretrainedConfig:
    """The tiny ``PretrainedConfig`` of ``family`` (hidden 64, 8 experts, top-2, vocab = tokenizer's).

    ``overrides`` are passed to the config class last, e.g. ``num_hidden_layers=4``. Special token
    ids come from :func:`tiny_tokenizer` so ``generate`` needs no extra arguments.
    """
    _check_family(family)
    from transformers import AutoConfig

    tok = _trained_backend()
    kwargs: dict[str, Any] = dict(_COMMON)
    kwargs.update(
        vocab_size=tok.get_vocab_size(),
        pad_token_id=tok.token_to_id(SPECIAL_TOKENS["pad_token"]),
        bos_token_id=tok.token_to_id(SPECIAL_TOKENS["bos_token"]),
        eos_token_id=tok.token_to_id(SPECIAL_TOKENS["eos_token"]),
    )
    kwargs.update(copy.deepcopy(_FAMILY_KWARGS[family]))
    if "num_hidden_layers" in overrides and family == "gpt_oss" and "layer_types" not in overrides:
        n = overrides["num_hidden_layers"]
        kwargs["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n)]
    kwargs.update(overrides)
    config = AutoConfig.for_model(family, **kwargs)
    # transformers 5 configs keep unknown kwargs as plain attributes, so a misspelt override would
    # be ignored without a word.
    known = {f.name for f in dataclasses.fields(type(config))} | set(type(config).attribute_map)
    unknown = sorted(set(overrides) - known)
    if unknown:
        logger.warning("tiny_config(%r): unknown config arguments %s (not fields of %s), kept as plain attributes",
                       family, ", ".join(unknown), type(config).__name__)
    return config


_ROUTER_CLASS = re.compile(r"(TopKRouter|TopkRouter)$")


@torch.no_grad()
def _make_healthy(model: torch.nn.Module, seed: int) -> None:
    """Re-draw what HF's ``_init_weights`` leaves constant or too flat, from a generator seeded by ``seed``.

    Routers get a decisive spread; zero biases (attention, expert, router, lm_head, DeepSeek's
    ``e_score_correction_bias``) become small normals; unit norm weights become ``1 + small
    normal``. Everything else keeps HF's init (normal with ``initializer_range``).
    """
    gen = torch.Generator().manual_seed(seed + 0x5EED)

    def normal_(t: torch.Tensor, mean: float, std: float) -> None:
        t.copy_(torch.randn(t.shape, generator=gen, dtype=torch.float32) * std + mean)

    for module_name, module in model.named_modules():
        is_router = bool(_ROUTER_CLASS.search(type(module).__name__))
        for name, param in module.named_parameters(recurse=False):
            if is_router and name == "weight":
                normal_(param, 0.0, _ROUTER_STD)
            elif torch.all(param == 0):
                normal_(param, 0.0, _BIAS_STD)
            elif torch.all(param == 1):
                normal_(param, 1.0, _NORM_STD)
        for name, buf in module.named_buffers(recurse=False):
            if name == "e_score_correction_bias":
                normal_(buf, 0.0, _BIAS_STD)


def build_tiny_model(
    family: str,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "eager",
    draw_in_dtype: bool = False,
    **config_overrides,
) -> PreTrainedModel:
    """A randomly initialised ``AutoModelForCausalLM`` of ``family`` in eval mode.

    Same ``(family, seed, config_overrides)`` -> bit-identical weights. Weights are drawn in float32
    and then cast, so a bfloat16 model is the rounding of the float32 one; ``draw_in_dtype`` draws
    them in ``dtype`` instead (other values, half the peak memory of a bfloat16 model: real widths).
    """
    from transformers import AutoModelForCausalLM

    config = tiny_config(family, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation,
                                             dtype=dtype if draw_in_dtype else torch.float32)
    _make_healthy(model, seed)
    model.to(dtype)
    model.eval()
    n_params = sum(p.numel() for p in model.parameters())
    logger.debug("built tiny %s (seed %d): %d parameters", family, seed, n_params)
    return model


# --------------------------------------------------------------------------------------------
# checkpoints
# --------------------------------------------------------------------------------------------

_FUSED_EXPERT_KEY = re.compile(r"\.experts\.(gate_up_proj|down_proj)$")


def save_tiny_model(
    family: str,
    path,
    seed: int = 0,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_size: int | str | None = None,
    legacy_expert_keys: bool = False,
    build=None,
    **config_overrides,
) -> Path:
    """Build the tiny model and save it with its tokenizer to ``path``; returns ``path``.

    ``legacy_expert_keys=False`` writes the transformers 5 layout (fused ``experts.gate_up_proj``
    ``[E, 2I, H]`` / ``experts.down_proj`` ``[E, H, I]``, GPT-OSS transposed). ``True`` writes the
    layout of the original hub checkpoints, one key per expert (Mixtral/PhiMoE:
    ``block_sparse_moe.experts.E.w1/w2/w3.weight`` and ``block_sparse_moe.gate.weight``; Qwen,
    DeepSeek, OLMoE: ``mlp.experts.E.gate_proj/up_proj/down_proj.weight``), which transformers'
    conversion mapping fuses again at load. GPT-OSS has no such layout (its hub checkpoints are
    fused) and raises ``NotImplementedError``. ``family`` may also be one of
    :data:`LEGACY_LAYOUT_MIXED`, built by the ``build`` given (``kinject.families.build_tiny_family_model``:
    this module does not import :mod:`kinject.families`, which builds on it). ``build(family, seed=, dtype=,
    **config_overrides)`` replaces :func:`build_tiny_model`.

    ``max_shard_size`` (e.g. ``"200KB"``) produces a sharded checkpoint with
    ``model.safetensors.index.json``.
    """
    if build is None:
        if family in LEGACY_LAYOUT_MIXED:
            raise ValueError(f"{family}: pass build=kinject.families.build_tiny_family_model")
        _check_family(family)
        build = build_tiny_model
    if legacy_expert_keys and family not in LEGACY_LAYOUT_FAMILIES | LEGACY_LAYOUT_MIXED:
        raise NotImplementedError(
            f"{family}: transformers has no per-expert checkpoint conversion for this family; "
            "its hub checkpoints already store fused experts"
        )
    path = Path(path)
    model = build(family, seed=seed, dtype=dtype, **config_overrides)
    tokenizer = tiny_tokenizer()
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id"):
        setattr(model.config, attr, getattr(tokenizer, attr))
        setattr(model.generation_config, attr, getattr(tokenizer, attr))
    save_kwargs: dict[str, Any] = {"save_original_format": legacy_expert_keys}
    if max_shard_size is not None:
        save_kwargs["max_shard_size"] = max_shard_size
    # transformers 5 reverts its load-time conversion on save by default (save_original_format=True),
    # which is exactly the hub layout; False keeps the in-memory fused parameter names.
    with no_progress_bars():
        model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    if legacy_expert_keys:
        fused = [k for k in _checkpoint_keys(path) if _FUSED_EXPERT_KEY.search(k)]
        if fused:
            raise NotImplementedError(f"{family}: transformers did not write per-expert keys (e.g. {fused[0]})")
    return path


@contextlib.contextmanager
def no_progress_bars() -> Iterator[None]:
    """Silence transformers' per-shard tqdm bars (noise for kilobyte checkpoints), then restore."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _checkpoint_keys(path: Path) -> list[str]:
    """Tensor names of a (possibly sharded) safetensors checkpoint, without loading tensors."""
    from safetensors import safe_open

    keys: list[str] = []
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            keys.extend(f.keys())
    return keys


# --------------------------------------------------------------------------------------------
# quantized checkpoints, in the layouts the releases ship
# --------------------------------------------------------------------------------------------

_FP8_MAX = 448.0                                            # largest float8_e4m3fn value
# the projections FP8 releases quantize (Qwen3-Next: also the gated-delta-net's in_proj_qkvz / out_proj)
_FP8_WEIGHT = re.compile(r"_proj(_with_mqa|_qkvz)?\.weight$")


def quantize_fp8(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(float8_e4m3fn values, float32 weight_scale_inv)`` of a 2-D weight, as FP8 releases store it:
    one scale per ``block`` (``None``: one per row), ``weight ~= values * scale`` blockwise."""
    rows, cols = weight.shape
    bm, bn = block if block is not None else (1, cols)
    if rows % bm and rows > bm or cols % bn and cols > bn:
        raise ValueError(f"weight {list(weight.shape)} does not split into whole blocks of {list(block)}")
    bm, bn = min(bm, rows), min(bn, cols)
    w = weight.float().reshape(rows // bm, bm, cols // bn, bn)                    # [R/bm, bm, C/bn, bn]
    scale = w.abs().amax(dim=(1, 3)).clamp(min=1e-12) / _FP8_MAX                   # [R/bm, C/bn]
    values = (w / scale[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return values.reshape(rows, cols), scale


def save_tiny_fp8_model(family: str, path, seed: int = 0, *, block: tuple[int, int] | None = (128, 128),
                        dtype: torch.dtype = torch.float32, build=None, **config_overrides) -> Path:
    """A tiny ``family`` checkpoint in the fine-grained FP8 layout of DeepSeek-V3 / Qwen3-FP8 releases.

    Per-expert keys (``experts.N.gate_proj.weight``, as the releases and transformers'
    ``save_pretrained`` write them); every ``*_proj.weight`` (attention, experts, shared experts,
    dense MLPs) stored as ``float8_e4m3fn`` values plus a float32 ``weight_scale_inv`` of block
    scales; config.json gets ``quantization_config: {quant_method: fp8, weight_block_size: block}``
    (``block=None``: per-row scales, ``weight_block_size: null``). Embeddings, norms, routers and
    lm_head stay in ``dtype``."""
    from safetensors.torch import load_file, save_file

    path = save_tiny_model(family, path, seed, dtype=dtype, legacy_expert_keys=True, build=build, **config_overrides)
    for file in sorted(path.glob("*.safetensors")):
        tensors = load_file(str(file))
        for key in [k for k, t in tensors.items() if _FP8_WEIGHT.search(k) and t.dim() == 2]:
            tensors[key], tensors[key + "_scale_inv"] = quantize_fp8(tensors[key], block)
        save_file(tensors, str(file), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        _index_scales(index)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block) if block is not None else None}
    (path / "config.json").write_text(json.dumps(config, indent=2))
    return path


def _index_scales(index: Path) -> None:
    """Add every ``*_scale_inv`` key to a sharded checkpoint's weight map (in its values' file)."""
    data = json.loads(index.read_text())
    weight_map = data["weight_map"]
    for key, file in list(weight_map.items()):
        if _FP8_WEIGHT.search(key):
            weight_map[key + "_scale_inv"] = file
    index.write_text(json.dumps(data, indent=2))
