"""Plans from `memkit suggest` start and train under `accelerate launch`, as written.

A tiny Llama, two CPU processes (gloo), ZeRO-2 and ZeRO-3 with and without CPU offload. The files
are the ones `memkit suggest --out` writes, launched unchanged with launch/finetune.py; the
runner's log, written from inside the ranks, says how many processes DeepSpeed ran with, under
which distributed type, and with which ZeRO config.

The ZeRO-2 (pinned to fp32) and ZeRO-3 + offload bundles and their runs are made once per session
by tests/e2e/shared_runner_runs.py and read here and by test_runner.py (crash / SIGTERM and
resume beside the same run); the other two are launched here.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memkit.cli.main import main

from runner_util import events, launch, read_log, write_tiny_llama
from shared_runner_runs import SHARED, SUGGEST, suggested_run


pytestmark = pytest.mark.e2e

PINS = {
    "zero2": SHARED["zero2"][0],
    "zero2-offload": ["--zero", "2", "--offload-optimizer", "cpu"],
    "zero3": ["--zero", "3", "--no-offload"],
    "zero3-offload": SHARED["zero3-offload"][0],
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.mark.parametrize("name", list(PINS))
def test_suggested_plan_trains_under_accelerate_launch(name, tiny, tmp_path, tmp_path_factory, capsys):
    if name in SHARED:  # suggest and its run made once per session, also read by test_runner.py
        shared = suggested_run(tmp_path_factory, name)
        out_dir, run_dir, steps = shared.bundle, shared.whole, shared.max_steps
        capsys.readouterr()
    else:
        out_dir, run_dir, steps = tmp_path / name, tmp_path / "run", 2
        code = main(["suggest", "--model", str(tiny), *SUGGEST, "--out", str(out_dir), *PINS[name]])
        capsys.readouterr()
        assert code == 0
    plan = json.loads((out_dir / "plan.json").read_text())["plan"]
    assert (plan["micro_batch_size"], plan["grad_accum"], plan["dp"]) == (2, 2, 2)

    if name not in SHARED:
        proc = launch(out_dir / "accelerate.yaml",
                      ["--plan", str(out_dir / "plan.json"), "--model", str(tiny), "--data", "synthetic",
                       "--output-dir", str(run_dir), "--max-steps", str(steps), "--no-save-final"])
        assert proc.returncode == 0, proc.stdout[-4000:]
    log = read_log(run_dir)
    start, end = events(log, "start")[0], events(log, "end")[0]
    assert start["plan"] == plan  # the bundle's plan, as written
    assert start["world_size"] == 2 and start["distributed_type"] == "DEEPSPEED"
    zero = start["deepspeed_config"]["zero_optimization"]
    assert zero["stage"] == plan["zero_stage"]
    assert (zero.get("offload_optimizer") or {}).get("device", "none") == plan["offload_optimizer"]
    assert (zero.get("offload_param") or {}).get("device", "none") == plan["offload_params"]
    assert start["deepspeed_config"]["train_batch_size"] == 8
    assert end["status"] == "ok" and end["steps_done"] == steps and end["world_size"] == 2
    assert math.isfinite(end["last_loss"])
