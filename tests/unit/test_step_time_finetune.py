"""Hand-worked checks of the fine-tuning step-time terms (memkit/estimate/throughput.py), each
from the library's source: peft's fp32 LoRA adapters (peft/tuners/lora/layer.py Linear.forward,
peft/tuners/tuners_utils.py BaseTuner._cast_adapter_dtype), torchtune's side-stream activation
offload (torchtune/training/_activation_offloading.py OffloadActivations), DeepSpeed ZeRO-1 vs
ZeRO-2 gradient handling (runtime/zero/stage_1_and_2.py) and ZeRO-3's per-release debug strings
before v0.9.4 (runtime/zero/partitioned_param_coordinator.py)."""
from __future__ import annotations

import pytest
import torch

from memkit.estimate import kernels
from memkit.estimate.backward_techniques import activation_offload_transfer_s
from memkit.estimate import throughput as tp_model
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

LLAMA1B = load_model_spec("llama-3.2-1b")
A100 = find_gpu("a100-80gb")
ONE_A100 = Hardware(gpu=A100, num_gpus_per_node=1)


def test_peft_keeps_adapters_fp32_on_a_bf16_base_and_casts_the_input_to_them():
    """The premise of peft_fp32_adapters, on the real peft: get_peft_model's default
    autocast_adapter_dtype=True upcasts the adapters of a bf16 base to fp32, and Linear.forward
    hands lora_A (through dropout) an fp32 input while the base output stays bf16."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    base = torch.nn.Sequential(torch.nn.Linear(16, 16, bias=False)).to(torch.bfloat16)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["0"], lora_dropout=0.1))
    layer = model.base_model.model[0]
    assert layer.base_layer.weight.dtype == torch.bfloat16
    assert layer.lora_A["default"].weight.dtype == torch.float32
    assert layer.lora_B["default"].weight.dtype == torch.float32
    seen = {}
    layer.lora_A["default"].register_forward_hook(lambda m, i, o: seen.update(inp=i[0].dtype, out=o.dtype))
    out = model(torch.randn(3, 16, dtype=torch.bfloat16))
    assert seen == {"inp": torch.float32, "out": torch.float32}   # fp32 GEMM without autocast
    assert out.dtype == torch.bfloat16                              # result.to(torch_result_dtype)


def test_which_runs_get_fp32_adapters():
    lora = dict(lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert tp_model.peft_fp32_adapters(TrainingPlan(engine="torch", precision="bf16-pure", **lora))
    assert tp_model.peft_fp32_adapters(TrainingPlan(engine="torch", precision="bf16", **lora))
    # DeepSpeed casts the whole module to the training dtype (engine._configure_distributed_model)
    assert not tp_model.peft_fp32_adapters(TrainingPlan(engine="deepspeed", precision="bf16-pure", **lora))
    # a framework that casts after peft (VectorLM's .bfloat16()) or has its own LoRA (torchtune)
    assert not tp_model.peft_fp32_adapters(TrainingPlan(engine="torch", precision="bf16-pure", **lora), "bf16")
    assert not tp_model.peft_fp32_adapters(TrainingPlan(engine="torch", precision="fp32", **lora))
    assert not tp_model.peft_fp32_adapters(TrainingPlan(engine="torch", precision="bf16-pure"))


def test_fp32_adapters_without_autocast_run_their_six_gemms_on_the_cuda_cores_by_hand():
    plan = TrainingPlan(engine="torch", precision="bf16-pure", lora_rank=16, lora_targets=("q_proj",),
                        lora_dropout=0.0)
    m, k, n, r = 4096.0, 2048, 2048, 16
    fp32 = tp_model.lora_adapter_pass(A100, plan, m, k, n, fp32_adapters=True)
    gemm = lambda prec, a, b, c: kernels.gemm_time_s(A100, prec, a, b, c)  # noqa: E731
    mem = lambda nbytes: kernels.memory_time_s(A100, nbytes)  # noqa: E731
    # forward: x.to(fp32) (2 B read, 4 written per input element), x A and (xA) B in fp32,
    # * scaling (4 + 4), bf16 result + fp32 delta -> fp32 (2 + 4 read, 4 written), .to(bf16) (4 + 2)
    fwd = (mem(6 * m * k) + gemm("fp32", m, r, k) + gemm("fp32", m, n, r) + mem((8 + 10 + 6) * m * n))
    # backward: the four adapter GEMMs in fp32 and a backward of the same width per elementwise op
    bwd = (gemm("fp32", m, r, n) + gemm("fp32", m, k, r) + gemm("fp32", r, n, m) + gemm("fp32", k, r, m)
           + mem(6 * m * k) + mem((8 + 10 + 6) * m * n))
    assert fp32.fwd_s == pytest.approx(fwd, rel=1e-12)
    assert fp32.bwd_s == pytest.approx(bwd, rel=1e-12)
    # the same adapter in bf16 (DeepSpeed's cast, or torchtune's LoRALinear): tensor-core GEMMs
    bf16 = tp_model.lora_adapter_pass(A100, plan, m, k, n, fp32_adapters=False)
    assert bf16.fwd_s == pytest.approx(gemm("bf16-pure", m, r, k) + gemm("bf16-pure", m, n, r) + mem(6 * m * n))
    assert fp32.fwd_s > 3 * bf16.fwd_s


def test_fp32_adapters_under_autocast_keep_bf16_gemms_and_pay_the_casts_and_fp32_dropout():
    plan = TrainingPlan(engine="torch", precision="bf16", lora_rank=8, lora_targets=("q_proj",),
                        lora_dropout=0.05)
    m, k, n, r = 2048.0, 2048, 512, 8
    got = tp_model.lora_adapter_pass(A100, plan, m, k, n, fp32_adapters=True)
    gemm = lambda a, b, c: kernels.gemm_time_s(A100, "bf16", a, b, c)  # noqa: E731
    mem = lambda nbytes: kernels.memory_time_s(A100, nbytes)  # noqa: E731
    casts = 2 * mem(6 * m * k)            # x.to(fp32) by peft, back to bf16 by autocast's F.linear
    drop = mem((2 * 4 + 1) * m * k)       # fp32 dropout: read, write, 1-byte mask
    assert got.fwd_s == pytest.approx(gemm(m, r, k) + gemm(m, n, r) + mem(6 * m * n) + casts + drop, rel=1e-12)
    assert got.bwd_s == pytest.approx(gemm(m, r, n) + gemm(m, k, r) + gemm(r, n, m) + gemm(k, r, m)
                                      + casts + 2 * drop, rel=1e-12)


def test_a_peft_lora_step_can_be_slower_than_full_fine_tuning_at_the_same_shape():
    """bf16-pure, every block linear at rank 64, one A100: the fp32 adapter GEMMs cost more than
    the weight gradients LoRA saves; with bf16 adapters LoRA is faster, as expected."""
    shape = dict(engine="torch", precision="bf16-pure", micro_batch_size=4, seq_len=2048, attention="sdpa")
    full = estimate_step_time(LLAMA1B, TrainingPlan(**shape), ONE_A100).step_time_s
    lora = TrainingPlan(**shape, lora_rank=64, lora_targets=LLAMA1B.linear_names())
    peft = estimate_step_time(LLAMA1B, lora, ONE_A100).step_time_s
    cast = estimate_step_time(LLAMA1B, lora, ONE_A100, lora_adapter_dtype="bf16").step_time_s
    assert peft > full > cast


def test_activation_offload_on_a_side_stream_costs_only_what_sticks_out_of_each_pass():
    """torchtune OffloadActivations(use_streams=True): out during forward, back during backward,
    each hidden behind its pass; memkit's runner copies on the compute stream (all exposed)."""
    assert tp_model.activation_offload_exposed_s(2.0, fwd_s=0.4, bwd_s=0.5) == pytest.approx(0.6 + 0.5)
    assert tp_model.activation_offload_exposed_s(2.0, fwd_s=1.0, bwd_s=2.0) == 0.0
    plan = TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=2, seq_len=4096,
                        checkpointing="full", offload_activations="cpu")
    base = estimate_step_time(LLAMA1B, TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=2,
                                                    seq_len=4096, checkpointing="full"), ONE_A100)
    exposed = estimate_step_time(LLAMA1B, plan, ONE_A100)
    streamed = estimate_step_time(LLAMA1B, plan, ONE_A100, offload_streams=True)
    moved = activation_offload_transfer_s(LLAMA1B, plan, A100.pcie_gbps)
    assert exposed.step_time_s - base.step_time_s == pytest.approx(moved, rel=1e-9)
    # on the side stream the copies hide behind forward and backward, up to what sticks out
    assert base.step_time_s <= streamed.step_time_s < exposed.step_time_s
    assert streamed.step_time_s - base.step_time_s < moved / 2


