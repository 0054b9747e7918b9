"""Match rules against a model's module tree and swap in operators, transactionally.

Three steps, in this order (docs/architecture.md, "Injection: plan, validate, change"):

1. :func:`match_modules` — a pure pre-order walk: which rule claims which module.
2. build — every operator is constructed (constructors must not touch the model).
3. apply — modules are swapped, then each operator's ``attach`` places its weights.

Any exception in 2 or 3 undoes whatever 3 did, so a failed :func:`optimize` leaves the
model exactly as it was: the same module objects holding the same tensors.
"""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from kinject.engine.formats.base import FormatError
from kinject.errors import InjectionError, KinjectError, RuleError
from kinject.io.loading import materialise_rest
from kinject.rules import Rule, RuleSet, load_rules
from kinject.runtime import Runtime
from operators.base import Operator

logger = logging.getLogger(__name__)

#: Class-name fragments of modules a MoE port usually has to place (for `inspect`).
MOE_LOOKING = re.compile(r"(Experts?|Router|Gate|Gating|MoE|Moe|Attention)$")


def match_rule(rule: Rule, name: str, module: nn.Module) -> bool:
    """Whether ``rule`` claims the module at dotted path ``name`` (pure; no side effects)."""
    m = rule.match
    if m.pattern is not None and not m.pattern.search(name):
        return False
    if m.class_pattern is not None and not m.class_pattern.search(type(module).__name__):
        return False
    if m.without_child_pattern is not None and any(m.without_child_pattern.search(n) for n, _ in module.named_children()):
        return False
    if m.with_children_pattern is not None and sum(
            1 for _, c in module.named_children() if m.with_children_pattern.search(type(c).__name__)) < m.with_children[1]:
        return False
    if m.cls is not None:
        if isinstance(m.cls, str):
            return any(c.__name__ == m.cls for c in type(module).__mro__)
        return isinstance(module, m.cls)
    return True


@dataclass
class Claim:
    """A module a rule matched, and where it hangs in the tree."""

    name: str
    module: nn.Module
    rule: Rule
    parent: nn.Module
    attr: str


@dataclass
class InjectionReport:
    """Which rule matched which modules; MoE-looking modules no rule touched."""

    rules_file: str
    rules: list[Rule]
    matches: dict[int, list[str]] = field(default_factory=dict)
    untouched: list[tuple[str, str]] = field(default_factory=list)   # (name, class name)

    def format(self, max_names: int = 4) -> str:
        out = [f"rules: {self.rules_file}"]
        for r in self.rules:
            names = self.matches.get(r.index, [])
            shown = ", ".join(names[:max_names]) + (", ..." if len(names) > max_names else "")
            none = " (optional)" if r.optional and not names else ""
            out.append(f"  {r.describe()}: {len(names)} matched{none}" + (f"  [{shown}]" if names else ""))
        if self.untouched:
            out.append(f"  MoE-looking modules no rule touched ({len(self.untouched)}):")
            by_cls: dict[str, list[str]] = {}
            for n, c in self.untouched:
                by_cls.setdefault(c, []).append(n)
            for c, ns in by_cls.items():
                out.append(f"    {c}: {len(ns)}  [{', '.join(ns[:max_names])}{', ...' if len(ns) > max_names else ''}]")
        return "\n".join(out)

    __str__ = format


def match_modules(model: nn.Module, ruleset: RuleSet) -> tuple[list[Claim], InjectionReport]:
    """Pre-order walk: the first matching rule claims a module; ``recursive: false`` stops
    the walk below it, and an operator class may take over some descendants of the module it
    claims (``owned_descendants(module, kwargs)``: dotted names below it, e.g. the experts modules
    of a MoE block whose experts it schedules), which no other rule then claims. Raises RuleError for a non-optional
    rule that matched nothing."""
    claims: list[Claim] = []
    report = InjectionReport(rules_file=ruleset.path, rules=ruleset.rules)
    seen: set[int] = set()
    all_names: list[tuple[str, nn.Module]] = []

    owned: set[str] = set()      # descendants a claiming operator takes over (their weights are its own)

    def walk(parent: nn.Module, prefix: str, inside_claim: bool) -> None:
        for attr, child in parent.named_children():
            if child is None or id(child) in seen:
                continue
            seen.add(id(child))
            name = f"{prefix}.{attr}" if prefix else attr
            all_names.append((name, child))
            if name in owned:
                continue
            rule = next((r for r in ruleset.rules if match_rule(r, name, child) and _accepts(r, child, parent)), None)
            if rule is not None:
                claims.append(Claim(name, child, rule, parent, attr))
                report.matches.setdefault(rule.index, []).append(name)
                if not rule.recursive:
                    continue
                owned.update(f"{name}.{d}" for d in rule.replace_cls.owned_descendants(child, rule.kwargs))
            elif not inside_claim and MOE_LOOKING.search(type(child).__name__):
                report.untouched.append((name, type(child).__name__))
            walk(child, name, inside_claim or rule is not None)

    walk(model, "", False)
    claimed = [c.name + "." for c in claims]        # a block whose insides are all placed is fine
    report.untouched = [(n, c) for n, c in report.untouched if not any(x.startswith(n + ".") for x in claimed)]
    for r in ruleset.rules:
        if not r.optional and not report.matches.get(r.index):
            raise RuleError(f"{r.describe()} matched no module{_near_misses(r, all_names)}",
                            file=r.file or ruleset.path, rule=r.index, key="match", line=r.line)
    return claims, report


