"""Write a model as llama.cpp's converter does: a GGUF file (or ``-0000N-of-0000M`` shards) with
its tensor names, its metadata keys and a chosen GGML type (tests and benches; models cannot be
downloaded here).

Names come from gguf-py's own tables (``gguf.get_tensor_name_map``, what ``convert_hf_to_gguf.py``
uses); fused experts are written as llama.cpp's 3-D ``blk.N.ffn_{gate,up,down}_exps.weight``; norms,
biases and the router (``ffn_gate_inp``) stay F32 as the converter keeps them. Types gguf-py can
encode (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, MXFP4, BF16, F16) are encoded from the weights; for the others
(the K-quants, IQ4_NL, IQ4_XS) the blocks are random codes with float16 scales set so each tensor
has the weight's spread: a valid file, whose meaning is its dequantization (the reference every
reader is compared with).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from kinject.engine.formats import ggml

ARCHS = {"qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe", "minimax_m2": "minimax-m2", "gpt_oss": "gpt-oss"}
ENCODABLE = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "MXFP4")
# byte offsets of a block's float16 scale (d) and, for types with one, its min scale (dmin); the
# dmin / d ratio that centres the values near zero
_SCALES = {"Q2_K": (80, 82, 1.5), "Q3_K": (108, None, 0), "Q4_K": (0, 2, 7.5), "Q5_K": (0, 2, 15.5),
           "Q6_K": (208, None, 0), "IQ4_NL": (0, None, 0), "IQ4_XS": (0, None, 0)}


def random_blocks(shape: tuple[int, ...], qtype: str, std: float, rng: np.random.Generator) -> np.ndarray:
    """``uint8 [..., rows, row_bytes]`` of ``qtype`` blocks: random codes, scales giving ``std``."""
    from gguf import GGMLQuantizationType, quants

    *lead, cols = shape
    data = rng.integers(0, 256, (*lead, ggml.row_bytes(qtype, cols)), dtype=np.uint8)
    _, size = ggml.BLOCKS[qtype]
    blocks = data.reshape(-1, size)
    d_at, m_at, ratio = _SCALES[qtype]

    def set_scales(d: float) -> None:
        blocks[:, d_at:d_at + 2] = np.float16(d).reshape(1, 1).view(np.uint8)
        if m_at is not None:
            blocks[:, m_at:m_at + 2] = np.float16(d * ratio).reshape(1, 1).view(np.uint8)

    set_scales(1.0)
    unit = float(quants.dequantize(data, GGMLQuantizationType[qtype]).std())
    set_scales(std / unit if unit else 0.0)
    return data


def encode(values: torch.Tensor, qtype: str, rng: np.random.Generator) -> tuple[np.ndarray, str]:
    """One tensor's GGUF data and type name."""
    from gguf import GGMLQuantizationType, quants

    array = values.detach().to(torch.float32).cpu().numpy()
    if qtype == "F32":
        return array, qtype
    if qtype == "F16":
        return array.astype(np.float16), qtype
    if qtype in ENCODABLE:
        return quants.quantize(array, GGMLQuantizationType[qtype]), qtype
    return random_blocks(array.shape, qtype, float(array.std()) or 0.02, rng), qtype


def _keeps_f32(gguf_name: str, values: torch.Tensor) -> bool:
    return values.dim() == 1 or ".ffn_gate_inp." in gguf_name or gguf_name.endswith(".bias")


