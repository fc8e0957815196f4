"""Checkpoints from someone else run no code, every damage kind falls back, every fault at save
says what happened, and a killed op build does not wedge the next launch: 2-process DeepSpeed
ZeRO-2 on CPU (gloo), the real DeepSpeed and Accelerate, a tiny Llama.

One uninterrupted reference run checkpoints after steps 1-6 of 7 (tests/e2e/shared_ckpt_runs.py's,
shared with test_corrupt_checkpoint.py); each test works on a copy:
  - a pickle that would run a command (it writes a marker) in the model states (manifest re-hashed)
    or in rank 1's optimizer partition (manifest deleted): one line naming the file, every rank exits 2
    (`accelerate launch` itself then exits 1, as for any failed rank), no marker;
  - no manifests, a truncated model-states file in step 6, a stray step-9/ with only
    trainer_state.json and no `latest`: both skipped with a line, resumed from step 5, final
    parameters equal the reference's (1e-6, as tests/e2e/test_corrupt_checkpoint.py);
  - checkpoints onto a real full tmpfs, then the same tmpfs read-only: the one line, exit 4, the
    previous checkpoint kept and intact (needs root for mount; skipped otherwise);
  - build locks left by a killed torch FileBaton holder (every op, deepspeed_shm_comm included):
    removed with a line, the launch finishes (the fallback resume above is that launch: one run,
    two tests read it).
"""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from runner_util import TEXT_DATA, final_params, launch, write_tiny_llama
from shared_ckpt_runs import STEPS, step_name as _step, zero2_reference

from memkit.plan.plan import TrainingPlan

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
__all__ = ["zero2_reference"]  # the shared session fixture, imported for pytest to find
EXIT_CHECKPOINT_WRITE = 4


def _rank_exits(result) -> list[int]:
    """The ranks' exit codes. `accelerate launch` itself exits 1 with torch elastic's
    ChildFailedError summary when a rank fails (torch/distributed/elastic/multiprocessing/errors),
    which lists each failed rank's `exitcode`; no Python frame of memkit may appear."""
    assert result.returncode != 0, result.stdout[-4000:]
    assert not re.search(r'File ".*(memkit|finetune\.py)', result.stdout), result.stdout[-4000:]
    found = re.findall(r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)", result.stdout)
    by_rank = {int(rank): int(code) for rank, code in found}  # the root cause is listed twice
    return [code for _, code in sorted(by_rank.items())]


_PROBE = '''
import os, sys, torch
class Probe:
    def __reduce__(self):
        return os.system, ("touch " + sys.argv[2],)
torch.save({"module": Probe()}, sys.argv[1])
'''


@pytest.mark.parametrize("target,manifest", [("pytorch_model/mp_rank_00_model_states.pt", "rehashed"),
                                             ("pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt", "deleted")])
def test_a_pickle_that_runs_code_is_refused_before_any_rank_loads_it(zero2_reference, tmp_path, target, manifest):
    from memkit.train.checkpoint import write_manifest

    config, whole = zero2_reference.config, zero2_reference.whole
    out = tmp_path / "run"
    shutil.copytree(whole / "checkpoints", out / "checkpoints")
    newest = out / "checkpoints" / _step(STEPS - 1)
    marker = tmp_path / "MARKER"
    subprocess.run([sys.executable, "-c", _PROBE, str(newest / target), str(marker)], check=True)
    assert not marker.exists()
    if manifest == "deleted":
        (newest / "manifest.json").unlink()
    else:  # the manifest is integrity, not authentication: anyone who can write the folder re-hashes it
        write_manifest(newest, step=STEPS - 1, accelerator=None)
    result = launch(config, [*zero2_reference.args(), "--output-dir", str(out), "--resume"])
    assert _rank_exits(result) == [2, 2]
    assert not marker.exists(), "the checkpoint's pickle ran"
    hits = [line for line in result.stdout.splitlines() if "needs code to load" in line]
    assert len(hits) == 1 and str(newest / target) in hits[0] and "posix.system" in hits[0], hits
    assert hits[0].startswith("finetune: error: --resume: ")


