"""The Slurm script of `memkit launch-script --slurm` asks for the time-limit warning and requeues
(#28). sbatch is not installed here, so the #SBATCH lines are checked by parsing them as sbatch
reads them (the leading comment block, `#SBATCH --opt[=value]`), and the script's own logic (its
USR1/TERM traps, the relay to the steps, the requeue) is run with `srun`, `scancel` and `scontrol`
on PATH as small scripts that record their arguments; `--python` stands in for the launcher."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memkit.plan.plan import TrainingPlan

FAKE_SRUN = """#!/bin/bash
# srun [--opt=value]... bash -c CMD NAME ARGS...: run the step here as node 0.
echo "srun $*" >> "$LAUNCH_LOG"
while [[ "$1" == --* ]]; do shift; done
SLURM_NODEID=0 exec "$@"
"""
FAKE_SCANCEL = """#!/bin/bash
# scancel --signal=SIG JOBID: the job's steps (here: the fake launcher) get SIG.
echo "scancel $*" >> "$LAUNCH_LOG"
kill -"${1#--signal=}" "$(cat "$LAUNCHER_PID")"
"""
FAKE_SCONTROL = """#!/bin/bash
echo "scontrol $*" >> "$LAUNCH_LOG"
[[ "$1" == show ]] && echo node-a
exit 0
"""
FAKE_LAUNCHER = """#!/bin/bash
echo $$ > "$LAUNCHER_PID"
trap 'echo "launcher got USR1" >> "$LAUNCH_LOG"; exit 138' USR1
trap 'echo "launcher got TERM" >> "$LAUNCH_LOG"; exit 143' TERM
echo "launcher started $*" >> "$LAUNCH_LOG"
while true; do sleep 0.05; done
"""


def _bundle(tmp_path: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from runner_util import write_bundle

    plan = TrainingPlan(precision="fp32", zero_stage=2, micro_batch_size=1, seq_len=64, dp=2)
    return write_bundle(tmp_path / "bundle", plan, num_gpus_per_node=1, num_nodes=2)[1]


def _sbatch_options(text: str) -> dict[str, str | None]:
    """#SBATCH options as sbatch reads them: only the comment block before the first command."""
    options = {}
    for line in text.splitlines()[1:]:
        if line and not line.startswith("#"):
            break
        if line.startswith("#SBATCH "):
            key, _, value = line[len("#SBATCH "):].strip().partition("=")
            options[key] = value or None
    return options


def _write(tmp_path: Path, *extra: str, python: str | None = None) -> Path:
    from memkit.cli.main import main

    out = tmp_path / "job.sh"
    args = ["launch-script", "--plan", str(_bundle(tmp_path)), "--slurm", "--out", str(out), *extra]
    if python:
        args += ["--python", python]
    assert main([*args, "--", "--data", "d.jsonl", "--output-dir", "out"]) == 0
    return out


def test_slurm_script_requests_the_warning_and_requeue(tmp_path, capsys):
    from memkit.cli.main import main

    text = _write(tmp_path).read_text()
    options = _sbatch_options(text)
    assert options["--signal"] == "B:USR1@660" and "--requeue" in options and options["--open-mode"] == "append"
    assert "--signal=TERM" not in text
    assert 'ARGS=(--plan ' in text and text.split("ARGS=(", 1)[1].split(")", 1)[0].split()[-1] == "--resume"
    assert 'TORCHELASTIC_SIGNALS_TO_HANDLE="${TORCHELASTIC_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}"' \
        in text
    assert 'export PET_SIGNALS_TO_HANDLE="${PET_SIGNALS_TO_HANDLE:-$TORCHELASTIC_SIGNALS_TO_HANDLE}"' in text  # torchrun's flag
    assert subprocess.run(["bash", "-n", str(tmp_path / "job.sh")]).returncode == 0
    assert _sbatch_options(_write(tmp_path, "--signal-lead", "300").read_text())["--signal"] == "B:USR1@300"
    capsys.readouterr()
    assert main(["launch-script", "--plan", str(tmp_path / "bundle" / "plan.json"), "--slurm", "--out",
                 str(tmp_path / "x.sh"), "--signal-lead", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("memkit: error: --signal-lead 0 must be a positive integer (seconds "
                                              "before the time limit, at most 10,000,000)")
    assert not (tmp_path / "x.sh").exists()


def _run_job(tmp_path: Path, sig: int) -> tuple[int, list[str], str]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scancel", FAKE_SCANCEL), ("scontrol", FAKE_SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    launcher = tmp_path / "fake-python"
    launcher.write_text(FAKE_LAUNCHER)
    launcher.chmod(0o755)
    script = _write(tmp_path, python=str(launcher))
    log, pid_file = tmp_path / "launch.log", tmp_path / "launcher.pid"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LAUNCH_LOG": str(log),
           "LAUNCHER_PID": str(pid_file), "SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "node-a",
           "SLURM_CPUS_ON_NODE": "4"}
    proc = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(400):  # hang guard only: the fake launcher starts within a second
            if log.exists() and "launcher started" in log.read_text():
                break
            time.sleep(0.05)
        if sig == signal.SIGUSR1:
            proc.send_signal(sig)  # B:USR1: Slurm signals the batch shell only
        else:  # scancel / preemption: every process of the job
            proc.send_signal(sig)
            os.kill(int(pid_file.read_text()), sig)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, log.read_text().splitlines(), out


def test_usr1_checkpoints_then_requeues(tmp_path):
    code, log, out = _run_job(tmp_path, signal.SIGUSR1)
    assert code == 0, out
    assert [line for line in log if not line.startswith(("srun", "launcher started", "scontrol show"))] == [
        "scancel --signal=USR1 4242", "launcher got USR1", "scontrol requeue 4242"]
    started = next(line for line in log if line.startswith("launcher started"))
    assert started.endswith("--data d.jsonl --output-dir out --resume")
    assert "memkit: requeueing job 4242" in out


@pytest.mark.parametrize("sig", [signal.SIGTERM])
def test_term_waits_for_the_ranks_and_does_not_requeue(tmp_path, sig):
    code, log, out = _run_job(tmp_path, sig)
    assert code == 143, out
    assert "launcher got TERM" in log and not any(line.startswith(("scancel", "scontrol requeue")) for line in log)
    assert "memkit: SIGTERM: the ranks checkpoint and exit" in out
