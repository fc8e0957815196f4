"""The HF Trainer path runs the plan that was priced (issue #8).

For a matrix of bundles (checkpointing, LoRA, 8-bit AdamW, Adafactor, SGD, the attention kernels,
ZeRO 0-3, CPU offload, every precision), the test reads what the bundle README prints - the
TrainingArguments flags, the from_pretrained call, the peft line - and does what a user's Trainer
script does with them: HfArgumentParser(TrainingArguments) on the flags (with the emitted
ds_config.json), the tiny model loaded with the printed kwargs and wrapped by the printed peft
config. Then it reads back, from transformers / DeepSpeed / peft objects only, what Trainer would
run: activation checkpointing, the optimizer (DeepSpeed's block or Trainer's own --optim), the
attention implementation, the adapters (r, alpha, dropout, targets, trainable parameters), ZeRO
stage and offload, precision, micro batch, accumulation and sequence length. That plan must equal
the priced plan knob by knob (0 mismatches) and the estimator must price it the same.

transformers' DeepSpeed config parsing needs a process group, so the checks run in one
subprocess (a gloo group of one rank), as in test_emit.py.
"""
from __future__ import annotations

import ast
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from memkit.plan.plan import TrainingPlan

TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128,
        "max_position_embeddings": 256, "tie_word_embeddings": False}

# name -> plan knobs (one GPU: Trainer in this one process counts a world of one)
MATRIX = {
    "z0-bf16-sdpa": dict(zero_stage=0, precision="bf16"),
    "z0-fp32-eager-ckpt": dict(zero_stage=0, precision="fp32", attention="eager", checkpointing="full"),
    "z0-fp16-sgd": dict(zero_stage=0, precision="fp16", optimizer="sgd"),
    "z0-bf16-flash-lora": dict(zero_stage=0, attention="flash", lora_rank=8),
    "z1-bf16-adamw8bit-ckpt": dict(zero_stage=1, optimizer="adamw-8bit", checkpointing="full"),
    "z1-bf16-offload": dict(zero_stage=1, offload_optimizer="cpu"),
    "z1-bf16pure": dict(zero_stage=1, precision="bf16-pure"),
    "z2-bf16-adafactor-eager": dict(zero_stage=2, optimizer="adafactor", attention="eager"),
    "z2-fp16-ckpt-lora": dict(zero_stage=2, precision="fp16", checkpointing="full", lora_rank=8),
    "z2-bf16-lora16-qkvo-adamw8bit": dict(zero_stage=2, lora_rank=16, optimizer="adamw-8bit",
                                          lora_targets=("q_proj", "k_proj", "v_proj", "o_proj")),
    "z2-bf16-flash": dict(zero_stage=2, attention="flash"),
    "z3-bf16-ckpt": dict(zero_stage=3, checkpointing="full"),
    "z3-bf16-offload-all-lora": dict(zero_stage=3, offload_optimizer="cpu", offload_params="cpu", lora_rank=4),
    "z3-bf16pure-adafactor": dict(zero_stage=3, precision="bf16-pure", optimizer="adafactor"),
    "z3-fp32-sgd-eager": dict(zero_stage=3, precision="fp32", optimizer="sgd", attention="eager"),
}
KNOBS = ("precision", "optimizer", "zero_stage", "offload_optimizer", "offload_params", "checkpointing",
         "attention", "micro_batch_size", "grad_accum", "seq_len", "lora_rank", "lora_alpha", "lora_dropout",
         "lora_targets")


def _plan(knobs: dict) -> TrainingPlan:
    return TrainingPlan(micro_batch_size=2, grad_accum=3, seq_len=128, dp=1, **knobs).validate()


@pytest.fixture(scope="module")
def bundles(tmp_path_factory) -> dict[str, Path]:
    from memkit.emit import plan_doc
    from memkit.emit.bundle import bundle_files, write_bundle
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.planner.space import describe
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    root = tmp_path_factory.mktemp("fidelity")
    model_dir = root / "tiny-llama"
    _save_tiny_model(model_dir)
    spec = spec_from_config(TINY, name=str(model_dir))
    hardware = Hardware(gpu=find_gpu("a100-80gb"))
    out = {}
    for name, knobs in MATRIX.items():
        plan = _plan(knobs)
        doc = plan_doc.plan_document(model_name=str(model_dir), plan=plan, hardware=plan_doc.hardware_dict(hardware),
                                     memory=estimate_memory(spec, plan, hardware),
                                     speed=estimate_step_time(spec, plan, hardware), label=describe(plan),
                                     version_info={"memkit": "test"})
        folder = root / name
        write_bundle(str(folder), bundle_files(doc, out_dir=str(folder)))
        out[name] = folder
    return out


