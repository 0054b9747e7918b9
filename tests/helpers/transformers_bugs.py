"""Bugs of an installed transformers that keep a family's *untouched* tiny model from running.

kinject promises transformers >= 5.17, and the family tests compare kinject with the untouched
model. Where the untouched model itself fails in some transformers release, there is nothing to
compare with: the test is skipped, saying which bug. Each entry is told apart by the error the
untouched model raises (not by version), so a release that fixes the bug runs the test in full, and
any other failure still fails.
"""

from __future__ import annotations

import pytest
import transformers

# model_type -> (text of the error the untouched model raises, what the bug is)
UNTOUCHED_MODEL_BUGS: dict[str, tuple[str, str]] = {
    "doge": ("dropout(): argument 'input' (position 1) must be Tensor, not tuple",
             "DogeDecoderLayer passes the MoE block's (hidden_states, router_logits) tuple to dropout, so "
             "Doge's MoE variant (is_moe=True) cannot run at all (huggingface/transformers#40079, fixed "
             "in a later release)"),
    "llama4": ("'MoeCausalLMOutputWithPast' object has no attribute 'image_outputs'",
               "Llama4ForConditionalGeneration.forward builds its output from outputs.image_outputs of its language "
               "model's MoeCausalLMOutputWithPast, which has none: every forward raises (text or image, "
               "return_dict=True or False), so generate cannot run; its text model alone is the llama4_text family"),
}


def skip_if_untouched_model_bug(model_type: str, exc: BaseException) -> None:
    """Skip the calling test when ``exc``, raised by the untouched ``model_type`` model, is a known
    bug of the installed transformers; return otherwise (the caller then fails as it would)."""
    known = UNTOUCHED_MODEL_BUGS.get(model_type)
    if known is not None and known[0] in str(exc):
        pytest.skip(f"transformers {transformers.__version__}: {known[1]}; untouched model: "
                    f"{type(exc).__name__}: {exc}")
