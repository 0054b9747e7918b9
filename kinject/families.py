"""Every decoder-only MoE family transformers registers, found by scanning its auto mappings.

"Any MoE model" is meant literally, so the list of families is not kept by hand: it is every
``model_type`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` whose config class describes a mixture of
experts (it has an expert-count field). For each one this module builds a tiny, deterministic
model from the config class's own defaults, shrunk by one table of size fields, and reports how
the family lays out its experts, what its router returns and which cache layers it builds.

    families = moe_families()                        # ["afmoe", "aria_text", ..., "zaya"]
    model = build_tiny_family_model("qwen3_next")    # eval(), float32, seeded, eager attention
    report = family_report("qwen3_next")             # experts layout, router output, cache kinds ...

The eight families of :mod:`kinject.testing` keep their hand-tuned :func:`kinject.testing.tiny_config`.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import re
from typing import TYPE_CHECKING, Any

import torch

from kinject import testing

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

logger = logging.getLogger(__name__)

# --------------------------------------------------------------------------------------------
# the scan
# --------------------------------------------------------------------------------------------

# A config describes a mixture of experts when it names how many experts there are.
EXPERT_COUNT_FIELDS: frozenset[str] = frozenset(
    {"num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"}
)
# Families that can be built dense or MoE say which with a switch; the tiny config turns it on.
MOE_SWITCH_FIELDS: tuple[str, ...] = ("is_moe", "enable_moe_block")
# Sub-configs that make a causal-LM entry multimodal (its CausalLM takes pixels / audio / codes).
_MODAL_SUBCONFIG = re.compile(r"vision|audio|image|vq|speech|patcher|encoder")

# Entries that carry expert fields but are not a mixture of experts; model_type -> reason.
# (Empty with transformers 5.23: every entry with an expert-count field is an MoE family.)
NOT_MOE: dict[str, str] = {}
# Scanned families whose tiny model does not build or generate yet; model_type -> reason.
# (Empty with transformers 5.23; tests accept a failure only when it is listed here.)
KNOWN_FAILURES: dict[str, str] = {}


def _config_class(model_type: str):
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return CONFIG_MAPPING[model_type]


def _field_names(cls) -> set[str]:
    names = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    return names | set(getattr(cls, "attribute_map", {}))


def _expert_fields(cls) -> list[str]:
    """Expert-count fields of ``cls`` or of its non-modal sub-configs (DBRX keeps them in ``ffn_config``)."""
    found = sorted(_field_names(cls) & EXPERT_COUNT_FIELDS)
    for key, sub in getattr(cls, "sub_configs", {}).items():
        if not _MODAL_SUBCONFIG.search(key) and key != "text_config" and dataclasses.is_dataclass(sub):
            found += [f"{key}.{name}" for name in sorted(_field_names(sub) & EXPERT_COUNT_FIELDS)]
    return found


def classify_causal_lm_entries() -> dict[str, dict[str, str]]:
    """Every ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` entry with expert fields -> ``{"verdict", "reason"}``.

    ``verdict`` is ``"moe"`` (scanned), ``"multimodal"`` (its CausalLM config wraps vision / audio
    sub-configs; its text model is scanned under its own model_type when transformers registers
    one), ``"encoder_decoder"`` or ``"not_moe"`` (:data:`NOT_MOE`). Entries without any expert
    field are not listed.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    verdicts: dict[str, dict[str, str]] = {}
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        cls = _config_class(model_type)
        subs = getattr(cls, "sub_configs", {})
        text_cls = subs.get("text_config")
        modal = sorted(k for k in subs if _MODAL_SUBCONFIG.search(k))
        fields = _expert_fields(cls)
        if modal and text_cls is not None and dataclasses.is_dataclass(text_cls):
            text_fields = _expert_fields(text_cls)
            if text_fields:
                text_type = getattr(text_cls, "model_type", "?")
                scanned = text_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
                verdicts[model_type] = {
                    "verdict": "multimodal",
                    "reason": f"sub-configs {modal} (multimodal wrapper); its MoE text model "
                    + (f"is scanned as {text_type!r}" if scanned else f"{text_type!r} has no causal-LM entry"),
                }
            continue
        if not fields:
            continue
        if getattr(cls(), "is_encoder_decoder", False):
            verdicts[model_type] = {"verdict": "encoder_decoder", "reason": "is_encoder_decoder=True"}
        elif model_type in NOT_MOE:
            verdicts[model_type] = {"verdict": "not_moe", "reason": NOT_MOE[model_type]}
        else:
            switch = [s for s in MOE_SWITCH_FIELDS if s in _field_names(cls)]
            reason = f"expert fields {fields}" + (f"; MoE behind switch {switch[0]}" if switch else "")
            verdicts[model_type] = {"verdict": "moe", "reason": reason}
    return verdicts


@functools.lru_cache(maxsize=1)
def _moe_families() -> tuple[str, ...]:
    verdicts = classify_causal_lm_entries()
    for model_type, v in verdicts.items():
        logger.info("%-22s %-15s %s", model_type, v["verdict"], v["reason"])
    return tuple(sorted(m for m, v in verdicts.items() if v["verdict"] == "moe"))


def moe_families() -> list[str]:
    """Model types of every decoder-only MoE causal LM transformers registers, sorted."""
    return list(_moe_families())


# --------------------------------------------------------------------------------------------
# tiny configs
# --------------------------------------------------------------------------------------------

# One table: config field -> tiny value, applied to every family whose config class has the field
# and whose default is set (a None / 0 default means "feature off" and stays off).
_TINY: dict[str, Any] = {
    # widths
    "hidden_size": 64, "d_model": 64,
    "intermediate_size": 128, "ffn_hidden_size": 128, "dense_intermediate_size": 128,
    "intermediate_size_mlp": 128, "prefix_dense_intermediate_size": 128,
    # 48, not 32: 2 * 32 == hidden 64 would make [E, 2I, H] and [E, H, 2I] experts indistinguishable
    "moe_intermediate_size": 48, "expert_ffn_hidden_size": 48,
    "shared_expert_intermediate_size": 64, "moe_shared_expert_intermediate_size": 64,
    "shared_intermediate_size": 64, "shared_experts_intermediate_size": 64,
    # attention
    "num_attention_heads": 4, "n_heads": 4, "swa_num_attention_heads": 4,
    "num_key_value_heads": 2, "kv_n_heads": 2, "swa_num_key_value_heads": 2,
    "head_dim": 16, "swa_head_dim": 16, "kv_channels": 16,
    "q_lora_rank": 32, "kv_lora_rank": 32, "o_lora_rank": 16, "o_groups": 2,
    "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "qk_head_dim": 24, "v_head_dim": 16,
    "rotary_dim": 8,
    "sliding_window": 16, "sliding_window_size": 16, "attention_chunk_size": 16, "rel_extent": 16,
    # sparse / indexed attention
    "index_n_heads": 2, "index_head_dim": 16, "index_topk": 16, "index_block_size": 4,
    "index_topk_blocks": 2, "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16,
    # (Kolibri 1.1's indexer: scoring heads at most the query heads of a key head, 4 / 2; a pool of
    # blocks of 4 and a few sink / local tokens, so the tiny prompts are longer than both and select)
    "index_num_heads": 2, "index_pool_size": 8, "index_compression": 4, "index_num_local_tokens": 4,
    "index_num_sink_tokens": 2,
    # linear attention / state space
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_key_heads": 2,
    "linear_num_value_heads": 4, "linear_head_dim": 16, "linear_num_heads": 4,
    "mamba_n_heads": 8, "mamba_num_heads": 8, "mamba_d_head": 16, "mamba_head_dim": 16,
    "mamba_d_state": 16, "ssm_state_size": 16, "mamba_n_groups": 1, "n_groups": 1,
    "mamba_chunk_size": 16, "chunk_size": 16, "mamba_dt_rank": 8, "block_size": 16,
    # experts
    "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8, "moe_num_experts": 8,
    "num_experts_per_tok": 2, "moe_topk": 2, "moe_k": 2, "top_k_experts": 2, "moe_top_k": 2,
    "n_shared_experts": 1, "num_shared_experts": 1, "moe_num_shared_experts": 1,
    "zero_expert_num": 2, "router_hidden_size": 16, "moe_latent_size": 16,
    # misc sizes
    "max_position_embeddings": 512, "max_seq_len": 512, "hidden_size_per_layer_input": 8,
    "hc_lowrank": 8, "ple_embed_dim": 16,
}
# Set even where the default is None: None means "derived" or "unset", and the model reads them.
_TINY_ALWAYS: dict[str, Any] = {
    "head_dim": 16,  # = hidden 64 / 4 heads, so setting it never disagrees with a derived value
    "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 16, "indexer_budget": 16,
    "indexer_compress_ratio": 4,
}
# Expert routing groups (DeepSeek-V3 style): 4 groups of 2 experts, top-2 groups; 1 stays 1.
_GROUPS = {"n_group": 4, "topk_group": 2}
_TOP_K_FIELDS = frozenset({"num_experts_per_tok", "moe_topk", "moe_k", "top_k_experts", "moe_top_k"})
_LAYER_COUNT_FIELDS = ("num_hidden_layers", "n_layers", "num_layers")
_VOCAB_FIELDS = ("vocab_size", "unpadded_vocab_size", "vocab_size_per_layer_input")
_SUBCONFIG_SKIP = re.compile(r"mtp")

# Only where the generic shrink fails; each entry says why.
_FAMILY_OVERRIDES: dict[str, dict[str, Any]] = {
    # default layer_types is None but every decoder layer indexes it; LFM2's kinds are short
    # convolutions and full attention, after one dense layer
    "lfm2_moe": dict(num_hidden_layers=3, layer_types=["conv", "full_attention", "conv"]),
    # the default pattern is all Mamba (linear_attention); Granite 4 interleaves attention layers
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    # attention and MoE layers come from periods (8 / 2), not lists: layer 0 Mamba + dense MLP,
    # layer 1 attention + MoE
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2, expert_layer_offset=1),
    # transformers bug: DbrxAttention reads attn_config.rope_theta, which DbrxAttentionConfig does
    # not define (the default DbrxConfig() cannot build a model either), and clamps q/k/v by
    # clip_qkv unconditionally (default None fails); 8.0 is DBRX-instruct's value, kv_n_heads 1 DBRX's own
    "dbrx": dict(attn_config=dict(kv_n_heads=1, rope_theta=10000.0, clip_qkv=8.0)),
    # CDMoE routes by product keys: sqrt(num_experts) keys per half, so 8 would reach only 4 experts
    "doge": dict(num_experts=16),
    # ZAYA validates num_experts_per_tok == 1
    "zaya": dict(num_experts_per_tok=1),
    # Kolibri 1.1's sparse layers attend to all keys while a query sees no more than index_topk + its
    # sink and local tokens: 4 (+ 2 + 4), not the table's 16, so the tiny prompts (8-19 tokens) select
    "kolibri1_1": dict(index_topk=4),
}


def _defaults(cls) -> Any:
    """A default instance of ``cls`` (its field values are the family's reference sizes)."""
    return cls()


def _get(config, name: str):
    try:
        return getattr(config, name)
    except Exception:  # heterogeneous configs raise for per-layer attributes read globally
        return None


def _layer_count(config) -> tuple[str | None, int | None]:
    for name in _LAYER_COUNT_FIELDS:
        value = _get(config, name)
        if isinstance(value, int):
            return name, value
    return None, None


def _is_index_list(value, n_layers: int) -> bool:
    """``[0, 3, 7]``-style lists of layer indices (strictly increasing ints below ``n_layers``)."""
    return (
        isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
        and all(a < b for a, b in zip(value, value[1:])) and all(0 <= v < n_layers for v in value)
    )


def _is_layer_reference_list(name: str, value, n_layers: int) -> bool:
    """A per-layer list naming, for each layer, an earlier layer or itself (Kolibri 1.1's
    ``kv_source_layers``: whose keys and values each layer attends to): one int per layer, entry
    ``i`` in ``0 .. i``, under a name of layers (``..._layers``)."""
    return (
        name.endswith(("_layers", "_layer_ids")) and isinstance(value, list) and len(value) == n_layers
        and all(isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= i for i, v in enumerate(value))
    )


def _per_layer_lists(config, fields: set[str], n_layers: int) -> tuple[dict[str, list], dict[str, list], dict[str, list]]:
    """The config's lists about layers: per-layer values (``layer_types``), index lists (``[0, 3, 7]``)
    and layer-reference lists (:func:`_is_layer_reference_list`)."""
    per_layer, index_lists, references = {}, {}, {}
    for name in sorted(fields):
        value = _get(config, name)
        if not isinstance(value, list) or not value:
            continue
        if _is_layer_reference_list(name, value, n_layers):
            references[name] = value
        elif _is_index_list(value, n_layers) and len(value) < n_layers \
                or name.endswith(("_layers", "_layer_ids")) and _is_index_list(value, n_layers):
            index_lists[name] = value
        elif len(value) == n_layers:
            per_layer[name] = value
    return per_layer, index_lists, references


def _kept_layers(per_layer: dict[str, list], index_lists: dict[str, list], n_layers: int, minimum: int,
                 references: dict[str, list] | None = None) -> list[int]:
    """Original layer indices to keep: the first layer of every distinct value of every per-layer
    list (so models of mixed layer kinds keep one layer of each kind), at least ``minimum`` layers.
    A layer-reference list counts two kinds, layers naming themselves and layers naming another
    (its values are layer numbers, not kinds: each distinct would keep every layer), and every kept
    layer's referenced layer is kept too, so the cut list still names kept layers
    (:func:`_renumbered_references`)."""
    keep = {0}
    references = references or {}
    kinds = [["own" if v == i else "other" for i, v in enumerate(values)] for values in references.values()]
    for values in [*per_layer.values(), *kinds]:
        first: dict[str, int] = {}
        for i, v in enumerate(values):
            first.setdefault(repr(v), i)
        keep |= set(first.values())
    for indices in index_lists.values():  # a layer inside and one outside every index list
        keep.add(indices[0])
        outside = [i for i in range(n_layers) if i not in indices]
        if outside:
            keep.add(outside[0])
    i = 0
    while len(keep) < minimum and i < n_layers:
        keep.add(i)
        i += 1
    while True:                           # close over references (entry i <= i: this ends)
        named = {values[i] for values in references.values() for i in keep} - keep
        if not named:
            return sorted(keep)
        keep |= named


def _renumbered_references(values: list[int], keep: list[int]) -> list[int]:
    """A layer-reference list cut to the kept layers, each entry the kept position of the layer it named."""
    position = {i: j for j, i in enumerate(keep)}
    return [position[values[i]] for i in keep]


def _shrink_fields(config, fields: set[str]) -> dict[str, Any]:
    kwargs = {}
    for name, tiny in _TINY.items():
        if name in fields:
            default = _get(config, name)
            if default is not None and default is not False and default != 0:
                kwargs[name] = tiny if not isinstance(default, int) or default > tiny or name.startswith(("num_", "n_")) else default
    for name, tiny in _TINY_ALWAYS.items():
        if name in fields and not isinstance(_get(config, name), str):
            kwargs[name] = tiny
    for name in EXPERT_COUNT_FIELDS | _TOP_K_FIELDS:  # always 8 experts top-2 (dots1 defaults None)
        if name in fields and (name in kwargs or _get(config, name) is None):
            kwargs[name] = _TINY[name]
    if "n_shared_experts" in fields and _get(config, "n_shared_experts") is None:
        kwargs["n_shared_experts"] = 1  # dots1 defaults None but sizes its shared MLP by it
    if "kv_lora_rank" in kwargs:  # MLA: every head reads the latent KV; head_dim is the rope part
        if "num_attention_heads" in kwargs:
            kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
        if "head_dim" in kwargs:
            kwargs["head_dim"] = _TINY["qk_rope_head_dim"]
    for name, tiny in _GROUPS.items():
        if name in fields and isinstance(_get(config, name), int) and _get(config, name) > 1:
            kwargs[name] = tiny
    return kwargs


def _dense_prefix_kwargs(config, fields: set[str], mlp_types: list | None) -> dict[str, Any]:
    """Leading dense layers: keep one where the family has them, derived from the kept mlp types."""
    kwargs = {}
    lead = None
    if mlp_types:
        lead = next((i for i, t in enumerate(mlp_types) if t not in ("dense", "mlp")), len(mlp_types))
    for name in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index"):
        if name in fields and isinstance(_get(config, name), int) and _get(config, name) > 0:
            kwargs[name] = lead if lead is not None else 1
    return kwargs


def _generic_tiny_kwargs(model_type: str) -> dict[str, Any]:
    cls = _config_class(model_type)
    config = _defaults(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    kwargs = _shrink_fields(config, fields)
    for switch in MOE_SWITCH_FIELDS:
        if switch in fields:
            kwargs[switch] = True
    if ("num_experts" in kwargs or "moe_intermediate_size" in fields) and _get(config, "moe_intermediate_size") is None \
            and "moe_intermediate_size" in fields:
        kwargs["moe_intermediate_size"] = _TINY["moe_intermediate_size"]  # switch-on families default it to None
    for name in ("num_experts", "top_k_experts"):
        if name in fields and _get(config, name) is None and any(s in fields for s in MOE_SWITCH_FIELDS):
            kwargs[name] = _TINY[name]

    layer_field, n_layers = _layer_count(config)
    per_layer, index_lists, references = _per_layer_lists(config, fields, n_layers) if n_layers else ({}, {}, {})
    has_dense_prefix = any(
        isinstance(_get(config, f), int) and _get(config, f) > 0
        for f in ("first_k_dense_replace", "num_dense_layers", "moe_layer_start_index")
    )
    if n_layers:
        keep = _kept_layers(per_layer, index_lists, n_layers, minimum=3 if has_dense_prefix else 2, references=references)
        keep = [i for i in keep if i < n_layers][: max(len(keep), 2)]
        kwargs[layer_field] = len(keep)
        for name, values in per_layer.items():
            kwargs[name] = [values[i] for i in keep]
        for name, indices in index_lists.items():
            kwargs[name] = [j for j, i in enumerate(keep) if i in indices]
        for name, values in references.items():
            kwargs[name] = _renumbered_references(values, keep)
        mlp_types = kwargs.get("mlp_layer_types")
        kwargs.update(_dense_prefix_kwargs(config, fields, mlp_types))
        if "moe_layer_end_index" in fields and isinstance(_get(config, "moe_layer_end_index"), int):
            kwargs["moe_layer_end_index"] = len(keep) - 1

    # special tokens and vocabulary from kinject.testing's tokenizer
    tok = testing._trained_backend()
    vocab = tok.get_vocab_size()
    for name in _VOCAB_FIELDS:
        if name in fields and _get(config, name) is not None:
            kwargs[name] = vocab
    for attr, key in (("pad_token_id", "pad_token"), ("bos_token_id", "bos_token"), ("eos_token_id", "eos_token")):
        kwargs[attr] = tok.token_to_id(testing.SPECIAL_TOKENS[key])
    kwargs["initializer_range"] = testing._INIT_STD
    kwargs["tie_word_embeddings"] = False

    # non-modal sub-configs (DBRX's attn_config / ffn_config) shrink by the same table
    for key, sub_cls in getattr(cls, "sub_configs", {}).items():
        if _MODAL_SUBCONFIG.search(key) or _SUBCONFIG_SKIP.search(key) or not dataclasses.is_dataclass(sub_cls):
            continue
        sub = _get(config, key)
        if sub is None or not hasattr(sub, "to_dict"):
            continue
        kwargs[key] = _shrink_fields(sub, {f.name for f in dataclasses.fields(sub_cls)})
    kwargs.update(copy.deepcopy(_FAMILY_OVERRIDES.get(model_type, {})))
    return kwargs


def tiny_family_config(model_type: str, **overrides) -> PretrainedConfig:
    """The tiny config of ``model_type``: the config class's defaults shrunk by one size table.

    Hidden 64, heads 4 / kv heads 2, head_dim 16, 8 experts top-2, vocab and special tokens of
    :func:`kinject.testing.tiny_tokenizer`, max positions 512; per-layer lists (``layer_types``,
    ``mlp_layer_types`` ...) cut to the kept layers, which include one layer of every kind. The
    eight families of :data:`kinject.testing.FAMILIES` return :func:`kinject.testing.tiny_config`.
    """
    if model_type in testing.FAMILIES:
        return testing.tiny_config(model_type, **overrides)
    from transformers import AutoConfig

    kwargs = _generic_tiny_kwargs(model_type)
    kwargs.update(overrides)
    return AutoConfig.for_model(model_type, **kwargs)


def build_tiny_family_model(model_type: str, seed: int = 0, dtype: torch.dtype = torch.float32, **config_overrides) -> PreTrainedModel:
    """A seeded ``AutoModelForCausalLM`` of ``model_type`` built from :func:`tiny_family_config`.

    Eval mode, eager attention; same ``(model_type, seed, overrides)`` -> bit-identical weights
    (weights drawn in float32 and re-drawn where HF leaves them flat, as :mod:`kinject.testing` does).
    """
    if model_type in testing.FAMILIES:
        return testing.build_tiny_model(model_type, seed=seed, dtype=dtype, **config_overrides)
    from transformers import AutoModelForCausalLM

    config = tiny_family_config(model_type, **config_overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    testing._make_healthy(model, seed)
    model.to(dtype)
    model.eval()
    return model


# --------------------------------------------------------------------------------------------
# the survey
# --------------------------------------------------------------------------------------------

_EXPERTS_CLASS = re.compile(r"Experts?$|ParallelExperts|ExpertGLU|ExpertMLP|MoA$")
_ROUTER_CLASS = re.compile(r"Router|Gate$|Gating")
_ROUTER_NAMES = frozenset({"gate", "router", "router_gate", "wg"})
_MIXER_CLASS = re.compile(r"Att|Mamba|Mixer|Conv|Delta|SSM|KDA|Recurren|Lightning|MLA")
_NOT_MIXER = re.compile(r"(MoE|Moe|MLP|Experts?|RMSNorm|LayerNorm)$")


def _describe(value) -> str:
    """``f[2,7,8]`` for a float tensor, ``i[14,2]`` for an integer one, tuples in parentheses."""
    if isinstance(value, torch.Tensor):
        kind = "f" if value.is_floating_point() else ("b" if value.dtype == torch.bool else "i")
        return f"{kind}[{','.join(map(str, value.shape))}]"
    if isinstance(value, (tuple, list)):
        return "(" + ", ".join(_describe(v) for v in value) + ")"
    if value is None:
        return "None"
    return type(value).__name__


def _decoder_layers(model) -> tuple[str, torch.nn.ModuleList]:
    """The decoder's layer list: the first ``ModuleList`` named ``layers`` / ``blocks`` / ``h``."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "blocks", "h") and len(module):
            return name, module
    raise LookupError(f"{type(model).__name__}: no decoder layer list found")


def _experts_in(layer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """Routed-experts modules of one decoder layer (outermost only; shared experts excluded)."""
    found: list[tuple[str, torch.nn.Module]] = []
    for name, module in layer.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        is_experts = bool(_EXPERTS_CLASS.search(type(module).__name__)) or (
            leaf == "experts" and isinstance(module, torch.nn.ModuleList)
        )
        if not name or not is_experts or "shared" in name.lower():
            continue
        if any(name.startswith(prev + ".") for prev, _ in found):
            continue
        found.append((name, module))
    return found


def _parent(root: torch.nn.Module, name: str) -> tuple[str, torch.nn.Module]:
    parent_name = name.rsplit(".", 1)[0] if "." in name else ""
    return parent_name, root.get_submodule(parent_name) if parent_name else root


def _experts_layout(name: str, experts: torch.nn.Module) -> dict[str, Any]:
    params = {n: list(p.shape) for n, p in experts.named_parameters()}
    if isinstance(experts, torch.nn.ModuleList):
        first = {n: list(p.shape) for n, p in experts[0].named_parameters()}
        layout = f"ModuleList[{len(experts)}] of {type(experts[0]).__name__}"
        return {"path": name, "class": type(experts).__name__, "layout": layout, "params": {"0." + n: s for n, s in first.items()}}
    ndims = {len(s) for s in params.values()}
    if 3 in ndims:
        layout = "fused 3-D"
    elif params and ndims == {2}:
        layout = "2-D stacked"
    else:
        layout = "other"
    return {"path": name, "class": type(experts).__name__, "layout": layout, "params": params}


def _moe_layer(model) -> tuple[int, torch.nn.Module] | tuple[None, None]:
    _, layers = _decoder_layers(model)
    for i, layer in enumerate(layers):
        if _experts_in(layer) or any(isinstance(m, torch.nn.Embedding) and "embed" in n
                                     for n, m in layer.named_modules() if n.count(".") >= 1):
            return i, layer
    return None, None


def _survey_moe(model, batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Experts, router and shared experts of the first MoE layer, router / experts calls recorded on a forward."""
    index, layer = _moe_layer(model)
    if layer is None:
        return {"moe_layer": None}
    experts = _experts_in(layer)
    info: dict[str, Any] = {"moe_layer": index}
    if experts:
        primary = next(((n, m) for n, m in experts if "attn" not in n and "attention" not in n), experts[0])
        block_name, block = _parent(layer, primary[0])
        if isinstance(primary[1], torch.nn.Module) and sum(1 for n, _ in experts if _parent(layer, n)[0] == block_name) > 1:
            pair = [(n, m) for n, m in experts if _parent(layer, n)[0] == block_name]
            info["experts"] = {
                "path": ", ".join(n for n, _ in pair), "class": "+".join(type(m).__name__ for _, m in pair),
                "layout": "parallel-experts pair",
                "params": {f"{n.rsplit('.', 1)[-1]}.{pn}": list(p.shape) for n, m in pair for pn, p in m.named_parameters()},
            }
        else:
            info["experts"] = _experts_layout(primary[0], primary[1])
        others = [n for n, _ in experts if _parent(layer, n)[0] != block_name]
        if others:
            info["other_experts"] = {n: type(m).__name__ for n, m in experts if n in others}
    else:  # expert weights kept as embedding tables (Doge's CDMoE)
        tables = [(n, m) for n, m in layer.named_modules() if isinstance(m, torch.nn.Embedding)]
        block_name, block = _parent(layer, tables[0][0])
        info["experts"] = {
            "path": ", ".join(n for n, _ in tables), "class": "Embedding", "layout": "embedding tables",
            "params": {n.rsplit(".", 1)[-1] + ".weight": list(m.weight.shape) for n, m in tables},
        }
    info["block"] = {"path": block_name or "<decoder layer>", "class": type(block).__name__,
                     "params": {n: list(p.shape) for n, p in block.named_parameters(recurse=False)}}
    routers = [(n, m) for n, m in block.named_children()
               if (_ROUTER_CLASS.search(type(m).__name__) or n in _ROUTER_NAMES) and "shared" not in n]
    info["router"] = [{"path": n, "class": type(m).__name__,
                       "params": {pn: list(p.shape) for pn, p in m.named_parameters()}} for n, m in routers]
    info["shared"] = {n: type(m).__name__ for n, m in block.named_children() if "shared" in n.lower()}

    calls: dict[str, list[str]] = {"router": [], "experts": []}
    hooks = []
    for _, router in routers[:1]:
        hooks.append(router.register_forward_hook(lambda m, a, out: calls["router"].append(_describe(out))))
    experts_module = (experts[0][1] if experts else None)
    if experts and info["experts"]["layout"] != "parallel-experts pair":
        experts_module = layer.get_submodule(info["experts"]["path"])

        def record(m, args, kwargs):
            described = [_describe(a) for a in args] + [f"{k}={_describe(v)}" for k, v in kwargs.items()]
            calls["experts"].append(", ".join(described))

        hooks.append(experts_module.register_forward_pre_hook(record, with_kwargs=True))
    try:
        with torch.no_grad():
            model(**batch, use_cache=False)
    finally:
        for h in hooks:
            h.remove()
    info["router_output"] = calls["router"][0] if calls["router"] else None
    info["experts_call"] = calls["experts"][0] if calls["experts"] else None
    # called with the routing (indices / weights) beside the hidden states, as transformers' fused experts are
    info["experts_get_routing"] = bool(calls["experts"]) and calls["experts"][0].count("[") > 1
    info["zero_experts"] = {k: v for k, v in model.config.to_dict().items() if "zero_expert" in k}
    return info


def _mixers(model) -> list[str]:
    """Per decoder layer, the class names of its token mixers (attention, SSM, conv, linear attention)."""
    _, layers = _decoder_layers(model)
    out = []
    for layer in layers:
        kinds = []
        for _, child in layer.named_children():
            if isinstance(child, torch.nn.ModuleList) and len(child) and _MIXER_CLASS.search(type(child[0]).__name__):
                kinds.append(f"{len(child)}x{type(child[0]).__name__}")
            elif _MIXER_CLASS.search(type(child).__name__) and not _NOT_MIXER.search(type(child).__name__):
                kinds.append(type(child).__name__)
        out.append("+".join(kinds) or "none")  # e.g. Nemotron-H's MoE-only / MLP-only layers
    return out


def mixer_kinds(model) -> list[str]:
    """Per decoder layer, its token mixers' class names joined by ``+`` (attention, SSM, conv ...)."""
    return _mixers(model)


def _cache_layers(model) -> dict[str, Any]:
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=model.config)
        built = [type(layer).__name__ for layer in cache.layers]
    except Exception as exc:  # noqa: BLE001 - reported, not raised
        built = [f"error: {type(exc).__name__}: {exc}"]
    return {"dynamic_cache_layers": built}


def family_report(model_type: str, seed: int = 0) -> dict[str, Any]:
    """What ``model_type`` looks like to kinject: config class, whether its tiny model builds and
    generates, its experts layout, router output, shared experts, cache layer kinds and mixers.

    Never raises for a family's own failure: each stage's exception is recorded under ``errors``.
    """
    report: dict[str, Any] = {"model_type": model_type, "config_class": _config_class(model_type).__name__,
                              "builds": False, "forward_ok": False, "generate_ok": False, "errors": {}}
    tok = testing.tiny_tokenizer()
    batch = testing.tiny_batch(tok, 3, min_tokens=8)  # [3, L], left-padded
    try:
        config = tiny_family_config(model_type)
        report["n_layers"] = _layer_count(config)[1]
        report["layer_types"] = _get(config, "layer_types")
        model = build_tiny_family_model(model_type, seed=seed)
        report["builds"] = True
        report["model_class"] = type(model).__name__
        report["n_params"] = sum(p.numel() for p in model.parameters())
    except Exception as exc:  # noqa: BLE001
        report["errors"]["build"] = f"{type(exc).__name__}: {exc}"
        return report
    for stage, fn in (("moe", lambda: report.update(_survey_moe(model, batch))),
                      ("mixers", lambda: report.update(mixers=_mixers(model))),
                      ("cache", lambda: report.update(_cache_layers(model)))):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            report["errors"][stage] = f"{type(exc).__name__}: {exc}"
    try:
        with torch.no_grad():
            out = model(**batch, use_cache=True)
        report["forward_ok"] = True
        cache = out.past_key_values
        report["forward_cache"] = type(cache).__name__ if cache is not None else None
        if cache is not None and hasattr(cache, "layers"):
            report["forward_cache_layers"] = [type(layer).__name__ for layer in cache.layers]
        generated = model.generate(**batch, max_new_tokens=4, do_sample=False)
        report["generate_ok"] = tuple(generated.shape) == (batch["input_ids"].shape[0], batch["input_ids"].shape[1] + 4)
        report["generated"] = generated[:, -4:].tolist()
    except Exception as exc:  # noqa: BLE001
        report["errors"]["forward" if not report["forward_ok"] else "generate"] = f"{type(exc).__name__}: {exc}"
    return report


# --------------------------------------------------------------------------------------------
# cache-layer kinds
# --------------------------------------------------------------------------------------------


def cache_layer_kinds(model_type: str) -> tuple[str, ...] | None:
    """transformers' cache-layer classes for the tiny config of ``model_type``, one per decoder layer
    (what ``DynamicCache(config=...)`` builds, the family's modeling module imported first so its own
    layer kinds are registered); None when ``generate`` does not use a ``DynamicCache`` for the family
    (it builds a cache class of its own, as the original MiniMax does)."""
    from transformers import AutoModelForCausalLM, DynamicCache

    config = tiny_family_config(model_type)
    model_cls = AutoModelForCausalLM._model_mapping[type(config)]       # imports the modeling module
    supports = getattr(model_cls, "_supports_default_dynamic_cache", None)
    if callable(supports) and not supports():
        return None
    return tuple(type(layer).__name__ for layer in DynamicCache(config=config).layers)


def families_by_cache_kinds() -> dict[frozenset[str], list[str]]:
    """Every MoE family grouped by the set of cache-layer kinds its tiny config builds (families whose
    ``generate`` keeps a cache class of its own under ``frozenset({"own cache"})``), in scan order."""
    groups: dict[frozenset[str], list[str]] = {}
    for model_type in moe_families():
        kinds = cache_layer_kinds(model_type)
        groups.setdefault(frozenset(kinds) if kinds is not None else frozenset({"own cache"}), []).append(model_type)
    return groups
