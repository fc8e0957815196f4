"""memkit suggest: the fastest plan that fits, why, and the files that run it."""
from __future__ import annotations

import argparse
import json
import sys
import time

from memkit.cli.common import add_hardware_args, add_model_args, hardware_from_args, lora_targets
from memkit.errors import MemkitError
from memkit.plan import ATTENTIONS, CHECKPOINTING, OFFLOADS, OPTIMIZERS, PRECISIONS

HELP = "find the fastest plan that fits and write accelerate.yaml + ds_config.json for it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_hardware_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--global-batch-size", type=int, required=True,
                   help="sequences per optimizer step across all GPUs (micro x accum x dp, exactly)")
    w.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    w.add_argument("--lora-rank", type=int, default=0, help="fine-tune LoRA adapters of this rank (0 = full)")
    w.add_argument("--lora-targets", default=None, help="comma-separated module names (default q/v projections)")
    pins = p.add_argument_group("pins (leave out to let memkit choose)")
    pins.add_argument("--precision", choices=PRECISIONS)
    pins.add_argument("--optimizer", choices=OPTIMIZERS,
                      help="default: AdamW; 8-bit AdamW / Adafactor / pure bf16 only if nothing else fits")
    pins.add_argument("--zero", type=int, choices=(0, 1, 2, 3))
    pins.add_argument("--offload-optimizer", choices=OFFLOADS)
    pins.add_argument("--offload-params", choices=OFFLOADS)
    pins.add_argument("--no-offload", action="store_true", help="never offload to CPU or NVMe")
    pins.add_argument("--nvme-path", help="local NVMe mount; NVMe offload is considered only with it")
    pins.add_argument("--checkpointing", choices=CHECKPOINTING)
    pins.add_argument("--attention", choices=ATTENTIONS, default="sdpa", help="attention kernel (default sdpa)")
    pins.add_argument("--max-micro-batch", type=int)
    pins.add_argument("--tp", default=None,
                      help="tensor-parallel degree (DeepSpeed AutoTP), or 'auto' (default): split when nothing "
                           "fits otherwise or when the step-time model says the split is faster")
    pins.add_argument("--pp", default=None,
                      help="pipeline-parallel degree (torch.distributed.pipelining, 1F1B), or 'auto' (as --tp)")
    pins.add_argument("--headroom", default="10%",
                      help="device memory left unused for fragmentation, variable-length batches and "
                           "eval spikes (default 10%%)")
    pins.add_argument("--objective", choices=("throughput", "memory"), default="throughput")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--out", metavar="DIR", help="write accelerate.yaml, ds_config.json, plan.json, README.md")
    out.add_argument("--plot", metavar="PNG", help="stacked bars of per-GPU memory: chosen plan and alternatives")
    out.add_argument("--lr", type=float, default=2e-5, help="learning rate written into ds_config.json")
    out.add_argument("--main-process-ip", help="node 0's address for multi-node accelerate.yaml")
    out.add_argument("--num-alternatives", type=int, default=4)


def parse_headroom(text: str) -> float:
    raw = str(text).strip()
    try:
        value = float(raw.rstrip("%"))
    except ValueError:
        raise MemkitError(f"--headroom {text!r} is not a number; write e.g. 10% or 0.1") from None
    fraction = value / 100.0 if raw.endswith("%") or value >= 1.0 else value
    if not 0.0 <= fraction < 0.9:
        raise MemkitError(f"--headroom {text} must be between 0% and 90%")
    return fraction


def parse_degree(text: str | None, flag: str) -> int | None:
    if text is None or str(text).lower() == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise MemkitError(f"{flag} {text!r} must be a positive integer or 'auto'") from None
    if value < 1:
        raise MemkitError(f"{flag} {value} must be a positive integer or 'auto'")
    return value


def request_from_args(args: argparse.Namespace):
    from memkit.planner import Request
    from memkit.spec.hf import load_model_spec

    model = load_model_spec(args.model)
    hardware = hardware_from_args(args)
    targets = lora_targets(args.lora_targets, model) if args.lora_rank else ("q_proj", "v_proj")
    return Request(
        model=model, hardware=hardware, global_batch_size=args.global_batch_size, seq_len=args.seq_len,
        headroom=parse_headroom(args.headroom), objective=args.objective, precision=args.precision,
        optimizer=args.optimizer, zero_stage=args.zero, offload_optimizer=args.offload_optimizer,
        offload_params=args.offload_params, allow_offload=not args.no_offload, nvme_path=args.nvme_path,
        checkpointing=args.checkpointing, attention=args.attention, max_micro_batch=args.max_micro_batch,
        lora_rank=args.lora_rank, lora_targets=targets, tp=parse_degree(args.tp, "--tp"),
        pp=parse_degree(args.pp, "--pp"),
        split="auto").validate()


def request_dict(request) -> dict:
    """The workload and the pins, as plan.json records them (pins only when given)."""
    out = {"global_batch_size": request.global_batch_size, "seq_len": request.seq_len,
           "headroom": request.headroom, "objective": request.objective, "attention": request.attention,
           "split": request.split}
    for key in ("precision", "optimizer", "zero_stage", "offload_optimizer", "offload_params", "nvme_path",
                "checkpointing", "max_micro_batch", "tp", "pp"):
        value = getattr(request, key)
        if value is not None:
            out[key] = value
    if not request.allow_offload:
        out["allow_offload"] = False
    if request.lora_rank:
        out["lora_rank"] = request.lora_rank
        out["lora_targets"] = list(request.lora_targets)
    return out


