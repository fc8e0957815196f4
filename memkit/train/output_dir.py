"""What an --output-dir already holds, and the refusal to train over an earlier run.

A folder holds a run when it has the runner's log.jsonl or checkpoints/. Training into it
again would silently mix two runs (log.jsonl is appended to, final/ replaced), so the runner
refuses unless --resume (continue that run) or --overwrite (delete what the runner wrote
there, nothing else, and start afresh).
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from memkit.errors import MemkitError

RUN_OUTPUTS = ("log.jsonl", "checkpoints", "final", "adapter", "tensorboard", "probe_logits.pt",
               "report.json")
"""What the runner writes under --output-dir (plus oom.rank*.json); --overwrite removes these only."""


def run_status(folder: Path) -> str | None:
    """'finished' (log.jsonl ends with a finished run, or final/ exists), 'unfinished' (a log or
    checkpoints without a finished end), or None (no run here)."""
    folder = Path(folder)
    log = folder / "log.jsonl"
    if (folder / "final" / "config.json").is_file():
        return "finished"
    if log.is_file():
        for line in reversed(log.read_text(errors="replace").splitlines()):
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            if record.get("event") == "end":
                return "finished" if record.get("status") == "ok" else "unfinished"
        return "unfinished"
    return "unfinished" if (folder / "checkpoints").is_dir() else None


def check_output_dir(folder: Path, *, resume: str | None, overwrite: bool) -> None:
    """MemkitError (one line, exit 2) when `folder` holds a run and neither --resume nor --overwrite says
    what to do with it."""
    if overwrite and resume is not None:
        raise MemkitError("--overwrite and --resume both given; --resume continues the run in --output-dir, "
                          "--overwrite deletes it: pick one")
    status = run_status(folder)
    if status is None or overwrite or resume is not None:
        return
    if status == "finished":
        raise MemkitError(f"--output-dir {folder} already holds a finished run; pass --overwrite to replace "
                          "it, or choose another --output-dir")
    raise MemkitError(f"--output-dir {folder} already holds an unfinished run; pass --resume to continue it, "
                      "--overwrite to start afresh, or choose another --output-dir")


def clear_run_outputs(folder: Path) -> list[Path]:
    """--overwrite: remove what the runner wrote in `folder` (RUN_OUTPUTS, oom.rank*.json)."""
    removed = []
    for path in [Path(folder) / name for name in RUN_OUTPUTS] + sorted(Path(folder).glob("oom.rank*.json")):
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(path)
    return removed
