"""One declaration per knob (memkit/plan/plan.py): the flags of estimate, suggest, the runner and the
split harness, the planner Request's knob fields and the validation all come from TrainingPlan's
fields; and the knob added on top of them, --lora-alpha / --lora-dropout, is priced (dropout only),
recorded in plan.json and emitted to adapter_config.json and the Trainer recipe."""
from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from memkit.cli.main import main
from memkit.errors import MemkitError
from memkit.plan.plan import (BF16_PURE_ZERO_ERROR, TrainingPlan, add_knob_flags, flag_name, knob_choices, knob_fields,
                              knob_values)


def _parser(command: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    add_knob_flags(p, command)
    return p


@pytest.mark.parametrize("command", ["estimate", "pin", "workload", "run", "launch"])
def test_every_declared_knob_is_a_flag_with_its_declared_choices(command):
    actions = {a.dest: a for a in _parser(command)._actions}
    for f in knob_fields(command):
        spec = f.metadata["cli"][command]
        flag = (spec.get("flag") if isinstance(spec, dict) else None) or flag_name(f)
        action = actions[flag[2:].replace("-", "_")]
        assert flag in action.option_strings
        declared = spec["choices"] if isinstance(spec, dict) and "choices" in spec else knob_choices(f)
        if action.choices is not None:  # a choice flag offers exactly the declared choices
            assert tuple(action.choices) == tuple(declared)


def test_flags_read_back_into_a_plan_equal_to_the_defaults():
    """estimate's flags, not given, are TrainingPlan's defaults (engine aside: chosen from the base)."""
    values = knob_values(_parser("estimate").parse_args([]), "estimate")
    values.pop("engine")
    values.pop("lora_targets")
    assert TrainingPlan(**values) == TrainingPlan()


def test_pins_not_given_are_none_and_given_ones_are_typed():
    pins = knob_values(_parser("pin").parse_args([]), "pin")
    assert {k for k, v in pins.items() if v is not None} == set()
    pins = knob_values(_parser("pin").parse_args(["--zero", "2", "--no-double-quant", "--optimizer-in-backward"]), "pin")
    assert (pins["zero_stage"], pins["double_quant"], pins["optimizer_in_backward"]) == (2, False, True)


def test_request_derives_its_knob_fields_from_the_plan():
    from memkit.planner.space import Request

    req = {f.name: f for f in dataclasses.fields(Request)}
    plan = {f.name: f for f in dataclasses.fields(TrainingPlan)}
    for f in knob_fields("pin"):
        assert req[f.name].default == (plan[f.name].default if f.type == "bool" else None), f.name
    for f in knob_fields("workload"):
        assert req[f.name].default == plan[f.name].default, f.name


def test_declared_choice_and_range_checks():
    with pytest.raises(MemkitError, match=r"--precision 'fp8' is not one of fp32, fp16, bf16, bf16-pure"):
        TrainingPlan(precision="fp8").validate()
    with pytest.raises(MemkitError, match=r"--zero 4 is not a ZeRO stage; use 0, 1, 2 or 3"):
        TrainingPlan(zero_stage=4).validate()
    with pytest.raises(MemkitError, match=r"--lora-rank -1 must be >= 0 \(0 = full fine-tuning\)"):
        TrainingPlan(lora_rank=-1).validate()
    with pytest.raises(MemkitError, match=r"--lora-dropout 1.5 must be between 0.0 and 0.99"):
        TrainingPlan(lora_dropout=1.5).validate()


def test_bf16_pure_zero_rule_is_a_plan_rule():
    with pytest.raises(MemkitError, match="bf16-pure with --zero 0"):
        TrainingPlan(precision="bf16-pure", zero_stage=0).validate()
    assert BF16_PURE_ZERO_ERROR.startswith("--precision bf16-pure with --zero 0")
    TrainingPlan(precision="bf16-pure", zero_stage=1).validate()
    TrainingPlan(precision="bf16-pure", engine="torch").validate()  # plain PyTorch keeps bf16 weights itself


# ---- the knob added on top: --lora-alpha / --lora-dropout ----------------------------------------

TINY = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512}
LORA = TrainingPlan(engine="torch", precision="fp32", attention="sdpa", micro_batch_size=4, seq_len=128,
                    lora_rank=8, lora_targets=("q_proj", "v_proj", "up_proj"))


