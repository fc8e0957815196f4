"""memkit suggest: the fastest plan that fits, why, and the files that run it."""
from __future__ import annotations

import argparse
import json
import sys
import time

from memkit.cli.common import add_hardware_args, add_model_args, hardware_from_args, lora_targets
from memkit.emit.plan_doc import DEFAULT_LR
from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan, add_knob_flags, knob_values

HELP = "find the fastest plan that fits and write accelerate.yaml + ds_config.json for it"


def add_arguments(p: argparse.ArgumentParser) -> None:
    add_model_args(p)
    add_hardware_args(p)
    w = p.add_argument_group("workload")
    w.add_argument("--global-batch-size", type=int, required=True,
                   help="sequences per optimizer step across all GPUs (micro x accum x dp, exactly)")
    add_knob_flags(w, "workload")  # memkit/plan/plan.py declares each knob
    w.add_argument("--data", metavar="FILE",
                   help="your training data (any `memkit train --data` format): --seq-len comes from it unless "
                        "given (the longest example rounded up to 64, as `memkit run`), and the output says what "
                        "padding costs against packing; tokenized by the model folder's tokenizer, else memkit's "
                        "byte tokenizer")
    p.set_defaults(seq_len=None)  # unset: from --data, else the knob's default (resolve_seq_len)
    pins = p.add_argument_group("pins (leave out to let memkit choose)")
    add_knob_flags(pins, "pin")
    pins.add_argument("--no-offload", action="store_true", help="never offload to CPU or NVMe")
    pins.add_argument("--nvme-path", help="local NVMe mount; NVMe offload is considered only with it")
    pins.add_argument("--allow", default="", metavar="TECHNIQUE,...",
                      help="model-changing techniques memkit may choose unpinned: qlora (a 4-bit base under "
                           "--lora-rank), 8bit-optimizer (8-bit AdamW); default: none. Every pin is honoured "
                           "or the request fails naming it")
    pins.add_argument("--max-micro-batch", type=int)
    pins.add_argument("--headroom", default="10%",
                      help="device memory left unused for fragmentation, variable-length batches and "
                           "eval spikes (default 10%%)")
    pins.add_argument("--objective", choices=("throughput", "memory"), default="throughput")
    pins.add_argument("--stack", default="", metavar="PKG=VER,...",
                      help="plan for another software stack, e.g. transformers=4.40,torch=2.3 (spec/stack.py; "
                           "default: the installed versions); recorded in plan.json under 'stack'")
    out = p.add_argument_group("output")
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--out", metavar="DIR", help="write accelerate.yaml, ds_config.json, plan.json, README.md")
    out.add_argument("--force", action="store_true",
                     help="write --out into a non-empty folder that memkit did not write (its files of the same "
                          "names are replaced)")
    out.add_argument("--relative-paths", action="store_true",
                     help="write the bundle's paths as --out is typed (for bundles kept in a repository, such as "
                          "presets/); default: absolute paths, so the printed command runs from any directory")
    out.add_argument("--plot", metavar="PNG", help="stacked bars of per-GPU memory: chosen plan and alternatives")
    out.add_argument("--lr", type=float, default=DEFAULT_LR, help=f"learning rate written into ds_config.json "
                     f"(default {DEFAULT_LR:g})")
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


def parse_allow(text: str) -> tuple[str, ...]:
    """--allow a,b: the names in order, once each (Request.validate checks them)."""
    return tuple(dict.fromkeys(t.strip() for t in str(text).split(",") if t.strip()))


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
    from memkit.plan.plan import TASK_FIELDS
    from memkit.spec.generic import task_spec
    from memkit.spec.hf import load_model_spec

    base = load_model_spec(args.model, trust_remote_code=args.trust_remote_code)
    data = resolve_seq_len(args, base)
    knobs = {**knob_values(args, "workload"), **knob_values(args, "pin")}  # memkit/plan/plan.py's knobs
    task = TrainingPlan(**{name: knobs[name] for name in TASK_FIELDS}).validate()
    model = task_spec(base, task)  # the task's head and lengths (spec/generic.py)
    hardware = hardware_from_args(args)
    knobs.update(lora_targets=lora_targets(args.lora_targets, model) if args.lora_rank else TrainingPlan().lora_targets,
                 optimizer_in_backward=bool(args.optimizer_in_backward), double_quant=not args.no_double_quant,
                 tp=parse_degree(args.tp, "--tp"), pp=parse_degree(args.pp, "--pp"))
    request = Request(
        model=model, hardware=hardware, global_batch_size=args.global_batch_size,
        headroom=parse_headroom(args.headroom), objective=args.objective,
        allow_offload=not args.no_offload, nvme_path=args.nvme_path, max_micro_batch=args.max_micro_batch,
        allow=parse_allow(args.allow), split="auto", **knobs).validate()
    args.data_lengths = data
    return request


