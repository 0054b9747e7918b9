"""Where kinject keeps what it makes once and reuses: the built-in model, compiled host kernels."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """``$KINJECT_CACHE``, else ``$XDG_CACHE_HOME/kinject``, else ``~/.cache/kinject``."""
    root = os.environ.get("KINJECT_CACHE")
    if root:
        return Path(root).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "kinject"
