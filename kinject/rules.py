"""Rule files: load with OmegaConf, validate into typed dataclasses.

A rule file has a ``pipeline:`` mapping (read by the Runtime) and a ``rules:`` list
(read by the injector). Everything is checked here, before any module is touched, and
every error names the file, the rule index, the key and (when known) the YAML line.
"""

from __future__ import annotations

import dataclasses
import logging
import importlib
import inspect
import re
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from kinject.errors import RuleError

logger = logging.getLogger(__name__)

#: Short names accepted in ``replace.class`` for the operators kinject ships.
CLASS_ALIASES = {
    "default": "operators.base.Default",
}

# pipeline.host_kernel: auto or a host kernel of operators/host_experts.py's chain (a test keeps both lists equal)
HOST_KERNELS = ("auto", "torch-host", "kt-kernel", "torch-grouped", "torch-layout")

_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(value: Any) -> int | None:
    """``"22GiB"`` / ``"6GB"`` / ``123`` -> bytes; ``None`` stays ``None``."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _SIZE_UNITS:
        raise ValueError(f"not a size: {value!r} (use e.g. 6GiB, 512MB or a byte count)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()])


@dataclass
class PipelineConfig:
    """The global ``pipeline:`` section. Sizes are bytes after parsing."""

    device: str = "cpu"                     # compute device
    dtype: str | None = None                # compute dtype override (None: keep the model's)
    micro_batch_size: int | None = None     # Klotski's bs; None = the whole batch at once
    n_batches: int | str = 1                # Klotski's n, or "auto" (planner)
    decode_chunk: int | str = 1             # micro-batches a decode step's attention runs at once (their KV as one
                                            # chunk), or "auto": the most whose two chunks fit kv_budget
    kv_budget: int | None = None            # device bytes for KV working buffers (decode_chunk's room; None: unbounded)
    prefill: str = "group"                  # group: the batch group's prompts at once; micro_batch: one micro-batch
                                            # at a time through the whole model (activations of one micro-batch);
                                            # layer: each layer runs every micro-batch before the next layer
                                            # (weights once per layer, activations of one micro-batch per layer)
    prefill_chunk: int = 1                  # prefill: layer: micro-batches each layer call takes at once (attention
                                            # still per micro-batch, the experts once over all their tokens)
    # peak device bytes the placement must respect; auto: CUDA's free memory less the KV and activation
    # reserve, none on a CPU device (the same memory as the host); null: unbounded (kinject/engine/memory.py)
    device_budget: int | None | Literal["auto"] = "auto"
    # host bytes for the host tier, the rest caches the disk tier; auto: MemAvailable less a safety
    # margin, the cache shrinking when available memory drops; null: no cache (kinject/engine/memory.py)
    host_budget: int | None | Literal["auto"] = "auto"
    offload_dir: str | None = None          # where the disk tier lives
    emulate_bandwidth: float | None = None  # GB/s host->device link emulation (CPU machines)
    prefetch_lookahead: int = 1             # operators with offloaded weights the scheduler prefetches ahead
    disk_read_ahead_layers: int = 0         # host window of layers read ahead from disk
    drop_page_cache: bool = False           # posix_fadvise(DONTNEED) on the byte ranges each disk read used
    disk_workers: int = 2                   # concurrent disk reads (threads of the disk channel)
    # kernel readahead on disk reads; false: POSIX_FADV_RANDOM, read only the bytes asked for; auto: per batch
    # of reads, readahead where its units cover most of the bytes they span, exact bytes where they are sparse
    disk_readahead: bool | Literal["auto"] = "auto"
    trace: bool = False                     # record compute/transfer events (costs ~0.2 ms per layer on CPU)
    correlation_table: str | None = None    # expert correlation table JSON (prefetcher)
    update_table: bool = True               # update the table online during inference
    release_policy: str = "free"            # free: drop offloaded weights after use; cache: keep (LRU) within budget
    save_table: bool = False                # write the updated table back at the end
    host_threads: int | None = None         # torch threads of the host-experts worker (CUDA; None: torch's default)
    # kinject's compiled grouped GEMV for host compute (kinject/engine/host_gemv.py): exact: where its bits are
    # torch's (bfloat16 host experts and a CPU model's one-row linears: on AMX, or where torch computes in its
    # own order, AVX2) and INT8 host experts; fast: bfloat16 also elsewhere, and a decode step's attention in one
    # call (kinject/engine/host_sdpa.py; about 1 output in 10^4 one bfloat16 ulp off torch's); torch:
    # torch's kernels everywhere
    host_gemv: Literal["exact", "fast", "torch"] = "exact"
    # which host kernel computes host experts (operators/host_experts.py's chain): auto: the first that serves,
    # torch-host (transformers' bits) before kt-kernel; a name: that kernel first (skipped with a warning
    # saying why where it cannot serve)
    host_kernel: str = "auto"
    keep_resident: bool = False             # keep every-step units (attention, routers, ...) on the device as far as
                                            # the budget allows (kinject/engine/residency.py)

    _SIZES = ("device_budget", "host_budget", "kv_budget")
    _AUTO_SIZES = ("device_budget", "host_budget")      # sizes that also take "auto"

    def __post_init__(self) -> None:
        if self.n_batches != "auto" and not (isinstance(self.n_batches, int) and self.n_batches >= 1):
            raise ValueError("n_batches must be a positive integer or 'auto'")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError("micro_batch_size must be >= 1")
        if self.decode_chunk != "auto" and not (isinstance(self.decode_chunk, int) and self.decode_chunk >= 1):
            raise ValueError(f"decode_chunk must be a positive integer or 'auto', got {self.decode_chunk!r}")
        if self.emulate_bandwidth is not None and self.emulate_bandwidth <= 0:
            raise ValueError("emulate_bandwidth must be > 0 GB/s")
        if self.prefill not in ("group", "micro_batch", "layer"):
            raise ValueError(f"prefill must be 'group', 'micro_batch' or 'layer', got {self.prefill!r}")
        if not (isinstance(self.prefill_chunk, int) and not isinstance(self.prefill_chunk, bool)
                and self.prefill_chunk >= 1):
            raise ValueError(f"prefill_chunk must be a positive integer, got {self.prefill_chunk!r}")
        if self.release_policy not in ("free", "cache"):
            raise ValueError(f"release_policy must be 'free' or 'cache', got {self.release_policy!r}")
        if self.prefetch_lookahead < 0:
            raise ValueError("prefetch_lookahead must be >= 0")
        if self.disk_workers < 1:
            raise ValueError("disk_workers must be >= 1")
        if self.host_threads is not None and not (isinstance(self.host_threads, int) and self.host_threads >= 1):
            raise ValueError(f"host_threads must be a positive integer or null, got {self.host_threads!r}")
        if self.host_gemv not in ("exact", "fast", "torch"):
            raise ValueError(f"host_gemv must be 'exact', 'fast' or 'torch', got {self.host_gemv!r}")
        if self.host_kernel not in HOST_KERNELS:
            raise ValueError(f"host_kernel must be one of {', '.join(HOST_KERNELS)}, got {self.host_kernel!r}")


@dataclass(frozen=True)
class Match:
    """``match:`` of a rule. ``name`` is a regex searched in the dotted module path;
    ``cls`` is a class (isinstance) or, for a bare class name, a name looked up in the MRO;
    ``class_name`` is a regex searched in the module's class name (``'MoeExperts$'``), so one
    rule can serve every family without naming any family's class; ``without_child`` is a regex
    that none of the module's direct children's names may match (``'^experts$'``: a dense MLP,
    not a MoE block that happens to be called ``...MLP``); ``with_children`` (``{class_name: REGEX,
    min: N}``) asks for at least ``N`` direct children whose class name matches (a MoE block that
    holds several experts modules: ``{class_name: 'Experts$', min: 2}``)."""

    name: str | None = None
    cls: type | str | None = None
    pattern: re.Pattern | None = field(default=None, compare=False, repr=False)
    class_name: str | None = None
    class_pattern: re.Pattern | None = field(default=None, compare=False, repr=False)
    without_child: str | None = None         # regex: no direct child's attribute name may match it
    without_child_pattern: re.Pattern | None = field(default=None, compare=False, repr=False)
    with_children: tuple[str, int] | None = None    # (class-name regex, at least this many direct children)
    with_children_pattern: re.Pattern | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Rule:
    index: int
    match: Match
    replace_path: str           # import path as written (after alias expansion)
    replace_cls: type
    kwargs: dict[str, Any]
    recursive: bool = True
    optional: bool = False
    line: int | None = None
    file: str | None = None     # the file the rule was written in (an ``extends:`` base, or the file itself)

    def describe(self) -> str:
        parts = []
        if self.match.name is not None:
            parts.append(f"name={self.match.name!r}")
        if self.match.cls is not None:
            c = self.match.cls
            parts.append(f"class={c if isinstance(c, str) else c.__module__ + '.' + c.__qualname__}")
        if self.match.class_name is not None:
            parts.append(f"class_name={self.match.class_name!r}")
        if self.match.without_child is not None:
            parts.append(f"without_child={self.match.without_child!r}")
        if self.match.with_children is not None:
            parts.append("with_children={class_name: %r, min: %d}" % self.match.with_children)
        return f"rule {self.index} ({', '.join(parts)} -> {self.replace_path})"


@dataclass
class RuleSet:
    path: str                   # file name, or "<dict>" for in-memory rules
    pipeline: PipelineConfig
    rules: list[Rule]
    raw: dict = field(repr=False, default_factory=dict)   # resolved container, for reports


# ---------------------------------------------------------------- loading


def builtin_rules_dir() -> Path:
    """The ``rules/`` folder shipped next to the ``kinject`` package."""
    return Path(__file__).resolve().parent.parent / "rules"


def resolve_rules_path(name: str | Path) -> Path:
    """A rule file path as given, else a shipped one: ``klotski`` or ``rules/klotski.yaml``
    both find ``<repo>/rules/klotski.yaml``.

    Shipped rules are family-agnostic, one file per strategy; the per-family names of earlier
    releases (``rules/mixtral_klotski.yaml``, ``qwen3_moe_offload``, ...) still work: a
    ``<model_type>_<strategy>`` name with no file of its own resolves to ``<strategy>.yaml``
    when ``<model_type>`` is a model type transformers knows."""
    p = Path(name).expanduser()
    if p.is_file():
        return p
    shipped = builtin_rules_dir()
    stem = p.name[:-5] if p.name.endswith(".yaml") else p.name
    for cand in (shipped / p.name, shipped / f"{stem}.yaml"):
        if cand.is_file():
            return cand
    generic = _generic_for_family_name(stem)
    return generic if generic is not None else p


def _generic_for_family_name(stem: str) -> Path | None:
    """``mixtral_klotski`` -> ``rules/klotski.yaml`` (``mixtral`` a known model type), else None."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    parts = stem.split("_")
    for i in range(1, len(parts)):
        family, strategy = "_".join(parts[:i]), "_".join(parts[i:])
        cand = builtin_rules_dir() / f"{strategy}.yaml"
        if family in CONFIG_MAPPING_NAMES and cand.is_file():
            logger.info("kinject: %s has no family file; using the family-agnostic %s", stem, cand)
            return cand
    return None