def _ds(stage: int, **kw) -> TrainingPlan:
    return TrainingPlan(engine="deepspeed", precision="bf16", zero_stage=stage, micro_batch_size=2, seq_len=2048, **kw)


def test_zero2_handles_every_gradient_each_micro_step_and_zero1_once_per_step_by_hand():
    """deepspeed runtime/zero/stage_1_and_2.py: with contiguous_gradients each 16-bit gradient is
    copied into the ipg bucket and the rank's part into grads_in_partition; 6 ops per tensor."""
    hw = Hardware(gpu=A100, num_gpus_per_node=1)
    copy_s, ops = tp_model.zero12_grad_handling(_ds(2, grad_accum=4), LLAMA1B, A100)
    n = LLAMA1B.num_params
    assert copy_s == pytest.approx(kernels.memory_time_s(A100, 2 * 2 * n + 2 * 2 * n / 1), rel=1e-12)
    tensors = tp_model._param_tensors(LLAMA1B, _ds(2))
    assert ops == tensors * 6
    # Llama 3.2 1B: 16 blocks x (7 linears + 2 norms) + embedding, final norm, head = 147 tensors
    assert tensors == 16 * 9 + 3
    one = estimate_step_time(LLAMA1B, _ds(1, grad_accum=4), hw)
    two = estimate_step_time(LLAMA1B, _ds(2, grad_accum=4), hw)
    assert two.components_s["zero_grad_copies"] == pytest.approx(4 * copy_s, rel=1e-12)
    assert one.components_s["zero_grad_copies"] == pytest.approx(max(copy_s, ops * tp_model.OP_DISPATCH_S))
    assert two.step_time_s > one.step_time_s          # stage 1 and stage 2 no longer tie on one GPU
    # torch engine (DDP / FSDP) and contiguous_gradients=False: no such copies
    assert tp_model.zero12_grad_handling(TrainingPlan(engine="torch", zero_stage=2), LLAMA1B, A100) == (0.0, 0)
    assert tp_model.zero12_grad_handling(_ds(2, contiguous_gradients=False), LLAMA1B, A100) == (0.0, 0)


