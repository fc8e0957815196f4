"""PYTORCH_CUDA_ALLOC_CONF: what the runner sets, what bundles and launch scripts export, and the
one line when a user's setting differs (the fixed-shape estimate prices default segments;
estimate --lengths/--data price both, tests/unit/test_varlen.py)."""
from __future__ import annotations

from memkit.cli.estimate import alloc_conf_note
from memkit.emit.bundle import alloc_conf_lines
from memkit.plan.plan import TrainingPlan
from memkit.train.main import ALLOC_CONF, set_alloc_conf


def test_runner_sets_expandable_segments_unless_the_user_did():
    env: dict[str, str] = {}
    assert set_alloc_conf(env) == "" and env["PYTORCH_CUDA_ALLOC_CONF"] == ALLOC_CONF == "expandable_segments:True"
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}
    note = set_alloc_conf(mine)
    assert mine["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128"  # kept
    assert "max_split_size_mb:128" in note and "expandable_segments:True" in note and "\n" not in note
    same = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True,max_split_size_mb:512"}
    assert set_alloc_conf(same) == ""


def test_one_line_when_the_shell_setting_differs_from_the_priced_one():
    assert alloc_conf_note({}) == ""
    assert alloc_conf_note({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64"}) == ""
    line = alloc_conf_note({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"})
    assert "default segments" in line and "\n" not in line


def test_bundle_readme_exports_it():
    lines = "\n".join(alloc_conf_lines(TrainingPlan().to_dict()))
    assert "export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in lines
