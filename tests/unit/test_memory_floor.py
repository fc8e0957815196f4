"""estimate/memory.py peak_floor_bytes is a lower bound of the exact estimate's nvidia-smi peak:
the planner rejects a plan whose floor is over its budget without replaying the allocator
(planner/search.py _Evaluator.fails), so a floor above the exact peak would drop a plan that fits.
Checked on the plans the planner itself searches (every tier and layout of several requests:
ZeRO stages, offloads, checkpointing, the chunked loss, activation offload, tp / pp, LoRA, a
4-bit base), each at micro-batch 1 and a larger one and with partial checkpointing, plus the
knobs only a pin reaches (selective checkpointing, plain PyTorch, the optimizer in backward,
eager attention, the CPU device)."""
from __future__ import annotations

import pytest

from memkit.errors import MemkitError
from memkit.estimate.memory import estimate_memory, peak_floor_bytes
from memkit.plan.plan import TrainingPlan
from memkit.planner.space import Request, layouts, structures, tiers, with_micro
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.units import GIB

REQUESTS = [  # (model, gpu, GPUs per node, nodes, global batch, seq len, extra request fields)
    ("llama-3.2-1b", "rtx-4090", 2, 1, 16, 1024, {}),
    ("gpt2", "a100-80gb", 8, 1, 32, 1024, {}),  # tp and pp layouts too
    ("qwen2.5-0.5b", "a100-40gb", 4, 1, 16, 2048, {"lora_rank": 16, "allow": ("qlora",)}),
    ("t5-small", "t4", 1, 1, 8, 512, {}),
]
STRIDE = 2
"""Every other searched structure (the order alternates the knobs: each kind is still present)."""


def _grid(name, gpu, per_node, nodes, batch, seq, extra):
    model = load_model_spec(name)
    hardware = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node, num_nodes=nodes,
                        host_ram_bytes_per_node=512 * GIB)
    request = Request(model=model, hardware=hardware, global_batch_size=batch, seq_len=seq, **extra)
    plans = []
    for tier in tiers(request):
        for lay in layouts(request):
            for s in structures(request, tier, lay)[::STRIDE]:
                per_rank = s.micro_batch_size * s.grad_accum
                plans.append(s)
                if per_rank // max(1, s.pp) >= 4 and not s.optimizer_in_backward:
                    plans.append(with_micro(s, 4))
                if s.checkpointing == "full" and s.pp == 1:
                    plans.append(s.with_(checkpointing=str(max(1, model.total_layers // 2))))
    return model, hardware, plans


@pytest.mark.parametrize("case", REQUESTS, ids=[r[0] for r in REQUESTS])
def test_floor_is_below_the_exact_peak_on_the_searched_plans(case):
    model, hardware, plans = _grid(*case)
    assert len(plans) > 20
    checked = 0
    for plan in plans:
        try:
            exact = estimate_memory(model, plan, hardware).nvidia_smi_peak_bytes
        except MemkitError:
            with pytest.raises(MemkitError):
                peak_floor_bytes(model, plan, hardware)
            continue
        floor = peak_floor_bytes(model, plan, hardware)
        assert 0 < floor <= exact, (plan, floor, exact)
        checked += 1
    assert checked > 20


PINNED_ONLY = [
    dict(checkpointing="selective"),
    dict(engine="torch", zero_stage=0),
    dict(engine="torch", zero_stage=0, optimizer_in_backward=True, gradient_clipping=0.0, dp=1, grad_accum=1),
    dict(attention="eager", micro_batch_size=2),
    dict(precision="fp32", zero_stage=2, offload_optimizer="cpu"),
    dict(precision="bf16-pure", zero_stage=3, optimizer="adafactor"),
    dict(zero_stage=3, offload_optimizer="nvme", offload_params="nvme"),
    dict(loss="chunked", offload_activations="cpu", checkpointing="full"),
]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("knobs", PINNED_ONLY, ids=[",".join(f"{k}={v}" for k, v in d.items()) for d in PINNED_ONLY])
def test_floor_is_below_the_exact_peak_for_pinned_knobs(knobs, device):
    model = load_model_spec("llama-3.2-1b")
    plan = TrainingPlan(**{"precision": "bf16", "dp": 2, "seq_len": 1024, "grad_accum": 2, **knobs})
    hardware = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=plan.dp, num_nodes=1)
    exact = estimate_memory(model, plan, hardware, device=device).nvidia_smi_peak_bytes
    floor = peak_floor_bytes(model, plan, hardware, device=device)
    assert 0 < floor <= exact
