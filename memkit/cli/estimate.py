"""memkit estimate: per-GPU peak memory of one plan, with a readable breakdown."""
from __future__ import annotations

import argparse
import json
import sys

from memkit.cli.common import (add_hardware_args, add_model_args, add_plan_args, check_positive, plan_engine,
                               hardware_from_args, lora_targets, render_breakdown)
from memkit.plan import TrainingPlan

HELP = "predict per-GPU peak memory (and host RAM) and the step time of one training plan"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_hardware_args(p)
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="write a stacked bar chart of the breakdown")
    p.add_argument("--stack", default="", metavar="PKG=VER,...",
                   help="plan for another software stack, e.g. transformers=4.40,torch=2.3 "
                        "(default: the versions installed here)")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="price a step on this device (default cuda); cpu: the same loop run on the CPU, as "
                        "tests/golden/cpu_measurements.json measures it (no CUDA context or allocator cache); "
                        "without --gpu the device memory is the host RAM")


def plan_from_args(args: argparse.Namespace, model, hardware) -> TrainingPlan:
    check_positive(micro_batch_size=args.micro_batch_size, seq_len=args.seq_len,
                   grad_accum=args.grad_accum, tp=args.tp, pp=args.pp)
    total = hardware.num_gpus
    model_par = args.tp * args.pp
    if total % model_par:
        from memkit.errors import MemkitError
        raise MemkitError(f"tp*pp = {model_par} does not divide the {total} GPUs; "
                          f"pick tp and pp whose product divides {total}")
    return TrainingPlan(
        precision=args.precision, optimizer=args.optimizer, zero_stage=args.zero,
        offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
        checkpointing=args.checkpointing, loss=args.loss, attention=args.attention,
        micro_batch_size=args.micro_batch_size, grad_accum=args.grad_accum, seq_len=args.seq_len,
        dp=total // model_par, tp=args.tp, pp=args.pp, lora_rank=args.lora_rank,
        lora_targets=lora_targets(args.lora_targets, model), engine=plan_engine(args),
        quantize_base=args.quantize_base, double_quant=not args.no_double_quant,
        offload_activations=args.offload_activations, optimizer_in_backward=args.optimizer_in_backward,
        **({"gradient_clipping": 0.0} if args.optimizer_in_backward else {})).validate()


def run(args: argparse.Namespace) -> int:
    from memkit.estimate.memory import estimate_memory
    from memkit.spec.hf import load_model_spec
    from memkit.spec.stack import parse_stack

    model = load_model_spec(args.model)
    if args.device == "cpu" and not (args.gpu or args.gpu_memory):  # a CPU run's memory is the host's RAM
        args.gpu_memory = args.host_ram or "64GiB"
    hardware = hardware_from_args(args)
    plan = plan_from_args(args, model, hardware)
    stack = parse_stack(args.stack)
    est = estimate_memory(model, plan, hardware, device=args.device, stack=stack)
    # a CPU estimate (`--device cpu`) is calibrated by CPU verify runs
    device_key = "cpu" if args.device == "cpu" else hardware.gpu.name
    est = _calibrated(est, plan, device_key, stack)
    speed = _step_time(model, plan, hardware, stack)
    from memkit.estimate.activations import activation_source

    approximations = model.approximations + ((activation_source(model, plan, device=args.device),)
                                             if model.traced else ())
    if args.plot:
        from memkit.plot import plot_estimates
        plot_estimates([("plan", est)], path=args.plot)
    if args.json:
        out = est.to_dict()
        out["model"] = model.name
        out["gpu"] = hardware.gpu.name
        out["plan"] = plan.to_dict()
        out["stack"] = stack.to_dict()
        out["step_time"] = speed.to_dict()
        out["device"] = args.device
        out["approximations"] = list(approximations)
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    title = (f"{model.name} ({model.num_params / 1e9:.2f}B params, "
             f"{est.num_trainable_params / 1e9:.3g}B trainable) on {hardware.num_gpus_per_node}x"
             f"{hardware.num_nodes} {hardware.gpu.name}: {plan.precision}, ZeRO-{plan.zero_stage}"
             f"{', offload opt ' + plan.offload_optimizer if plan.offload_optimizer != 'none' else ''}"
             f"{', offload params ' + plan.offload_params if plan.offload_params != 'none' else ''}, "
             f"ckpt {plan.checkpointing}, loss {plan.loss}, {plan.attention}, micro {plan.micro_batch_size} x seq "
             f"{plan.seq_len} x accum {plan.grad_accum}, tp {plan.tp} pp {plan.pp} dp {plan.dp}"
             f"{', LoRA r' + str(plan.lora_rank) if plan.is_lora else ''}"
             f"{', ' + plan.quantize_base + ' base' if plan.is_quantized else ''}"
             f"{', activations offloaded to cpu' if plan.offload_activations != 'none' else ''}"
             f"{', optimizer in backward' if plan.optimizer_in_backward else ''}")
    print(render_breakdown(est, title=title))
    for line in approximations:
        print(f"  approximated: {line}")
    gib = 1024 ** 3
    print(f"upper bound (+{est.upper_margin:.0%}, {est.upper_basis}): allocated "
          f"{est.allocated_peak_upper_bytes / gib:.2f}, reserved {est.reserved_peak_upper_bytes / gib:.2f}, "
          f"nvidia-smi {est.nvidia_smi_peak_upper_bytes / gib:.2f} GiB; predicted nvidia-smi "
          f"{est.nvidia_smi_peak_bytes / gib:.2f} GiB")
    print(render_step_time(speed))
    return 0


def _calibrated(est, plan, device: str, stack):
    """The estimate with upper bounds from this machine's profile, when it holds runs for the
    device and stack (memkit/profile.py); else unchanged (published-runs margin)."""
    from memkit import profile
    from memkit.estimate.memory import with_upper_bounds

    table, n = profile.margins(device, stack)
    if not n:
        return est
    return with_upper_bounds(est, plan, table=table, basis=f"calibrated on {n} runs on this machine",
                             device="cuda" if device != "cpu" else "cpu")


def _step_time(model, plan, hardware, stack):
    from memkit.estimate.throughput import estimate_step_time
    return estimate_step_time(model, plan, hardware, stack=stack)


def render_step_time(speed) -> str:
    """Step time, tokens/s, MFU and the seconds per step of each term (largest first)."""
    from memkit.estimate.throughput import step_time_uncertainty
    lines = [f"step time: {speed.step_time_s:.3f} s/step, {speed.tokens_per_s:,.0f} tokens/s, "
             f"MFU {speed.mfu:.1%} (predicted; +-{step_time_uncertainty():.0%} = p75 error on published runs)"]
    for name, sec in sorted(speed.components_s.items(), key=lambda kv: -kv[1]):
        if sec > 0:
            lines.append(f"  {name:<17} {sec:9.3f} s  {sec / speed.step_time_s:6.1%}")
    return "\n".join(lines)
