"""Runtime measurements for a training run: peak memory, throughput, MFU.

CUDA: the caching allocator's own counters (torch.cuda.max_memory_allocated / _reserved, the
figures MemoryEstimate predicts) and the device's used memory from cudaMemGetInfo (what
nvidia-smi shows: reserved + CUDA context + other processes).
CPU: the bytes of live tensor storages, from LiveTensorTracker (live_tensors.py), the CPU
analogue of "allocated"; there is no "reserved" on CPU.
"""
from __future__ import annotations

import resource
import statistics
import sys
from dataclasses import dataclass

import torch

from memkit.errors import MemkitError


@dataclass(frozen=True, slots=True, kw_only=True)
class MemorySample:
    kind: str
    """'cuda' (allocator counters) or 'live-tensors' (LiveTensorTracker) or 'none'."""
    allocated_peak_bytes: int | None
    reserved_peak_bytes: int | None = None
    device_used_peak_bytes: int | None = None
    """Peak of (total - free) device memory seen at step ends (nvidia-smi 'used')."""
    host_rss_peak_bytes: int | None = None

    def to_dict(self) -> dict:
        return {"memory_kind": self.kind, "allocated_peak_bytes": self.allocated_peak_bytes,
                "reserved_peak_bytes": self.reserved_peak_bytes,
                "device_used_peak_bytes": self.device_used_peak_bytes,
                "host_rss_peak_bytes": self.host_rss_peak_bytes}


def host_rss_peak_bytes() -> int:
    """This process's peak resident set size (getrusage; Linux reports KiB, macOS bytes)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class MemoryMeter:
    """Peak memory of this process since it started (CUDA) or since the tracker started (CPU)."""

    def __init__(self, device: torch.device, *, tracker=None) -> None:
        self.device = device
        self.tracker = tracker
        self._used_peak = 0

    @property
    def kind(self) -> str:
        if self.device.type == "cuda":
            return "cuda"
        return "live-tensors" if self.tracker is not None else "none"

    def sample(self) -> MemorySample:
        """Read the counters now (call at step ends; cheap: no device sync beyond mem_get_info)."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            self._used_peak = max(self._used_peak, total - free)
            return MemorySample(kind="cuda",
                                allocated_peak_bytes=int(torch.cuda.max_memory_allocated(self.device)),
                                reserved_peak_bytes=int(torch.cuda.max_memory_reserved(self.device)),
                                device_used_peak_bytes=int(self._used_peak),
                                host_rss_peak_bytes=host_rss_peak_bytes())
        peak = int(self.tracker.peak_bytes) if self.tracker is not None else None
        return MemorySample(kind=self.kind, allocated_peak_bytes=peak,
                            host_rss_peak_bytes=host_rss_peak_bytes())


def gpu_peak_tflops(device: torch.device, precision: str) -> float | None:
    """Dense peak TFLOP/s of this CUDA device for `precision`, from the GPU catalog; None if unknown."""
    if device.type != "cuda":
        return None
    from memkit.spec.hardware import find_gpu

    name = torch.cuda.get_device_name(device)
    try:
        gpu = find_gpu(name)
    except MemkitError:
        return None
    return gpu.peak_tflops(precision) or None


def train_flops_per_token(*, num_params: int, num_trainable_params: int, num_layers: int,
                          hidden_size: int, seq_len: int, embedding_params: int = 0) -> float:
    """Model FLOPs per trained token for the measured MFU: memkit.estimate.flops, the formula the
    predicted MFU uses (PaLM App. B). The matmul parameters are the model's minus its embedding
    lookup: `embedding_params` is the input-embedding lookup no matmul uses (0 when the LM head is tied
    to it); pass it so measured and predicted MFU count the same N."""
    from memkit.estimate.flops import train_flops_per_token as one_formula

    matmul = num_params - embedding_params
    return one_formula(matmul_params=matmul, trainable_matmul_params=min(matmul, num_trainable_params),
                       num_layers=num_layers, attention_width=hidden_size, seq_len=seq_len)


def mfu(tokens_per_s: float, flops_per_token: float, peak_tflops: float | None) -> float | None:
    """Model FLOPs utilisation (PaLM, Appendix B): achieved model FLOP/s over the device peak."""
    if not peak_tflops or tokens_per_s <= 0:
        return None
    return tokens_per_s * flops_per_token / (peak_tflops * 1e12)


def steady_median(values: list[float], *, warmup: int = 1) -> float | None:
    """Median of per-step figures after the first `warmup` steps (JIT, allocator warm-up)."""
    if not values:
        return None
    tail = values[warmup:] if len(values) > warmup else values
    return statistics.median(tail)
