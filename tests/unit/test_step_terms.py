"""The step-time techniques' interface (memkit/estimate/step_terms.py): a technique a plan does not
use leaves every term as it found it, and one it uses adds its own term, worked by hand."""
from __future__ import annotations
import pytest

from memkit.estimate import kernels
from memkit.estimate.backward_techniques import activation_offload_transfer_s
from memkit.estimate.step_terms import (STEP_TECHNIQUES, ActivationOffload, Lora, Loss, OptimizerOffload, OptimizerStep,
                                        StepContext, StepTerms)
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.spec.stack import behaviour

LLAMA1B = load_model_spec("llama-3.2-1b")
A100 = find_gpu("a100-80gb")


def _context(plan: TrainingPlan) -> StepContext:
    return StepContext(model=LLAMA1B, plan=plan, hardware=Hardware(gpu=A100), gpu=A100, how=behaviour(None),
                       tokens=plan.micro_batch_size * plan.seq_len)


def test_a_technique_the_plan_does_not_use_adds_nothing():
    c = _context(TrainingPlan(engine="torch", precision="bf16-pure", gradient_clipping=0.0))
    for technique in STEP_TECHNIQUES:
        if isinstance(technique, OptimizerStep):
            continue  # every plan steps its optimizer
        t = StepTerms()
        technique.setup(c, t)
        t.early_stop = False  # the stack's switch, not a term
        technique.compute(c, t)
        technique.exposed(c, t)
        assert t == StepTerms(), type(technique).__name__


def test_the_chunked_loss_adds_one_head_matmul_to_the_recompute():
    plan = TrainingPlan(loss="chunked", micro_batch_size=2, seq_len=1024)
    t = StepTerms()
    Loss().compute(_context(plan), t)
    assert t.recompute_s == kernels.gemm_time_s(A100, "bf16", 2048, LLAMA1B.vocab_size, LLAMA1B.hidden_size)


def test_optimizer_and_activation_offload_by_hand():
    """ZeRO-Offload on one GPU: the 16-bit params back over PCIe and CPU-Adam's 30 B per parameter
    at the host's bandwidth once per step; the gradients' copies hide under a long enough backward.
    Activation offload on the compute stream: every byte out and back is exposed."""
    plan = TrainingPlan(engine="deepspeed", precision="bf16", zero_stage=2, offload_optimizer="cpu",
                        offload_activations="cpu", micro_batch_size=2, seq_len=2048)
    c, t = _context(plan), StepTerms()
    t.recompute_s = 1e3   # a backward window no copy sticks out of
    OptimizerOffload().exposed(c, t)
    n = LLAMA1B.num_params
    assert t.offload_boundary_s == n * 2 / (A100.pcie_gbps * 1e9) + n * 30 / 100e9
    assert t.offload_micro_s == 0.0
    ActivationOffload().exposed(c, t)
    assert t.offload_micro_s == activation_offload_transfer_s(LLAMA1B, plan, A100.pcie_gbps)
    assert estimate_step_time(LLAMA1B, plan, Hardware(gpu=A100)).components_s["optimizer_step"] == 0.0


