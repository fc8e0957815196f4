"""The runner's main (`python -m memkit.finetune`, the memkit-finetune script, launch/finetune.py)
under `accelerate launch`:

    accelerate launch --config_file runs/x/accelerate.yaml -m memkit.finetune \\
        --plan runs/x/plan.json --data train.jsonl --output-dir out/ --max-steps 200

Exit codes: 0 done; 2 bad input (one line on stderr); 3 out of memory (reported, see
report.json); 143/130/138 stopped by SIGTERM/SIGINT/SIGUSR1 after writing a checkpoint
(memkit.train.loop.StopFlag: every rank agrees on the step; repeats are ignored).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import signal
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

from memkit.errors import MemkitError, exit_now
from memkit.plan.plan import ALLOC_CONF_ENV, TrainingPlan, add_knob_flags, alloc_conf_of, knob_values
from memkit.spec.resolve import ModelSource
from memkit.train.config import DEFAULT_PREEMPT_GRACE_S, DEFAULT_SAVE_EVERY_MINUTES, REPORT_TO, RunConfig

HELP = "fine-tune a causal LM under a memkit plan (run it with accelerate launch)"


def add_arguments(p: argparse.ArgumentParser, *, for_wrapper: bool = False) -> None:
    p.add_argument("--plan", help="plan.json written by `memkit suggest --out DIR`")
    p.add_argument("--model", help="local HF model folder with weights, a hub id in the local HF cache, a "
                                    "config.json, or a catalog name (default: plan.json's model)")
    p.add_argument("--init", choices=("pretrained", "random"), default=None,
                   help="pretrained: --model's weights (the default when it has them); random: fresh seeded "
                        "weights from its config (smoke tests; required for a catalog name without weights)")
    from memkit.cli.common import add_trust_remote_code

    add_trust_remote_code(p, "run the model folder's configuration_*.py and modeling_*.py to build the model "
                             "(without it the runner refuses such a model, in one line)")
    p.add_argument("--data", required=not for_wrapper,
                   help=".jsonl/.json/.csv/.parquet/.txt or a datasets folder: text, prompt+completion, alpaca, "
                        "chat messages / ShareGPT (memkit.train.records); or synthetic[:N]")
    p.add_argument("--output-dir", required=not for_wrapper, help="log.jsonl, checkpoints/, final/")
    p.add_argument("--max-steps", type=int, default=None, help="optimizer steps (default 100)")
    p.add_argument("--num-epochs", type=float,
                   help="passes over the data instead of --max-steps (steps = ceil(epochs x sequences / global batch))")
    g = p.add_argument_group("plan knobs (runs without --plan; with --plan they must agree with it)")
    add_knob_flags(g, "run")  # memkit/plan/plan.py declares each knob; None = not given (plan.json decides)
    o = p.add_argument_group("optimisation")
    o.add_argument("--lr", type=float, default=None,
                   help="peak LR at --ref-batch-size (default 2e-5 for full fine-tuning, 2e-4 for LoRA/QLoRA: "
                        "memkit.train.config.default_lr)")
    o.add_argument("--scale-lr", choices=("none", "linear", "sqrt"), default="none",
                   help="scale --lr from --ref-batch-size to the plan's global batch")
    o.add_argument("--ref-batch-size", type=int, help="global batch (sequences) --lr was tuned for")
    o.add_argument("--warmup-steps", type=int, default=0)
    o.add_argument("--lr-decay", choices=("cosine", "linear", "constant"), default="cosine")
    o.add_argument("--min-lr-ratio", type=float, default=0.1)
    o.add_argument("--weight-decay", type=float, default=0.0)
    o.add_argument("--seed", type=int, default=0)
    o.add_argument("--no-shuffle", action="store_true")
    c = p.add_argument_group("checkpoints and measurement")
    c.add_argument("--save-every", type=int, default=0, help="checkpoint every N steps (0: only on "
                                                              "SIGTERM/SIGINT)")
    c.add_argument("--save-every-minutes", type=float, default=DEFAULT_SAVE_EVERY_MINUTES,
                   help=f"also checkpoint when this many minutes passed since the last one (default "
                        f"{DEFAULT_SAVE_EVERY_MINUTES:g}: an unannounced kill loses at most that; 0: never by time)")
    c.add_argument("--preempt-grace", type=float, default=DEFAULT_PREEMPT_GRACE_S, metavar="SECONDS",
                   help=f"after SIGTERM/SIGINT/SIGUSR1 every rank checkpoints at the next step boundary and "
                        f"exits; repeats of the signal are ignored this long (default {DEFAULT_PREEMPT_GRACE_S:g}, "
                        "under Slurm's 30 s KillWait); SIGUSR1 is checkpoint-and-exit")
    c.add_argument("--keep-checkpoints", type=int, default=2)
    c.add_argument("--resume", nargs="?", const="latest", default=None,
                   help="continue from the newest checkpoint in --output-dir, or from PATH")
    c.add_argument("--no-save-final", action="store_true", help="do not write output-dir/final")
    c.add_argument("--measure", choices=("auto", "off"), default="auto",
                   help="auto: CUDA allocator counters, or live-tensor tracking on CPU")
    c.add_argument("--no-progress", action="store_true")
    c.add_argument("--report-json", help="also write the end report here")
    c.add_argument("--dist-timeout-s", type=int, default=1800)
    c.add_argument("--report-to", choices=REPORT_TO, default="tensorboard",
                   help="tensorboard: event files in output-dir/tensorboard (default); wandb (offline unless "
                        "WANDB_MODE=online); mlflow (MLFLOW_TRACKING_URI, else output-dir/mlruns); none")
    c.add_argument("--overwrite", action="store_true",
                   help="replace a run already in --output-dir (default: refuse)")
    d = p.add_argument_group("data")
    d.add_argument("--packing", choices=("on", "off", "isolated"), default=None,
                   help="isolated: pack examples, each attending only to itself (per-example position ids; the "
                        "default where the model allows it); on: fill each sequence with several documents/"
                        "examples, a packed example attending to the earlier ones; off: one per sequence")
    d.add_argument("--truncate", action="store_true",
                   help="cut an example longer than --seq-len to its first --seq-len tokens (default: refuse it)")
    d.add_argument("--eval-data", help="held-out data (any --data format) for the eval loss")
    d.add_argument("--eval-fraction", type=float, default=0.0,
                   help="hold out this fraction of --data's records for the eval loss")
    d.add_argument("--eval-every", type=int, default=0, help="eval loss every N steps (default: at the end)")
    c.add_argument("--debug-signal-at-step", type=int, help=argparse.SUPPRESS)
    c.add_argument("--debug-crash-in-save-at-step", type=int, help=argparse.SUPPRESS)
    c.add_argument("--debug-signal-in-save-at-step", type=int, help=argparse.SUPPRESS)
    c.add_argument("--debug-offload-copy-on-cpu", action="store_true", help=argparse.SUPPRESS)


def plan_flags(args: argparse.Namespace) -> dict:
    """plan field -> its flag's value (None: not given) for every knob the runner takes (memkit/plan/plan.py)."""
    return knob_values(args, "run")


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """What a run starts from, every part checked against the others before any process group
    exists (`prepare`)."""

    plan: TrainingPlan | None
    """plan.json's plan; None for a run from flags (and a DeepSpeed file) alone."""
    plan_doc: dict | None
    flags: dict
    """Plan knobs given as flags (None: not given); with a plan they agree with it."""
    run: RunConfig
    source: ModelSource
    model_config: Any
    """The transformers config the model is built from."""
    tokenizer: Any
    data: Any
    init_note: str = ""
    """One line on where the weights come from (pretrained folder, or fresh with the reason)."""
    packing: str = "on"
    """--packing as run (the default resolved: memkit.train.data.resolve_packing), and why when defaulted."""
    packing_note: str = ""


