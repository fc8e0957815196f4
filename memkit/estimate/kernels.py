"""Time of one GPU kernel from its shape: matmuls, attention, memory-bound elementwise ops.

Pure arithmetic on the GPU catalog's datasheet peaks (presets/gpus.json). Each efficiency below is a
published measurement of what the kernel reaches on that GPU generation (or says plainly that it is
an assumption), not a fit to memkit's throughput benchmark (benchmarks/throughput_accuracy.py).
"""
from __future__ import annotations

import math

from memkit.spec.hardware import GPU

GB = 1e9

MATMUL_EFFICIENCY = {
    # 16-bit tensor-core GEMM, largest well-shaped sizes: "Maximum Achievable Matmul FLOPS" table,
    # stas00/ml-engineering compute/accelerator/README.md (A100 SXM 267.9/312 = 85.9 %, H100 SXM
    # 792.1/989 = 80.1 %, MI300X 781.9/1300 = 60.1 %). Volta: cuBLAS FP16 GEMM M=N=K=8192 on a V100
    # reaches ~101 of 112 TFLOP/s = 90 % (NVIDIA developer forum, "Understanding IPC and issue slot
    # utilization when using Tensor Cores", 2019); Turing taken as Volta (same tensor-core
    # generation per SM), Ada as Ampere (same SM tensor-core design).
    "tensor": {"volta": 0.90, "turing": 0.90, "ampere": 0.859, "ada": 0.859, "hopper": 0.801, "cdna3": 0.601},
    # fp32 GEMM on CUDA cores (PyTorch keeps TF32 off for matmuls since 1.12,
    # torch.backends.cuda.matmul.allow_tf32). Assumption, not a measurement: the same ~90 %
    # best-shape share cuBLAS reaches with tensor cores on Volta.
    "fp32": {"volta": 0.90, "turing": 0.90, "ampere": 0.90, "ada": 0.90, "hopper": 0.90, "cdna3": 0.90},
}

FLASH_ATTENTION_EFFICIENCY = {"ampere": 0.50, "ada": 0.50, "hopper": 0.35, "cdna3": 0.35}
"""Fraction of the 16-bit peak a flash-attention kernel (forward + backward) reaches, on the FLOPs
MFU tables count for attention (flops.py: 4·T·H·Q per token forward, twice that backward).
Ampere: FlashAttention-2 reaches 50-73 % of the A100 peak (Dao 2023, abstract and Sec. 4.1; the
backward is at the low end); Hopper: FlashAttention-2 "achieves only 35 % utilization" on H100
(Shah et al. 2024, FlashAttention-3, Sec. 1). Volta/Turing have no flash kernel (FA2 needs sm80+);
PyTorch SDPA picks its memory-efficient kernel there, whose utilisation is not published, so
attention there is priced as eager matmuls plus score-matrix traffic (an upper bound on time)."""

SUSTAINED_CLOCK_FRACTION = {"ampere": 1305 / 1410, "hopper": 1575 / 1980}
"""Training is one long power-saturated run, so tensor-core kernels run at the clock the GPU
sustains at its power limit, below the clock short benchmarks (MAMF, kernel papers) run at.
Ampere: the clock NVIDIA sustains on A100 at its power limit in HPL, 1305 of its 1410 MHz boost
(G. Lockwood, "Peak FLOPS", glennklockwood.com, Rpeak). Hopper: an H-series SXM GPU at its 700 W
limit drops from its 1980 MHz application clock to 1575 MHz once GEMMs overlap communication, as
training does (deepseek-ai/DeepGEMM issue #120, 2025); H200 runners at 700 W cannot hold even a
locked 1830 MHz under full load (tile-ai/TileOPs issue #1587, 2026). 1980 MHz is the clock the
driver boosts a short benchmark to (TileOPs #1587: "Application graphics clock remains at the
default 1980 MHz"), so MAMF is measured there. Other generations: no published sustained figure,
1.0. HBM bandwidth does not follow the SM clock, so memory-bound kernels keep HBM_EFFICIENCY."""

HBM_EFFICIENCY = 0.85
"""Achievable share of datasheet DRAM bandwidth for streaming kernels: BabelStream on A100/V100
reaches ~85-90 % (Deakin et al. 2018, "Evaluating attainable memory bandwidth of parallel
programming models via BabelStream"; NVIDIA's own A100 copy figure ~1.4 of 1.55 TB/s)."""

WAVE_TILE = (256, 128, 64)
"""cuBLAS's large tensor-core output tile (either orientation) and its K step: 256x128 output
tiles with one thread block resident per SM (NVIDIA, "Matrix Multiplication Background User's
Guide", Sec. 2.3 "Typical Tile Dimensions in cuBLAS and Performance" and Sec. 3.2 "Wave
Quantization", whose example is an A100: 108 SMs, so a wave is 108 such tiles); K advances 64 per
main-loop stage (cuBLAS's Ampere kernel names, e.g. ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_
stages_64x3_tn, as profilers list them)."""


