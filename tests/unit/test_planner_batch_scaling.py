"""Batch size does not drive the search's cost (issue 22): a pipeline plan with a long accumulation
is rejected by the closed-form floor of its receive buffers (search._pipeline_buffers_miss) instead
of a replay that grows with the accumulation; the floor never exceeds the exact estimate, so the
verdict is the one the replay gives; and a 10^9-sequence batch with the splits searched answers
the same plan as a 64-sequence-per-rank one scaled up."""
from __future__ import annotations

import pytest

from memkit.estimate.memory import estimate_memory
from memkit.planner import Request, search
from memkit.planner.search import PIPELINE_REPLAY_ACCUM, _Evaluator, _pipeline_buffers_miss, device_peak_bytes
from memkit.planner.space import layouts, structures, tiers, with_micro
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.units import GIB


def _request(batch: int, *, gpu: str = "rtx-4090", per_node: int = 2, seq: int = 8192) -> Request:
    return Request(model=load_model_spec("llama-3.1-8b"), global_batch_size=batch, seq_len=seq,
                   hardware=Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node,
                                     host_ram_bytes_per_node=256 * GIB))


def test_the_receive_buffer_floor_is_below_the_exact_estimate_and_gives_its_verdict():
    accum = PIPELINE_REPLAY_ACCUM + 76
    req = _request(2 * accum)
    (lay,) = [lay for lay in layouts(req) if lay[1] == 2]
    plans = [s for s in structures(req, tiers(req)[0], lay) if s.checkpointing == "full"][:1]
    assert plans and all(p.grad_accum == accum * 2 // lay[2] for p in plans)
    exact = _Evaluator(req, lambda *a, **k: estimate_memory(*a, **k))  # not `bounded`: always the replay
    assert not exact.bounded
    for plan in plans:
        verdict = _pipeline_buffers_miss(req, plan, req.budget_bytes)
        assert verdict is not None and verdict.device_fails and verdict.reason.startswith("at least")
        floor = verdict.overshoot * req.budget_bytes
        est = estimate_memory(req.model, plan, req.hardware)
        assert device_peak_bytes(est) >= floor > req.budget_bytes
        assert exact.check(plan).reason  # the replay says it does not fit either
        assert _Evaluator(req, estimate_memory).check(plan).reason == verdict.reason


def test_short_accumulations_and_fitting_floors_are_estimated():
    req = _request(64)
    plans = [s for lay in layouts(req) if lay[1] > 1 for s in structures(req, tiers(req)[0], lay)]
    assert plans
    for plan in plans:  # accumulation <= PIPELINE_REPLAY_ACCUM: the replay decides
        assert plan.grad_accum <= PIPELINE_REPLAY_ACCUM
        assert _pipeline_buffers_miss(req, plan, req.budget_bytes) is None
    big = _request(4 * PIPELINE_REPLAY_ACCUM, seq=128, gpu="h100-80gb")  # 1 MiB boundaries: the floor fits
    plan = with_micro(next(s for lay in layouts(big) if lay[1] > 1 for s in structures(big, tiers(big)[0], lay)), 1)
    assert plan.grad_accum > PIPELINE_REPLAY_ACCUM
    assert _pipeline_buffers_miss(big, plan, big.budget_bytes) is None


@pytest.mark.parametrize("batch", [8 * 64, 1_000_000_000])
def test_huge_global_batch_with_splits_searched_answers(batch):
    """No tp/pp pins (`memkit suggest`'s default, split 'auto'): the search ends and picks a
    data-parallel plan whose per-rank batch is the request's."""
    req = _request(batch, gpu="a100-80gb", per_node=8, seq=2048)
    result = search(req)
    plan = result.chosen.plan
    assert plan.micro_batch_size * plan.grad_accum * plan.dp == batch
    assert plan.tp == plan.pp == 1
    assert result.num_memory_estimates < 2000