def _save_tiny_model(folder: Path) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**TINY)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))


@pytest.fixture(scope="module")
def ran(bundles) -> dict[str, dict]:
    """Each bundle's README through transformers, DeepSpeed's parser as Trainer hands it over, and peft."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, __file__, *map(str, bundles.values())], capture_output=True,
                          text=True, timeout=600, env=env)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(lines) == len(bundles), proc.stdout[-3000:] + proc.stderr[-3000:]
    return {Path(r["dir"]).name: r for r in map(json.loads, lines)}


@pytest.mark.parametrize("name", list(MATRIX))
def test_trainer_runs_the_priced_plan_knob_by_knob(name, ran):
    plan = _plan(MATRIX[name])
    result = ran[name]
    assert result.get("error") is None, result.get("error")
    trainer = result["trainer_plan"]
    priced = plan.to_dict()
    mismatches = [f"{k}: priced {priced[k]!r}, Trainer runs {trainer.get(k)!r}" for k in KNOBS
                  if (list(trainer.get(k)) if k == "lora_targets" else trainer.get(k)) !=
                  (sorted(priced[k]) if k == "lora_targets" else priced[k])]
    assert mismatches == []
    assert result["trainer_mismatches"] == []  # transformers' own check of flags vs ds_config.json


def test_the_estimator_prices_what_trainer_runs_as_planned(ran):
    """The plan rebuilt from what Trainer runs is priced exactly as the planned one; a LoRA model's
    trainable parameters (counted by peft) are the estimator's adapter count."""
    from memkit.estimate.memory import estimate_memory
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    spec = spec_from_config(TINY, name="tiny")
    hardware = Hardware(gpu=find_gpu("a100-80gb"))
    mismatches = 0
    for name, knobs in MATRIX.items():
        plan = _plan(knobs)
        trainer = dict(ran[name]["trainer_plan"])
        trainer["lora_targets"] = tuple(t for t in plan.lora_targets if t in trainer["lora_targets"]) \
            if set(trainer["lora_targets"]) == set(plan.lora_targets) else tuple(trainer["lora_targets"])
        rebuilt = plan.with_(**{k: trainer[k] for k in KNOBS})
        mismatches += estimate_memory(spec, rebuilt, hardware) != estimate_memory(spec, plan, hardware)
        if plan.is_lora:
            assert ran[name]["trainable_params"] == spec.lora_params(plan.lora_rank, plan.lora_targets), name
    assert mismatches == 0


def test_readme_names_the_flags_the_issue_found_missing(bundles):
    text = (bundles["z1-bf16-adamw8bit-ckpt"] / "README.md").read_text()
    assert "--gradient_checkpointing True" in text and "--optim adamw_bnb_8bit" in text
    assert "--optim adafactor" in (bundles["z2-bf16-adafactor-eager"] / "README.md").read_text()
    lora = (bundles["z2-fp16-ckpt-lora"] / "README.md").read_text()
    assert "LoraConfig.from_pretrained(" in lora and (bundles["z2-fp16-ckpt-lora"] / "adapter_config.json").is_file()
    assert "attn_implementation='flash_attention_2'" in (bundles["z2-bf16-flash"] / "README.md").read_text()


# ---- the user's side, run as a subprocess by the `ran` fixture ------------------------------------

def read_readme(folder: Path) -> dict:
    """What a user copies from the README: the flags, the from_pretrained call, the peft line, the length."""
    text = (folder / "README.md").read_text()
    section = text[text.index("With Hugging Face Trainer instead"):]
    blocks = re.findall(r"```(?:python)?\n(.*?)```", section, flags=re.S)
    flags = shlex.split(blocks[0])
    calls = {}
    for node in ast.walk(ast.parse(blocks[1])):
        if isinstance(node, ast.Call):
            func = node.func
            name = f"{func.value.id}.{func.attr}" if isinstance(func, ast.Attribute) else func.id
            calls.setdefault(name, node)
    load = calls["AutoModelForCausalLM.from_pretrained"]
    peft_call = calls.get("get_peft_model")
    return {
        "flags": flags,
        "checkpoint": ast.literal_eval(load.args[0]),
        "model_kwargs": {kw.arg: ast.literal_eval(kw.value) for kw in load.keywords},
        "peft_dir": ast.literal_eval(peft_call.args[1].args[0]) if peft_call is not None else None,
        "max_length": int(re.search(r"data to (\d+) tokens per sequence", section).group(1)),
    }


