"""Score memkit's step-time model against published training throughput.

    python benchmarks/throughput_accuracy.py [--data ../shared/calibration/published_throughput.jsonl]
                                             [--holdout benchmarks/data/holdout_throughput.jsonl]
                                             [--rows] [--show-misordered] [--write-uncertainty]

Prints two halves, dev (--data) and holdout (--holdout: runs kept out of every fit,
benchmarks/data/SOURCES_holdout.md), each per source and overall: records scored in absolute terms, median |error|, signed mean,
share within +-20 %, p75 |error|, and rank agreement within each same-model/same-GPU group
(Kendall tau and share of concordant pairs), and p75|r|: the p75 over those pairs (both rows
scored in absolute terms) of |predicted ratio / measured ratio - 1|
(memkit.calibrate.published_throughput.pair_ratio_errors). Error = (predicted - measured) /
measured of tokens/s per GPU. `--write-uncertainty` writes the dev half's overall p75 |error|
(memkit.estimate.throughput.step_time_uncertainty: how far one prediction may be off) and its
p75|r| (step_time_ranking_uncertainty: how far the predicted ratio of two plans may be off, which
the planner's tie and split rules read) to presets/step_time_uncertainty.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memkit.calibrate.published_throughput import map_record, ranked_pairs, score, summarize  # noqa: E402
from memkit.presets_dir import presets_dir  # noqa: E402

HOLDOUT_DATA = ROOT / "benchmarks" / "data" / "holdout_throughput.jsonl"
DEFAULT_DATA = ROOT.parent / "shared" / "calibration" / "published_throughput.jsonl"
for candidate in (DEFAULT_DATA, Path("/work/shared/calibration/published_throughput.jsonl")):
    if candidate.exists():
        DEFAULT_DATA = candidate
        break


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=DEFAULT_DATA, help="the dev file (default: %(default)s)")
    ap.add_argument("--holdout", type=Path, default=HOLDOUT_DATA,
                    help="held-out runs, printed as their own half and never fitted on (default: %(default)s); "
                         "'none' skips them")
    ap.add_argument("--rows", action="store_true", help="print every record's prediction")
    ap.add_argument("--write-uncertainty", action="store_true")
    ap.add_argument("--by-gpu", action="store_true", help="also break the figures down by GPU")
    ap.add_argument("--show-misordered", "--discordant", dest="discordant", action="store_true",
                    help="print every pair the prediction orders against the measurement (or ties), with "
                         "the predicted and measured ratio of the two")
    args = ap.parse_args(argv)
    outcomes = _outcomes(args.data)
    holdout = _outcomes(args.holdout) if str(args.holdout) != "none" else []
    for title, rows in (("dev", outcomes), ("holdout", holdout)):
        if rows:
            print(f"== {title}: {args.data if title == 'dev' else args.holdout}")
            _report(rows, args)
            print()
    if args.write_uncertainty:
        _write_uncertainty(summarize(outcomes))   # the dev half only: the holdout is never fitted on
    return 0


def _outcomes(path: Path) -> list:
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [score(map_record(r, configs_dir=ROOT / "benchmarks" / "calibration_configs")) for r in records]


def _report(outcomes: list, args) -> None:
    if args.rows:
        for o in outcomes:
            c = o.case
            if c.skip_reason or o.error:
                print(f"{c.case_id:42} skip: {c.skip_reason or o.error}")
                continue
            err = f"{o.error_pct:+6.1f}%" if o.error_pct is not None else "  rank "
            comp = " ".join(f"{k}={v:.3g}" for k, v in o.estimate.components_s.items() if v > 0)
            print(f"{c.case_id:42} meas {c.measured_tps_per_gpu:10.1f} pred {o.predicted_tps_per_gpu:10.1f} {err}"
                  f"  mfu {o.estimate.mfu:.3f}  {c.summary}  [{comp}]")
    if args.discordant:
        for a, b, kind in ranked_pairs(outcomes):
            if kind != "concordant":
                ratio_m = a.case.measured_tps_per_gpu / b.case.measured_tps_per_gpu
                ratio_p = a.predicted_tps_per_gpu / b.predicted_tps_per_gpu
                print(f"{kind:10} {a.case.case_id:38} meas {a.case.measured_tps_per_gpu:9.1f} pred "
                      f"{a.predicted_tps_per_gpu:9.1f} | {b.case.case_id:38} meas {b.case.measured_tps_per_gpu:9.1f}"
                      f" pred {b.predicted_tps_per_gpu:9.1f} | a/b meas {ratio_m:.3f} pred {ratio_p:.3f}")
    table = summarize(outcomes)
    _print_table(table)
    if args.by_gpu:
        print()
        _print_table(summarize(outcomes, key=lambda c: c.hardware.gpu.name if c.hardware else "(skipped)"),
                     title="gpu")


def _write_uncertainty(table: dict) -> None:
    path = presets_dir() / "step_time_uncertainty.json"
    doc = {"_about": "Written by benchmarks/throughput_accuracy.py --write-uncertainty: the p75 of "
                     "|predicted - measured| / measured tokens/s over the published runs it scores "
                     "(../shared/calibration/published_throughput.jsonl): step_time_uncertainty(), the "
                     "error bar of one prediction. p75_pair_ratio_error: the p75 over the same runs' ranked "
                     "pairs (same source, model and GPU; both rows absolute) of |predicted ratio / measured "
                     "ratio - 1| (published_throughput.pair_ratio_errors): step_time_ranking_uncertainty(). "
                     "The planner treats plans whose predicted step times differ by less than it as tied.",
           "p75_abs_error": round(table["ALL"]["p75_abs_pct"] / 100, 4),
           "p75_pair_ratio_error": round(table["ALL"]["p75_pair_ratio_pct"] / 100, 4),
           "n_ratio_pairs": table["ALL"]["n_ratio_pairs"],
           "median_abs_error": round(table["ALL"]["median_abs_pct"] / 100, 4),
           "n_scored": table["ALL"]["n_scored"]}
    path.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {path}")


def _print_table(table: dict, *, title: str = "source") -> None:
    print(f"{title:38} {'n':>4} {'scored':>6} {'med|e|':>7} {'signed':>7} {'<=20%':>6} {'p75|e|':>7}"
          f" {'pairs':>6} {'tied':>5} {'conc':>6} {'tau':>6} {'p75|r|':>7}")
    for name in sorted(table, key=lambda k: (k == "ALL", k)):
        s = table[name]
        print(f"{name:38} {s['n_records']:4d} {s['n_scored']:6d} {s['median_abs_pct']:6.1f}% "
              f"{s['mean_signed_pct']:+6.1f}% {s['within_20_pct']:6.0%} {s['p75_abs_pct']:6.1f}% "
              f"{s['pairs']:6d} {s['tied']:5d} {s['concordant']:6.1%} {s['kendall_tau']:+6.2f}"
              f" {s['p75_pair_ratio_pct']:6.1f}%")


if __name__ == "__main__":
    raise SystemExit(main())