def test_zero3_before_deepspeed_0_9_4_formats_debug_strings_at_every_fetch_and_release():
    from memkit.spec.stack import Stack, behaviour

    assert behaviour(Stack(deepspeed="0.9.2")).zero3_debug_strings
    assert not behaviour(Stack(deepspeed="0.9.4")).zero3_debug_strings
    assert not behaviour(Stack(deepspeed="0.19.8")).zero3_debug_strings
    hw = Hardware(gpu=A100, num_gpus_per_node=2)
    plan = TrainingPlan(engine="deepspeed", precision="bf16", zero_stage=3, dp=2, micro_batch_size=2, seq_len=2048)
    old = estimate_step_time(LLAMA1B, plan, hw, stack=Stack(deepspeed="0.8.3"))
    new = estimate_step_time(LLAMA1B, plan, hw, stack=Stack(deepspeed="0.14.0"))
    # 147 parameters fetched and released in forward and again in backward, 4 strings each
    extra = 2 * 147 * 4 * tp_model.OP_DISPATCH_S
    assert old.step_time_s - new.step_time_s == pytest.approx(extra, rel=1e-9)
    assert new.step_time_s == pytest.approx(estimate_step_time(LLAMA1B, plan, hw).step_time_s, rel=1e-12)


def test_fsdp_runs_peft_adapters_in_its_param_dtype():
    lora = dict(lora_rank=8, lora_targets=("q_proj", "v_proj"), precision="bf16-pure", engine="torch")
    assert not tp_model.peft_fp32_adapters(TrainingPlan(zero_stage=3, dp=2, **lora))
    assert not tp_model.peft_fp32_adapters(TrainingPlan(zero_stage=2, dp=2, **lora))
    assert tp_model.peft_fp32_adapters(TrainingPlan(zero_stage=0, dp=2, **lora))     # DDP keeps them fp32