def what_trainer_runs(folder: Path) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

    got = read_readme(folder)
    (args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        got["flags"] + ["--output_dir", str(folder / "trainer"), "--report_to", "none", "--use_cpu", "True"])
    hf = args.hf_deepspeed_config  # what Trainer hands DeepSpeed (transformers integrations/deepspeed.py)
    out: dict = {"dir": str(folder), "trainer_mismatches": list(hf.mismatches)}
    attention = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash"}
    try:
        model = AutoModelForCausalLM.from_pretrained(got["checkpoint"], **got["model_kwargs"])
        out["attention"] = attention[model.config._attn_implementation]
    except ImportError as exc:  # flash-attn is not installed here: the kwarg reached that kernel
        if "flash" not in str(exc).lower() or got["model_kwargs"]["attn_implementation"] != "flash_attention_2":
            raise
        out["attention"] = "flash"
        model = AutoModelForCausalLM.from_pretrained(got["checkpoint"], attn_implementation="eager")
    if got["peft_dir"] is not None:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig.from_pretrained(got["peft_dir"])
        model = get_peft_model(model, lora)
        out.update(lora_rank=lora.r, lora_alpha=lora.lora_alpha, lora_dropout=lora.lora_dropout,
                   lora_targets=sorted(lora.target_modules))
        out["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
    else:
        out.update(lora_rank=0, lora_alpha=16, lora_dropout=0.05, lora_targets=["q_proj", "v_proj"])
    hf.trainer_config_finalize(args, model, 10)  # raises on any flag that disagrees with the file
    ds = hf.config
    zero = ds.get("zero_optimization") or {}
    bf16 = ds.get("bf16") or {}
    if (ds.get("fp16") or {}).get("enabled"):
        precision = "fp16"
    elif bf16.get("enabled"):
        precision = "bf16-pure" if bf16.get("bf16_master_weights_and_grads") else "bf16"
    else:
        precision = "fp32"
    assert args.bf16 == precision.startswith("bf16") and args.fp16 == (precision == "fp16")
    if "optimizer" in ds:  # DeepSpeed builds it (transformers deepspeed_optim_sched)
        optimizer = {"AdamW": "adamw", "Adam": "adamw", "SGD": "sgd"}[ds["optimizer"]["type"]]
    else:  # Trainer builds --optim and hands it to DeepSpeed
        cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
        optimizer = {"AdamW": "adamw-8bit" if kwargs.get("optim_bits") == 8 else "adamw",
                     "Adafactor": "adafactor", "SGD": "sgd"}[cls.__name__]
    checkpointing = bool(getattr(args, "activation_checkpointing", args.gradient_checkpointing))
    if checkpointing:  # as Trainer does it (transformers trainer.py, "Activate activation checkpointing")
        kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs
        assert kwargs == {"use_reentrant": False}, kwargs
        base = model.get_base_model() if hasattr(model, "get_base_model") else model
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        checkpointing = bool(base.is_gradient_checkpointing)
    out["trainer_plan"] = {
        "precision": precision, "optimizer": optimizer, "zero_stage": int(zero.get("stage", 0)),
        "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none"),
        "offload_params": (zero.get("offload_param") or {}).get("device", "none"),
        "checkpointing": "full" if checkpointing else "none", "attention": out.pop("attention"),
        "micro_batch_size": ds["train_micro_batch_size_per_gpu"], "grad_accum": ds["gradient_accumulation_steps"],
        "seq_len": got["max_length"],
        **{k: out.pop(k) for k in ("lora_rank", "lora_alpha", "lora_dropout", "lora_targets")},
    }
    assert args.per_device_train_batch_size == ds["train_micro_batch_size_per_gpu"]
    assert args.gradient_accumulation_steps == ds["gradient_accumulation_steps"]
    del torch
    return out


def _main(folders: list[str]) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0",
                       "LOCAL_WORLD_SIZE": "1"})
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        os.environ["MASTER_PORT"] = str(sock.getsockname()[1])
    import deepspeed
    import torch.distributed as dist

    deepspeed.init_distributed(dist_backend="gloo")
    try:
        for folder in folders:
            try:
                result = what_trainer_runs(Path(folder))
            except Exception as exc:  # report, the test asserts
                result = {"dir": folder, "error": f"{type(exc).__name__}: {exc}"}
            print(json.dumps(result), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _main(sys.argv[1:])
