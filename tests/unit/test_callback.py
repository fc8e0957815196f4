"""MemkitCallback in a real (tiny, CPU) Hugging Face Trainer run: one record per optimizer step,
measured peak next to memkit's prediction, written as JSON; and the public Python API."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

import memkit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import TINY_LLAMA  # noqa: E402

SEQ, MICRO, ACCUM, STEPS = 32, 2, 2, 3


def test_trainer_run_writes_measured_vs_predicted(tmp_path, monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    monkeypatch.setenv("MEMKIT_PROFILE", str(tmp_path / "profile.json"))  # never this machine's own profile

    cfg = dict(TINY_LLAMA)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    ids = torch.randint(0, 320, (MICRO * ACCUM * STEPS, SEQ), generator=torch.Generator().manual_seed(0))
    train_set = [{"input_ids": row, "labels": row} for row in ids]
    prediction = memkit.estimate(config, gpu="a100-80gb", device="cpu", precision="fp32", optimizer="adamw",
                                 micro_batch_size=MICRO, grad_accum=ACCUM, seq_len=SEQ, engine="torch")
    callback = memkit.MemkitCallback(tmp_path / "record.json", prediction=prediction, seq_len=SEQ)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=MICRO,
                             gradient_accumulation_steps=ACCUM, learning_rate=1e-3, report_to=[], use_cpu=True,
                             save_strategy="no", logging_steps=1, dataloader_num_workers=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=train_set, callbacks=[callback]).train()

    record = json.loads((tmp_path / "record.json").read_text())
    assert [s["step"] for s in record["steps"]] == [1, 2, 3]
    assert all(s["tokens"] == MICRO * ACCUM * SEQ for s in record["steps"])  # 1 process, padded count
    measured = record["measured"]
    assert measured["memory_kind"] == "live-tensors"
    num_params = sum(p.numel() for p in model.parameters())
    # At an AdamW step, fp32 weights, gradients and both moments are live: >= 16 bytes a parameter.
    assert measured["allocated_peak_bytes"] >= 16 * num_params
    assert record["predicted"]["allocated_peak_bytes"] == prediction.allocated_peak_bytes
    assert record["measured_over_predicted"]["allocated_peak_bytes"] == \
        measured["allocated_peak_bytes"] / prediction.allocated_peak_bytes
    assert measured["tokens_per_s"] > 0
    # memkit's CPU-priced estimate of this plan vs HF Trainer's measured live-tensor peak, at the
    # estimator's 5% tolerance (measured here: 2,702,768 vs 2,730,240 bytes, ratio 0.990).
    assert abs(record["measured_over_predicted"]["allocated_peak_bytes"] - 1) < 0.05


def test_trainer_run_feeds_the_local_profile_that_a_later_estimate_uses(tmp_path, monkeypatch, capsys):
    """profile=None: nothing is written while no local profile exists; profile=True: the run is
    appended (device 'cpu', this stack), and `memkit estimate --device cpu` of the same plan then
    takes its upper-bound margin from it."""
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from memkit import profile
    from memkit.cli.main import main
    from memkit.plan.plan import TrainingPlan

    monkeypatch.setenv(profile.ENV, str(tmp_path / "profile.json"))
    cfg = dict(TINY_LLAMA)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    plan = TrainingPlan(precision="fp32", optimizer="adamw", micro_batch_size=MICRO, grad_accum=ACCUM, seq_len=SEQ,
                        engine="torch")
    prediction = memkit.estimate(config, gpu="a100-80gb", device="cpu", plan=plan)
    ids = torch.randint(0, 320, (MICRO * ACCUM * STEPS, SEQ), generator=torch.Generator().manual_seed(0))
    train_set = [{"input_ids": row, "labels": row} for row in ids]
    records = []
    for feed in (None, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        callback = memkit.MemkitCallback(tmp_path / f"record-{feed}.json", prediction=prediction, plan=plan,
                                         seq_len=SEQ, profile=feed)
        args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=STEPS, per_device_train_batch_size=MICRO,
                                 gradient_accumulation_steps=ACCUM, learning_rate=1e-3, report_to=[], use_cpu=True,
                                 save_strategy="no", dataloader_num_workers=0, disable_tqdm=True)
        Trainer(model=model, args=args, train_dataset=train_set, callbacks=[callback]).train()
        records.append(json.loads((tmp_path / f"record-{feed}.json").read_text()))
    assert records[0]["profile"] == {"skipped": f"no local profile at {tmp_path / 'profile.json'} "
                                                "(profile=True creates it)"}
    assert records[1]["profile"] == {"path": str(tmp_path / "profile.json"), "device": "cpu", "runs": 1}
    (machine,) = json.loads((tmp_path / "profile.json").read_text())["machines"].values()
    (run,) = machine["runs"]
    measured = records[1]["measured"]["allocated_peak_bytes"]
    assert run["measured"] == {"allocated_peak_bytes": measured}
    assert run["predicted"]["allocated_peak_bytes"] == prediction.allocated_peak_bytes
    assert run["plan"] == plan.to_dict()

    capsys.readouterr()
    assert main(["estimate", "--model", str(tmp_path / "config.json"), "--device", "cpu", "--gpu", "a100-80gb",
                 "--precision", "fp32", "--optimizer", "adamw", "--micro-batch-size", str(MICRO), "--grad-accum",
                 str(ACCUM), "--seq-len", str(SEQ), "--engine", "torch", "--json"]) == 0
    later = json.loads(capsys.readouterr().out)
    assert later["upper_basis"] == "calibrated on 1 runs on this machine"
    margin = max(0.0, measured / prediction.allocated_peak_bytes - 1)
    assert later["allocated_peak_upper_bytes"] == int(later["allocated_peak_bytes"] * (1 + margin))


def test_api_estimate_and_suggest_match_the_library():
    from memkit.estimate.memory import estimate_memory
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec

    plan = TrainingPlan(precision="bf16", zero_stage=2, micro_batch_size=1, seq_len=2048, dp=8)
    direct = estimate_memory(load_model_spec("llama-3.1-8b"), plan,
                             Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=8))
    via_api = memkit.estimate("llama-3.1-8b", gpu="a100-80gb", num_gpus=8, precision="bf16", zero_stage=2,
                              micro_batch_size=1, seq_len=2048)
    assert via_api.allocated_peak_bytes == direct.allocated_peak_bytes
    assert callable(memkit.estimate) and memkit.estimate.memory.estimate_memory is estimate_memory
    result = memkit.suggest("llama-3.1-8b", gpu="a100-80gb", num_gpus=8, global_batch_size=64, seq_len=2048)
    chosen = result.chosen.plan
    assert chosen.micro_batch_size * chosen.grad_accum * chosen.dp == 64


def test_training_arguments_carry_the_plan(tmp_path):
    from memkit.plan.plan import TrainingPlan

    plan = TrainingPlan(precision="fp32", micro_batch_size=2, grad_accum=4, checkpointing="full", seq_len=64,
                        engine="torch")
    args = memkit.training_arguments(plan, output_dir=str(tmp_path), lr=3e-4, max_steps=5, use_cpu=True)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (2, 4)
    assert (args.learning_rate, args.max_steps, args.bf16, args.fp16) == (3e-4, 5, False, False)
    assert args.gradient_checkpointing and args.gradient_checkpointing_kwargs == {"use_reentrant": False}
    assert args.max_grad_norm == plan.gradient_clipping and args.deepspeed is None


def test_training_arguments_from_a_plan_json_use_the_deepspeed_file_beside_it(tmp_path):
    from runner_util import write_bundle

    from memkit.plan.plan import TrainingPlan

    plan = TrainingPlan(precision="fp32", zero_stage=2, micro_batch_size=1, grad_accum=2, seq_len=64, dp=2)
    _, plan_path = write_bundle(tmp_path / "bundle", plan)
    args = memkit.training_arguments(plan_path.parent, output_dir=str(tmp_path / "hf"))
    assert args.deepspeed == str((tmp_path / "bundle" / "ds_config.json").resolve())
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps) == (1, 2)
