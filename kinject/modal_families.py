"""Every generative MoE family beyond the decoder-only text ones, found by scanning.

:mod:`kinject.families` scans transformers' causal-LM auto mapping. This module scans its other
generative auto mappings -- image-text-to-text, multimodal LM, seq2seq, speech-seq2seq, text-to-audio
-- for model types whose config (or a sub-config, to depth 2) names an expert count, and builds
tiny models of the encoder-decoder ones from the config class's own defaults, shrunk by one table.

    modal_moe_families()            # {"aria": "image-text-to-text", ..., "switch_transformers": "seq2seq"}
    model = build_tiny_seq2seq_model("switch_transformers")
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import inspect
import re
from typing import TYPE_CHECKING

import torch

from kinject import families, testing

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# modality -> transformers' auto mapping of that task (in the order families are reported)
MAPPINGS: dict[str, str] = {
    "image-text-to-text": "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
    "multimodal-lm": "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
    "seq2seq": "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
    "speech-seq2seq": "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
    "text-to-audio": "MODEL_FOR_TEXT_TO_WAVEFORM_MAPPING_NAMES",
}

# Encoder-decoder size fields beyond the decoder table of :mod:`kinject.families`.
_SEQ2SEQ_TINY = {
    "d_ff": 128, "d_kv": 16, "num_heads": 4, "num_layers": 2, "num_decoder_layers": 2,
    "encoder_layers": 2, "decoder_layers": 2, "encoder_ffn_dim": 128, "decoder_ffn_dim": 128,
    "encoder_attention_heads": 4, "decoder_attention_heads": 4,
    # every expert takes every token it is routed (a capacity below the batch's tokens drops some)
    "expert_capacity": 64,
    # every layer a MoE layer (the defaults alternate dense and sparse layers)
    "num_sparse_encoder_layers": 2, "num_sparse_decoder_layers": 2,
    "encoder_sparse_step": 1, "decoder_sparse_step": 1, "sparse_step": 1,
}


def _has_experts(cls, depth: int = 0) -> bool:
    if families._field_names(cls) & families.EXPERT_COUNT_FIELDS:
        return True
    return depth < 2 and any(isinstance(sub, type) and _has_experts(sub, depth + 1)
                             for sub in getattr(cls, "sub_configs", {}).values())


@functools.lru_cache(maxsize=1)
def _scan() -> tuple[tuple[str, str], ...]:
    from transformers.models.auto import modeling_auto
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    text = set(families.moe_families())
    found: dict[str, str] = {}
    for modality, mapping in MAPPINGS.items():
        for model_type in getattr(modeling_auto, mapping, {}):
            if model_type in found or model_type in text or model_type not in CONFIG_MAPPING:
                continue
            if _has_experts(CONFIG_MAPPING[model_type]):
                found[model_type] = modality
    return tuple(sorted(found.items()))


def modal_moe_families() -> dict[str, str]:
    """model_type -> the first generative mapping it is registered in, for every MoE family of
    those mappings that the causal-LM scan (:func:`kinject.families.moe_families`) does not cover."""
    return dict(_scan())


def seq2seq_families() -> list[str]:
    return [m for m, modality in _scan() if modality in ("seq2seq", "speech-seq2seq")]


def tiny_seq2seq_config(model_type: str):
    """The tiny config of an encoder-decoder MoE family: the decoder table of
    :mod:`kinject.families` plus encoder-decoder sizes, 2 encoder and 2 decoder layers, all MoE."""
    from transformers import AutoConfig

    kwargs = families._generic_tiny_kwargs(model_type)
    fields = {f.name for f in dataclasses.fields(families._config_class(model_type))}
    kwargs.update({k: v for k, v in _SEQ2SEQ_TINY.items() if k in fields})
    kwargs["decoder_start_token_id"] = kwargs["pad_token_id"]
    return AutoConfig.for_model(model_type, **kwargs)


def build_tiny_seq2seq_model(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A seeded float32 eval-mode model of the family's seq2seq class (eager attention)."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES

    config = tiny_seq2seq_config(model_type)
    cls = getattr(transformers, MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES[model_type])
    torch.manual_seed(seed)
    model = cls._from_config(config, attn_implementation="eager", dtype=torch.float32)
    testing._make_healthy(model, seed)
    return model.eval()


# Tower sub-configs (vision, audio, ...) shrink by this table: 2 blocks of width 32. Fields that
# feed the text model (a projection's output) take the text width instead (:data:`_TO_TEXT`).
_TOWER_TINY = {
    "hidden_size": 32, "embed_dim": 32, "d_model": 32, "width": 32,
    "depth": 2, "num_hidden_layers": 2, "num_layers": 2, "encoder_layers": 2, "n_layers": 2,
    "num_heads": 2, "num_attention_heads": 2, "num_key_value_heads": 2, "encoder_attention_heads": 2,
    "intermediate_size": 64, "encoder_ffn_dim": 64, "mlp_dim": 64, "head_dim": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4,
    "num_experts_per_tok": 2, "moe_intermediate_size": 32,
}
_TO_TEXT = ("out_hidden_size", "output_dim", "projection_dim", "vision_output_dim", "text_hidden_size",
            "output_hidden_size", "out_dim")


# A tower initialised this flat passes no image through random weights (DeepSeek-OCR 2's SAM encoder
# defaults to 1e-10: every image gives the same features); a tiny tower is drawn with at least this std.
_MIN_INIT_STD = 0.02

_LAYER_FIELDS = ("depth", "num_hidden_layers", "num_layers", "encoder_layers", "n_layers")
# Size fields the tables do not name (an adapter's input, a conv's output, an MoE's inner width)
# are rescaled when they are a simple multiple of a default width (:func:`_rescaled_widths`).
_WIDTH_NAME = re.compile(r"hidden|_dim$|_size$|width|channels")
_NOT_A_WIDTH = re.compile(r"image|patch|vocab|position|pos_|window|token|max_|chunk|kernel|merge|group|bucket"
                          r"|sampl|hop|feature|spatial|temporal|stride|num_|layers|heads|experts")
_WIDTH_RATIOS = (1, 0.5, 2, 3, 4, 6, 8)
# A list of widths (a conv stack's channels, UnlimitedOCR's SAM ``downsample_channels`` = [512, 1024]
# whose last feeds its CLIP encoder of width 1024) is rescaled entry by entry when every entry is.
_LIST_OF_WIDTHS = re.compile(r"channels$|_dims$|hidden_sizes$")


def _rescaled_widths(values: dict, out: dict, widths: list[tuple[int, int]]) -> dict:
    """Tiny values of the size fields of ``values`` no table set: a field that is ``r`` times a
    default width (the sub-config's own first, then the text model's) becomes ``r`` times its tiny
    width (Dots3's ``adapter_in_dim`` = the tower's width, ``adapter_out_dim`` = the text width)."""
    def rescaled(value):
        match = next(((r, tiny) for r in _WIDTH_RATIOS for default, tiny in widths     # equal widths first
                      if default and value == r * default), None)
        return None if match is None else int(match[0] * match[1])

    found = {}
    for name, value in values.items():
        if name in out:
            continue
        if _is_size(value) and _WIDTH_NAME.search(name) and not _NOT_A_WIDTH.search(name):
            if (tiny := rescaled(value)) is not None:
                found[name] = tiny
        elif isinstance(value, list) and value and all(map(_is_size, value)) and _LIST_OF_WIDTHS.search(name):
            tiny = [rescaled(v) for v in value]             # every channel count of a conv stack, or none
            if None not in tiny:
                found[name] = tiny
    return found


def _declared(values: dict, cls) -> dict:
    """The values of the fields ``cls`` declares: a field its ``__post_init__`` computes from others
    (Dots3's audio ``conv_output_size`` = ``downsample_hidden_size`` x mel bins / 8) is left for the
    tiny config to recompute from the shrunk ones, never rescaled on its own."""
    names = families._field_names(cls)
    return {k: v for k, v in values.items() if k in names} if dataclasses.is_dataclass(cls) else values


def _is_size(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _kept_blocks(values: dict, n: int, tiny: int) -> list[int]:
    """Block indices a tower keeps: ``tiny`` blocks, and the first block of every kind its per-block
    kind lists name (Dots3's vision ``mlp_layer_types``: a dense and a sparse block)."""
    kinds = {k: v for k, v in values.items()
             if isinstance(v, list) and len(v) == n and v and all(isinstance(x, str) for x in v)}
    return families._kept_layers(kinds, {}, n, minimum=tiny)


def _per_layer_config(values: dict, keep: list[int], table: dict) -> dict:
    """``per_layer_config`` (layer index -> overrides) re-keyed to the kept blocks, its sizes by ``table``."""
    plc = values.get("per_layer_config") or {}
    out = {}
    for j, i in enumerate(keep):
        overrides = plc.get(str(i), plc.get(i))
        if overrides:
            out[j] = {k: table.get(k, v) if isinstance(v, int) and not isinstance(v, bool) else v
                      for k, v in overrides.items()}
    return out


def _width(values: dict) -> int | None:
    return next((values[n] for n in ("hidden_size", "embed_dim", "d_model", "width") if isinstance(values.get(n), int)), None)


def _shrunk_tower(default, text: tuple[int, int], siblings: tuple = ()) -> dict:
    """Tiny kwargs of a tower sub-config from its default instance: the table's sizes, blocks cut
    to the kept ones (per-block lists and per-layer overrides with them), nested encoder configs
    shrunk the same way (each also rescales widths equal to its siblings' widths: ``siblings``),
    other widths rescaled, projections onto the text width."""
    values = default.to_dict()                  # global values (a per-layer attribute read raises)
    out = {"model_type": default.model_type} if getattr(default, "model_type", "") else {}
    layers = {}                                 # original block count -> kept block indices
    for name, tiny in _TOWER_TINY.items():
        value = values.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[name] = min(value, tiny) if name.startswith(("num_experts_per", "depth")) else tiny
            if name in _LAYER_FIELDS:
                layers[value] = _kept_blocks(values, value, out[name])
                out[name] = len(layers[value])
    for name in set(values) - set(out):         # per-block lists (patch sizes, widths, depths per stage)
        value = values[name]
        if isinstance(value, list) and len(layers.get(len(value), value)) < len(value):
            out[name] = [value[i] for i in layers[len(value)]]
    for n, keep in layers.items():
        if values.get("per_layer_config"):
            out["per_layer_config"] = _per_layer_config(values, keep, _TOWER_TINY)
    nested = {key: sub for key in getattr(type(default), "sub_configs", {})   # an OCR tower's SAM + CLIP
              if hasattr(sub := getattr(default, key, None), "to_dict")}
    for key, sub in nested.items():
        others = tuple((_width(o.to_dict()), _TOWER_TINY["hidden_size"]) for k, o in nested.items() if k != key)
        out[key] = _shrunk_tower(sub, text, others)
    for name in _TO_TEXT:
        if isinstance(values.get(name), int):
            out[name] = text[1]
    out.update(_rescaled_widths(_declared(values, type(default)), out, [(_width(values), _TOWER_TINY["hidden_size"]), *siblings, text]))
    if isinstance(values.get("initializer_range"), float) and values["initializer_range"] < _MIN_INIT_STD:
        out["initializer_range"] = _MIN_INIT_STD     # a random tower that carries its input (SAM's is 1e-10)
    return out


def _listed_like(kwargs: dict, default) -> dict:
    """A tiny size given where the default holds one per modality (ERNIE-4.5-VL's
    ``moe_intermediate_size: [text, vision]``) becomes that list of the tiny size."""
    for name, value in kwargs.items():
        was = families._get(default, name)
        if isinstance(value, int) and isinstance(was, list) and was and all(isinstance(v, int) for v in was):
            kwargs[name] = [value] * len(was)
    return kwargs


def _fit_rope_sections(text_kwargs: dict, default) -> None:
    """Multimodal rope sections (``mrope_section``: time / height / width frequencies) of the
    default config, rescaled to the tiny head's rotary half-width."""
    for attr in ("rope_parameters", "rope_scaling"):
        params = families._get(default, attr)
        if not isinstance(params, dict) or not isinstance(params.get("mrope_section"), list):
            continue
        head = text_kwargs.get("qk_rope_head_dim") or text_kwargs.get("head_dim") or families._TINY["head_dim"]
        factor = params.get("partial_rotary_factor") or families._get(default, "partial_rotary_factor") or 1.0
        sections = params["mrope_section"]
        half, total = int(head * factor) // 2, sum(sections)
        fitted = [max(1, s * half // total) for s in sections]
        fitted[0] += half - sum(fitted)
        text_kwargs[attr] = {**params, "mrope_section": fitted}


# Only where the generic shrink leaves a config transformers cannot run; each entry says why.
_FAMILY_OVERRIDES: dict[str, dict] = {
    # a block of 4 tokens (the default 256 makes every generate one block of 256 tokens, 48 denoising
    # steps): 8 new tokens are two blocks, the second's prefix KV written by the first
    "diffusion_gemma": {"canvas_length": 4},
    # its text layers read sliding_window, which the default config leaves None
    "step3p7": {"text_config": {"sliding_window": 16}},
    # its rope index reads vision_start_token_id, which the thinker config does not define
    # (151652: the Qwen vision-start id of the released checkpoints)
    "qwen3_omni_moe_thinker": {"vision_start_token_id": 151652},
    # 3-D rope sections the model defaults in code ([22, 22, 20], [8, 12, 12]) when the config has
    # none: given here for the tiny rotary half-width (head_dim 16: 8; GLM's partial rotary: 4)
    "ernie4_5_vl_moe": {"text_config": {"rope_parameters": {"rope_theta": 500000.0, "rope_type": "default",
                                                            "mrope_section": [3, 3, 2]}}},
    "glm4v_moe": {"text_config": {"rope_parameters": {"rope_theta": 10000.0, "rope_type": "default",
                                                      "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1]}}},
    # the default text config leaves mlp_layer_types None, which every decoder layer indexes (the
    # default DeepseekOcr2Config cannot build a model): a dense layer, then a sparse one
    "deepseek_ocr2": {"text_config": {"mlp_layer_types": ["dense", "sparse"]},
                      "vision_config": {"sam_config": {"downsample_channels": [64, 32]}}},
    # its projector maps only the per-image patch counts its table names (projector_patch_to_query_dict:
    # 1225 = 35^2, 4900 = 70^2), and its processor resizes to 490 or 980 pixels: patch 14 (the released
    # checkpoints' value; the default config's 32 over 224 gives 49 patches) makes 490 give 1225.
    # initializer_range: the tiny text table's (its own 0.02 inits the projector, a cross-attention of
    # learned queries, so flat at these widths that every image gave features 1e-4 apart, and whether
    # another image changed a greedy token was chance: it did in transformers 5.24, not in 5.17)
    "aria": {"vision_config": {"patch_size": 14, "image_size": 490}, "initializer_range": testing._INIT_STD},
    # the talker reads shared_expert_intermediate_size (its sparse MoE block) and spatial_merge_size,
    # which its config classes do not declare (released configs carry them as extra keys): given, at
    # the tiny shared width and the vision tower's merge size
    # its HMLP vision encoder plans one scale per layer and imports scipy (not a dependency) when it has
    # fewer layers than scales (1 + prime factors of patch 40 and temporal patch 2: 6); 6 layers do not
    "inkling_mm_model": {"vision_config": {"n_layers": 6}},
    # its default vision config is not a released one (width 768 with the 1408-wide tower's intermediate
    # 5632, vision_output_dim 7680 with projector_output_dim 4096): the pixel shuffle feeds its MLP
    # width / ratio^2 (4 x 32) features, the projector takes what that MLP puts out
    "llama4": {"vision_config": {"intermediate_size": 128, "projector_input_dim": 64, "projector_output_dim": 64,
                                 "vision_output_dim": 64}},
    "qwen3_omni_moe": {"talker_config": {"spatial_merge_size": 2,
                                         "text_config": {"shared_expert_intermediate_size": 64}}},
}
# Image-processor arguments per family, beside the sizes read from the tiny vision config.
# (the smallest size each supports: aria 490 or 980 px; gemma4 70 .. 1120 soft tokens per image)
_PROCESSOR_OVERRIDES: dict[str, dict] = {"aria": {"max_image_size": 490}, "gemma4": {"max_soft_tokens": 70}}
# transformers' attention implementation per family where eager cannot generate. DiffusionGemma's
# generate builds its canvas mask with the integer canvas as ``inputs_embeds``, so the eager mask's
# ``torch.finfo(dtype)`` raises on an integer dtype; the sdpa mask is boolean.
_ATTN_IMPLEMENTATION: dict[str, str] = {"diffusion_gemma": "sdpa"}


def _keep_multi_head(kwargs: dict, values: dict) -> None:
    """A text model with as many KV heads as query heads stays so when shrunk (UnlimitedOCR's eager
    attention has no ``repeat_kv``: grouped-query heads would not run)."""
    heads, kv = values.get("num_attention_heads"), values.get("num_key_value_heads")
    if isinstance(heads, int) and heads == kv and "num_attention_heads" in kwargs:
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]


def _merge(into: dict, extra: dict) -> None:
    """``extra`` merged into ``into`` key by key, nested dicts (sub-configs) merged, not replaced."""
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def _default_tower(cls, key: str, sub_cls):
    """The default config of a tower ``cls``'s default leaves out: its class's own default, or where the
    class is ``AutoConfig`` (DiffusionGemma's vision tower in transformers 5.17), what ``cls`` builds
    from an empty dict for it (the model type its ``__post_init__`` names); None if neither builds one."""
    from transformers import PretrainedConfig

    if issubclass(sub_cls, PretrainedConfig):
        return sub_cls()
    try:
        built = getattr(cls(**{key: {}}), key, None)
    except Exception:  # noqa: BLE001 -- a config that takes no empty dict for it: no default tower
        return None
    return built if isinstance(built, PretrainedConfig) else None


def tiny_modal_config(model_type: str, **overrides):
    """The tiny config of a multimodal MoE family: its text sub-config shrunk as the text families
    (:func:`kinject.families._generic_tiny_kwargs` of the text model type), every tower sub-config
    shrunk to 2 blocks of width 32, projections onto the text width."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    config = cls()
    # expert fields of its own (a text config registered as image-text-to-text): the text table
    kwargs: dict = families._generic_tiny_kwargs(model_type) if families._expert_fields(cls) else {}
    text_default = config.get_text_config().to_dict() if hasattr(config, "get_text_config") else {}
    text = (_width(text_default), families._TINY["hidden_size"])         # (default, tiny) text width
    for key, sub_cls in getattr(cls, "sub_configs", {}).items():
        default = getattr(config, key, None)
        if default is None and isinstance(sub_cls, type) and key != "text_config":
            default = _default_tower(cls, key, sub_cls)     # a tower the default leaves out (Gemma 4's vision / audio)
        sub_type = getattr(default, "model_type", "")
        if default is None or not hasattr(default, "to_dict"):
            continue
        if key == "text_config" and sub_type in CONFIG_MAPPING:
            # model_type named, as a tower's and as to_dict() writes it: some configs build their
            # text config from a dict only when it names one (Aria in transformers 5.17)
            sub = {"model_type": sub_type, **_listed_like(families._generic_tiny_kwargs(sub_type), default)}
            sub.update(_rescaled_widths(default.to_dict(), sub, [text]))
            _keep_multi_head(sub, default.to_dict())
            _fit_rope_sections(sub, default)
            kwargs[key] = sub
        elif sub_type in CONFIG_MAPPING and getattr(type(default), "sub_configs", None) and _has_experts(type(default)):
            kwargs[key] = tiny_modal_config(sub_type).to_dict()          # a thinker / talker: recurse
        else:
            kwargs[key] = _shrunk_tower(default, text)
    # the wrapper's own widths (a projector's hidden size, the merged tower width it maps from)
    towers = [(_width(getattr(config, k).to_dict()), _TOWER_TINY["hidden_size"]) for k in kwargs
              if k != "text_config" and hasattr(getattr(config, k, None), "to_dict")]
    kwargs.update(_rescaled_widths(_declared(config.to_dict(), cls),
                                   {**kwargs, **dict.fromkeys(getattr(cls, "sub_configs", {}))}, towers + [text]))
    _merge(kwargs, copy.deepcopy(_FAMILY_OVERRIDES.get(model_type, {})))
    _merge(kwargs, copy.deepcopy(overrides))
    return AutoConfig.for_model(model_type, **kwargs)


def _token_ids_in_vocab(model_type: str) -> dict:
    """Special-token ids of the config (image, vision start / end ...) past the tiny vocabulary,
    moved to its top ids (distinct, from the last id down); an omni config's thinker and talker
    configs too, one id meaning one token in both (they share the thinker's vocabulary)."""
    config = tiny_modal_config(model_type)
    vocab = config.get_text_config().vocab_size
    new_ids: dict[int, int] = {}

    def moved(values: dict, depth: int) -> dict:
        out = {}
        for name, value in values.items():
            if _is_size(value) and "token" in name and value >= vocab:
                out[name] = new_ids.setdefault(value, vocab - 1 - len(new_ids))
            elif depth and isinstance(value, dict) and "model_type" in value and "vision_config" in value:
                out[name] = moved(value, depth - 1)
        return {k: v for k, v in out.items() if v != {}}

    return moved(config.to_dict(), 1)


def build_tiny_modal_model(model_type: str, seed: int = 0) -> PreTrainedModel:
    """A seeded float32 eval-mode model of a multimodal MoE family's generative class (the first
    scanned mapping that registers it), eager attention, special tokens inside the vocabulary."""
    import transformers
    from transformers.models.auto import modeling_auto

    config = tiny_modal_config(model_type, **_token_ids_in_vocab(model_type))
    names = getattr(modeling_auto, MAPPINGS[modal_moe_families()[model_type]])
    torch.manual_seed(seed)
    attn = _ATTN_IMPLEMENTATION.get(model_type, "eager")
    model = getattr(transformers, names[model_type])._from_config(config, attn_implementation=attn,
                                                                   dtype=torch.float32)
    testing._make_healthy(model, seed)
    return model.eval()


def image_processor(model_type: str, config):
    """The family's own image processor (its PIL implementation), sized like the tiny vision tower;
    None where transformers registers none without torchvision."""
    import transformers
    from transformers.models.auto.image_processing_auto import IMAGE_PROCESSOR_MAPPING_NAMES

    name = (IMAGE_PROCESSOR_MAPPING_NAMES.get(model_type) or {}).get("pil")
    if name is None:
        return None
    vision = config.vision_config
    kwargs = {dst: getattr(vision, src) for src, dst in (("patch_size", "patch_size"),
              ("temporal_patch_size", "temporal_patch_size"), ("spatial_merge_size", "merge_size"))
              if isinstance(getattr(vision, src, None), int)}
    cls = getattr(transformers, name)
    if hasattr(cls, "temporal_patch_size") and "temporal_patch_size" not in kwargs:
        kwargs["temporal_patch_size"] = 1       # a tower with no temporal patch embeds one frame per patch (Dots3)
    return cls(**kwargs, **_PROCESSOR_OVERRIDES.get(model_type, {}))


def _config_token(config, *names):
    return next((getattr(config, n) for n in names if isinstance(getattr(config, n, None), int)), None)


def synthetic_pixels(model, rows: int, seed: int = 0, steps: int = 1, wide: int = 1) -> list[dict]:
    """Candidate pixel inputs built from the vision config where transformers has no PIL processor
    for the family. Where ``forward`` takes ``image_grid_thw`` (a 2x2 grid of merged patches per
    image, ``steps`` temporal patches and ``wide`` times as wide: a video's): flattened patches ``[patches, C*T*P*P]``
    with the grid in patches (the Qwen2-VL layout),
    then ``[tokens, P*M, P*M, C]`` with the grid in merged tokens (Inkling's); else ``rows`` images of the tower's
    ``image_size``, else 4 patches ``[T, P, P, C]`` per image (a tower that embeds patches one by one).
    Empty when the vision config names neither a patch size nor an image size."""
    vision = model.config.vision_config.to_dict()
    if not isinstance(vision.get("image_size"), int):     # the first nested encoder takes the pixels (SAM)
        vision = {**next((v for v in vision.values() if isinstance(v, dict) and isinstance(v.get("image_size"), int)),
                         {}), **vision}
    params = inspect.signature(model.forward).parameters
    channels = next((vision[n] for n in ("in_channels", "num_channels", "in_chans") if isinstance(vision.get(n), int)), 3)
    g = torch.Generator().manual_seed(seed)
    patch = vision.get("patch_size")
    if "image_grid_thw" in params and isinstance(patch, int):
        temporal = next((vision[n] for n in ("temporal_patch_size", "patch_temporal") if isinstance(vision.get(n), int)), 1)
        merge = next((vision[n] for n in ("spatial_merge_size", "merge_size") if isinstance(vision.get(n), int)), 1)
        side = 2 * merge
        grid = torch.tensor([[steps, side, side * wide]] * rows)                        # [rows, 3]
        patches = torch.randn(rows * steps * side * side * wide, channels * temporal * patch * patch, generator=g)
        tokens = torch.randn(rows * steps * 4 * wide, patch * merge, patch * merge, channels, generator=g)
        return [{"pixel_values": patches, "image_grid_thw": grid},
                {"pixel_values": tokens, "image_grid_thw": torch.tensor([[steps, 2, 2 * wide]] * rows)}]
    size = vision.get("image_size")
    if isinstance(size, int):
        return [{"pixel_values": torch.randn(rows, channels, size, size, generator=g)}]      # [rows, C, S, S]
    if isinstance(patch, int):                  # patches embedded one by one (Inkling's HMLP): 4 per image
        temporal = vision.get("temporal_patch_size") or 1
        return [{"pixel_values": torch.randn(rows * 4, temporal, patch, patch, channels, generator=g)}]
    return []


def _pixels(model, model_type: str, rows: int, seed: int) -> dict | None:
    """The family's processor's pixel inputs for ``rows`` random 64x64 images (only what
    ``forward`` takes), else :func:`synthetic_pixels`."""
    import numpy as np

    proc = image_processor(model_type, model.config)
    if proc is None:
        return next(iter(synthetic_pixels(model, rows, seed)), None)
    rng = np.random.default_rng(seed)
    pixels = dict(proc(images=[rng.integers(0, 255, (64, 64, 3), dtype=np.uint8) for _ in range(rows)],
                       return_tensors="pt"))
    params = inspect.signature(model.forward).parameters
    return {k: v for k, v in pixels.items() if k in params}


def _features_owner(model, modality: str):
    """The module whose ``get_<modality>_features`` the model's forward calls: the model, else its
    base model (Dots3's generation class leaves it to its inner model); None where neither has it."""
    name = f"get_{modality}_features"
    return next((m for m in (model, getattr(model, "base_model", None)) if hasattr(m, name)), None)


def _features_params(model, modality: str) -> dict:
    """The named parameters of the model's ``get_<modality>_features``, else of its base model's
    (Dots3's generation class passes ``*args, **kwargs`` on); empty where neither names any."""
    name = f"get_{modality}_features"
    for m in (model, getattr(model, "base_model", None)):
        params = inspect.signature(getattr(m, name)).parameters if hasattr(m, name) else {}
        if any(p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params.values()):
            return params
    return {}


def _config_arguments(model, modality: str, given: dict) -> dict:
    """The arguments ``get_<modality>_features`` requires beside ``given`` (no default), from the model's
    config or its tower's (Llama 4's ``vision_feature_select_strategy`` in transformers 5.17, which its
    forward passes from the vision config); those neither config holds are left for the call to refuse."""
    config = model.config
    tower = getattr(config, "audio_config" if modality == "audio" else "vision_config", None)
    out = {}
    for name, p in _features_params(model, modality).items():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) or p.default is not p.empty or name in given:
            continue
        for source in (config, tower):
            if source is not None and hasattr(source, name):
                out[name] = getattr(source, name)
                break
    return out


def _image_features(model, model_type: str, rows: int, seed: int):
    """(pixel inputs, the model's pooled image features): the processor's, else the first
    :func:`synthetic_pixels` candidate the model's ``get_image_features`` accepts."""
    proc = image_processor(model_type, model.config)
    candidates = [_pixels(model, model_type, rows, seed)] if proc is not None else synthetic_pixels(model, rows, seed)
    for i, pixels in enumerate(candidates):
        try:
            with torch.no_grad():
                out = _features_owner(model, "image").get_image_features(**pixels,
                                                                          **_config_arguments(model, "image", pixels))
            # the pooled features, else the last hidden state (Llama 4 projects that, row by row)
            return pixels, out.pooler_output if out.pooler_output is not None else out.last_hidden_state
        except RuntimeError:
            if i == len(candidates) - 1 or proc is not None:
                raise
    return None, None


def _as_video(pixels: dict) -> dict:
    """Image inputs renamed as the same frames' video inputs (``pixel_values`` -> ``pixel_values_videos``,
    ``image_grid_thw`` -> ``video_grid_thw``, ``image_position_ids`` -> ``video_position_ids``)."""
    return {("pixel_values_videos" if k == "pixel_values" else re.sub(r"^image_", "video_", k)): v
            for k, v in pixels.items()}


def synthetic_video(model, model_type: str, rows: int, seed: int = 0) -> list[dict]:
    """Candidate video inputs, one clip per prompt (transformers' video processors all need
    torchvision). Where ``get_video_features`` takes ``video_grid_thw``: as many temporal patches
    (of the vision config's ``temporal_patch_size`` frames each) as its tower merges into one step
    (``temporal_merge_size``: ERNIE-4.5-VL's 2; else one), laid out as :func:`synthetic_pixels`' grid
    candidates, twice as wide as the images (a family that scatters video features into image
    placeholders then fails, not silently overwriting the image): one placeholder run per clip, as
    every family lays out one frame step. Else 2 frames per clip through the family's image processor (or :func:`synthetic_pixels`),
    concatenated along the frame axis with ``num_frames_per_video`` where it asks for that (Gemma 4);
    where it asks for no frame count, also as ``[clips, frames, ...]`` (Gemma 4 in transformers 5.17)."""
    params = _features_params(model, "video")
    if "video_grid_thw" in params:
        steps = getattr(model.config.vision_config, "temporal_merge_size", None)
        return [_as_video(p) for p in synthetic_pixels(model, rows, seed, steps if _is_size(steps) else 1, wide=2)]
    frames = 2
    if image_processor(model_type, model.config) is not None:
        candidates = [_pixels(model, model_type, rows * frames, seed)]
    else:
        candidates = synthetic_pixels(model, rows * frames, seed)
    extra = {n: torch.full((rows,), frames) for n in params if n.startswith("num_frames")}   # [rows]
    clips = [{**{k: v for k, v in _as_video(p).items() if k in params}, **extra} for p in candidates if p]
    if not extra:       # no frame count taken: also each clip's frames on an axis of their own (Gemma 4 in 5.17)
        clips += [{k: v.unflatten(0, (rows, frames)) if v.shape[:1] == (rows * frames,) else v
                   for k, v in clip.items()} for clip in clips]
    return clips


def _first_accepted(model, modality: str, candidates: list[dict]):
    """(inputs, the model's features): the first candidate its ``get_<modality>_features`` accepts;
    (None, None) where none is."""
    for inputs in candidates:
        try:
            with torch.no_grad():
                out = getattr(_features_owner(model, modality), f"get_{modality}_features")(
                    **inputs, **_config_arguments(model, modality, inputs))
        except (RuntimeError, TypeError, ValueError, IndexError):
            continue
        return inputs, out.pooler_output if out.pooler_output is not None else out.last_hidden_state
    return None, None


def _video_features(model, model_type: str, rows: int, seed: int):
    """:func:`_first_accepted` of the :func:`synthetic_video` candidates (other pixels than the images')."""
    return _first_accepted(model, "video", synthetic_video(model, model_type, rows, seed + 1))


def synthetic_audio(model, model_type: str, rows: int, seed: int = 0) -> list[dict]:
    """Candidate audio inputs built from the audio config where ``get_audio_features`` takes mel
    ``input_features``: ``[rows, mel bins, 200 frames]`` (Whisper's layout), then ``[rows, frames,
    mel bins]``, with the frame mask it takes (every frame valid) and the waveform samples per clip
    (frames x hop length) where it asks for them. The mel-bin count: the audio config's, else the
    family's feature extractor's. Discretized audio ids where it takes those (:func:`_audio_token_ids`).
    Empty without either."""
    from transformers.models.auto.feature_extraction_auto import FEATURE_EXTRACTOR_MAPPING_NAMES

    params = _features_params(model, "audio")
    if ids := next((n for n in params if n.endswith("input_ids")), None):
        return _audio_token_ids(model.config.audio_config, ids, params, rows, seed)
    audio = model.config.audio_config.to_dict()
    mel = next((audio[n] for n in ("num_mel_bins", "n_mel_bins", "feature_size", "input_feat_size")
                if _is_size(audio.get(n))), None)
    if mel is None and model_type in FEATURE_EXTRACTOR_MAPPING_NAMES:
        import transformers

        mel = getattr(getattr(transformers, FEATURE_EXTRACTOR_MAPPING_NAMES[model_type])(), "feature_size", None)
    if not _is_size(mel) or "input_features" not in params:
        return []
    g, frames = torch.Generator().manual_seed(seed), 200
    extra = {n: torch.ones(rows, frames, dtype=torch.bool) for n in params if n.endswith("_mask")}   # [rows, F]
    if _is_size(audio.get("hop_length")):
        extra.update({n: torch.full((rows,), frames * audio["hop_length"]) for n in params if n.endswith("sample_lengths")})
    return [{"input_features": torch.randn(rows, mel, frames, generator=g), **extra},
            {"input_features": torch.randn(rows, frames, mel, generator=g), **extra}]


def _audio_token_ids(audio, name: str, params, rows: int, seed: int) -> list[dict]:
    """Discretized audio (Inkling's dMel bin ids): ``[rows, 4 frames, codebooks]`` ids below the
    audio config's codebook size, every frame valid in the mask ``get_audio_features`` takes."""
    books, size = (_config_token(audio, *names) for names in (("num_codebooks", "n_codebooks"),
                                                            ("codebook_size", "mel_vocab_size")))
    if not (_is_size(books) and _is_size(size)):
        return []
    g, frames = torch.Generator().manual_seed(seed), 4
    mask = {n: torch.ones(rows, frames, dtype=torch.bool) for n in params if n.startswith(name) and n.endswith("_mask")}
    return [{name: torch.randint(0, size, (rows, frames, books), generator=g), **mask}]      # [rows, F, books]


def _audio_features(model, model_type: str, rows: int, seed: int):
    """:func:`_first_accepted` of the :func:`synthetic_audio` candidates."""
    return _first_accepted(model, "audio", synthetic_audio(model, model_type, rows, seed))


# modality -> (features getter, its placeholder token's config names, start names, end names)
_MODALITIES = {
    "image": (_image_features, ("image_token_id", "image_token_index"),
              ("vision_start_token_id", "image_start_token_id", "boi_token_id", "image_bos_token_id"),
              ("vision_end_token_id", "image_end_token_id", "eoi_token_id")),
    "video": (_video_features, ("video_token_id", "video_token_index"),
              ("video_start_token_id", "vision_start_token_id", "boi_token_id"),
              ("video_end_token_id", "vision_end_token_id", "eoi_token_id")),
    "audio": (_audio_features, ("audio_token_id", "audio_token_index"),
              ("audio_start_token_id", "boa_token_id", "audio_bos_token_id"),
              ("audio_end_token_id", "eoa_token_id", "audio_eos_token_id")),
}


def _forward_takes(model, inputs: dict) -> bool:
    """Whether ``model.forward`` takes every input (by name, or on to its inner model's forward)."""
    params = inspect.signature(model.forward).parameters
    inner = inspect.signature(model.base_model.forward).parameters if model.base_model is not model else {}
    return all(n in params or (n in inner and any(p.kind == p.VAR_KEYWORD for p in params.values())) for n in inputs)


def _counts(pooled, rows: int) -> list[int]:
    """Placeholder tokens per item of a modality's features."""
    if isinstance(pooled, (list, tuple)):                       # one [tokens, D] per item
        return [p.shape[0] for p in pooled]
    return [pooled.numel() // pooled.shape[-1] // rows] * rows  # [items, tokens, D], [all tokens, D] or [patches, 1, D]


def modal_batches(model, model_type: str, rows: int = 3, seed: int = 0) -> list[tuple[list[str], dict]]:
    """[(the modalities given, a left-padded batch of ``rows`` prompts)]: one image each
    (:func:`_pixels`), one video clip each (:func:`synthetic_video`) and one audio clip each
    (:func:`synthetic_audio`) where the model takes them, each item's placeholder tokens as many as
    the model's own ``get_<modality>_features`` returns rows for it, between the family's start /
    end tokens of that modality where it has them. A video's placeholder is the video token, else
    (where the model's forward refuses that) the image token inside the video's start / end tokens
    (GLM-5-Next tells video from image by those). Where neither runs beside the other inputs
    (GLM-4.5V scatters video features into every image placeholder), the video goes in a second,
    video-only batch (no pixels), with the first placeholder its forward runs alone. Empty where no
    modality input can be built."""
    config = model.config
    if model_type in TEXT_ONLY:
        return []
    inputs, segments = {}, []                           # segments: (modality, placeholders, start, end, counts)
    for modality, (features, token, start, end) in _MODALITIES.items():
        if _features_owner(model, modality) is None or _config_token(config, *token) is None:
            continue
        given, pooled = features(model, model_type, rows, seed)
        if given is not None and _forward_takes(model, given):
            inputs.update(given)
            placeholders = [_config_token(config, *token)]
            if modality == "video":
                placeholders.append(_config_token(config, *_MODALITIES["image"][1]))
            segments.append((modality, placeholders, _config_token(config, *start), _config_token(config, *end),
                             _counts(pooled, rows)))
    if not segments:
        return []
    if (batch := _running_batch(model, segments, inputs, rows, seed)) is not None:
        return [([m for m, *_ in segments], batch)]
    # no video placeholder runs beside the other inputs: those without the video, then the video alone
    video = [s for s in segments if s[0] == "video"]
    rest = [s for s in segments if s[0] != "video"]
    out = [([m for m, *_ in rest], _prompts(model, [(m, p[0], *more) for m, p, *more in rest],
                                            {k: v for k, v in inputs.items() if "video" not in k}, rows, seed))]
    alone = _running_batch(model, video, {k: v for k, v in inputs.items() if "video" in k}, rows, seed)
    return out + ([(["video"], alone)] if alone is not None else [])


def _running_batch(model, segments: list, inputs: dict, rows: int, seed: int) -> dict | None:
    """The batch of the first placeholder choice (one per segment, in order) the model's forward
    runs; the only one, untried, where each segment has one; None where no choice runs."""
    choices = max(len(p) for _, p, *_ in segments)
    for choice in range(choices):
        picked = [(m, p[min(choice, len(p) - 1)], *rest) for m, p, *rest in segments]
        batch = _prompts(model, picked, inputs, rows, seed)
        if choices == 1:
            return batch
        try:
            with torch.no_grad():
                model(**batch)
            return batch
        except (RuntimeError, ValueError):
            continue
    return None


_KINDS = {"image": 1, "video": 2}     # the modality ids processors give (``mm_token_type_ids``; text 0)


def _prompts(model, segments: list, inputs: dict, rows: int, seed: int) -> dict:
    """The left-padded batch: random text, then each modality's run of placeholder tokens per prompt."""
    config = model.config
    g = torch.Generator().manual_seed(seed)
    seqs = [torch.randint(5, 200, (2 + i,), generator=g).tolist() for i in range(rows)]
    kinds = [[0] * len(s) for s in seqs]
    for modality, token, start, end, counts in segments:
        for seq, kind, n in zip(seqs, kinds, counts):
            run = [t for t in (start,) if t is not None] + [token] * n + [t for t in (end,) if t is not None]
            seq += run + [7, 8]
            kind += [_KINDS.get(modality, 0) if t == token else 0 for t in run] + [0, 0]
    width = max(map(len, seqs))
    pad = config.get_text_config().pad_token_id or 0
    ids = torch.tensor([[pad] * (width - len(s)) + s for s in seqs])                 # [rows, L]
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in seqs])      # [rows, L]
    batch = {"input_ids": ids, "attention_mask": mask, **inputs}
    for name in inspect.signature(model.forward).parameters:   # (ERNIE-4.5-VL: also its MoE's modality)
        if name.endswith("mm_token_type_ids"):
            batch[name] = torch.tensor([[0] * (width - len(k)) + k for k in kinds]).int()
        elif name.endswith("second_per_grid") and "pixel_values_videos" in inputs:
            batch[name] = torch.ones(rows)      # seconds per temporal patch (Qwen3-Omni's video rope): 1
    return batch


def text_batch(rows: int = 3, seed: int = 0, length: int = 7) -> dict:
    """A left-padded batch of ``rows`` text prompts (token ids below the tiny vocabulary)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, 200, (rows, length), generator=g)                         # [rows, length]
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    return {"input_ids": ids, "attention_mask": mask}


def family_batches(model, model_type: str) -> list[tuple[str, dict]]:
    """[(what was given, the batch)]: an encoder sequence for encoder-decoders, a real image, video
    and audio clip per prompt where they can be built (:func:`modal_batches`: a second, video-only
    batch where the video cannot run beside the image), text prompts otherwise."""
    if model.config.is_encoder_decoder:
        return [("encoder sequence", text_batch())]
    owner = _inputs_owner(model)
    got = modal_batches(owner, model_type) if owner is not None else []
    return [(" + ".join([*given, "text"]), batch) for given, batch in got] or [("text", text_batch())]


# The batch shapes every family is checked with (:func:`shape_batches`): (rows, new tokens, what)
NEW_TOKENS = 3
LONG_SHAPE = (4, 10, 8)         # text prompts, their tokens, new tokens: more than a block diffusion block


def shape_batches(model, model_type: str) -> list[tuple[str, dict, int]]:
    """[(what was given, the batch, new tokens)] a family is checked with: each batch of
    :func:`family_batches` (3 prompts: not a multiple of the micro-batch of 2) for
    :data:`NEW_TOKENS`, then :data:`LONG_SHAPE`: 4 text prompts of 10 tokens for 8 new tokens -- more
    than a block of a block-diffusion model (DiffusionGemma's tiny ``canvas_length`` is 4: two blocks,
    each denoised by re-forwarding its positions) and longer decodes for the others."""
    rows, length, new = LONG_SHAPE
    given = [(what, batch, NEW_TOKENS) for what, batch in family_batches(model, model_type)]
    return given + [(f"{rows} x {length} text", text_batch(rows, seed=1, length=length), new)]


def _inputs_owner(model):
    """The model whose forward takes the pixels: the model itself where its config has a vision
    config, else its first child model that has one (an omni model generates through its thinker)."""
    if hasattr(model.config, "vision_config"):
        return model
    return next((child for child in model.children()
                 if hasattr(getattr(child, "config", None), "vision_config")), None)


def generate_tokens(model, batch: dict, new_tokens: int = NEW_TOKENS) -> torch.Tensor:
    """Greedy ``generate``'s sequences, the global RNG seeded first (a diffusion family's
    ``generate`` draws its starting canvas from it; greedy decoders draw nothing)."""
    torch.manual_seed(0)
    out = model.generate(**batch, **_text_generation_kwargs(model, new_tokens))
    return getattr(out, "sequences", out)


def _text_generation_kwargs(model, new_tokens: int) -> dict:
    """Greedy text generation in the model's own ``generate`` terms: an omni model's generate
    (Qwen3-Omni: ``return_audio``, ``thinker_max_new_tokens``) is asked for text only."""
    kwargs = {"max_new_tokens": new_tokens, "do_sample": False}
    params = inspect.signature(model.generate).parameters
    if "return_audio" in params:
        kwargs["return_audio"] = False
    kwargs.update({name: new_tokens for name in params if name.endswith("_max_new_tokens") and "talker" not in name})
    return kwargs


# Families whose tiny model does not build or generate with transformers' own code at these sizes in
# every supported transformers release (the untouched model fails, before kinject is involved);
# model_type -> reason. Tests accept a failure only when it is listed here, or when it is a bug of
# the installed release only, told apart by its error (tests/helpers/transformers_bugs.py: Llama 4's
# forward in 5.24, which 5.17 runs).
KNOWN_FAILURES: dict[str, str] = {
}
# Families given text prompts only although they take images; model_type -> why no image is built.
TEXT_ONLY: dict[str, str] = {
}
# Inputs a family takes that the tests do not build yet; model_type -> what is missing and why.
NOT_BUILT: dict[str, str] = {
    "muse_spark": "no audio: its generation class's forward takes no audio input (it has an audio tower)",
}


def takes_video(model_type: str) -> bool:
    """Whether the family's generative class takes video frames (``pixel_values_videos``)."""
    import transformers
    from transformers.models.auto import modeling_auto

    names = getattr(modeling_auto, MAPPINGS[modal_moe_families()[model_type]])
    cls = getattr(transformers, names[model_type], None)
    return cls is not None and "pixel_values_videos" in inspect.signature(cls.forward).parameters
# Families kinject refuses with the whole rule file, with a clear error before anything changes.
PORT_FAILURES: dict[str, str] = {
}
# Families that port on the host tier but whose own checkpoint kinject cannot read lazily from disk.
DISK_FAILURES: dict[str, str] = {
}
