"""Device memory a CUDA training process holds besides its tensors, each term from its source.

Inside the caching allocator (so in max_memory_allocated / reserved):
- the cuBLAS workspace, one per (handle, stream) that runs a matmul -- forward and backward run on
  the default stream, so one: aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize()
  (default ":4096:8" on sm90 = 32 MiB, else 4096 KiB x 2 + 16 KiB x 8), allocated by
  getNewWorkspace() through c10::cuda::CUDACachingAllocator; cuBLASLt shares it
  (TORCH_CUBLASLT_UNIFIED_WORKSPACE, default on).

Outside it (seen by nvidia-smi only):
- the CUDA context: the catalog's cuda_context_mib (driver, runtime and the kernels loaded
  lazily -- torch sets CUDA_MODULE_LOADING=LAZY in aten/src/ATen/cuda/detail/CUDAHooks.cpp since 1.13;
  an older stack loads every kernel module at init, see spec/stack.py);
- NCCL communicator buffers: per channel and ring peer, one buffer per protocol --
  SIMPLE NCCL_BUFFSIZE = 4 MiB, LL 512 KiB, LL128 4,915,200 B (NVIDIA/nccl src/init.cc,
  DEFAULT_BUFFSIZE / DEFAULT_LL_BUFFSIZE / DEFAULT_LL128_BUFFSIZE), allocated with cudaMalloc by
  the P2P/SHM transports (src/transport/p2p.cc). The channel count is topology dependent
  (NCCL_MIN_NCHANNELS / NCCL_MAX_NCHANNELS); memkit takes 16 over NVLink-class links and 2 over
  PCIe, the counts NCCL's ring search settles on for 8-GPU NVSwitch and PCIe boxes
  (NCCL_DEBUG=INFO "N coll channels"), an approximation stated as such.
"""
from __future__ import annotations

from memkit.plan import TrainingPlan
from memkit.spec.hardware import GPU, Hardware
from memkit.units import MIB

CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
NCCL_BUFFERS_PER_PEER = 4 * MIB + 512 * 1024 + 4_915_200
NCCL_RING_PEERS = 2
_SM90 = ("h100", "h200", "h800", "h20", "gh200")
# Channels NCCL opens per communicator: NVLink/NVSwitch nodes vs PCIe (see module docstring).
_NVLINK_CHANNELS, _PCIE_CHANNELS = 16, 2
_NVLINK_GBPS = 100


def is_sm90(gpu: GPU) -> bool:
    return gpu.name.lower().startswith(_SM90)


def cublas_workspace_bytes(gpu: GPU) -> int:
    return CUBLAS_WORKSPACE_SM90 if is_sm90(gpu) else CUBLAS_WORKSPACE_DEFAULT


def nccl_bytes(plan: TrainingPlan, hardware: Hardware) -> int:
    """One communicator per parallel dimension wider than 1 (data, tensor, pipeline)."""
    comms = sum(d > 1 for d in (plan.dp, plan.tp, plan.pp))
    if not comms:
        return 0
    channels = _NVLINK_CHANNELS if hardware.gpu.intra_node_gbps >= _NVLINK_GBPS else _PCIE_CHANNELS
    return comms * channels * NCCL_RING_PEERS * NCCL_BUFFERS_PER_PEER


def outside_allocator_bytes(plan: TrainingPlan, hardware: Hardware, *, context_bytes: int | None = None) -> int:
    """Device bytes nvidia-smi counts that torch's allocator does not: context + NCCL."""
    context = hardware.gpu.cuda_context_bytes if context_bytes is None else context_bytes
    return context + nccl_bytes(plan, hardware)
