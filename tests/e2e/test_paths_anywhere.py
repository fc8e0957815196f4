"""Printed commands work as printed from any directory (#15), with real (tiny, saved) weights:

- a preset launched from outside the repository: `memkit preset NAME --out DIR`, then the "Run it"
  command it prints, unchanged but for --max-steps, with the preset's hub id in the local HF cache;
- the command in a `suggest --out` bundle's README, run from a different working directory, on a
  ZeRO-3 plan, with a chat (`messages`) data set: the saved weights are loaded under
  deepspeed.zero.Init (step 1's loss is the saved model's loss on step 1's batch, assistant tokens only).

One process each (the plans are 1-GPU plans): cheap."""
from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from runner_util import env, events, free_port, read_log

pytestmark = pytest.mark.e2e

PRESET = "llama-3.2-1b-lora16-1xh100-80gb-4k"  # ZeRO-0 bf16, LoRA 16, micro 4 x accum 16 x seq 4096
SMALL = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 16, "intermediate_size": 32,
         "num_hidden_layers": 1, "num_attention_heads": 1, "num_key_value_heads": 1, "vocab_size": 320,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _save(folder: Path, config: dict):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(folder)


def _text_data(path: Path, num_bytes: int) -> None:
    with open(path, "w") as handle:
        i = 0
        while handle.tell() < num_bytes:
            handle.write(json.dumps({"text": f"Document {i}: the quick brown fox jumps over the lazy dog. " * 8}) + "\n")
            i += 1


def _chat_data(path: Path, num_records: int) -> None:
    with open(path, "w") as handle:
        for i in range(num_records):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                  {"role": "assistant", "content": f"{2 * i}."}]}) + "\n")


def _run_printed(command: str, *, cwd: Path, extra: list[str], environ: dict) -> subprocess.CompletedProcess:
    argv = shlex.split(command)
    assert argv[:2] in (["accelerate", "launch"], ["memkit", "train"])
    if argv[0] == "memkit":  # a free rendezvous port (the last --main-process-port wins): tests run in parallel
        extra = extra + ["--main-process-port", str(free_port())]
        if shutil.which("memkit") is None:  # the console script is not on PATH here
            argv[:1] = [sys.executable, "-m", "memkit.cli.main"]
    if argv[0] == "accelerate" and shutil.which("accelerate") is None:  # the same program
        argv[:2] = [sys.executable, "-m", "accelerate.commands.launch"]
    return subprocess.run(argv + extra, cwd=cwd, env=environ, capture_output=True, text=True, timeout=900)


def _run_it(stdout: str) -> str:
    lines = stdout.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.startswith("Run it")) + 1].strip()


def test_preset_launched_from_outside_the_repository(tmp_path):
    # The preset names meta-llama/Llama-3.2-1B; a tiny model saved under that hub id in a local HF cache
    # is what the printed command trains (huggingface_hub's cache layout: refs/main -> snapshots/<commit>).
    cache = tmp_path / "hub"
    repo = cache / "models--meta-llama--Llama-3.2-1B"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("0" * 40)
    _save(repo / "snapshots" / ("0" * 40), SMALL)
    user = tmp_path / "elsewhere"
    user.mkdir()
    environ = {**env(), "HF_HUB_CACHE": str(cache)}
    made = subprocess.run([sys.executable, "-m", "memkit.cli.main", "preset", PRESET, "--out", "bundle"],
                          cwd=user, env=environ, capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    command = _run_it(made.stdout)
    assert command.startswith(f"memkit train --plan {user / 'bundle' / 'plan.json'}")
    assert "--model meta-llama/Llama-3.2-1B --data train.jsonl" in command
    acc = (user / "bundle" / "accelerate.yaml").read_text()
    assert f"deepspeed_config_file: {user / 'bundle' / 'ds_config.json'}" in acc
    preset = Path(__file__).resolve().parents[2] / "presets" / "plans" / PRESET
    for name in ("ds_config.json", "plan.json", "adapter_config.json"):  # the same plan, byte for byte
        assert (user / "bundle" / name).read_text() == (preset / name).read_text(), name

    _text_data(user / "train.jsonl", 64 * 4096 + 4096)  # one global batch: 64 sequences of 4096 bytes
    run = _run_printed(command, cwd=user, extra=["--max-steps", "1", "--no-progress"], environ=environ)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"finetune: weights: pretrained weights from {repo / 'snapshots' / ('0' * 40)}" in run.stderr
    start = events(read_log(user / "bundle" / "run"), "start")[0]
    assert start["distributed_type"] == "DEEPSPEED" and start["plan"]["lora_rank"] == 16
    assert (user / "bundle" / "run" / "adapter" / "adapter_model.safetensors").is_file()


def test_suggest_readme_command_runs_from_another_directory(tmp_path):
    tiny = {**SMALL, "hidden_size": 32, "num_attention_heads": 2, "max_position_embeddings": 128}
    planner, user = tmp_path / "planner", tmp_path / "user"
    planner.mkdir()
    user.mkdir()
    _save(planner / "tiny", tiny)
    made = subprocess.run([sys.executable, "-m", "memkit.cli.main", "suggest", "--model", "tiny",
                           "--gpu-memory", "1GiB", "--global-batch-size", "2", "--seq-len", "64", "--zero", "3",
                           "--precision", "fp32",
                           "--out", "bundle"], cwd=planner, env=env(), capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    readme = (planner / "bundle" / "README.md").read_text()
    command = readme.split("```\n", 2)[1].strip()  # the main job, first code block
    assert command == _run_it(made.stdout)
    assert f"--model {planner / 'tiny'} --data train.jsonl --output-dir {planner / 'bundle' / 'run'}" in command
    _chat_data(user / "train.jsonl", 24)
    run = _run_printed(command, cwd=user, extra=["--max-steps", "2", "--no-progress"], environ=env())
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]
    assert f"finetune: weights: pretrained weights from {planner / 'tiny'}" in run.stderr
    log = read_log(planner / "bundle" / "run")
    start = events(log, "start")[0]
    assert start["plan"]["zero_stage"] == 3 and len(events(log, "step")) == 2
    assert start["data"]["kind"] == "chat"
    micro, accum = start["plan"]["micro_batch_size"], start["plan"]["grad_accum"]
    expected = _loss_of_step_1(planner / "tiny", user / "train.jsonl", seq_len=64, micro=micro, accum=accum)
    assert events(log, "step")[0]["loss"] == pytest.approx(expected, abs=1e-5)


def _loss_of_step_1(model_dir: Path, data_path: Path, *, seq_len: int, micro: int, accum: int) -> float:
    """The saved model's mean next-token loss on the runner's first global batch (same seed, data order)."""
    from transformers import AutoModelForCausalLM

    from memkit.train.data import Sharding, prepare_data
    from memkit.train.loop import causal_lm_loss_sum
    from memkit.train.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    vocab = model.config.vocab_size
    data = prepare_data(str(data_path), load_tokenizer(model_dir, vocab_size=vocab), seq_len=seq_len,
                        max_positions=model.config.max_position_embeddings, vocab_size=vocab, seed=0)
    window = Sharding(num_sequences=data.num_sequences, micro_batch_size=micro, grad_accum=accum, dp=1).step_indices(0)
    batch = data.batch(window.reshape(-1))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return float(causal_lm_loss_sum(logits, batch["labels"])) / int(data.loss_tokens[window.reshape(-1)].sum())