def load_rules(source: str | Path | dict | RuleSet, overrides: list[str] | tuple[str, ...] | None = None) -> RuleSet:
    """Load and validate a rule file (or an in-memory dict) with ``key=value`` overrides."""
    if isinstance(source, RuleSet):
        if overrides:
            raise RuleError("overrides need a rule file or dict, not an already-loaded RuleSet", file=source.path)
        return source
    if isinstance(source, dict):
        fname, data, origins = "<dict>", dict(source), {}
        if "extends" in data:
            raise RuleError("'extends' needs a rule file (a path to resolve it against), not a dict", file=fname,
                            key="extends")
    else:
        path = resolve_rules_path(source)
        fname = str(path) if path.name != Path(str(source)).name else str(source)   # a family alias: the real file
        data, origins = _read_rule_file(path, fname, ())
    resolved = _apply_overrides_and_resolve(data, overrides or [], fname)
    return _validate(resolved, fname, origins)


def _read_rule_file(path: Path, fname: str, chain: tuple[Path, ...]) -> tuple[dict, dict]:
    """A rule file's data with its ``extends:`` chain merged in, and where every key came from
    (``{key path: (file, line)}``).

    ``extends: klotski.yaml`` (a path relative to this file, or a shipped rule file's name) takes
    the base file's ``vars`` and ``pipeline`` with this file's keys merged over them. A rule
    whose ``match`` equals a base rule's replaces that rule in place (indices for ``--set
    rules.N...`` stay the base's); every other rule goes *before* the base's, so it wins where
    both match (first match wins)."""
    if not path.is_file():
        raise RuleError(f"rule file not found: {path}", file=fname)
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
        lines = _line_index(yaml.compose(text))
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        raise RuleError(f"malformed YAML: {getattr(exc, 'problem', None) or exc}", file=fname,
                        line=mark.line + 1 if mark else None) from None
    if not isinstance(data, dict):
        raise RuleError("a rule file must be a mapping with 'pipeline:' and 'rules:'", file=fname)
    origins = {p: (fname, ln) for p, ln in lines.items()}
    base_name = data.pop("extends", None)
    if base_name is None:
        return data, origins
    where = dict(file=fname, key="extends", line=lines.get(("extends",)))
    if not isinstance(base_name, str) or not base_name:
        raise RuleError(f"must be a rule file name or path, got {base_name!r}", **where)
    base_path = path.parent / base_name
    if not base_path.is_file():
        base_path = resolve_rules_path(base_name)
    if not base_path.is_file():
        raise RuleError(f"base rule file {base_name!r} not found (next to {path} or in {builtin_rules_dir()})", **where)
    if base_path.resolve() in chain + (path.resolve(),):
        raise RuleError(f"'extends' loops back to {base_path}", **where)
    base, base_origins = _read_rule_file(base_path, str(base_path), chain + (path.resolve(),))
    for key in ("vars", "pipeline", "rules"):
        for d, name in ((data, fname), (base, str(base_path))):
            if d.get(key) is not None and not isinstance(d[key], list if key == "rules" else dict):
                raise RuleError(f"'{key}' must be a {'list' if key == 'rules' else 'mapping'}", file=name, key=key)
    own_rules = list(data.get("rules") or [])
    base_rules = list(base.get("rules") or [])
    merged = dict(base)
    merged.update({k: v for k, v in data.items() if k not in ("vars", "pipeline", "rules")})
    for key in ("vars", "pipeline"):
        if key in data or key in base:
            merged[key] = _merge_mappings(base.get(key) or {}, data.get(key) or {})
    # a rule whose `match` equals a base rule's replaces it in place; the others go first
    rules = list(base_rules)
    in_place: dict[int, int] = {}               # own rule index -> the base rule it replaces
    for i, r in enumerate(own_rules):
        j = next((j for j, b in enumerate(base_rules) if _same_match(r, b)), None)
        if j is not None:
            rules[j] = r
            in_place[i] = j
    added = [i for i in range(len(own_rules)) if i not in in_place]
    merged["rules"] = [own_rules[i] for i in added] + rules
    target = {i: k for k, i in enumerate(added)} | {i: j + len(added) for i, j in in_place.items()}
    shifted = {}
    for p, where_from in base_origins.items():
        if _rule_path(p):
            if p[1] in in_place.values():
                continue
            p = ("rules", p[1] + len(added)) + p[2:]
        shifted[p] = where_from
    for p, where_from in origins.items():
        if _rule_path(p):
            p = ("rules", target[p[1]]) + p[2:]
        elif p[:1] == ("rules",):
            continue
        shifted[p] = where_from
    return merged, shifted


