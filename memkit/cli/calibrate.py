"""memkit calibrate: show, reset or export the local calibration profile (memkit/profile.py)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HELP = "show, reset or export this machine's measured-vs-predicted memory profile"


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--show", action="store_true", help="runs per device and stack, and the margin they give")
    g.add_argument("--reset", action="store_true", help="delete the profile")
    g.add_argument("--export", metavar="FILE", help="write the profile to FILE")
    p.add_argument("--json", action="store_true", help="--show as one JSON object")


def run(args: argparse.Namespace) -> int:
    from memkit import profile
    from memkit.estimate.bounds import QUANTILE_LABEL
    from memkit.spec.stack import Stack

    path = profile.profile_path()
    if args.reset:
        print(f"removed {path}" if profile.reset(path) else f"no profile at {path}")
        return 0
    if args.export:
        n = profile.export(Path(args.export), path)
        print(f"wrote {n} runs to {args.export}")
        return 0
    doc = profile.load(path)
    if args.json:
        json.dump(doc, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(f"profile: {path}")
    if not doc["machines"]:
        print("  no runs yet (memkit verify records one per run)")
    for key, entry in sorted(doc["machines"].items()):
        stack = Stack(**{k: v for k, v in entry["stack"].items() if k in Stack.__dataclass_fields__})
        table, n = profile.margins(entry["device"], stack, path)
        shown = ", ".join(f"{k} +{v:.1%}" for k, v in sorted(table.items()))
        print(f"  {key}: {n} runs; {QUANTILE_LABEL} under-prediction {shown or '-'}")
    return 0
