"""How kinject prints sizes, shapes and durations in messages and summaries.

One small module every layer may use (it imports nothing of kinject), so that an error
raised by the store, an operator's report and a run summary write a byte count the same way.
"""

from __future__ import annotations

from typing import Iterable


def format_bytes(n: float | None) -> str:
    """``n`` bytes in the largest binary unit that keeps it at least 1 (``None``: "unlimited",
    what an absent budget means)."""
    if n is None:
        return "unlimited"
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{n:.0f} B"


def format_seconds(seconds: float) -> str:
    """A short duration in the unit that reads best: ``1.234 s``, ``12.345 ms``, ``3.21 µs``."""
    s = abs(seconds)
    if s == 0 or s >= 1:
        return f"{seconds:.3f} s"
    if s >= 1e-3:
        return f"{seconds * 1e3:.3f} ms"
    return f"{seconds * 1e6:.2f} µs"


def format_shape(shape: Iterable[int]) -> str:
    """A tensor shape as ``[d0, d1, ...]`` (torch.Size prints ``torch.Size([...])``)."""
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def format_duration(seconds: float) -> str:
    """Whole seconds as ``h:mm:ss`` (a long run's estimate)."""
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}"
