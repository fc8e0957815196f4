"""The one FLOPs-per-token formula: model FLOPs of one trained token, the numerator of MFU.

Predicted MFU (memkit/estimate/throughput.py) and measured MFU (memkit/measure/runtime.py, the run
report) both call `train_flops_per_token`, so the two figures are comparable.

PaLM (Chowdhery et al. 2022), Appendix B: 6N + 12 L H Q T per token, N the parameters a token meets
in a matmul, L layers, H heads, Q head dim, T sequence length (the attention term counts the full,
non-causal score matrix, as published MFU tables do: llm-foundry, torchtitan, nanoGPT). The 6N is
2N forward + 2N input gradients + 2N weight gradients (Narayanan et al. 2021, Sec. 5.1); frozen
weights (LoRA) get no weight gradient, so it becomes 4N + 2N_trainable. Recompute is not model work:
it counts in HFU only (Korthikanti et al. 2022, Sec. 6).
"""
from __future__ import annotations


def train_flops_per_token(*, matmul_params: int, trainable_matmul_params: int, num_layers: int,
                          attention_width: int, seq_len: int) -> float:
    """matmul_params: parameters used in matmuls (no embedding lookup; a tied LM head counts);
    trainable_matmul_params: those that get a weight gradient; attention_width: heads x head_dim."""
    dense = 4.0 * matmul_params + 2.0 * trainable_matmul_params
    attention = 12.0 * num_layers * attention_width * seq_len
    return dense + attention
