"""The local calibration profile: a measured CPU run is recorded, a later estimate for the same
device and stack takes its margin from it; `memkit calibrate` shows, exports and resets it."""
from __future__ import annotations

import json

import pytest

from memkit import profile
from memkit.estimate.memory import estimate_memory, with_upper_bounds
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import spec_from_config
from memkit.spec.stack import installed

pytest.importorskip("torch")

CONFIG = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
          "max_position_embeddings": 256, "tie_word_embeddings": False}


def test_measured_run_calibrates_the_next_estimate(tmp_path, monkeypatch, capsys):
    from memkit.cli.main import main
    from memkit.calibrate.cpu_step import measure_training

    monkeypatch.setenv(profile.ENV, str(tmp_path / "profile.json"))
    plan = TrainingPlan(precision="fp32", engine="torch", micro_batch_size=2, seq_len=64, attention="sdpa")
    spec = spec_from_config(CONFIG, name="tiny")
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    before = estimate_memory(spec, plan, hw, device="cpu")
    measured = measure_training(CONFIG, plan, num_steps=2)
    stack = installed()
    n = profile.record_run(device="cpu", stack=stack, plan=plan, predicted=before.to_dict(),
                           measured={"allocated_peak_bytes": measured["peak_bytes"]})
    assert n == 1
    table, runs = profile.margins("cpu", stack)
    expected = measured["peak_bytes"] / before.allocated_peak_bytes - 1
    assert runs == 1 and table["all"] == pytest.approx(expected)
    after = with_upper_bounds(estimate_memory(spec, plan, hw, device="cpu"), plan, device="cpu", table=table,
                              basis=f"calibrated on {runs} runs on this machine")
    assert after.upper_basis == "calibrated on 1 runs on this machine"
    assert after.allocated_peak_upper_bytes == int(after.allocated_peak_bytes * (1 + max(0.0, expected)))
    # another stack is another key: nothing recorded for it
    assert profile.margins("cpu", stack.__class__(torch="1.0"))[1] == 0

    assert main(["calibrate", "--show"]) == 0
    assert "cpu|" in capsys.readouterr().out
    out = tmp_path / "export.json"
    assert main(["calibrate", "--export", str(out)]) == 0
    assert len(next(iter(json.loads(out.read_text())["machines"].values()))["runs"]) == 1
    assert main(["calibrate", "--reset"]) == 0
    assert profile.margins("cpu", stack) == ({}, 0)


def test_unreadable_profile_is_one_clear_error(tmp_path, monkeypatch):
    from memkit.errors import MemkitError

    bad = tmp_path / "profile.json"
    bad.write_text("{not json")
    monkeypatch.setenv(profile.ENV, str(bad))
    with pytest.raises(MemkitError, match="calibrate --reset"):
        profile.load()
