"""memkit doctor: is this machine ready to run a plan? Versions, devices, DeepSpeed ops, build locks.

    memkit doctor                       report; exit 1 when a stale build lock is found
    memkit doctor --build               also compile the DeepSpeed ops the plans use (cached)
    memkit doctor --clear-stale-locks   remove build locks no process holds (memkit.train.ops)
"""
from __future__ import annotations

import argparse
import json
import sys

HELP = "check torch/CUDA/DeepSpeed/accelerate, prebuild DeepSpeed ops, find stale build locks"
EXIT_PROBLEM = 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--build", action="store_true",
                   help="compile the DeepSpeed ops memkit's plans load (cpu_adam, fused_adam, deepspeed_shm_comm) "
                        "where buildable")
    p.add_argument("--clear-stale-locks", action="store_true",
                   help="remove build locks left by interrupted compiles (no process has them open)")
    p.add_argument("--json", action="store_true", help="print the report as one JSON object")


def _versions() -> dict:
    import importlib

    out = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "accelerate", "deepspeed", "peft", "datasets", "tensorboard"):
        try:
            out[name] = importlib.import_module(name).__version__
        except Exception as exc:  # noqa: BLE001 - a broken install is what doctor reports
            out[name] = f"missing ({type(exc).__name__})"
    return out


def _devices() -> dict:
    import torch

    info = {"cuda_available": torch.cuda.is_available(), "torch_cuda": torch.version.cuda,
            "devices": []}
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append({"index": index, "name": props.name, "total_bytes": int(props.total_memory),
                                    "capability": f"{props.major}.{props.minor}"})
    return info


def collect(*, build: bool, clear_stale_locks: bool, say) -> dict:
    from memkit.train.ops import (OPS, build_estimate, build_op, clear_stale_locks as clear, find_locks, op_state,
                                  use_install_extensions_dir)

    root = use_install_extensions_dir()  # the folder the runs build into (per install unless TORCH_EXTENSIONS_DIR)
    report = {"versions": _versions(), "devices": _devices(), "extensions_root": str(root), "ops": {},
              "locks": [], "removed_locks": []}
    if clear_stale_locks:
        report["removed_locks"] = [str(path) for path in clear(root)]
    for lock in find_locks(root):
        report["locks"].append({"path": str(lock.path), "age_s": round(lock.age_s), "stale": lock.stale,
                                "holders": list(lock.holders) if lock.holders is not None else None,
                                "explain": lock.explain()})
    if "missing" in report["versions"]["deepspeed"]:
        return report
    for name in OPS:
        state = op_state(name, root)
        entry = {"compatible": state.compatible, "prebuilt": state.prebuilt, "cached": state.cached,
                 "build_dir": str(state.build_dir)}
        if build and state.compatible and not state.ready:
            if state.lock is not None:
                entry["build"] = f"skipped: {state.lock.explain()}"
            else:
                say(f"building DeepSpeed {name}, {build_estimate(name, root)}, cached in {state.build_dir} ...")
                try:
                    entry["build_s"] = round(build_op(name), 1)
                    entry["cached"] = op_state(name, root).cached
                except Exception as exc:  # noqa: BLE001 - a failed compile is a finding, not a crash
                    entry["build"] = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        report["ops"][name] = entry
    return report


def render(report: dict) -> str:
    v, d = report["versions"], report["devices"]
    lines = ["versions: " + ", ".join(f"{k} {val}" for k, val in v.items())]
    if d["cuda_available"]:
        lines.append(f"CUDA {d['torch_cuda']}: " + "; ".join(
            f"{x['index']}: {x['name']} ({x['total_bytes'] / 2**30:.0f} GiB, sm {x['capability']})"
            for x in d["devices"]))
    else:
        lines.append(f"CUDA: not available (torch built {'for CUDA ' + d['torch_cuda'] if d['torch_cuda'] else 'CPU-only'});"
                     " runs use the CPU (gloo)")
    lines.append(f"torch extensions cache: {report['extensions_root']}")
    for name, op in report["ops"].items():
        if op["prebuilt"]:
            state = "prebuilt (installed with deepspeed)"
        elif op["cached"]:
            state = "built (cached)"
        elif not op["compatible"]:
            state = "not buildable here"
        else:
            state = "not built yet: the first run compiles it (memkit doctor --build does it now)"
        if "build_s" in op:
            state += f"; built now in {op['build_s']} s"
        if "build" in op:
            state += f"; {op['build']}"
        lines.append(f"DeepSpeed {name}: {state}")
    for lock in report["locks"]:
        lines.append(("PROBLEM: " if lock["stale"] else "") + lock["explain"])
    for path in report["removed_locks"]:
        lines.append(f"removed stale build lock {path}")
    if not report["locks"] and not report["removed_locks"]:
        lines.append("build locks: none")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    def say(message: str) -> None:
        print(f"memkit doctor: {message}", file=sys.stderr, flush=True)

    import contextlib

    # DeepSpeed logs to stdout on import; keep stdout for the report (one JSON object with --json).
    with contextlib.redirect_stdout(sys.stderr):
        report = collect(build=args.build, clear_stale_locks=args.clear_stale_locks, say=say)
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(render(report))
    failed = any("failed" in str(op.get("build", "")) for op in report["ops"].values())
    return EXIT_PROBLEM if failed or any(lock["stale"] for lock in report["locks"]) else 0
