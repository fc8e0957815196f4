"""The planner's side of activation offload and the optimizer in backward
(rules: memkit/plan/backward_techniques.py; prices: memkit/estimate/backward_techniques.py).

- Activation offload is searched wherever the request allows offloading (not with --no-offload)
  and the model is not split: every structure also comes with `offload_activations='cpu'`, and
  the step-time model ranks it (its PCIe transfer is not overlapped, so it wins only where
  nothing faster fits: the plan it replaces would need a smaller micro-batch, more
  recompute, or parameter offload, which moves the weights over the same link twice per
  micro-step).
- The optimizer in backward is searched only when the request asks for it (`suggest
  --optimizer-in-backward`): it changes what training does (no global-norm gradient clipping),
  which the planner does not decide for the user. Then every structure runs on plain PyTorch in
  one process with the whole per-GPU batch in one micro-batch (no accumulation), clipping off.
"""
from __future__ import annotations

from memkit.plan.backward_techniques import ACTIVATION_OFFLOADS, OPTIMIZER_IN_BACKWARD_FLAG
from memkit.plan.plan import TrainingPlan


def request_error(request) -> str | None:
    """What a Request's two knobs cannot be (space.Request.validate calls it), or None."""
    value = request.offload_activations
    if value is not None and value not in ACTIVATION_OFFLOADS:
        return f"--offload-activations {value!r} is not one of {', '.join(ACTIVATION_OFFLOADS)}"
    if value not in (None, "none") and not request.allow_offload:
        return f"--offload-activations {value} contradicts --no-offload; drop one of them"
    if request.optimizer_in_backward and request.hardware.num_gpus > 1:
        return (f"{OPTIMIZER_IN_BACKWARD_FLAG} with {request.hardware.num_gpus} GPUs: DDP reduces gradients "
                "after the per-parameter hook has stepped; use --num-gpus 1")
    return None


def variants(request, plan: TrainingPlan) -> list[TrainingPlan]:
    """`plan` with each activation offload the request allows, on the optimizer-in-backward
    engine when the request asks for it."""
    if request.offload_activations is not None:
        offloads = [request.offload_activations]
    else:
        offloads = ["none", "cpu"] if request.allow_offload and plan.tp * plan.pp == 1 else ["none"]
    out = [plan.with_(offload_activations=value) for value in offloads]
    if request.optimizer_in_backward:
        out = [p.with_(engine="torch", optimizer_in_backward=True, gradient_clipping=0.0,
                       micro_batch_size=p.micro_batch_size * p.grad_accum, grad_accum=1) for p in out]
    return out


def micro_options(plan: TrainingPlan, micros: tuple[int, ...]) -> tuple[int, ...]:
    """The micro-batches a structure may take: the whole per-rank batch with the optimizer in backward."""
    if not plan.optimizer_in_backward:
        return micros
    per_rank = plan.micro_batch_size * plan.grad_accum
    return tuple(m for m in micros if m == per_rank)


def notes(ev, plan: TrainingPlan, gib) -> list[str]:
    """Why the chosen plan offloads activations / steps in backward, in the evaluator's words."""
    out = []
    request = ev.request
    if plan.offload_activations != "none" and request.offload_activations is None:
        kept = plan.with_(offload_activations="none")
        why = ev.check(kept).reason or f"{gib(kept):.1f} GiB, fits"
        from memkit.estimate.backward_techniques import activation_offload_transfer_s, offloaded_activation_bytes

        moved = offloaded_activation_bytes(request.model, plan) / 2**30
        pcie = activation_offload_transfer_s(request.model, plan, request.hardware.gpu.pcie_gbps) * plan.grad_accum
        out.append(f"activation offload: with its activations on the GPU this plan would be {why}, instead of "
                   f"{gib(plan):.1f} GiB; it moves {moved:.1f} GiB per micro-batch to host RAM and back "
                   f"({pcie:.2f} s/step of PCIe, not overlapped)")
    if plan.optimizer_in_backward:
        out.append(f"optimizer in backward ({OPTIMIZER_IN_BACKWARD_FLAG}): each parameter steps in its gradient "
                   "hook, so one gradient is alive at a time; plain PyTorch, one micro-batch per step, no "
                   "gradient clipping")
    return out
