"""memkit's memory estimate against measured runs: real CPU training steps, then published GPU runs.

    python benchmarks/memory_accuracy.py [--calibration DIR] [--holdout FILE] [--verbose] [--worst N]

First table: tests/golden/cpu_measurements.json, real training steps of small HF models on CPU
(single process and 2-process DeepSpeed ZeRO 0-3, measured with memkit's live-tensor tracker;
regenerate with benchmarks/measure_cpu.py), against estimate_memory(..., device="cpu").

For every record of DIR/published_gpu_measurements.jsonl (default ../shared/calibration relative
to the repository root; sources cited in DIR/SOURCES.md) it prints the mapped configuration, the
measured and predicted GiB of the matching metric (alloc = max_memory_allocated, resv = peak
reserved, smi = nvidia-smi used, layer = one layer's saved activations) and the error, then the
median / mean absolute error per source, and the upper bound's coverage per framework left out
(its worst fold and pooled). Then the same for --holdout (benchmarks/data/holdout_memory.jsonl:
frameworks outside the calibration, never fitted), and both sets side by side. Rows marked '~' were mapped to the closest plan memkit
can express (reasons listed below the table); skipped rows say why. Accuracy is reported here,
never asserted.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from memkit.calibrate.published_memory import (Outcome, cases_for_record, framework_coverage, score, summarize,
                                               upper_bound)
from memkit.estimate.bounds import QUANTILE_LABEL, uncovered_kinds
from memkit.units import GIB

REPO = Path(__file__).resolve().parent.parent
DEFAULT_CALIBRATION = REPO.parent / "shared" / "calibration"
if not DEFAULT_CALIBRATION.is_dir() and (REPO.parent.parent / "shared" / "calibration").is_dir():
    DEFAULT_CALIBRATION = REPO.parent.parent / "shared" / "calibration"  # a worktree one level deeper
CONFIGS_DIR = Path(__file__).resolve().parent / "calibration_configs"
_METRIC_SHORT = {"allocated": "alloc", "reserved": "resv", "nvidia_smi": "smi", "block_saved": "layer", "-": "-"}


DEFAULT_HOLDOUT = Path(__file__).resolve().parent / "data" / "holdout_memory.jsonl"
"""Measured GPU runs from frameworks outside the calibration (benchmarks/data/SOURCES_holdout_memory.md),
scored here and kept out of every fit: memory_residuals.py reads only --calibration."""


def read_jsonl(path: Path) -> list[dict]:
    with Path(path).open() as fh:
        return [json.loads(line) for line in fh if line.strip()]


def read_records(calibration_dir: Path) -> list[dict]:
    return read_jsonl(Path(calibration_dir) / "published_gpu_measurements.jsonl")


def outcomes_of(records: list[dict]) -> list[Outcome]:
    return [score(case) for record in records for case in cases_for_record(record, configs_dir=CONFIGS_DIR)]


def published_outcomes(calibration_dir: Path) -> list[Outcome]:
    return outcomes_of(read_records(calibration_dir))


GOLDEN = REPO / "tests" / "golden" / "cpu_measurements.json"


def cpu_rows() -> list[tuple[str, str, int, int, str]]:
    """(row id, predicted phase, measured peak, predicted peak, plan summary) per golden row."""
    import tempfile

    from memkit.estimate.memory import estimate_memory
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(json.loads(GOLDEN.read_text())["rows"]):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(row["model_config"]))
            plan = TrainingPlan.from_dict(row["plan"])
            est = estimate_memory(load_model_spec(str(folder)), plan,
                                  Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=plan.num_gpus),
                                  device="cpu")
            measured = row["measured"]
            peak = measured.get("peak_bytes") or max(r["peak_bytes"] for r in measured["ranks"])
            summary = (f"{plan.engine} z{plan.zero_stage} {plan.precision} {plan.attention} "
                       f"ckpt={plan.checkpointing} mb{plan.micro_batch_size}x{plan.seq_len} "
                       f"acc{plan.grad_accum} dp{plan.dp}" + (f" lora{plan.lora_rank}" if plan.is_lora else "")
                       + (f" off={plan.offload_optimizer}" if plan.offload_optimizer != "none" else ""))
            out.append((row["id"], est.peak_phase, peak, est.allocated_peak_bytes, summary))
    return out


def render_cpu(rows) -> str:
    lines = ["# real CPU training steps (tests/golden/cpu_measurements.json), peak live-tensor bytes per rank",
             f"{'row':<30} {'plan':<58} {'measured MiB':>12} {'predicted':>10} {'error':>7}  phase"]
    errors = []
    for row_id, phase, measured, predicted, summary in rows:
        err = (predicted / measured - 1) * 100
        errors.append(abs(err))
        lines.append(f"{row_id:<30} {summary:<58} {measured / 2**20:12.2f} {predicted / 2**20:10.2f} "
                     f"{err:+6.1f}%  {phase}")
    errors.sort()
    lines.append(f"{len(errors)} rows: median |error| {errors[len(errors) // 2]:.1f}%, "
                 f"max {errors[-1]:.1f}%, within 5%: {sum(e <= 5 for e in errors)}/{len(errors)}")
    return "\n".join(lines)


def _gib(num_bytes: float | None) -> str:
    return "-" if num_bytes is None else f"{num_bytes / GIB:.2f}"


def _row(o: Outcome) -> str:
    c = o.case
    mark = "~" if c.approx else " "
    if c.kind == "skip":
        result = f"SKIP {c.skip_reason}"
        return f"{mark}{c.case_id:<44} {c.model_name:<24} {c.summary:<60} {'-':>5} {_gib(c.measured_bytes):>7} {'-':>7}  {result}"
    if o.error:
        result = f"ERROR {o.error}"
    elif c.kind in ("regression", "activation_probe"):
        result = f"{o.error_pct:+7.1f}%"
        if c.kind == "activation_probe":
            result += f"  {o.detail}"
        elif o.alternatives:
            result += "  " + " ".join(f"[{k}: {_gib(v)}]" for k, v in o.alternatives.items())
    else:
        verdict = "PASS" if o.passed else "FAIL"
        result = f"{verdict} {c.kind} {o.detail}"
        if o.alternatives:
            result += "  " + " ".join(f"[{k}: {_gib(v)}]" for k, v in o.alternatives.items())
    return (f"{mark}{c.case_id:<44} {c.model_name:<24} {c.summary:<60} {_METRIC_SHORT[c.metric]:>5} "
            f"{_gib(c.measured_bytes):>7} {_gib(o.predicted_bytes):>7}  {result}")


def _breakdown(o: Outcome) -> list[str]:
    est = o.estimate
    lines = [f"  {o.case.case_id}: peak phase {est.peak_phase}; allocated {_gib(est.allocated_peak_bytes)}, "
             f"reserved {_gib(est.reserved_peak_bytes)}, smi {_gib(est.nvidia_smi_peak_bytes)} GiB; measured "
             f"{_gib(o.case.measured_bytes)} ({o.case.metric})"]
    comps = sorted(est.components.items(), key=lambda kv: -kv[1])
    lines.append("    " + ", ".join(f"{k} {_gib(v)}" for k, v in comps))
    lines.append("    phases: " + ", ".join(f"{k} {_gib(v)}" for k, v in est.phases.items()))
    return lines


def _fmt(x: float) -> str:
    return "   -" if isinstance(x, float) and math.isnan(x) else f"{x:5.1f}"


def render(outcomes: list[Outcome], *, verbose: bool, worst: int) -> str:
    out = []
    header = (f" {'id':<44} {'model':<24} {'config':<60} {'what':>5} {'meas':>7} {'pred':>7}  error / check")
    out.append(header)
    out.append("-" * len(header))
    source = None
    for o in outcomes:
        if o.case.source_id != source:
            source = o.case.source_id
            out.append(f"# {source}")
        out.append(_row(o))

    out.append("")
    out.append("Approximations (rows marked ~):")
    seen: dict[str, list[str]] = {}
    for o in outcomes:
        for reason in o.case.approx:
            seen.setdefault(reason, []).append(o.case.case_id)
    for reason, ids in seen.items():
        out.append(f"  [{len(ids):2d}] {reason}")

    for title, exact in (("all mapped rows", False), ("exact-mapped rows only (no ~)", True)):
        out.append("")
        out.append(f"Summary, {title}: regression |error| %, signed mean %, >hdrm = % of rows measured above "
                   "predicted/0.9 (a plan sized to the 10% headroom would OOM), upper = % of rows at or under "
                   f"the {QUANTILE_LABEL} upper bound (margin computed without the row's framework), bound checks")
        out.append(f"  {'source':<40} {'n':>3} {'median':>7} {'mean':>7} {'signed':>7} {'>hdrm':>6} {'upper':>6}"
                   f"   {'probe n/med':>11}   {'bounds':>9} {'skip':>5} {'err':>4}")
        stats = summarize(outcomes, exact_only=exact)
        for name in sorted(stats, key=lambda k: (k == "ALL", k)):
            s = stats[name]
            probe = f"{s['n_probe']}/{_fmt(s['probe_median_abs_pct'])}" if s["n_probe"] else "-"
            out.append(f"  {name:<40} {s['n_regression']:>3} {_fmt(s['median_abs_pct']):>7} "
                       f"{_fmt(s['mean_abs_pct']):>7} {_fmt(s['mean_signed_pct']):>7} "
                       f"{_fmt(s['beyond_headroom_pct']):>6} {_fmt(s['upper_coverage_pct']):>6}   {probe:>11}   "
                       f"{s['bounds_pass']:>3}P/{s['bounds_fail']:<3}F {s['skipped']:>5} {s['errors']:>4}")

    out.append("")
    out.append(f"{QUANTILE_LABEL} upper-bound coverage by framework (margin computed without the framework; "
               "frameworks outside the calibration get the published margin):")
    cov = framework_coverage(outcomes)
    for name, (c, n) in sorted(cov.items()):
        out.append(f"  {name:<40} {n:>3} rows  {100 * c / n:5.1f}% under the bound")
    if cov:
        fold = min(cov, key=lambda k: cov[k][0] / cov[k][1])
        covered, total = sum(c for c, _ in cov.values()), sum(n for _, n in cov.values())
        out.append(f"  worst fold {fold} {100 * cov[fold][0] / cov[fold][1]:.1f}%, pooled {100 * covered / total:.1f}% "
                   f"of {total} rows")

    wide: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if o.case.kind == "regression" and o.error_pct is not None:
            for reason in uncovered_kinds(o.case.model, o.case.plan, variable_length=bool(o.case.sample_lengths)):
                wide.setdefault(reason.split(":")[0], []).append(o)
    if wide:
        out.append("Rows of a kind no calibration framework covers (bound widened to the largest dev "
                   "under-prediction, estimate/bounds.py uncovered_kinds):")
        for reason, rows in sorted(wide.items()):
            covered = sum(o.case.measured_bytes <= upper_bound(o) for o in rows)
            out.append(f"  {reason:<40} {len(rows):>3} rows  {100 * covered / len(rows):5.1f}% under the bound")

    if verbose:
        rows = [o for o in outcomes if o.estimate is not None and o.error_pct is not None]
        rows.sort(key=lambda o: -abs(o.error_pct))
        out.append("")
        out.append(f"Component breakdown of the {worst} worst regression rows:")
        for o in rows[:worst]:
            out.extend(_breakdown(o))
        fails = [o for o in outcomes if o.passed is False and o.estimate is not None]
        if fails:
            out.append("")
            out.append("Component breakdown of failed bound checks:")
            for o in fails:
                out.extend(_breakdown(o))
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", type=Path, default=DEFAULT_CALIBRATION,
                        help=f"folder holding published_gpu_measurements.jsonl (default {DEFAULT_CALIBRATION})")
    parser.add_argument("--holdout", type=Path, default=DEFAULT_HOLDOUT,
                        help=f"held-out measured runs, scored separately and never fitted (default {DEFAULT_HOLDOUT})")
    parser.add_argument("--verbose", action="store_true", help="component breakdown of the worst rows")
    parser.add_argument("--worst", type=int, default=10, help="how many worst rows --verbose breaks down")
    args = parser.parse_args(argv)
    print(render_cpu(cpu_rows()))
    print()
    if not (args.calibration / "published_gpu_measurements.jsonl").is_file():
        print(f"no published_gpu_measurements.jsonl in {args.calibration}; pass --calibration DIR", file=sys.stderr)
        return 2
    dev = published_outcomes(args.calibration)
    print("## DEV: the calibration the margins are chosen on")
    print(render(dev, verbose=args.verbose, worst=args.worst))
    if not args.holdout.is_file():
        print(f"no holdout file {args.holdout}; pass --holdout FILE", file=sys.stderr)
        return 2
    holdout = outcomes_of(read_jsonl(args.holdout))
    print()
    print(f"## HOLDOUT: {args.holdout.name}, frameworks outside the calibration, never fitted")
    print(render(holdout, verbose=args.verbose, worst=args.worst))
    print()
    print(side_by_side(dev, holdout))
    return 0


def side_by_side(dev: list[Outcome], holdout: list[Outcome]) -> str:
    """One line per set: the issue's four figures over all mapped regression rows."""
    lines = [f"{'set':<8} {'n':>3} {'median':>7} {'signed':>7} {'>hdrm':>6} {'upper':>6}"]
    for name, outcomes in (("dev", dev), ("holdout", holdout)):
        s = summarize(outcomes)["ALL"]
        lines.append(f"{name:<8} {s['n_regression']:>3} {_fmt(s['median_abs_pct']):>7} {_fmt(s['mean_signed_pct']):>7} "
                     f"{_fmt(s['beyond_headroom_pct']):>6} {_fmt(s['upper_coverage_pct']):>6}")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
