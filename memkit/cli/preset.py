"""memkit preset: a ready-made plan from presets/plans/ as a bundle that runs from any directory.

    memkit preset                                   # list the presets: model, GPUs, plan, peak, speed
    memkit preset llama-3.1-8b-lora16-1xh100-80gb-4k        # its README (repository-relative paths)
    memkit preset llama-3.1-8b-lora16-1xh100-80gb-4k --out runs/8b

The presets keep repository-relative paths (each is what `memkit suggest --out presets/plans/NAME
--relative-paths` writes, byte for byte: tests/unit/test_presets_equal_suggest.py). --out writes
the same plan with absolute paths, as `memkit suggest --out DIR` would: accelerate.yaml points at
DIR's ds_config.json, and the printed command works from any working directory.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from memkit.errors import MemkitError, did_you_mean

HELP = "list the ready-made plans, or write one as a bundle with absolute paths (--out DIR)"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("name", nargs="?", help="preset name (a folder of presets/plans/); none: list them")
    p.add_argument("--out", metavar="DIR", help="write accelerate.yaml, ds_config.json, plan.json, README.md here")
    p.add_argument("--force", action="store_true",
                   help="write --out into a non-empty folder that memkit did not write (its files of the same "
                        "names are replaced)")


def preset_names() -> list[str]:
    from memkit.presets_dir import presets_dir

    plans = presets_dir() / "plans"
    return sorted(p.name for p in plans.iterdir() if (p / "plan.json").is_file()) if plans.is_dir() else []


def preset_folder(name: str) -> Path:
    from memkit.presets_dir import presets_dir

    names = preset_names()
    if name not in names:
        raise MemkitError(f"unknown preset {name!r}{did_you_mean(name, names)}; `memkit preset` lists them")
    return presets_dir() / "plans" / name


def preset_bundle(name: str, out_dir: str) -> dict[str, str]:
    """The files of preset `name` for a bundle at `out_dir` (absolute): the preset's plan.json as is,
    the other files built by the same emitter suggest uses (memkit.emit.bundle.bundle_files)."""
    from memkit.emit import plan_doc
    from memkit.emit.bundle import bundle_files
    from memkit.emit.deepspeed import largest_param_numel
    from memkit.spec.hf import load_model_spec

    folder = preset_folder(name)
    doc = plan_doc.read(folder / "plan.json").data
    # presets_gen writes presets with the default nvme path (memkit.presets_gen.render)
    files = bundle_files(doc, out_dir=out_dir, largest_param_numel=largest_param_numel(load_model_spec(doc["model"])))
    files["plan.json"] = (folder / "plan.json").read_text(encoding="utf-8")  # the committed plan, versions and all
    return files


def preset_rows() -> list[list[str]]:
    """One row per preset: name, model, GPUs, the plan's technique summary (its label), predicted
    per-GPU peak as nvidia-smi shows it / the card's memory, predicted tokens/s (all from plan.json)."""
    from memkit.emit import plan_doc
    from memkit.units import GIB

    rows = []
    for name in preset_names():
        doc = plan_doc.read(preset_folder(name) / "plan.json").data
        hw, est = doc["hardware"], doc["estimate"]
        rows.append([name, str(doc["model"]), f"{hw['num_gpus_per_node'] * hw['num_nodes']} x {hw['gpu']}",
                     doc["label"], f"{est['nvidia_smi_peak_bytes'] / GIB:.1f} / {hw['gpu_memory_bytes'] / GIB:.0f}",
                     f"{doc['step_time']['tokens_per_s']:,.0f}"])
    return rows


def run(args: argparse.Namespace) -> int:
    import os

    if not args.name:
        if args.out:
            raise MemkitError("--out needs a preset name; `memkit preset` lists them")
        from memkit.cli.render import format_table

        print(format_table(["preset", "model", "GPUs", "plan", "peak GiB", "tokens/s"], preset_rows(),
                           right={4, 5}))
        print("\n(peak: predicted per GPU as nvidia-smi shows it / the card's memory; tokens/s: predicted, all "
              "GPUs; `memkit preset NAME` shows one, `--out DIR` writes it)")
        return 0
    folder = preset_folder(args.name)
    if not args.out:
        # the preset's README as the bundle emitter writes it for the repository-relative folder
        # (presets commit plan.json, accelerate.yaml, ds_config.json; the README is derived)
        print(preset_bundle(args.name, f"presets/plans/{args.name}")["README.md"], end="")
        # the paths read presets/plans/NAME/...: they hold from the folder above presets/ (a checkout),
        # not from an installed wheel's memkit/_presets/ (memkit.presets_dir)
        where = f"run from {folder.parents[2]}, or " if folder.parents[1].name == "presets" else ""
        print(f"\n(repository-relative paths: {where}write a bundle that runs from anywhere with "
              f"`memkit preset {args.name} --out DIR`)")
        return 0
    from memkit.emit import plan_doc
    from memkit.emit.bundle import train_command, write_bundle

    out_dir = os.path.abspath(os.path.expanduser(args.out))
    written = write_bundle(args.out, preset_bundle(args.name, out_dir), force=args.force)
    doc = plan_doc.read(folder / "plan.json").data
    print(f"preset {args.name}: {doc['label']}")
    print("\nRun it (--model: the weights to fine-tune; a smoke test on fresh weights: --init random "
          "--data synthetic --max-steps 20; the raw accelerate line is in README.md):")
    print("  " + train_command(doc, out_dir=out_dir))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
