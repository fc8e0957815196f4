"""memkit's one error family. The CLI turns each into one line and its exit code (memkit/ARCHITECTURE.md);
exit_now ends a process with its code."""
from __future__ import annotations

import os
import sys
from typing import NoReturn


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


def exit_now(code: int) -> NoReturn:
    """End this process with `code` without the interpreter's teardown (finalizing every module
    of torch, transformers, DeepSpeed and gloo: measured 0.9 CPU s in a runner that stopped on bad
    input after its imports, ~1.2 CPU s per rank of a finished 2-rank ZeRO-2 run). For a process's
    last line only, where everything it keeps is written and closed: os._exit runs no atexit
    handler and flushes no stdio buffer (Python docs, os._exit), so the logging handlers
    (logging.shutdown, which atexit would run) and stdout/stderr are flushed here first."""
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
