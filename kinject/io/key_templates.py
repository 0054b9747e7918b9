"""transformers' key renaming run once per *shape* of checkpoint key, not once per key.

A release's checkpoint keys differ mostly in their digits: DeepSeek-V3's 45,395 keys are a few
dozen names with a layer and an expert index in them. transformers renames each key by running
every ``WeightRenaming`` and then the ``WeightConverter`` patterns on it (tens of microseconds a
key, most of :meth:`kinject.io.checkpoint.CheckpointIndex.open`'s time at those counts).
:class:`TemplateRenamer` runs transformers' own renaming on one key per *template* and gives the
others its result with their digits put back (docs/architecture.md, "Where each concept lives").

Why that is exact, not a guess. Let ``F`` be the digits the rules can tell apart: every digit a
pattern's regex matches as itself or in a class of only some digits (read from the parsed regex,
:func:`_told_apart`), and every digit written in a target pattern or a scope prefix. Two keys
have the same template when they are equal but for digits outside ``F`` and their digits outside
``F`` repeat in the same places (``layers.3.experts.3`` and ``layers.4.experts.4`` do;
``layers.3.experts.4`` does not). Then one key is the other with the digits outside ``F``
permuted, character by character, and every step of the renaming commutes with such a
permutation: a regex that cannot tell those digits apart matches the same spans in both keys,
captures permuted text, and ``str.replace`` / group substitution carry the permutation through.
So the renamed key of the second is the renamed key of the first with the same permutation.
Rules whose class is not exactly ``WeightRenaming`` / ``WeightConverter`` (their renaming may be
any code) and keys with the template's placeholder character are renamed one by one.
The model-dependent last step (adding or dropping ``base_model_prefix`` by looking the key up in
the model) is run per key, by transformers.
"""

from __future__ import annotations

import re
from typing import Callable

_DIGITS = "0123456789"
_PLACEHOLDER = "\x00"        # a free digit in a template (a key holding it is renamed on its own)


def _told_apart(pattern: str) -> set[str] | None:
    """The ASCII digits regex ``pattern`` treats differently from other digits (a literal digit, a
    class of some digits); None when the pattern cannot be analysed (then no digit is free)."""
    try:
        from re import _constants as c, _parser
    except ImportError:        # pragma: no cover - Python < 3.11
        return None
    try:
        parsed = _parser.parse(pattern)
    except Exception:  # noqa: BLE001 - any pattern the parser refuses: analysed as "every digit"
        return None
    told: set[str] = set()

    def class_digits(items) -> set[str] | None:
        listed: set[str] = set()
        for op, av in items:
            if op is c.NEGATE:
                continue
            if op is c.LITERAL:
                listed |= {chr(av)} & set(_DIGITS)
            elif op is c.RANGE:
                listed |= {d for d in _DIGITS if av[0] <= ord(d) <= av[1]}
            elif op is c.CATEGORY:
                if av in (c.CATEGORY_DIGIT, c.CATEGORY_WORD, c.CATEGORY_UNI_DIGIT, c.CATEGORY_UNI_WORD,
                          c.CATEGORY_NOT_SPACE, c.CATEGORY_UNI_NOT_SPACE, c.CATEGORY_NOT_LINEBREAK,
                          c.CATEGORY_UNI_NOT_LINEBREAK):
                    listed |= set(_DIGITS)
                elif av not in (c.CATEGORY_NOT_DIGIT, c.CATEGORY_UNI_NOT_DIGIT, c.CATEGORY_NOT_WORD,
                                c.CATEGORY_UNI_NOT_WORD, c.CATEGORY_SPACE, c.CATEGORY_UNI_SPACE,
                                c.CATEGORY_LINEBREAK, c.CATEGORY_UNI_LINEBREAK):
                    return None
            else:
                return None
        return set() if listed == set(_DIGITS) else listed    # all digits alike: none told apart

    def walk(items) -> bool:
        for op, av in items:
            if op in (c.LITERAL, c.NOT_LITERAL):
                if chr(av) in _DIGITS:
                    told.add(chr(av))
            elif op is c.IN:
                digits = class_digits(av)
                if digits is None:
                    return False
                told.update(digits)
            elif op is c.SUBPATTERN:
                if not walk(av[3]):
                    return False
            elif op is c.BRANCH:
                if not all(walk(branch) for branch in av[1]):
                    return False
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT, getattr(c, "POSSESSIVE_REPEAT", None)):
                if not walk(av[2]):
                    return False
            elif op in (c.ASSERT, c.ASSERT_NOT):
                if not walk(av[1]):
                    return False
            elif op is getattr(c, "ATOMIC_GROUP", None):
                if not walk(av):
                    return False
            elif op is c.GROUPREF_EXISTS:
                if not (walk(av[1]) and (av[2] is None or walk(av[2]))):
                    return False
            elif op not in (c.ANY, c.AT, c.CATEGORY, c.GROUPREF):
                return False
        return True

    return told if walk(parsed) else None


