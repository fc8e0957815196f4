"""The estimators' memos return what the computation returns (issue #22: presets_gen's speed).

- block_activations, head_activations and throughput._layer_passes are memoised on a part of the
  plan (BLOCK_PLAN_FIELDS, HEAD_PLAN_FIELDS, LAYER_PASS_PLAN_FIELDS): changing any other field of
  the plan must change nothing they compute, or the memo would answer for the wrong plan.
- memory._replay remembers the uncapped allocator replay by a digest of its inputs; with the
  capacity binding it replays as allocator.replay_on_device does.
- presets_gen's worker tasks cover every preset group once, in the groups' own order per task.
"""
from __future__ import annotations

from dataclasses import fields

import pytest

from memkit.estimate import activations, memory, throughput
from memkit.estimate.activations import BLOCK_PLAN_FIELDS, HEAD_PLAN_FIELDS, PlanPart
from memkit.estimate.allocator import replay_on_device
from memkit.estimate.replay import moment_events
from memkit.plan.plan import TrainingPlan, knob_choices
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

BASES = (
    TrainingPlan(micro_batch_size=2, seq_len=1024, dp=2),
    TrainingPlan(micro_batch_size=1, seq_len=2048, lora_rank=16, lora_targets=("q_proj", "v_proj"), zero_stage=2,
                 checkpointing="full", loss="chunked"),
    TrainingPlan(precision="fp32", engine="torch", micro_batch_size=4, seq_len=512, zero_stage=3, dp=4,
                 offload_activations="cpu", overlap_comm=False),
)


def _other_values(plan: TrainingPlan, name: str) -> list:
    """Values of field `name` other than the plan's: the knob's declared choices, else a nearby one."""
    value = getattr(plan, name)
    choices = knob_choices(next(f for f in fields(TrainingPlan) if f.name == name))
    if choices is not None:
        return [c for c in choices if c != value]
    if isinstance(value, bool):
        return [not value]
    if isinstance(value, int):
        return [value + 1, value * 2 + 3]
    if isinstance(value, float):
        return [value + 0.25]
    if isinstance(value, str) and value.isdigit():
        return [str(int(value) + 1)]
    if name == "checkpointing":
        return ["none", "full", "3"]
    return []


def _variants(plan: TrainingPlan, keyed: tuple[str, ...]):
    for f in fields(TrainingPlan):
        if f.name in keyed:
            continue
        for other in _other_values(plan, f.name):
            yield f.name, plan.with_(**{f.name: other})


@pytest.fixture(scope="module")
def model():
    return load_model_spec("llama-3.2-1b")


@pytest.mark.parametrize("base", BASES)
def test_block_and_head_activations_read_no_plan_field_outside_their_keys(model, base):
    block = activations._block_activations(model, base, base.micro_batch_size, None, "cuda", True)
    head = activations._head_activations(model, base, base.micro_batch_size, "cuda")
    checked = 0
    for name, variant in _variants(base, BLOCK_PLAN_FIELDS):
        assert activations._block_activations(model, variant, base.micro_batch_size, None, "cuda", True) == block, name
        checked += 1
    for name, variant in _variants(base, HEAD_PLAN_FIELDS):
        assert activations._head_activations(model, variant, base.micro_batch_size, "cuda") == head, name
    assert checked > 20  # the grid reaches the fields the key leaves out


@pytest.mark.parametrize("base", BASES)
def test_layer_passes_read_no_plan_field_outside_their_key(model, base):
    gpu = find_gpu("a100-40gb")
    compute = throughput._memo_layer_passes.__wrapped__
    keyed = throughput.LAYER_PASS_PLAN_FIELDS
    tokens = base.micro_batch_size * base.seq_len
    want = compute(gpu, PlanPart(base, keyed), model, tokens, False, False, False, False)
    for name, variant in _variants(base, keyed):
        assert compute(gpu, PlanPart(variant, keyed), model, tokens, False, False, False, False) == want, name


@pytest.mark.parametrize("base", BASES)
def test_flops_per_token_reads_no_plan_field_outside_its_key(model, base):
    compute = throughput._memo_flops_per_token.__wrapped__
    keyed = throughput.FLOPS_PLAN_FIELDS
    want = compute(model, PlanPart(base, keyed))
    for name, variant in _variants(base, keyed):
        assert compute(model, PlanPart(variant, keyed)) == want, name


def test_memoised_estimates_equal_fresh_ones(model):
    hw = Hardware(gpu=find_gpu("a100-40gb"), num_gpus_per_node=2)
    plans = [p.with_(dp=2) for p in BASES]
    warm = [memory.estimate_memory(model, p, hw) for p in plans + plans]
    memory._UNCAPPED.clear()
    for memo in (activations._memo_block_activations, activations._memo_head_activations, memory._recent_walk,
                 throughput._memo_layer_passes, throughput._memo_flops_per_token):
        memo.cache_clear()
    assert warm == [memory.estimate_memory(model, p, hw) for p in plans] * 2


def test_replay_memo_equals_replay_on_device_with_and_without_a_binding_capacity(model):
    plan, hw = BASES[0], Hardware(gpu=find_gpu("a100-40gb"), num_gpus_per_node=2)
    trace: dict = {}
    memory._stage(model, plan, hw, 0, "cuda", trace=trace)
    timeline, chunks, streams = trace["timeline"], trace["chunks"], trace["streams"]
    free = replay_on_device(moment_events(timeline, chunks, streams), caching=True, expandable_segments=False,
                            capacity=hw.gpu.memory_bytes)
    assert free.allocated_peak_bytes < free.reserved_peak_bytes  # so a capacity between them binds
    for capacity in (hw.gpu.memory_bytes, free.allocated_peak_bytes, (free.allocated_peak_bytes + free.reserved_peak_bytes) // 2):
        want = replay_on_device(moment_events(timeline, chunks, streams), caching=True, expandable_segments=False,
                                capacity=capacity)
        for _ in range(2):  # a miss, then a hit
            got = memory._replay(timeline, chunks, streams, caching=True, expandable_segments=False, capacity=capacity)
            assert got == want


def test_replay_memo_is_bounded(model, monkeypatch):
    monkeypatch.setattr(memory, "REPLAY_MEMO_SIZE", 2)
    memory._UNCAPPED.clear()
    hw = Hardware(gpu=find_gpu("a100-40gb"), num_gpus_per_node=1)
    for micro in (1, 2, 3, 4):
        memory.estimate_memory(model, BASES[0].with_(dp=1, micro_batch_size=micro), hw)
    assert len(memory._UNCAPPED) == 2


def test_worker_tasks_cover_every_group_once_in_order():
    from memkit import presets_gen

    groups = presets_gen._groups()
    tasks = presets_gen._worker_tasks(groups)
    flat = [g for task in tasks for g in task]
    assert sorted(flat) == sorted(groups) and len(flat) == len(groups)
    for task in tasks:
        assert len({(g[0], g[2], g[3]) for g in task}) == 1
        assert task == sorted(task, key=groups.index)
