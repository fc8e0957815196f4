"""Flags shared by estimate, suggest and verify, and their conversion to library objects."""
from __future__ import annotations

import argparse

from memkit.errors import MemkitError
from memkit.plan import ATTENTIONS, OFFLOADS, OPTIMIZERS, PRECISIONS, TASKS
from memkit.quantize import QUANTIZE_BASES
from memkit.backward_techniques import add_backward_args
from memkit.techniques import LOSSES, checkpointing_type
from memkit.spec.hardware import HOST_RAM_GIB_PER_GPU, MIN_HOST_RAM_GIB, Hardware, custom_gpu, find_gpu
from memkit.units import format_bytes, parse_bytes


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="catalog name (memkit models), a config.json or its folder, or a cached hub id")


def add_hardware_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu", help="GPU name from the catalog (memkit gpus)")
    g.add_argument("--gpu-memory", help="GPU memory instead of --gpu, e.g. 24GiB")
    g.add_argument("--num-gpus", type=int, default=1, help="GPUs per node (default 1)")
    g.add_argument("--num-nodes", type=int, default=1, help="nodes (default 1)")
    g.add_argument("--host-ram", help=f"host RAM per node (default {HOST_RAM_GIB_PER_GPU}GiB per GPU, at least "
                   f"{MIN_HOST_RAM_GIB}GiB: a typical GPU server's share; pass what your nodes have)")


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    if args.gpu and args.gpu_memory:
        raise MemkitError("give --gpu or --gpu-memory, not both")
    if args.gpu:
        gpu = find_gpu(args.gpu)
    elif args.gpu_memory:
        gpu = custom_gpu(parse_bytes(args.gpu_memory, what="--gpu-memory"))
    else:
        raise MemkitError("no GPU given; pass --gpu NAME (see `memkit gpus`) or --gpu-memory 24GiB")
    # Not given: 0, which Hardware replaces by the one default (spec.hardware.default_host_ram_bytes).
    host_ram = parse_bytes(args.host_ram, what="--host-ram") if getattr(args, "host_ram", None) else 0
    return Hardware(gpu=gpu, num_gpus_per_node=args.num_gpus, num_nodes=args.num_nodes,
                    host_ram_bytes_per_node=host_ram).validate()


def plan_engine(args: argparse.Namespace) -> str:
    """--engine as given, else torch for a 4-bit base (memkit/quantize.py: plain PyTorch / DDP only)
    and DeepSpeed otherwise."""
    if args.engine:
        return args.engine
    return "torch" if (args.quantize_base or "none") != "none" else "deepspeed"


def add_plan_args(p: argparse.ArgumentParser, *, for_search: bool = False) -> None:
    """The knobs of a TrainingPlan. For `suggest` every knob is optional (a pin)."""
    g = p.add_argument_group("plan")
    default = (lambda v: None) if for_search else (lambda v: v)
    g.add_argument("--micro-batch-size", type=int, default=default(1))
    g.add_argument("--seq-len", type=int, default=2048 if not for_search else 2048)
    add_task_args(g)
    g.add_argument("--grad-accum", type=int, default=default(1))
    g.add_argument("--precision", choices=PRECISIONS, default=default("bf16"))
    g.add_argument("--optimizer", choices=OPTIMIZERS, default=default("adamw"))
    g.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=default(0))
    g.add_argument("--offload-optimizer", choices=OFFLOADS, default=default("none"))
    g.add_argument("--offload-params", choices=OFFLOADS, default=default("none"))
    g.add_argument("--checkpointing", type=checkpointing_type, default=default("none"),
                   help="none, full, or K: the first K decoder blocks (memkit/techniques.py)")
    g.add_argument("--loss", choices=LOSSES, default=default("standard"),
                   help="standard (full fp32 logits), chunked (memkit's chunked cross-entropy), "
                        "fused (liger-kernel, CUDA only)")
    g.add_argument("--attention", choices=ATTENTIONS, default=default("sdpa"))
    add_backward_args(g, for_search=for_search)  # memkit/backward_techniques.py
    g.add_argument("--tp", type=int, default=default(1))
    g.add_argument("--pp", type=int, default=default(1))
    g.add_argument("--lora-rank", type=int, default=default(0))
    g.add_argument("--lora-targets", default=None,
                   help="comma-separated module names (default q_proj,v_proj or the model's equivalents)")
    g.add_argument("--engine", choices=("deepspeed", "torch"), default=None,
                   help="deepspeed (default; torch with --quantize-base) or torch (plain PyTorch AMP/DDP; "
                        "zero 3 = FSDP)")
    g.add_argument("--quantize-base", choices=QUANTIZE_BASES, default=default("none"),
                   help="none, nf4 or fp4: a frozen 4-bit base under the LoRA adapters (QLoRA, bitsandbytes; "
                        "needs --lora-rank; memkit/quantize.py)")
    g.add_argument("--no-double-quant", action="store_true",
                   help="with --quantize-base: keep the block scales in fp32 (default: double quantisation)")


