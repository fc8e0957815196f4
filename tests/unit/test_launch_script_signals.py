"""The multi-node scripts of `memkit launch-script` (#15): the hostfile script runs this interpreter
by its absolute path and passes the DeepSpeed file by its absolute path; SIGTERM / Ctrl-C to
`bash run.sh` reaches the launcher on every host; the Slurm script gives each node's launcher
the node's CPUs.

The hosts are simulated: `ssh` on PATH is a script that runs the remote command here, and
`--python` is a script that stands in for the launcher (it records its arguments and the signal
it gets). What is tested is the script's own logic: its trap, the pid files, the exit code."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from memkit.plan.plan import TrainingPlan

FAKE_SSH = f"""#!/bin/bash
# ssh [-o OPT]... HOST COMMAND: run COMMAND here, as sshd would run it on HOST: with default signal
# dispositions (a background job of a script starts with SIGINT ignored; a process sshd starts does not).
while [[ "$1" == -o ]]; do shift 2; done
shift
exec {sys.executable} -c 'import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); \\
os.execvp("bash", ["bash", "-c", sys.argv[1]])' "$*"
"""
FAKE_LAUNCHER = """#!/bin/bash
trap 'echo "rank $MACHINE_RANK got TERM" >> "$LAUNCH_LOG"; exit 143' TERM
trap 'echo "rank $MACHINE_RANK got INT" >> "$LAUNCH_LOG"; exit 130' INT
echo "rank $MACHINE_RANK started $*" >> "$LAUNCH_LOG"
while true; do sleep 0.05; done
"""


def _as_a_terminal_starts_it() -> None:
    """The script starts with SIGINT and SIGTERM at their defaults and none blocked, as from a terminal or a
    scheduler, whatever an earlier test left in this pytest process (bash cannot trap a signal that was
    ignored when it started: bash(1), SIGNALS)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_SETMASK, [])


def _bundle(tmp_path: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
    from runner_util import write_bundle

    plan = TrainingPlan(precision="fp32", zero_stage=2, micro_batch_size=1, seq_len=64, dp=2)
    return write_bundle(tmp_path / "bundle", plan, num_gpus_per_node=1, num_nodes=2)[1]


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def test_hostfile_script_uses_this_interpreter_and_absolute_paths(tmp_path):
    from memkit.cli.main import main

    plan_path = _bundle(tmp_path)
    (tmp_path / "hosts").write_text("node-a\nnode-b\n")
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(tmp_path / "hosts"),
                 "--out", str(tmp_path / "run.sh"), "--", "--data", "d.jsonl"]) == 0
    text = (tmp_path / "run.sh").read_text()
    assert f"exec {sys.executable} -m accelerate.commands.launch" in text and os.path.isabs(sys.executable)
    assert f"--deepspeed_config_file {tmp_path / 'bundle' / 'ds_config.json'}" in text
    assert subprocess.run(["bash", "-n", str(tmp_path / "run.sh")]).returncode == 0


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_signal_to_the_script_stops_the_launcher_on_every_host(tmp_path, sig, code):
    from memkit.cli.main import main

    plan_path = _bundle(tmp_path)
    (tmp_path / "hosts").write_text("node-a\nnode-b\n")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _executable(bin_dir / "ssh", FAKE_SSH)
    launcher = _executable(tmp_path / "fake-python", FAKE_LAUNCHER)
    script = tmp_path / "run.sh"
    assert main(["launch-script", "--plan", str(plan_path), "--hostfile", str(tmp_path / "hosts"),
                 "--out", str(script), "--python", str(launcher), "--", "--data", "d.jsonl"]) == 0
    log = tmp_path / "launch.log"
    run_id = f"test-{os.getpid()}-{sig.name}"
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "LAUNCH_LOG": str(log),
           "MEMKIT_RUN_ID": run_id}
    proc = subprocess.Popen(["bash", str(script)], env=env, start_new_session=True, preexec_fn=_as_a_terminal_starts_it,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        for _ in range(400):  # hang guard only: both launchers normally start within a second
            if log.exists() and log.read_text().count("started") == 2:
                break
            time.sleep(0.05)
        started = log.read_text().splitlines()
        assert sorted(line.split(" started ")[0] for line in started) == ["rank 0", "rank 1"]
        assert all(f"--machine_rank {line[5]} --main_process_ip node-a" in line for line in started)
        proc.send_signal(sig)  # to the script only, as Ctrl-C in its terminal or a scheduler's TERM
        try:
            out, _ = proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:  # a hang: say what was left running, for the next reader
            ps = subprocess.run(["ps", "-eo", "pid,ppid,stat,args", "--forest"], capture_output=True, text=True).stdout
            raise AssertionError(f"the script did not exit after {sig.name}\nlog:\n{log.read_text()}\n"
                                 f"pid files: {sorted(Path('/tmp').glob(f'memkit-{run_id}.rank*.pid'))}\n"
                                 + "\n".join(line for line in ps.splitlines() if str(tmp_path) in line)) from None
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == code, out
    got = sorted(line for line in log.read_text().splitlines() if " got " in line)
    assert got == [f"rank 0 got {sig.name[3:]}", f"rank 1 got {sig.name[3:]}"]
    assert f"memkit: {sig.name}: stopping the launcher on every host" in out
    assert not list(Path("/tmp").glob(f"memkit-{run_id}.rank*.pid"))  # the pid files are removed


def test_slurm_script_gives_each_launcher_the_nodes_cpus(tmp_path, capsys):
    from memkit.cli.main import main

    plan_path = _bundle(tmp_path)
    out = tmp_path / "job.sh"
    assert main(["launch-script", "--plan", str(plan_path), "--slurm", "--out", str(out)]) == 0
    text = out.read_text()
    assert '--ntasks-per-node=1 --cpus-per-task="$SLURM_CPUS_ON_NODE" bash -c' in text
    assert "#SBATCH --cpus-per-task" not in text
    assert main(["launch-script", "--plan", str(plan_path), "--slurm", "--out", str(out), "--cpus-per-node", "48"]) == 0
    text = out.read_text()
    assert "#SBATCH --cpus-per-task=48" in text and "--cpus-per-task=48 bash -c" in text
    assert subprocess.run(["bash", "-n", str(out)]).returncode == 0
    capsys.readouterr()
    assert main(["launch-script", "--plan", str(plan_path), "--slurm", "--out", str(out), "--cpus-per-node", "0"]) == 2
    assert capsys.readouterr().err.strip() == ("memkit: error: --cpus-per-node 0: give it with --slurm, at least one "
                                              "CPU per process (1)")
