"""memkit verify: run a few steps of a plan on this machine; print predicted vs measured.

It starts `accelerate launch --config_file <plan dir>/accelerate.yaml -m memkit.finetune` for
--steps optimizer steps on synthetic tokens (or --data), then reads the run's report. Running
out of memory is a result, not a crash: the report says where, and the next-ranked plan from
plan.json's alternatives that is predicted to need less memory. A run that does not finish
within --timeout-s is stopped (the whole process group) and reported.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from memkit.cli.launching import child_env, deepspeed_file, launch_command, launchable_config, quote
from memkit.errors import MemkitError
from memkit.units import format_bytes

HELP = "run a few steps of a plan here; compare measured peak memory and speed with the prediction"
EXIT_OOM = 3
EXIT_FAILED = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--plan", required=True, help="plan.json written by `memkit suggest --out DIR`, or DIR")
    p.add_argument("--config-file", help="accelerate config (default: accelerate.yaml beside plan.json)")
    p.add_argument("--model", help="model folder/config/catalog name (default: plan.json's model)")
    p.add_argument("--data", default="synthetic", help="training data (default: synthetic tokens)")
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to run (default 5)")
    p.add_argument("--output-dir", help="where the run writes (default: a temporary folder)")
    p.add_argument("--timeout-s", type=int, default=1200, help="stop the run after this (default 1200)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")
    from memkit.cli.train import add_port_argument

    add_port_argument(p)


def run(args: argparse.Namespace) -> int:
    from memkit.cli.launching import plan_path
    from memkit.cli.train import with_port
    from memkit.train.config import read_plan_file

    args.plan = plan_path(args.plan)  # a bundle folder: its plan.json, and accelerate.yaml beside it
    plan, doc = read_plan_file(args.plan)
    if args.steps < 1:
        raise MemkitError(f"--steps {args.steps} must be >= 1")
    from memkit.validate import check_launch_files

    config_file, acc, _, _ = check_launch_files(plan, plan_path=args.plan, config_file=args.config_file)
    if config_file is None:
        raise MemkitError(f"no accelerate config beside {args.plan}; pass --config-file (memkit suggest --out "
                          "writes accelerate.yaml next to plan.json)")
    _check_devices(acc, config_file)
    _check_op_builds(plan, acc, config_file)
    out_dir = Path(args.output_dir or tempfile.mkdtemp(prefix="memkit-verify-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    report_path = out_dir / "report.json"
    if report_path.exists():
        report_path.unlink()
    finetune_args = ["--plan", args.plan, "--data", args.data, "--output-dir", str(out_dir),
                     "--max-steps", str(args.steps), "--no-save-final", "--no-progress",
                     "--report-json", str(report_path), "--lr", "1e-5", "--warmup-steps", "0",
                     "--overwrite",  # a scratch run: a repeated verify replaces the last one
                     "--init", "random"]  # memory and speed do not depend on the weights' values
    if args.model:
        finetune_args += ["--model", args.model]
    log_path = out_dir / "launch.log"
    if not args.json:
        print(f"memkit verify: {args.steps} steps of {args.plan} under {config_file} (log: {log_path})",
              file=sys.stderr)
    with launchable_config(config_file) as launched:  # a preset's repository-relative paths, resolved
        cmd = with_port(launch_command(launched, finetune_args), args.main_process_port)
        status, returncode = _run(cmd, log_path, timeout_s=args.timeout_s)
    if status == "signal":
        print(f"memkit verify: stopped by a signal; the launcher and every rank are stopped (log: {log_path})",
              file=sys.stderr)
        return returncode
    report = _read_report(report_path, out_dir)
    if report is None:
        report = {"status": status if status != "ok" else "failed", "returncode": returncode,
                  "error": _tail(log_path)}
    report["command"] = quote(with_port(launch_command(config_file, finetune_args), args.main_process_port))
    report["log"] = str(log_path)
    if report["status"] == "oom":
        report["next_plan"] = next_ranked_plan(doc)
    if report["status"] == "ok":
        try:
            report["profile_runs"] = record_in_profile(report, doc, plan, args.model)
        except (MemkitError, OSError, KeyError) as exc:  # the run's result stands without the profile
            report["profile_error"] = str(exc)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        sys.stdout.write("\n")
    else:
        print(render(report, doc))
    if report["status"] == "ok":
        return 0
    return EXIT_OOM if report["status"] == "oom" else EXIT_FAILED


def _check_devices(acc: dict, path: Path) -> None:
    import torch

    wanted = int(acc.get("num_processes", 1)) // max(1, int(acc.get("num_machines", 1)))
    if torch.cuda.is_available() and torch.cuda.device_count() < wanted:
        raise MemkitError(f"{path} starts {wanted} processes per machine but this machine has "
                          f"{torch.cuda.device_count()} GPU(s); verify on a machine like the plan's, or make a "
                          f"plan for {torch.cuda.device_count()} GPU(s)")


def _check_op_builds(plan, acc: dict, config_file: Path) -> None:
    """Before launching: stale DeepSpeed build locks are removed with a line (the ranks would wait
    on them forever, silently, in the log) and the ops the run needs are built here, announced
    (memkit.train.ops.prepare_ops)."""
    from memkit.train.ops import announce_builds

    ds_file = (acc.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if not ds_file:
        return
    try:
        ds_config = json.loads(deepspeed_file(acc, config_file).read_text())
    except (OSError, json.JSONDecodeError, MemkitError):
        return  # the runner reports a missing or broken DeepSpeed file itself
    import contextlib

    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import; --json owns it
        announce_builds(plan, ds_config)


def _run(cmd: list[str], log_path: Path, *, timeout_s: int) -> tuple[str, int | None]:
    """Run the launch; SIGTERM/SIGINT/SIGUSR1 stop the launcher and its ranks (memkit.train.supervise),
    the launcher relaying each to the ranks as under `memkit train` (launcher_env: torchrun handles
    SIGUSR1 instead of dying of it and waits the ranks' grace)."""
    from memkit.train.supervise import SHUTDOWN_MARGIN_S, Supervisor, launcher_env
    from memkit.train.config import DEFAULT_PREEMPT_GRACE_S

    env = launcher_env(child_env(), preempt_grace_s=DEFAULT_PREEMPT_GRACE_S)
    with open(log_path, "w") as log:
        return Supervisor(cmd, env=env, stdout=log, grace_s=DEFAULT_PREEMPT_GRACE_S + 2 * SHUTDOWN_MARGIN_S).run(
            timeout_s=timeout_s)


def _read_report(report_path: Path, out_dir: Path) -> dict | None:
    if report_path.is_file():
        return json.loads(report_path.read_text())
    ooms = sorted(out_dir.glob("oom.rank*.json"))
    if ooms:
        return json.loads(ooms[0].read_text())
    return None


def _tail(path: Path, num_lines: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


def next_ranked_plan(doc: dict) -> dict | None:
    """The first alternative in plan.json predicted to need less device memory than the plan."""
    base = (doc.get("estimate") or {}).get("allocated_peak_bytes")
    for alt in doc.get("alternatives") or []:
        if not isinstance(alt, dict):
            continue
        est = alt.get("estimate") or {}
        peak = est.get("allocated_peak_bytes", alt.get("allocated_peak_bytes"))
        if base is None or peak is None or peak < base:
            return alt
    return None


def _plan_line(plan: dict) -> str:
    keys = ("precision", "zero_stage", "offload_optimizer", "offload_params", "checkpointing", "loss",
            "micro_batch_size", "grad_accum", "lora_rank", "quantize_base")
    keys += ("offload_activations", "optimizer_in_backward")  # memkit/plan/backward_techniques.py
    return ", ".join(f"{k}={plan[k]}" for k in keys if k in plan)


def render(report: dict, doc: dict) -> str:
    from memkit.train.report import render_report

    status = report["status"]
    if status == "ok":
        return render_report(report)
    if status == "oom":
        predicted = (doc.get("estimate") or {}).get("allocated_peak_bytes")
        measured = (report.get("measured") or {}).get("allocated_peak_bytes")
        lines = [f"memkit verify: OUT OF MEMORY at {report.get('where')} on rank {report.get('rank')}: "
                 f"{report.get('error')}"]
        lines.append(f"  predicted allocated peak {format_bytes(predicted) if predicted else '-'}; "
                     f"allocated when it failed {format_bytes(measured) if measured else '-'}")
        alt = report.get("next_plan")
        if alt:
            plan = alt.get("plan", alt)
            label = alt.get("label", "")
            lines.append(f"  next-ranked plan that should fit: {label} {_plan_line(plan)}".rstrip())
        else:
            lines.append("  plan.json lists no smaller alternative; rerun memkit suggest with a larger "
                         "--headroom or more GPUs")
        return "\n".join(lines)
    return (f"memkit verify: run {status} (exit code {report.get('returncode')}); last lines of "
            f"{report.get('log')}:\n{report.get('error', '')}")


def record_in_profile(report: dict, doc: dict, plan, model_arg: str | None) -> int:
    """Add this run's measured vs predicted peaks to the local calibration profile (memkit/profile.py).
    On CPU the measurement is live tensors, so the prediction compared is memkit's CPU estimate."""
    import torch

    from memkit import profile
    from memkit.spec.stack import installed

    measured = dict(report.get("measured") or {})
    if "device_used_peak_bytes" in measured:
        measured["nvidia_smi_peak_bytes"] = measured.pop("device_used_peak_bytes")
    hw_doc = doc.get("hardware") or {}
    if torch.cuda.is_available():
        device, predicted = hw_doc.get("gpu", "unknown"), doc.get("estimate") or {}
    else:
        from memkit.spec.resolve import resolve_model
        from memkit.train.report import cpu_priced

        config_path = resolve_model(model_arg or doc["model"]).config_path
        device, predicted = "cpu", cpu_priced(doc, plan, config_path)["estimate"]
        measured = {"allocated_peak_bytes": measured.get("allocated_peak_bytes")}
    return profile.record_run(device=device, stack=installed(), plan=plan, predicted=predicted, measured=measured)
