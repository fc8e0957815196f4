"""GPU catalog (presets/gpus.json) and the Hardware a plan runs on."""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from memkit.errors import MemkitError, did_you_mean
from memkit.presets_dir import presets_dir
from memkit.units import GIB, MIB


@dataclass(frozen=True, slots=True, kw_only=True)
class GPU:
    name: str
    memory_bytes: int
    bf16: bool
    fp32_tflops: float
    tf32_tflops: float
    fp16_tflops: float
    bf16_tflops: float
    hbm_gbps: float
    intra_node_gbps: float
    """Achievable all-reduce bus bandwidth inside a node, GB/s per GPU."""
    pcie_gbps: float
    cuda_context_bytes: int
    aliases: tuple[str, ...] = ()
    arch: str = "ampere"
    """GPU generation (volta, turing, ampere, ada, hopper, cdna3): selects the achievable matmul and
    attention-kernel fractions of peak in memkit/estimate/kernels.py."""
    num_sms: int = 0
    """Streaming multiprocessors (datasheet / architecture whitepaper): a GEMM's tiles run in waves
    of one per SM (memkit/estimate/kernels.py wave_quantization); 0 = unknown, not modelled."""

    def peak_tflops(self, precision: str) -> float:
        """Dense peak for the matmul dtype a precision runs in (fp32 uses TF32 as PyTorch allows it)."""
        if precision in ("bf16", "bf16-pure"):
            return self.bf16_tflops
        if precision == "fp16":
            return self.fp16_tflops
        return self.fp32_tflops


HOST_RAM_GIB_PER_GPU = 128
MIN_HOST_RAM_GIB = 64
"""The one host-RAM default (the CLI, the presets and a Hardware built without it use it): 128 GiB
per GPU, at least 64 GiB. 8-GPU servers ship 1-2 TiB (NVIDIA DGX A100 user guide: 1 TiB; DGX
H100: 2 TiB), i.e. 128-256 GiB per GPU; workstations have less. Pass --host-ram for your nodes."""


def default_host_ram_bytes(num_gpus_per_node: int) -> int:
    """Host RAM per node assumed when none is given (HOST_RAM_GIB_PER_GPU, MIN_HOST_RAM_GIB)."""
    return max(MIN_HOST_RAM_GIB, HOST_RAM_GIB_PER_GPU * max(num_gpus_per_node, 1)) * GIB


@dataclass(frozen=True, slots=True, kw_only=True)
class Hardware:
    gpu: GPU
    num_gpus_per_node: int = 1
    num_nodes: int = 1
    host_ram_bytes_per_node: int = 0
    """Host RAM per node available for offload; 0 (not given) = default_host_ram_bytes(num_gpus_per_node)."""
    nvme_bytes_per_node: int = 2 * 1024 * GIB
    inter_node_gbps: float = 25.0
    """Per-GPU network bandwidth across nodes, GB/s (200 Gb/s InfiniBand/EFA per GPU ~ 25 GB/s)."""

    def __post_init__(self):
        if not self.host_ram_bytes_per_node:
            object.__setattr__(self, "host_ram_bytes_per_node", default_host_ram_bytes(self.num_gpus_per_node))

    @property
    def num_gpus(self) -> int:
        return self.num_gpus_per_node * self.num_nodes

    def validate(self) -> "Hardware":
        if self.num_gpus_per_node < 1:
            raise MemkitError(f"--num-gpus {self.num_gpus_per_node} must be >= 1 (GPUs per node)")
        if self.num_nodes < 1:
            raise MemkitError(f"--num-nodes {self.num_nodes} must be >= 1")
        return self


@lru_cache(maxsize=1)
def gpu_catalog() -> dict[str, GPU]:
    """Every catalog GPU by name (aliases resolved by `find_gpu`)."""
    from memkit.fileio import read_json_object

    data = read_json_object(presets_dir() / "gpus.json", what="GPU catalog")
    out = {}
    for row in data["gpus"]:
        row = dict(row)
        out[row["name"]] = GPU(
            name=row["name"], memory_bytes=row["memory_mib"] * MIB, bf16=row["bf16"],
            fp32_tflops=row["fp32_tflops"], tf32_tflops=row["tf32_tflops"],
            fp16_tflops=row["fp16_tflops"], bf16_tflops=row["bf16_tflops"],
            hbm_gbps=row["hbm_gbps"], intra_node_gbps=row["intra_node_gbps"],
            pcie_gbps=row["pcie_gbps"], cuda_context_bytes=row["cuda_context_mib"] * MIB,
            aliases=tuple(row.get("aliases", ())), arch=row.get("arch", "ampere"),
            num_sms=int(row.get("num_sms", 0)))
    return out


def find_gpu(name: str) -> GPU:
    """A catalog GPU by name or alias, case- and separator-insensitive."""
    key = _norm(name)
    for gpu in gpu_catalog().values():
        if key == _norm(gpu.name) or key in {_norm(a) for a in gpu.aliases}:
            return gpu
    names = list(gpu_catalog())
    raise MemkitError(f"unknown GPU {name!r}{did_you_mean(name, names)}; "
                      f"known: {', '.join(names)}; or pass --gpu-memory 24GiB")


def custom_gpu(memory_bytes: int, *, like: GPU | None = None) -> GPU:
    """A GPU known only by its memory (--gpu-memory): A100-class speeds unless `like` is given."""
    base = like or gpu_catalog()["a100-80gb"]
    return replace(base, name=f"custom-{memory_bytes / GIB:g}gib", memory_bytes=memory_bytes, aliases=())


def _norm(text: str) -> str:
    return "".join(ch for ch in text.lower() if ch.isalnum())
