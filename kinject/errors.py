"""One exception family for everything kinject refuses to do.

Messages quote the user's input back (file, rule index, key, tensor name) so the
fix is obvious without a traceback.
"""

from __future__ import annotations


class KinjectError(Exception):
    """Base class of every error kinject raises on purpose."""


class RuleError(KinjectError):
    """A rule file (or an override) is malformed; says file, rule index, key and line."""

    def __init__(self, message: str, *, file: str | None = None, rule: int | None = None,
                 key: str | None = None, line: int | None = None):
        self.file, self.rule, self.key, self.line = file, rule, key, line
        where = []
        if file:
            where.append(f"{file}" + (f":{line}" if line else ""))
        if rule is not None:
            where.append(f"rule {rule}")
        if key:
            where.append(f"key '{key}'")
        super().__init__((", ".join(where) + ": " if where else "") + message)


class InjectionError(KinjectError):
    """Matching or building operators failed; the model was left untouched."""


class LoadError(KinjectError):
    """A checkpoint tensor is missing, truncated or mis-shaped."""


class BudgetError(KinjectError):
    """A placement or plan does not fit the configured memory budget."""


class TransferError(KinjectError):
    """A background transfer (disk read, host->device copy) failed."""


class PlanError(KinjectError):
    """The planner found no feasible configuration."""
