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
  DeepSpeed opens one communicator more than the parallel dimensions: its data-parallel group is
  a clone of the world group (deepspeed/utils/groups.py, _clone_world_group, used for ZeRO's
  reductions), while zero.Init's parameters gather over the world group itself
  (deepspeed/runtime/zero/partition_parameters.py: ds_process_group = dist.get_world_group()).
- NVLS (NVLink SHARP) multicast buffers, on Hopper nodes with an NVSwitch and more than 2 GPUs in
  the communicator (src/transport/nvls.cc ncclNvlsInit: gpuCount <= 2 returns; src/graph/
  search.cc: no NVS node or compute capability < 90, no NVLS graph). ncclNvlsSetup maps, per rank
  and communicator, nvlsTotalSize = nChannels x 2 x (buffSize + memSize) x nHeads bytes with
  cuMemCreate (outside torch's allocator): nChannels = NCCL_NVLS_NCHANNELS = 16, buffSize =
  NCCL_BUFFSIZE = 4 MiB, memSize = NVLS_MEM_ALIGN_SIZE = 2 MiB, nHeads = the node's GPUs in the
  communicator (search.cc: "NVLS search must have ngpus heads at most"): 1.5 GiB on 8 GPUs.
  NCCL 2.17-2.21 do it when the communicator is created (src/init.cc, initTransportsRank); from
  2.22 NCCL_RUNTIME_CONNECT=1 defers it to the first collective that picks NVLS (src/group.cc,
  ncclNvlsBufferSetup), which memkit does not predict, so it prices the eager versions only
  (spec/stack.py: which torch ships which NCCL). The node is taken to be an 8-GPU HGX board: a
  4-GPU HGX H100 board links its GPUs directly, with no NVSwitch and no NVLS.
"""
from __future__ import annotations

from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import GPU, Hardware
from memkit.units import MIB

CUBLAS_WORKSPACE_SM90 = 4096 * 8 * 1024
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
NCCL_BUFFSIZE = 4 * MIB
NCCL_BUFFERS_PER_PEER = NCCL_BUFFSIZE + 512 * 1024 + 4_915_200
NVLS_CHANNELS = 16
NVLS_MEM_ALIGN_SIZE = 2 * MIB
NCCL_RING_PEERS = 2
_SM90 = ("h100", "h200", "h800", "h20", "gh200")
# Channels NCCL opens per communicator: NVLink/NVSwitch nodes vs PCIe (see module docstring).
_NVLINK_CHANNELS, _PCIE_CHANNELS = 16, 2
_NVLINK_GBPS = 100


def is_sm90(gpu: GPU) -> bool:
    return gpu.name.lower().startswith(_SM90)


def cublas_workspace_bytes(gpu: GPU) -> int:
    return CUBLAS_WORKSPACE_SM90 if is_sm90(gpu) else CUBLAS_WORKSPACE_DEFAULT


def _communicator_widths(plan: TrainingPlan) -> list[int]:
    """Ranks of each NCCL communicator a rank opens: one per parallel dimension wider than 1
    (data, tensor, pipeline), and DeepSpeed's clone of the data-parallel world group."""
    widths = [d for d in (plan.dp, plan.tp, plan.pp) if d > 1]
    if plan.engine == "deepspeed" and plan.dp > 1:
        widths.append(plan.dp)
    return widths


def nccl_bytes(plan: TrainingPlan, hardware: Hardware) -> int:
    """Ring/tree buffers of every communicator (see the module docstring)."""
    comms = len(_communicator_widths(plan))
    if not comms:
        return 0
    channels = _NVLINK_CHANNELS if hardware.gpu.intra_node_gbps >= _NVLINK_GBPS else _PCIE_CHANNELS
    return comms * channels * NCCL_RING_PEERS * NCCL_BUFFERS_PER_PEER


def has_nvswitch_multicast(hardware: Hardware) -> bool:
    """Hopper with NVLink-class links: an HGX board with NVSwitch (module docstring)."""
    return hardware.gpu.arch == "hopper" and hardware.gpu.intra_node_gbps >= _NVLINK_GBPS


def nvls_bytes(plan: TrainingPlan, hardware: Hardware) -> int:
    """NVLS multicast buffers NCCL 2.17-2.21 map per communicator of more than 2 node-local GPUs."""
    if not has_nvswitch_multicast(hardware):
        return 0
    total = 0
    for width in _communicator_widths(plan):
        heads = min(width, hardware.num_gpus_per_node)  # the communicator's GPUs in this node
        if heads > 2:
            total += NVLS_CHANNELS * 2 * (NCCL_BUFFSIZE + NVLS_MEM_ALIGN_SIZE) * heads
    return total


def outside_allocator_bytes(plan: TrainingPlan, hardware: Hardware, *, context_bytes: int | None = None,
                            eager_nvls: bool = False) -> int:
    """Device bytes nvidia-smi counts that torch's allocator does not: context + NCCL (+ NVLS
    buffers when the stack's NCCL maps them at communicator creation)."""
    context = hardware.gpu.cuda_context_bytes if context_bytes is None else context_bytes
    return context + nccl_bytes(plan, hardware) + (nvls_bytes(plan, hardware) if eager_nvls else 0)
