"""Launched runs that several e2e files read (issue 22 item 4: one launch per configuration, not one
per file that asserts on it).

Each is built once per test session, also across pytest-xdist workers (runner_util.py `once`).

The runs here are `memkit suggest --out` bundles launched unchanged (2 CPU processes, DeepSpeed),
read by tests/e2e/test_suggest_runs.py (the plan trains as written) and tests/e2e/test_runner.py
(the same launched run's loss, saved folder, and the crash / SIGTERM and resume runs beside it)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from runner_util import QA_DATA, TEXT_DATA, launch, once, write_tiny_llama


@dataclass(frozen=True)
class SuggestedRun:
    """A `memkit suggest --out` bundle (2 GPUs, global batch 8, micro <= 2) and the run of it."""
    bundle: Path          # accelerate.yaml, ds_config.json, plan.json, README.md as suggest wrote them
    model: Path           # the tiny Llama config folder the bundle was planned for
    args: tuple           # launch/finetune.py arguments of the run, less --output-dir
    max_steps: int
    whole: Path           # the run's output folder (log.jsonl, final/, probe_logits.pt)

    @property
    def config(self) -> Path:
        return self.bundle / "accelerate.yaml"


SUGGEST = ["--gpu", "a100-80gb", "--num-gpus", "2", "--global-batch-size", "8", "--seq-len", "64",
           "--max-micro-batch", "2"]
SHARED = {
    # name: (suggest pins, data, steps, extra run flags)
    # fp32, so the saved folder gives the run's logits exactly and a resume matches to 1e-6 (test_runner.py)
    "zero2": (["--zero", "2", "--no-offload", "--precision", "fp32"], TEXT_DATA, 6,
              ["--lr", "3e-3", "--warmup-steps", "1", "--save-every", "2"]),
    # suggest's own choice of precision here is bf16 (the plan test_runner.py's SIGTERM run wants)
    "zero3-offload": (["--zero", "3", "--offload-optimizer", "cpu", "--offload-params", "cpu"], QA_DATA, 8,
                      ["--lr", "3e-3"]),
}


def suggested_run(tmp_path_factory, name: str) -> SuggestedRun:
    pins, data, steps, extra = SHARED[name]

    def paths(folder: Path) -> SuggestedRun:
        bundle, model = folder / "bundle", folder / "tiny"
        args = ("--plan", str(bundle / "plan.json"), "--model", str(model), "--data", str(data),
                "--max-steps", str(steps), *extra)
        return SuggestedRun(bundle=bundle, model=model, args=args, max_steps=steps, whole=folder / "whole")

    def make(folder: Path) -> None:
        from memkit.cli.main import main

        run = paths(folder)
        write_tiny_llama(run.model)
        assert main(["suggest", "--model", str(run.model), *SUGGEST, "--out", str(run.bundle), *pins]) == 0
        proc = launch(run.config, [*run.args, "--output-dir", str(run.whole)])
        assert proc.returncode == 0, proc.stdout[-4000:]

    return paths(once(tmp_path_factory, f"suggested-{name}", make))


@pytest.fixture(scope="session")
def suggested_zero2(tmp_path_factory) -> SuggestedRun:
    return suggested_run(tmp_path_factory, "zero2")


@pytest.fixture(scope="session")
def suggested_zero3_offload(tmp_path_factory) -> SuggestedRun:
    return suggested_run(tmp_path_factory, "zero3-offload")
