"""Survey every decoder-only MoE family transformers registers: experts layout, router output,
mixers, cache layer kinds, whether a tiny model builds and generates.

    python examples/scan_families.py families_survey.md [family ...]
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from collections import defaultdict
from pathlib import Path

from kinject import families

logger = logging.getLogger("scan_families")


def _compact(names: list[str]) -> str:
    """``A x2, B`` for a per-layer list of class names (runs collapsed, order kept)."""
    seen: dict[str, int] = {}
    for n in names:
        seen[n] = seen.get(n, 0) + 1
    return ", ".join(f"{n} x{c}" if c > 1 else n for n, c in seen.items())


def _row(r: dict) -> list[str]:
    exp = r.get("experts") or {}
    params = "; ".join(f"{k} {v}" for k, v in (exp.get("params") or {}).items())
    experts = f"{exp.get('layout', '-')}: `{exp.get('path', '-')}` {exp.get('class', '')} ({params})" if exp else "-"
    routers = r.get("router") or []
    router = ", ".join(f"`{x['path']}` {x['class']}" for x in routers) or "-"
    shared = ", ".join(f"`{k}` {v}" for k, v in (r.get("shared") or {}).items()) or "-"
    extra = []
    if r.get("other_experts"):
        extra.append("also " + ", ".join(f"`{k}` {v}" for k, v in r["other_experts"].items()))
    if r.get("zero_experts"):
        extra.append("zero-compute " + ", ".join(f"{k}={v}" for k, v in r["zero_experts"].items()))
    errors = "; ".join(f"{k}: {v[:160]}" for k, v in r["errors"].items())
    return [
        f"`{r['model_type']}`", experts + (" — " + "; ".join(extra) if extra else ""), router,
        f"`{r.get('router_output')}`", f"`{r.get('experts_call')}`", shared,
        _compact(r.get("mixers") or []), _compact(r.get("dynamic_cache_layers") or []),
        "yes" if r["builds"] else "**no**", "yes" if r["generate_ok"] else "**no**", errors or "",
    ]


def survey(names: list[str]) -> tuple[str, list[dict]]:
    header = ["family", "experts layout (params)", "router", "router output", "experts called with",
              "shared", "attention / mixer kinds", "cache layer kinds", "builds?", "generate ok?", "errors"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    reports = []
    for name in names:
        start = time.perf_counter()
        r = families.family_report(name)
        logger.info("%-20s %.2fs builds=%s generate=%s", name, time.perf_counter() - start, r["builds"], r["generate_ok"])
        reports.append(r)
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in _row(r)) + " |")
    return "\n".join(lines), reports


def summary(reports: list[dict]) -> str:
    """Families grouped by experts layout, router output shape and cache layer kind."""
    groups: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for r in reports:
        exp = r.get("experts") or {}
        key = f"{exp.get('layout')}: " + ", ".join(f"{k}{v}" for k, v in (exp.get("params") or {}).items())
        groups["experts layout"][key].append(r["model_type"])
        groups["router output"][str(r.get("router_output"))].append(r["model_type"])
        for kind in sorted(set(r.get("dynamic_cache_layers") or [])):
            groups["cache layer kind"][kind].append(r["model_type"])
        for kind in sorted(set(r.get("mixers") or [])):
            groups["mixer"][kind].append(r["model_type"])
    out = []
    for title, table in groups.items():
        out.append(f"\n### {title}\n")
        for key, fams in sorted(table.items(), key=lambda kv: -len(kv[1])):
            out.append(f"- `{key}` ({len(fams)}): {', '.join(fams)}")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", type=Path, help="markdown file to write")
    parser.add_argument("families", nargs="*", help="model types (default: every scanned MoE family)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    warnings.filterwarnings("ignore")
    verdicts = families.classify_causal_lm_entries()
    names = args.families or families.moe_families()
    table, reports = survey(names)
    excluded = [f"- `{m}`: {v['verdict']} — {v['reason']}" for m, v in verdicts.items() if v["verdict"] != "moe"]
    ok = sum(r["builds"] for r in reports), sum(r["generate_ok"] for r in reports)
    text = "\n".join([
        "# MoE families in transformers", "",
        f"{len(names)} families scanned; {ok[0]} build, {ok[1]} generate.", "",
        "## excluded causal-LM entries with expert fields", *excluded, "", "## survey", table,
        "", "## grouped", summary(reports), "",
    ])
    args.output.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
