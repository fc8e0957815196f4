"""NCCL's device buffers outside torch's allocator (memkit/estimate/cuda_extras.py), against
figures worked by hand from NVIDIA/nccl's source: the NVLS multicast buffers of NCCL 2.18-2.21
(src/transport/nvls.cc, ncclNvlsSetup) and DeepSpeed's extra data-parallel communicator."""
from __future__ import annotations

from dataclasses import replace

import pytest

from memkit.estimate.cuda_extras import nccl_bytes, nvls_bytes
from memkit.estimate.memory import estimate_memory
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.spec.stack import Stack, behaviour
from memkit.units import MIB

# nvlsTotalSize = nChannels 16 x 2 x (buffSize 4 MiB + memSize 2 MiB) x nHeads 8 (the vLLM log of
# NCCL's "NVLS comm ... nvlsPerRankSize" line has the same form, vllm-project/vllm#9699).
NVLS_8GPU = 16 * 2 * 6 * MIB * 8
RING = 16 * 2 * (4 * MIB + 512 * 1024 + 4_915_200)  # one communicator's ring buffers over NVLink


def _plan(**kw) -> TrainingPlan:
    base = dict(precision="bf16", engine="deepspeed", zero_stage=3, micro_batch_size=1, seq_len=128, dp=8)
    return TrainingPlan(**{**base, **kw})


H100x8 = Hardware(gpu=find_gpu("h100-80gb"), num_gpus_per_node=8)


def test_nvls_buffers_per_communicator():
    assert NVLS_8GPU == 1536 * MIB
    assert nvls_bytes(_plan(), H100x8) == 2 * NVLS_8GPU           # world group + DeepSpeed's clone
    assert nvls_bytes(_plan(engine="torch"), H100x8) == NVLS_8GPU  # FSDP: the world group only
    # 4 GPUs: 4 heads; 2 GPUs: no NVLS (ncclNvlsInit returns for gpuCount <= 2)
    assert nvls_bytes(_plan(engine="torch", dp=4), replace(H100x8, num_gpus_per_node=4)) == NVLS_8GPU // 2
    assert nvls_bytes(_plan(engine="torch", dp=2), replace(H100x8, num_gpus_per_node=2)) == 0
    # no NVSwitch multicast: Ampere, or a PCIe Hopper card
    assert nvls_bytes(_plan(), Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=8)) == 0
    assert nvls_bytes(_plan(), Hardware(gpu=find_gpu("h100-pcie"), num_gpus_per_node=8)) == 0


def test_deepspeed_opens_a_second_data_parallel_communicator():
    assert nccl_bytes(_plan(), H100x8) == 2 * RING
    assert nccl_bytes(_plan(engine="torch"), H100x8) == RING
    assert nccl_bytes(_plan(dp=1), Hardware(gpu=find_gpu("h100-80gb"), num_gpus_per_node=1)) == 0


@pytest.mark.parametrize("torch_version, eager", [("2.0.1", False), ("2.1.0+cu121", True), ("2.2.0", True),
                                                   ("2.6.0", True), ("2.7.0", False), ("2.13.0", False)])
def test_which_torch_ships_an_eager_nvls_nccl(torch_version, eager):
    assert behaviour(Stack(torch=torch_version)).eager_nvls is eager


def test_estimate_adds_nvls_to_nvidia_smi_only():
    spec = load_model_spec("gpt2")
    old = estimate_memory(spec, _plan(), H100x8, stack=Stack(torch="2.2.0"))
    new = estimate_memory(spec, _plan(), H100x8, stack=Stack(torch="2.7.0"))
    assert old.allocated_peak_bytes == new.allocated_peak_bytes
    assert old.reserved_peak_bytes == new.reserved_peak_bytes
    assert old.nvidia_smi_peak_bytes - new.nvidia_smi_peak_bytes == 2 * NVLS_8GPU