def prepare(args: argparse.Namespace, *, launched: bool = True) -> Prepared:
    """Everything that can fail on bad input, before any process group exists: the plan and
    every plan flag against it, the model, the split against the model and the launch, the
    tokenizer and the data. launched=False (`memkit train`, before it starts the launcher) skips
    the launched-world checks."""
    from memkit.train.config import (check_flags, check_split, default_lr, plan_model_name, read_plan_file,
                                     scaled_lr)
    from memkit.train.data import prepare_data
    from memkit.train.model import choose_init, data_task, load_config, max_positions, resolve_model
    from memkit.train.output_dir import check_output_dir
    from memkit.train.tokenizer import load_tokenizer

    plan, plan_doc = (None, None)
    if args.plan:
        plan, plan_doc = read_plan_file(args.plan)
    flags = plan_flags(args)
    if plan is not None:
        check_flags(plan, flags)  # --micro-batch-size 4 against a plan of 2: one line, before any rank starts
    from memkit.train.techniques import refuse_on_cpu

    refuse_on_cpu(plan if plan is not None else TrainingPlan(**{k: v for k, v in flags.items()
                                                               if k in ("loss", "optimizer") and v}))
    model_name = args.model or (plan_model_name(plan_doc) if plan_doc else None)
    if not model_name:
        raise MemkitError("no model: pass --model (folder, config.json or catalog name) or a --plan "
                          "that names one")
    source, init, init_note = choose_init(resolve_model(model_name), args.init)  # refuses silent random weights
    if plan is not None and (plan.tp > 1 or plan.pp > 1):
        check_split(plan, plan_doc, config_path=source.config_path, model_name=model_name,
                    env=dict(os.environ) if launched else None)
    from memkit.train.split_checkpoint import check_resume_layout

    check_resume_layout(plan, args.resume, Path(args.output_dir))
    config = load_config(source, trust_remote_code=args.trust_remote_code)
    seq_len = flags["seq_len"] or (plan.seq_len if plan else None)
    if seq_len is None:
        raise MemkitError("no sequence length: pass --seq-len or a --plan")
    task = data_task(plan if plan is not None else TrainingPlan(**{  # seq2seq / classifiers: plan.json's task
        k: (tuple(v) if k == "lora_targets" else v) for k, v in flags.items() if v is not None}), config)
    tokenizer = load_tokenizer(source.folder, vocab_size=config.vocab_size,
                               require_eos=task.task in ("causal-lm", "seq2seq"))
    if args.max_steps is not None and args.num_epochs is not None:
        raise MemkitError(f"--max-steps {args.max_steps} and --num-epochs {args.num_epochs:g} both given; use one")
    check_output_dir(Path(args.output_dir), resume=args.resume, overwrite=args.overwrite)
    from memkit.train.loggers import check_report_to

    check_report_to(args.report_to)
    from memkit.train.data import resolve_packing

    if task.is_lm:
        packing, packing_note = resolve_packing(args.packing, config, pipeline=plan is not None and plan.pp > 1)
    elif args.packing in ("on", "isolated"):
        raise MemkitError(f"--packing {args.packing}: a {task.task} run trains one example per sequence "
                          "(memkit.train.task_data); drop --packing or pass --packing off")
    else:
        packing, packing_note = "off", f"{task.task} examples are one per sequence"
    data = prepare_data(args.data, tokenizer, seq_len=seq_len, max_positions=max_positions(config),
                        vocab_size=config.vocab_size, seed=args.seed, packing=packing != "off",
                        eval_source=args.eval_data, eval_fraction=args.eval_fraction, truncate=args.truncate,
                        isolate=packing == "isolated", task=task)
    if packing_note and data.kind == "text":  # isolation is for examples; a text stream packs GPT-style
        packing, packing_note = "on", "the default for text"
    micro = flags["micro_batch_size"] or (plan.micro_batch_size if plan else 1)
    accum = flags["grad_accum"] or (plan.grad_accum if plan else 1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    global_batch = micro * accum * (plan.dp if plan is not None and (plan.tp > 1 or plan.pp > 1) else world)
    base_lr, lr_note = (args.lr, "") if args.lr is not None else default_lr(
        flags["lora_rank"] if flags["lora_rank"] is not None else (plan.lora_rank if plan else 0))
    lr, note = scaled_lr(base_lr, rule=args.scale_lr, global_batch_size=global_batch,
                         ref_batch_size=args.ref_batch_size)
    note = "; ".join(n for n in (lr_note, note) if n)
    run = RunConfig(
        model=model_name, init=init, data=args.data, output_dir=Path(args.output_dir),
        max_steps=100 if args.max_steps is None else args.max_steps, num_epochs=args.num_epochs,
        eval_every=args.eval_every, report_to=args.report_to, overwrite=args.overwrite,
        lr=lr, base_lr=base_lr, lr_scaling_note=note, warmup_steps=args.warmup_steps,
        lr_decay=args.lr_decay, min_lr_ratio=args.min_lr_ratio, weight_decay=args.weight_decay,
        seed=args.seed, shuffle=not args.no_shuffle, save_every=args.save_every,
        save_every_minutes=args.save_every_minutes, preempt_grace_s=args.preempt_grace,
        keep_checkpoints=args.keep_checkpoints, resume=args.resume, save_final=not args.no_save_final,
        measure=args.measure, progress=not args.no_progress, dist_timeout_s=args.dist_timeout_s,
        report_json=Path(args.report_json) if args.report_json else None,
        debug_signal_at_step=args.debug_signal_at_step,
        debug_crash_in_save_at_step=args.debug_crash_in_save_at_step,
        debug_signal_in_save_at_step=args.debug_signal_in_save_at_step,
        debug_offload_copy_on_cpu=args.debug_offload_copy_on_cpu,
        debug_oom_at_step=_env_int("MEMKIT_DEBUG_OOM_AT_STEP")).validate()
    if flags["seq_len"] is None and plan is None:
        flags["seq_len"] = seq_len
    return Prepared(plan=plan, plan_doc=plan_doc, flags=flags, run=run, source=source, model_config=config,
                    tokenizer=tokenizer, data=data, init_note=init_note, packing=packing, packing_note=packing_note)


PACKING_RULES = {
    ("text", True): "documents joined by EOS and cut every {L} tokens (GPT-style: a document attends to the "
                    "ones before it in its sequence; the EOS marks each boundary)",
    ("text", False): "one document per sequence, padded; a longer one continues in the next sequence",
    ("examples", True): "whole examples share a sequence while they fit, none split; each is trained on its own "
                        "labels, and attends to the earlier examples in its sequence (--packing isolated: each only "
                        "to itself; off: one per sequence)",
    ("examples", False): "one example per sequence, padded (no example sees another)",
    ("examples", "isolated"): "whole examples share a sequence while they fit, none split; each attends only to "
                              "itself (positions restart at each example: a block-diagonal causal mask)",
    ("text", "isolated"): "documents joined by EOS and cut every {L} tokens (isolation applies to examples only)",
}
"""What --packing does to each kind of data (memkit.train.data._pack_text / _pack_examples / _one_per_row)."""


def start_lines(prepared: "Prepared", *, world: int, packing, packing_note: str = "") -> list[str]:
    """What the run will do, printed before it starts: data, epochs and steps, tokens per step,
    packing and its boundary rule, eval and checkpoint cadence, where the logs go."""
    from memkit.train.config import steps_for_epochs

    run, data, plan, flags = prepared.run, prepared.data, prepared.plan, prepared.flags
    micro = flags["micro_batch_size"] or (plan.micro_batch_size if plan else 1)
    accum = flags["grad_accum"] or (plan.grad_accum if plan else 1)
    dp = plan.dp if plan is not None else world
    batch = micro * accum * dp
    if run.num_epochs is not None:
        steps = steps_for_epochs(run.num_epochs, num_sequences=data.num_sequences, global_batch_size=batch)
        how = f"--num-epochs {run.num_epochs:g}"
    else:
        steps, how = run.max_steps, "--max-steps" if run.max_steps != 100 else "the default --max-steps"
    epochs = steps * batch / data.num_sequences
    target = f" -> targets of {data.target_len}" if data.target_len else ""
    lines = [f"data: {data.num_sequences:,} sequences of {data.seq_len} tokens{target} from {data.source} ({data.kind}, "
             f"{data.num_documents:,} records)"
             + (f"; {data.num_truncated:,} example(s) cut to {data.seq_len} tokens (--truncate)" if data.num_truncated
                else ""),
             f"steps: {steps:,} ({how}) = {epochs:.3g} epoch(s); {batch} sequences x {data.seq_len} = "
             f"{batch * data.seq_len:,} tokens per step (micro {micro} x accum {accum} x dp {dp})"]
    if data.kind != "synthetic":
        rule = PACKING_RULES[("text" if data.kind == "text" else "examples", packing)]
        shown = packing if isinstance(packing, str) else ("on" if packing else "off")
        lines.append(f"packing {shown}{f' ({packing_note})' if packing_note else ''}: {rule.format(L=data.seq_len)}")
    if data.eval is not None:
        every = f"every {run.eval_every} steps and at the end" if run.eval_every else "at the end"
        lines.append(f"eval: {every}, on {data.eval.num_sequences:,} sequences of {data.eval.source}")
    else:
        lines.append("eval: none (no eval split; --eval-fraction 0.02 or --eval-data FILE adds one)")
    out = run.output_dir
    if run.save_every:
        lines.append(f"checkpoints: every {run.save_every} steps in {out / 'checkpoints'} (newest "
                     f"{run.keep_checkpoints} kept), and on SIGTERM/SIGINT")
    else:
        lines.append(f"checkpoints: on SIGTERM/SIGINT only, in {out / 'checkpoints'} (--save-every N adds periodic ones)")
    board = {"tensorboard": f"; TensorBoard: {out / 'tensorboard'}", "none": ""}.get(
        run.report_to, f"; metrics also to {run.report_to}")
    lines.append(f"logs: {out / 'log.jsonl'}{board}; final model: "
                 + (f"{out / 'final'}" if run.save_final else "not saved (--no-save-final)"))
    return lines


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return int(value) if value else None


def _oom_report(args, where: str, message: str) -> None:
    import torch

    rank = int(os.environ.get("RANK", "0"))
    peak = int(torch.cuda.max_memory_allocated()) if torch.cuda.is_available() else None
    reserved = int(torch.cuda.max_memory_reserved()) if torch.cuda.is_available() else None
    report = {"status": "oom", "where": where, "error": message, "rank": rank,
              "measured": {"allocated_peak_bytes": peak, "reserved_peak_bytes": reserved}}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"oom.rank{rank}.json").write_text(json.dumps(report, indent=1))
    if args.report_json:
        Path(args.report_json).write_text(json.dumps(report, indent=1))
    sys.stderr.write(f"finetune: out of memory on rank {rank} at {where}: {message}\n")


