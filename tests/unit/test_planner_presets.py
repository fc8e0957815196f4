"""presets/plans/: every committed preset is what memkit would generate now, and every one is
accepted by the installed DeepSpeed, Accelerate and transformers.

If the first test fails after an intended change to the estimator, planner or emitters, run
`python -m memkit.presets_gen` and commit the result.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memkit.presets_dir import presets_dir
from memkit.presets_gen import FILES, plan_presets, render, stale_files

PLANS = presets_dir() / "plans"
NAMES = sorted(p.name for p in PLANS.iterdir()) if PLANS.is_dir() else []
CHECKER = Path(__file__).with_name("test_emit.py")


@pytest.mark.slow  # regenerates every preset (~4.5 min on 2 busy cores)
def test_committed_presets_are_not_stale():
    files = render(*plan_presets())
    stale = stale_files(files, presets_dir())
    assert not stale, f"{len(stale)} stale, e.g. {stale[:3]}; regenerate: python -m memkit.presets_gen"


def test_library_covers_the_cards_counts_and_modes():
    assert 40 <= len(NAMES) <= 150
    joined = " ".join(NAMES)
    for card in ("v100-16gb", "rtx-4090", "a100-40gb", "l40s", "h100-80gb"):
        assert card in joined
    for count in ("-1x", "-2x", "-4x", "-8x"):
        assert count in joined
    for part in ("-full-", "-lora16-", "-2k", "-4k", "-8k", "llama-3.2-1b", "llama-3.1-70b"):
        assert part in joined
    readme = (presets_dir() / "README.md").read_text()
    for name in NAMES:
        assert f"[{name}](plans/{name}/)" in readme


@pytest.mark.parametrize("name", NAMES)
def test_preset_files_agree_with_each_other(name):
    folder = PLANS / name
    doc = json.loads((folder / "plan.json").read_text())
    acc = yaml.safe_load((folder / "accelerate.yaml").read_text())
    plan = doc["plan"]
    assert acc["num_processes"] == plan["dp"] * plan["tp"] * plan["pp"]
    assert plan["micro_batch_size"] * plan["grad_accum"] * plan["dp"] == 64
    expected = [f for f in FILES if (f != "ds_config.json" or plan["engine"] == "deepspeed")
                and (f != "adapter_config.json" or plan["lora_rank"] > 0)]
    assert sorted(p.name for p in folder.iterdir()) == sorted(expected)
    if plan["engine"] != "deepspeed":  # a pipeline plan or a 4-bit base: a plain (multi-)process launch
        processes = plan["dp"] * plan["tp"] * plan["pp"]
        assert acc["distributed_type"] == ("MULTI_GPU" if processes > 1 else "NO") and "deepspeed_config" not in acc
        return
    ds = json.loads((folder / "ds_config.json").read_text())
    assert acc["deepspeed_config"]["deepspeed_config_file"] == f"presets/plans/{name}/ds_config.json"
    # DeepSpeed counts every process in its batch check (AutoTP: dp x tp of them).
    assert ds["train_batch_size"] == 64 * plan["tp"]
    assert ds["zero_optimization"]["stage"] == plan["zero_stage"]
    assert doc["estimate"]["nvidia_smi_peak_bytes"] <= doc["budget_bytes"]


@pytest.mark.slow  # one of the longest unit tests on 2 busy cores: the inner loop (-m 'not slow') skips it
def test_every_preset_is_accepted_by_deepspeed_accelerate_and_transformers():
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    proc = subprocess.run([sys.executable, str(CHECKER), *(str(PLANS / n) for n in NAMES)],
                          capture_output=True, text=True, timeout=900, env=env)
    results = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert proc.returncode == 0 and len(results) == len(NAMES), proc.stderr[-3000:]
    bad = [(Path(r["dir"]).name, r[k]) for r in results
           for k in ("deepspeed", "accelerate", "hf_deepspeed_config") if r[k] not in ("ok", "no DeepSpeed file")]
    assert not bad, bad[:5]