def wave_quantization(gpu: GPU, m: float, n: float, k: float, *, batch: float = 1.0) -> tuple[float, int]:
    """(share of the launched tile slots that do useful math, K slices) of one (batched) GEMM.

    Tile quantization: m and n round up to whole tiles; wave quantization: the tiles run in waves of
    one tile per SM, and the last, partial wave takes a whole wave's time (Matrix Multiplication
    Background, Sec. 3.1-3.2). When all the tiles fill less than one wave, the K reduction is split
    over more thread blocks (CUTLASS media/docs/efficient_gemm.md, "Split K - reduction across
    threadblocks": for small problems "there are too few threadblocks to efficiently occupy the
    entire GPU"), as many slices as fill the SMs, each at least one K stage deep. The catalog's
    num_sms = 0 (unknown) prices tile quantization alone."""
    tm, tn, tk = WAVE_TILE
    best, best_split = 0.0, 1
    for a, b in ((tm, tn), (tn, tm)):
        tiles = batch * math.ceil(m / a) * math.ceil(n / b)
        useful = batch * m * n / (tiles * a * b)
        split = 1
        if gpu.num_sms > 0:
            if tiles < gpu.num_sms:
                split = max(1, min(gpu.num_sms // int(tiles), int(k // tk)))
            slots = math.ceil(tiles * split / gpu.num_sms) * gpu.num_sms
            useful *= tiles * split / slots
        if useful > best:
            best, best_split = useful, split
    return best, best_split


def matmul_peak_flops(gpu: GPU, precision: str) -> float:
    return gpu.peak_tflops(precision) * 1e12


def sustained_clock_fraction(gpu: GPU) -> float:
    return SUSTAINED_CLOCK_FRACTION.get(gpu.arch, 1.0)


def matmul_efficiency(gpu: GPU, precision: str) -> float:
    """Achievable share of peak for a well-shaped GEMM at the sustained clock."""
    kind = "fp32" if precision == "fp32" else "tensor"
    return MATMUL_EFFICIENCY[kind].get(gpu.arch, MATMUL_EFFICIENCY[kind]["ampere"]) * sustained_clock_fraction(gpu)


_GEMM_CACHE: dict[tuple, float] = {}
_GEMM_GPUS: dict[int, GPU] = {}  # keeps each keyed GPU alive, so its id() is not reused meanwhile
_GEMM_CACHE_LIMIT = 200_000


def gemm_time_s(gpu: GPU, precision: str, m: float, n: float, k: float, *, batch: float = 1.0) -> float:
    """_gemm_time_s, memoised: a pure function of its arguments that the planner's step-time bounds
    ask for with the same shapes thousands of times (every structure at every micro-batch)."""
    key = (id(gpu), precision, m, n, k, batch)
    hit = _GEMM_CACHE.get(key)
    if hit is None:
        if len(_GEMM_CACHE) >= _GEMM_CACHE_LIMIT:
            _GEMM_CACHE.clear()
            _GEMM_GPUS.clear()
        _GEMM_GPUS[id(gpu)] = gpu
        hit = _GEMM_CACHE[key] = _gemm_time_s(gpu, precision, m, n, k, batch=batch)
    return hit


def _gemm_time_s(gpu: GPU, precision: str, m: float, n: float, k: float, *, batch: float = 1.0) -> float:
    """One (batched) GEMM C[m,n] = A[m,k] B[k,n]: the slower of its math (tile- and wave-quantised,
    at the achievable matmul rate) and its HBM traffic (roofline, Williams et al. 2009), plus a
    split-K reduction where the tiles fill less than one wave (wave_quantization)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    elt = 4 if precision == "fp32" else 2
    hbm = gpu.hbm_gbps * GB * HBM_EFFICIENCY
    if precision == "fp32":   # CUDA-core SGEMM: its tiles and waves are not modelled
        useful, split = 1.0, 1
    else:
        useful, split = wave_quantization(gpu, m, n, k, batch=batch)
    math_s = batch * 2.0 * m * n * k / useful / (matmul_peak_flops(gpu, precision) * matmul_efficiency(gpu, precision))
    bytes_s = batch * elt * (m * k + k * n + m * n) / hbm
    # split K: each slice writes an fp32 partial of C, a reduction kernel reads them and writes C
    reduce_s = batch * (8 * split + elt) * m * n / hbm if split > 1 else 0.0
    return max(math_s, bytes_s) + reduce_s


def memory_time_s(gpu: GPU, num_bytes: float) -> float:
    """A memory-bound kernel: bytes read + written over achievable HBM bandwidth (roofline)."""
    return num_bytes / (gpu.hbm_gbps * GB * HBM_EFFICIENCY)


def has_flash_kernel(gpu: GPU, precision: str) -> bool:
    """FlashAttention-2 / PyTorch SDPA's flash backend: 16-bit inputs on sm80+ (Dao-AILab
    flash-attention README 'Requirements'; torch sdp_utils check_sm_version / check_dtype)."""
    return precision != "fp32" and gpu.arch in FLASH_ATTENTION_EFFICIENCY


FLASH_ATTENTION_LENGTHS = (512, 1024, 2048, 4096, 8192, 16384)
FLASH_ATTENTION_CURVES = {
    # FlashAttention-2 forward + backward TFLOP/s by sequence length (the lengths above), read off
    # the bars of Dao 2023's Figure 4 as the flash-attention repo ships it (Dao-AILab/flash-attention
    # assets/flash2_a100_fwd_bwd_benchmark.png and assets/flash2_h100_fwd_bwd_benchmark.png @ 0251105a;
    # batch x seq = 16k tokens, hidden 2048, bf16). Keyed (figure, causal, head dim). Two A100
    # non-causal bars are hidden under the figure's legend (None): interpolated / held from their
    # neighbours. Only the shape is used (flash_attention_length_factor): the level stays the
    # paper's headline utilisation, FLASH_ATTENTION_EFFICIENCY.
    ("a100", True, 64): (88, 119, 140, 156, 165, 171),
    ("a100", True, 128): (99, 133, 155, 173, 182, 189),
    ("a100", False, 64): (132, None, 162, 171, 175, 176),
    ("a100", False, 128): (None, None, 187, 196, 201, 203),
    ("h100", True, 64): (141, 192, 232, 257, 273, 284),
    ("h100", True, 128): (163, 221, 265, 294, 308, 328),
    ("h100", False, 64): (215, 254, 274, 288, 294, 296),
    ("h100", False, 128): (248, 294, 320, 326, 335, 338),
}
FLASH_ATTENTION_FIGURE = {"ampere": "a100", "ada": "a100", "hopper": "h100", "cdna3": "h100"}
"""Which measured figure a generation follows: Ada shares Ampere's SM design (as in
MATMUL_EFFICIENCY); MI300X's flash kernels are not in the figures, the H100 shape is an assumption."""

