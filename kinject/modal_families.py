"""Every generative MoE family beyond the decoder-only text ones, found by scanning.

:mod:`kinject.families` scans transformers' causal-LM auto mapping. This module scans its other
generative auto mappings -- image-text-to-text, multimodal LM, seq2seq, speech-seq2seq, text-to-audio
-- for model types whose config (or a sub-config, to depth 2) names an expert count, and builds
tiny models of the encoder-decoder ones from the config class's own defaults, shrunk by one table.

    modal_moe_families()            # {"aria": "image-text-to-text", ..., "switch_transformers": "seq2seq"}
    model = build_tiny_seq2seq_model("switch_transformers")
"""

from __future__ import annotations

import dataclasses
import functools
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
