"""The runner as a user meets it, run as `python -m memkit.finetune` from a folder outside the
repository: pretrained (saved) weights, a chat data set, LoRA, an eval split, --num-epochs,
TensorBoard events read back, the adapter beside the merged model, the refusal to train over a
finished run, and the resume line. One plain process (no launcher): cheap."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from runner_util import TINY_LLAMA, env, events, read_log

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    root = tmp_path_factory.mktemp("user")
    cfg = dict(TINY_LLAMA)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg)).save_pretrained(root / "tiny")
    with open(root / "chat.jsonl", "w") as handle:
        for i in range(16):
            handle.write(json.dumps({"messages": [{"role": "user", "content": f"What is {i} plus {i}?"},
                                                  {"role": "assistant", "content": f"{2 * i}"}]}) + "\n")
    return root


def _finetune(cwd, *args):
    return subprocess.run([sys.executable, "-m", "memkit.finetune", "--model", "tiny", "--data", "chat.jsonl",
                           "--seq-len", "64", "--micro-batch-size", "2", "--precision", "fp32", "--lora-rank", "4", "--lora-alpha", "8",
                           "--lora-targets", "q_proj,v_proj", "--lr", "1e-3", "--no-progress", *args],
                          cwd=cwd, env=env(), capture_output=True, text=True, timeout=300)


def _base_loss_of_step_1(workdir) -> float:
    from transformers import AutoModelForCausalLM

    from memkit.train.data import Sharding, prepare_data
    from memkit.train.loop import causal_lm_loss_sum
    from memkit.train.tokenizer import load_tokenizer

    data = prepare_data(str(workdir / "chat.jsonl"), load_tokenizer(workdir / "tiny", vocab_size=320), seq_len=64,
                        max_positions=256, vocab_size=320, eval_fraction=0.25)
    window = Sharding(num_sequences=data.num_sequences, micro_batch_size=2, grad_accum=1, dp=1).step_indices(0)
    batch = data.batch(window.reshape(-1))
    model = AutoModelForCausalLM.from_pretrained(workdir / "tiny").eval()
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    return float(causal_lm_loss_sum(logits, batch["labels"])) / int(data.loss_tokens[window.reshape(-1)].sum())


def test_chat_lora_eval_epochs_tensorboard_overwrite_resume(workdir):
    from peft import PeftModel
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from transformers import AutoModelForCausalLM

    out = workdir / "out"
    first = _finetune(workdir, "--output-dir", "out", "--eval-fraction", "0.25", "--eval-every", "2",
                      "--num-epochs", "1", "--save-every", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    log = read_log(out)
    start = events(log, "start")[0]
    # 16 records, 4 held out; each conversation fits one 64-token sequence with room for one more.
    num_sequences = start["data"]["num_sequences"]
    assert start["data"]["kind"] == "chat" and start["data"]["eval"]["num_sequences"] >= 1
    steps = math.ceil(num_sequences / 2)
    assert start["max_steps"] == steps and len(events(log, "step")) == steps
    assert f"--num-epochs 1 = {steps} steps" in first.stderr
    evals = events(log, "eval")
    assert [e["step"] for e in evals] == sorted({*range(2, steps + 1, 2), steps})

    # TensorBoard, the default logger (no --report-to above): its event file holds the same figures
    # as log.jsonl, and the start lines say where it is.
    assert "memkit: logs: " in first.stderr and "TensorBoard: " in first.stderr
    board = EventAccumulator(str(out / "tensorboard"))
    board.Reload()
    assert [(s.step, round(s.value, 5)) for s in board.Scalars("train/loss")] == \
        [(r["step"], round(r["loss"], 5)) for r in events(log, "step")]
    assert [(s.step, round(s.value, 5)) for s in board.Scalars("eval/loss")] == \
        [(e["step"], round(e["eval_loss"], 5)) for e in evals]

    # The saved weights were loaded: step 1's loss is the pretrained model's loss on step 1's batch
    # (LoRA starts with B = 0, so the model of step 1 is the base model).
    assert events(log, "step")[0]["loss"] == pytest.approx(_base_loss_of_step_1(workdir), abs=1e-5)

    # The adapter on the pretrained base gives the merged model's logits.
    ids = torch.randint(0, 258, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "final").eval()(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(workdir / "tiny"),
                                            out / "adapter").eval()(input_ids=ids).logits
    torch.testing.assert_close(adapted, merged, rtol=1e-4, atol=1e-5)
    assert "{{ eos_token }}" in (out / "final" / "chat_template.jinja").read_text()  # the template it learned

    # Training again into the same folder is refused (one line, exit 2) ...
    again = _finetune(workdir, "--output-dir", "out", "--eval-fraction", "0.25", "--num-epochs", "1")
    assert again.returncode == 2
    assert again.stderr.strip().splitlines()[-1] == ("finetune: error: --output-dir out already holds a finished "
                                                     "run; pass --overwrite to replace it, or choose another --output-dir")
    # ... and --resume continues it, saying from where.
    resumed = _finetune(workdir, "--output-dir", "out", "--eval-fraction", "0.25", "--num-epochs", "2", "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    last_saved = max(s for s in range(2, steps, 2))
    assert f"memkit: resumed from step {last_saved} (" in resumed.stderr
    assert events(read_log(out), "end")[-1]["steps_done"] == 2 * steps
