"""transformers' checkpoint conversion mapping, interpreted for lazy reads.

transformers converts a checkpoint's keys into a model's tensors with the model's conversion
mapping (``transformers.conversion_mapping``): ``WeightRenaming`` entries rename keys,
``WeightConverter`` operations combine loaded tensors. kinject never loads a whole checkpoint, so
it does not run those operations on tensors: :class:`KeyMapper` applies the renamings as they are
and interprets each converter (:func:`recipes_of`) as a :class:`Recipe`: which byte ranges of which
keys make each target, read one expert at a time. A converter it cannot read lazily is described
by a message instead, and the checkpoint index (:mod:`kinject.io.checkpoint`) then runs it eagerly
or refuses it, naming the operation.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import torch

from kinject.io.key_templates import TemplateRenamer, fixed_digits

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipe:
    """What a transformers ``WeightConverter`` means for lazy reading.

    ``stack``: the target is ``[E, ...]`` and expert ``e`` comes from the keys whose ``*`` is ``e``
    (``MergeModulelist(dim=0)``); ``concat_dim``: the converter's source patterns are concatenated,
    in their order, along this dim of one expert's slice (or of the whole target when not stacked);
    ``split``: one key cut along dim 0 into the converter's several targets, each a row range of it
    (``"sizes"``: ``Split``, each target as many rows as it has; ``"chunks"``: ``Chunk``, equal parts).
    """

    stack: bool
    concat_dim: int | None
    patterns: tuple[str, ...]
    index_regex: tuple[re.Pattern | None, ...]  # per pattern: extracts the expert index from the key
    interleave: int | None = None  # ``Interleave(dim)`` of one key: its halves along dim are interleaved on disk
    split: str | None = None       # "sizes" (``Split(dim=0)``) or "chunks" (``Chunk(dim=0)``) into several targets
    experts_split: bool = False    # stacked experts cut in equal runs into the targets (text / vision experts)


def _recipes_of(converter) -> dict[str, Recipe | str]:
    """Source pattern -> how its keys are read (a ``Recipe``), or why they cannot be (a message).

    Operations that hand a lone source tensor through unchanged are dropped first (asked of the
    operation itself, :func:`_passes_lone_source_through`): e.g. a dequantization that combines a
    weight with scale keys, run on a checkpoint that holds only the weight (as ``save_pretrained``
    writes it). The weight's key is then read by the rest of the recipe, and a key of any other
    pattern (a scale the operation would combine) cannot be read lazily."""
    ops = list(converter.operations)
    patterns = tuple(converter.source_patterns)
    kept = list(ops)
    while kept and len(converter.target_patterns) == 1 and _passes_lone_source_through(kept[0], converter):
        kept.pop(0)
    if len(kept) == len(ops) or len(patterns) == 1:
        recipe = _interpret(converter, kept)
        return dict.fromkeys(patterns, recipe)
    lone = _interpret(converter, kept, patterns[:1])
    described = ", ".join(repr(op) for op in ops)
    why = f"operations [{described}] combining it with the key of '{patterns[0]}'"
    return {patterns[0]: lone, **{p: why for p in patterns[1:]}}


def _passes_lone_source_through(op, converter) -> bool:
    """Whether ``op.convert`` returns its only source tensor itself when given just one (a probe of
    one element: cheap, and any error or new tensor means no)."""
    probe = torch.zeros(1)
    try:
        out = op.convert({converter.source_patterns[0]: [probe]}, list(converter.source_patterns),
                         list(converter.target_patterns), model=None, full_layer_name=None)
    except Exception:  # noqa: BLE001 - an operation that needs more than one source: not a pass-through
        return False
    return isinstance(out, dict) and len(out) == 1 and next(iter(out.values())) is probe


def _interpret(converter, ops: list | None = None, patterns: tuple[str, ...] | None = None) -> Recipe | str:
    """A ``Recipe`` for a converter whose operations (``ops``, default all) on its source
    ``patterns`` (default all) kinject reads lazily, else why not (a message)."""
    from transformers.core_model_loading import Chunk, Concatenate, Interleave, MergeModulelist, Transpose
    try:
        from transformers.core_model_loading import Split     # (5.24; 5.17 has no Split)
    except ImportError:
        Split = None

    ops = list(converter.operations) if ops is None else ops
    patterns = tuple(converter.source_patterns) if patterns is None else patterns
    described = ", ".join(repr(op) for op in converter.operations)
    if not ops and len(patterns) == 1 and len(converter.target_patterns) == 1:
        return Recipe(False, None, patterns, (None,))                          # the key as it is
    if len(ops) == 1 and type(ops[0]) in (Split, Chunk) and ops[0].dim == 0 and len(patterns) == 1 \
            and len(converter.target_patterns) > 1 and not getattr(ops[0], "num_shards_attribute", None):
        split = "sizes" if type(ops[0]) is Split else "chunks"
        return Recipe(False, None, patterns, (None,), split=split)             # row ranges of one key
    if len(ops) == 1 and isinstance(ops[0], Interleave) and not ops[0].inverse and ops[0].dim > 0 \
            and len(patterns) == 1 and len(converter.target_patterns) == 1:
        return Recipe(False, None, patterns, (None,), interleave=ops[0].dim)   # a strided read of one key
    split_experts = _experts_split_recipe(ops, patterns, converter)
    if split_experts is not None:
        return split_experts
    stack = bool(ops) and isinstance(ops[0], MergeModulelist) and ops[0].dim == 0
    rest = ops[1:] if stack else ops
    concat_dim = None
    if len(rest) == 1 and isinstance(rest[0], Concatenate) and not getattr(rest[0], "num_shards_attribute", None):
        concat_dim = rest[0].dim - (1 if stack else 0)
        rest = []
    if len(converter.target_patterns) != 1 or rest or (concat_dim is not None and concat_dim < 0):
        if len(ops) == 1 and isinstance(ops[0], Transpose) and ops[0].check_dims:
            return Recipe(False, None, patterns, (None,) * len(patterns))  # no-op when the shape already fits
        return f"operations [{described}]"
    if stack and any(p.count("*") != 1 for p in patterns):
        return f"operations [{described}] on patterns {list(patterns)} without one '*' each"
    if not stack and len(patterns) > 1 and concat_dim is None:
        return f"operations [{described}] on several patterns"
    regexes = tuple(re.compile(p.replace("*", r"(\d+)")) if stack else None for p in patterns)
    return Recipe(stack, concat_dim, patterns, regexes)


def _experts_split_recipe(ops: list, patterns: tuple[str, ...], converter) -> Recipe | None:
    """The recipe of ``ErnieFuseAndSplitTextVisionExperts(stack_dim=0, concat_dim=d)`` (ERNIE-4.5-VL:
    one list of per-expert keys holds the text experts, then the vision experts), or None for any
    other operation. It cuts the list into as many equal runs as there are targets (the first runs
    ``ceil(N / targets)`` long), stacks each run and concatenates the source patterns along ``d``:
    so target ``t``'s expert ``e`` is the keys whose ``*`` is ``t * run + e``, concatenated along
    ``d - 1`` of one expert's slice, which reads lazily per expert like ``MergeModulelist``."""
    try:
        from transformers.core_model_loading import ErnieFuseAndSplitTextVisionExperts as Op
    except ImportError:  # transformers without it: no checkpoint needs it
        return None
    if len(ops) != 1 or type(ops[0]) is not Op or ops[0].stack_dim != 0 or ops[0].concat_dim < 1 \
            or any(p.count("*") != 1 for p in patterns):
        return None
    regexes = tuple(re.compile(p.replace("*", r"(\d+)")) for p in patterns)
    return Recipe(True, ops[0].concat_dim - 1, patterns, regexes, experts_split=len(converter.target_patterns) > 1)


