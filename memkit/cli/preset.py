"""memkit preset: a ready-made plan from presets/plans/ as a bundle that runs from any directory.

    memkit preset                                   # list the presets
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


def run(args: argparse.Namespace) -> int:
    import os

    if not args.name:
        if args.out:
            raise MemkitError("--out needs a preset name; `memkit preset` lists them")
        print("\n".join(preset_names()))
        return 0
    folder = preset_folder(args.name)
    if not args.out:
        print((folder / "README.md").read_text(encoding="utf-8"), end="")
        print(f"\n(repository-relative paths: run from {folder.parents[2]}, or write a bundle that runs from "
              f"anywhere with `memkit preset {args.name} --out DIR`)")
        return 0
    from memkit.emit import plan_doc
    from memkit.emit.bundle import launch_command, write_bundle

    out_dir = os.path.abspath(os.path.expanduser(args.out))
    written = write_bundle(args.out, preset_bundle(args.name, out_dir), force=args.force)
    doc = plan_doc.read(folder / "plan.json").data
    print(f"preset {args.name}: {doc['label']}")
    print("\nRun it (--model: the weights to fine-tune; a smoke test on fresh weights: --init random "
          "--data synthetic --max-steps 20):")
    print("  " + launch_command(doc, out_dir=out_dir))
    print("\nwrote " + ", ".join(str(p) for p in written))
    return 0