def test_gpt2_gelu_new_is_eight_eager_kernels_mostly_fp32_under_autocast_by_hand():
    from transformers.activations import ACT2FN, NewGELUActivation

    assert isinstance(ACT2FN["gelu_new"], NewGELUActivation)   # GPT-2's default activation_function
    # autocast, bf16 (e = 2): 0.5*x 4, pow 2+4+8, *c 8, x+ 2+4+4, *sqrt 8, tanh 8, 1+ 8, product 2+4+4,
    # cast back for c_proj 4+2
    assert tp_model.gelu_new_bytes(2, autocast=True) == 4 + 14 + 8 + 10 + 8 + 8 + 8 + 10 + 6 == 76
    assert tp_model.gelu_new_bytes(2, autocast=False) == 6 * 4 + 2 * 6 == 36
    gpt2 = load_model_spec("gpt2")
    assert gpt2.hidden_act == "gelu_new"
    plan = TrainingPlan(engine="torch", precision="bf16", micro_batch_size=8, seq_len=1024)
    tokens = 8 * 1024
    eager = tp_model._elementwise_pass(A100, plan, gpt2, 1, tokens)
    fused = tp_model._elementwise_pass(A100, plan, gpt2, 1, tokens, compiled=True)
    gpt2_gelu = gpt2.__class__(**{**{f: getattr(gpt2, f) for f in gpt2.__dataclass_fields__}, "hidden_act": "gelu"})
    one_kernel = tp_model._elementwise_pass(A100, plan, gpt2_gelu, 1, tokens)
    i = gpt2.intermediate_size
    assert eager.fwd_s - one_kernel.fwd_s == pytest.approx(kernels.memory_time_s(A100, (76 - 2 * 2) * i * tokens),
                                                          rel=1e-9)
    # compiled, gelu_new is one fused kernel like exact GELU (GPT-2's LayerNorm is one kernel either way)
    assert fused.fwd_s == pytest.approx(one_kernel.fwd_s, rel=1e-12)


def test_hf_gradient_checkpointing_is_reentrant_before_transformers_5_and_never_stops_early():
    from memkit.spec.stack import Stack, behaviour

    assert behaviour(Stack(transformers="4.40", torch="2.3")).hf_checkpoint_reentrant
    assert not behaviour(Stack(transformers="5.24", torch="2.13")).hf_checkpoint_reentrant
    plan = TrainingPlan(engine="torch", precision="bf16", micro_batch_size=4, seq_len=2048, checkpointing="full")
    old = Stack(transformers="4.40", torch="2.3")
    reentrant = estimate_step_time(LLAMA1B, plan, ONE_A100, stack=old, hf_checkpointing=True)
    non_reentrant = estimate_step_time(LLAMA1B, plan, ONE_A100, stack=old)
    # the difference is the down projection's forward, re-run in each of the 16 blocks
    down = next(lin for lin in LLAMA1B.layer_linears if lin.role == "down")
    down_fwd = tp_model._linear_pass(A100, plan, LLAMA1B, down, 4 * 2048).fwd_s
    assert (reentrant.components_s["recompute"] - non_reentrant.components_s["recompute"]
            == pytest.approx(16 * down_fwd, rel=1e-9))
    new = Stack(transformers="5.24", torch="2.13")
    assert estimate_step_time(LLAMA1B, plan, ONE_A100, stack=new, hf_checkpointing=True).step_time_s == \
        pytest.approx(estimate_step_time(LLAMA1B, plan, ONE_A100, stack=new).step_time_s, rel=1e-12)
