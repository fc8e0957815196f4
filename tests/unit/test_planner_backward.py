"""The planner with activation offload and the optimizer in backward (memkit/planner/backward.py).

- llama-3.1-8b, 8 x A100-80GB, 8 x 131072 tokens: with activation offload the planner keeps the
  parameters on the GPU (a ZeRO-2 plan that offloads the saved activations, inside its upper
  bound); without it, only plans that offload the parameters fit.
- llama-3.2-1b, 1 x RTX 4090, 1 x 8192 tokens, bf16 AdamW, nothing offloaded: no plan fits unless
  the optimizer steps in backward (one gradient alive at a time).
(The premises moved with the estimates: before the sharded-tensor replay and its tighter upper
bounds, 131k tokens found no plan inside its bound without activation offload, and llama-3.2-3b
at 32k only fitted fp32 without the optimizer in backward.)
"""
from __future__ import annotations

from dataclasses import replace

import pytest

from memkit.errors import MemkitError
from memkit.planner import NoPlanFits, Request, search
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec


def _request(model, gpu, num_gpus, batch, seq, **pins):
    hw = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=num_gpus)
    return Request(model=load_model_spec(model), hardware=hw, global_batch_size=batch, seq_len=seq, **pins).validate()


def test_long_context_fits_its_upper_bound_only_with_activation_offload():
    request = _request("llama-3.1-8b", "a100-80gb", 8, 8, 131072)
    result = search(request)
    chosen = result.chosen
    assert chosen.plan.offload_activations == "cpu"
    assert chosen.plan.offload_params == "none"
    assert chosen.memory.nvidia_smi_peak_upper_bytes <= request.hardware.gpu.memory_bytes
    assert chosen.memory.host_bytes_per_node <= request.hardware.host_ram_bytes_per_node
    assert chosen.speed.components_s["offload_transfer"] > 0
    assert any(n.startswith("activation offload: with its activations on the GPU this plan would be")
               for n in result.notes)
    without = search(replace(request, offload_activations="none"))
    assert without.chosen.plan.offload_params == "cpu"
    assert without.chosen.plan.offload_activations == "none"


def test_optimizer_in_backward_fits_bf16_adamw_without_offload():
    request = _request("llama-3.2-1b", "rtx-4090", 1, 1, 8192, allow_offload=False, precision="bf16",
                       optimizer="adamw")
    with pytest.raises(NoPlanFits):
        search(request)
    inbwd = search(replace(request, optimizer_in_backward=True))
    plan = inbwd.chosen.plan
    assert (plan.optimizer_in_backward, plan.engine, plan.precision, plan.optimizer) == (True, "torch", "bf16", "adamw")
    assert (plan.grad_accum, plan.gradient_clipping, plan.offload_optimizer) == (1, 0.0, "none")
    assert inbwd.chosen.memory.nvidia_smi_peak_upper_bytes <= request.hardware.gpu.memory_bytes
    assert any(n.startswith("optimizer in backward (--optimizer-in-backward)") for n in inbwd.notes)


def test_request_refusals():
    with pytest.raises(MemkitError, match="use --num-gpus 1"):
        _request("llama-3.2-1b", "a100-80gb", 2, 2, 2048, optimizer_in_backward=True)
    with pytest.raises(MemkitError, match="contradicts --no-offload"):
        _request("llama-3.2-1b", "a100-80gb", 1, 1, 2048, offload_activations="cpu", allow_offload=False)
