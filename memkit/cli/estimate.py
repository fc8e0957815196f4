"""memkit estimate: per-GPU peak memory of one plan, with a readable breakdown."""
from __future__ import annotations

import argparse
import json
import sys

from memkit.cli.common import (add_hardware_args, add_model_args, add_plan_args, check_positive, plan_engine,
                               hardware_from_args, lora_targets, render_breakdown)
from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan, knob_values

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
    v = p.add_argument_group("variable-length data (memkit/estimate/varlen.py)")
    v.add_argument("--lengths", metavar="LEN:COUNT,...",
                   help="sample lengths in tokens as a histogram, e.g. 128:500,512:300,2048:20: the run's "
                        "steps are replayed through the caching allocator at their padded lengths, with "
                        "and without expandable_segments")
    v.add_argument("--data", metavar="FILE",
                   help="the training file (the runner's formats): its length histogram, tokenized as the "
                        "runner does with the model folder's tokenizer (else memkit's byte tokenizer)")
    v.add_argument("--padding", choices=("longest", "multiple", "seq-len", "packed"), default="longest",
                   help="how a batch is padded with --lengths/--data: to its longest sample (default, "
                        "DataCollatorWithPadding), to a multiple of --pad-multiple, to --seq-len, or packed")
    v.add_argument("--pad-multiple", type=int, default=64, help="pad_to_multiple_of with --padding multiple (default 64)")
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
        raise MemkitError(f"tp*pp = {model_par} does not divide the {total} GPUs; "
                          f"pick tp and pp whose product divides {total}")
    knobs = knob_values(args, "estimate")  # every knob flag, as memkit/plan/plan.py declares it
    knobs.update(dp=total // model_par, lora_targets=lora_targets(args.lora_targets, model), engine=plan_engine(args))
    if args.optimizer_in_backward:
        knobs["gradient_clipping"] = 0.0
    from memkit.plan.parallel import bf16_unsupported

    if (error := bf16_unsupported(knobs["precision"], hardware)):  # the hardware's rule before the plan's
        raise MemkitError(error)
    return TrainingPlan(**knobs).validate()


def run(args: argparse.Namespace) -> int:
    from memkit.estimate.memory import estimate_memory
    from memkit.spec.hf import load_model_spec
    from memkit.spec.stack import parse_stack

    model = load_model_spec(args.model, trust_remote_code=args.trust_remote_code)
    if args.device == "cpu" and not (args.gpu or args.gpu_memory):  # a CPU run's memory is the host's RAM
        args.gpu_memory = args.host_ram or "64GiB"
    hardware = hardware_from_args(args)
    plan = plan_from_args(args, model, hardware)
    stack = parse_stack(args.stack)
    est = estimate_memory(model, plan, hardware, device=args.device, stack=stack)
    # a CPU estimate (`--device cpu`) is calibrated by CPU verify runs
    device_key = "cpu" if args.device == "cpu" else hardware.gpu.name
    est = _calibrated(est, plan, device_key, stack)
    varlen = _varlen(args, model, plan, hardware, stack)
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
        if varlen:
            out["variable_length"] = varlen
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
    if (line := alloc_conf_note(plan.alloc_conf)):
        print(line)
    for line in approximations:
        print(f"  approximated: {line}")
    gib = 1024 ** 3
    print(f"upper bound (+{est.upper_margin:.0%}, {est.upper_basis}): allocated "
          f"{est.allocated_peak_upper_bytes / gib:.2f}, reserved {est.reserved_peak_upper_bytes / gib:.2f}, "
          f"nvidia-smi {est.nvidia_smi_peak_upper_bytes / gib:.2f} GiB; predicted nvidia-smi "
          f"{est.nvidia_smi_peak_bytes / gib:.2f} GiB")
    if varlen:
        print(render_varlen(varlen))
    print(render_step_time(speed))
    return 0


def _varlen(args, model, plan, hardware, stack) -> dict | None:
    """With --lengths or --data: the run's steps at their padded lengths, replayed with and without
    expandable segments, the median of varlen.ORDERS seeded epoch orders (estimate/varlen.py)."""
    if not (args.lengths or args.data):
        return None
    from memkit.errors import MemkitError
    from memkit.estimate.varlen import estimate_varlen, padding_waste, parse_lengths, step_orders

    if args.lengths and args.data:
        raise MemkitError("--lengths and --data both given; use one")
    if args.lengths:
        lengths, where = parse_lengths(args.lengths), "--lengths"
    else:
        lengths, where = data_lengths(args.data, args.model, model.vocab_size), f"--data {args.data}"
    orders = step_orders(lengths, micro_batch=plan.micro_batch_size, seq_len=plan.seq_len,
                         padding=args.padding, multiple=args.pad_multiple)
    steps = orders[0]
    out = {"source": where, "samples": len(lengths), "padding": args.padding, "steps": len(steps),
           "longest_sample": max(lengths), "truncated_samples": sum(n > plan.seq_len for n in lengths),
           "padding_waste": round(padding_waste(lengths, steps, micro_batch=plan.micro_batch_size,
                                                seq_len=plan.seq_len), 4)}
    for expandable in (False, True):
        v = estimate_varlen(model, plan, hardware, steps, orders=tuple(orders[1:]), expandable_segments=expandable,
                            device=args.device, stack=stack)
        out["expandable_segments" if expandable else "default_segments"] = {
            "allocated_peak_bytes": v.allocated_peak_bytes, "reserved_peak_bytes": v.reserved_peak_bytes,
            "nvidia_smi_peak_bytes": v.nvidia_smi_peak_bytes, "replayed_steps": v.num_steps,
            "distinct_lengths": len(v.lengths), "single_shape_reserved_bytes": v.single_shape_reserved_bytes,
            "reserved_peak_bytes_by_order": list(v.reserved_by_order)}
    return out


def data_lengths(data: str, model_arg: str, vocab_size: int) -> list[int]:
    """Tokens per example of `data` (data_examples)."""
    return data_examples(data, model_arg, vocab_size)[0]


def data_examples(data: str, model_arg: str, vocab_size: int) -> tuple[list[int], str, str]:
    """(tokens per example, the records' kind, what tokenized them) of `data`, by the runner's
    tokenisation (memkit/train/data.py) with the tokenizer beside `model_arg` (a folder, or the
    folder of a config.json) when it has one, else memkit's byte tokenizer (load_tokenizer)."""
    from pathlib import Path

    from memkit.train.data import example_lengths_and_kind
    from memkit.train.tokenizer import has_tokenizer, load_tokenizer

    path = Path(model_arg).expanduser()
    folder = path if path.is_dir() else path.parent if path.is_file() else None
    folder = folder if folder is not None and has_tokenizer(folder) else None
    lengths, kind = example_lengths_and_kind(data, load_tokenizer(folder, vocab_size=vocab_size))
    by = ("the model folder's tokenizer" if folder is not None else
          "memkit's byte tokenizer (no tokenizer at --model: lengths are bytes, longer than a real "
          "tokenizer's; pass a model folder with its tokenizer)")
    return lengths, kind, by


def render_varlen(v: dict) -> str:
    gib = 1024 ** 3
    lines = [f"variable-length data ({v['source']}: {v['samples']} samples, longest {v['longest_sample']} tokens"
             f"{', ' + str(v['truncated_samples']) + ' truncated to --seq-len' if v['truncated_samples'] else ''}), "
             f"padding {v['padding']}: {v['steps']} steps, {v['padding_waste']:.0%} of the computed tokens are padding"]
    for key, label in (("default_segments", "default segments"), ("expandable_segments", "expandable_segments:True")):
        r = v[key]
        lines.append(f"  {label:<26} reserved {r['reserved_peak_bytes'] / gib:6.2f} GiB, nvidia-smi "
                     f"{r['nvidia_smi_peak_bytes'] / gib:6.2f} GiB ({r['replayed_steps']} steps replayed, "
                     f"{r['distinct_lengths']} lengths; one longest-shape step alone reserves "
                     f"{r['single_shape_reserved_bytes'] / gib:.2f} GiB)")
        spread = r.get("reserved_peak_bytes_by_order") or []
        if len(spread) > 1 and min(spread) != max(spread):
            lines.append(f"  {'':<26} the median of {len(spread)} shuffled orders: reserved "
                         f"{min(spread) / gib:.2f}-{max(spread) / gib:.2f} GiB across them (the cache's growth "
                         "depends on when the longest steps come)")
    return "\n".join(lines)


def alloc_conf_note(priced: str, environ=None) -> str:
    """One line when this shell's PYTORCH_CUDA_ALLOC_CONF runs another allocator than the one the
    estimate priced (`priced`, TrainingPlan.alloc_conf); unset runs memkit's runner's choice."""
    import os

    from memkit.plan.plan import ALLOC_CONF_ENV, alloc_conf_of

    user = (os.environ if environ is None else environ).get("PYTORCH_CUDA_ALLOC_CONF")
    if user is None or alloc_conf_of(user) == priced:
        return ""
    return (f"note: PYTORCH_CUDA_ALLOC_CONF={user!r} here runs {alloc_conf_of(user)} segments; this estimate "
            f"prices --alloc-conf {priced} ({ALLOC_CONF_ENV[priced] or 'unset'}): pass --alloc-conf "
            f"{alloc_conf_of(user)} to price yours")


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
