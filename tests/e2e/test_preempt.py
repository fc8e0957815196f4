"""Preemption end to end (#28): a stop signal sent to the launcher and to every rank at once, as
Slurm's scancel / preemption and a Kubernetes pod kill send it, writes one checkpoint every time,
and the resumed run ends with the parameters of the uninterrupted one.

Two CPU processes under the real DeepSpeed (ZeRO-2 fp32) on the tiny Llama of runner_util. Each
trial: start the run (`accelerate launch` of launch/finetune.py, or `memkit train`), wait for
rank 0's log to reach step k, snapshot the process tree from /proc and signal every process in
it; then `--resume` to the end and compare the final folder with the uninterrupted run's.
The signal lands wherever the ranks are at that moment (mid-step, in the all-reduce, in a
save); one trial uses the runner's testing aid that signals everything as a checkpoint starts.

Tolerance 1e-6 on the final parameters: DeepSpeed's CPU Adam recomputes beta^t with pow() after a
restart (tests/e2e/test_runner.py module docstring: measured 1.2e-7 in fp32).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from runner_util import FINETUNE, REPO, TEXT_DATA, env, events, final_params, free_port, read_log, write_bundle, \
    write_tiny_llama

from memkit.train.supervise import EXIT_SIGNAL, descendants, launcher_env
from memkit.plan.plan import TrainingPlan

pytestmark = pytest.mark.e2e
MAX_STEPS = 12
HANG_GUARD_S = 600  # a run here takes 20-60 s; the guard only turns a hang into a failure
TIME_CADENCE = ["--save-every-minutes", "0.00001", "--keep-checkpoints", str(MAX_STEPS)]
"""A time cadence every step boundary passes (0.6 ms), every checkpoint kept."""


class Setup(tuple):
    """(common finetune args, accelerate config, the uninterrupted run's final params), and in
    `whole_dir` that run's output dir (its log and time-cadence checkpoints)."""
    whole_dir: Path


@pytest.fixture(scope="module")
def setup(tmp_path_factory) -> Setup:
    """The uninterrupted run, which also checkpoints on a time cadence of ~1 ms (so at every step
    boundary but the last): the trials compare with its final parameters,
    test_time_cadence_checkpoints_without_a_signal reads its checkpoints."""
    root = tmp_path_factory.mktemp("preempt")
    tiny = root / "tiny"
    write_tiny_llama(tiny)
    plan = TrainingPlan(precision="fp32", zero_stage=2, micro_batch_size=1, grad_accum=2, seq_len=64, dp=2,
                        reduce_bucket_size=1_000_000, allgather_bucket_size=1_000_000)
    config, plan_path = write_bundle(root / "bundle", plan)
    acc = yaml.safe_load(config.read_text())
    acc["main_process_port"] = free_port()  # `memkit train` takes the port from the config
    config.write_text(yaml.safe_dump(acc, sort_keys=False))
    common = ["--plan", str(plan_path), "--model", str(tiny), "--data", str(TEXT_DATA),
              "--max-steps", str(MAX_STEPS), "--lr", "3e-3", "--warmup-steps", "1", "--no-progress"]
    whole = root / "whole"
    proc = _start(config, [*common, "--output-dir", str(whole), *TIME_CADENCE], via_train=False)
    out = _wait(proc)
    assert proc.returncode == 0, out[-4000:]
    assert [r["step"] for r in events(read_log(whole), "step")] == list(range(1, MAX_STEPS + 1))
    done = Setup((common, config, final_params(whole / "final")))
    done.whole_dir = whole
    return done


def _start(config: Path, args: list[str], *, via_train: bool) -> subprocess.Popen:
    run_env = launcher_env(env(), preempt_grace_s=25.0)  # as memkit train and the Slurm script set it
    if via_train:
        cmd = [sys.executable, "-m", "memkit.cli.main", "train", "--config-file", str(config), *args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config),
               "--main_process_port", str(free_port()), str(FINETUNE), *args]
    return subprocess.Popen(cmd, cwd=REPO, env={**run_env, "PYTHONPATH": str(REPO)}, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=HANG_GUARD_S)
    except subprocess.TimeoutExpired:
        for pid in [proc.pid, *descendants(proc.pid)]:
            os.kill(pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"hang guard: {proc.args}\n{out[-4000:]}")
    return out


def _steps_logged(run_dir: Path) -> int:
    try:
        return sum(1 for line in (run_dir / "log.jsonl").read_text().splitlines()
                   if line.endswith("}") and json.loads(line)["event"] == "step")
    except FileNotFoundError:
        return 0


def _signal_everything_at(proc: subprocess.Popen, run_dir: Path, step: int, sig: int) -> list[int]:
    """Once rank 0 has logged `step` steps: `sig` to the root process and every descendant,
    all within a millisecond or so (the scheduler's way). Returns the pids signalled."""
    deadline = time.monotonic() + HANG_GUARD_S
    while _steps_logged(run_dir) < step:
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
        time.sleep(0.02)
    tree = [proc.pid, *descendants(proc.pid)]
    for pid in tree:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass
    return tree


