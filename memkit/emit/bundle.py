"""Write a plan's bundle: accelerate.yaml, ds_config.json, plan.json and README.md.

The only emitter that touches disk. `bundle_files` builds the texts (pure, used by the presets
generator and its staleness test); `write_bundle` writes them. Plans that do not run under
DeepSpeed (pipeline parallel) have no ds_config.json: their accelerate.yaml is a plain
multi-process launch and plan.json's "engines" says what runs each split.
"""
from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path

from memkit.emit.accelerate import accelerate_config
from memkit.emit.deepspeed import deepspeed_config, trainer_arguments
from memkit.errors import MemkitError
from memkit.plan import TrainingPlan
from memkit.units import GIB

PLAN_FORMAT_VERSION = 1
FILES = ("accelerate.yaml", "ds_config.json", "plan.json", "README.md")
DEFAULT_LR = 2e-5


def versions() -> dict:
    """Installed versions of what the bundle was made for (importlib.metadata: no imports)."""
    out = {}
    for dist in ("memkit", "deepspeed", "accelerate", "torch", "transformers", "peft"):
        try:
            out[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            out[dist] = None
    return out


def plan_document(*, model_name: str, plan: TrainingPlan, hardware: dict, memory, speed,
                  request: dict | None = None, alternatives: list[dict] | None = None,
                  rejected: list[dict] | None = None, notes: list[str] | None = None,
                  label: str = "", lr: float = DEFAULT_LR, version_info: dict | None = None) -> dict:
    """plan.json: the plan, what memkit predicts for it, and what it was made for."""
    return {
        "format_version": PLAN_FORMAT_VERSION,
        "model": model_name,
        "hardware": hardware,
        "request": request or {},
        "plan": plan.to_dict(),
        "label": label,
        "estimate": memory.to_dict(),
        "step_time": speed.to_dict(),
        "engines": engines(plan),
        "trainer_arguments": trainer_arguments(plan, lr=lr),
        "alternatives": alternatives or [],
        "rejected": rejected or [],
        "notes": notes or [],
        "versions": versions() if version_info is None else version_info,
    }


def engines(plan: TrainingPlan) -> dict:
    """Which engine runs each split of `plan` (plan.json's "engines"; None: no such split)."""
    ds = plan.engine == "deepspeed"
    if ds:
        dp = f"DeepSpeed ZeRO-{plan.zero_stage}" + (" (AutoTP data-parallel groups)" if plan.tp > 1 else "")
    elif plan.pp > 1:
        dp = "gradient all-reduce over the pipeline replicas (memkit.train.parallel)"
    else:
        dp = "PyTorch DDP (Accelerate)"
    return {
        "launcher": "accelerate launch, DeepSpeed (ds_config.json)" if ds
        else "accelerate launch, torchrun processes (no DeepSpeed)",
        "data_parallel": dp if plan.dp > 1 else None,
        "tensor_parallel": (f"DeepSpeed AutoTP training, autotp_size {plan.tp} (ds_config.json tensor_parallel)"
                            if plan.tp_engine == "autotp" else f"transformers tp_plan (DTensor), tp {plan.tp}")
        if plan.tp > 1 else None,
        "pipeline_parallel": (f"torch.distributed.pipelining, {plan.pp} stages, "
                              f"{'Schedule1F1B' if plan.pp_schedule == '1f1b' else 'ScheduleGPipe'} over "
                              f"{plan.grad_accum} micro-batches" if plan.pp_engine == "torch"
                              else f"DeepSpeed PipelineModule, {plan.pp} stages") if plan.pp > 1 else None,
    }


def file_names(plan: TrainingPlan) -> tuple[str, ...]:
    """The files of `plan`'s bundle: no ds_config.json when the plan does not run under DeepSpeed."""
    return FILES if plan.engine == "deepspeed" else tuple(f for f in FILES if f != "ds_config.json")


def bundle_files(document: dict, *, out_dir: str, nvme_path: str = "/local_nvme",
                 largest_param_numel: int = 0, main_process_ip: str | None = None) -> dict[str, str]:
    """File name -> text for the four files of a bundle that will live at `out_dir` (as the user
    will type it in the launch command; the YAML refers to the JSON by that path)."""
    import yaml

    plan = TrainingPlan.from_dict(document["plan"])
    hw = document["hardware"]
    lr = document["trainer_arguments"]["learning_rate"]
    files = {}
    ds_path = None
    if plan.engine == "deepspeed":
        ds = deepspeed_config(plan, lr=lr, nvme_path=nvme_path, largest_param_numel=largest_param_numel)
        ds_path = f"{out_dir.rstrip('/')}/ds_config.json"
        files["ds_config.json"] = json.dumps(ds, indent=2) + "\n"
    acc = accelerate_config(plan, deepspeed_config_file=ds_path, num_gpus_per_node=hw["num_gpus_per_node"],
                            num_nodes=hw["num_nodes"], main_process_ip=main_process_ip)
    files["accelerate.yaml"] = yaml.safe_dump(acc, sort_keys=False)
    files["plan.json"] = json.dumps(document, indent=2) + "\n"
    files["README.md"] = readme(document, out_dir=out_dir.rstrip("/"))
    return {name: files[name] for name in file_names(plan)}


def write_bundle(out_dir: str, files: dict[str, str]) -> list[Path]:
    root = Path(out_dir)
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise MemkitError(f"--out {out_dir}: cannot create the folder ({exc.strerror}); pick a writable path")
    written = []
    for name, text in files.items():
        path = root / name
        path.write_text(text)
        written.append(path)
    return written


def launch_command(document: dict, *, out_dir: str, data: str = "train.jsonl",
                   extra: str = "") -> str:
    """The command that runs the bundle (the runner module memkit.finetune: `--help` lists its flags)."""
    return (f"accelerate launch --config_file {out_dir}/accelerate.yaml -m memkit.finetune "
            f"--plan {out_dir}/plan.json --model {document['model']} --data {data} "
            f"--output-dir {out_dir}/run{extra}")


def readme(document: dict, *, out_dir: str) -> str:
    plan = document["plan"]
    est = document["estimate"]
    speed = document["step_time"]
    hw = document["hardware"]
    targs = document["trainer_arguments"]
    num_gpus = hw["num_gpus_per_node"] * hw["num_nodes"]
    tokens = plan["micro_batch_size"] * plan["grad_accum"] * plan["dp"] * plan["seq_len"]
    lines = [
        f"# {document['model']} on {num_gpus} x {hw['gpu']}",
        "",
        f"Plan: **{document['label']}** (made by memkit {document['versions'].get('memkit')}).",
        "",
        "```",
        launch_command(document, out_dir=out_dir),
        "```",
        "",
        "`--data` takes a .jsonl (text, or prompt+completion), a .txt or a datasets folder. A 20-step "
        "smoke test on synthetic tokens, which also reports the measured peak per GPU:",
        "",
        "```",
        launch_command(document, out_dir=out_dir, data="synthetic", extra=" --max-steps 20"),
        "```",
        "",
    ]
    if hw["num_nodes"] > 1:
        lines += [
            f"Multi-node: run the same command on each of the {hw['num_nodes']} nodes, adding "
            "`--machine_rank i --main_process_ip <node 0 address>` (node 0 has rank 0).",
            "",
        ]
    lines += [
        "| | |", "|---|---|",
        f"| global batch | micro {plan['micro_batch_size']} x accum {plan['grad_accum']} x dp {plan['dp']} = "
        f"{plan['micro_batch_size'] * plan['grad_accum'] * plan['dp']} sequences of {plan['seq_len']} tokens "
        f"= {tokens:,} tokens |",
        f"| precision / optimizer | {plan['precision']} / {plan['optimizer']} |",
        f"| ZeRO | stage {plan['zero_stage']}, optimizer offload {plan['offload_optimizer']}, "
        f"param offload {plan['offload_params']} |",
        f"| checkpointing / attention | {plan['checkpointing']} / {plan['attention']} |",
        f"| tp / pp / dp | {plan['tp']} / {plan['pp']} / {plan['dp']} |",
    ]
    for split, how in (document.get("engines") or {}).items():
        if how and split in ("tensor_parallel", "pipeline_parallel"):
            lines.append(f"| {split.replace('_', ' ')} | {how} |")
    if plan["lora_rank"]:
        lines.append(f"| LoRA | rank {plan['lora_rank']}, alpha {plan['lora_alpha']}, "
                     f"targets {', '.join(plan['lora_targets'])} |")
    lines += [
        f"| predicted peak per GPU | {est['nvidia_smi_peak_bytes'] / GIB:.1f} GiB as nvidia-smi shows it "
        f"({est['reserved_peak_bytes'] / GIB:.1f} reserved, {est['allocated_peak_bytes'] / GIB:.1f} allocated) "
        f"of {est['device_total_bytes'] / GIB:.1f} GiB, in {est['peak_phase']} |",
        f"| host RAM per node | {est['host_bytes_per_node'] / GIB:.1f} GiB |",
        f"| predicted speed | {speed['tokens_per_s']:,.0f} tokens/s, {speed['step_time_s']:.2f} s/step, "
        f"MFU {speed['mfu']:.0%} |",
        "",
    ]
    if plan["engine"] == "deepspeed":
        lines += [
            "Files: `accelerate.yaml` (processes and machines; it points at the DeepSpeed file and sets "
            "nothing else), `ds_config.json` (every DeepSpeed setting, explicit values), `plan.json` "
            "(the plan, memkit's estimate and the versions it was made with; `memkit explain "
            f"{out_dir}/plan.json` prints it).",
            "",
        ]
        if plan["tp"] == 1:
            lines += [
                "With Hugging Face Trainer instead, pass `--deepspeed "
                f"{out_dir}/ds_config.json` and these TrainingArguments, which the file must agree with:",
                "",
                "```",
                " ".join(f"--{k} {v}" for k, v in targs.items()),
                "```",
                "",
            ]
        else:
            lines += ["Under AutoTP, DeepSpeed counts every process in its batch check, so "
                      "`train_batch_size` in ds_config.json is micro x accum x dp x tp; only dp shards "
                      "see distinct data (launch/finetune.py feeds a TP group one batch).", ""]
    else:
        lines += [
            "Files: `accelerate.yaml` (a plain multi-process launch: no DeepSpeed; launch/finetune.py "
            "splits the model into pipeline stages itself), `plan.json` (the plan, memkit's estimate, "
            f"which engine runs each split; `memkit explain {out_dir}/plan.json` prints it).",
            "",
        ]
    if plan["checkpointing"] == "full":
        lines += ["The plan counts on activation checkpointing of every decoder block "
                  "(`model.gradient_checkpointing_enable()`; Trainer: gradient checkpointing on).", ""]
    if plan["optimizer"] in ("adamw-8bit", "adafactor"):
        lines += [f"The optimizer ({plan['optimizer']}) is built by the training script, not by DeepSpeed; "
                  "the config allows that (`zero_allow_untested_optimizer`).", ""]
    if plan["offload_optimizer"] == "nvme" or plan["offload_params"] == "nvme":
        lines += ["NVMe offload writes to the `nvme_path` in ds_config.json: it must be a fast local "
                  "NVMe mount on every node.", ""]
    return "\n".join(lines)