def fixed_digits(transforms: list) -> str | None:
    """The digits ``transforms`` (transformers ``WeightRenaming`` / ``WeightConverter``) tell apart,
    as a string; None when one of them renames by code of its own (no template is sound then)."""
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    fixed: set[str] = set()
    for t in transforms:
        if type(t) not in (WeightRenaming, WeightConverter):
            return None
        told = _told_apart(t.compiled_sources.pattern)
        if told is None:
            return _DIGITS
        fixed |= told
        written = [*t.target_patterns, getattr(t, "scope_prefix", None) or "", getattr(t, "base_model_prefix", None) or ""]
        fixed |= {ch for text in written for ch in text if ch in _DIGITS}
    return "".join(sorted(fixed))


class TemplateRenamer:
    """``rename(key)`` for many keys, run once per template (see the module docstring).

    ``rename``: a pure function of the key (transformers' renamings and converters, no lookup in
    the model) returning ``(renamed keys, rest)``: a tuple of strings the key is renamed to, and
    anything that does not depend on the key's digits (the converter pattern that matched);
    ``fixed``: the digits the rules tell apart (:func:`fixed_digits`; None: every key on its own)."""

    def __init__(self, rename: Callable[[str], tuple[tuple[str, ...], object]], fixed: str | None):
        self._rename = rename
        free = "".join(d for d in _DIGITS if d not in (fixed if fixed is not None else _DIGITS))
        self._free = re.compile(f"[{free}]") if free else None
        # (bytes: a C loop; UTF-8 never puts an ASCII byte inside another character's bytes)
        self._blank = bytes.maketrans(free.encode(), _PLACEHOLDER.encode() * len(free))
        self._templates: dict[tuple, tuple[str, tuple] | None] = {}
        self.calls = 0            # keys renamed by transformers itself (one per template, plus refused ones)

    def __call__(self, key: str) -> tuple[tuple[str, ...], object]:
        if self._free is None or _PLACEHOLDER in key:
            return self._run(key)
        digits = "".join(self._free.findall(key))
        if not digits:
            return self._run(key)
        shape = (key.encode().translate(self._blank), tuple(map(digits.index, digits)))
        template = self._templates.get(shape)
        if template is None:
            if shape in self._templates:          # a template whose result does not carry its digits
                return self._run(key)
            result = self._run(key)
            carried = all(set(self._free.findall(name)) <= set(digits) for name in result[0])
            self._templates[shape] = (digits, result) if carried else None
            return result
        own, result = template
        if own == digits:
            return result
        table = bytes.maketrans(own.encode(), digits.encode())
        return tuple(name.encode().translate(table).decode() for name in result[0]), result[1]

    def _run(self, key: str) -> tuple[tuple[str, ...], object]:
        self.calls += 1
        return self._rename(key)
