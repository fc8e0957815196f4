"""memkit's memory estimate against real CPU steps of the state-space, hybrid, encoder-decoder and
encoder families (issue #27): per row and per family, the median and worst |error|.

    python benchmarks/arch_accuracy.py [--golden tests/golden/cpu_measurements_arch.json] [--rows]

The rows are measured by benchmarks/measure_cpu_arch.py with the project's live-tensor tracker
(memkit/calibrate/cpu_step.py); the estimate is estimate_memory(..., device="cpu"), as in
tests/unit/test_estimate_measured_arch.py. Accuracy is reported here, never asserted.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
GOLDEN = REPO / "tests" / "golden" / "cpu_measurements_arch.json"


def errors(golden: Path) -> list[tuple[str, str, int, int, float]]:
    """(family, row id, measured peak, estimated peak, signed relative error) per golden row."""
    from memkit.estimate.memory import estimate_memory
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import load_model_spec

    out = []
    with tempfile.TemporaryDirectory() as tmp:
        for i, row in enumerate(json.loads(golden.read_text())["rows"]):
            folder = Path(tmp) / str(i)
            folder.mkdir()
            (folder / "config.json").write_text(json.dumps(row["model_config"]))
            plan = TrainingPlan.from_dict(row["plan"])
            est = estimate_memory(load_model_spec(str(folder)), plan,
                                  Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1), device="cpu")
            peak = row["measured"]["peak_bytes"]
            out.append((row["arch"], row["id"], peak, est.allocated_peak_bytes,
                        (est.allocated_peak_bytes - peak) / peak))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--golden", type=Path, default=GOLDEN)
    parser.add_argument("--rows", action="store_true", help="print every row, not only the families")
    args = parser.parse_args(argv)
    rows = errors(args.golden)
    if args.rows:
        print(f"{'row':36s} {'measured MiB':>12s} {'estimate MiB':>12s} {'err':>7s}")
        for _fam, rid, peak, est, err in rows:
            print(f"{rid:36s} {peak / 2**20:12.2f} {est / 2**20:12.2f} {err:+7.1%}")
        print()
    print("| family | rows | median |err| | worst | within 5 % |\n|---|---|---|---|---|")
    for fam in dict.fromkeys(r[0] for r in rows):
        errs = [r[4] for r in rows if r[0] == fam]
        worst = max(errs, key=abs)
        print(f"| {fam} | {len(errs)} | {statistics.median(abs(e) for e in errs):.1%} | {worst:+.1%} | "
              f"{sum(abs(e) <= 0.05 for e in errs)}/{len(errs)} |")
    all_errs = [abs(r[4]) for r in rows]
    print(f"\nall: {sum(e <= 0.05 for e in all_errs)}/{len(all_errs)} rows within 5 %, "
          f"median |err| {statistics.median(all_errs):.1%}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
