"""The step-time techniques' interface (memkit/estimate/step_terms.py): a technique a plan does not
use leaves every term as it found it, and one it uses adds its own term, worked by hand."""
from __future__ import annotations

from memkit.estimate import kernels
from memkit.estimate.backward_techniques import activation_offload_transfer_s
from memkit.estimate.step_terms import (STEP_TECHNIQUES, ActivationOffload, Loss, OptimizerOffload, OptimizerStep,
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