def _estimate(argv, capsys) -> dict:
    assert main(["estimate", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--lora-rank", "16", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_alpha_changes_no_memory_and_is_recorded(capsys):
    base, scaled = _estimate([], capsys), _estimate(["--lora-alpha", "64"], capsys)
    assert (base["plan"]["lora_alpha"], scaled["plan"]["lora_alpha"]) == (16, 64)
    assert base["allocated_peak_bytes"] == scaled["allocated_peak_bytes"]
    assert base["components"] == scaled["components"]


def test_dropout_zero_drops_exactly_the_mask_and_copy(capsys):
    """peft/tuners/lora/layer.py, Linear.forward: lora_B(lora_A(dropout(x))); nn.Dropout (p > 0)
    saves a bool mask (1 byte/element) and lora_A then saves the dropped copy (the adapter dtype:
    fp32 under peft's autocast_adapter_dtype) instead of the input it shares with the base."""
    with_dropout, without = _estimate([], capsys), _estimate(["--lora-dropout", "0"], capsys)
    assert without["plan"]["lora_dropout"] == 0.0
    assert without["allocated_peak_bytes"] < with_dropout["allocated_peak_bytes"]
    assert _estimate(["--lora-dropout", "0.3"], capsys)["allocated_peak_bytes"] == with_dropout["allocated_peak_bytes"]


def test_dropout_priced_within_tolerance_of_a_real_peft_step():
    """The estimate with and without LoRA dropout against a measured CPU step of a real peft LoRA
    model (memkit's LiveTensorTracker, calibrate/cpu_step.py): each peak within the estimator's
    stated 5%, and dropout > 0 costs memory in both."""
    from memkit.estimate.memory import estimate_memory
    from memkit.calibrate.cpu_step import measure_training
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    spec = spec_from_config(TINY, name="tiny-llama")
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1)
    measured, estimated = {}, {}
    for p in (0.0, 0.1):
        plan = LORA.with_(lora_dropout=p)
        measured[p] = measure_training(TINY, plan, num_steps=2)["peak_bytes"]
        estimated[p] = estimate_memory(spec, plan, hardware, device="cpu").allocated_peak_bytes
        assert estimated[p] == pytest.approx(measured[p], rel=0.05), (p, estimated[p], measured[p])
    assert measured[0.1] > measured[0.0] and estimated[0.1] > estimated[0.0]


def test_suggest_records_alpha_and_dropout_and_emits_them(tmp_path, capsys):
    from peft import LoraConfig

    from memkit.emit.trainer import trainer_recipe

    out = tmp_path / "bundle"
    assert main(["suggest", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--global-batch-size", "8",
                 "--lora-rank", "16", "--lora-alpha", "32", "--lora-dropout", "0.1", "--out", str(out)]) == 0
    capsys.readouterr()
    doc = json.loads((out / "plan.json").read_text())
    assert (doc["plan"]["lora_alpha"], doc["plan"]["lora_dropout"]) == (32, 0.1)
    assert (doc["request"]["lora_alpha"], doc["request"]["lora_dropout"]) == (32, 0.1)
    for alt in doc["alternatives"]:
        assert (alt["plan"]["lora_alpha"], alt["plan"]["lora_dropout"]) == (32, 0.1)
    config = LoraConfig.from_pretrained(str(out))  # the real peft reads the bundle's adapter_config.json
    assert (config.r, config.lora_alpha, config.lora_dropout) == (16, 32, 0.1)
    recipe = trainer_recipe(TrainingPlan.from_dict(doc["plan"]))
    assert (recipe.peft_config["lora_alpha"], recipe.peft_config["lora_dropout"]) == (32, 0.1)


def test_default_alpha_and_dropout_leave_the_request_as_before(capsys):
    assert main(["suggest", "--model", "llama-2-7b", "--gpu", "a100-80gb", "--global-batch-size", "8",
                 "--lora-rank", "16", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert "lora_alpha" not in doc["request"] and "lora_dropout" not in doc["request"]
    assert (doc["plan"]["lora_alpha"], doc["plan"]["lora_dropout"]) == (16, 0.05)


def test_suggest_pins_are_the_declared_valued_pin_knobs_in_their_listed_order():
    """PIN_FLAGS (planner/space.py) comes from the declarations: every "pin" knob that takes a value,
    by its flag, in declaration order but --quantize-base right after --loss (its "lists_after"),
    the order plan.json's pins were always shown in (cli/explain.py pin_words)."""
    from memkit.plan.plan import pin_flags
    from memkit.planner.space import PIN_FLAGS

    valued = [f.name for f in knob_fields("pin") if f.type != "bool"]
    assert sorted(PIN_FLAGS) == sorted(valued) and PIN_FLAGS == pin_flags()
    assert list(PIN_FLAGS.items()) == [
        ("precision", "--precision"), ("optimizer", "--optimizer"), ("zero_stage", "--zero"),
        ("offload_optimizer", "--offload-optimizer"), ("offload_params", "--offload-params"),
        ("checkpointing", "--checkpointing"), ("loss", "--loss"), ("quantize_base", "--quantize-base"),
        ("offload_activations", "--offload-activations"), ("tp", "--tp"), ("pp", "--pp")]


def test_trainer_arguments_take_the_declared_knobs_as_they_are():
    """The knobs declared with trainer= lead TrainingArguments, in declaration order, with the plan's values."""
    from memkit.emit.trainer import trainer_arguments
    from memkit.plan.plan import trainer_knobs

    plan = TrainingPlan(micro_batch_size=3, grad_accum=5, gradient_clipping=0.25)
    assert trainer_knobs(plan) == {"per_device_train_batch_size": 3, "gradient_accumulation_steps": 5,
                                   "max_grad_norm": 0.25}
    assert list(trainer_arguments(plan).items())[:3] == list(trainer_knobs(plan).items())


def test_trainer_flags_follow_the_declared_rules():
    """The TrainingArguments a knob's value sets (trainer={field: rule}): --bf16 for bf16 and bf16-pure,
    --optim by name, --gradient_checkpointing for full only, use_liger_kernel written for the fused loss only."""
    from memkit.emit.trainer import trainer_arguments
    from memkit.plan.plan import trainer_flags

    plan = TrainingPlan(precision="bf16-pure", optimizer="adamw-8bit", checkpointing="full", loss="fused")
    assert trainer_flags(plan) == {"bf16": True, "fp16": False, "optim": "adamw_bnb_8bit",
                                   "gradient_checkpointing": True, "use_liger_kernel": True}
    plain = TrainingPlan(precision="fp16", checkpointing="4")
    assert trainer_flags(plain) == {"bf16": False, "fp16": True, "optim": "adamw_torch",
                                    "gradient_checkpointing": False}
    assert list(trainer_arguments(plan))[-6:] == ["bf16", "fp16", "optim", "gradient_checkpointing",
                                                  "use_liger_kernel", "gradient_checkpointing_kwargs"]