def _accepts(rule: Rule, module: nn.Module, parent: nn.Module) -> bool:
    """The operator's own check of a match (``accepts(module, parent)``, by tree and shapes)."""
    return rule.replace_cls.accepts(module, parent)


def _near_misses(rule: Rule, names: list[tuple[str, nn.Module]]) -> str:
    """A hint with the closest existing module names / classes, for a rule that matched nothing."""
    hints = []
    if rule.match.name is not None:
        literal = re.sub(r"\\d\+|\\d|[\^\$\\()\[\]+*?]", "", rule.match.name)
        cand = [n for n, _ in names]
        near = difflib.get_close_matches(literal, cand, n=3, cutoff=0.3)
        if near:
            hints.append("closest module names: " + ", ".join(near))
    if rule.match.cls is not None:
        classes = sorted({type(m).__name__ for _, m in names})
        want = rule.match.cls if isinstance(rule.match.cls, str) else rule.match.cls.__name__
        near = difflib.get_close_matches(want, classes, n=3, cutoff=0.3)
        if near:
            hints.append("closest classes in the model: " + ", ".join(near))
    if rule.match.class_name is not None:
        classes = sorted({type(m).__name__ for _, m in names})
        near = difflib.get_close_matches(rule.match.class_name, classes, n=3, cutoff=0.3)
        if near:
            hints.append("closest classes in the model: " + ", ".join(near))
    return ("; " + "; ".join(hints)) if hints else ""


def optimize(model: nn.Module, rules: str | Path | dict | RuleSet, overrides: list[str] | None = None, *,
             checkpoint=None) -> nn.Module:
    """Inject operators into ``model`` in place, by rules; returns the same model.

    ``model.kinject`` is then the :class:`~kinject.runtime.Runtime`. On any error the model
    is left exactly as it was and the error says which rule and module failed.
    ``checkpoint`` (used by :func:`kinject.from_pretrained`): index that meta-device
    parameters are read from.
    """
    if getattr(model, "kinject", None) is not None:
        raise InjectionError("model is already optimized by kinject; call kinject.restore(model) first")
    ruleset = load_rules(rules, overrides)
    claims, report = match_modules(model, ruleset)
    if checkpoint is None:
        _refuse_quantized_modules(model, claims)
    _refuse_shared_parameters(claims)
    runtime = Runtime(ruleset, checkpoint=checkpoint)
    runtime.injection = report
    runtime.claims = claims
    runtime.find_stacks(model)

    ops = [_build(c, runtime) for c in claims]           # 2. build (no changes yet)
    try:
        _refuse_double_quantization(checkpoint, claims, ops)
    except FormatError:
        runtime.transfer.close()
        raise
    swapped: list[tuple[Claim, nn.Module]] = []
    attached = []
    current: Claim | None = None
    try:                                                  # 3. apply, undo on failure
        for claim, op in zip(claims, ops):
            setattr(claim.parent, claim.attr, op)
            swapped.append((claim, op))
        for claim, op in zip(claims, ops):
            attached.append(op)         # before attach: a half-done attach is undone too
            current = claim
            op.attach()
        current = None
        if checkpoint is not None:      # from_pretrained: what no operator took goes to the device
            materialise_rest(model, checkpoint, runtime.device, runtime.dtype,
                             named_modules=original_modules(model, runtime.device))
        runtime.attach_model(model)
        model.kinject = runtime
    except BaseException as exc:
        _undo(model, swapped, attached)
        runtime.transfer.close()
        if isinstance(exc, KinjectError):
            raise
        where = f" while attaching {current.rule.describe()} to {current.name!r}" if current else ""
        raise InjectionError(f"optimize failed{where}: {type(exc).__name__}: {exc}; model left unchanged") from exc
    logger.info("kinject: %d operators injected from %s", len(ops), ruleset.path)
    return model


def _refuse_shared_parameters(claims: list) -> None:
    """Weights tied across two claimed modules (DiffusionGemma's decoder layers reuse its encoder's
    Parameters) are served by one store copy that both operators bind to (``TensorStore.share``):
    that needs the two modules to hold the very same Parameters under the same names and to be
    claimed by one rule or by rules with the same operator and kwargs (the same units, tier and
    quantization): tied embeddings offloaded by an embeddings rule and an lm_head rule are one. Any other tie (a part of one
    module's weights tied to a part of another's, or across two rules) is refused before anything
    changes, naming both modules."""
    owner: dict[int, tuple[Claim, str]] = {}
    for claim in claims:
        for pname, param in claim.module.named_parameters(remove_duplicate=False):
            first = owner.setdefault(id(param), (claim, pname))
            nested = f"{first[0].name}.".startswith(f"{claim.name}.") or f"{claim.name}.".startswith(f"{first[0].name}.")
            if not nested:              # (a block claimed around its own claimed router is one owner)
                why = _why_not_shared(first[0], claim)
                if why:
                    raise InjectionError(
                        f"{claim.rule.describe()} matches {claim.name!r}, whose parameter {pname!r} is the same tensor "
                        f"as {first[0].name}.{first[1]} ({first[0].rule.describe()}): weights tied across two claimed "
                        f"modules are shared only when {why}; narrow the rule's match to one of them; model left "
                        "unchanged")


