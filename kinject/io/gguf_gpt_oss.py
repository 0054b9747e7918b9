"""gpt-oss GGUF files (llama.cpp's ``GptOssModel`` converter): their config and tensor map.

transformers' own GGUF map for gpt-oss leaves ``ffn_gate_exps`` / ``ffn_up_exps`` and the expert
biases unmapped and reads ``ffn_down_exps`` untransposed, so kinject maps the file itself, as the
converter wrote it (docs/architecture.md "Stored formats"):

- ``blk.N.ffn_{gate,up}_exps.weight`` ``[E, I, H]`` are the even and odd columns of the model's
  fused, interleaved ``gate_up_proj`` ``[E, H, 2I]``; ``.bias`` ``[E, I]`` of ``gate_up_proj_bias``;
- ``blk.N.ffn_down_exps.weight`` ``[E, H, I]`` is ``down_proj`` ``[E, I, H]`` transposed;
- ``blk.N.attn_sinks.weight`` is ``self_attn.sinks``; ``ffn_gate_inp`` the router; ``post_attention_norm``
  the post-attention norm.

Each expert stays its own rows of the GGML blocks; :class:`JoinedSource` dequantizes them and
transposes / interleaves on the compute device. The config's metadata keys are listed exactly;
any other ``gpt-oss.*`` key (an unknown rope scaling, a different swiglu) is refused by the caller.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kinject.engine.disk_sources import StoredSource
from kinject.errors import LoadError

ARCH = "gpt-oss"
MODEL_TYPE = "gpt_oss"

# metadata read here (key suffix -> config attribute), on top of transformers' GGUF_CONFIG_MAPPING
READ_HERE = {"attention.key_length": None, "attention.sliding_window": None, "expert_feed_forward_length": None,
             "rope.scaling.type": None, "rope.scaling.factor": None, "rope.scaling.original_context_length": None}


@dataclass(frozen=True)
class Join:
    """How one expert's dequantized GGUF rows ``[rows, cols]`` make the model's tensor: each
    transposed (``transpose``), then several interleaved column by column (``interleave``)."""

    transpose: bool
    interleave: bool

    def apply(self, values: list[torch.Tensor]) -> torch.Tensor:
        if self.transpose:
            values = [v.transpose(-1, -2) for v in values]
        if self.interleave:
            return torch.stack(values, dim=-1).reshape(*values[0].shape[:-1], -1)
        if len(values) != 1:
            raise ValueError("a join of several GGUF tensors must interleave them")
        return values[0].contiguous()

    def shape(self, shapes: list[tuple[int, int]]) -> tuple[int, int]:
        rows, cols = shapes[0]
        if self.transpose:
            rows, cols = cols, rows
        return rows, cols * (len(shapes) if self.interleave else 1)


_WEIGHTS = Join(transpose=True, interleave=True)
_BIASES = Join(transpose=False, interleave=True)
_DOWN = Join(transpose=True, interleave=False)
_DOWN_BIAS = Join(transpose=False, interleave=False)


def parse(checkpoint) -> dict:
    """transformers' generic parse of the metadata (``GGUF_CONFIG_MAPPING``, as
    ``load_gguf_checkpoint`` applies it), without its gpt-oss rope block, which in 5.24 reads a
    field's length part as its value and fails on every llama.cpp gpt-oss file."""
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    parsed = {"tie_word_embeddings": "output.weight" not in checkpoint.tensors}
    for key in checkpoint.fields:
        prefix, _, rest = key.partition(".")
        prefix = MODEL_TYPE if prefix == ARCH else prefix
        attr = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if attr is not None and attr != -1:
            value = checkpoint.value(key)
            parsed[attr] = MODEL_TYPE if value == ARCH else value
    return parsed