@pytest.fixture(scope="module")
def fallback_run(zero2_reference, tmp_path_factory):
    """The reference's checkpoints without manifests, the newest's model states truncated, a stray
    step-9/ and no `latest`, resumed with a torch-extensions folder whose build locks a killed
    FileBaton holder left (every op, deepspeed_shm_comm included): (result, run dir, locks)."""
    from memkit.train.ops import extensions_root, use_install_extensions_dir

    top = tmp_path_factory.mktemp("fallback")
    out = top / "run"
    shutil.copytree(zero2_reference.whole / "checkpoints", out / "checkpoints")
    ckpts = out / "checkpoints"
    for manifest in ckpts.glob("step-*/manifest.json"):
        manifest.unlink()  # as an older memkit wrote them
    states = ckpts / _step(STEPS - 1) / "pytorch_model" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
    stray = ckpts / _step(9)
    stray.mkdir()
    shutil.copy(ckpts / _step(STEPS - 1) / "trainer_state.json", stray / "trainer_state.json")
    (ckpts / "latest").unlink()

    use_install_extensions_dir()
    ext = top / "extensions"
    shutil.copytree(extensions_root(), ext, ignore=shutil.ignore_patterns("lock", ".adopting-*"))
    locks = [ext / name / "lock" for name in ("cpu_adam", "fused_adam", "deepspeed_shm_comm")]
    killed = subprocess.run([sys.executable, "-c", _HOLD_AND_DIE, *map(str, locks)])
    assert killed.returncode == -signal.SIGKILL and all(lock.exists() for lock in locks)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCH_EXTENSIONS_DIR", str(ext))  # launch() hands os.environ to the run
        result = launch(zero2_reference.config, [*zero2_reference.args(), "--output-dir", str(out), "--resume"])
    return result, out, locks