def set_alloc_conf(environ=os.environ, wanted: str | None = None) -> str:
    """Set PYTORCH_CUDA_ALLOC_CONF (c10/cuda/CUDAAllocatorConfig.cpp parses it when the allocator
    initialises, so before CUDA starts) to the plan's setting (`wanted`, TrainingPlan.alloc_conf,
    ALLOC_CONF_ENV; default the knob's) unless the user set it; return a one-line note when the user's
    setting differs from the plan's (else '')."""
    wanted = wanted or TrainingPlan().alloc_conf
    user = environ.get("PYTORCH_CUDA_ALLOC_CONF")
    if user is None:
        if ALLOC_CONF_ENV[wanted]:
            environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF_ENV[wanted]
        return ""
    if alloc_conf_of(user) == wanted:
        return ""
    return (f"PYTORCH_CUDA_ALLOC_CONF={user!r} is yours and kept; the plan was priced with --alloc-conf {wanted} "
            f"({ALLOC_CONF_ENV[wanted] or 'unset'}), so the run's reserved memory can differ from the estimate")


def main(argv: list[str] | None = None) -> NoReturn:
    """The runner's process: runs (run_finetune) and ends the process with its exit code
    (memkit.errors.exit_now; nothing the run keeps is left in the process by then: a checkpoint is
    fsynced and published before save returns (memkit.train.checkpoint), log.jsonl is reopened and
    closed per record (loop.py JsonlLog), the final folder and --report-json are written and closed
    and the metrics logger closed (loop.py _finish), and every rank has passed the last barrier
    (loop.py cleanup_distributed)).
    --help and an argparse usage error leave through SystemExit as usual; an unexpected exception
    through the interpreter (a traceback)."""
    exit_now(_collected(argv))  # a stopping run's handlers stay installed through the exit (loop.py StopFlag)


