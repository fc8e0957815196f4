"""Where the runner's metrics go besides log.jsonl (--report-to): TensorBoard, Weights & Biases or
MLflow, behind the one interface the loop writes to (TensorBoard's SummaryWriter: add_scalar(tag,
value, global_step), close()).

wandb: `wandb.init(project=..., dir=..., config=...)` and `run.log({tag: value}, step=step)`
(wandb/sdk/wandb_run.py, Run.log); offline unless WANDB_MODE says otherwise, so nothing is sent
without the user asking (WANDB_MODE=online). mlflow: `mlflow.start_run()` and
`mlflow.log_metric(key, value, step=step)` (mlflow/tracking/fluent.py), to MLFLOW_TRACKING_URI
or, by default, output-dir/mlruns. Metric names keep TensorBoard's tags except that MLflow
refuses none of them ('/' is allowed in MLflow keys).
"""
from __future__ import annotations

import os
from pathlib import Path

from memkit.errors import MemkitError
from memkit.train.config import REPORT_TO

PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}


def check_report_to(report_to: str) -> None:
    """One line, before any process starts, when the logger's package is missing."""
    import importlib.util

    if report_to not in REPORT_TO:
        raise MemkitError(f"--report-to {report_to!r} is not one of {', '.join(REPORT_TO)}")
    package = PACKAGES.get(report_to)
    if package and importlib.util.find_spec(package) is None:
        raise MemkitError(f"--report-to {report_to} needs the {package} package, which is not installed; "
                          f"pip install {package}, or pass --report-to none")


def open_board(report_to: str, out_dir: Path, *, config: dict | None = None):
    """The logger for --report-to on the main process; None for 'none'."""
    if report_to == "tensorboard":
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(out_dir / "tensorboard"))
    if report_to == "wandb":
        return _Wandb(out_dir, config or {})
    if report_to == "mlflow":
        return _Mlflow(out_dir, config or {})
    return None


class _Wandb:
    def __init__(self, out_dir: Path, config: dict) -> None:
        import wandb

        os.environ.setdefault("WANDB_MODE", "offline")
        self.run = wandb.init(project=os.environ.get("WANDB_PROJECT", "memkit"), dir=str(out_dir),
                              config=config, reinit=True)

    def add_scalar(self, tag: str, value, global_step: int) -> None:
        self.run.log({tag: value}, step=global_step)

    def close(self) -> None:
        self.run.finish()


class _Mlflow:
    def __init__(self, out_dir: Path, config: dict) -> None:
        import mlflow

        if not os.environ.get("MLFLOW_TRACKING_URI"):
            mlflow.set_tracking_uri((Path(out_dir) / "mlruns").resolve().as_uri())
        self.mlflow = mlflow
        self.run = mlflow.start_run()
        flat = {k: v for k, v in config.items() if isinstance(v, (int, float, str, bool))}
        if flat:
            mlflow.log_params(flat)

    def add_scalar(self, tag: str, value, global_step: int) -> None:
        self.mlflow.log_metric(tag, float(value), step=global_step)

    def close(self) -> None:
        self.mlflow.end_run()
