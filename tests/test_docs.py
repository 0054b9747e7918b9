"""The pages a user reads stay a results page and stay about kinject.

BENCHMARKS.md opens with the headline table (one row per benchmark, each with its command,
machine, date and commit), has one section per benchmark and stays short enough to read; the
user docs (README, BENCHMARKS, docs/, examples/, rules/) name no local scratch paths and say
nothing about how the work on kinject was organised. Every command the headline table gives
must still parse with kinject's own command line, so a renamed flag cannot leave a stale number."""

import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "BENCHMARKS.md"
MAX_LINES = 400
HEADLINE_COLUMNS = ["benchmark", "command", "contenders", "result", "bound", "machine", "date", "commit"]
SECTIONS = ["`kinject demo`", "`kinject bench cpu`", "`kinject bench overhead`", "`kinject bench kv`",
            "`kinject bench plan`", "`kinject bench offload`", "`kinject bench gpu`", "Ablations in `examples/`"]

# Absolute paths of one machine (a leading '~/' in a documented default is not one).
LOCAL_PATH = re.compile(r"(?<![\w.~])/(?:tmp|work|root|home|scratch)/")
# Words about how the work was organised, not about kinject ("helper" and "branch" have technical
# meanings in code and are left to review).
ORGANISATION = re.compile(r"\b(?:sessions?|agents?|worktrees?|the lead|lent|this task|our machines|"
                          r"team'?s?|issues? #?\d+)\b", re.I)


def user_docs() -> list[Path]:
    """README, BENCHMARKS, everything under docs/ and examples/, and the shipped rule files."""
    files = [ROOT / "README.md", BENCHMARKS]
    for folder, pattern in (("docs", "*.md"), ("examples", "*.py"), ("examples", "*.md"), ("rules", "*.yaml")):
        files += sorted((ROOT / folder).rglob(pattern))
    return files


def offences(text: str) -> list[str]:
    """Each local path or organisation word in text, as 'line N: match'."""
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        found += [f"line {n}: {m.group(0)!r}" for pattern in (LOCAL_PATH, ORGANISATION) for m in pattern.finditer(line)]
    return found


def table_rows(lines: list[str]) -> list[list[str]]:
    """The cells of a Markdown table's body rows (header and separator dropped)."""
    rows = [[c.strip() for c in ln.strip().strip("|").split("|")] for ln in lines]
    return rows[2:]


def headline() -> tuple[list[str], list[list[str]]]:
    """The header cells and body rows of the table BENCHMARKS.md starts with (after its title)."""
    lines = BENCHMARKS.read_text().splitlines()
    assert lines[0].startswith("# "), "BENCHMARKS.md starts with its title"
    body = [ln for ln in lines[1:] if ln.strip()]
    table = []
    for ln in body:
        if not ln.startswith("|"):
            break
        table.append(ln)
    assert table, "the first thing after BENCHMARKS.md's title is the headline table"
    header = [c.strip().lower() for c in table[0].strip().strip("|").split("|")]
    return header, table_rows(table)


def test_benchmarks_is_short_and_starts_with_the_headline_table():
    assert len(BENCHMARKS.read_text().splitlines()) <= MAX_LINES
    header, rows = headline()
    for want in HEADLINE_COLUMNS:
        assert any(want in cell for cell in header), f"headline table has no '{want}' column: {header}"
    assert len(rows) >= len(SECTIONS) - 1
    col = {name: next(i for i, c in enumerate(header) if name in c) for name in HEADLINE_COLUMNS}
    for row in rows:
        assert len(row) == len(header), f"headline row has {len(row)} cells, header {len(header)}: {row}"
        assert re.search(r"`[^`]+`", row[col["command"]]), f"headline row without a command: {row}"
        if "not yet measured" in row[col["result"]]:
            continue                            # a benchmark with no number yet says so and how to get it
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row[col["date"]]), f"headline row without a date: {row}"
        assert re.fullmatch(r"[0-9a-f]{7,40}(, [0-9a-f]{7,40})*", row[col["commit"]]), f"no commit: {row}"


def test_every_benchmark_has_its_section():
    headings = [ln for ln in BENCHMARKS.read_text().splitlines() if ln.startswith("## ")]
    for name in SECTIONS:
        assert sum(name in h for h in headings) == 1, f"BENCHMARKS.md needs one '## {name}' section: {headings}"


