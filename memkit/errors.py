"""memkit's one error family. The CLI turns each into one line and its exit code (memkit/ARCHITECTURE.md)."""
from __future__ import annotations


class MemkitError(Exception):
    """A user error: says what is wrong, the value, and the fix. CLI exit code 2."""

    exit_code = 2


class NoFeasiblePlan(MemkitError):
    """The planner found no plan that fits. CLI exit code 3."""

    exit_code = 3


def did_you_mean(value: str, choices) -> str:
    """' (did you mean X?)' for the closest catalog name, or ''."""
    import difflib

    close = difflib.get_close_matches(value.lower(), [c.lower() for c in choices], n=3, cutoff=0.5)
    if not close:
        return ""
    by_lower = {c.lower(): c for c in choices}
    return " (did you mean " + ", ".join(by_lower[c] for c in close) + "?)"
