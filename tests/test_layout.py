"""The package layout is the architecture: imports run one way and never in a circle.

Every ``import`` in ``kinject/`` and ``operators/`` is read from the source (module level and
inside functions alike, so a lazy import cannot hide an upward dependency or a circle; ``if
TYPE_CHECKING:`` blocks count too: a type-only circle is still a circle, and a lower layer names a
higher one's objects through an interface it defines, as the runtime names operators by
``kinject.runtime.RuntimeOperator``). Importing ``a.b.c`` also runs ``a`` and ``a.b``, so those
count as imported too. The layers are those of docs/architecture.md, "Layers".
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kinject", "operators")

#: Layers, lowest first: a module may import its own layer or lower ones, never a higher one.
LAYERS: list[tuple[str, ...]] = [
    ("kinject", "kinject.errors", "kinject.formatting"),  # the package init imports only errors eagerly
    ("kinject.trace", "kinject.testing", "kinject.families", "kinject.modal_families", "kinject.fixtures"),
    ("kinject.engine", "kinject.stacks"),
    ("kinject.kv", "kinject.io"),                        # both built on the engine (KV arena, disk sources)
    ("kinject.runtime",),
    ("operators",),
    ("kinject.rules", "kinject.inject", "kinject.pretrained"),
    ("kinject.plan",),
    ("kinject.bench",),
    ("kinject.app", "kinject.__main__"),                # the command line runs the benches, never the reverse
]


def modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def imported_names(name: str, path: Path, type_only: bool = False) -> set[str]:
    """Dotted names ``name`` imports (``from x import y``: both ``x`` and ``x.y``); with
    ``type_only``, those of ``if TYPE_CHECKING:`` blocks too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child) and not type_only:
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (child.level - 1)]
                    mod = ".".join(base + ([child.module] if child.module else []))
                else:
                    mod = child.module
                found.add(mod)
                found.update(f"{mod}.{a.name}" for a in child.names)
            visit(child)

    visit(tree)
    return found


def import_graph(type_only: bool = False) -> dict[str, set[str]]:
    """Module -> the package modules it imports (``type_only``: annotation-only imports too)."""
    mods = modules()
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        edges = set()
        for target in imported_names(name, path, type_only):
            parts = target.split(".")
            for i in range(1, len(parts) + 1):          # a.b.c runs a and a.b first ...
                prefix = ".".join(parts[:i])
                if prefix in mods and prefix != name and not name.startswith(prefix + "."):
                    edges.add(prefix)                   # ... unless they are the importer's own packages
        graph[name] = edges
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def layer_of(name: str) -> int:
    best, rank = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > best:
                best, rank = len(p), i
    assert rank is not None, f"module {name} is in no layer of tests/test_layout.py: add it where it belongs"
    return rank


def test_cycle_finder_finds_a_planted_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycle_among_the_package_modules():
    """Type-only imports included: ``if TYPE_CHECKING: from a import X`` in ``b`` while ``a`` imports
    ``b`` is a circle of meaning even though Python never runs it."""
    graph = import_graph(type_only=True)
    assert len(graph) > 30
    found = cycles(graph)
    assert found == [], f"import circles (type-only imports count): {found}"


def test_a_type_only_import_closes_a_circle(tmp_path):
    """The reader sees ``if TYPE_CHECKING:`` imports when asked to, and only then."""
    path = tmp_path / "mod.py"
    path.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from kinject.engine.store import Unit\n")
    assert "kinject.engine.store" in imported_names("kinject.engine.slabs", path, type_only=True)
    assert "kinject.engine.store" not in imported_names("kinject.engine.slabs", path)


def test_imports_run_one_way_down_the_layers():
    """Type-only imports too: a lower layer names a higher one's objects by an interface of its own."""
    upward = [f"{src} (layer {layer_of(src)}) imports {dst} (layer {layer_of(dst)})"
              for src, dsts in import_graph(type_only=True).items() for dst in sorted(dsts)
              if layer_of(dst) > layer_of(src)]
    assert upward == []


def test_engine_reads_its_own_disk_sources():
    """The store reads disk units through the engine's own value types; the checkpoint index (io)
    builds them, never the other way round."""
    graph = import_graph(type_only=True)
    assert not {d for m, ds in graph.items() if m.startswith("kinject.engine") for d in ds if d.startswith("kinject.io")}


def test_runtime_imports_no_operator_inject_or_loading():
    graph = import_graph(type_only=True)
    bad = {d for d in graph["kinject.runtime"]
           if d.startswith("operators") or d in ("kinject.inject", "kinject.io.loading", "kinject.pretrained")}
    assert bad == set()


def test_benchmarks_and_apps_live_outside_the_engine():
    mods = modules()
    for name in mods:
        leaf = name.rsplit(".", 1)[-1]
        if leaf.startswith("bench") or leaf in ("cli", "run", "demo"):
            assert name.startswith(("kinject.bench", "kinject.app")), name