FLASH_BACKWARD_FLOP_RATIO = 2.5
"""The flash backward does 2.5x the forward's matmul FLOPs: it recomputes the scores (Q K^T) and
runs four more GEMMs (dV, dP, dQ, dK) against the forward's two (Dao 2023, Sec. 3.1.2 Algorithm 2;
flash-attention benchmarks/benchmark_flash_attention.py counts bwd = 2.5 x fwd). MFU tables count
the backward as 2x (memkit.estimate.flops), so of a fwd+bwd attention time the forward -- what a
checkpoint recompute re-runs -- is 1/3.5 of it, not 1/3."""


def _curve_at(points: tuple, seq_len: float) -> float:
    known = [(math.log2(n), v) for n, v in zip(FLASH_ATTENTION_LENGTHS, points) if v is not None]
    x = math.log2(max(seq_len, 1.0))
    if x <= known[0][0]:
        return known[0][1]
    for (x0, v0), (x1, v1) in zip(known, known[1:]):
        if x <= x1:
            return v0 + (v1 - v0) * (x - x0) / (x1 - x0)
    return known[-1][1]       # beyond 16k the figures have flattened (8k -> 16k: +1 ... +6 %)


def flash_attention_length_factor(gpu: GPU, seq_len: float, head_dim: float, causal: bool) -> float:
    """The flash kernel's rate at this sequence length and head dim over its rate at 16k (the
    long-sequence plateau the paper's headline utilisation describes): fewer query blocks per head
    and, under a causal mask, a larger share of half-masked diagonal blocks slow short sequences
    (Dao 2023, Sec. 4.1 and Figure 4). Head dims between 64 and 128 interpolate, outside clamp."""
    fig = FLASH_ATTENTION_FIGURE[gpu.arch]
    def at(d: int) -> float:
        points = FLASH_ATTENTION_CURVES[(fig, causal, d)]
        return _curve_at(points, seq_len) / _curve_at(points, FLASH_ATTENTION_LENGTHS[-1])
    w = min(1.0, max(0.0, (head_dim - 64) / 64))
    return (1 - w) * at(64) + w * at(128)


def flash_attention_time_s(gpu: GPU, precision: str, counted_flops: float, *, seq_len: float = 16384,
                           head_dim: float = 128, causal: bool = True) -> float:
    """Forward + backward time of flash attention whose MFU-counted FLOPs (forward + 2x backward)
    are counted_flops."""
    rate = (matmul_peak_flops(gpu, precision) * FLASH_ATTENTION_EFFICIENCY[gpu.arch] * sustained_clock_fraction(gpu)
            * flash_attention_length_factor(gpu, seq_len, head_dim, causal))
    return counted_flops / rate
