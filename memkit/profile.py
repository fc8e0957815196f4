"""The local calibration profile: measured vs predicted memory of every run on this machine.

`memkit verify` (and the CPU measurement harness) append one run per call, keyed by the device
(the catalog GPU name, or "cpu") and the software stack (spec/stack.py Stack.key()). A later
estimate for the same device and stack takes its upper-bound margin from these runs instead of the
published calibration set (estimate/bounds.py) and says "calibrated on N runs on this machine".

File: $MEMKIT_PROFILE, else $XDG_CACHE_HOME/memkit/profile.json, else ~/.cache/memkit/profile.json.
This module does the file I/O; the estimator only receives the margins.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

from memkit.errors import MemkitError
from memkit.estimate.bounds import QUANTILE, plan_kind, quantile
from memkit.plan.plan import TrainingPlan
from memkit.spec.stack import Stack

ENV = "MEMKIT_PROFILE"
FORMAT_VERSION = 1
FIGURES = ("allocated_peak_bytes", "reserved_peak_bytes", "nvidia_smi_peak_bytes")


def profile_path() -> Path:
    if os.environ.get(ENV):
        return Path(os.environ[ENV])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "memkit" / "profile.json"


def machine_key(device: str, stack: Stack) -> str:
    return f"{device}|{stack.key()}"


def load(path: Path | None = None) -> dict:
    path = path or profile_path()
    if not path.is_file():
        return {"format_version": FORMAT_VERSION, "machines": {}}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise MemkitError(f"calibration profile {path} is not readable JSON ({exc}); "
                          f"fix it or run `memkit calibrate --reset`") from None
    from memkit.plan.plan_schema import check_profile

    check_profile(doc, where=f"calibration profile {path}", version=FORMAT_VERSION)
    return doc


def _write(doc: dict, path: Path) -> None:
    """Whole or not at all; a failure is one line and leaves no temporary file (fileio.write_text_atomic)."""
    from memkit.fileio import write_text_atomic

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MemkitError(f"could not write calibration profile {path}: cannot create {path.parent} "
                          f"({exc.strerror}); pick a writable path") from None
    write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=True), what="calibration profile")


def record_run(*, device: str, stack: Stack, plan: TrainingPlan, predicted: dict, measured: dict,
               path: Path | None = None) -> int:
    """Append one run: `predicted` = the estimate's dict (to_dict()), `measured` = figures by the
    estimate's names (any of FIGURES, plus optional "components"). Returns the machine's run count."""
    path = path or profile_path()
    doc = load(path)
    entry = doc["machines"].setdefault(machine_key(device, stack), {"device": device,
                                                                     "stack": stack.to_dict(), "runs": []})
    entry["runs"].append({
        "plan_kind": plan_kind(plan), "plan": plan.to_dict(),
        "predicted": {k: predicted.get(k) for k in FIGURES if predicted.get(k)},
        "predicted_components": dict(predicted.get("components") or {}),
        "measured": {k: v for k, v in measured.items() if k in FIGURES and v},
        "measured_components": dict(measured.get("components") or {}),
    })
    _write(doc, path)
    return len(entry["runs"])


def _residual(run: dict) -> float | None:
    """The run's worst relative under-prediction over the figures it measured."""
    pairs = [(run["measured"][k], run["predicted"][k]) for k in FIGURES
             if run["measured"].get(k) and run["predicted"].get(k)]
    return max((m / p - 1 for m, p in pairs), default=None)


def margins(device: str, stack: Stack, path: Path | None = None) -> tuple[dict[str, float], int]:
    """(margin table like residuals_table.RESIDUAL_P90, number of runs) for this device and stack;
    ({}, 0) when the profile holds none."""
    entry = load(path)["machines"].get(machine_key(device, stack))
    runs = [(r["plan_kind"], _residual(r)) for r in (entry or {}).get("runs", [])]
    runs = [(k, r) for k, r in runs if r is not None]
    if not runs:
        return {}, 0
    table = {"all": quantile([r for _, r in runs], QUANTILE)}
    for kind in {k for k, _ in runs}:
        table[kind] = quantile([r for k, r in runs if k == kind], QUANTILE)
    return table, len(runs)


def reset(path: Path | None = None) -> bool:
    path = path or profile_path()
    if path.is_file():
        path.unlink()
        return True
    return False


def export(dest: Path, path: Path | None = None) -> int:
    """Copy the profile to `dest`; returns the number of runs written."""
    doc = load(path)
    _write(doc, Path(dest))
    return sum(len(m.get("runs", [])) for m in doc["machines"].values())
