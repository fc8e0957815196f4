"""The light commands pay only for what runs (memkit/cli/main.py imports only the subcommand that
runs): `memkit --help`, `models`, `gpus`, `estimate` and `suggest` on a catalog model that needs no
meta-device build import neither torch nor transformers nor deepspeed. Each runs the real CLI in a
fresh interpreter and reads its sys.modules afterwards."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ("torch", "transformers", "deepspeed", "accelerate", "peft", "bitsandbytes", "datasets")
PROBE = """
import contextlib, io, json, sys
from memkit.cli.main import main
out = io.StringIO()
with contextlib.redirect_stdout(out):
    try:
        rc = main(sys.argv[1:])
    except SystemExit as exc:  # --help exits through argparse
        rc = exc.code
print(json.dumps({"rc": rc, "out": out.getvalue(), "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)

COMMANDS = {
    "help": ["--help"],
    "models": ["models", "llama"],
    "gpus": ["gpus"],
    "estimate": ["estimate", "--model", "llama-3.1-8b", "--gpu", "a100-80gb"],
    "suggest": ["suggest", "--model", "llama-3.2-1b", "--gpu", "rtx-4090", "--num-gpus", "1",
                "--global-batch-size", "8", "--seq-len", "1024"],
    # the README main job, its splits searched too (issue 22): the whole search, catalog data only
    "suggest-main-job": ["suggest", "--model", "llama-3.1-8b", "--gpu", "rtx-4090", "--num-gpus", "2",
                         "--global-batch-size", "64", "--seq-len", "2048"],
}


def _run(argv: list[str]) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_light_commands_import_no_training_library(name):
    got = _run(COMMANDS[name])
    assert got["rc"] == 0, got
    assert got["heavy"] == [], got["heavy"]
    assert got["out"].strip()  # it printed its answer


def test_top_level_help_lists_every_subcommand_with_its_help_line():
    """The help read from each module's source is the module's own HELP."""
    import importlib

    from memkit.cli.main import COMMANDS as SUBCOMMANDS

    out = _run(["--help"])["out"]
    flat = " ".join(out.split())
    for name, module_name in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        assert name in out
        assert " ".join(module.HELP.split()) in flat, name
