"""Flags shared by estimate, suggest and verify, and their conversion to library objects."""
from __future__ import annotations

import argparse

from memkit.errors import MemkitError
from memkit.plan.plan import add_knob_flags
from memkit.spec.hardware import HOST_RAM_GIB_PER_GPU, MIN_HOST_RAM_GIB, Hardware, custom_gpu, find_gpu
from memkit.units import format_bytes, parse_bytes


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True,
                   help="catalog name (memkit models), a config.json or its folder, or a cached hub id")
    add_trust_remote_code(p, "build and trace the model folder's modeling_*.py; without it memkit prices the "
                             "families it maps (Qwen-1) from the config alone and runs nothing")


def add_trust_remote_code(p: argparse.ArgumentParser, what: str) -> None:
    """--trust-remote-code, one flag for every command that reads a model (estimate, suggest, the runner)."""
    p.add_argument("--trust-remote-code", action="store_true",
                   help="a config with auto_map (the model ships its own code), as transformers runs it with "
                        f"trust_remote_code=True: {what}")


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
    """--engine as given, else torch for a 4-bit base (memkit/plan/quantize.py: plain PyTorch / DDP only)
    and DeepSpeed otherwise."""
    if args.engine:
        return args.engine
    return "torch" if (args.quantize_base or "none") != "none" else "deepspeed"


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The knobs of a TrainingPlan, each as memkit/plan/plan.py declares it."""
    add_knob_flags(p.add_argument_group("plan"), "estimate")


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
