"""#28's must-show, as a table: a stop signal sent to the launcher and to every rank at once (as Slurm's
scancel / preemption and a Kubernetes pod kill send it) at seeded random steps, 10 trials per signal
(SIGTERM, SIGUSR1), every third through `memkit train`, one while a checkpoint is being written.
Each row: the run stopped with exactly the expected checkpoints, `--resume` went to the end, and the
final parameters equal the uninterrupted run's within 1e-6 (tests/e2e/test_preempt.py's docstring
says why 1e-6). Two CPU ranks under the real DeepSpeed ZeRO-2; ~40 launches, 20-60 s each here.

    nice python benchmarks/preempt_trials.py            # both signals, prints the table, exit 1 on a failed row
    nice python benchmarks/preempt_trials.py SIGUSR1    # one signal

tests/e2e/test_preempt.py::test_ten_trials_at_random_steps runs the same trials (MEMKIT_LONG_TRIALS=1).
"""
from __future__ import annotations

import os
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "tests" / "e2e"), str(REPO / "tests"), str(REPO)]

import test_preempt as tp  # noqa: E402  (the e2e module's launch/signal/resume helpers, one copy)
from runner_util import events, final_params, read_log  # noqa: E402

NUM_TRIALS = 10
IN_SAVE_TRIAL = 4  # this trial signals while the periodic step-3 checkpoint is on disk half-written
IN_SAVE_STEP = 3


@dataclass(frozen=True)
class Trial:
    index: int
    step: int  # signal once rank 0 has logged this many steps (in-save: the save at IN_SAVE_STEP)
    via_train: bool
    in_save: bool


@dataclass
class Row:
    trial: Trial
    signal: str
    ok: bool = False
    stop_step: int | None = None
    checkpoints: str = ""
    exit_code: int | None = None
    worst_delta: float | None = None
    error: str = ""
    wall_s: float = 0.0


def trials(sig: int) -> list[Trial]:
    """Seeded: the same steps every run (seed 28 + the signal's number)."""
    rng = random.Random(28 + int(sig))
    return [Trial(i, IN_SAVE_STEP if i == IN_SAVE_TRIAL else rng.randint(1, 7), via_train=i % 3 == 0,
                  in_save=i == IN_SAVE_TRIAL) for i in range(NUM_TRIALS)]


def _signal_during_save(proc, run_dir: Path, step: int, sig: int) -> list[int]:
    """`sig` to the whole tree while checkpoints/.tmp-step-<step> exists (CheckpointManager.save's
    unpublished folder, memkit/train/checkpoint.py): the ranks are inside the save."""
    tmp = run_dir / "checkpoints" / f".tmp-step-{step:08d}"
    deadline = time.monotonic() + tp.HANG_GUARD_S
    while not tmp.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before its save"
        time.sleep(0.005)
    return tp._signal_everything_at(proc, run_dir, 0, sig)  # step 0: at once


def run_trial(setup, root: Path, trial: Trial, sig: int) -> Row:
    common, config, whole = setup
    row = Row(trial, signal.Signals(sig).name)
    t0 = time.monotonic()
    run_dir = root / f"t{trial.index}-{row.signal}-{trial.step}-{'train' if trial.via_train else 'launch'}"
    extra = ["--save-every", str(IN_SAVE_STEP)] if trial.in_save else []
    proc = tp._start(config, [*common, "--output-dir", str(run_dir), *extra], via_train=trial.via_train)
    try:
        if trial.in_save:
            tree = _signal_during_save(proc, run_dir, IN_SAVE_STEP, sig)
        else:
            tree = tp._signal_everything_at(proc, run_dir, trial.step, sig)
        assert len(tree) >= 3, f"signalled only {tree}"  # the launcher and both ranks
        out = tp._wait(proc)
        row.exit_code = proc.returncode
        row.stop_step = tp._assert_stopped_then_resumes(setup, run_dir, proc, out, sig=sig,
                                                         via_train=trial.via_train,
                                                         expect_checkpoints=2 if trial.in_save else 1)
        reasons = [c["reason"] for c in events(read_log(run_dir), "checkpoint")]
        row.checkpoints = ",".join(reasons)
        if trial.in_save:  # the interrupted save completes; the stop comes at the next step boundary
            assert row.stop_step == IN_SAVE_STEP + 1 and reasons[:2] == ["save-every", row.signal], reasons
        got = final_params(run_dir / "final")
        row.worst_delta = max(float((got[k].float() - whole[k].float()).abs().max()) for k in got)
        row.ok = True
    except AssertionError as exc:
        row.error = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else "assertion failed"
        if proc.poll() is None:
            for pid in [proc.pid, *tp.descendants(proc.pid)]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.communicate()
    row.wall_s = time.monotonic() - t0
    return row


def make_setup(root: Path):
    """test_preempt's module fixture (the uninterrupted run), called outside pytest."""

    class _Factory:  # the one method of pytest's tmp_path_factory the fixture uses
        @staticmethod
        def mktemp(name: str) -> Path:
            path = Path(tempfile.mkdtemp(prefix=name, dir=root))
            return path

    return tp.setup._get_wrapped_function()(_Factory())


def table(rows: list[Row]) -> str:
    lines = ["| signal | trial | via | signalled at | stopped at | checkpoints | exit | resume max abs delta | result |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        t = r.trial
        at = f"in the step-{t.step} save" if t.in_save else f"step {t.step}"
        delta = "" if r.worst_delta is None else f"{r.worst_delta:.1e}"
        lines.append(f"| {r.signal} | {t.index} | {'memkit train' if t.via_train else 'accelerate launch'} | {at} | "
                     f"{'' if r.stop_step is None else r.stop_step} | {r.checkpoints} | "
                     f"{'' if r.exit_code is None else r.exit_code} | {delta} | "
                     f"{'ok' if r.ok else 'FAIL: ' + r.error} |")
    good = sum(r.ok for r in rows)
    lines.append(f"\n{good}/{len(rows)} trials: a checkpoint every time and the resumed run equal to the "
                 f"uninterrupted one (tolerance 1e-6)")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    sigs = [signal.Signals[a] for a in argv] or [signal.SIGTERM, signal.SIGUSR1]
    with tempfile.TemporaryDirectory(prefix="memkit-preempt-") as tmp:
        root = Path(tmp)
        setup = make_setup(root)
        rows = []
        for sig in sigs:
            for trial in trials(sig):
                rows.append(run_trial(setup, root, trial, sig))
                r = rows[-1]
                print(f"{r.signal} trial {trial.index}: {'ok' if r.ok else 'FAIL ' + r.error} ({r.wall_s:.0f} s)",
                      file=sys.stderr, flush=True)
    print(table(rows))
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