def add_task_args(g) -> None:
    """--task, --num-labels, --target-len (TrainingPlan.task / num_labels / target_len)."""
    g.add_argument("--task", choices=TASKS, default="causal-lm",
                   help="causal-lm (default: the model's own LM head, masked/seq2seq LM for encoders/"
                        "encoder-decoders), seq-cls or token-cls (a classification head of --num-labels)")
    g.add_argument("--num-labels", type=int, default=2, help="outputs of the seq-cls / token-cls head (default 2)")
    g.add_argument("--target-len", type=int, default=0,
                   help="encoder-decoders (T5, BART): decoder tokens per sequence (default 0: --seq-len)")


def task_knobs(args: argparse.Namespace) -> dict:
    """The task fields of a TrainingPlan from add_task_args' flags."""
    return {"task": args.task, "num_labels": args.num_labels, "target_len": args.target_len}


def check_positive(**values: int | None) -> None:
    for name, value in values.items():
        if value is not None and value < 1:
            raise MemkitError(f"--{name.replace('_', '-')} {value} must be a positive integer")


def lora_targets(value: str | None, model) -> tuple[str, ...]:
    """User's targets, or q/v projections under the model's own names (peft's defaults)."""
    names = model.linear_names()
    if value:
        targets = tuple(t.strip() for t in value.split(",") if t.strip())
        unknown = [t for t in targets if t not in names]
        if unknown:
            raise MemkitError(f"--lora-targets {','.join(unknown)} not in {model.name}'s linears "
                              f"({', '.join(names)})")
        return targets
    from memkit.planner.space import default_lora_targets

    return default_lora_targets(model)


def render_breakdown(est, *, title: str) -> str:
    """Readable component x bytes table for one estimate."""
    lines = [title]
    width = max([len(k) for k in est.components] + [10])
    for name, value in sorted(est.components.items(), key=lambda kv: -kv[1]):
        share = value / est.allocated_peak_bytes * 100 if est.allocated_peak_bytes else 0
        lines.append(f"  {name:<{width}}  {format_bytes(value):>12}  {share:5.1f}%")
    lines.append(f"  {'-' * width}  {'-' * 12}")
    lines.append(f"  {'allocated peak':<{width}}  {format_bytes(est.allocated_peak_bytes):>12}"
                 f"  (phase: {est.peak_phase})")
    lines.append(f"  {'reserved peak':<{width}}  {format_bytes(est.reserved_peak_bytes):>12}")
    lines.append(f"  {'nvidia-smi peak':<{width}}  {format_bytes(est.nvidia_smi_peak_bytes):>12}"
                 "  (+ CUDA context)")
    lines.append(f"  {'device total':<{width}}  {format_bytes(est.device_total_bytes):>12}")
    fits = "fits" if est.headroom_bytes >= 0 else "DOES NOT FIT"
    lines.append(f"  {'headroom':<{width}}  {format_bytes(est.headroom_bytes):>12}  {fits}")
    lines.append("  phases: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in est.phases.items()))
    lines.append(f"  host RAM per node: {format_bytes(est.host_bytes_per_node)}"
                 + (f", NVMe per node: {format_bytes(est.nvme_bytes_per_node)}" if est.nvme_bytes_per_node else ""))
    for note in est.notes:
        lines.append(f"  note: {note}")
    return "\n".join(lines)
