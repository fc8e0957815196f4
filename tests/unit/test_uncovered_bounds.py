"""Issue 20 items 1 and 5 on the memory side: a source's stated length statistics as sample lengths
(calibrate/published_memory.py lengths_from_stats), the variable-length replay held to the device
as torch's allocator holds it (estimate/varlen.py), and the wider upper bound of a kind of plan no
calibration framework covers (estimate/bounds.py uncovered_kinds)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from memkit.calibrate.published_memory import lengths_from_stats
from memkit.errors import MemkitError
from memkit.estimate.bounds import margin, uncovered_kinds
from memkit.estimate.memory import estimate_memory
from memkit.estimate.residuals_table import COVERED_LORA_SEQ_LEN, RESIDUAL_MARGIN, UNCOVERED_MARGIN
from memkit.estimate.varlen import estimate_varlen
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, custom_gpu, find_gpu
from memkit.spec.hf import load_model_spec

REPO = Path(__file__).resolve().parents[2]
QWEN7B = REPO / "benchmarks" / "calibration_configs" / "qwen-7b"
LLAMA = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2000,
         "max_position_embeddings": 4096, "tie_word_embeddings": False}


def _llama(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA))
    return load_model_spec(str(tmp_path))


def test_lengths_from_stats_keep_the_stated_moments_and_the_source_rule():
    stats = {"mean": 3000.0, "sd": 1500.0, "min": 1, "max": 10 ** 7, "samples": 40000}
    drawn = lengths_from_stats(stats, max_length=10 ** 7)  # nothing cut: the lognormal itself
    mean = sum(drawn) / len(drawn)
    sd = math.sqrt(sum((n - mean) ** 2 for n in drawn) / len(drawn))
    # sigma^2 = ln(1 + 0.5^2), mu = ln(3000) - sigma^2 / 2: mean 3000 and sd 1500 (int() floors: -0.5)
    assert mean == pytest.approx(3000, rel=0.02) and sd == pytest.approx(1500, rel=0.04)
    deleted = lengths_from_stats({**stats, "over_max_length": "delete"}, max_length=2048)
    truncated = lengths_from_stats(stats, max_length=2048)
    assert max(deleted) <= 2048 and len(deleted) == sum(n <= 2048 for n in drawn)
    assert len(truncated) == len(drawn) and max(truncated) == 2048
    clipped = lengths_from_stats({**stats, "min": 500, "max": 4000}, max_length=10 ** 7)
    assert min(clipped) == 500 and max(clipped) == 4000
    with pytest.raises(MemkitError):
        lengths_from_stats({"mean": 100, "sd": 10, "max": 200, "over_max_length": "delete"}, max_length=50)


def test_varlen_replay_releases_the_cache_at_the_device():
    """Ever longer steps leave every shorter step's segments cached (none is large enough for the
    next). On a device too small for that, torch frees the cached segments and retries the
    cudaMalloc, so reserved stays within the device while the live bytes are those of one step."""
    spec = load_model_spec("gpt2")
    plan = TrainingPlan(precision="bf16", micro_batch_size=4, seq_len=1024)
    steps = list(range(256, 1025, 64))
    big = estimate_varlen(spec, plan, Hardware(gpu=find_gpu("a100-80gb")), steps, expandable_segments=False)
    assert big.reserved_peak_bytes > 1.5 * big.single_shape_reserved_bytes  # the cache grew
    small_gpu = custom_gpu(int(1.25 * big.single_shape_reserved_bytes) + 2 ** 30, like=find_gpu("a100-80gb"))
    small = estimate_varlen(spec, plan, Hardware(gpu=small_gpu), steps, expandable_segments=False)
    outside = big.nvidia_smi_peak_bytes - big.reserved_peak_bytes
    assert small.reserved_peak_bytes <= small_gpu.memory_bytes - outside
    assert small.reserved_peak_bytes < big.reserved_peak_bytes
    assert small.allocated_peak_bytes == big.allocated_peak_bytes


def test_uncovered_kinds_name_each_kind(tmp_path):
    llama = _llama(tmp_path)
    short = TrainingPlan(precision="bf16", lora_rank=8, seq_len=COVERED_LORA_SEQ_LEN)
    long = TrainingPlan(precision="bf16", lora_rank=8, seq_len=COVERED_LORA_SEQ_LEN * 2)
    assert uncovered_kinds(llama, short) == ()
    assert uncovered_kinds(llama, TrainingPlan(precision="bf16", seq_len=COVERED_LORA_SEQ_LEN * 2)) == ()
    (reason,) = uncovered_kinds(llama, long)
    assert reason.startswith("LoRA long sequence:") and str(COVERED_LORA_SEQ_LEN) in reason
    assert uncovered_kinds(llama, short, variable_length=True)[0].startswith("variable-length data:")
    qwen = load_model_spec(str(QWEN7B))  # remote code (model_type 'qwen'), priced by its mapping
    assert uncovered_kinds(qwen, short)[0].startswith("remote code:")


def test_an_uncovered_plan_gets_the_wider_bound_and_says_why(tmp_path):
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    plan = TrainingPlan(precision="bf16-pure", engine="torch", lora_rank=8, lora_targets=("c_attn",), seq_len=1024,
                        checkpointing="full", attention="sdpa")
    qwen = estimate_memory(load_model_spec(str(QWEN7B)), plan, hw)
    assert qwen.upper_margin == pytest.approx(max(UNCOVERED_MARGIN["cached"], RESIDUAL_MARGIN["cached"]), abs=1e-4)
    assert qwen.nvidia_smi_peak_upper_bytes == int(qwen.nvidia_smi_peak_bytes * (1 + qwen.upper_margin))
    assert "no calibration framework covers" in qwen.upper_basis and "remote code" in qwen.upper_basis
    llama = estimate_memory(_llama(tmp_path), TrainingPlan(precision="bf16", lora_rank=8, seq_len=1024), hw)
    assert llama.upper_margin == pytest.approx(RESIDUAL_MARGIN["cached"], abs=1e-4)
    assert "no calibration framework covers" not in llama.upper_basis
    assert margin(plan, RESIDUAL_MARGIN, figure="allocated", uncovered=("x",)) == UNCOVERED_MARGIN["allocated"]


def test_the_allocated_bound_never_exceeds_the_reserved_bound():
    # the uncovered allocated margin (the largest allocated residual) is far above the cached one
    plan = TrainingPlan(precision="bf16-pure", engine="torch", lora_rank=8, lora_targets=("c_attn",), seq_len=4096,
                        checkpointing="full", attention="sdpa")
    est = estimate_memory(load_model_spec(str(QWEN7B)), plan, Hardware(gpu=find_gpu("a100-80gb")))
    assert UNCOVERED_MARGIN["allocated"] > UNCOVERED_MARGIN["cached"]
    assert est.allocated_peak_bytes <= est.allocated_peak_upper_bytes <= est.reserved_peak_upper_bytes
