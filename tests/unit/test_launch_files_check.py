"""`memkit launch-script` checks the bundle's ds_config.json before writing a script: memkit's own
file (what memkit.emit.deepspeed writes for the plan) is known good and costs no DeepSpeed import;
an edited one is still read by DeepSpeed's own models and refused in one line (exit 2)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from memkit.cli.main import main

ROOT = Path(__file__).resolve().parents[2]
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "max_position_embeddings": 256, "tie_word_embeddings": False}
PROBE = """
import json, sys
from memkit.cli.main import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "deepspeed": "deepspeed" in sys.modules}))
"""


def _bundle(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    bundle = tmp_path / "bundle"
    assert main(["suggest", "--model", str(tmp_path / "config.json"), "--gpu", "a100-80gb", "--num-gpus", "2",
                 "--seq-len", "64", "--global-batch-size", "8", "--zero", "2", "--out", str(bundle)]) == 0
    (tmp_path / "hosts").write_text("node-01 slots=2\n")
    return bundle


def _launch_script(tmp_path: Path, bundle: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, "-c", PROBE, "launch-script", "--plan", str(bundle / "plan.json"),
                           "--hostfile", str(tmp_path / "hosts"), "--out", str(tmp_path / "run.sh")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=300)
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "err": proc.stderr}


def test_memkits_own_ds_config_needs_no_deepspeed_import(tmp_path, capsys):
    bundle = _bundle(tmp_path)
    got = _launch_script(tmp_path, bundle)
    assert got["rc"] == 0 and got["deepspeed"] is False, got
    assert (tmp_path / "run.sh").is_file()


def test_an_edited_ds_config_is_still_checked_by_deepspeeds_models(tmp_path, capsys):
    bundle = _bundle(tmp_path)
    ds_path = bundle / "ds_config.json"
    ds = json.loads(ds_path.read_text())
    ds["zero_optimization"]["reduce_bucket_size"] = -5  # DeepSpeedZeroConfig: ge=0
    ds_path.write_text(json.dumps(ds, indent=2))
    before = ds_path.read_bytes()
    got = _launch_script(tmp_path, bundle)
    assert got["rc"] == 2 and got["deepspeed"] is True, got
    lines = got["err"].strip().splitlines()
    assert len(lines) == 1 and "reduce_bucket_size" in lines[0] and "Traceback" not in got["err"], got["err"]
    assert not (tmp_path / "run.sh").exists() and ds_path.read_bytes() == before
