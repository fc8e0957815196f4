"""Bytes of a 4-bit (QLoRA) base on one rank: the packed weights, their quantisation state, the
floating-point rest, and the dequantised-weight temporary of one linear (rules and the
bitsandbytes / transformers / peft sources: memkit/plan/quantize.py).

- Quantised: every decoder (and encoder) block linear except fused MoE expert tensors
  (transformers replace_with_bnb_linear converts nn.Linear / Conv1D modules only). The embedding,
  norms and lm_head stay floating point, in fp32 after prepare_model_for_kbit_training
  (peft utils/other.py), and so do the LoRA adapters (peft autocast_adapter_dtype=True). A 4-bit
  linear's bias is recast to the compute dtype at its first forward (bitsandbytes nn/modules.py
  Linear4bit.forward: `bias.data = bias.data.to(x.dtype)` after x is cast to compute_dtype).
- Forward and backward each dequantise one whole weight into a compute-dtype tensor, freed
  after its matmul (bitsandbytes autograd/_functions.py MatMul4Bit, backends/default/ops.py
  _gemm_4bit_default_impl): one such weight, the largest, is live at a time.
"""
from __future__ import annotations

from memkit.plan.plan import TrainingPlan
from memkit.plan.quantize import packed_bytes, quant_state_bytes
from memkit.spec.model import Linear, ModelSpec

COMPUTE_ITEMSIZE = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of bnb_4bit_compute_dtype for each precision (memkit/plan/quantize.py COMPUTE_DTYPE)."""


def quantized_linears(model: ModelSpec) -> list[tuple[Linear, int]]:
    """(linear, number of blocks it is in) for every linear transformers stores in 4 bits."""
    out = [(lin, model.num_layers) for lin in model.layer_linears if not lin.role.startswith("expert")]
    out += [(lin, model.num_encoder_layers) for lin in model.encoder_layer_linears
            if not lin.role.startswith("expert")]
    return [(lin, n) for lin, n in out if n]


def quantized_numel(model: ModelSpec) -> int:
    """Weight elements held in 4 bits (biases excluded: they stay fp32)."""
    return sum(lin.count * lin.in_features * lin.out_features * n for lin, n in quantized_linears(model))


def base_bytes(model: ModelSpec, plan: TrainingPlan, num_params: int) -> dict[str, int]:
    """Resident bytes of a 4-bit base of `num_params` parameters (adapters included) by component:
    'weights' (the fp32 rest and adapters), 'weights_4bit' (packed), 'quant_state' (scales, codes)."""
    packed = state = 0
    for lin, n in quantized_linears(model):
        numel = lin.in_features * lin.out_features
        packed += lin.count * n * packed_bytes(numel)
        state += lin.count * n * quant_state_bytes(numel, double_quant=plan.double_quant)
    biases = sum(lin.count * n * lin.out_features for lin, n in quantized_linears(model) if lin.bias)
    rest = num_params - quantized_numel(model) - biases
    return {"weights": rest * 4 + biases * COMPUTE_ITEMSIZE[plan.precision], "weights_4bit": packed,
            "quant_state": state}


def dequantized_weight_bytes(model: ModelSpec, plan: TrainingPlan) -> int:
    """The largest linear's weight dequantised into the compute dtype (the temporary of its matmul)."""
    largest = max((lin.in_features * lin.out_features for lin, _ in quantized_linears(model)), default=0)
    return largest * COMPUTE_ITEMSIZE[plan.precision]


def dequant_traffic_bytes(model: ModelSpec, plan: TrainingPlan, tokens: int) -> tuple[float, float]:
    """(forward, backward) bytes read + written by the 4-bit work of one micro-batch, for a
    memory-bound roofline (estimate/kernels.py memory_time_s): every quantised weight is
    dequantised once in forward and once in backward (MatMul4Bit), reading half a byte per
    element plus its scales (QLoRA Sec. 3: 4.127 / 4.5 bits) and writing the compute dtype; under
    autocast each linear's output is cast back to the fp32 stream (Linear4bit.forward
    `.to(inp_dtype)`: 2 B read + 4 B written per element), and its gradient cast again in backward."""
    from memkit.plan.quantize import bits_per_param

    c = COMPUTE_ITEMSIZE[plan.precision]
    dequant = sum(lin.count * n * lin.in_features * lin.out_features for lin, n in quantized_linears(model)) \
        * (bits_per_param(double_quant=plan.double_quant) / 8 + c)
    outputs = tokens * sum(lin.count * n * lin.out_features for lin, n in quantized_linears(model)) \
        * ((c + 4) if c != 4 else 0)
    return dequant + outputs, dequant + outputs
