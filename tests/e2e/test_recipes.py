"""`memkit run RECIPE` (#24): every recipe shipped under presets/recipes/ plans, writes its bundle and
recipe.yaml, prints the `memkit train` line and trains to a loadable model, run from a directory
outside the repository on a tiny saved Llama (the recipe's model, batch, length and epochs
overridden by flags, as a user would for a smoke test; the 8-GPU recipe on 2 CPU processes).
`memkit run --resume DIR` continues a run stopped by SIGTERM from its checkpoint."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from runner_util import env, events, free_port, read_log

pytestmark = pytest.mark.e2e

RECIPES = Path(__file__).resolve().parents[2] / "presets" / "recipes"
SMALL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
         "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 320,
         "max_position_embeddings": 256, "tie_word_embeddings": False}


def _save_tiny(folder: Path) -> Path:
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(SMALL)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(folder)
    return folder


def _chat(path: Path, n: int) -> None:
    with open(path, "w") as handle:
        for i in range(n):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                  {"role": "assistant", "content": f"{2 * i}."}]}) + "\n")


def _memkit(args: list[str], *, cwd: Path, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "memkit.cli.main", *args], cwd=cwd, env=env(),
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def user(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("user")  # outside the repository
    _save_tiny(folder / "tiny")
    _chat(folder / "train.jsonl", 100)
    return folder


def test_the_four_recipes_ship():
    assert sorted(p.name for p in RECIPES.glob("*.yaml")) == [
        "chat-sft-1b.yaml", "full-8b-8xa100.yaml", "lora-8b-1x4090.yaml", "qlora-70b-2xa100.yaml"]


@pytest.mark.parametrize("recipe", sorted(p.name for p in RECIPES.glob("*.yaml")))
def test_recipe_runs_to_a_loadable_model(recipe, user):
    shipped = yaml.safe_load((RECIPES / recipe).read_text())
    out = user / recipe.removesuffix(".yaml")
    extra = ["--num-gpus", "2"] if shipped["budget"].get("num_gpus", 1) > 2 else []
    made = _memkit(["run", str(RECIPES / recipe), "--model", "tiny", "--data", "train.jsonl", "--global-batch-size",
                    "4", "--seq-len", "64", "--num-epochs", "0.2", "--out", str(out),
                    "--main-process-port", str(free_port()), *extra], cwd=user)
    assert made.returncode == 0, made.stdout[-3000:] + made.stderr[-3000:]
    doc = json.loads((out / "plan.json").read_text())
    printed = next(line for line in made.stdout.splitlines() if line.startswith("Run it: "))
    assert printed.startswith(f"Run it: memkit train --plan {out}/plan.json --model {user / 'tiny'} "
                              f"--output-dir {out}/run --data train.jsonl")
    assert f"predicted peak per GPU: {doc['estimate']['nvidia_smi_peak_bytes'] / 2**30:.1f} GiB" in made.stdout
    saved = yaml.safe_load((out / "recipe.yaml").read_text())  # the recipe as run: the shipped one, flags merged
    assert saved["model"]["name"] == "tiny" and saved["work"]["seq_len"] == 64
    assert saved["training"] == shipped["training"] and saved["output"]["dir"] == str(out)
    log = read_log(out / "run")
    start, end = events(log, "start")[0], events(log, "end")[0]
    acc = yaml.safe_load((out / "accelerate.yaml").read_text())
    assert start["plan"] == doc["plan"] and start["world_size"] == acc["num_processes"]  # the processes as printed
    assert end["status"] == "ok" and end["steps_done"] == len(events(log, "step")) >= 1
    assert doc["plan"]["lora_rank"] == shipped["training"].get("lora_rank", 0)
    assert doc["plan"].get("quantize_base", "none") == shipped["training"].get("quantize_base", "none")
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 2, 3, 4]])
    if doc["plan"]["lora_rank"]:
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(user / "tiny")
        model = PeftModel.from_pretrained(base, out / "run" / "adapter")
    else:
        model = AutoModelForCausalLM.from_pretrained(out / "run" / "final")
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, 4, SMALL["vocab_size"]) and torch.isfinite(logits).all()


def test_run_stopped_by_sigterm_resumes_from_its_folder(user, tmp_path):
    out = tmp_path / "lora"
    cmd = [sys.executable, "-m", "memkit.cli.main", "run", str(RECIPES / "lora-8b-1x4090.yaml"), "--model",
           str(user / "tiny"), "--data", str(user / "train.jsonl"), "--global-batch-size", "2", "--seq-len", "64",
           "--num-epochs", "3", "--save-every", "2", "--out", str(out), "--main-process-port", str(free_port())]
    proc = subprocess.Popen(cmd, cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    log = out / "run" / "log.jsonl"
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline and proc.poll() is None:
        if log.is_file() and '"event": "checkpoint"' in log.read_text():
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    os.kill(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 143, err[-3000:]
    stopped = events(read_log(out / "run"), "step")[-1]["step"]
    resumed = _memkit(["run", "--resume", str(out)], cwd=user)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "Run it: memkit train --plan" in resumed.stdout and resumed.stdout.rstrip().count("--resume") == 1
    log = read_log(out / "run")
    start = events(log, "start")[-1]
    assert start["resumed_from"] and 0 < start["start_step"] <= stopped
    assert events(log, "end")[-1]["status"] == "ok" and events(log, "step")[-1]["step"] == start["max_steps"]
    assert (out / "run" / "adapter" / "adapter_model.safetensors").is_file()