def run_finetune(argv: list[str] | None = None) -> int:
    """Parse, check, train; the exit code (module docstring). For in-process callers: the caller's
    signal handlers are back when it returns, whatever the outcome (the run installs its StopFlag
    before anything slow: memkit/train/loop.py)."""
    from memkit.train.loop import restore_stop_flag

    try:
        return _collected(argv)
    finally:
        restore_stop_flag()


def _collected(argv: list[str] | None) -> int:
    """_run_finetune with the garbage collector paused through set-up (memkit/train/collector.py;
    train() resumes it before step 1) and as it was once the run returns."""
    from memkit.train import collector

    collector.pause()
    try:
        return _run_finetune(argv)
    finally:
        collector.restore()


def _run_finetune(argv: list[str] | None) -> int:
    from memkit.validate import check_args, harden

    parser = argparse.ArgumentParser(prog="finetune", description=HELP)
    add_arguments(parser)
    args = harden(parser).parse_args(argv)  # ASCII integers, finite floats
    rank = int(os.environ.get("RANK", "0"))
    # torch.distributed deprecation notices that DeepSpeed triggers on every collective.
    warnings.filterwarnings("ignore", message=r".*`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if hasattr(signal, "SIGUSR2"):  # `kill -USR2 PID` prints every thread's stack (hang diagnosis)
        faulthandler.register(signal.SIGUSR2, all_threads=True)
    from memkit.train.loop import StopFlag

    # Before anything slow: a stop signal during setup is kept and acted on at the first step boundary.
    StopFlag(args.preempt_grace if args.preempt_grace > 0 else DEFAULT_PREEMPT_GRACE_S).install()
    try:
        check_args(args)  # ranges, paths, data, --resume: one line before any process group
        prepared = prepare(args)
    except MemkitError as exc:
        if rank == 0:
            sys.stderr.write(f"finetune: error: {exc}\n")
        return exc.exit_code
    run = prepared.run
    # before CUDA starts (prepare builds no CUDA tensor): the allocator the plan was priced with
    alloc_note = set_alloc_conf(wanted=prepared.plan.alloc_conf if prepared.plan is not None
                                else prepared.flags.get("alloc_conf"))
    if rank == 0 and alloc_note:
        sys.stderr.write(f"finetune: {alloc_note}\n")
    if rank == 0 and prepared.init_note:
        sys.stderr.write(f"finetune: weights: {prepared.init_note}\n")
    if rank == 0:
        packing = {"on": True, "off": False}.get(prepared.packing, prepared.packing)
        for line in start_lines(prepared, world=int(os.environ.get("WORLD_SIZE", "1")), packing=packing,
                                packing_note=prepared.packing_note):
            sys.stderr.write(f"memkit: {line}\n")

    import torch

    from memkit.train.loop import EXIT_OOM, OutOfMemory, cleanup_distributed, train

    tracker = None
    if args.measure == "auto" and not torch.cuda.is_available():
        from memkit.measure.live_tensors import LiveTensorTracker

        tracker = LiveTensorTracker(keep_history=False)
    try:
        with tracker if tracker is not None else _Null():
            report = train(plan_in=prepared.plan, flags=prepared.flags, run=run, data=prepared.data,
                           tokenizer=prepared.tokenizer, model_source=prepared.source,
                           model_config=prepared.model_config, plan_doc=prepared.plan_doc, tracker=tracker)
    except MemkitError as exc:
        if rank == 0:
            sys.stderr.write(f"finetune: error: {exc}\n")
        exit_now(exc.exit_code)  # peers may wait in a collective; do not hang in teardown
    except (OutOfMemory, torch.OutOfMemoryError) as exc:
        where = getattr(exc, "where", "init")
        _oom_report(args, where, str(exc).splitlines()[0] if str(exc) else "out of memory")
        exit_now(EXIT_OOM)  # the launcher then stops the other ranks
    cleanup_distributed()
    return int(report.get("exit_code", 0))


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


if __name__ == "__main__":
    main()
