"""The LoRA adapter the runner saves beside the merged model: PeftModel.from_pretrained puts it on
the base weights and gives the merged model's logits."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from runner_util import TINY_LLAMA  # noqa: E402


def test_adapter_on_base_gives_merged_logits(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from memkit.train.checkpoint import save_final_model
    from memkit.train.tokenizer import byte_tokenizer

    cfg = dict(TINY_LLAMA)
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg), dtype=torch.float32)
    base.save_pretrained(tmp_path / "base")
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                            lora_dropout=0.0, task_type="CAUSAL_LM"))
    with torch.no_grad():  # as after training: B != 0, so the adapter changes the logits
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.5)
    accelerator = Accelerator(cpu=True)
    try:
        prepared = accelerator.prepare(model)
        save_final_model(accelerator, prepared, byte_tokenizer(), tmp_path / "final", lora_scaling=8 / 4,
                         adapter_dir=tmp_path / "adapter", base_model=str(tmp_path / "base"))
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)

    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == ["README.md", "adapter_config.json",
                                                                       "adapter_model.safetensors"]
    adapter_config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == str(tmp_path / "base")
    assert (adapter_config["r"], adapter_config["lora_alpha"]) == (4, 8)
    assert not (tmp_path / "final" / "adapter_config.json").exists()

    ids = torch.randint(0, 258, (2, 16), generator=torch.Generator().manual_seed(1))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "final").eval()
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                        tmp_path / "adapter").eval()
    with torch.no_grad():
        merged_logits = merged(input_ids=ids).logits
        adapted_logits = adapted(input_ids=ids).logits
        plain_logits = plain(input_ids=ids).logits
    torch.testing.assert_close(adapted_logits, merged_logits, rtol=1e-4, atol=1e-5)
    assert (merged_logits - plain_logits).abs().max() > 1e-2  # the adapter is not a no-op