def resolve_seq_len(args: argparse.Namespace, model) -> dict | None:
    """args.seq_len when given; else from --data (seq_len_for_lengths, the rule `memkit run
    --seq-len from-data` applies), else the knob's default. Returns the lengths, kind and
    tokenizer of --data (cli/estimate.py data_examples) and the seq-len line, or None without it."""
    if getattr(args, "data", None) is None:
        if args.seq_len is None:
            args.seq_len = TrainingPlan().seq_len
        return None
    from memkit.cli.estimate import data_examples
    from memkit.train.data import seq_len_for_lengths

    lengths, kind, by = data_examples(args.data, args.model, model.vocab_size)
    line = None
    if args.seq_len is None:
        args.seq_len, line = seq_len_for_lengths(lengths, kind, max_positions=model.max_position_embeddings)
    return {"lengths": lengths, "kind": kind, "tokenized_by": by, "seq_len_line": line}


def run(args: argparse.Namespace) -> int:
    from memkit.cli.explain import render_document
    from memkit.planner import NoPlanFits, search

    if args.num_alternatives < 0:
        raise MemkitError(f"--num-alternatives {args.num_alternatives} must be >= 0")
    request = request_from_args(args)
    stack, estimator = _stack_estimator(args.stack)
    start = time.perf_counter()
    try:
        result = search(request, estimator=estimator, num_alternatives=args.num_alternatives, stack=stack)
    except NoPlanFits as exc:
        return _report_no_fit(args, request, exc)
    elapsed = time.perf_counter() - start
    from memkit.emit import plan_doc
    from memkit.emit.deepspeed import largest_param_numel

    doc = plan_doc.build(result, lr=args.lr)  # what plan.json holds (the presets hold the same)
    if stack is not None:  # the versions the plan was priced for (plan.json's "versions": this machine's)
        doc["stack"] = stack.to_dict()
    if args.trust_remote_code:  # the bundle's commands pass it to the runner (emit/bundle.py _model_flags)
        doc["trust_remote_code"] = True
    out_dir = bundle_dir(args.out, relative=args.relative_paths) if args.out else None
    if out_dir is not None and not args.relative_paths:
        doc["model"] = _absolute_if_path(args.model, doc["model"])
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

            files = bundle_files(doc, out_dir=out_dir, nvme_path=args.nvme_path or "/local_nvme",
                                 largest_param_numel=largest_param_numel(request.model),
                                 main_process_ip=args.main_process_ip)
            written = [str(p) for p in write_bundle(args.out, files, force=args.force)]  # all or nothing
    except BaseException:
        if plot_tmp is not None:
            plot_tmp.unlink(missing_ok=True)
        raise
    if plot_tmp is not None:
        import os

        os.replace(plot_tmp, args.plot)
        written.append(args.plot)
    doc["search"]["seconds"] = round(elapsed, 4)  # shown, not written: plan.json stays reproducible
    data = data_report(args, result.chosen.plan) if getattr(args, "data_lengths", None) else None
    if args.json:
        out = dict(doc)
        out["written"] = written
        if data is not None:
            out["data"] = data
        json.dump(out, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(render_document(doc, out_dir=out_dir))
    if data is not None:
        print("\n" + render_data(data))
    if written:
        print("\nwrote " + ", ".join(written))
    return 0


def data_report(args: argparse.Namespace, plan: TrainingPlan) -> dict:
    """What the chosen plan's micro-batch computes on --data: the share of padding when each batch is
    padded to its longest example (HF DataCollatorWithPadding after a RandomSampler;
    estimate/varlen.py step_lengths), to --seq-len, and when whole examples are packed into rows
    of --seq-len as `memkit train` does (train/data.py packed_row_groups; a text stream is packed
    across documents, so only its last row is short)."""
    from memkit.estimate.varlen import padding_waste, step_lengths
    from memkit.train.data import packed_row_groups

    info, seq_len, micro = args.data_lengths, plan.seq_len, plan.micro_batch_size
    lengths = info["lengths"]
    capped = [min(n, seq_len) for n in lengths]
    waste = {padding: padding_waste(lengths, step_lengths(lengths, micro_batch=micro, seq_len=seq_len,
                                                          padding=padding), micro_batch=micro, seq_len=seq_len)
             for padding in ("longest", "seq-len")}
    rows = (-(-sum(capped) // seq_len) if info["kind"] == "text" else len(packed_row_groups(capped, seq_len)))
    waste["packed"] = max(0.0, 1 - sum(capped) / (rows * seq_len))
    ordered = sorted(lengths)
    return {"source": args.data, "kind": info["kind"], "examples": len(lengths), "longest": ordered[-1],
            "median": ordered[len(ordered) // 2], "tokenized_by": info["tokenized_by"], "seq_len": seq_len,
            "seq_len_from_data": info["seq_len_line"], "longer_than_seq_len": sum(n > seq_len for n in lengths),
            "micro_batch_size": micro, "packed_rows": rows,
            "padding_share": {k: round(v, 4) for k, v in waste.items()}}


def render_data(d: dict) -> str:
    share = d["padding_share"]
    lines = [f"data: {d['examples']:,} {d['kind']} examples in {d['source']}, median {d['median']:,} and longest "
             f"{d['longest']:,} tokens, tokenized by {d['tokenized_by']}"]
    if d["seq_len_from_data"]:
        lines.append(d["seq_len_from_data"])
    if d["longer_than_seq_len"]:
        lines.append(f"{d['longer_than_seq_len']:,} example(s) are longer than --seq-len {d['seq_len']:,}: "
                     "memkit train refuses them unless --truncate")
    lines.append(f"padding at micro-batch {d['micro_batch_size']}: each batch to its longest example "
                 f"{share['longest']:.0%} of the computed tokens, to --seq-len {share['seq-len']:.0%}; packed "
                 f"into {d['packed_rows']:,} rows of {d['seq_len']:,} (memkit train's default) {share['packed']:.0%}")
    lines.append("the plan is priced at full rows of --seq-len (packed, or the longest batch padded); "
                 "`memkit estimate --data` replays the variable-length steps through the allocator")
    return "\n".join(lines)


def _stack_estimator(text: str):
    """(Stack, estimator pricing it) for `--stack`; (None, None) without it: the planner's default
    estimator, the installed behaviours."""
    if not text:
        return None, None
    from functools import partial

    from memkit.estimate.memory import estimate_memory
    from memkit.spec.stack import parse_stack

    stack = parse_stack(text)
    return stack, partial(estimate_memory, stack=stack)


def bundle_dir(out: str, *, relative: bool) -> str:
    """The folder as the bundle's files and the printed command name it: absolute (accelerate reads
    deepspeed_config_file relative to the launching directory), or as typed with --relative-paths."""
    import os

    if relative:
        return out.rstrip("/") or "/"
    return os.path.abspath(os.path.expanduser(out))


def _absolute_if_path(arg: str, name: str) -> str:
    """--model as an absolute path when it is a local file or folder (plan.json and the command then
    work from any directory); catalog names and hub ids unchanged."""
    from pathlib import Path

    path = Path(arg).expanduser()
    return str(path.resolve()) if name == arg and path.exists() else name


def _report_no_fit(args, request, exc) -> int:
    from memkit.cli.render import format_table
    from memkit.units import GIB

    if args.json:
        from memkit.emit.plan_doc import hardware_dict, rejection_dict

        json.dump({"error": str(exc), "model": request.model.name, "hardware": hardware_dict(request.hardware),
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
