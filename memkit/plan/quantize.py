"""QLoRA rules (torch-free, like memkit/plan/techniques.py): a frozen base whose linear weights are
stored in 4 bits, LoRA adapters trained on top (Dettmers et al. 2023, "QLoRA: Efficient
Finetuning of Quantized LLMs", Sec. 3), shared by the estimator, planner, emitters and runner.

What bitsandbytes 0.50 and transformers 5 do (read from the installed sources):
- Which weights are 4-bit: every nn.Linear / Conv1D except the output embedding (lm_head), tied
  weights and the last module (transformers quantizers/base.py get_keys_to_not_convert,
  integrations/bitsandbytes.py replace_with_bnb_linear -> bnb.nn.Linear4bit). Embeddings,
  norms and fused MoE expert tensors (no nn.Linear) stay floating point.
- Storage of one weight of n elements (bitsandbytes functional.py quantize_4bit, blocksize 64;
  nn/modules.py Params4bit): ceil(n/2) packed uint8 bytes; one absmax per 64-element block in
  fp32, or with double quantisation (compress_statistics, QLoRA Sec. 3 "Double Quantization")
  the absmax minus their mean in 8 bits (quantize_blockwise, blocksize 256) + one fp32 absmax
  per 256 blocks + the fp32 mean (`offset`, a 0-dim tensor). Each weight's QuantState also holds
  its own copy of the 16-entry fp32 4-bit code (get_4bit_type) and, nested, of the 256-entry
  fp32 dynamic 8-bit code (quantize_blockwise -> create_dynamic_map): counted, they are ~1 KiB.
- peft 0.21 utils/other.py prepare_model_for_kbit_training: freezes everything, casts every
  fp16/bf16 parameter that is not Params4bit to fp32 (so the unquantized rest is fp32 whatever
  dtype it was loaded in), and, only with use_gradient_checkpointing=True (its default), enables
  transformers' gradient checkpointing and input require-grads. memkit passes False and applies
  the plan's own checkpointing (memkit/train/techniques.py), so the plan decides.
- bnb.nn.Linear4bit.forward: casts its input to `compute_dtype` (BitsAndBytesConfig
  bnb_4bit_compute_dtype), runs matmul_4bit and casts the output back to the input's dtype;
  autograd/_functions.py MatMul4Bit saves only the packed weight, and forward and backward each
  dequantise the whole weight into a compute-dtype temporary (backends/default/ops.py
  _gemm_4bit_default_impl on CPU; on CUDA the same dequant + F.linear fallback above a few
  rows, backends/cuda/ops.py gemm_4bit) that is freed after its matmul.
- Where it runs: plain PyTorch, one process or DDP (tests/e2e/test_runner_qlora.py: 2 gloo
  processes). DeepSpeed (its engine casts and flattens the module's parameters), FSDP (needs
  bnb_4bit_quant_storage in the shard dtype) and tp/pp splits are not verified and are refused.
"""
from __future__ import annotations

QUANTIZE_BASES = ("none", "nf4", "fp4")
"""'nf4': 4-bit NormalFloat (QLoRA Sec. 3, the paper's choice); 'fp4': bitsandbytes' 4-bit float."""
BLOCKSIZE = 64
"""Elements per absmax block (bitsandbytes functional.py quantize_4bit, blocksize=None -> 64)."""
NESTED_BLOCKSIZE = 256
"""Absmax values per second-level block under double quantisation (functional.py quantize_4bit:
quantize_blockwise(_absmax - offset, blocksize=256))."""
CODE_4BIT_BYTES = 16 * 4
"""The fp32 16-entry NF4 / FP4 code each QuantState holds (functional.py get_4bit_type)."""
CODE_8BIT_BYTES = 256 * 4
"""The fp32 256-entry dynamic code of the nested absmax quantisation (create_dynamic_map)."""
COMPUTE_DTYPE = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}
"""bnb_4bit_compute_dtype per plan precision: the autocast dtype of a mixed plan, fp32 otherwise
(QLoRA Sec. 3: "BFloat16 computation data type"). bf16-pure has no QLoRA form (see below)."""


def quantize_knob_error(quantize_base: str, *, lora_rank: int, precision: str, engine: str,
                        zero_stage: int, tp: int, pp: int) -> str | None:
    """What a 4-bit base cannot run with (one line each), or None."""
    if quantize_base not in QUANTIZE_BASES:
        return f"--quantize-base {quantize_base!r} is not one of {', '.join(QUANTIZE_BASES)}"
    if quantize_base == "none":
        return None
    if lora_rank <= 0:
        return (f"--quantize-base {quantize_base} trains LoRA adapters on a frozen 4-bit base; "
                "add --lora-rank (e.g. --lora-rank 16)")
    if precision not in COMPUTE_DTYPE:
        return (f"--quantize-base {quantize_base} with --precision {precision}: "
                "prepare_model_for_kbit_training casts every non-4-bit weight to fp32; use --precision bf16")
    if engine != "torch" or zero_stage != 0:
        return (f"--quantize-base {quantize_base} with engine {engine} ZeRO-{zero_stage}: memkit runs 4-bit "
                "bases only with plain PyTorch / DDP (not verified under DeepSpeed or FSDP); use "
                "--engine torch --zero 0")
    if tp > 1 or pp > 1:
        return (f"--quantize-base {quantize_base} with tp={tp} pp={pp}: 4-bit weights cannot be split by "
                "AutoTP / tp_plan / pipeline stages in memkit; use --tp 1 --pp 1")
    return None


def absmax_bytes(numel: int, *, double_quant: bool) -> int:
    """Bytes of the block scales of one 4-bit weight of `numel` elements (QuantState.absmax and,
    nested, state2.absmax + offset), without the codes."""
    blocks = -(-numel // BLOCKSIZE)
    if not double_quant:
        return 4 * blocks
    return blocks + 4 * -(-blocks // NESTED_BLOCKSIZE) + 4


def quant_state_bytes(numel: int, *, double_quant: bool) -> int:
    """Everything one weight's QuantState holds: scales + its own copies of the codes."""
    codes = CODE_4BIT_BYTES + (CODE_8BIT_BYTES if double_quant else 0)
    return absmax_bytes(numel, double_quant=double_quant) + codes


def packed_bytes(numel: int) -> int:
    """Two 4-bit values per uint8 (functional.py quantize_4bit: ((n + 1) // 2, 1) uint8)."""
    return (numel + 1) // 2


def bits_per_param(*, double_quant: bool) -> float:
    """Storage per weight element, codes left out: 4 + 32/64 = 4.5 bits, or with double
    quantisation 4 + 8/64 + 32/(64*256) = 4.127 bits (QLoRA Sec. 3, Double Quantization)."""
    scales = (8 / BLOCKSIZE + 32 / (BLOCKSIZE * NESTED_BLOCKSIZE)) if double_quant else 32 / BLOCKSIZE
    return 4 + scales