def config_dict(checkpoint, parsed: dict) -> dict:
    """transformers' parse of the metadata (``parsed``), completed and checked: head_dim from
    ``attention.key_length``, the expert width equal to ``feed_forward_length``, the rope scaling
    exactly llama.cpp's yarn (type, factor, original context) over transformers' gpt-oss defaults."""
    where = f"GGUF file {checkpoint.files[0]}"
    parsed.pop("rope_scaling", None)
    parsed["head_dim"] = checkpoint.value(f"{ARCH}.attention.key_length")
    # llama.cpp's gpt-oss: a sliding window on every even layer (set_swa_pattern(2)), full attention on odd
    parsed["sliding_window"] = checkpoint.value(f"{ARCH}.attention.sliding_window")
    parsed["layer_types"] = ["sliding_attention" if i % 2 == 0 else "full_attention"
                             for i in range(parsed["num_hidden_layers"])]
    width = checkpoint.value(f"{ARCH}.expert_feed_forward_length", parsed.get("intermediate_size"))
    if width != parsed.get("intermediate_size"):
        raise LoadError(f"{where}: metadata key '{ARCH}.expert_feed_forward_length' = {width!r} differs from "
                        f"'{ARCH}.feed_forward_length' = {parsed.get('intermediate_size')!r}; gpt-oss has one width")
    rope = {"rope_type": "default", "rope_theta": float(checkpoint.value(f"{ARCH}.rope.freq_base"))}
    kind = checkpoint.value(f"{ARCH}.rope.scaling.type", None)
    if kind is not None:
        if kind != "yarn":
            raise LoadError(f"{where}: metadata key '{ARCH}.rope.scaling.type' = {kind!r}; kinject reads gpt-oss "
                            "with yarn rope scaling only")
        # llama.cpp's yarn: beta_fast 32, beta_slow 1 (not stored), correction dims floored / ceiled
        rope.update(rope_type="yarn", factor=float(checkpoint.value(f"{ARCH}.rope.scaling.factor")),
                    original_max_position_embeddings=int(checkpoint.value(f"{ARCH}.rope.scaling.original_context_length")),
                    beta_fast=32.0, beta_slow=1.0, truncate=True)
    parsed["rope_parameters"] = rope
    parsed.pop("rope_theta", None)
    return parsed


def tensor_map(config) -> tuple[dict[str, str], dict[str, Join]]:
    """GGUF tensor name -> model tensor name, and the :class:`Join` of each expert tensor."""
    to_hf: dict[str, str] = {"token_embd.weight": "model.embed_tokens.weight",
                             "output_norm.weight": "model.norm.weight", "output.weight": "lm_head.weight"}
    joins: dict[str, Join] = {}
    for i in range(config.num_hidden_layers):
        blk, layer = f"blk.{i}", f"model.layers.{i}"
        to_hf[f"{blk}.attn_norm.weight"] = f"{layer}.input_layernorm.weight"
        to_hf[f"{blk}.post_attention_norm.weight"] = f"{layer}.post_attention_layernorm.weight"
        to_hf[f"{blk}.attn_sinks.weight"] = f"{layer}.self_attn.sinks"
        for gguf_name, proj in (("attn_q", "q_proj"), ("attn_k", "k_proj"), ("attn_v", "v_proj"), ("attn_output", "o_proj")):
            for kind in ("weight", "bias"):
                to_hf[f"{blk}.{gguf_name}.{kind}"] = f"{layer}.self_attn.{proj}.{kind}"
        for kind in ("weight", "bias"):
            to_hf[f"{blk}.ffn_gate_inp.{kind}"] = f"{layer}.mlp.router.{kind}"
        experts = f"{layer}.mlp.experts"
        for part in ("gate", "up"):
            to_hf[f"{blk}.ffn_{part}_exps.weight"] = f"{experts}.gate_up_proj"
            to_hf[f"{blk}.ffn_{part}_exps.bias"] = f"{experts}.gate_up_proj_bias"
        to_hf[f"{blk}.ffn_down_exps.weight"] = f"{experts}.down_proj"
        to_hf[f"{blk}.ffn_down_exps.bias"] = f"{experts}.down_proj_bias"
        joins.update({f"{experts}.gate_up_proj": _WEIGHTS, f"{experts}.gate_up_proj_bias": _BIASES,
                      f"{experts}.down_proj": _DOWN, f"{experts}.down_proj_bias": _DOWN_BIAS})
    return to_hf, joins


@dataclass(frozen=True)
class JoinedSource(StoredSource):
    """One expert of a gpt-oss expert tensor: its GGUF rows, dequantized, then :class:`Join`-ed
    (in ``concat_dim``'s place: this source's pieces are never concatenated)."""

    join: Join | None = None

    def assemble(self, tensors: dict[str, torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self.dtype
        values = [self.fmt.dequantize({role: tensors[f"{i}.{role}"] for role in piece}, dtype)
                  for i, piece in enumerate(self.pieces)]
        return self.join.apply(values).reshape(self.shape)


def joined(name, expert, shape, dtype, fmt, pieces, join: Join) -> JoinedSource:
    return JoinedSource(name, expert, shape, dtype, fmt, pieces, None, join=join)
