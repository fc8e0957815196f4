"""The planner's QLoRA rule (planner/search.py _quantized_instead, memkit/plan/quantize.py): for a
LoRA request with --allow qlora (#28: a 4-bit base changes what is trained, so never unasked) a
4-bit NF4 base is chosen only when the fastest 16-bit-base plan that fits offloads and the 4-bit
plan is priced faster; pinnable both ways; never for full fine-tuning."""
from __future__ import annotations

import pytest

from memkit.errors import MemkitError
from memkit.planner import Request, search
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec


def request(model: str = "llama-2-13b", **pins) -> Request:
    """LoRA r16 on one RTX 4090 (24 GiB): llama-2-13b's 16-bit weights alone are 24 GiB."""
    pins.setdefault("lora_rank", 16)
    return Request(model=load_model_spec(model), hardware=Hardware(gpu=find_gpu("rtx-4090"), num_gpus_per_node=1),
                   global_batch_size=8, seq_len=2048, **pins)


def _offloads(plan) -> bool:
    return plan.offload_optimizer != "none" or plan.offload_params != "none"


def test_qlora_replaces_an_offloaded_16bit_base_plan_and_says_why():
    refused = search(request(quantize_base="none")).chosen
    assert _offloads(refused.plan) and not refused.plan.is_quantized
    unasked = search(request())  # without --allow qlora: the same 16-bit-base plan
    assert unasked.chosen.plan == refused.plan
    assert not any(a.plan.is_quantized for a in unasked.alternatives)
    result = search(request(allow=("qlora",)))
    plan = result.chosen.plan
    assert (plan.quantize_base, plan.double_quant, plan.engine, plan.zero_stage) == ("nf4", True, "torch", 0)
    assert plan.optimizer == "adamw" and not _offloads(plan)
    assert result.chosen.speed.step_time_s < refused.speed.step_time_s
    note = next(n for n in result.notes if n.startswith("nf4 4-bit base"))
    assert refused.label in note and "--quantize-base none" in note
    assert result.alternatives[0].plan == refused.plan  # the 16-bit-base plan it replaced


def test_no_qlora_when_a_16bit_base_plan_fits_on_the_gpu():
    plan = search(request("llama-3.1-8b", allow=("qlora",))).chosen.plan
    assert not plan.is_quantized and not _offloads(plan)


def test_pinned_fp4_without_double_quant():
    plan = search(request("llama-3.1-8b", quantize_base="fp4", double_quant=False)).chosen.plan
    assert (plan.quantize_base, plan.double_quant, plan.engine) == ("fp4", False, "torch")


def test_full_fine_tuning_never_gets_a_4bit_base():
    with pytest.raises(MemkitError, match="add --lora-rank"):
        search(request("llama-3.2-1b", lora_rank=0, quantize_base="nf4"))
    assert not search(request("llama-3.2-1b", lora_rank=0)).chosen.plan.is_quantized
