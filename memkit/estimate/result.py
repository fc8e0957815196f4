"""What the memory estimator returns."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True, kw_only=True)
class MemoryEstimate:
    allocated_peak_bytes: int
    """What torch.cuda.max_memory_allocated() would report on the worst rank."""
    reserved_peak_bytes: int
    """What torch.cuda.max_memory_reserved() would report (the caching allocator's pool)."""
    nvidia_smi_peak_bytes: int
    """reserved plus the CUDA context: what nvidia-smi shows as used; compared with the device total."""
    device_total_bytes: int
    num_params: int
    num_trainable_params: int
    peak_phase: str
    """init | forward | backward | optimizer_step | checkpoint_save"""
    components: dict[str, int]
    """Bytes live at the peak, by component (weights, gradients, optimizer_states, activations, ...)."""
    phases: dict[str, int]
    """Allocated bytes at the peak of each phase."""
    host_bytes_per_node: int
    """Host RAM the run needs per node (offloaded states, pinned buffers, the processes themselves)."""
    nvme_bytes_per_node: int = 0
    notes: tuple[str, ...] = field(default=())
    allocated_peak_upper_bytes: int = 0
    """allocated_peak_bytes plus the margin (bounds.QUANTILE of memkit's under-prediction) for this kind of plan
    (estimate/bounds.py); reserved / nvidia-smi likewise."""
    reserved_peak_upper_bytes: int = 0
    nvidia_smi_peak_upper_bytes: int = 0
    upper_margin: float = 0.0
    """The relative margin the upper bounds add (bounds.QUANTILE of the residuals, see upper_basis)."""
    upper_basis: str = ""

    @property
    def headroom_bytes(self) -> int:
        return self.device_total_bytes - self.nvidia_smi_peak_bytes

    def to_dict(self) -> dict:
        return {
            "allocated_peak_bytes": self.allocated_peak_bytes,
            "reserved_peak_bytes": self.reserved_peak_bytes,
            "nvidia_smi_peak_bytes": self.nvidia_smi_peak_bytes,
            "device_total_bytes": self.device_total_bytes,
            "headroom_bytes": self.headroom_bytes,
            "num_params": self.num_params,
            "num_trainable_params": self.num_trainable_params,
            "peak_phase": self.peak_phase,
            "components": dict(self.components),
            "phases": dict(self.phases),
            "host_bytes_per_node": self.host_bytes_per_node,
            "nvme_bytes_per_node": self.nvme_bytes_per_node,
            "notes": list(self.notes),
            "allocated_peak_upper_bytes": self.allocated_peak_upper_bytes,
            "reserved_peak_upper_bytes": self.reserved_peak_upper_bytes,
            "nvidia_smi_peak_upper_bytes": self.nvidia_smi_peak_upper_bytes,
            "upper_margin": self.upper_margin,
            "upper_basis": self.upper_basis,
        }
