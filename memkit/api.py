"""memkit's Python API for your own scripts: thin wrappers over the library the CLI uses.

    import memkit

    est = memkit.estimate("llama-3.1-8b", gpu="a100-80gb", precision="bf16", zero_stage=2,
                          micro_batch_size=4, seq_len=2048, num_gpus=8)
    est.allocated_peak_bytes, est.to_dict()          # what `memkit estimate --json` prints

    result = memkit.suggest("llama-3.1-8b", gpu="a100-80gb", num_gpus=8,
                            global_batch_size=64, seq_len=2048)
    result.chosen.plan, result.chosen.memory, result.alternatives, result.rejected

    trainer.add_callback(memkit.MemkitCallback("memkit_record.json", prediction=est))

`model` is what `--model` takes (a catalog name, a config.json path or model folder, a hub id in
the local HF cache), or a config dict, a transformers config object, or a ModelSpec. Nothing
here downloads, prints or writes files.
"""
from __future__ import annotations

from memkit.errors import MemkitError
from memkit.plan.plan import DEFAULT_LR
from memkit.estimate.entry import estimate, hardware, model_spec  # noqa: F401 (the estimate layer's; re-exported)


def suggest(model, *, global_batch_size: int, seq_len: int, gpu: str | None = None,
            gpu_memory: int | str | None = None, num_gpus: int = 1, num_nodes: int = 1,
            num_alternatives: int = 4, **pins):
    """The fastest plan that fits (`memkit suggest`): a SearchResult (chosen, alternatives, rejected).

    pins: any field of memkit.planner.Request (precision, optimizer, zero_stage, offload_optimizer,
    offload_params, allow_offload, checkpointing, attention, max_micro_batch, lora_rank,
    lora_targets, tp, pp, headroom, objective). Raises NoPlanFits when nothing fits.
    """
    from memkit.planner import Request, search

    if "lora_targets" in pins:
        pins["lora_targets"] = tuple(pins["lora_targets"])
    request = Request(model=model_spec(model), global_batch_size=global_batch_size, seq_len=seq_len,
                      hardware=hardware(gpu=gpu, gpu_memory=gpu_memory, num_gpus=num_gpus, num_nodes=num_nodes),
                      **pins).validate()
    return search(request, num_alternatives=num_alternatives)


def training_arguments(plan, *, output_dir: str, lr: float = DEFAULT_LR, weight_decay: float = 0.0,
                       for_: str = "trainer", **overrides):
    """transformers.TrainingArguments that train `plan` with your own Trainer / SFTTrainer: the
    flags of the bundle README's Trainer recipe (memkit.emit.trainer.trainer_arguments).

    for_="trl": a trl.SFTConfig (TrainingArguments' subclass, trl/trainer/sft_config.py) with the
    same flags and max_length = the plan's seq_len, for TRL's SFTTrainer.
    On a machine without a CUDA GPU the arguments are a CPU smoke test of the plan, and a
    UserWarning says so: use_cpu=True, and a 16-bit plan runs in fp32 without its DeepSpeed file
    (transformers refuses bf16/fp16 on a CPU: "Your setup doesn't support bf16/gpu").

    plan: a TrainingPlan, or a plan.json (or the folder `memkit suggest --out` wrote); for a
    DeepSpeed plan.json the ds_config.json beside it becomes `deepspeed` (absolute path).
    overrides: any other TrainingArguments field (max_steps, logging_steps, report_to, ...).
    Model-side settings (attention kernel, LoRA) are not TrainingArguments: see
    memkit.emit.trainer.trainer_recipe(plan).model_kwargs / .peft_config.
    """
    from pathlib import Path

    from memkit.emit.trainer import trainer_arguments
    from memkit.plan.plan import TrainingPlan

    deepspeed = None
    if not isinstance(plan, TrainingPlan):
        from memkit.emit.plan_doc import read

        document = read(plan, flag="")
        plan = document.plan
        beside = Path(document.path).resolve().parent / "ds_config.json"
        if plan.engine == "deepspeed" and beside.is_file():
            deepspeed = str(beside)
    if plan.optimizer_in_backward:  # memkit/plan/backward_techniques.py; the bundle README says the same
        raise MemkitError("this plan steps the optimizer in backward, which HF Trainer cannot run (it steps and "
                          "clips after backward); train it with launch/finetune.py --plan plan.json")
    if for_ not in ("trainer", "trl"):
        raise MemkitError(f"for_={for_!r}: use 'trainer' (transformers TrainingArguments) or 'trl' (trl.SFTConfig)")
    args = trainer_arguments(plan, lr=lr, weight_decay=weight_decay)
    if deepspeed is not None:
        args["deepspeed"] = deepspeed
    if for_ == "trl":
        args["max_length"] = plan.seq_len
    args.update(_cpu_smoke_test(args, overrides))
    args.update(overrides)
    if for_ == "trl":
        from trl import SFTConfig

        return SFTConfig(output_dir=output_dir, **args)
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=output_dir, **args)


def _cpu_smoke_test(args: dict, overrides: dict) -> dict:
    """On a machine without CUDA: what makes the plan's arguments run here (and a warning saying so)."""
    import torch

    if torch.cuda.is_available() or overrides.get("use_cpu") is False:
        return {}
    import warnings

    changes = {"use_cpu": True}
    if args.get("bf16") or args.get("fp16"):
        changes.update(bf16=False, fp16=False)
        if "deepspeed" in args:
            changes["deepspeed"] = None
    changed = ", ".join(f"{k}={v}" for k, v in changes.items())
    warnings.warn(f"memkit.training_arguments: no CUDA GPU here, so these arguments are a CPU smoke test of the "
                  f"plan ({changed}); on the plan's GPUs they are the plan's own", UserWarning, stacklevel=3)
    return changes
