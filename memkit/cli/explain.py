"""memkit explain: re-read a plan.json and print it as `memkit suggest` did."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from memkit.cli.render import format_table
from memkit.plan.techniques import CHECKPOINTING
from memkit.units import GIB

HELP = "print a plan.json written by `memkit suggest --out` (optionally re-estimate it)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("plan_json", metavar="PLAN.json", help="plan.json (or the folder holding it)")
    p.add_argument("--check", action="store_true",
                   help="re-estimate the plan with this memkit and show what changed")
    p.add_argument("--json", action="store_true", help="print the document as one JSON object")


def read_document(path_text: str) -> dict:
    from memkit.emit import plan_doc

    return plan_doc.read(path_text, flag="", require=("plan", "model", "hardware", "estimate", "step_time")).data


def run(args: argparse.Namespace) -> int:
    doc = read_document(args.plan_json)
    folder = Path(args.plan_json) if Path(args.plan_json).is_dir() else Path(args.plan_json).parent
    out_dir = str(folder.resolve())  # the printed command runs from any directory
    check = _recheck(doc) if args.check else None
    if args.json:
        out = dict(doc)
        if check is not None:
            out["check"] = check
        print(json.dumps(out, indent=2))
        return 0
    print(render_document(doc, out_dir=out_dir))
    if check is not None:
        print()
        print(_render_check(doc, check))
    return 0


def _recheck(doc: dict) -> dict:
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.emit.plan_doc import PlanDocument
    from memkit.spec.hf import load_model_spec

    from memkit.plan.plan_schema import check_hardware_sizes

    check_hardware_sizes(doc["hardware"], where="plan.json")  # --check rebuilds the Hardware from them
    document = PlanDocument(doc)
    hardware, plan = document.hardware(), document.plan
    model = load_model_spec(document.model)
    stack = _recorded_stack(doc)
    est = estimate_memory(model, plan, hardware, stack=stack)
    speed = estimate_step_time(model, plan, hardware, stack=stack)
    return {"estimate": est.to_dict(), "step_time": speed.to_dict()}


def _recorded_stack(doc: dict):
    """The versions `suggest --stack` priced the plan for (plan.json "stack"), so a re-check prices
    the same stack; None (the installed one) for a plan without it. A malformed entry is bad input."""
    from memkit.errors import MemkitError
    from memkit.spec.stack import PACKAGES, Stack

    recorded = doc.get("stack")
    if recorded is None:
        return None
    if not isinstance(recorded, dict) or set(recorded) - set(PACKAGES) or not all(
            v is None or isinstance(v, str) for v in recorded.values()):
        raise MemkitError(f"plan.json 'stack' {recorded!r} is not a map of {', '.join(PACKAGES)} to version "
                          "strings; fix: rewrite it with `memkit suggest --stack ... --out DIR`")
    return Stack(**recorded)


def _render_check(doc: dict, check: dict) -> str:
    old, new = doc["estimate"], check["estimate"]
    rows = []
    for key in ("nvidia_smi_peak_bytes", "reserved_peak_bytes", "allocated_peak_bytes", "host_bytes_per_node"):
        rows.append([key, f"{old[key] / GIB:.2f} GiB", f"{new[key] / GIB:.2f} GiB",
                     f"{(new[key] - old[key]) / GIB:+.2f} GiB"])
    rows.append(["tokens_per_s", f"{doc['step_time']['tokens_per_s']:,.0f}",
                 f"{check['step_time']['tokens_per_s']:,.0f}", ""])
    budget = doc.get("budget_bytes")
    verdict = ""
    if budget:
        peak = new["nvidia_smi_peak_bytes"]
        verdict = ("\nstill fits the budget" if peak <= budget
                   else f"\nNO LONGER FITS: {peak / GIB:.1f} GiB > {budget / GIB:.1f} GiB budget")
    return "re-estimated with this memkit:\n" + format_table(["", "plan.json", "now", "change"], rows,
                                                            right={1, 2, 3}) + verdict


def pin_words(req: dict) -> list[str]:
    """The pins of plan.json's request as the user typed them (memkit.planner.space.pins; --lora-rank
    is the workload, shown in the LoRA line)."""
    from memkit.planner.space import PIN_FLAGS

    words = [f"{PIN_FLAGS[k]} {req[k]}" for k in PIN_FLAGS if req.get(k) is not None]
    if req.get("attention", "sdpa") != "sdpa":
        words.append(f"--attention {req['attention']}")
    if req.get("optimizer_in_backward"):
        words.append("--optimizer-in-backward")
    if req.get("allow_offload") is False:
        words.append("--no-offload")
    if req.get("max_micro_batch") is not None:
        words.append(f"--max-micro-batch {req['max_micro_batch']}")
    if req.get("allow"):
        words.append(f"--allow {','.join(req['allow'])}")
    return words


def render_document(doc: dict, *, out_dir: str | None = None) -> str:
    """The terminal view of a plan document (suggest's output; explain's too)."""
    plan, est, speed, hw = doc["plan"], doc["estimate"], doc["step_time"], doc["hardware"]
    req = doc.get("request", {})
    num_gpus = hw["num_gpus_per_node"] * hw["num_nodes"]
    device = est["device_total_bytes"]
    budget = doc.get("budget_bytes") or device
    seqs = plan["micro_batch_size"] * plan["grad_accum"] * plan["dp"]
    nodes = f" ({hw['num_gpus_per_node']} per node x {hw['num_nodes']} nodes)" if hw["num_nodes"] > 1 else ""
    lines = [f"{doc['model']} on {num_gpus} x {hw['gpu']}{nodes}, {device / GIB:.1f} GiB each; "
             f"global batch {seqs} x {plan['seq_len']} tokens"]
    search = doc.get("search")
    if search:
        took = f" in {search['seconds']:.2f} s" if "seconds" in search else ""
        lines.append(f"searched {search['num_structures']} plan shapes with {search['num_memory_estimates']} "
                     f"memory estimates{took}")
    lines += ["", f"Chosen plan: {doc.get('label', '')}"]
    pinned = pin_words(req)
    if pinned:
        lines.append(f"  pins (all honoured): {', '.join(pinned)}")
    if doc.get("split_reason"):
        lines.append(f"  split: {doc['split_reason']}")
    if doc.get("split_limits"):
        lines.append(f"  split runs: {doc['split_limits']}")
    precision_note = {"fp16": "mixed, fp32 master weights, dynamic loss scaling",
                      "bf16": "mixed, fp32 master weights", "bf16-pure": "weights, grads, optimizer states in bf16",
                      "fp32": "full precision"}[plan["precision"]]
    offload = f"optimizer {plan['offload_optimizer']}, params {plan['offload_params']}"
    knobs = [
        ("precision", f"{plan['precision']} ({precision_note})"),
        ("optimizer", plan["optimizer"]),
        ("ZeRO stage", str(plan["zero_stage"])),
        ("offload", offload),
        ("checkpointing", plan["checkpointing"] if plan["checkpointing"] in CHECKPOINTING
         else f"first {plan['checkpointing']} blocks"),
        ("loss", plan.get("loss", "standard")),
        ("attention", plan["attention"]),
        ("batch", f"micro {plan['micro_batch_size']} x accum {plan['grad_accum']} x dp {plan['dp']} = "
                  f"{seqs} sequences = {seqs * plan['seq_len']:,} tokens"),
        ("tp / pp / dp", f"{plan['tp']} / {plan['pp']} / {plan['dp']}"),
    ]
    for split, how in (doc.get("engines") or {}).items():
        if how and split in ("tensor_parallel", "pipeline_parallel"):
            knobs.append((split.replace("_", " "), how))
    if plan["lora_rank"]:
        knobs.append(("LoRA", f"rank {plan['lora_rank']}, alpha {plan['lora_alpha']}, "
                              f"targets {','.join(plan['lora_targets'])}"))
    if plan.get("quantize_base", "none") != "none":  # memkit/plan/quantize.py
        bnb = doc.get("bitsandbytes") or {}
        knobs.append(("4-bit base", f"{plan['quantize_base']} (bitsandbytes), double quant "
                                    f"{'on' if plan.get('double_quant', True) else 'off'}, compute dtype "
                                    f"{bnb.get('bnb_4bit_compute_dtype', '?')}"))
    if plan["zero_stage"] >= 1:
        buckets = f"reduce {plan['reduce_bucket_size']:,}"
        if plan["zero_stage"] == 3:
            buckets += (f", prefetch {plan['stage3_prefetch_bucket_size']:,}, max live "
                        f"{plan['stage3_max_live_parameters']:,}, persistence "
                        f"{plan['stage3_param_persistence_threshold']:,}")
        else:
            buckets += f", allgather {plan['allgather_bucket_size']:,}"
        knobs.append(("ZeRO buffers", f"{buckets} elements; overlap_comm {str(plan['overlap_comm']).lower()}"))
    if plan.get("offload_activations", "none") != "none":  # memkit/plan/backward_techniques.py
        knobs.append(("activation offload", f"{plan['offload_activations']} (saved activations in pinned host RAM)"))
    if plan.get("optimizer_in_backward"):
        knobs.append(("optimizer in backward", "yes (one optimizer per parameter, stepped in its gradient hook)"))
    knobs.append(("gradient clipping", str(plan["gradient_clipping"])))
    left = device - est["nvidia_smi_peak_bytes"]
    knobs += [
        ("peak per GPU", f"{est['nvidia_smi_peak_bytes'] / GIB:.1f} GiB as nvidia-smi shows it ("
                         f"{est['reserved_peak_bytes'] / GIB:.1f} reserved, {est['allocated_peak_bytes'] / GIB:.1f} "
                         f"allocated) in {est['peak_phase']}"),
        ("budget", f"{budget / GIB:.1f} GiB ({req.get('headroom', 0):.0%} headroom); "
                   f"{left / GIB:.1f} GiB of the device left unused"),
        ("host RAM per node", f"{est['host_bytes_per_node'] / GIB:.1f} GiB of "
                              f"{hw.get('host_ram_bytes_per_node', 0) / GIB:.0f} GiB"),
        ("speed", f"{speed['tokens_per_s']:,.0f} tokens/s, {speed['step_time_s']:.2f} s/step, MFU "
                  f"{speed['mfu']:.0%} (predicted)"),
    ]
    width = max(len(k) for k, _ in knobs)
    lines += [f"  {k:<{width}}  {v}" for k, v in knobs]
    top = sorted(est["components"].items(), key=lambda kv: -kv[1])[:6]
    lines.append(f"  {'at the peak':<{width}}  " + ", ".join(f"{k} {v / GIB:.1f}" for k, v in top) + " GiB")
    if doc.get("rejected"):
        lines += ["", "Why not a faster plan:"]
        lines.append(_indent(format_table(
            ["plan", "why not", "tokens/s if it fit"],
            [[r["label"], r["reason"], f"{seqs * plan['seq_len'] / r['step_time_s_if_it_fit']:,.0f}"]
             for r in doc["rejected"]], right={2})))
    if doc.get("alternatives"):
        lines += alternatives_table(doc["alternatives"], speed["step_time_s"])
    notes = list(doc.get("notes", [])) + list(est.get("notes", []))
    if notes:
        lines += [""] + [f"note: {n}" for n in notes]
    if out_dir:
        from memkit.emit.bundle import train_command

        lines += ["", "Run it (--model: the weights to fine-tune; a smoke test on fresh weights: --init random "
                  "--data synthetic --max-steps 20; the raw accelerate line is in README.md):",
                  "  " + train_command(doc, out_dir=out_dir.rstrip("/"))]
    return "\n".join(lines)


def alternatives_table(alternatives: list[dict], chosen_step_s: float) -> list[str]:
    """The fitting alternatives with each one's predicted margin over the chosen plan's step time;
    'tied' where that margin is within the step-time model's measured ranking uncertainty
    (estimate.throughput.step_time_ranking_uncertainty: the p75 error of the predicted ratio of two
    published runs), where the ranking is not a decision (issue 21, item 5)."""
    from memkit.estimate.throughput import step_time_ranking_uncertainty
    from memkit.planner.search import step_time_margin

    u = step_time_ranking_uncertainty()
    rows = []
    for i, a in enumerate(alternatives, 1):
        margin = step_time_margin(chosen_step_s, a["step_time_s"])
        rows.append([i, a["label"], f"{a['nvidia_smi_peak_bytes'] / GIB:.1f}", f"{a['tokens_per_s']:,.0f}",
                     f"{a['step_time_s']:.2f}", f"{a['mfu']:.0%}",
                     f"{margin:+.1%}", "tied" if abs(margin) <= u else ""])
    return ["", "Alternatives that fit:",
            _indent(format_table(["#", "plan", "peak GiB", "tokens/s", "s/step", "MFU", "vs chosen", ""], rows,
                                 right={0, 2, 3, 4, 5, 6})),
            f"  vs chosen: predicted step time over the chosen plan's; tied: within the step-time model's "
            f"+-{u:.1%} measured ranking uncertainty (p75 error of the predicted ratio of two published runs), "
            "so the two are not ranked by speed"]


def _indent(text: str) -> str:
    return "\n".join("  " + line for line in text.splitlines())
