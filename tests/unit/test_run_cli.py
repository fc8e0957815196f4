"""`memkit run` and the printed `memkit train` line without training (#24): a recipe is planned,
written with recipe.yaml beside the bundle and printed (--dry-run); bad recipes and bad data are
one line, exit 2, and leave --out as it was; a worker's error under the launcher is one line,
exit 2; `train` / `verify` take --main-process-port and --plan DIR."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from memkit.cli.main import main

REPO = Path(__file__).resolve().parents[2]
RECIPES = REPO / "presets" / "recipes"
TINY = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1, "vocab_size": 320,
        "max_position_embeddings": 256, "tie_word_embeddings": False}


@pytest.fixture
def user(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny").mkdir()
    (tmp_path / "tiny" / "config.json").write_text(json.dumps(TINY))
    with open(tmp_path / "train.jsonl", "w") as handle:
        for i in range(20):
            handle.write(json.dumps({"prompt": f"What is {i} plus {i}?", "completion": f" {2 * i}."}) + "\n")
    return tmp_path


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_dry_run_plans_writes_the_bundle_and_the_recipe_and_prints_the_command(user, capsys):
    argv = ["run", str(RECIPES / "lora-8b-1x4090.yaml"), "--model", "tiny", "--init", "random", "--data",
            "train.jsonl", "--global-batch-size", "4", "--seq-len", "64", "--out", "r", "--dry-run"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    doc = json.loads((user / "r" / "plan.json").read_text())
    assert doc["plan"]["lora_rank"] == 16 and doc["plan"]["seq_len"] == 64 and doc["hardware"]["gpu"] == "rtx-4090"
    assert f"Chosen plan: {doc['label']}" in out
    run_it = [line for line in out.splitlines() if line.startswith("Run it: ")]
    assert run_it == [f"Run it: memkit train --plan {user}/r/plan.json --model {user}/tiny --output-dir {user}/r/run "
                      "--init random --data train.jsonl --eval-fraction 0.02 --num-epochs 2.0 --warmup-steps 10 "
                      "--eval-every 100 --save-every 200 --main-process-port 29500"]
    saved = yaml.safe_load((user / "r" / "recipe.yaml").read_text())
    assert saved["model"] == {"name": "tiny", "init": "random"} and saved["output"]["dir"] == str(user / "r")
    assert saved["training"]["lora_rank"] == 16 and saved["work"]["global_batch_size"] == 4
    assert json.loads((user / "r" / "ds_config.json").read_text())["optimizer"]["params"]["lr"] == 2e-4  # LoRA default
    assert not (user / "r" / "run").exists()  # nothing trained


@pytest.mark.parametrize("recipe, extra, message", [
    ({"model": {"name": "tiny"}, "dataa": {}}, [], r"unknown section 'dataa' \(did you mean data\?\)"),
    ({"model": {"name": "tiny"}, "work": {"epochs": 2}}, [], r"unknown key work.epochs \(did you mean"),
    ({"model": {"name": "tiny"}, "work": {"seq_len": "long"}}, [], r"work.seq_len 'long' must be an integer"),
    ({"model": {"name": "tiny"}, "budget": {"gpu": "a100-80gb"}}, [],
     r"has no data.path \(--data\), work.global_batch_size \(--global-batch-size\)"),
    ({"model": {"name": "tiny"}, "budget": {"gpu": "a100-80gb"}, "work": {"global_batch_size": 4, "seq_len": 64}},
     ["--data", "missing.jsonl"], r"--data missing.jsonl: no such file or folder"),
    ({"model": {"name": "tiny"}, "budget": {"gpu": "a100-80gb"}, "work": {"global_batch_size": 4, "seq_len": 64}},
     ["--data", "bad.jsonl"], r"--data bad.jsonl: line 2"),
    ({"model": {"name": "tiny"}, "budget": {"gpu": "a100-80gb"}, "work": {"global_batch_size": 4, "seq_len": 8}},
     ["--data", "train.jsonl"], r"line 1 has \d+ tokens .* longer than --seq-len 8; .* or pass --truncate"),
])
def test_bad_recipe_or_data_is_one_line_exit_2_and_writes_nothing(recipe, extra, message, user, capsys):
    import re

    (user / "bad.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{not json\n")
    (user / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    assert main(["run", "recipe.yaml", "--init", "random", "--out", "r", *extra]) == 2
    line = _one_line(capsys)
    assert line.startswith("memkit: error: ") and re.search(message, line), line
    assert not (user / "r").exists()


def test_truncate_lets_the_too_long_row_through(user, capsys):
    (user / "recipe.yaml").write_text(yaml.safe_dump(
        {"model": {"name": "tiny", "init": "random"}, "budget": {"gpu": "a100-80gb"},
         "work": {"global_batch_size": 4, "seq_len": 8}, "data": {"path": "train.jsonl"}}))
    assert main(["run", "recipe.yaml", "--out", "r", "--dry-run"]) == 2
    assert "pass --truncate" in _one_line(capsys)
    assert main(["run", "recipe.yaml", "--out", "r", "--dry-run", "--truncate"]) == 0
    assert "--truncate" in capsys.readouterr().out and yaml.safe_load((user / "r" / "recipe.yaml").read_text())[
        "data"]["truncate"] is True
    from memkit.train.data import prepare_data
    from memkit.train.tokenizer import byte_tokenizer

    tok = byte_tokenizer()
    data = prepare_data(str(user / "train.jsonl"), tok, seq_len=8, max_positions=256, vocab_size=320, truncate=True)
    lengths = [len(tok(f"What is {i} plus {i}?")["input_ids"]) + len(tok(f" {2 * i}.")["input_ids"]) + 1
               for i in range(20)]
    assert data.num_truncated == sum(n > 8 for n in lengths) == 20
    assert data.num_sequences == 20 and int(data.attention_mask.sum()) == 20 * 8  # each row its first 8 tokens


def test_printed_train_line_reports_a_worker_error_as_one_line(user, capsys):
    """A worker's one-line error under the launcher (a real child process writing what a failed
    rank and then accelerate write) is kept as memkit's one line; the launcher's traceback after it
    is dropped, and what came before it passes through unchanged."""
    from memkit.cli.train import WorkerErrors

    script = ("import sys\nsys.stderr.write('progress 10%\\r progress 50%\\n')\n"
              "sys.stderr.write('finetune: error: --data x.jsonl: line 7 is not JSON; fix the line\\n')\n"
              "sys.stderr.write('Traceback (most recent call last):\\n  File \"launch.py\"\\n"
              "subprocess.CalledProcessError: returned non-zero exit status 2.\\n')\nsys.exit(1)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
    sink = _Sink()
    errors = WorkerErrors(sink)
    errors(proc.stderr)
    assert proc.wait() == 1
    assert sink.data.decode() == "progress 10%\r progress 50%\n"  # passed through as it came
    assert errors.line == "error: --data x.jsonl: line 7 is not JSON; fix the line" and errors.exit_code == 2


class _Sink:
    def __init__(self):
        self.data = b""

    def write(self, data):
        self.data += data

    def flush(self):
        pass


def test_train_and_verify_take_a_port_and_a_plan_folder(user, capsys):
    assert main(["run", "--model", "tiny", "--init", "random", "--gpu", "a100-80gb", "--global-batch-size", "2",
                 "--seq-len", "64", "--data", "train.jsonl", "--out", "b", "--dry-run"]) == 0
    capsys.readouterr()
    assert main(["train", "--plan", "b", "--model", "tiny", "--init", "random", "--data", "train.jsonl",
                 "--output-dir", "o", "--main-process-port", "29733", "--dry-run"]) == 0
    cmd = capsys.readouterr().out.split()
    at = cmd.index("--config_file")
    assert cmd[at + 1] == "b/accelerate.yaml" and cmd[at + 2: at + 4] == ["--main_process_port", "29733"]
    assert cmd[cmd.index("--plan") + 1] == "b/plan.json"
    assert main(["train", "--plan", "b", "--data", "train.jsonl", "--output-dir", "o", "--main-process-port",
                 "70000"]) == 2
    assert "--main-process-port 70000 must be between 1 and 65,535" in _one_line(capsys)
    from memkit.cli.launching import accelerate_config_for, plan_path

    assert accelerate_config_for(plan_path("b"), None) == Path("b") / "accelerate.yaml"  # what verify --plan b uses


def test_a_flag_replaces_the_recipes_other_unit(user, capsys):
    """--max-steps on a recipe that counts epochs (and --gpu-memory on one that names a GPU) replaces
    the recipe's key instead of contradicting it; the recipe's eval cadence (50) past the shorter run
    becomes the eval at the end, said in one line (it was exit 2: --eval-every beyond --max-steps)."""
    assert main(["run", str(RECIPES / "chat-sft-1b.yaml"), "--model", "tiny", "--init", "random", "--data",
                 "train.jsonl", "--global-batch-size", "4", "--seq-len", "64", "--max-steps", "5",
                 "--gpu-memory", "24GiB", "--out", "r", "--dry-run"]) == 0
    captured = capsys.readouterr()
    run_it = next(line for line in captured.out.splitlines() if line.startswith("Run it: "))
    assert "--max-steps 5" in run_it and "--num-epochs" not in run_it and "--eval-every 0" in run_it
    assert "memkit: the recipe's training.eval_every 50 is beyond --max-steps 5" in captured.err
    saved = yaml.safe_load((user / "r" / "recipe.yaml").read_text())
    assert "num_epochs" not in saved["work"] and saved["budget"] == {"gpu_memory": "24GiB"}
    assert saved["training"]["eval_every"] == 0
    assert json.loads((user / "r" / "plan.json").read_text())["hardware"]["gpu_memory_bytes"] == 24 * 2**30


@pytest.mark.parametrize("data, message", [
    ("missing.jsonl", r"^memkit: error: --data missing.jsonl: no such file or folder"),
    ("bad.jsonl", r"^memkit: error: --data bad.jsonl: line 2"),
    ("long.jsonl", r"^memkit: error: --data long.jsonl: line 1 has \d+ tokens .*longer than --seq-len 64; .*--truncate"),
])
def test_the_printed_train_line_refuses_bad_data_in_one_line(data, message, user, capsys):
    """The "Run it" line of a bundle, with the user's data: a missing file, a broken row and an
    over-long row are each one line and exit 2, before any process starts."""
    import re
    import shlex

    (user / "bad.jsonl").write_text(json.dumps({"prompt": "a", "completion": "b"}) + "\n{not json\n")
    (user / "long.jsonl").write_text(json.dumps({"prompt": "word " * 100, "completion": " yes"}) + "\n")
    assert main(["run", "--model", "tiny", "--init", "random", "--gpu", "a100-80gb", "--global-batch-size", "2",
                 "--seq-len", "64", "--data", "train.jsonl", "--out", "b", "--dry-run"]) == 0
    printed = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("Run it: "))
    argv = shlex.split(printed.removeprefix("Run it: "))
    assert argv[:2] == ["memkit", "train"]
    argv[argv.index("--data") + 1] = data
    assert main(argv[1:]) == 2
    line = _one_line(capsys)
    assert re.search(message, line), line
    assert not (user / "b" / "run").exists()


@pytest.mark.parametrize("given", [[], ["--seq-len", "from-data"]])
def test_seq_len_from_the_data(user, capsys, given):
    """No --seq-len (or --seq-len from-data): the longest tokenized example, rounded up to a multiple
    of 64, stated in one line, planned and saved in the recipe (a resume uses the same)."""
    from memkit.train.data import prepare_data
    from memkit.train.tokenizer import byte_tokenizer

    assert main(["run", "--model", "tiny", "--init", "random", "--gpu", "a100-80gb", "--global-batch-size", "2",
                 "--data", "train.jsonl", "--out", "s", "--dry-run", *given]) == 0
    longest = max(len(p) + len(c) + 1 for p, c in ((f"What is {i} plus {i}?", f" {2 * i}.") for i in range(20)))
    assert longest == 24  # byte tokens: prompt + completion + EOS; 20 rows
    err = capsys.readouterr().err
    assert ("memkit: --seq-len 64 from the data: the longest of 20 prompt_completion records is 24 tokens (p99 24), "
            "rounded up to a multiple of 64") in err
    assert json.loads((user / "s" / "plan.json").read_text())["plan"]["seq_len"] == 64
    assert yaml.safe_load((user / "s" / "recipe.yaml").read_text())["work"]["seq_len"] == 64
    assert prepare_data(str(user / "train.jsonl"), byte_tokenizer(), seq_len=64, max_positions=256,
                        vocab_size=320).num_sequences >= 1


def test_seq_len_from_the_data_is_capped_by_the_model(user, capsys):
    (user / "long.jsonl").write_text("".join(json.dumps({"prompt": "word " * 60, "completion": " ok"}) + "\n"
                                             for _ in range(3)))
    assert main(["run", "--model", "tiny", "--init", "random", "--gpu", "a100-80gb", "--global-batch-size", "2",
                 "--data", "long.jsonl", "--truncate", "--out", "c", "--dry-run"]) == 0
    assert ("--seq-len 256 from the data: the longest of 3 prompt_completion records is 304 tokens (p99 304), rounded "
            "up to a multiple of 64, capped at 256 (the model's max_position_embeddings; 3 longer record(s) need "
            "--truncate)") in capsys.readouterr().err
