"""Eval loss for pipeline-parallel runs (#15): a pp2 (1F1B) run of `memkit suggest --pp 2`'s bundle
with --eval-fraction logs eval loss every --eval-every steps through the pipeline schedule's
forward-only eval (torch.distributed.pipelining), and its final figure is the eval loss of the saved
final model computed in one process on the same held-out sequences (fp32: the stage forwards are
the unsplit forward, tests/e2e/test_split_checkpoint.py PROBE_ATOL; only the order of the sums
differs)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from memkit.cli.main import main

from runner_util import TEXT_DATA, events, launch, read_log, write_tiny_llama

pytestmark = pytest.mark.e2e

EVAL_ATOL = 1e-5


def _eval_loss_of(folder, *, seq_len: int, eval_fraction: float) -> tuple[float, int]:
    from transformers import AutoModelForCausalLM

    from memkit.train.data import IGNORE_INDEX, prepare_data
    from memkit.train.loop import causal_lm_loss_sum
    from memkit.train.tokenizer import load_tokenizer

    model = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
    vocab = model.config.vocab_size
    data = prepare_data(str(TEXT_DATA), load_tokenizer(None, vocab_size=vocab), seq_len=seq_len,
                        max_positions=model.config.max_position_embeddings, vocab_size=vocab, seed=0,
                        eval_fraction=eval_fraction)
    batch = data.eval.batch(np.arange(data.eval.num_sequences))
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    tokens = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
    return float(causal_lm_loss_sum(logits, batch["labels"])) / tokens, tokens


def test_pipeline_run_logs_the_eval_loss_of_its_model(tmp_path):
    tiny = write_tiny_llama(tmp_path / "tiny").parent
    bundle = tmp_path / "pp2"
    assert main(["suggest", "--model", str(tiny), "--gpu", "a100-80gb", "--num-gpus", "2", "--global-batch-size", "4",
                 "--seq-len", "32", "--max-micro-batch", "1", "--precision", "fp32", "--pp", "2",
                 "--out", str(bundle)]) == 0
    out = tmp_path / "run"
    proc = launch(bundle / "accelerate.yaml", ["--plan", str(bundle / "plan.json"), "--model", str(tiny),
                                               "--data", str(TEXT_DATA), "--output-dir", str(out), "--max-steps", "4",
                                               "--lr", "3e-3", "--eval-fraction", "0.25", "--eval-every", "2"])
    assert proc.returncode == 0, proc.stdout[-4000:]
    log = read_log(out)
    assert events(log, "start")[0]["plan"]["pp"] == 2
    evals = events(log, "eval")
    assert [e["step"] for e in evals] == [2, 4]
    expected, tokens = _eval_loss_of(out / "final", seq_len=32, eval_fraction=0.25)
    assert evals[-1]["eval_tokens"] == tokens
    print(f"pp2 eval loss {evals[-1]['eval_loss']:.8f} vs the final model in one process {expected:.8f} "
          f"({tokens} tokens)")
    assert evals[-1]["eval_loss"] == pytest.approx(expected, abs=EVAL_ATOL)
    assert evals[0]["eval_loss"] != evals[-1]["eval_loss"]  # the model between the two evals trained
