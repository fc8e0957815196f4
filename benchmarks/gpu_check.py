"""Measured vs predicted on one CUDA GPU: a matrix of short `memkit verify` runs.

    bash benchmarks/gpu_check.sh            # or: python benchmarks/gpu_check.py --budget-s 460

For each plan below (llama-3.2-1b built from its catalog config with fresh weights, one GPU),
write the bundle memkit suggest would write (accelerate.yaml, ds_config.json, plan.json with
memkit's estimate for this GPU), run `memkit verify` for a few steps, and tabulate predicted and
measured allocated / reserved peak and tokens/s. Results: benchmarks/results/gpu_check.{md,json}.
Plans run in order until --budget-s is spent; the rest are listed as skipped. DeepSpeed's
FusedAdam and CPU Adam kernels are JIT-built first (in parallel) so no run pays for compilation.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODEL = "llama-3.2-1b"

# (label, plan knobs). dp=1: one GPU. Every precision, checkpointing on/off, ZeRO 0-3 with and
# without offload, LoRA, seq 512-4096.
MATRIX = [
    ("fp32 z0 s512", dict(precision="fp32", zero_stage=0, micro_batch_size=4, seq_len=512)),
    ("bf16 z0 s2048", dict(precision="bf16", zero_stage=0, micro_batch_size=2, seq_len=2048)),
    ("bf16 z0 ckpt s4096", dict(precision="bf16", zero_stage=0, checkpointing="full", micro_batch_size=4,
                                seq_len=4096)),
    ("fp16 z0 s1024", dict(precision="fp16", zero_stage=0, micro_batch_size=4, seq_len=1024)),
    ("bf16 z1 s2048", dict(precision="bf16", zero_stage=1, micro_batch_size=2, seq_len=2048)),
    ("bf16 z2 ckpt s2048", dict(precision="bf16", zero_stage=2, checkpointing="full", micro_batch_size=8,
                                seq_len=2048)),
    ("bf16 z3 s2048", dict(precision="bf16", zero_stage=3, micro_batch_size=2, seq_len=2048)),
    ("bf16 lora16 z0 s2048", dict(precision="bf16", zero_stage=0, micro_batch_size=4, seq_len=2048,
                                  lora_rank=16, lora_targets=("q_proj", "k_proj", "v_proj", "o_proj"))),
    ("fp16 z2 ckpt s4096", dict(precision="fp16", zero_stage=2, checkpointing="full", micro_batch_size=2,
                                seq_len=4096)),
    ("bf16 z2 off-opt s2048", dict(precision="bf16", zero_stage=2, offload_optimizer="cpu", micro_batch_size=2,
                                   seq_len=2048)),
    ("bf16 z3 off-all ckpt s1024", dict(precision="bf16", zero_stage=3, offload_optimizer="cpu",
                                       offload_params="cpu", checkpointing="full", micro_batch_size=2,
                                       seq_len=1024)),
    ("fp32 z3 s1024", dict(precision="fp32", zero_stage=3, micro_batch_size=2, seq_len=1024)),
]


def write_plan_bundle(folder: Path, label: str, knobs: dict, gpu_name: str) -> Path:
    from memkit.emit.bundle import bundle_files, plan_document, write_bundle
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec

    spec = load_model_spec(MODEL)
    gpu = find_gpu(gpu_name)
    hardware = Hardware(gpu=gpu, num_gpus_per_node=1, num_nodes=1)
    plan = TrainingPlan(dp=1, grad_accum=1, **knobs).validate()
    doc = plan_document(model_name=MODEL, plan=plan, label=label,
                        hardware={"gpu": gpu.name, "num_gpus_per_node": 1, "num_nodes": 1},
                        memory=estimate_memory(spec, plan, hardware),
                        speed=estimate_step_time(spec, plan, hardware))
    write_bundle(str(folder), bundle_files(doc, out_dir=str(folder),
                                           largest_param_numel=spec.vocab_size * spec.hidden_size))
    return folder / "plan.json"


def prebuild_kernels() -> None:
    """JIT-build DeepSpeed's FusedAdam (GPU) and CPU Adam (offload) once, in parallel."""
    code = "from deepspeed.ops.op_builder import {0}; {0}().load()"
    procs = [subprocess.Popen([sys.executable, "-c", code.format(name)], cwd=REPO)
             for name in ("FusedAdamBuilder", "CPUAdamBuilder")]
    for proc in procs:
        proc.wait(timeout=400)