def test_a_chunked_loss_that_keeps_its_logits_recomputes_nothing_and_compiled_moves_six_bytes_a_logit():
    # torchtune's CEWithChunkedOutputLoss (the head run per chunk, autograd keeps each chunk's logits;
    # torchtune/modules/transformer.py, modules/loss/ce_chunked_output_loss.py @ 1814feb17): memkit's
    # chunked loss re-runs the head GEMM (8192 x 128256 x 3072 for llama-3.2-3b, 2 x 4096 tokens),
    # torchtune's does not; compiled (training/_compile.py compile_loss), the per-chunk cross-entropy
    # moves 6 B a logit instead of 32: (32 - 6) x 8192 x 128256 B less HBM traffic.
    model = load_model_spec("llama-3.2-3b")
    hw = Hardware(gpu=A100)
    plan = TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=2, seq_len=4096, loss="chunked",
                        gradient_clipping=0.0)
    ours = estimate_step_time(model, plan, hw).components_s
    theirs = estimate_step_time(model, plan, hw, chunked_loss_saves_logits=True).components_s
    head_gemm = kernels.gemm_time_s(A100, "bf16-pure", 8192, 128256, 3072)
    assert ours["recompute"] - theirs["recompute"] == pytest.approx(head_gemm, rel=1e-9)
    assert theirs["recompute"] == 0.0 and ours["compute"] == pytest.approx(theirs["compute"], rel=1e-12)
    eager_c = estimate_step_time(model, plan, hw, compiled=True).components_s
    comp = estimate_step_time(model, plan, hw, compiled=True, chunked_loss_saves_logits=True).components_s
    assert eager_c["compute"] - comp["compute"] == pytest.approx(
        (32 - 6) * 8192 * 128256 / (2039e9 * 0.85), rel=1e-9)
    # the standard loss is untouched by the switch
    std = plan.with_(loss="standard")
    assert (estimate_step_time(model, std, hw, compiled=True).step_time_s
            == estimate_step_time(model, std, hw, compiled=True, chunked_loss_saves_logits=True).step_time_s)


def test_torchtune_eager_fp32_rope_moves_56_bytes_forward_and_116_backward_per_rotated_element():
    # torchtune's RotaryPositionalEmbeddings.forward (torchtune/modules/position_embeddings.py @ 1814feb17),
    # bf16 q / k (e = 2), op by op: x.float() 2+4; four half-size products of a strided fp32 read,
    # 4 x (4+2); sub and add 2 x (4+2); stack 4+4; type_as 4+2 -> 56. Backward: cast 2+4; neg 4+2;
    # mul backwards 3 x (4+2) + (2+2); four select_backward (zeros 4, copy 2+4); three fp32
    # accumulations 3 x (8+4); float()'s backward 4+2 -> 116.
    from memkit.estimate.throughput import eager_fp32_rope_bytes
    assert eager_fp32_rope_bytes(2) == (56, 116)
    # llama-3.2-3b: 24 query + 8 kv heads of 128 = 4096 rotated elements per token and layer, 28 layers,
    # 2 x 4096 tokens; the default prices rotary as one fused kernel (r 2 + w 2 forward, twice that
    # backward = 12 B), so eager fp32 adds (56 + 116 - 12) B per element at 0.85 x 2039 GB/s.
    model = load_model_spec("llama-3.2-3b")
    hw = Hardware(gpu=A100)
    plan = TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=2, seq_len=4096,
                        gradient_clipping=0.0)
    fused = estimate_step_time(model, plan, hw).components_s
    eager = estimate_step_time(model, plan, hw, eager_fp32_rope=True).components_s
    rotated = (24 + 8) * 128 * 28 * 8192
    assert eager["compute"] - fused["compute"] == pytest.approx((56 + 116 - 12) * rotated / (2039e9 * 0.85),
                                                                rel=1e-9)
    # full checkpointing re-runs the forward: 56 - 4 more per element in the recompute
    ac = plan.with_(checkpointing="full")
    assert (estimate_step_time(model, ac, hw, eager_fp32_rope=True).components_s["recompute"]
            - estimate_step_time(model, ac, hw).components_s["recompute"]) == pytest.approx(
        (56 - 4) * rotated / (2039e9 * 0.85), rel=1e-9)
    # under torch.compile Inductor fuses the rotation: the switch changes nothing
    assert (estimate_step_time(model, plan, hw, compiled=True, eager_fp32_rope=True).step_time_s
            == estimate_step_time(model, plan, hw, compiled=True).step_time_s)


