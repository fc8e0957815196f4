"""Optimizer-state placement, hand-worked on Llama-3.1-8B's config (32 blocks, hidden 4096, 8 KV heads of
128 -> v_proj 4096 -> 1024, two RMSNorm weights of 4096 per block):

- bitsandbytes paged optimizers (estimate/states.py BNB_PAGED_MIN_NUMEL): a parameter of >= 1e5 elements
  gets its states from functional.get_paged (cudaMallocManaged, outside torch's allocator), a smaller one
  torch.zeros_like (inside it).
- peft's adapter dtype by version (spec/stack.py PEFT_ADAPTERS_IN_BASE_DTYPE): fp32 adapters over a bf16
  base carry 4-byte weights, gradients, AdamW states and foreach temporary.
"""
from __future__ import annotations

import pytest

from memkit.estimate.memory import estimate_memory, rank_params
from memkit.estimate.states import model_states, optimizer_state_bytes_per_param
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.spec.stack import Stack, behaviour

LAYERS, H, KV = 32, 4096, 1024


@pytest.fixture(scope="module")
def llama8b():
    return load_model_spec("llama-3.1-8b")


def test_full_finetune_pages_every_state_but_the_norms(llama8b):
    plan = TrainingPlan(precision="bf16-pure", optimizer="paged-adamw-8bit")
    rp = rank_params(llama8b, plan)
    assert rp.paged_trainable == rp.num_trainable - LAYERS * 2 * H  # the blocks' two norms stay small
    st = model_states(plan, rp)
    total = int(rp.num_trainable * optimizer_state_bytes_per_param("paged-adamw-8bit", "bf16-pure"))
    assert st.managed_optimizer_states == int(total * rp.paged_trainable / rp.num_trainable)
    assert st.optimizer_states + st.managed_optimizer_states == total
    # the unpaged 8-bit optimizer keeps them all in the allocator
    plain = model_states(TrainingPlan(precision="bf16-pure", optimizer="adamw-8bit"), rp)
    assert plain.managed_optimizer_states == 0 and plain.optimizer_states == total


@pytest.mark.parametrize("rank, paged_per_layer", [
    (8, 0),                    # A 8x4096, B 4096x8, v's A 8x4096, B 1024x8: all < 1e5
    (64, 3 * 64 * H),          # q: A, B = 262144 each; v: A 262144, B 1024x64 = 65536 stays small
])
def test_lora_adapters_paged_per_tensor(llama8b, rank, paged_per_layer):
    plan = TrainingPlan(precision="bf16-pure", optimizer="paged-adamw-8bit", lora_rank=rank,
                        lora_targets=("q_proj", "v_proj"))
    rp = rank_params(llama8b, plan)
    assert rp.num_trainable == LAYERS * rank * ((H + H) + (H + KV))
    assert rp.paged_trainable == LAYERS * paged_per_layer
    st = model_states(plan, rp)
    total = int(rp.num_trainable * optimizer_state_bytes_per_param("paged-adamw-8bit", "bf16-pure"))
    assert st.managed_optimizer_states == int(total * paged_per_layer * LAYERS / rp.num_trainable)


def test_deepspeed_flat_partition_is_paged_and_cpu_pages_nothing(llama8b):
    z2 = TrainingPlan(precision="bf16", optimizer="paged-adamw-8bit", engine="deepspeed", zero_stage=2, dp=2)
    st = model_states(z2, rank_params(llama8b, z2))
    assert st.optimizer_states == 0 and st.managed_optimizer_states > 0
    # bitsandbytes' get_state_buffer returns zeros_like on CPU parameters: nothing managed
    plan = TrainingPlan(precision="bf16-pure", optimizer="paged-adamw-8bit")
    cpu = model_states(plan, rank_params(llama8b, plan), device="cpu")
    assert cpu.managed_optimizer_states == 0


def test_managed_states_outside_reserved_but_resident_for_nvidia_smi(llama8b):
    paged = TrainingPlan(precision="bf16-pure", engine="torch", optimizer="paged-adamw-8bit", optimizer_in_backward=True, gradient_clipping=0.0,
                         checkpointing="full", micro_batch_size=1, seq_len=512)
    plain = TrainingPlan(precision="bf16-pure", engine="torch", optimizer="adamw-8bit", optimizer_in_backward=True, gradient_clipping=0.0,
                         checkpointing="full", micro_batch_size=1, seq_len=512)
    managed = model_states(paged, rank_params(llama8b, paged)).managed_optimizer_states
    big = Hardware(gpu=find_gpu("h100-80gb"))
    ep, e8 = estimate_memory(llama8b, paged, big), estimate_memory(llama8b, plain, big)
    assert ep.reserved_peak_bytes < e8.reserved_peak_bytes - managed // 2
    # on a device with room, every managed byte is resident: nvidia-smi = reserved + context + managed
    assert (ep.nvidia_smi_peak_bytes - ep.reserved_peak_bytes
            == e8.nvidia_smi_peak_bytes - e8.reserved_peak_bytes + managed)
    # on a 24 GB card the driver pages the excess to the host: nvidia-smi stops at the device
    small = Hardware(gpu=find_gpu("rtx-4090"))
    es = estimate_memory(llama8b, paged, small)
    assert es.reserved_peak_bytes < small.gpu.memory_bytes
    assert es.nvidia_smi_peak_bytes == small.gpu.memory_bytes
    assert es.host_bytes_per_node >= managed


@pytest.mark.parametrize("peft, fp32", [("0.5.0", True), ("0.6.2", True), ("0.7.1", False), ("0.11.1", False),
                                        ("0.12.0", True), ("0.19.2.dev0", True), (None, False)])
def test_peft_adapter_dtype_by_version(peft, fp32):
    assert behaviour(Stack(peft=peft)).fp32_lora_adapters is fp32


def test_fp32_adapters_carry_four_byte_states(llama8b):
    plan = TrainingPlan(precision="bf16-pure", engine="torch", lora_rank=8, lora_targets=("q_proj", "v_proj"))
    rp = rank_params(llama8b, plan)
    psi_t = LAYERS * 8 * ((H + H) + (H + KV))
    assert rp.num_trainable == psi_t == 3_407_872
    base, fp32 = model_states(plan, rp), model_states(plan, rp, fp32_adapters=True)
    assert fp32.weights - base.weights == 2 * psi_t           # 4 bytes where the base dtype gave 2
    assert (base.gradients, fp32.gradients) == (2 * psi_t, 4 * psi_t)
    assert (base.optimizer_states, fp32.optimizer_states) == (4 * psi_t, 8 * psi_t)  # AdamW m, v
    assert (base.step_transient, fp32.step_transient) == (2 * psi_t, 4 * psi_t)      # foreach sqrt temporary
    # the estimate reads it from the stated peft
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    old = estimate_memory(llama8b, plan, hw, stack=Stack(peft="0.6.2"))
    mid = estimate_memory(llama8b, plan, hw, stack=Stack(peft="0.7.1"))
    assert old.allocated_peak_bytes > mid.allocated_peak_bytes