def candidate_dict(cand) -> dict:
    return {"label": cand.label, "plan": cand.plan.to_dict(), "tier": cand.tier,
            "nvidia_smi_peak_bytes": cand.memory.nvidia_smi_peak_bytes,
            "reserved_peak_bytes": cand.memory.reserved_peak_bytes,
            "allocated_peak_bytes": cand.memory.allocated_peak_bytes,
            "host_bytes_per_node": cand.memory.host_bytes_per_node,
            "components": dict(cand.memory.components),
            "step_time_s": cand.speed.step_time_s, "tokens_per_s": cand.speed.tokens_per_s, "mfu": cand.speed.mfu}


def rejection_dict(rej) -> dict:
    return {"label": rej.label, "plan": rej.plan.to_dict(), "reason": rej.reason,
            "nvidia_smi_peak_bytes": rej.device_peak_bytes, "host_bytes_per_node": rej.host_bytes_per_node,
            "needs": list(rej.needs), "step_time_s_if_it_fit": rej.step_time_s}


def document_for(result, *, lr: float, elapsed_s: float | None = None, version_info: dict | None = None) -> dict:
    from memkit.emit.bundle import plan_document

    req = result.request
    chosen = result.chosen
    doc = plan_document(
        model_name=req.model.name, plan=chosen.plan, hardware=req.hardware_dict(), memory=chosen.memory,
        speed=chosen.speed, request=request_dict(req), label=chosen.label, lr=lr,
        alternatives=[candidate_dict(c) for c in result.alternatives],
        rejected=[rejection_dict(r) for r in result.rejected],
        notes=list(result.notes) + ([f"micro-batch limit: {chosen.micro_limit}"] if chosen.micro_limit else []),
        version_info=version_info)
    doc["budget_bytes"] = req.budget_bytes
    if result.split_reason:
        doc["split_reason"] = result.split_reason
    doc["search"] = {"num_structures": result.num_structures, "num_memory_estimates": result.num_memory_estimates}
    if elapsed_s is not None:
        doc["search"]["seconds"] = round(elapsed_s, 4)
    return doc


def run(args: argparse.Namespace) -> int:
    from memkit.cli.explain import render_document
    from memkit.planner import NoPlanFits, search

    if args.num_alternatives < 0:
        raise MemkitError(f"--num-alternatives {args.num_alternatives} must be >= 0")
    request = request_from_args(args)
    start = time.perf_counter()
    try:
        result = search(request, num_alternatives=args.num_alternatives)
    except NoPlanFits as exc:
        return _report_no_fit(args, request, exc)
    elapsed = time.perf_counter() - start
    doc = document_for(result, lr=args.lr, elapsed_s=elapsed)
    written = []
    plot_tmp = None
    try:
        if args.plot:  # drawn first, beside its target: a plot that fails leaves --out untouched
            from memkit.fileio import temp_beside
            from memkit.plot import plot_estimates

            items = [(f"chosen: {result.chosen.label}", result.chosen.memory)]
            items += [(f"alt {i}: {c.label}", c.memory) for i, c in enumerate(result.alternatives, 1)]
            plot_tmp = temp_beside(args.plot)
            plot_estimates(items, path=str(plot_tmp), budget_bytes=request.budget_bytes,
                           title=f"{request.model.name} on {request.hardware.num_gpus} x {request.hardware.gpu.name}")
        if args.out:
            from memkit.emit.bundle import bundle_files, write_bundle

            files = bundle_files(doc, out_dir=args.out, nvme_path=args.nvme_path or "/local_nvme",
                                 largest_param_numel=_largest_param(request.model),
                                 main_process_ip=args.main_process_ip)
            written = [str(p) for p in write_bundle(args.out, files)]  # all or nothing
    except BaseException:
        if plot_tmp is not None:
            plot_tmp.unlink(missing_ok=True)
        raise
    if plot_tmp is not None:
        import os

        os.replace(plot_tmp, args.plot)
        written.append(args.plot)
    if args.json:
        out = dict(doc)
        out["written"] = written
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(render_document(doc, out_dir=args.out))
    if written:
        print("\nwrote " + ", ".join(written))
    return 0


def _largest_param(model) -> int:
    """The largest single tensor: the token embedding (or an untied LM head) in practice."""
    biggest = model.vocab_size * model.hidden_size
    for lin in model.layer_linears + model.encoder_layer_linears:
        biggest = max(biggest, lin.in_features * lin.out_features)
    return biggest


def _report_no_fit(args, request, exc) -> int:
    from memkit.cli.render import format_table
    from memkit.units import GIB

    if args.json:
        json.dump({"error": str(exc), "model": request.model.name, "hardware": request.hardware_dict(),
                   "budget_bytes": request.budget_bytes,
                   "nearest_misses": [rejection_dict(m) for m in exc.misses]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        rows = [[m.label, m.reason, "; and ".join(m.needs) or "-"] for m in exc.misses]
        print(f"No plan fits {request.model.name} on {request.hardware.num_gpus} x {request.hardware.gpu.name} "
              f"(budget {request.budget_bytes / GIB:.1f} GiB per GPU)." + (" Nearest misses:" if rows else ""))
        if rows:
            print(format_table(["plan", "why it does not fit", "what it would need"], rows))
    sys.stderr.write(f"memkit: error: {exc}\n")
    return exc.exit_code
