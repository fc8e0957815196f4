"""Stale DeepSpeed build locks (a compile killed mid-way): found by `memkit doctor`, removed with
--clear-stale-locks, and removed by the runner (with a line) before it would wait on them forever."""
from __future__ import annotations

import json
import os

import pytest

from memkit.cli.main import main
from memkit.plan.plan import TrainingPlan
from memkit.train.ops import find_locks, ops_for


@pytest.fixture
def ext_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    for name in ("cpu_adam", "fused_adam"):
        (tmp_path / name).mkdir()
    return tmp_path


def test_stale_lock_is_found_explained_and_removed(ext_dir, capsys):
    stale = ext_dir / "cpu_adam" / "lock"
    stale.write_text("")  # what a killed build leaves (torch FileBaton: O_CREAT | O_EXCL, never removed)
    live = ext_dir / "fused_adam" / "lock"
    fd = os.open(live, os.O_CREAT | os.O_EXCL)  # a build in progress keeps its descriptor open
    try:
        locks = {lock.path.parent.name: lock for lock in find_locks()}
        assert locks["cpu_adam"].stale and locks["cpu_adam"].holders == ()
        assert not locks["fused_adam"].stale and locks["fused_adam"].holders == (os.getpid(),)
        assert "a build of cpu_adam was interrupted" in locks["cpu_adam"].explain()

        assert main(["doctor", "--json"]) == 1  # a stale lock is a problem
        report = json.loads(capsys.readouterr().out)
        assert report["extensions_root"] == str(ext_dir)
        assert [(lk["path"], lk["stale"]) for lk in report["locks"]] == [(str(stale), True), (str(live), False)]
        assert report["ops"]["cpu_adam"]["cached"] is False

        assert main(["doctor", "--clear-stale-locks"]) == 0
        out = capsys.readouterr().out
        assert f"removed stale build lock {stale}" in out and "being built by process" in out
        assert not stale.exists() and live.exists()  # only the stale one goes
    finally:
        os.close(fd)


def test_runner_removes_a_stale_lock_and_announces_a_build(ext_dir, capsys):
    """prepare_ops before the process group: a lock no process holds (what a build killed mid-way
    leaves, here for every op incl. deepspeed_shm_comm) is removed with a line, never waited on; a
    build is announced with what, why and an estimate. The build itself is not run here (op_state
    says cached once the .so exists, as after a real build)."""
    from memkit.train.ops import needed_ops, prepare_ops

    plan = TrainingPlan(precision="bf16", zero_stage=2, offload_optimizer="cpu", seq_len=64)
    ds_config = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}
    assert ops_for(plan, ds_config) == ["cpu_adam"]
    assert ops_for(plan.with_(offload_optimizer="none"), ds_config) == ["fused_adam"]
    assert ops_for(plan, None) == []
    assert needed_ops(plan, ds_config) == ["cpu_adam", "deepspeed_shm_comm"]  # the CPU accelerator's collectives
    offload_file = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert needed_ops(TrainingPlan(seq_len=64), offload_file)[0] == "cpu_adam"  # a run from flags + this file
    (ext_dir / "deepspeed_shm_comm").mkdir()
    for name in ("cpu_adam", "fused_adam", "deepspeed_shm_comm"):
        (ext_dir / name / "lock").write_text("")  # left by a killed build: nobody has it open
    for name in ("cpu_adam", "deepspeed_shm_comm"):  # built already: prepare_ops only loads them
        (ext_dir / name / f"{name}.so").write_text("")
    built = []
    import memkit.train.ops as ops

    real_build, ops.build_op = ops.build_op, built.append
    try:
        assert prepare_ops(plan, ds_config) == ["cpu_adam", "deepspeed_shm_comm"]
    finally:
        ops.build_op = real_build
    err = capsys.readouterr().err.splitlines()
    removed = [line for line in err if "removed stale build lock" in line]
    assert len(removed) == 3 and all("no process has it open" in line for line in removed)
    assert not list(ext_dir.glob("*/lock"))
    assert built == ["cpu_adam", "deepspeed_shm_comm"]
    (ext_dir / "cpu_adam" / "cpu_adam.so").unlink()
    ops.build_op = built.append
    try:
        prepare_ops(plan, ds_config)
    finally:
        ops.build_op = real_build
    line = [x for x in capsys.readouterr().err.splitlines() if "building DeepSpeed cpu_adam" in x]
    assert len(line) == 1 and "optimizer offload" in line[0] and "min" in line[0], line
    assert f"cached in {ext_dir / 'cpu_adam'}" in line[0]


def test_extensions_root_is_per_install(monkeypatch, tmp_path):
    """Without TORCH_EXTENSIONS_DIR the root is torch's default folder name plus a digest of
    sys.prefix: another prefix (another venv) gets another folder."""
    import sys

    from memkit.train import ops

    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    mine = ops.install_extensions_root()
    assert mine.name.startswith(ops._default_root().name + "-") and mine.parent == ops._default_root().parent
    monkeypatch.setattr(sys, "prefix", str(tmp_path / "other-venv"))
    assert ops.install_extensions_root() != mine
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "mine"))
    assert ops.use_install_extensions_dir() == tmp_path / "mine"  # the user's choice wins
