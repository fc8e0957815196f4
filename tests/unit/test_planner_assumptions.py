"""The facts the planner's pruning rests on (memkit/planner/search.py, _Pruner), checked against
the real estimator, so a change to the estimator that breaks them fails here, not silently in
the search:

  (a) at a fixed ZeRO stage, precision, optimizer and layout, device memory does not grow with
      more offload, with checkpointing, or with overlap_comm off; it grows with the micro-batch;
  (b) host RAM does not depend on checkpointing, overlap_comm or the micro-batch, and does not
      shrink with more CPU offload;
  (c) activation offload never shortens a step: the same plan at the same micro-batch is at
      least as slow with it (search._bound_order prices offload structures lazily on this);
  (d) nor does overlap_comm off under ZeRO-1/2 (search._dominators, the same laziness).
"""
from __future__ import annotations

import pytest

from memkit.estimate.allocator import K_LARGE_BUFFER
from memkit.estimate.memory import estimate_memory
from memkit.estimate.throughput import estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.planner.space import bucket_sizes
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec

MODELS = ["gpt2", "llama-3.2-1b", "qwen2.5-7b", "gemma-2-2b", "phi-2", "llama-3.1-70b", "opt-1.3b", "t5-base"]
HARDWARE = [("rtx-4090", 2, 1), ("a100-80gb", 8, 2), ("t4", 1, 1)]
OFFLOADS = {1: [("none", "none"), ("cpu", "none")], 2: [("none", "none"), ("cpu", "none")],
            3: [("none", "none"), ("cpu", "none"), ("cpu", "cpu")]}


def _plans(model, hardware):
    prec = "bf16" if hardware.gpu.bf16 else "fp16"
    buckets = bucket_sizes(model, hardware)

    def plan(**kw):
        return TrainingPlan(precision=prec, dp=hardware.num_gpus, seq_len=512, **buckets, **kw)
    return plan


@pytest.mark.slow  # one of the longest unit tests on 2 busy cores: the inner loop (-m 'not slow') skips it
@pytest.mark.parametrize("gpu, per_node, nodes", HARDWARE)
@pytest.mark.parametrize("name", MODELS)
def test_device_memory_is_monotone_within_a_zero_stage(name, gpu, per_node, nodes):
    model = load_model_spec(name)
    hardware = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node, num_nodes=nodes)
    plan = _plans(model, hardware)

    def peak(p):
        return estimate_memory(model, p, hardware).nvidia_smi_peak_bytes

    # Within one 20 MiB segment: reserved comes from a replay of the caching allocator
    # (estimate/allocator.py), and a real allocator is not monotone below that grain either (one
    # more or one fewer cached segment).
    def le(a, b):
        return a <= b + K_LARGE_BUFFER

    def descending(xs):
        return all(le(b, a) for a, b in zip(xs, xs[1:]))

    for zero, combos in OFFLOADS.items():
        for ckpt in ("none", "full"):
            for overlap in (True, False):
                peaks = [peak(plan(zero_stage=zero, offload_optimizer=o, offload_params=q, checkpointing=ckpt,
                                   overlap_comm=overlap)) for o, q in combos]
                assert descending(peaks), (zero, ckpt, overlap, peaks)
        for o, q in combos:
            base = dict(zero_stage=zero, offload_optimizer=o, offload_params=q)
            assert le(peak(plan(**base, checkpointing="full")), peak(plan(**base, checkpointing="none")))
            assert le(peak(plan(**base, overlap_comm=False)), peak(plan(**base, overlap_comm=True)))
            micro = [peak(plan(**base, micro_batch_size=m)) for m in (1, 2, 4)]
            assert descending(micro[::-1]), micro


@pytest.mark.parametrize("gpu, per_node, nodes", HARDWARE)
@pytest.mark.parametrize("name", MODELS)
def test_host_memory_ignores_device_only_knobs_and_grows_with_offload(name, gpu, per_node, nodes):
    model = load_model_spec(name)
    hardware = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node, num_nodes=nodes)
    plan = _plans(model, hardware)

    def host(p):
        return estimate_memory(model, p, hardware).host_bytes_per_node

    for zero, combos in OFFLOADS.items():
        hosts = []
        for o, q in combos:
            values = {host(plan(zero_stage=zero, offload_optimizer=o, offload_params=q, checkpointing=c,
                                overlap_comm=ov, micro_batch_size=m))
                      for c in ("none", "full") for ov in (True, False) for m in (1, 4)}
            assert len(values) == 1, (zero, o, q, values)
            hosts.append(values.pop())
        assert hosts == sorted(hosts), (zero, hosts)


@pytest.mark.parametrize("gpu, per_node, nodes", HARDWARE)
@pytest.mark.parametrize("name", MODELS)
def test_activation_offload_never_shortens_a_step(name, gpu, per_node, nodes):
    model = load_model_spec(name)
    hardware = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node, num_nodes=nodes)
    plan = _plans(model, hardware)

    def step_s(p):
        return estimate_step_time(model, p, hardware).step_time_s

    for zero, combos in OFFLOADS.items():
        for o, q in combos:
            for ckpt in ("none", "2", "full"):
                for micro in (1, 4):
                    kept = plan(zero_stage=zero, offload_optimizer=o, offload_params=q, checkpointing=ckpt,
                                micro_batch_size=micro, grad_accum=2)
                    assert step_s(kept.with_(offload_activations="cpu")) >= step_s(kept), (zero, o, q, ckpt, micro)


@pytest.mark.parametrize("gpu, per_node, nodes", HARDWARE)
@pytest.mark.parametrize("name", MODELS)
def test_overlap_off_never_shortens_a_zero12_step(name, gpu, per_node, nodes):
    model = load_model_spec(name)
    hardware = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node, num_nodes=nodes)
    plan = _plans(model, hardware)

    def step_s(p):
        return estimate_step_time(model, p, hardware).step_time_s

    for zero in (1, 2):
        for o, q in OFFLOADS[zero]:
            for ckpt in ("none", "2", "full"):
                for micro in (1, 4):
                    for acts in ("none", "cpu"):
                        on = plan(zero_stage=zero, offload_optimizer=o, offload_params=q, checkpointing=ckpt,
                                  micro_batch_size=micro, grad_accum=2, offload_activations=acts, overlap_comm=True)
                        assert step_s(on.with_(overlap_comm=False)) >= step_s(on), (zero, o, ckpt, micro, acts)
