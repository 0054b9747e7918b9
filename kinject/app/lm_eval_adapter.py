"""lm-evaluation-harness on a kinject model: its ``HFLM`` driving the optimized model object.

lm-evaluation-harness (``pip install kinject[eval]``) evaluates a transformers model object passed as
``pretrained=``; :class:`KinjectLM` builds that object with :func:`kinject.from_pretrained` (rules,
``--set`` overrides, any stored format chosen by rule) so every task runs through kinject's
operators, the same path as ``generate`` and ``kinject eval``. Registered as the harness model
``kinject`` once this module is imported::

    import lm_eval, kinject.app.lm_eval_adapter
    lm_eval.simple_evaluate(model="kinject", model_args="model=DIR,rules=rules/klotski.yaml,"
                            "set=vars.quant={format: fp8}", tasks=[...])

Tasks download their datasets from the Hugging Face hub; offline, only local task files run.
"""

from __future__ import annotations

from pathlib import Path

from kinject.errors import KinjectError

try:
    from lm_eval.api.registry import register_model
    from lm_eval.models.huggingface import HFLM
except ImportError as exc:  # pragma: no cover - the optional extra is missing
    raise KinjectError("the lm-evaluation-harness adapter needs the 'lm-eval' package: pip install 'kinject[eval]'") \
        from exc


@register_model("kinject")
class KinjectLM(HFLM):
    """``HFLM`` over ``kinject.from_pretrained(model, rules, set)``; ``set``: overrides separated by
    ``;`` (a ``--set`` value may hold commas). Other keyword arguments go to ``HFLM``."""

    def __init__(self, model: str | None = None, rules: str | None = None, set: str | list[str] | None = None,
                 dtype: str | None = None, batch_size: int | str = 8, **kwargs):
        from transformers import AutoTokenizer

        from kinject.app.run import default_model_path, default_rules
        from kinject.pretrained import from_pretrained

        model_dir = Path(model) if model else default_model_path()
        overrides = [s for s in (set.split(";") if isinstance(set, str) else set or []) if s.strip()]
        optimized = from_pretrained(model_dir, rules or default_rules(model_dir), overrides, dtype=dtype)
        super().__init__(pretrained=optimized, tokenizer=AutoTokenizer.from_pretrained(model_dir),
                         batch_size=batch_size, **kwargs)
        self.runtime = optimized.kinject

    def close(self) -> None:
        """Stop the model's transfer threads (the harness has no hook for it)."""
        self.runtime.transfer.close()
