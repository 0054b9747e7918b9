"""The model behind ``kinject serve`` and ``kinject run-batch``: loaded once, named, with its batch group.

Both load exactly what ``kinject run`` loads (its default model, rule file, tokenizer and group
plan: :mod:`kinject.app.run`), and name it for the ``model`` field of requests: ``--served-model-name``,
else the model folder's name, or ``kinject-builtin`` for the built-in model.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from kinject.app.openai_protocol import ModelInfo, model_defaults
from kinject.app.run import default_model_path, default_rules, load_tokenizer, model_type
from kinject.plan.groups import GroupPlan, plan_groups
from kinject.errors import KinjectError

logger = logging.getLogger(__name__)

BUILTIN_NAME = "kinject-builtin"


@dataclass
class Served:
    model: object
    tok: object
    info: ModelInfo
    plan: GroupPlan
    model_dir: Path
    rules: Path

    @property
    def runtime(self):
        return self.model.kinject

    def close(self) -> None:
        self.runtime.transfer.close()


def served_name(model: str | None, served_model_name: str | None) -> str:
    if served_model_name:
        return served_model_name
    return Path(model).expanduser().resolve().name if model else BUILTIN_NAME


def context_length(model_dir: Path, tok) -> int:
    """Tokens a sequence may hold: the config's ``max_position_embeddings`` (or its text config's),
    capped by the tokenizer's ``model_max_length`` when that is a real limit."""
    config = json.loads((model_dir / "config.json").read_text())
    sub = config.get("text_config") or {}
    limit = config.get("max_position_embeddings") or sub.get("max_position_embeddings")
    tok_limit = getattr(tok, "model_max_length", None)
    if isinstance(tok_limit, int) and 0 < tok_limit < 10 ** 8:
        limit = min(limit, tok_limit) if limit else tok_limit
    if not limit:
        raise KinjectError(f"{model_dir}: neither config.json max_position_embeddings nor the tokenizer's "
                           "model_max_length says how long a sequence may be")
    return int(limit)


def check_model_dir(model: str | None) -> Path:
    """The model folder (the built-in one without ``--model``), checked before anything loads."""
    model_dir = Path(model).expanduser() if model else default_model_path()
    model_type(model_dir)
    return model_dir


@dataclass
class Prepared:
    """Everything but the weights: what a request is checked against before the model loads."""

    model_dir: Path
    rules: Path
    ruleset: object
    tok: object
    info: ModelInfo


def prepare(model: str | None, rules: str | None, overrides: list[str], *,
            served_model_name: str | None = None) -> Prepared:
    """Model folder, rule file (``--set`` applied), tokenizer and :class:`ModelInfo`; no weights read."""
    from transformers import GenerationConfig

    from kinject.rules import load_rules, resolve_rules_path

    model_dir = check_model_dir(model)
    rules_path = resolve_rules_path(rules) if rules else default_rules(model_dir)
    ruleset = load_rules(rules_path, list(overrides))
    tok = load_tokenizer(model_dir)
    try:
        gen = GenerationConfig.from_pretrained(model_dir)
    except OSError:
        gen = None
    info = ModelInfo(served_name(model, served_model_name), tok, context_length(model_dir, tok), **model_defaults(gen))
    return Prepared(model_dir, Path(rules_path), ruleset, tok, info)


def load_served(prepared: Prepared, *, dtype: str | None = None, attn: str = "eager") -> Served:
    """Load the model as ``kinject run`` does and plan its batch group (``n x bs`` sequences)."""
    import kinject

    m = kinject.from_pretrained(prepared.model_dir, prepared.ruleset, dtype=dtype, attn_implementation=attn)
    try:
        plan = plan_groups(prepared.ruleset.pipeline, m)
    except BaseException:
        m.kinject.transfer.close()
        raise
    logger.info("kinject: serving %s as %r, batch group n=%d x bs=%d", prepared.model_dir, prepared.info.name,
                plan.n, plan.bs)
    return Served(m, prepared.tok, prepared.info, plan, prepared.model_dir, prepared.rules)


def add_served_model_arguments(s) -> None:
    """The options naming the served model, shared by ``kinject serve`` and ``kinject run-batch``."""
    s.add_argument("--model", help="Hugging Face model directory (default: the built-in tiny MoE)")
    s.add_argument("--rules", help="rule file (default: rules/klotski.yaml)")
    s.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a rule-file key")
    s.add_argument("--served-model-name", metavar="NAME",
                   help="the name requests' 'model' must give (default: the model folder's name, "
                        "kinject-builtin for the built-in model; \"default\" always works)")
