"""The runner on the task plans (issue 27): a tiny BART trained as a seq2seq LM (source/target records,
the encoder at --seq-len, the decoder at --target-len), and tiny BERT sequence and token classifiers,
each two steps in one process (launch/finetune.py without a launcher: world size 1, distributed type
NO), on memkit's byte tokenizer. Each checks the loss is finite, the final folder reloads as the
task's model, and the live-tensor peak is compared with the CPU-priced plan."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

from memkit.plan import TrainingPlan

from runner_util import FINETUNE, REPO, env, events, read_log

pytestmark = pytest.mark.e2e

TINY_BART = {"model_type": "bart", "architectures": ["BartForConditionalGeneration"], "d_model": 64,
             "encoder_layers": 2, "decoder_layers": 2, "encoder_attention_heads": 4, "decoder_attention_heads": 4,
             "encoder_ffn_dim": 128, "decoder_ffn_dim": 128, "vocab_size": 320, "max_position_embeddings": 128,
             "pad_token_id": 1, "bos_token_id": 0, "eos_token_id": 2, "decoder_start_token_id": 2}
TINY_BERT = {"model_type": "bert", "architectures": ["BertForMaskedLM"], "hidden_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 4, "intermediate_size": 128, "vocab_size": 320, "max_position_embeddings": 128,
             "pad_token_id": 0}


def _plan_doc(config: dict, plan: TrainingPlan) -> dict:
    """plan.json as `memkit suggest --out` writes it (memkit.emit.bundle.plan_document), priced on the CPU."""
    from memkit.emit.bundle import plan_document
    from memkit.estimate.memory import estimate_memory
    from memkit.estimate.throughput import estimate_step_time
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    spec = spec_from_config(dict(config), name=config["model_type"])
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1, num_nodes=1)
    return plan_document(model_name=config["model_type"], plan=plan,
                         hardware={"gpu": hardware.gpu.name, "num_gpus_per_node": 1, "num_nodes": 1},
                         memory=estimate_memory(spec, plan, hardware, device="cpu"),
                         speed=estimate_step_time(spec, plan, hardware), label="test")


def _run(tmp_path, name: str, config: dict, plan: TrainingPlan, records: list[dict], extra=()):
    model = tmp_path / f"{name}-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    data = tmp_path / f"{name}.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    plan_path = tmp_path / f"{name}-plan.json"
    plan_path.write_text(json.dumps(_plan_doc(config, plan)))
    out = tmp_path / f"{name}-out"
    report = tmp_path / f"{name}-report.json"
    cmd = [sys.executable, str(FINETUNE), "--plan", str(plan_path), "--model", str(model), "--data", str(data),
           "--output-dir", str(out), "--max-steps", "2", "--lr", "1e-3", "--no-progress", "--report-to", "none",
           "--report-json", str(report), *extra]
    result = subprocess.run(cmd, cwd=REPO, env=env(), capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    log = read_log(out)
    start = events(log, "start")[-1]
    assert (start["world_size"], start["distributed_type"]) == (1, "NO")
    losses = [s["loss"] for s in events(log, "step")]
    assert len(losses) == 2 and all(math.isfinite(v) and v > 0 for v in losses)
    return start, json.loads(report.read_text()), out, result.stderr


def test_bart_seq2seq_two_lengths(tmp_path):
    from transformers import AutoModelForSeq2SeqLM

    plan = TrainingPlan(engine="torch", precision="fp32", optimizer="adamw", micro_batch_size=2, seq_len=32,
                        target_len=16, gradient_clipping=0.0)
    records = [{"source": f"sum {i}: " + "ab " * (i % 4), "target": f"n{i}"} for i in range(8)]
    start, report, out, err = _run(tmp_path, "bart", TINY_BART, plan, records)
    assert start["data"] | {} == start["data"] and start["data"]["task"] == "seq2seq"
    assert (start["data"]["seq_len"], start["data"]["target_len"], start["data"]["kind"]) == (32, 16, "seq2seq")
    assert "targets of 16" in err
    model = AutoModelForSeq2SeqLM.from_pretrained(str(out / "final"))
    assert type(model).__name__ == "BartForConditionalGeneration"
    probe = torch.load(out / "probe_logits.pt")
    assert probe["logits"].shape == (1, 16, 320)  # decoder positions x vocab
    assert report["status"] == "ok" and report["steps_done"] == 2


def test_bert_sequence_classifier(tmp_path):
    from transformers import AutoModelForSequenceClassification

    plan = TrainingPlan(engine="torch", precision="fp32", optimizer="adamw", micro_batch_size=2, seq_len=32,
                        task="seq-cls", num_labels=3, gradient_clipping=0.0)
    records = [{"text": f"review {i} " + "good " * (i % 3), "label": i % 3} for i in range(8)]
    start, report, out, _ = _run(tmp_path, "cls", TINY_BERT, plan, records)
    assert (start["data"]["task"], start["data"]["kind"]) == ("seq-cls", "classification")
    model = AutoModelForSequenceClassification.from_pretrained(str(out / "final"))
    assert model.config.num_labels == 3 and model.classifier.out_features == 3
    assert torch.load(out / "probe_logits.pt")["logits"].shape == (1, 3)


def test_bert_token_classifier_lora(tmp_path):
    plan = TrainingPlan(engine="torch", precision="fp32", optimizer="adamw", micro_batch_size=2, seq_len=48,
                        task="token-cls", num_labels=5, lora_rank=4, lora_alpha=8,
                        lora_targets=("query", "value"), gradient_clipping=0.0)
    records = [{"tokens": ["EU", "rejects", f"item{i}"], "labels": [1, 0, i % 5]} for i in range(8)]
    start, report, out, _ = _run(tmp_path, "tok", TINY_BERT, plan, records)
    assert (start["data"]["task"], start["data"]["kind"]) == ("token-cls", "token_classification")
    adapter = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert adapter["task_type"] == "TOKEN_CLS"
    # the fresh head trains with the adapters (peft puts `classifier` in modules_to_save)
    assert 0 < start["num_trainable_params"] < start["num_params"]
    assert torch.load(out / "probe_logits.pt")["logits"].shape == (1, 48, 5)