def _same_match(rule: Any, base_rule: Any) -> bool:
    return isinstance(rule, dict) and isinstance(base_rule, dict) and rule.get("match") == base_rule.get("match")


def _rule_path(path: tuple) -> bool:
    """``('rules', 3, ...)``: a key path inside one rule."""
    return len(path) >= 2 and path[0] == "rules" and isinstance(path[1], int)


def _merge_mappings(base: dict, top: dict) -> dict:
    """``top`` over ``base``, recursively for nested mappings."""
    out = dict(base)
    for k, v in top.items():
        out[k] = _merge_mappings(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _line_index(node, path=()) -> dict[tuple, int]:
    """Map each key path (('rules', 2, 'replace', 'class')) to its 1-based YAML line."""
    out: dict[tuple, int] = {}
    if node is None:
        return out
    out[path] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for k, v in node.value:
            key = k.value
            out[path + (key,)] = k.start_mark.line + 1
            out.update({p: ln for p, ln in _line_index(v, path + (key,)).items() if p != path + (key,)})
    elif isinstance(node, yaml.SequenceNode):
        for i, v in enumerate(node.value):
            out.update(_line_index(v, path + (i,)))
    return out


def _apply_overrides_and_resolve(data: dict, overrides: list[str], fname: str) -> dict:
    try:
        cfg = OmegaConf.create(data)
    except OmegaConfBaseException as exc:
        raise RuleError(f"cannot read rule file: {exc}", file=fname) from None
    for ov in overrides:
        if "=" not in ov:
            raise RuleError(f"override {ov!r} is not key=value", file=fname, key=ov)
        key, value = ov.split("=", 1)
        key = key.strip()
        if not key.startswith(("pipeline.", "rules.", "vars.")):
            raise RuleError(f"override {ov!r}: key must start with 'pipeline.', 'rules.' or 'vars.'",
                            file=fname, key=key)
        try:
            OmegaConf.update(cfg, key, yaml.safe_load(value) if value.strip() else None, merge=True)
        except (OmegaConfBaseException, yaml.YAMLError) as exc:
            raise RuleError(f"override {ov!r} cannot be applied: {str(exc).splitlines()[0]}",
                            file=fname, key=key) from None
    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        full_key = getattr(exc, "full_key", None)
        raise RuleError(f"interpolation failed: {str(exc).splitlines()[0]}", file=fname, key=full_key) from None


#: ``vars:`` is free-form: values to interpolate (``${vars.weights}``) and override (``vars.weights=disk``).
_TOP_KEYS = {"pipeline", "rules", "vars", "extends"}
_RULE_KEYS = {"match", "replace", "recursive", "optional"}
_MATCH_KEYS = {"name", "class", "class_name", "without_child", "with_children"}
_REPLACE_KEYS = {"class", "kwargs"}


def _validate(data: dict, fname: str, origins: dict) -> RuleSet:
    def err(msg, *, rule=None, key=None, path=()):
        file, line = origins.get(path) or _nearest_origin(origins, path) or (fname, None)
        return RuleError(msg, file=file, rule=rule, key=key, line=line)

    unknown = set(data) - _TOP_KEYS
    if unknown:
        k = sorted(unknown)[0]
        raise err(f"unknown top-level key {k!r}; expected {sorted(_TOP_KEYS)}", key=k, path=(k,))
    pipeline = _validate_pipeline(data.get("pipeline") or {}, err)
    rules_data = data.get("rules")
    if rules_data is None:
        raise err("missing 'rules:' list", key="rules")
    if not isinstance(rules_data, list):
        raise err(f"'rules' must be a list, got {type(rules_data).__name__}", key="rules", path=("rules",))
    rules = [_validate_rule(i, r, err) for i, r in enumerate(rules_data)]
    for r in rules:
        file, line = origins.get(("rules", r.index), (fname, None))
        object.__setattr__(r, "line", line)
        object.__setattr__(r, "file", file)
    return RuleSet(path=fname, pipeline=pipeline, rules=rules, raw=data)


def _nearest_origin(origins: dict, path: tuple) -> tuple[str, int] | None:
    while path:
        path = path[:-1]
        if path in origins:
            return origins[path]
    return None


def _validate_pipeline(p: Any, err) -> PipelineConfig:
    if not isinstance(p, dict):
        raise err(f"'pipeline' must be a mapping, got {type(p).__name__}", key="pipeline", path=("pipeline",))
    fields = {f.name: f for f in dataclasses.fields(PipelineConfig)}
    hints = typing.get_type_hints(PipelineConfig)
    values = {}
    for k, v in p.items():
        path = ("pipeline", k)
        if k not in fields:
            close = _close(k, fields)
            raise err(f"unknown pipeline key {k!r}{close}", key=f"pipeline.{k}", path=path)
        if k in PipelineConfig._SIZES:
            if not (v == "auto" and k in PipelineConfig._AUTO_SIZES):
                try:
                    v = parse_size(v)
                except ValueError as exc:
                    also = ", 'auto' or null" if k in PipelineConfig._AUTO_SIZES else " or null"
                    raise err(f"{exc}{also}", key=f"pipeline.{k}", path=path) from None
        elif k == "n_batches":
            if v != "auto" and not (isinstance(v, int) and not isinstance(v, bool)):
                raise err(f"expected a positive integer or 'auto', got {v!r}", key="pipeline.n_batches", path=path)
        else:
            problem = type_problem(v, hints[k])
            if problem:
                raise err(problem, key=f"pipeline.{k}", path=path)
        values[k] = v
    try:
        return PipelineConfig(**values)
    except ValueError as exc:
        raise err(str(exc), key="pipeline", path=("pipeline",)) from None


def _compile_regex(text: Any, err, *, rule: int, key: str, path: tuple) -> re.Pattern | None:
    """A rule's regex key compiled, or a located error quoting it back."""
    if text is None:
        return None
    if not isinstance(text, str) or not text:
        raise err(f"must be a non-empty regex string, got {text!r}", rule=rule, key=key, path=path)
    try:
        return re.compile(text)
    except re.error as exc:
        raise err(f"bad regex {text!r}: {exc}", rule=rule, key=key, path=path) from None


def _validate_rule(i: int, r: Any, err) -> Rule:
    base = ("rules", i)
    if not isinstance(r, dict):
        raise err(f"a rule must be a mapping, got {type(r).__name__}", rule=i, path=base)
    for k in r:
        if k not in _RULE_KEYS:
            raise err(f"unknown rule key {k!r}{_close(k, _RULE_KEYS)}", rule=i, key=k, path=base + (k,))
    for flag in ("recursive", "optional"):
        if flag in r and not isinstance(r[flag], bool):
            raise err(f"must be true or false, got {r[flag]!r}", rule=i, key=flag, path=base + (flag,))

    m = r.get("match")
    if not isinstance(m, dict) or not m:
        raise err("'match' must be a non-empty mapping with 'name', 'class' and/or 'class_name'", rule=i, key="match",
                  path=base + ("match",))
    for k in m:
        if k not in _MATCH_KEYS:
            raise err(f"unknown match key {k!r}{_close(k, _MATCH_KEYS)}", rule=i, key=f"match.{k}",
                      path=base + ("match", k))
    name, cls_spec, cls_name = m.get("name"), m.get("class"), m.get("class_name")
    if name is None and cls_spec is None and cls_name is None:
        raise err("'match' needs 'name', 'class' and/or 'class_name'", rule=i, key="match", path=base + ("match",))
    pattern = _compile_regex(name, err, rule=i, key="match.name", path=base + ("match", "name"))
    class_pattern = _compile_regex(cls_name, err, rule=i, key="match.class_name", path=base + ("match", "class_name"))
    without = m.get("without_child")
    without_pattern = _compile_regex(without, err, rule=i, key="match.without_child",
                                     path=base + ("match", "without_child"))
    children, children_pattern = m.get("with_children"), None
    if children is not None:
        where = dict(rule=i, key="match.with_children", path=base + ("match", "with_children"))
        if not isinstance(children, dict) or set(children) - {"class_name", "min"} or "class_name" not in children:
            raise err(f"must be a mapping {{class_name: REGEX, min: N}}, got {children!r}", **where)
        least = children.get("min", 1)
        if not isinstance(least, int) or isinstance(least, bool) or least < 1:
            raise err(f"'min' must be an integer >= 1, got {least!r}", **where)
        children_pattern = _compile_regex(children["class_name"], err, rule=i, key="match.with_children.class_name",
                                          path=base + ("match", "with_children", "class_name"))
        children = (children["class_name"], least)
    match_cls: type | str | None = None
    if cls_spec is not None:
        if not isinstance(cls_spec, str) or not cls_spec:
            raise err(f"must be a class import path or class name, got {cls_spec!r}", rule=i, key="match.class",
                      path=base + ("match", "class"))
        if "." in cls_spec:
            try:
                match_cls = import_object(cls_spec)
            except ImportError as exc:
                raise err(str(exc), rule=i, key="match.class", path=base + ("match", "class")) from None
            if not isinstance(match_cls, type):
                raise err(f"{cls_spec!r} is not a class", rule=i, key="match.class", path=base + ("match", "class"))
        else:
            match_cls = cls_spec
    match = Match(name=name, cls=match_cls, pattern=pattern, class_name=cls_name, class_pattern=class_pattern,
                  without_child=without, without_child_pattern=without_pattern,
                  with_children=children, with_children_pattern=children_pattern)

    rep = r.get("replace")
    if not isinstance(rep, dict) or "class" not in rep:
        raise err("'replace' must be a mapping with 'class'", rule=i, key="replace", path=base + ("replace",))
    for k in rep:
        if k not in _REPLACE_KEYS:
            raise err(f"unknown replace key {k!r}{_close(k, _REPLACE_KEYS)}", rule=i, key=f"replace.{k}",
                      path=base + ("replace", k))
    path = rep["class"]
    if not isinstance(path, str):
        raise err(f"must be an import path, got {path!r}", rule=i, key="replace.class", path=base + ("replace", "class"))
    path = CLASS_ALIASES.get(path, path)
    try:
        op_cls = import_object(path)
    except ImportError as exc:
        raise err(str(exc), rule=i, key="replace.class", path=base + ("replace", "class")) from None
    kwargs = rep.get("kwargs") or {}
    if not isinstance(kwargs, dict):
        raise err(f"must be a mapping, got {type(kwargs).__name__}", rule=i, key="replace.kwargs",
                  path=base + ("replace", "kwargs"))
    problem = check_operator_kwargs(op_cls, kwargs)
    if problem:
        key, msg = problem
        raise err(msg, rule=i, key=f"replace.kwargs.{key}" if key else "replace.class",
                  path=base + ("replace", "kwargs", key) if key else base + ("replace", "class"))
    return Rule(index=i, match=match, replace_path=path, replace_cls=op_cls, kwargs=dict(kwargs),
                recursive=r.get("recursive", True), optional=r.get("optional", False))


# ---------------------------------------------------------------- helpers


def import_object(path: str) -> Any:
    """``"pkg.mod.Name"`` -> the object; ImportError says exactly what failed."""
    mod_name, _, attr = path.rpartition(".")
    if not mod_name:
        raise ImportError(f"{path!r} is not an import path (expected 'package.module.Name')")
    try:
        mod = importlib.import_module(mod_name)
    except Exception as exc:  # ModuleNotFoundError, or an error inside that module
        raise ImportError(f"cannot import {path!r}: module {mod_name!r}: {exc}") from None
    try:
        return getattr(mod, attr)
    except AttributeError:
        names = [n for n in dir(mod) if not n.startswith("_")]
        raise ImportError(f"cannot import {path!r}: {mod_name!r} has no {attr!r}{_close(attr, names)}") from None


def _close(word: str, options) -> str:
    import difflib

    near = difflib.get_close_matches(str(word), [str(o) for o in options], n=3)
    return f" (did you mean {', '.join(repr(n) for n in near)}?)" if near else ""


#: Constructor parameters the injector supplies itself; rules may not set them.
RESERVED_PARAMS = ("key", "runtime")


def check_operator_kwargs(op_cls: type, kwargs: dict) -> tuple[str | None, str] | None:
    """Check rule kwargs against the operator's constructor; None if fine, else (key, message)."""
    if not isinstance(op_cls, type):
        return None, f"{op_cls!r} is not a class"
    from operators.base import Operator  # local: operators import kinject

    if not issubclass(op_cls, Operator):
        return None, f"{op_cls.__module__}.{op_cls.__qualname__} is not a kinject operator (subclass operators.base.Operator)"
    if inspect.isabstract(op_cls):
        return None, (f"{op_cls.__module__}.{op_cls.__qualname__} does not implement "
                      f"{', '.join(sorted(op_cls.__abstractmethods__))} (operators.base.Operator declares them)")
    sig = inspect.signature(op_cls.__init__)
    params = list(sig.parameters.values())[2:]  # skip self, base module
    accepted = {p.name: p for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                and p.name not in RESERVED_PARAMS}
    hints = _param_hints(op_cls.__init__, accepted)
    for k, v in kwargs.items():
        if k in RESERVED_PARAMS:
            return k, f"{k!r} is set by kinject, not by rules"
        if k not in accepted:
            return k, (f"{op_cls.__name__} does not take {k!r}{_close(k, accepted)}; "
                       f"it takes: {', '.join(sorted(accepted)) or 'no kwargs'}")
        if k in hints:
            problem = type_problem(v, hints[k])
            if problem:
                return k, problem
    missing = [n for n, p in accepted.items() if p.default is p.empty and n not in kwargs]
    if missing:
        return missing[0], f"{op_cls.__name__} requires {missing[0]!r}"
    try:
        op_cls.check_kwargs(dict(kwargs))          # declared by operators.base.Operator (default: no check)
    except (ValueError, TypeError) as exc:
        key = getattr(exc, "key", None)
        return key, str(exc)
    return None


def _param_hints(fn, params: dict) -> dict[str, Any]:
    """Evaluate each parameter annotation on its own, so one TYPE_CHECKING-only name
    (like ``'Runtime'``) does not hide the hints of every other parameter."""
    out = {}
    for name, p in params.items():
        ann = p.annotation
        if isinstance(ann, str):
            try:
                ann = eval(ann, getattr(fn, "__globals__", {}), {"Literal": Literal})  # noqa: S307 (annotation)
            except Exception:
                continue
        out[name] = ann
    return out


def type_problem(value: Any, hint: Any) -> str | None:
    """A message if ``value`` does not fit the annotation ``hint`` (simple types, Literal, unions)."""
    if hint is Any or hint is inspect.Parameter.empty:
        return None
    origin = typing.get_origin(hint)
    if origin is Literal:
        allowed = typing.get_args(hint)
        return None if value in allowed else f"expected one of {list(allowed)}, got {value!r}"
    if origin in (typing.Union, types.UnionType):
        problems = [type_problem(value, a) for a in typing.get_args(hint)]
        if any(p is None for p in problems):
            return None
        return f"expected {_hint_name(hint)}, got {value!r}"
    if hint is type(None):
        return None if value is None else f"expected null, got {value!r}"
    base = origin or hint
    if base is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(base, type):
        ok = isinstance(value, base)
    else:
        return None
    return None if ok else f"expected {_hint_name(hint)}, got {type(value).__name__} {value!r}"


def _hint_name(hint: Any) -> str:
    if typing.get_origin(hint) is Literal:
        return " or ".join(repr(a) for a in typing.get_args(hint))
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_hint_name(a) for a in typing.get_args(hint))
    return "null" if hint is type(None) else getattr(hint, "__name__", str(hint))