def test_headline_commands_parse_with_kinjects_command_line():
    from kinject.app.cli import build_parser

    header, rows = headline()
    col = next(i for i, c in enumerate(header) if "command" in c)
    parser = build_parser()
    checked = 0
    for row in rows:
        command = re.search(r"`([^`]+)`", row[col]).group(1)
        argv = shlex.split(command)
        if argv[0] == "kinject":
            try:
                parser.parse_args(argv[1:])
            except SystemExit:
                pytest.fail(f"BENCHMARKS.md headline command does not parse: {command}")
            checked += 1
        else:
            paths = [a for a in argv if a.endswith(".py")]
            assert paths and all((ROOT / p).exists() for p in paths), f"headline command names no file: {command}"
    assert checked >= 5


def test_scripts_named_in_benchmarks_exist():
    text = BENCHMARKS.read_text()
    for path in set(re.findall(r"\b((?:examples|tests|scripts)/[\w/]+\.(?:py|sh))", text)):
        assert (ROOT / path).exists(), f"BENCHMARKS.md names {path}, which does not exist"


@pytest.mark.parametrize("path", user_docs(), ids=lambda p: str(p.relative_to(ROOT)))
def test_user_docs_name_no_local_path_nor_how_the_work_was_organised(path):
    assert offences(path.read_text()) == [], f"{path.relative_to(ROOT)}"


@pytest.mark.parametrize("text", ["see /tmp/kinject-bench/x", "(`/work/scratch/abl.py`)", "in /home/me/m",
                                  "This session's runs", "no GPU was lent to this task", "issue 18 item 5",
                                  "the lead merges", "on our machines", "in a worktree of ea4f30e",
                                  "the agents' runs"])
def test_the_scan_catches_what_it_is_for(text):
    assert offences(text)


@pytest.mark.parametrize("text", ["offload_dir: ~/.cache/kinject/offload", "KV of every sequence in the host tier",
                                  "the paper's Table 3", "`kinject bench offload --workdir kinject-bench`",
                                  "https://docs.ray.io/en/latest/data/data.html", "equivalent",
                                  "the per-expert `_linear` helper"])
def test_the_scan_leaves_kinjects_own_words(text):
    assert offences(text) == []


ARCHITECTURE = ROOT / "docs" / "architecture.md"
CITATION = re.compile(r'docs/architecture\.md,\s+"([^"]+)"')


def test_code_cites_the_architecture_page_by_sections_that_exist():
    """Docstrings and comments cite docs/architecture.md by section name, never a document outside
    the repository; every cited section is a heading of that page."""
    headings = {ln.lstrip("#").strip() for ln in ARCHITECTURE.read_text().splitlines() if ln.startswith("#")}
    cited, outside = set(), []
    for folder in ("kinject", "operators", "tests", "examples", "rules", "scripts"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".yaml", ".sh", ".md") or not path.is_file():
                continue
            text = path.read_text(encoding="utf-8", errors="replace")
            cited |= set(CITATION.findall(" ".join(text.split())))
            if re.search(r"\bDESIGN(?:\.md)?\s+§", text):
                outside.append(str(path.relative_to(ROOT)))
    assert outside == [], f"cite docs/architecture.md instead: {outside}"
    assert len(cited) >= 5 and cited <= headings, f"cited sections missing from docs/architecture.md: {cited - headings}"


def test_architecture_page_names_every_module():
    """Each module of kinject/ and operators/ has its row in "Where each concept lives": its path,
    or its file name beside a sibling's path, or its folder's row (a folder that is one concept:
    ``kinject/engine/formats/``)."""
    text = ARCHITECTURE.read_text()
    section = text[text.index("## Where each concept lives"):]
    section = section[:section.index("\n## ", 1)]
    rows = [ln for ln in section.splitlines() if ln.startswith("| `")]
    missing = []
    for folder in ("kinject", "operators"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            rel = path.relative_to(ROOT)
            if "fixtures" in rel.parts or rel.name == "__main__.py" or rel == Path("kinject/__init__.py"):
                continue
            first = [r.split("|")[1] for r in rows]
            named = any(f"`{rel}`" in c or (f"`{rel.name}`" in c and f"`{rel.parent}/" in c) or f"`{rel.parent}/`" in c
                        for c in first)
            if not named and rel.name != "__init__.py":
                missing.append(str(rel))
    assert missing == [], f"docs/architecture.md, 'Where each concept lives', names no row for: {missing}"
