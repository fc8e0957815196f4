"""The estimator against measured memory for each user loss path (--loss-path hf, ce-16bit, upcast:
memkit/plan/techniques.py LOSS_PATHS), on Llama (untied head) and Qwen2 (tied) with a 16k vocabulary,
fp32 / bf16 autocast / pure bf16, full and LoRA. tests/golden/cpu_measurements_loss_paths.json is
written by `python benchmarks/measure_cpu_loss_paths.py --out tests/golden/cpu_measurements_loss_paths.json`
(the paths' code: memkit/train/loss_paths.py). Same tolerance as tests/unit/test_estimate_measured.py.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from golden_rows import estimate_row, golden_rows  # tests/unit/golden_rows.py

from memkit.errors import MemkitError
from memkit.estimate.activations import loss_path_bytes
from memkit.plan import TrainingPlan

TOLERANCE = 0.05
ROWS = golden_rows("loss_paths")
_estimate = estimate_row


@pytest.mark.parametrize("row", ROWS, ids=[r["id"] for r in ROWS])
def test_loss_path_estimate_within_tolerance_of_measured_peak(row):
    est = _estimate(row)
    peak = row["measured"]["peak_bytes"]
    assert est.allocated_peak_bytes == pytest.approx(peak, rel=TOLERANCE), (
        f"{row['id']}: predicted {est.allocated_peak_bytes} ({est.peak_phase}) vs measured {peak}")
    assert est.num_trainable_params == row["num_trainable_params"]


def test_every_loss_path_is_measured_and_they_differ():
    peaks = {r["plan"].get("loss_path", "hf"): r["measured"]["peak_bytes"] for r in ROWS
             if r["arch"] == "llama-gqa-v16k" and r["plan"]["precision"] == "bf16-pure" and not r["plan"]["lora_rank"]}
    assert set(peaks) == {"hf", "ce-16bit", "upcast"}
    assert peaks["ce-16bit"] < peaks["hf"] < peaks["upcast"]


def test_loss_path_bytes_per_logit_element():
    # bf16-pure: hf saves fp32 log-probs; ce-16bit bf16 ones; upcast also holds the fp32 logits
    pure = TrainingPlan(engine="torch", precision="bf16-pure")
    assert loss_path_bytes(pure).saved == (4,)
    assert loss_path_bytes(pure.with_(loss_path="ce-16bit")).saved == (2,)
    assert loss_path_bytes(pure.with_(loss_path="upcast")).saved == (4, 4)
    # under autocast log_softmax runs in fp32: ce-16bit is priced as hf
    amp = TrainingPlan(engine="torch", precision="bf16")
    assert loss_path_bytes(amp.with_(loss_path="ce-16bit")) == loss_path_bytes(amp)


def test_loss_path_default_left_out_of_plan_json_and_read_back():
    plan = TrainingPlan(engine="torch")
    assert "loss_path" not in plan.to_dict()
    stated = plan.with_(loss_path="upcast")
    assert stated.to_dict()["loss_path"] == "upcast"
    assert TrainingPlan.from_dict(stated.to_dict()) == stated


def test_loss_path_on_a_classifier_is_refused():
    with pytest.raises(MemkitError, match="--loss-path ce-16bit with --task seq-cls"):
        TrainingPlan(task="seq-cls", loss_path="ce-16bit").validate()
    with pytest.raises(MemkitError, match="--loss-path .bogus. is not one of hf, ce-16bit, upcast"):
        TrainingPlan(loss_path="bogus").validate()


def test_trainer_recipe_records_the_loss_path():
    from memkit.emit.trainer import trainer_recipe

    assert trainer_recipe(TrainingPlan()).loss_path == "hf"
    assert trainer_recipe(TrainingPlan()).model_code == ()
    recipe = trainer_recipe(TrainingPlan(loss_path="ce-16bit"))
    assert recipe.loss_path == "ce-16bit"
    assert recipe.model_code == ("# loss priced as --loss-path ce-16bit: your compute_loss_func runs "
                                 "F.cross_entropy on the 16-bit logits (no .float())",)


def test_a_stated_upcast_or_chunked_output_loss_maps_to_its_loss_path():
    # the stack facts each held-out source states (framework, extras), mapped through --loss / --loss-path
    from memkit.calibrate.published_memory import cases_for_record

    repo = Path(__file__).resolve().parents[2]
    records = [json.loads(line) for line in (repo / "benchmarks" / "data" / "holdout_memory.jsonl").read_text()
               .splitlines() if line.strip()]
    paths = {}
    for record in records:
        for case in cases_for_record(record, configs_dir=repo / "benchmarks" / "calibration_configs"):
            paths[case.case_id.split("-")[0]] = paths.get(case.case_id.split("-")[0], set()) | {
                (case.plan.loss, case.plan.loss_path)}
    assert paths == {"peftmc": {("standard", "hf")}, "tt24": {("standard", "upcast")},
                     "tt24b": {("standard", "hf")},
                     # ms-swift and Qwen finetune.py: the Qwen-1 remote code's CrossEntropyLoss with labels
                     "swift": {("standard", "hf")}, "qwenft": {("standard", "hf")}}


def test_a_stated_loss_path_is_said_in_one_note():
    row = next(r for r in ROWS if r["plan"].get("loss_path") == "upcast")
    notes = [n for n in _estimate(row).notes if n.startswith("loss path")]
    assert notes == ["loss path upcast: your fp32 upcast of the logits, held until backward ends "
                     "(estimate/activations.py loss_path_bytes)"]
    hf = next(r for r in ROWS if "loss_path" not in r["plan"])
    assert not [n for n in _estimate(hf).notes if n.startswith("loss path")]
