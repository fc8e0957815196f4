"""Rules of the two backward-time techniques (torch-free, like memkit/plan/techniques.py), shared by
the estimator, the planner, the emitters and the runner.

- Activation offload (`--offload-activations cpu`): every tensor the forward saves for backward
  is copied to (pinned) host RAM as it is saved and copied back when its backward node runs, as
  `torch.autograd.graph.save_on_cpu(pin_memory=True)` does (torch/autograd/graph.py), with two
  differences taken from torchtune's OffloadActivations (torchtune/training/_activation_offloading.py):
  parameters (and views of them, e.g. nn.Linear's weight.t()) stay where they are, and a storage
  saved by several nodes (the normed hidden state feeds q, k and v) is copied once. The hook
  wraps the whole forward (and the loss); with checkpointing the checkpointed blocks' inputs are
  what it moves, because torch's non-reentrant checkpoint saves them through the same hooks
  (torch/utils/checkpoint.py, _NoopSaveInputs.apply). The copies run on the compute stream
  (save_on_cpu's packed.copy_), so they do not overlap compute.
- Optimizer in backward (`--optimizer-in-backward`): one optimizer per trainable parameter,
  stepped (and its gradient freed) in that parameter's post-accumulate-grad hook
  (torch Tensor.register_post_accumulate_grad_hook; torchtune's optimizer_in_bwd,
  torchtune/training/memory.py register_optim_in_bwd_hooks), so at most one parameter's gradient
  exists at a time. It needs the whole step's gradient in one backward (no accumulation), no
  global-norm clipping (the norm needs every gradient before any step), and an engine that lets
  the hook step: plain PyTorch in one process (DDP's hooks reduce buckets after the per-parameter
  hook fired; DeepSpeed owns its optimizer step), and no fp16 loss scaler (torch.amp.GradScaler
  unscales and checks every gradient before the step).
"""
from __future__ import annotations

ACTIVATION_OFFLOADS = ("none", "cpu")
OPTIMIZER_IN_BACKWARD_FLAG = "--optimizer-in-backward"


def activation_offload_error(value: str, *, pp: int, tp: int) -> str | None:
    """What --offload-activations cannot run with, or None."""
    if value not in ACTIVATION_OFFLOADS:
        return f"--offload-activations {value!r} is not one of {', '.join(ACTIVATION_OFFLOADS)}"
    if value != "none" and (pp > 1 or tp > 1):
        return (f"--offload-activations {value} with tp={tp} pp={pp}: split runs save their activations "
                "in their own stage/shard code; use --offload-activations none with --tp/--pp")
    return None


def optimizer_in_backward_error(plan) -> str | None:
    """What --optimizer-in-backward cannot run with (plan: a TrainingPlan), or None."""
    if not plan.optimizer_in_backward:
        return None
    flag = OPTIMIZER_IN_BACKWARD_FLAG
    if plan.engine != "torch" or plan.zero_stage != 0:
        return (f"{flag} with engine {plan.engine} ZeRO-{plan.zero_stage}: DeepSpeed/FSDP own the optimizer "
                "step; use engine torch with --zero 0")
    if plan.num_gpus > 1:
        return (f"{flag} with {plan.num_gpus} GPUs: DDP reduces gradients after the per-parameter hook "
                "has stepped; use one GPU")
    if plan.offload_optimizer != "none":
        return f"{flag} with --offload-optimizer {plan.offload_optimizer}: use --offload-optimizer none"
    if plan.grad_accum > 1:
        return (f"{flag} with --grad-accum {plan.grad_accum}: each parameter steps as soon as its "
                "gradient lands, so gradients cannot accumulate; use --grad-accum 1 (or a larger micro-batch)")
    if plan.gradient_clipping > 0:
        return (f"{flag} with --gradient-clipping {plan.gradient_clipping}: the global norm needs every "
                "gradient before any step; use --gradient-clipping 0")
    if plan.precision == "fp16":
        return (f"{flag} with --precision fp16: the loss scaler unscales (and may skip) the step over every "
                "gradient after backward; use --precision bf16 or fp32")
    return None