def test_truncated_states_without_manifest_and_a_stray_folder_fall_back(zero2_reference, fallback_run):
    result, out, _ = fallback_run
    assert result.returncode == 0, result.stdout[-4000:]
    ckpts, stray = out / "checkpoints", out / "checkpoints" / _step(9)
    lines = result.stdout.splitlines()
    stray_lines = [line for line in lines if f"checkpoint {stray} is incomplete" in line]
    assert len(stray_lines) == 1 and "random_states_0.pkl is missing" in stray_lines[0], stray_lines
    damaged = [line for line in lines if f"checkpoint {ckpts / _step(STEPS - 1)} is damaged" in line]
    assert len(damaged) == 1 and "mp_rank_00_model_states.pt does not load" in damaged[0], damaged
    fallback = [line for line in lines if "resuming from " + _step(STEPS - 2) in line]
    assert len(fallback) == 1 and "2 damaged or incomplete" in fallback[0], fallback
    assert "Traceback" not in result.stdout and "AssertionError" not in result.stdout
    assert "WARNING: the RNG states" not in result.stdout  # restored: checked after load_state
    pa, pb = final_params(zero2_reference.whole / "final"), final_params(out / "final")
    assert sorted(pa) == sorted(pb)
    worst = max(float((pa[k].float() - pb[k].float()).abs().max()) for k in pa)
    assert worst <= 1e-6, f"max |delta| {worst}"


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 3 MiB tmpfs: one checkpoint of the tiny run (1.9 MiB) fits, a second does not."""
    from tmpfs_util import tmpfs

    with tmpfs(tmp_path / "run" / "checkpoints", "3m") as mount_point:
        yield mount_point


def test_full_and_read_only_checkpoint_folders_are_said_once(zero2_reference, tmp_path, small_tmpfs):
    from memkit.train.checkpoint import CheckpointManager

    config = zero2_reference.config
    out = tmp_path / "run"  # its checkpoints/ is the mount point: a run "already there", so --resume
    result = launch(config, [*zero2_reference.args(), "--output-dir", str(out), "--resume"])
    assert _rank_exits(result) in ([EXIT_CHECKPOINT_WRITE], [EXIT_CHECKPOINT_WRITE] * 2)  # the launcher may stop the last
    expected = (f"memkit: could not write checkpoint {_step(2)} to {small_tmpfs}: no space left on device "
                f"(previous checkpoint {_step(1)} kept)")
    assert [line for line in result.stdout.splitlines() if "could not write checkpoint" in line] == [expected]
    assert sorted(p.name for p in small_tmpfs.iterdir()) == [LATEST_NAME, _step(1)]  # no half-written folder
    assert CheckpointManager(small_tmpfs, accelerator=None).damage(small_tmpfs / _step(1)) is None

    from tmpfs_util import remount_read_only

    remount_read_only(small_tmpfs)
    result = launch(config, [*zero2_reference.args(), "--output-dir", str(out), "--resume"])
    assert _rank_exits(result) in ([EXIT_CHECKPOINT_WRITE], [EXIT_CHECKPOINT_WRITE] * 2)
    expected = (f"memkit: could not write checkpoint {_step(2)} to {small_tmpfs}: read-only file system "
                f"(previous checkpoint {_step(1)} kept)")
    assert [line for line in result.stdout.splitlines() if "could not write checkpoint" in line] == [expected]


LATEST_NAME = "latest"

_HOLD_AND_DIE = '''
import os, signal, sys
from torch.utils.file_baton import FileBaton
for path in sys.argv[1:]:
    assert FileBaton(path).try_acquire()  # what torch's JIT build takes before compiling
os.kill(os.getpid(), signal.SIGKILL)  # killed mid-build: the lock files stay, nobody holds them
'''


def test_locks_of_a_killed_build_are_removed_not_waited_on(fallback_run):
    result, _, locks = fallback_run
    assert result.returncode == 0, result.stdout[-4000:]
    removed = [line for line in result.stdout.splitlines() if "removed stale build lock" in line]
    assert sorted(line.split("removed stale build lock ")[1].split()[0] for line in removed) == \
        sorted(map(str, locks)), removed  # every stale lock of the root, said once (local rank 0)
    assert not any(lock.exists() for lock in locks)


def test_optimizer_in_backward_custom_state_is_checked_too(tmp_path):
    """One process, plain torch: --optimizer-in-backward's optimizers are saved by Accelerate as
    custom_checkpoint_0.pkl and loaded with weights_only=False (accelerate/checkpointing.py,
    load_custom_state). The real file of a real run loads as data; the probe in it is refused."""
    import json

    from runner_util import FINETUNE, REPO, env, plan_document

    from memkit.train.checkpoint import write_manifest

    tiny = tmp_path / "tiny"
    write_tiny_llama(tiny)
    plan = TrainingPlan(engine="torch", precision="fp32", optimizer="adamw", micro_batch_size=2, seq_len=64,
                        gradient_clipping=0.0, optimizer_in_backward=True)
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan_document(plan, num_gpus_per_node=1, num_nodes=1)))
    out = tmp_path / "run"
    cmd = [sys.executable, str(FINETUNE), "--plan", str(plan_path), "--model", str(tiny), "--output-dir", str(out),
           "--data", str(TEXT_DATA), "--max-steps", "2", "--save-every", "1", "--no-progress", "--report-to", "none"]
    first = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert first.returncode == 0, first.stderr[-4000:]
    custom = out / "checkpoints" / _step(1) / "custom_checkpoint_0.pkl"
    assert custom.is_file()
    marker = tmp_path / "MARKER"
    subprocess.run([sys.executable, "-c", _PROBE, str(custom), str(marker)], check=True)
    write_manifest(custom.parent, step=1, accelerator=None)
    result = subprocess.run([*cmd, "--resume", str(custom.parent)], cwd=REPO, env=env(), capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 2, result.stderr[-4000:]
    assert not marker.exists(), "the checkpoint's pickle ran"
    lines = [line for line in result.stderr.splitlines() if "needs code to load" in line]
    assert len(lines) == 1 and str(custom) in lines[0], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