def test_bitsandbytes_8bit_step_bytes_and_the_paged_variants_host_calls_by_hand():
    # kOptimizerStatic8bit2StateBlockwise (bitsandbytes csrc/kernels.cu, 0.44.0+) loads g, state1, state2,
    # p and stores p, state1, state2: g and p at the parameter's item size, the states one byte each.
    from memkit.estimate.step_terms import paged_host_ops
    from memkit.estimate.throughput import bnb_8bit_step_bytes
    assert bnb_8bit_step_bytes(2) == 2 + 1 + 1 + 2 + 2 + 1 + 1 == 10
    assert bnb_8bit_step_bytes(4) == 16
    model = load_model_spec("llama-3.2-3b")
    hw = Hardware(gpu=A100)
    plan = TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=2, seq_len=4096,
                        optimizer="adamw-8bit", gradient_clipping=0.0)
    # 3.21e9 bf16 params at 10 B over 0.85 x 2039 GB/s, plus the per-tensor host ops synced after each
    plain = estimate_step_time(model, plan, hw).components_s["optimizer_step"]
    n = model.num_params
    tensors = 28 * (7 + 2) + 3                      # throughput._param_tensors: 7 linears, 2 norms a block
    assert plain == pytest.approx(n * 10 / (2039e9 * 0.85) + tensors * 3 * 10e-6, rel=1e-9)
    # Paged: every linear weight (3072 x 1024 and up) and the tied embedding have >= 1e5 elements,
    # so 28 x 7 + 1 = 197 tensors page their states (Optimizer8bit.get_state_buffer) and prefetch two
    # of them each step (prefetch_state); step() syncs once more at its end when paged.
    paged = plan.with_(optimizer="paged-adamw-8bit")
    assert paged_host_ops(model, paged, step_calls=1) == 2 * 197 + 1
    assert paged_host_ops(model, plan, step_calls=1) == 0
    assert (estimate_step_time(model, paged, hw).components_s["optimizer_step"] - plain
            == pytest.approx((2 * 197 + 1) * 10e-6, rel=1e-9))
    # In backward: one paged optimizer per tensor (torchtune create_optim_in_bwd), so one end sync each.
    ib, ib_paged = plan.with_(optimizer_in_backward=True), paged.with_(optimizer_in_backward=True)
    assert (estimate_step_time(model, ib_paged, hw).components_s["optimizer_step"]
            - estimate_step_time(model, ib, hw).components_s["optimizer_step"]
            == pytest.approx((2 * 197 + tensors) * 10e-6, rel=1e-9))
    # LoRA r8 adapters of a 4096-wide model (8 x 4096 = 32768 elements) stay unpaged
    lora = TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=2, seq_len=2048,
                        optimizer="paged-adamw-8bit", lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert paged_host_ops(load_model_spec("llama-3.1-8b"), lora, step_calls=1) == 1


@pytest.mark.parametrize("peft, fp32", [("0.6.2", True), ("0.10.0", False), ("0.13.2", True), (None, True)])
def test_the_stated_peft_sets_the_adapters_dtype_for_step_time_as_for_memory(peft, fp32):
    """One fact (spec/stack.py PEFT_ADAPTERS_IN_BASE_DTYPE) for both models: peft 0.7-0.11 casts
    adapters to the base's dtype, so a bf16-pure LoRA step runs them in bf16; an unstated peft keeps
    the step time's default, peft's current fp32 upcast (throughput.peft_fp32_adapters)."""
    from memkit.spec.stack import Stack

    plan = TrainingPlan(engine="torch", precision="bf16-pure", lora_rank=16, micro_batch_size=2, seq_len=1024)
    how = behaviour(Stack(peft=peft) if peft else None)
    c = StepContext(model=LLAMA1B, plan=plan, hardware=Hardware(gpu=A100), gpu=A100, how=how,
                    tokens=plan.micro_batch_size * plan.seq_len)
    t = StepTerms()
    Lora().setup(c, t)
    assert t.fp32_adapters is fp32
    assert how.fp32_lora_adapters is (fp32 and peft is not None)  # the memory states' reading