class MappedKey(NamedTuple):
    """Where one checkpoint key goes (:meth:`KeyMapper.map`)."""

    targets: tuple[str, ...]           # what it makes: several when a converter cuts it into several targets
    recipe: Recipe | str | None       # how it is read lazily, why it cannot be (a message), None: as it is
    position: int = 0                  # position of the matched source pattern in the recipe
    expert: int | None = None          # the expert a per-expert key belongs to
    pattern: str | None = None         # the converter source pattern it matched
    converter: Any = None              # that transformers ``WeightConverter``


class KeyMapper:
    """Checkpoint key -> the target(s) it makes and how (:class:`MappedKey`), as transformers maps it."""

    def __init__(self, model: torch.nn.Module, targets: dict[str, torch.Tensor], *, templates: bool = True):
        self._targets = targets
        self._renamer = None    # TemplateRenamer: transformers' renaming once per template of key
        self._prefix = getattr(model, "base_model_prefix", None) or None
        self._renamings: list = []
        self._converters: list = []
        self._recipes: dict[str, Recipe | str] = {}  # converter source pattern -> recipe
        self._converters_of: dict[str, Any] = {}        # converter source pattern -> its converter
        self._rename_source_key = self._apply_renamings = None
        try:
            from transformers import PreTrainedModel
            from transformers.conversion_mapping import get_model_conversion_mapping
            from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key
        except ImportError:  # pragma: no cover - transformers without conversion mappings
            log.debug("transformers has no checkpoint conversion mapping; checkpoint keys are used as they are")
            return
        if not isinstance(model, PreTrainedModel):
            return
        self._apply_renamings, self._rename_source_key = _apply_renamings, rename_source_key
        mapping = get_model_conversion_mapping(model)  # fresh deep copies: the state they keep is ours
        self._renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
        self._converters = [t for t in mapping if isinstance(t, WeightConverter)]
        for converter in self._converters:   # a pattern of two converters: the last, as transformers picks
            self._recipes.update(_recipes_of(converter))
            self._converters_of.update(dict.fromkeys(converter.source_patterns, converter))
        if templates:
            self._renamer = TemplateRenamer(self._rename_alone, fixed_digits(self._renamings + self._converters))

    def _rename_alone(self, key: str) -> tuple[tuple[str, str], str | None]:
        """transformers' renaming of ``key`` before it looks the result up in the model: ((renamed by
        the renamings and converters, by the renamings only), the converter pattern that matched)."""
        renamed, pattern = self._rename_source_key(key, self._renamings, self._converters)
        return (renamed, self._apply_renamings(key, self._renamings)), pattern

    def renamed(self, key: str) -> tuple[str, str | None]:
        """``key`` as transformers renames it for this model (``rename_source_key``), and the
        converter source pattern it matched (None: none)."""
        return self._renamed(key)[0]

    def _renamed(self, key: str) -> tuple[tuple[str, str | None], Callable[[], str]]:
        if self._renamer is None:
            target = self._rename_source_key(key, self._renamings, self._converters, self._prefix, self._targets)
            return target, lambda: self._apply_renamings(key, self._renamings)
        (renamed, by_renamings), pattern = self._renamer(key)
        # the last step looks the name up in the model (adds or drops base_model_prefix): per key, by transformers
        target, _ = self._rename_source_key(renamed, [], [], self._prefix, self._targets)
        return (target, pattern), lambda: by_renamings

    def map(self, key: str) -> MappedKey:
        """The target(s) ``key`` makes, and how it is read."""
        if self._rename_source_key is None:  # not a transformers model: keys are used as they are
            return MappedKey((key,), None)
        (target, pattern), by_renamings = self._renamed(key)
        if target not in self._targets and key in self._targets:  # as transformers: keep a key that already fits
            return MappedKey((key,), None)
        if pattern is None:
            return MappedKey((target,), None)
        recipe, converter = self._recipes[pattern], self._converters_of[pattern]
        targets = _sibling_targets(target, converter)
        if isinstance(recipe, str):
            return MappedKey(targets, recipe, pattern=pattern, converter=converter)
        position = recipe.patterns.index(pattern)
        expert = None
        if recipe.stack:
            match = recipe.index_regex[position].search(by_renamings())
            if match is None:
                why = f"pattern '{pattern}' without an expert index in '{key}'"
                return MappedKey(targets, why, pattern=pattern, converter=converter)
            expert = int(match.group(1))
            if recipe.experts_split:
                return self._split_expert(targets, recipe, position, expert, pattern, converter)
        return MappedKey(targets, recipe, position, expert, pattern, converter)

    def _split_expert(self, targets: tuple[str, ...], recipe: Recipe, position: int, expert: int,
                      pattern: str, converter) -> MappedKey:
        """Checkpoint expert ``expert`` of a list cut in equal runs into ``targets``: the one target
        whose run holds it, and its index there. The run is the first target's number of experts
        (transformers' ``ceil(N / targets)``: the first run is never the short one)."""
        first = self._targets.get(targets[0])
        if first is None or first.dim() < 1 or first.shape[0] == 0:
            return MappedKey(targets, recipe, position, expert, pattern, converter)   # unused: reported as such
        run = int(first.shape[0])
        part = min(expert // run, len(targets) - 1)
        return MappedKey((targets[part],), recipe, position, expert - part * run, pattern, converter)


def _apply_renamings(key: str, renamings: list) -> str:
    """``key`` through every ``WeightRenaming`` in turn, as transformers renames before converting
    (its own ``apply_renamings`` exists only from 5.2x; each renaming's method since 5.0)."""
    for renaming in renamings:
        key, _ = renaming.rename_source_key(key)
    return key


def _sibling_targets(target: str, converter) -> tuple[str, ...]:
    """Every target a converter makes of the key that ``rename_source_key`` named ``target``.

    transformers names such a key after the converter's first target pattern only; its operations
    then name the others by putting each target pattern in its place (``Split``, and the
    unexpected-key report of ``convert_and_load_state_dict_in_model``): the same here."""
    first = converter.target_patterns[0]
    if len(converter.target_patterns) == 1 or first not in target:
        return (target,)
    return tuple(target.replace(first, pattern) for pattern in converter.target_patterns)
