"""QLoRA byte rules (memkit/plan/quantize.py, estimate/quantized.py) on hand-worked examples, checked
against the storages bitsandbytes 0.50 really allocates on CPU, and the knob's refusals."""
from __future__ import annotations

import pytest

from memkit.errors import MemkitError
from memkit.estimate.quantized import base_bytes, dequantized_weight_bytes, quantized_numel
from memkit.plan.plan import TrainingPlan
from memkit.plan.quantize import absmax_bytes, bits_per_param, packed_bytes, quant_state_bytes
from memkit.spec.hf import spec_from_config

LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2000,
         "max_position_embeddings": 512, "tie_word_embeddings": False}


def test_hand_worked_4096_square_weight():
    n = 4096 * 4096                      # 16,777,216 elements, 262,144 blocks of 64
    assert packed_bytes(n) == 8_388_608  # two per byte
    assert absmax_bytes(n, double_quant=False) == 262_144 * 4
    # 8-bit absmax per block + fp32 absmax per 256 blocks (1,024 of them) + the fp32 offset
    assert absmax_bytes(n, double_quant=True) == 262_144 + 1_024 * 4 + 4
    assert quant_state_bytes(n, double_quant=True) == 266_244 + 16 * 4 + 256 * 4
    assert quant_state_bytes(n, double_quant=False) == 1_048_576 + 16 * 4
    assert packed_bytes(65) == 33 and absmax_bytes(65, double_quant=False) == 8  # 2 blocks, rounded up


def test_bits_per_param_are_the_papers():
    # QLoRA Sec. 3, Double Quantization: 32/64 = 0.5 bits of scales, 8/64 + 32/(64*256) = 0.127
    assert bits_per_param(double_quant=False) == 4.5
    assert bits_per_param(double_quant=True) == pytest.approx(4.127, abs=5e-4)


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("double_quant", [True, False])
@pytest.mark.parametrize("shape", [(256, 256), (688, 256), (64, 20_000)])
def test_formulas_equal_bitsandbytes_storages(quant_type, double_quant, shape):
    """bitsandbytes.functional.quantize_4bit on CPU: the packed tensor and every QuantState
    tensor (absmax, code, and nested: offset, state2.absmax, state2.code), in bytes."""
    import torch
    from bitsandbytes.functional import quantize_4bit

    weight = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    packed, state = quantize_4bit(weight, blocksize=64, compress_statistics=double_quant, quant_type=quant_type)
    tensors = [state.absmax, state.code] + ([state.offset, state.state2.absmax, state.state2.code]
                                            if double_quant else [])
    n = weight.numel()
    assert packed.untyped_storage().nbytes() == packed_bytes(n)
    assert sum(t.untyped_storage().nbytes() for t in tensors) == quant_state_bytes(n, double_quant=double_quant)


def test_model_bytes_hand_worked():
    spec = spec_from_config(dict(LLAMA), name="llama-gqa")
    # per block: q,o 256x256; k,v 256x64; gate,up 256x688 and down 688x256 -> 692,224; 4 blocks
    assert quantized_numel(spec) == 4 * 692_224
    plan = TrainingPlan(engine="torch", precision="bf16", lora_rank=8, quantize_base="nf4")
    lora = 4 * 2 * 8 * (256 + 256) + 4 * 2 * 8 * (256 + 64)  # q and v adapters, A and B
    got = base_bytes(spec, plan, spec.num_params + lora)
    assert got["weights_4bit"] == 4 * (2 * 32_768 + 2 * 8_192 + 3 * 88_064)
    # embedding + head (2 x 2000 x 256), 9 norms of 256, adapters: all fp32
    assert got["weights"] == 4 * (2 * 2000 * 256 + 9 * 256 + lora)
    assert dequantized_weight_bytes(spec, plan) == 256 * 688 * 2  # the largest weight in bf16


@pytest.mark.parametrize("changes, match", [
    ({"lora_rank": 0}, "add --lora-rank"),
    ({"precision": "bf16-pure"}, "use --precision bf16"),
    ({"engine": "deepspeed"}, "use --engine torch --zero 0"),
    ({"zero_stage": 3}, "use --engine torch --zero 0"),
    ({"quantize_base": "int4"}, "not one of none, nf4, fp4"),
])
def test_refusals_are_one_line(changes, match):
    plan = TrainingPlan(engine="torch", precision="bf16", lora_rank=8, quantize_base="nf4").with_(**changes)
    with pytest.raises(MemkitError, match=match):
        plan.validate()


def test_runner_refuses_a_4bit_base_under_deepspeed_and_takes_it_under_ddp():
    """memkit/train/config.py resolve_plan with runner flags only (no plan.json)."""
    from memkit.emit.deepspeed import deepspeed_config
    from memkit.train.config import resolve_plan

    flags = {"quantize_base": "nf4", "lora_rank": 8, "precision": "bf16"}
    with pytest.raises(MemkitError, match="memkit runs 4-bit bases only with plain PyTorch / DDP"):
        resolve_plan(plan=None, flags=flags, ds_config=deepspeed_config(TrainingPlan(zero_stage=2, dp=2)),
                     world_size=2, distributed_type="DEEPSPEED")
    plan = resolve_plan(plan=None, flags={**flags, "double_quant": False}, ds_config=None, world_size=2,
                        distributed_type="MULTI_GPU")
    assert (plan.engine, plan.dp, plan.quantize_base, plan.double_quant) == ("torch", 2, "nf4", False)


def _tiny_4bit_llama():
    """A Llama whose linears are narrower than one quantisation block (in_features 32 < 64), as
    the e2e recipes' tiny model, through the runner's own 4-bit load (memkit/train/quantize.py)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from memkit.train.quantize import quantize_fresh

    torch.manual_seed(0)
    config = AutoConfig.for_model("llama", hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, vocab_size=320,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    plan = TrainingPlan(quantize_base="nf4", lora_rank=8, precision="fp32")
    return quantize_fresh(AutoModelForCausalLM.from_config(config), plan)


def test_a_4bit_base_evaluates_in_its_training_layout_on_any_cpu():
    """On an AVX512-BF16 CPU bitsandbytes repacks a Linear4bit for inference on its first eval-mode
    no-grad forward (Linear4bit.forward, support_avx512bf16_for_cpu), and the repack fails on a
    linear narrower than a block: absmax.reshape(out, in // 64) is [32, 0] (functional.py,
    _convert_weight_packed_for_cpu) -- the error a CI host gave the QLoRA recipe's eval. The
    runner's load turns that path off on every module, so eval runs the training kernels."""
    import torch

    model = _tiny_4bit_llama()
    linears = [m for m in model.modules() if hasattr(m, "support_avx512bf16_for_cpu")]
    assert len(linears) == 7 and not any(m.support_avx512bf16_for_cpu for m in linears)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 2, 3, 4]])).logits
    assert logits.shape == (1, 4, 320) and torch.isfinite(logits).all()
    assert not any(getattr(m.weight.quant_state, "packing_format_for_cpu", False) for m in linears)


def test_the_avx512_bf16_repack_is_what_fails_without_the_switch():
    """The same model with one module's flag as bitsandbytes sets it on such a host (the repack is
    plain torch, so it runs on this CPU too): the eval forward raises the CI error."""
    import torch

    model = _tiny_4bit_llama()
    q_proj = model.model.layers[0].self_attn.q_proj
    q_proj.support_avx512bf16_for_cpu = True
    model.eval()
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"shape '\[32, 0\]' is invalid for input of size 16"):
        model(input_ids=torch.tensor([[1, 2, 3, 4]]))
