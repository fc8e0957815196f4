"""TRL's SFTTrainer with memkit's plan (#24), on CPU: `memkit.training_arguments(plan.json,
for_="trl")` is a trl.SFTConfig carrying the plan's batch, accumulation, clipping and length, and
on a machine without CUDA it says it is a CPU smoke test; `MemkitCallback(plan_json=...)`
compares the run with the plan priced again for the CPU (not the GPU figures in plan.json),
prints measured vs predicted at the first steps, and warns above the upper bound."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import memkit

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import TINY_LLAMA  # noqa: E402

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU smoke-test path")

SEQ, MICRO, ACCUM, STEPS = 32, 2, 2, 3


def _plan_json(folder: Path, plan) -> Path:
    """plan.json as `memkit suggest --out` writes it: the estimate priced for the plan's GPU."""
    from memkit.emit.bundle import plan_document
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    spec = spec_from_config(dict(TINY_LLAMA), name="tiny-llama")
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1)
    doc = plan_document(model_name="tiny-llama", plan=plan, hardware={"gpu": "a100-80gb", "num_gpus_per_node": 1,
                                                                      "num_nodes": 1},
                        memory=estimate_memory(spec, plan, hardware), speed=estimate_step_time(spec, plan, hardware),
                        label="test")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "plan.json").write_text(json.dumps(doc, indent=1))
    return folder / "plan.json"


def _model():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(TINY_LLAMA)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)


def _rows(n: int):
    ids = torch.randint(0, 320, (n, SEQ), generator=torch.Generator().manual_seed(0))
    from datasets import Dataset

    return Dataset.from_dict({"input_ids": [row.tolist() for row in ids]})


def test_sft_trainer_with_the_plan_and_the_callback(tmp_path, monkeypatch, capsys):
    from trl import SFTConfig, SFTTrainer

    from memkit.estimate.memory import estimate_memory
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    monkeypatch.setenv("MEMKIT_PROFILE", str(tmp_path / "profile.json"))  # never this machine's profile
    plan = TrainingPlan(precision="bf16", micro_batch_size=MICRO, grad_accum=ACCUM, seq_len=SEQ, engine="torch")
    plan_json = _plan_json(tmp_path / "bundle", plan)
    with pytest.warns(UserWarning, match=r"no CUDA GPU here, so these arguments are a CPU smoke test of the plan "
                                         r"\(use_cpu=True, bf16=False, fp16=False\)"):
        args = memkit.training_arguments(plan_json, output_dir=str(tmp_path / "sft"), for_="trl", lr=1e-3,
                                         max_steps=STEPS, report_to=[], save_strategy="no", logging_steps=1,
                                         dataloader_num_workers=0, disable_tqdm=True)
    assert isinstance(args, SFTConfig)
    assert (args.per_device_train_batch_size, args.gradient_accumulation_steps, args.max_length) == (MICRO, ACCUM, SEQ)
    assert args.use_cpu and not args.bf16 and args.max_grad_norm == plan.gradient_clipping
    callback = memkit.MemkitCallback(tmp_path / "record.json", plan_json=plan_json, seq_len=SEQ)
    model = _model()
    from memkit.train.tokenizer import byte_tokenizer  # memkit's offline byte-level BPE (no download)

    trainer = SFTTrainer(model=model, args=args, train_dataset=_rows(MICRO * ACCUM * STEPS),
                         processing_class=byte_tokenizer(), callbacks=[callback])
    trainer.train()

    record = json.loads((tmp_path / "record.json").read_text())
    assert [s["step"] for s in record["steps"]] == [1, 2, 3]
    cpu = estimate_memory(spec_from_config(dict(TINY_LLAMA), name="tiny-llama"), plan,
                          Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1), device="cpu")
    gpu = json.loads(plan_json.read_text())["estimate"]["allocated_peak_bytes"]
    assert record["predicted_memory_for"] == "cpu"
    assert record["predicted"]["allocated_peak_bytes"] == cpu.allocated_peak_bytes != gpu  # like with like
    measured = record["measured"]["allocated_peak_bytes"]
    assert record["measured_over_predicted"]["allocated_peak_bytes"] == measured / cpu.allocated_peak_bytes
    said = [line for line in capsys.readouterr().err.splitlines() if line.startswith("memkit: step ")]
    assert [line.split(":")[1].strip() for line in said] == ["step 1", "step 2", "step 3"]
    assert all("predicted" in line and "tokens/s" in line for line in said)


def test_callback_warns_when_the_measured_peak_is_above_the_upper_bound(tmp_path, monkeypatch, capsys):
    from transformers import Trainer, TrainingArguments

    monkeypatch.setenv("MEMKIT_PROFILE", str(tmp_path / "profile.json"))
    bound = 1024  # bytes: far below any real step's live tensors
    callback = memkit.MemkitCallback(tmp_path / "record.json", prediction={
        "allocated_peak_bytes": bound, "allocated_peak_upper_bytes": bound}, seq_len=SEQ, log_steps=1)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=2, per_device_train_batch_size=MICRO,
                             report_to=[], use_cpu=True, save_strategy="no", dataloader_num_workers=0,
                             disable_tqdm=True)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 320, (2 * MICRO, SEQ))]
    Trainer(model=_model(), args=args, train_dataset=rows, callbacks=[callback]).train()
    err = capsys.readouterr().err
    warned = [line for line in err.splitlines() if "WARNING" in line]
    assert len(warned) == 1 and warned[0].startswith("memkit: WARNING: step 1 measured peak")  # first steps only
    assert "above the prediction's upper bound 1.00 KiB" in warned[0]
    assert json.loads((tmp_path / "record.json").read_text())["warnings"] == warned
