"""One launched ZeRO-2 run that checkpoints after every step, shared by the checkpoint e2e files
(test_corrupt_checkpoint.py, test_checkpoint_trust_e2e.py): each works on a copy of its
checkpoints and compares its resumed runs' final parameters with this run's.

A session fixture: under pytest-xdist the first worker that asks launches it and the others
read its result (runner_util.py `once`)."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from runner_util import TEXT_DATA, launch, once, write_bundle, write_tiny_llama

from memkit.plan.plan import TrainingPlan

STEPS = 7
"""Optimizer steps; the runner checkpoints after steps 1-6 (the last step writes final/ instead)."""
SMALL_BUCKETS = dict(reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000,
                     stage3_prefetch_bucket_size=1_000_000, stage3_param_persistence_threshold=1_000)
"""Small DeepSpeed buckets (the tiny model's ~100k parameters in a few buckets, not one)."""


def step_name(n: int) -> str:
    return f"step-{n:08d}"


def zero_plan(zero: int) -> TrainingPlan:
    """2 CPU processes, fp32, 2 sequences of 32 tokens per rank per step."""
    return TrainingPlan(precision="fp32", zero_stage=zero, micro_batch_size=2, grad_accum=1, seq_len=32, dp=2,
                        **SMALL_BUCKETS)


def common_args(plan_path: Path, tiny: Path, steps: int = STEPS) -> list[str]:
    return ["--plan", str(plan_path), "--model", str(tiny), "--data", str(TEXT_DATA), "--max-steps", str(steps),
            "--lr", "3e-3", "--save-every", "1", "--keep-checkpoints", str(steps)]


@dataclass(frozen=True)
class Reference:
    config: Path  # accelerate.yaml
    plan_path: Path
    tiny: Path  # the model folder (config.json only: random init)
    whole: Path  # the run's output dir: checkpoints/step-1..STEPS-1, final/

    def args(self) -> list[str]:
        return common_args(self.plan_path, self.tiny)


def reference_run(tmp_path_factory, zero: int) -> Reference:
    """The uninterrupted run, launched once per session (runner_util.py `once`)."""
    def make(root: Path) -> None:
        write_tiny_llama(root / "tiny")
        config, plan_path = write_bundle(root / "bundle", zero_plan(zero))
        result = launch(config, [*common_args(plan_path, root / "tiny"), "--output-dir", str(root / "whole")])
        assert result.returncode == 0, result.stdout[-4000:]

    root = once(tmp_path_factory, f"zero{zero}-reference", make)
    ref = Reference(root / "bundle" / "accelerate.yaml", root / "bundle" / "plan.json", root / "tiny", root / "whole")
    ckpts = ref.whole / "checkpoints"
    assert [p.name for p in sorted(ckpts.glob("step-*"))] == [step_name(n) for n in range(1, STEPS)]
    assert all((p / "manifest.json").is_file() for p in ckpts.glob("step-*"))
    return ref


@pytest.fixture(scope="session")
def zero2_reference(tmp_path_factory) -> Reference:
    return reference_run(tmp_path_factory, zero=2)
