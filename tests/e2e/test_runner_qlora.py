"""The runner with a 4-bit base (QLoRA, memkit/train/quantize.py): a tiny Llama checkpoint loaded
in NF4 by bitsandbytes on CPU in each of 2 DDP processes (gloo), LoRA on top, against the same run
on the 16-bit base.

Measured (6 AdamW steps, lr 3e-3, 2 processes): the NF4 run's losses fall (5.809 -> 5.593) and
track the 16-bit-base run's within 0.9 % (the 4-bit weights are a close copy of the base; asserted
at 2 %). Peak measured/predicted: 1.096 (NF4) vs 1.084 (16-bit base), asserted equal within 0.03
(the common ~9 % is the runner's own overhead at this 2 MiB size; the 4-bit terms are checked at
scale by tests/unit/test_estimate_measured_qlora.py). One process gave 1.097 vs 1.044 (~84 KB
more than predicted; not asserted): the runner's own run, since the same training steps measured
by memkit.calibrate.cpu_step on this model save what the estimate says (0.23 MiB both). The run saves the adapter only, and the base
loaded in 4 bits + that adapter reproduces the trained model's logits.
"""
from __future__ import annotations

import json

import pytest
import yaml
from runner_util import TEXT_DATA, TINY_LLAMA, events, launch, plan_document, read_log

from memkit.emit.accelerate import accelerate_config
from memkit.plan.plan import TrainingPlan

pytestmark = pytest.mark.e2e


def _write_checkpoint(folder):
    """A seeded tiny Llama saved with its weights (the base the adapter is applied to)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    data = dict(TINY_LLAMA)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(data.pop("model_type"), **data))
    model.save_pretrained(folder)
    return folder


def _run(tmp_path, name, plan, base):
    bundle = tmp_path / f"bundle-{name}"
    bundle.mkdir()
    config = bundle / "accelerate.yaml"
    config.write_text(yaml.safe_dump(accelerate_config(plan, deepspeed_config_file=None, num_gpus_per_node=plan.dp)))
    plan_path = bundle / "plan.json"
    plan_path.write_text(json.dumps(plan_document(plan, num_gpus_per_node=plan.dp, num_nodes=1)))
    out = tmp_path / f"run-{name}"
    result = launch(config, ["--plan", str(plan_path), "--model", str(base), "--data", str(TEXT_DATA),
                             "--max-steps", "6", "--lr", "3e-3", "--lr-decay", "constant", "--output-dir", str(out)])
    assert result.returncode == 0, result.stdout[-4000:]
    return out, read_log(out)


def test_nf4_base_trains_like_the_16bit_base_under_ddp_and_saves_a_loadable_adapter(tmp_path):
    import torch
    from peft import PeftModel

    from memkit.train.quantize import load_quantized

    base = _write_checkpoint(tmp_path / "tiny")
    plain = TrainingPlan(engine="torch", precision="fp32", micro_batch_size=2, seq_len=64, dp=2, lora_rank=8)
    qlora = plain.with_(quantize_base="nf4")
    runs = {name: _run(tmp_path, name, plan, base) for name, plan in (("lora", plain), ("qlora", qlora))}
    (q_out, q_log), (l_out, l_log) = runs["qlora"], runs["lora"]
    start = events(q_log, "start")[-1]
    assert (start["plan"]["quantize_base"], start["plan"]["double_quant"], start["plan"]["engine"]) == \
        ("nf4", True, "torch")
    assert start["num_params"] == events(l_log, "start")[-1]["num_params"]  # 4-bit weights counted per element
    q_losses = [s["loss"] for s in events(q_log, "step")]
    l_losses = [s["loss"] for s in events(l_log, "step")]
    assert q_losses[-1] < q_losses[0] - 0.1
    assert q_losses == pytest.approx(l_losses, rel=2e-2) and q_losses != l_losses
    q_ratio = events(q_log, "end")[-1]["measured_over_predicted"]["allocated_peak_bytes"]
    l_ratio = events(l_log, "end")[-1]["measured_over_predicted"]["allocated_peak_bytes"]
    assert q_ratio == pytest.approx(l_ratio, abs=0.03)
    # The adapter alone (no merged 4-bit 'final' folder), and it reproduces the trained model.
    assert not (q_out / "final").exists() and (q_out / "adapter" / "adapter_model.safetensors").is_file()
    model = PeftModel.from_pretrained(load_quantized(base, qlora), str(q_out / "adapter")).eval()
    probe = torch.load(q_out / "probe_logits.pt")
    with torch.no_grad():
        logits = model(input_ids=probe["input_ids"], attention_mask=probe["attention_mask"]).logits
    assert torch.allclose(logits.float(), probe["logits"], atol=1e-5)
