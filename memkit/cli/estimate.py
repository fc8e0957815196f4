"""memkit estimate: per-GPU peak memory of one plan, with a readable breakdown."""
from __future__ import annotations

import argparse
import json
import sys

from memkit.cli.common import (add_hardware_args, add_model_args, add_plan_args, check_positive,
                               hardware_from_args, lora_targets, render_breakdown)
from memkit.plan import TrainingPlan

HELP = "predict per-GPU peak memory (and host RAM) of one training plan"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_hardware_args(p)
    add_plan_args(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="PNG", help="write a stacked bar chart of the breakdown")


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
        lora_targets=lora_targets(args.lora_targets, model), engine=args.engine).validate()


def run(args: argparse.Namespace) -> int:
    from memkit.estimate.memory import estimate_memory
    from memkit.spec.hf import load_model_spec

    model = load_model_spec(args.model)
    hardware = hardware_from_args(args)
    plan = plan_from_args(args, model, hardware)
    est = estimate_memory(model, plan, hardware)
    if args.plot:
        from memkit.plot import plot_estimates
        plot_estimates([("plan", est)], path=args.plot)
    if args.json:
        out = est.to_dict()
        out["model"] = model.name
        out["gpu"] = hardware.gpu.name
        out["plan"] = plan.to_dict()
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
             f"{', LoRA r' + str(plan.lora_rank) if plan.is_lora else ''}")
    print(render_breakdown(est, title=title))
    return 0
