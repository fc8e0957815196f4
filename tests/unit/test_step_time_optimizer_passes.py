"""Hand-worked checks of the optimizer-step and clipping terms (memkit/estimate/step_terms.py
OptimizerStep, GradClipping, BNB_SYNC_PER_TENSOR, side_stream_hbm_s), each against the library it
prices: the element passes are counted on the real torch ops (a TorchDispatchMode sees every aten
op torch.optim.AdamW and clip_grad_norm_ issue), bitsandbytes' per-tensor sync is read from its
installed Optimizer8bit.step."""
from __future__ import annotations

import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from memkit.estimate import kernels
from memkit.estimate import throughput as tp_model
from memkit.estimate.backward_techniques import activation_offload_transfer_s, offloaded_activation_bytes
from memkit.estimate.step_terms import (BNB_SYNC_PER_TENSOR, ActivationOffload, OptimizerStep, StepContext, StepTerms,
                                        side_stream_hbm_s)
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.spec.stack import behaviour

LLAMA1B = load_model_spec("llama-3.2-1b")
A100 = find_gpu("a100-80gb")
ONE = Hardware(gpu=A100)
N = 4096   # elements of the parameter the passes are counted on


class _Passes(TorchDispatchMode):
    """Counts full passes over N-element tensors: each one an op reads, and each one it writes (the
    mutated first argument of an in-place op, or an N-element output)."""

    def __init__(self):
        super().__init__()
        self.passes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        big = lambda x: isinstance(x, torch.Tensor) and x.numel() == N  # noqa: E731
        # each distinct tensor read once (addcmul_(v, g, g) loads g's elements in one kernel)
        self.passes += len({id(x) for x in tree_flatten((args, kwargs or {}))[0] if big(x)})
        name = func._schema.name
        if name.endswith("_") or func._schema.is_mutable:
            first = args[0] if args else None
            self.passes += sum(big(x) for x in tree_flatten(first)[0])
        else:
            self.passes += sum(big(x) for x in tree_flatten(out)[0])
        return out


def _adamw_passes(**kw) -> int:
    p = torch.nn.Parameter(torch.randn(N))
    p.grad = torch.randn(N)
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01, **kw)
    opt.step()                       # the states exist from here on
    with _Passes() as mode:
        opt.step()
    return mode.passes


def test_torch_foreach_adamw_makes_twenty_element_passes_and_memkit_prices_them():
    assert _adamw_passes(foreach=True) == tp_model.ADAMW_FOREACH_PASSES == 20
    assert tp_model.adamw_step_bytes(2, fused=False, master_copy=False) == 40      # bf16-pure states
    assert tp_model.adamw_step_bytes(4, fused=True, master_copy=True) == 7 * 4 + 4  # DeepSpeed FusedAdam + 16-bit copy


def test_clip_grad_norm_reads_every_gradient_twice_and_writes_it_once():
    p = torch.nn.Parameter(torch.randn(N))
    p.grad = torch.randn(N)
    with _Passes() as mode:
        torch.nn.utils.clip_grad_norm_([p], 1.0, foreach=True)
    assert mode.passes == tp_model.CLIP_GRAD_PASSES == 3


def test_bf16_pure_full_fine_tuning_step_by_hand():
    """One GPU, bf16-pure, torch engine: foreach AdamW over bf16 states (20 x 2 B) plus the clip
    (3 x 2 B); fused=True drops the step to 7 x 2 B; no clipping drops the 6 B."""
    plan = TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=1, seq_len=512)
    n = LLAMA1B.num_params
    opt = lambda p, **kw: estimate_step_time(LLAMA1B, p, ONE, **kw).components_s["optimizer_step"]  # noqa: E731
    assert opt(plan) == pytest.approx(kernels.memory_time_s(A100, n * 40) + kernels.memory_time_s(A100, n * 6))
    assert opt(plan, fused_optimizer=True) == pytest.approx(kernels.memory_time_s(A100, n * 14)
                                                            + kernels.memory_time_s(A100, n * 6))
    assert opt(plan.with_(gradient_clipping=0.0)) == pytest.approx(kernels.memory_time_s(A100, n * 40))
    # torchtune-style optimizer in backward: no norm to clip by, so no clip pass
    oib = plan.with_(optimizer_in_backward=True)
    assert opt(oib) == pytest.approx(opt(plan.with_(gradient_clipping=0.0)))


def test_bitsandbytes_synchronizes_after_every_tensor_so_its_launches_add_to_its_kernels():
    from bitsandbytes.optim.optimizer import Optimizer8bit

    src = inspect.getsource(Optimizer8bit.step)
    loop = src[src.index("for pindex, p in enumerate"):]
    assert loop.index("self.update_step(") < loop.index("sync_gpu(p)") < loop.index("if self.is_paged")
    assert BNB_SYNC_PER_TENSOR
    plan = TrainingPlan(engine="torch", precision="bf16-pure", optimizer="adamw-8bit", gradient_clipping=0.0)
    c = StepContext(model=LLAMA1B, plan=plan, hardware=ONE, gpu=A100, how=behaviour(None), tokens=512)
    t = StepTerms()
    OptimizerStep().exposed(c, t)
    tensors = tp_model._param_tensors(LLAMA1B, plan)
    mem = kernels.memory_time_s(A100, LLAMA1B.num_params * tp_model.GPU_OPTIMIZER_BYTES_PER_PARAM["adamw-8bit"])
    assert t.optimizer_s == pytest.approx(mem + tensors * 3 * tp_model.OP_DISPATCH_S)   # a sum, not a max


def test_side_stream_offload_hides_pcie_but_not_the_hbm_reads_and_writes():
    """torchtune OffloadActivations(use_streams=True) behind passes long enough to hide PCIe: what
    stays is the copy engines' HBM traffic, each offloaded byte read out and written back."""
    plan = TrainingPlan(engine="torch", precision="bf16-pure", micro_batch_size=2, seq_len=4096,
                        checkpointing="full", offload_activations="cpu")
    c = StepContext(model=LLAMA1B, plan=plan, hardware=ONE, gpu=A100, how=behaviour(None), tokens=8192,
                    offload_streams=True)
    t = StepTerms(compute=tp_model._Pass(1e3, 1e3, 0))
    ActivationOffload().exposed(c, t)
    offloaded = offloaded_activation_bytes(LLAMA1B, plan)
    assert t.offload_micro_s == side_stream_hbm_s(A100, offloaded) == kernels.memory_time_s(A100, 2 * offloaded)
    # on the compute stream (memkit's runner) every PCIe second is exposed instead
    t = StepTerms(compute=tp_model._Pass(1e3, 1e3, 0))
    ActivationOffload().exposed(StepContext(model=LLAMA1B, plan=plan, hardware=ONE, gpu=A100, how=behaviour(None),
                                            tokens=8192), t)
    assert t.offload_micro_s == activation_offload_transfer_s(LLAMA1B, plan, A100.pcie_gbps)
    assert side_stream_hbm_s(A100, offloaded) < t.offload_micro_s