def _assert_stopped_then_resumes(setup, run_dir: Path, proc, out: str, *, sig: int, via_train: bool,
                                 expect_checkpoints: int = 1) -> int:
    common, config, whole = setup
    if via_train:  # memkit itself reports the signal's code
        assert proc.returncode == EXIT_SIGNAL[sig], out[-4000:]
    else:  # the launcher dies of the relayed SignalException (torch/distributed/launcher/api.py)
        assert proc.returncode != 0, out[-4000:]
    log = read_log(run_dir)
    end = events(log, "end")[-1]
    assert end["status"] == "interrupted", out[-4000:]
    assert f"memkit: {signal.Signals(sig).name}: checkpoint at step {end['steps_done']}, then exit " \
           f"{EXIT_SIGNAL[sig]}" in out
    stop_step = end["steps_done"]
    ckpts = events(log, "checkpoint")
    assert len(ckpts) == expect_checkpoints and ckpts[-1]["step"] == stop_step < MAX_STEPS, ckpts
    assert ckpts[-1]["reason"] == signal.Signals(sig).name
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step-{stop_step:08d}"
    assert not (run_dir / "final").exists()

    resumed = _start(config, [*common, "--output-dir", str(run_dir), "--resume"], via_train=via_train)
    out = _wait(resumed)
    assert resumed.returncode == 0, out[-4000:]
    log = read_log(run_dir)
    assert events(log, "start")[-1]["start_step"] == stop_step
    got = final_params(run_dir / "final")
    assert sorted(got) == sorted(whole)
    worst = max(float((got[k].float() - whole[k].float()).abs().max()) for k in got)
    assert worst <= 1e-6, f"max |delta param| {worst}"
    return stop_step


def _trial(setup, tmp_path: Path, *, step: int, sig: int, via_train: bool) -> int:
    common, config, _ = setup
    run_dir = tmp_path / f"run-{signal.Signals(sig).name}-{step}-{'train' if via_train else 'launch'}"
    proc = _start(config, [*common, "--output-dir", str(run_dir)], via_train=via_train)
    tree = _signal_everything_at(proc, run_dir, step, sig)
    assert len(tree) >= 3  # the launcher and both ranks (and memkit train above them)
    out = _wait(proc)
    return _assert_stopped_then_resumes(setup, run_dir, proc, out, sig=sig, via_train=via_train)


@pytest.mark.parametrize("sig, via_train", [(signal.SIGTERM, True), (signal.SIGUSR1, False)])
def test_signal_to_every_process_checkpoints_and_resumes(setup, tmp_path, sig, via_train):
    stop_step = _trial(setup, tmp_path, step=3, sig=sig, via_train=via_train)
    assert stop_step >= 3


def test_signal_during_a_save(setup, tmp_path):
    """SIGTERM to the launcher and both ranks as the step-3 checkpoint starts: that save
    completes, the ranks stop at the next boundary with a second checkpoint."""
    common, config, _ = setup
    run_dir = tmp_path / "in-save"
    proc = _start(config, [*common, "--output-dir", str(run_dir), "--save-every", "3",
                           "--debug-signal-in-save-at-step", "3"], via_train=False)
    out = _wait(proc)
    stop_step = _assert_stopped_then_resumes(setup, run_dir, proc, out, sig=signal.SIGTERM, via_train=False,
                                             expect_checkpoints=2)
    assert stop_step == 4
    assert [c["reason"] for c in events(read_log(run_dir), "checkpoint")][:2] == ["save-every", "SIGTERM"]


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("MEMKIT_LONG_TRIALS") != "1",
                    reason="20 launches and their resumes (~1 min each on 2 cores): MEMKIT_LONG_TRIALS=1 runs them "
                           "(or benchmarks/preempt_trials.py, which prints the table)")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1])
def test_ten_trials_at_random_steps(setup, tmp_path, sig):
    """10 trials per signal at seeded random steps 1..7, every third through `memkit train`, one
    while a checkpoint is being written (benchmarks/preempt_trials.py: the same trials as a table)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from preempt_trials import run_trial, table, trials

    rows = [run_trial(setup, tmp_path, trial, sig) for trial in trials(sig)]
    assert all(r.ok for r in rows), table(rows)


def test_time_cadence_checkpoints_without_a_signal(setup):
    """--save-every-minutes: rank 0's clock decides, every rank saves at that step (the all-reduce);
    the uninterrupted run of `setup` (which the resumed trials match) ran with it."""
    run_dir = setup.whole_dir
    ckpts = events(read_log(run_dir), "checkpoint")
    assert [(c["step"], c["reason"]) for c in ckpts] == [(s, "save-every-minutes") for s in range(1, MAX_STEPS)]
    assert sorted(p.name for p in (run_dir / "checkpoints").glob("step-*")) == \
        [f"step-{s:08d}" for s in range(1, MAX_STEPS)]
