"""Stale DeepSpeed build locks (a compile killed mid-way): found by `memkit doctor`, removed with
--clear-stale-locks, and refused by the runner before it would wait on them forever."""
from __future__ import annotations

import json
import os

import pytest

from memkit.cli.main import main
from memkit.errors import MemkitError
from memkit.plan import TrainingPlan
from memkit.train.ops import announce_builds, find_locks, ops_for


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


def test_runner_refuses_a_stale_lock_and_announces_a_build(ext_dir, capsys):
    plan = TrainingPlan(precision="bf16", zero_stage=2, offload_optimizer="cpu", seq_len=64)
    ds_config = {"optimizer": {"type": "AdamW"}, "zero_optimization": {"stage": 2}}
    assert ops_for(plan, ds_config) == ["cpu_adam"]
    assert ops_for(plan.with_(offload_optimizer="none"), ds_config) == ["fused_adam"]
    assert ops_for(plan, None) == []
    announce_builds(plan, ds_config)
    assert f"building DeepSpeed cpu_adam (first use, ~1 min), cached in {ext_dir / 'cpu_adam'}" in \
        capsys.readouterr().err
    (ext_dir / "cpu_adam" / "lock").write_text("")
    with pytest.raises(MemkitError, match=r"stale build lock .*cpu_adam/lock .* memkit doctor --clear-stale-locks"):
        announce_builds(plan, ds_config)
