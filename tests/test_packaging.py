"""pyproject.toml ships every package of the source tree: an editable install (what CI and the README
use) imports a package the list forgets, a built wheel would not have it."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.skipif(sys.version_info < (3, 11), reason="tomllib is Python 3.11+")
def test_every_package_is_listed():
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(init.parent.relative_to(ROOT).parts)
             for top in ("kinject", "operators") for init in (ROOT / top).rglob("__init__.py")}
    assert found - listed == set(), f"packages missing from pyproject.toml [tool.setuptools] packages: {sorted(found - listed)}"
    assert listed - found == set(), f"pyproject.toml lists packages that do not exist: {sorted(listed - found)}"
