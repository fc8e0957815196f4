"""A real torchrun launch of stand-in ranks that write ready.RANK (their pid) once their signal
handlers are installed, shared by the signal-relay tests (test_supervise.py, test_verify_signals.py)."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path


def wait_until_ready(folder: Path, driver: subprocess.Popen, ranks: tuple[int, ...] = (0, 1),
                     timeout_s: float = 120) -> list[int]:
    """Block until every rank wrote folder/ready.RANK (the driver still running); their pids."""
    deadline = time.monotonic() + timeout_s
    while not all((folder / f"ready.{r}").exists() for r in ranks):
        assert time.monotonic() < deadline and driver.poll() is None, "ranks did not start"
        time.sleep(0.1)
    time.sleep(0.3)  # both ready files written; handlers installed before them
    return [int((folder / f"ready.{r}").read_text()) for r in ranks]