def run_verify(plan_path: Path, out_dir: Path, *, steps: int, timeout_s: int) -> dict:
    cmd = [sys.executable, "-m", "memkit.cli.main", "verify", "--plan", str(plan_path), "--model", MODEL,
           "--steps", str(steps), "--timeout-s", str(timeout_s), "--output-dir", str(out_dir), "--json"]
    started = time.monotonic()
    result = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=timeout_s + 60)
    try:
        report = json.loads(result.stdout)
    except json.JSONDecodeError:
        report = {"status": "failed", "error": (result.stdout + result.stderr)[-2000:]}
    report["wall_s"] = time.monotonic() - started
    return report


def _gib(value) -> str:
    return "-" if value is None else f"{value / 2**30:.2f}"


def _ratio(measured, predicted) -> str:
    return "-" if not measured or not predicted else f"{measured / predicted:.2f}"


def table(rows: list[dict], gpu_name: str) -> str:
    lines = [f"# memkit gpu_check: {MODEL} on one {gpu_name}", "",
             "Allocated/reserved: torch.cuda.max_memory_allocated/_reserved over the run (GiB); "
             "predicted: memkit's estimate in plan.json (reserved from its allocator replay); upper: "
             "reserved_peak_upper_bytes (prediction + the margin of estimate/bounds.py), 'ok' when the measurement is under it. "
             "tokens/s: median step after the first.", "",
             "| plan | status | alloc pred | alloc meas | ratio | reserved pred | reserved meas | ratio "
             "| reserved upper | tok/s pred | tok/s meas | ratio | MFU meas |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        rep = row["report"]
        pred, meas = rep.get("predicted") or {}, rep.get("measured") or {}
        mfu = meas.get("mfu")
        upper = row.get("reserved_upper_bytes")
        within = "" if not (upper and meas.get("reserved_peak_bytes")) else (
            " ok" if meas["reserved_peak_bytes"] <= upper else " EXCEEDED")
        lines.append(
            f"| {row['label']} | {rep.get('status')} | {_gib(pred.get('allocated_peak_bytes'))} | "
            f"{_gib(meas.get('allocated_peak_bytes'))} | "
            f"{_ratio(meas.get('allocated_peak_bytes'), pred.get('allocated_peak_bytes'))} | "
            f"{_gib(pred.get('reserved_peak_bytes'))} | {_gib(meas.get('reserved_peak_bytes'))} | "
            f"{_ratio(meas.get('reserved_peak_bytes'), pred.get('reserved_peak_bytes'))} | "
            f"{_gib(upper)}{within} | "
            f"{pred.get('tokens_per_s', 0):,.0f} | {meas.get('tokens_per_s') or 0:,.0f} | "
            f"{_ratio(meas.get('tokens_per_s'), pred.get('tokens_per_s'))} | "
            f"{'-' if mfu is None else f'{mfu:.1%}'} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budget-s", type=int, default=460, help="stop starting runs after this (default 460)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--per-run-timeout-s", type=int, default=150)
    parser.add_argument("--work-dir", default="/tmp/memkit-gpu-check")
    parser.add_argument("--results", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU here", file=sys.stderr)
        return 2
    gpu_name = torch.cuda.get_device_name(0)
    started = time.monotonic()
    prebuild_kernels()
    print(f"gpu_check: kernels ready after {time.monotonic() - started:.0f}s", file=sys.stderr)
    work = Path(args.work_dir)
    rows = []
    for label, knobs in MATRIX:
        folder = work / label.replace(" ", "_")
        elapsed = time.monotonic() - started
        if elapsed > args.budget_s:
            rows.append({"label": label, "knobs": knobs, "report": {"status": "skipped (time budget)"}})
            continue
        try:
            plan_path = write_plan_bundle(folder, label, knobs, gpu_name)
            upper = json.loads(plan_path.read_text())["estimate"].get("reserved_peak_upper_bytes")
            report = run_verify(plan_path, folder / "run", steps=args.steps, timeout_s=args.per_run_timeout_s)
        except Exception as exc:  # record and go on: one bad plan must not hide the others
            upper, report = None, {"status": "error", "error": f"{type(exc).__name__}: {exc}"}
        rows.append({"label": label, "knobs": knobs, "report": report, "reserved_upper_bytes": upper})
        print(f"gpu_check: {label}: {report.get('status')} ({report.get('wall_s', 0):.0f}s)", file=sys.stderr)
    results = Path(args.results)
    results.mkdir(parents=True, exist_ok=True)
    text = table(rows, gpu_name)
    (results / "gpu_check.md").write_text(text)
    (results / "gpu_check.json").write_text(json.dumps({"gpu": gpu_name, "model": MODEL, "rows": rows},
                                                       indent=1, default=str))
    print(text)
    print(f"gpu_check: total {time.monotonic() - started:.0f}s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
