"""--report-to (#24): each logger's package is checked before any process starts (one line, exit 2,
naming the pip package), and a run writes its metrics where the logger keeps them: a W&B offline run /
an MLflow file store when that package is installed. TensorBoard, the default, is read back from the
default-logger run of tests/e2e/test_finetune_features.py (its event file equals log.jsonl; the start
lines name it), which this file's own run used to repeat."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import TINY_LLAMA, env  # noqa: E402

LOGGERS = ("wandb", "mlflow")


def _finetune(tmp_path: Path, report_to: str) -> subprocess.CompletedProcess:
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    return subprocess.run([sys.executable, "-m", "memkit.finetune", "--model", str(tmp_path / "tiny.json"),
                           "--init", "random", "--data", "synthetic:8", "--seq-len", "32", "--max-steps", "2",
                           "--output-dir", str(tmp_path / "out"), "--no-progress", "--report-to", report_to],
                          cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=600)


@pytest.mark.parametrize("name", [n for n in LOGGERS if importlib.util.find_spec(n) is None])
def test_a_missing_logger_package_is_one_line_before_the_run(name, tmp_path):
    (tmp_path / "tiny.json").write_text(json.dumps(TINY_LLAMA))
    proc = subprocess.run([sys.executable, "-m", "memkit.cli.main", "train", "--model", str(tmp_path / "tiny.json"),
                           "--init", "random", "--data", "synthetic:8", "--seq-len", "32", "--output-dir",
                           str(tmp_path / "out"), "--report-to", name], cwd=tmp_path, env=env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stderr.strip() == (
        f"memkit: error: --report-to {name} needs the {name} package, which is not installed; pip install {name}, "
        "or pass --report-to none")
    assert not (tmp_path / "out" / "log.jsonl").exists()


@pytest.mark.slow  # a real run (the inner loop keeps the one-line checks above)
@pytest.mark.parametrize("name", [n for n in LOGGERS if importlib.util.find_spec(n) is not None] or
                         [pytest.param("wandb", marks=pytest.mark.skip(reason="neither wandb nor mlflow installed"))])
def test_installed_logger_gets_the_step_metrics(name, tmp_path):
    run = _finetune(tmp_path, name)
    assert run.returncode == 0, run.stderr[-3000:]
    if name == "wandb":  # offline by default: a run folder under output-dir/wandb, nothing sent
        assert list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    else:
        import mlflow

        mlflow.set_tracking_uri((tmp_path / "out" / "mlruns").resolve().as_uri())
        runs = mlflow.search_runs(search_all_experiments=True)
        assert len(runs) == 1 and runs["metrics.train/loss"].notna().all()
