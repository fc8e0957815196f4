"""What --resume trusts (memkit.train.checkpoint): data, never code, with and without a manifest;
stray and partial folders skipped by step; RNG restore checked. One process (accelerator None
for the checks), real torch.save files, a real pickle that would run a command."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from memkit.train.checkpoint import CheckpointManager, UnsafeCheckpoint, resolve_resume, write_manifest


class Probe:
    """Unpickling it runs a shell command that writes a marker file."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def _checkpoint(root: Path, step: int, *, manifest: bool) -> Path:
    """A 1-process ZeRO-2 DeepSpeed layout as Accelerate writes it (file names of
    deepspeed/runtime/engine.py _get_ckpt_name / _get_zero_ckpt_name), every file real."""
    folder = root / f"step-{step:08d}"
    (folder / "pytorch_model").mkdir(parents=True)
    (folder / "trainer_state.json").write_text(json.dumps({"step": step, "world_size": 1,
                                                           "plan": {"zero_stage": 2, "tp": 1}}))
    torch.save({"torch_manual_seed": torch.get_rng_state()}, folder / "random_states_0.pkl")
    torch.save({"module": {"w": torch.full((4,), float(step))}}, folder / "pytorch_model" / "mp_rank_00_model_states.pt")
    torch.save({"optimizer_state_dict": {"exp_avg": torch.zeros(4)}},
               folder / "pytorch_model" / "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    if manifest:
        write_manifest(folder, step=step, accelerator=None)
    return folder


@pytest.mark.parametrize("manifest", ["kept-rehashed", "deleted"])
@pytest.mark.parametrize("target", ["pytorch_model/mp_rank_00_model_states.pt",
                                    "pytorch_model/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                    "random_states_0.pkl", "custom_checkpoint_0.pkl"])
def test_a_pickle_that_runs_code_is_refused_and_never_run(tmp_path, capsys, manifest, target):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 1, manifest=True)
    newest = _checkpoint(root, 2, manifest=True)
    marker = tmp_path / "MARKER"
    torch.save({"state": Probe(marker)}, newest / target)  # custom_checkpoint_0.pkl: --optimizer-in-backward's
    if manifest == "deleted":
        (newest / "manifest.json").unlink()
    else:  # anyone who can write the folder can re-hash it
        write_manifest(newest, step=2, accelerator=None)
    with pytest.raises(UnsafeCheckpoint) as err:
        resolve_resume("latest", CheckpointManager(root, accelerator=None))
    message = str(err.value)
    assert "\n" not in message and str(newest / target) in message and "posix.system" in message
    assert err.value.exit_code == 2
    assert not marker.exists()
    with pytest.raises(UnsafeCheckpoint):  # the same for an explicit path
        resolve_resume(str(newest), CheckpointManager(root, accelerator=None))
    assert not marker.exists()


def test_without_manifest_truncation_and_stray_folders_fall_back_by_step(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    _checkpoint(root, 1, manifest=False)
    _checkpoint(root, 2, manifest=False)
    states = root / "step-00000002" / "pytorch_model" / "mp_rank_00_model_states.pt"
    states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])  # truncated, no manifest to say so
    stray = root / "step-00000009"
    stray.mkdir()
    (stray / "trainer_state.json").write_text(json.dumps({"step": 9, "world_size": 1}))  # and no `latest`
    (root / "step-00000011").mkdir()  # an empty one
    capsys.readouterr()
    assert resolve_resume("latest", CheckpointManager(root, accelerator=None)) == root / "step-00000001"
    err = capsys.readouterr().err.splitlines()
    assert [line.split(": ", 2)[1].split()[1].rsplit("/", 1)[1] for line in err[:3]] == \
        ["step-00000011", "step-00000009", "step-00000002"]  # newest step first
    assert "is incomplete" in err[0] and "trainer_state.json is missing" in err[0]
    assert "is incomplete" in err[1] and "random_states_0.pkl is missing" in err[1]
    assert "is damaged" in err[2] and "mp_rank_00_model_states.pt does not load" in err[2]
    assert "has no manifest.json" in err[3] and "step-00000001" in err[3]
    assert "resuming from step-00000001" in err[4] and "3 damaged or incomplete" in err[4]
    assert len(err) == 5


def test_missing_partition_of_one_rank_without_manifest_is_incomplete(tmp_path, capsys):
    """A 2-process checkpoint (trainer_state world_size 2) needs both ranks' RNG and ZeRO files."""
    root = tmp_path / "checkpoints"
    folder = _checkpoint(root, 3, manifest=False)
    state = json.loads((folder / "trainer_state.json").read_text())
    (folder / "trainer_state.json").write_text(json.dumps({**state, "world_size": 2}))
    torch.save({"torch_manual_seed": torch.get_rng_state()}, folder / "random_states_1.pkl")
    manager = CheckpointManager(root, accelerator=None)
    assert manager.inspect(folder) == ("incomplete", "pytorch_model/zero_pp_rank_1_mp_rank_00_optim_states.pt or "
                                                     "pytorch_model/bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt "
                                                     "is missing")
    torch.save({"optimizer_state_dict": {}}, folder / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt")
    assert manager.inspect(folder) is None


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A real 1 MiB tmpfs (needs root for mount; skipped otherwise)."""
    from tmpfs_util import tmpfs

    with tmpfs(tmp_path / "ckpts", "1m") as mount_point:
        yield mount_point


def test_save_onto_a_full_then_read_only_file_system_says_why_and_keeps_the_previous(tiny_tmpfs):
    """One process, the real Accelerate save_state of a real model + AdamW: a checkpoint that
    fits is published; the next one does not fit (torch's zip writer fails without an errno) and
    is said as 'no space left on device', the half-written folder gone; read-only likewise."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    from tmpfs_util import remount_read_only

    from memkit.train.checkpoint import EXIT_CHECKPOINT_WRITE, CheckpointWriteError

    accelerator = Accelerator(cpu=True)
    try:
        model = torch.nn.Linear(64, 64)
        optimizer = torch.optim.AdamW(model.parameters())
        model, optimizer = accelerator.prepare(model, optimizer)
        manager = CheckpointManager(tiny_tmpfs, accelerator, keep=5)
        first = manager.save(1, {"step": 1, "world_size": 1})
        assert manager.damage(first) is None
        stat = os.statvfs(tiny_tmpfs)  # fill it up to 8 KiB: the probe fits, the model states do not
        (tiny_tmpfs / "filler").write_bytes(b"\0" * (stat.f_bavail * stat.f_frsize - 8192))
        with pytest.raises(CheckpointWriteError) as err:
            manager.save(2, {"step": 2, "world_size": 1})
        assert str(err.value) == (f"could not write checkpoint step-00000002 to {tiny_tmpfs}: no space left on device "
                                  "(previous checkpoint step-00000001 kept)")
        assert err.value.exit_code == EXIT_CHECKPOINT_WRITE
        assert sorted(p.name for p in tiny_tmpfs.iterdir()) == ["filler", "latest", "step-00000001"]
        assert manager.damage(first) is None
        (tiny_tmpfs / "filler").unlink()
        remount_read_only(tiny_tmpfs)
        with pytest.raises(CheckpointWriteError, match=r"step-00000002 to .*: read-only file system "
                                                       r"\(previous checkpoint step-00000001 kept\)$"):
            manager.save(2, {"step": 2, "world_size": 1})
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()


def test_dcp_metadata_loads_as_data_and_a_probe_in_it_is_refused(tmp_path):
    """A real torch.distributed.checkpoint save (one process): its .metadata (a plain protocol-4
    pickle that DCP reads with pickle.load) passes; the same file replaced by a probe is refused."""
    import pickle
    import warnings

    import torch.distributed.checkpoint as dcp

    from memkit.train.checkpoint import _check_loads

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "assuming the intent is to save in a single process"
        dcp.save({"model/w": torch.ones(3, 4, dtype=torch.bfloat16), "optim/w/exp_avg": torch.zeros(3, 4),
                  "step": torch.tensor(3)}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    assert _check_loads(tmp_path, None) is None
    marker = tmp_path / "MARKER"
    with open(tmp_path / "dcp" / ".metadata", "wb") as handle:
        pickle.dump(Probe(marker), handle, protocol=4)
    assert _check_loads(tmp_path, None) == ("code", "dcp/.metadata", "its pickle names posix.system")
    assert not marker.exists()


def test_an_rng_file_accelerate_cannot_restore_is_a_warning_line(tmp_path, capsys):
    """Accelerate skips RNG states it cannot apply with a message at INFO (accelerate/checkpointing.py,
    load_accelerator_state); memkit says it as a WARNING line. Real Accelerate save/load, one process."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    accelerator = Accelerator(cpu=True)
    try:
        model, optimizer = accelerator.prepare(torch.nn.Linear(8, 8), torch.optim.AdamW(torch.nn.Linear(8, 8).parameters()))
        manager = CheckpointManager(tmp_path / "checkpoints", accelerator)
        folder = manager.save(1, {"step": 1, "world_size": 1})
        capsys.readouterr()
        manager.load(folder)
        assert "WARNING" not in capsys.readouterr().err  # restored
        torch.save({"random_state": None, "torch_manual_seed": torch.zeros(3, dtype=torch.uint8)},
                   folder / "random_states_0.pkl")  # data, but not a generator state torch accepts
        write_manifest(folder, step=1, accelerator=None)
        assert manager.inspect(folder) is None
        manager.load(folder)
        err = capsys.readouterr().err.splitlines()
        assert len(err) == 1 and err[0].startswith(f"memkit: WARNING: the RNG states of {folder} were not restored")
        assert "random_states_0.pkl" in err[0]
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        PartialState._reset_state()