def gpt_oss_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """GGUF name -> values of a gpt-oss model, as llama.cpp's ``GptOssModel`` converter writes them:
    the interleaved ``gate_up_proj [E, H, 2I]`` split into its even (gate) and odd (up) columns,
    each transposed to ``[E, I, H]``; ``down_proj [E, I, H]`` transposed to ``[E, H, I]``; the expert
    biases split the same way; ``sinks`` as ``attn_sinks.weight``."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.GPT_OSS, model.config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    for hf, t in model.state_dict().items():
        module, _, suffix = hf.rpartition(".")
        values = t.detach()
        if ".mlp.experts." in hf:
            blk = f"blk.{hf.split('.')[2]}"
            if suffix == "gate_up_proj":
                out[f"{blk}.ffn_gate_exps.weight"] = values[..., ::2].transpose(1, 2).contiguous()
                out[f"{blk}.ffn_up_exps.weight"] = values[..., 1::2].transpose(1, 2).contiguous()
            elif suffix == "gate_up_proj_bias":
                out[f"{blk}.ffn_gate_exps.bias"] = values[..., ::2].contiguous()
                out[f"{blk}.ffn_up_exps.bias"] = values[..., 1::2].contiguous()
            elif suffix == "down_proj":
                out[f"{blk}.ffn_down_exps.weight"] = values.transpose(1, 2).contiguous()
            elif suffix == "down_proj_bias":
                out[f"{blk}.ffn_down_exps.bias"] = values
            else:
                raise ValueError(f"gpt-oss expert tensor {hf!r} has no GGUF name")
            continue
        stem = names.get_name(hf if suffix == "sinks" else module)
        if stem is None:
            raise ValueError(f"gguf has no name for {hf!r} (gpt-oss)")
        out[f"{stem}.weight" if suffix == "sinks" else f"{stem}.{suffix}"] = values
    if model.config.tie_word_embeddings:
        out.pop("output.weight", None)
    return out


def gguf_tensors(model: torch.nn.Module, arch: str) -> dict[str, torch.Tensor]:
    """GGUF name -> values, as ``convert_hf_to_gguf.py`` names and shapes them (torch order)."""
    import gguf

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    out: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for hf, t in model.state_dict(keep_vars=True).items():
        if id(t) in seen:            # tied lm_head: the converter writes no output.weight
            continue
        seen.add(id(t))
        module, _, suffix = hf.rpartition(".")
        values = t.detach()
        if suffix == "gate_up_proj":                            # [E, 2I, H] -> gate, up [E, I, H]
            stem = names.get_name(f"{module}.gate_proj")
            gate, up = values.chunk(2, dim=1)
            out[f"{stem}.weight"], out[f"{stem.replace('_gate_', '_up_')}.weight"] = gate, up
            continue
        if suffix == "down_proj":
            out[f"{names.get_name(f'{module}.down_proj')}.weight"] = values
            continue
        stem = names.get_name(module)
        head, _, tail = hf.rpartition("_")
        if stem is None and tail in ("bias", "weight") and names.get_name(head) is not None:
            stem, suffix = names.get_name(head), tail           # e_score_correction_bias -> exp_probs_b.bias
        if stem is None:
            raise ValueError(f"gguf has no name for {hf!r} ({arch})")
        if values.dim() == 2 and values.shape[0] == 1:          # [1, H] gate of the shared expert: llama.cpp's [H]
            values = values[0]
        out[f"{stem}.{suffix}"] = values
    return out


def add_metadata(writer, config, arch: str, n_vocab: int) -> None:
    """The keys ``convert_hf_to_gguf.py`` writes for ``arch`` (Qwen2MoeModel, Qwen3MoeModel, MiniMaxM2Model)."""
    import gguf

    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta") or getattr(config, "rope_theta", 10000.0)
    writer.add_name(f"tiny {arch}")
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(rope))
    writer.add_rope_dimension_count(getattr(config, "rotary_dim", None) or head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(config.num_experts_per_tok)
    writer.add_expert_feed_forward_length(expert_width)
    if getattr(config, "scoring_func", None) == "sigmoid":
        writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    if getattr(config, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
    writer.add_vocab_size(n_vocab)
    if arch == "gpt-oss":                                   # GptOssModel.set_gguf_parameters
        rope = config.rope_parameters
        writer.add_sliding_window(config.sliding_window)
        writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        writer.add_rope_scaling_factor(rope["factor"])
        writer.add_rope_scaling_orig_ctx_len(rope.get("original_max_position_embeddings", 4096))


def add_tokenizer(writer, tokenizer, n_vocab: int) -> None:
    """A byte-level BPE tokenizer as llama.cpp stores one (``tokenizer.ggml.model = gpt2``)."""
    import json

    state = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = state["model"]["vocab"]
    by_id = {i: tok for tok, i in vocab.items()}
    special = {t["id"] for t in state["added_tokens"] if t.get("special")}
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n_vocab)]
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types([3 if i in special else (5 if i not in by_id else 1) for i in range(n_vocab)])
    writer.add_token_merges(merges)
    for kind in ("bos", "eos", "pad"):
        token = getattr(tokenizer, f"{kind}_token_id", None)
        if token is not None:
            getattr(writer, f"add_{kind}_token_id")(token)


def save_gguf(model: torch.nn.Module, path, qtype: str = "Q8_0", *, tokenizer, types: dict[str, str] | None = None,
              split_max_tensors: int = 0, seed: int = 0) -> Path:
    """Write ``model`` to ``path`` (a ``.gguf`` file name; with ``split_max_tensors`` the shards
    ``<stem>-0000N-of-0000M.gguf``, and the first shard's path is returned). Every matrix is
    ``qtype`` except where ``types`` (a GGUF name substring -> type, e.g. ``{"ffn_down_exps": "Q6_K"}``)
    says otherwise; norms, biases and the router stay F32."""
    import gguf

    arch = ARCHS[model.config.model_type]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    writer = gguf.GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    n_vocab = model.config.vocab_size
    add_metadata(writer, model.config, arch, n_vocab)
    add_tokenizer(writer, tokenizer, n_vocab)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if qtype == "Q8_0" else gguf.LlamaFileType.GUESSED)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    tensors = gpt_oss_tensors(model) if arch == "gpt-oss" else gguf_tensors(model, arch)
    for name, values in tensors.items():
        want = "F32" if _keeps_f32(name, values) else next((t for k, t in (types or {}).items() if k in name), qtype)
        data, kind = encode(values, want, rng)
        writer.add_tensor(name, data, raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split_max_tensors:
        shards = sorted(path.parent.glob(f"{path.stem}-*-of-*.gguf"))
        return shards[0]
    return path
