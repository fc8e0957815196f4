"""Ties are decisions (issue 21 item 5): the ranking uncertainty the planner reads is the p75 error of
the predicted ratio of two published runs (calibrate/published_throughput.py pair_ratio_errors), and
within it suggest prefers the lower-risk plan -- no offload, no split, headroom, then fewer moving
parts (planner/search.py _risk, moving_parts) -- and says so; explain shows each margin."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from memkit.calibrate.published_throughput import (ThroughputCase, ThroughputOutcome, map_record,
                                                   pair_ratio_errors, score, summarize)
from memkit.estimate import throughput as tp_model
from memkit.estimate.memory import estimate_memory
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.planner.search import Candidate, _prefer_low_risk, device_peak_bytes, moving_parts, search
from memkit.planner.space import Request
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

LLAMA8B = load_model_spec("llama-3.1-8b")
A100x8 = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=8)
REPO = Path(__file__).resolve().parents[2]


def _outcome(case_id: str, measured: float, predicted: float, *, group: str = "g", absolute: bool = True):
    case = ThroughputCase(case_id=case_id, source_id="s", group=group, measured_tps_per_gpu=measured,
                          absolute=absolute, summary="-")
    return ThroughputOutcome(case=case, predicted_tps_per_gpu=predicted)


def test_pair_ratio_error_is_the_error_of_the_predicted_ratio_hand_worked():
    # A +10 %, B exact, C -20 %: A/B predicted 110/200 = 0.55 vs measured 0.5 -> 0.10; A/C 2.75 vs 2
    # -> 0.375; B/C 5 vs 4 -> 0.25. D is ranked only (not in a ratio), E is in another group.
    rows = [_outcome("A", 100, 110), _outcome("B", 200, 200), _outcome("C", 50, 40),
            _outcome("D", 70, 10, absolute=False), _outcome("E", 10, 30, group="h")]
    assert sorted(pair_ratio_errors(rows)) == pytest.approx([0.10, 0.25, 0.375])
    table = summarize(rows)["ALL"]
    # numpy-linear p75 of (0.10, 0.25, 0.375): position 1.5 -> 0.25 + 0.5 * 0.125
    assert table["n_ratio_pairs"] == 3 and table["p75_pair_ratio_pct"] == pytest.approx(31.25)
    # an error both rows share cancels: every prediction 20 % high ranks each pair exactly
    same = [_outcome("A", 100, 120), _outcome("B", 200, 240), _outcome("C", 50, 60)]
    assert pair_ratio_errors(same) == pytest.approx([0.0, 0.0, 0.0])


def test_stated_ranking_uncertainty_is_what_the_benchmark_measures_on_the_dev_half():
    data = next((p for p in (REPO.parent / "shared" / "calibration" / "published_throughput.jsonl",
                             Path("/work/shared/calibration/published_throughput.jsonl")) if p.exists()), None)
    if data is None:
        pytest.skip("published_throughput.jsonl is not next to the repository")
    records = [json.loads(line) for line in data.read_text().splitlines() if line.strip()]
    table = summarize([score(map_record(r, configs_dir=REPO / "benchmarks" / "calibration_configs"))
                       for r in records])["ALL"]
    # regenerate with: python benchmarks/throughput_accuracy.py --write-uncertainty (within a point)
    assert tp_model.step_time_ranking_uncertainty() == pytest.approx(table["p75_pair_ratio_pct"] / 100, abs=0.01)
    assert table["n_ratio_pairs"] > 100


def test_moving_parts_count_the_mechanisms_a_plan_adds():
    base = TrainingPlan(zero_stage=0, dp=8, micro_batch_size=1, seq_len=2048)
    assert moving_parts(base) == 0
    assert moving_parts(base.with_(checkpointing="full")) == 1
    assert moving_parts(base.with_(checkpointing="4", loss="chunked")) == 2
    assert moving_parts(base.with_(checkpointing="full", loss="chunked", zero_stage=3)) == 3


def _candidate(plan: TrainingPlan, step_s: float) -> Candidate:
    speed = estimate_step_time(LLAMA8B, plan, A100x8)
    return Candidate(plan=plan, memory=estimate_memory(LLAMA8B, plan, A100x8),
                     speed=replace(speed, step_time_s=step_s), tier="default")


def _request() -> Request:
    return Request(model=LLAMA8B, hardware=A100x8, seq_len=2048, global_batch_size=64)


def test_within_the_uncertainty_fewer_moving_parts_win_and_the_note_says_so_exactly():
    # Both ZeRO-3 on 8 A100s at micro 1 (no offload, no split, > 5 % headroom each); the
    # predicted-fastest also checkpoints every block (2 moving parts), the other does not (1), and is
    # 0.5 u slower: the other is chosen, and the note gives both times, the margin and the reason.
    u = tp_model.step_time_ranking_uncertainty()
    plain = TrainingPlan(zero_stage=3, dp=8, micro_batch_size=1, grad_accum=8, seq_len=2048)
    ckpt = plain.with_(checkpointing="full")
    fastest, other = _candidate(ckpt, 2.0), _candidate(plain, 2.0 * (1 + 0.5 * u))
    for c in (fastest, other):
        assert device_peak_bytes(c.memory) < 0.95 * A100x8.gpu.memory_bytes
    order, note = _prefer_low_risk(_request(), [fastest, other])
    assert order == [other, fastest]
    assert note == (f"tie: chose {other.label} ({other.speed.step_time_s:.2f} s/step) over the predicted-fastest "
                    f"{fastest.label} (2.00 s/step): {0.5 * u:.1%} slower, within the step-time model's "
                    f"+-{u:.1%} measured ranking uncertainty, and lower risk (fewer moving parts (1 vs 2: "
                    f"no checkpointing))")
    assert other.label == "ZeRO-3 bf16 micro 1 x accum 8" and fastest.label == "ZeRO-3 bf16 ckpt micro 1 x accum 8"
    # beyond the uncertainty the speed decides: 1.5 u slower is not a tie, the order stays, no note
    order, note = _prefer_low_risk(_request(), [fastest, _candidate(plain, 2.0 * (1 + 1.5 * u))])
    assert order[0] is fastest and note == ""


def test_a_tie_kept_on_fewer_moving_parts_names_them():
    # the predicted-fastest is also the simpler one: kept, and the note says on what it won
    u = tp_model.step_time_ranking_uncertainty()
    plain = TrainingPlan(zero_stage=3, dp=8, micro_batch_size=1, grad_accum=8, seq_len=2048)
    kept, runner = _candidate(plain, 2.0), _candidate(plain.with_(loss="chunked"), 2.0 * (1 + 0.25 * u))
    order, note = _prefer_low_risk(_request(), [kept, runner])
    assert order[0] is kept
    assert note == (f"tie: {kept.label} (2.00 s/step) and {runner.label} ({runner.speed.step_time_s:.2f} s/step) "
                    f"differ by {0.25 * u:.1%}, within the step-time model's +-{u:.1%} measured ranking "
                    f"uncertainty; kept it for lower risk (fewer moving parts (1 vs 2: no chunked/fused loss))")


def test_suggest_on_one_gpu_keeps_the_plain_step_when_sharding_is_priced_within_the_uncertainty():
    # llama-3.2-1b, one A100-80GB, 8 x 2048 tokens: ZeRO-0 and ZeRO-1/2 all fit with room; whatever
    # the model prices, every alternative the search found within u of the chosen plan has at least
    # as many moving parts, and the chosen plan's tie note states the margin it won by.
    u = tp_model.step_time_ranking_uncertainty()
    req = Request(model=load_model_spec("llama-3.2-1b"), hardware=Hardware(gpu=find_gpu("a100-80gb")),
                  global_batch_size=8, seq_len=2048)
    result = search(req)
    chosen = result.chosen
    close = [a for a in result.alternatives
             if abs(a.speed.step_time_s / chosen.speed.step_time_s - 1) <= u]
    assert close, "expected plans within the uncertainty on this request"
    assert all(moving_parts(a.plan) >= moving_parts(chosen.plan) for a in close)
    ties = [n for n in result.notes if n.startswith("tie: ")]
    assert len(ties) == 1 and f"+-{u:.1%} measured ranking uncertainty" in ties[0]