def _why_not_shared(a: Claim, b: Claim) -> str | None:
    """Why claims ``a`` and ``b``, whose modules share a parameter, cannot share one store copy of
    their weights (None: they can)."""
    if a.rule is not b.rule and (a.rule.replace_cls is not b.rule.replace_cls or a.rule.kwargs != b.rule.kwargs):
        return ("both modules are claimed by one rule, or by rules with the same operator and kwargs "
                "(the same units, tier and quantization)")
    pa = {n: id(p) for n, p in a.module.named_parameters()}
    pb = {n: id(p) for n, p in b.module.named_parameters()}
    if pa != pb:
        return "the two modules hold the very same Parameters under the same names (here only some are tied)"
    return None


_LOW_BIT = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e8m0fnu") if hasattr(torch, n))


def _refuse_quantized_modules(model: nn.Module, claims: list) -> None:
    """A model transformers loaded quantized on a GPU keeps its quantized modules (``FP8Linear``,
    ``FP8Experts``, MXFP4 experts: low-bit parameters beside scales, computed by their own kernels);
    kinject's operators move and compute plain weights, so claiming one is refused, pointing at
    ``kinject.from_pretrained``, which keeps those weights low-bit in every tier itself. (On a CPU
    transformers dequantizes at load: such a model is plain and optimized as any other.)"""
    for claim in claims:
        for pname, param in claim.module.named_parameters():
            if param.dtype in _LOW_BIT or not (param.dtype.is_floating_point or param.dtype.is_complex):
                raise InjectionError(
                    f"{claim.rule.describe()} matches {claim.name!r} ({type(claim.module).__name__}), whose parameter "
                    f"{pname!r} is {param.dtype}: the model was loaded quantized by transformers and kinject's "
                    "operators cannot wrap its quantized modules. Load the checkpoint with "
                    "kinject.from_pretrained(path, rules) instead: it keeps FP8 weights low-bit in every tier "
                    "and dequantizes them on the compute device; model left unchanged")


def _refuse_double_quantization(checkpoint, claims: list, ops: list) -> None:
    """A rule's ``quant`` (HQQ or any stored format) on a checkpoint released quantized would quantize its
    weights a second time: refused before any weight is read, naming the rule and the format."""
    fmt = getattr(checkpoint, "format", None)
    if fmt is None:
        return
    for claim, op in zip(claims, ops):
        if getattr(op, "quant", None) is not None:
            raise FormatError(
                f"{claim.rule.describe()} gives {claim.name!r} quant={op.quant.to_dict()}, but checkpoint "
                f"{checkpoint.root} is already quantized ({fmt.describe()}): kinject does not quantize twice. "
                "Set vars.quant=null (the weights already stay in their low-bit format in every tier)")


def original_modules(module: nn.Module, device: torch.device, prefix: str = ""):
    """``(name, module, device)`` triples with the names of the untouched model: an operator's
    ``base`` child takes the operator's own name, as checkpoint keys expect; ``device`` is where
    the loader reads what is still on meta: the operator's :meth:`~operators.base.Operator.load_device`
    for its base and everything below it, else the device passed in."""
    yield prefix, module, device
    for attr, child in module.named_children():
        if isinstance(module, Operator) and child is module.base:
            yield from original_modules(child, module.load_device() or device, prefix)
        else:
            yield from original_modules(child, device, f"{prefix}.{attr}" if prefix else attr)


def _build(claim: Claim, runtime: Runtime) -> nn.Module:
    rule = claim.rule
    try:
        return rule.replace_cls.from_module(claim.module, key=claim.name, runtime=runtime, **rule.kwargs)
    except KinjectError:
        raise
    except Exception as exc:
        raise RuleError(f"building {rule.replace_path} for module {claim.name!r} failed: {type(exc).__name__}: {exc}",
                        file=rule.file or runtime.rules.path, rule=rule.index, key="replace", line=rule.line) from exc


def _undo(model: nn.Module, swapped, attached) -> None:
    """Reverse of apply: detach in reverse order, then put the original modules back."""
    for op in reversed(attached):
        op.detach()
    for claim, _ in reversed(swapped):
        setattr(claim.parent, claim.attr, claim.module)
    if "kinject" in model.__dict__:
        del model.__dict__["kinject"]


def restore(model: nn.Module) -> nn.Module:
    """Undo :func:`optimize`: original modules back in place with their weights."""
    runtime = getattr(model, "kinject", None)
    if runtime is None:
        raise InjectionError("model is not optimized by kinject")
    runtime.detach_model(model)
    ops = [getattr(c.parent, c.attr) for c in runtime.claims]
    _undo(model, list(zip(runtime.claims, ops)), ops)
    return model
