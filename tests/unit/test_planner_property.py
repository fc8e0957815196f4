"""Property test over random requests: whatever the planner answers is arithmetic-exact and within
budget, and whenever it refuses it says why (batch arithmetic, exit 2) or gives near misses (exit 3)."""
from __future__ import annotations

import pytest

from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from memkit.emit.deepspeed import deepspeed_config
from memkit.errors import MemkitError
from memkit.estimate.memory import estimate_memory
from memkit.planner import NoPlanFits, Request, search
from memkit.planner.search import UPPER_BOUND_FALLBACK_NOTE
from memkit.planner.space import pins
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.plan.parallel import validate_parallel
from memkit.units import GIB

MODELS = ["qwen2.5-0.5b", "llama-3.2-1b", "gemma-2-2b", "llama-3.1-8b", "phi-2", "opt-1.3b", "qwen2.5-14b"]
GPUS = ["t4", "rtx-4090", "a10g", "l40s", "a100-40gb", "a100-80gb", "h100-80gb", "v100-32gb"]


@st.composite
def requests(draw):
    model = load_model_spec(draw(st.sampled_from(MODELS)))
    gpu = find_gpu(draw(st.sampled_from(GPUS)))
    hardware = Hardware(gpu=gpu, num_gpus_per_node=draw(st.sampled_from([1, 2, 4, 8])),
                        num_nodes=draw(st.sampled_from([1, 1, 2])),
                        host_ram_bytes_per_node=draw(st.sampled_from([64, 256, 1024])) * GIB)
    seq = draw(st.sampled_from([256, 512, 1024, 2048]))
    lora = draw(st.sampled_from([0, 0, 16]))
    return Request(
        model=model, hardware=hardware, seq_len=min(seq, model.max_position_embeddings),
        # Mostly multiples of the GPU count (what users ask for), sometimes anything.
        global_batch_size=draw(st.one_of(
            st.integers(min_value=1, max_value=32).map(lambda k: k * hardware.num_gpus),
            st.integers(min_value=1, max_value=32).map(lambda k: k * hardware.num_gpus),
            st.integers(min_value=1, max_value=256))),
        headroom=draw(st.sampled_from([0.0, 0.05, 0.1, 0.25])),
        objective=draw(st.sampled_from(["throughput", "throughput", "memory"])),
        lora_rank=lora,
        zero_stage=draw(st.sampled_from([None, None, None, 1, 3])),
        allow_offload=draw(st.booleans()),
        max_micro_batch=draw(st.sampled_from([None, None, 2])),
        tp=1 if lora else draw(st.sampled_from([1, 1, None])),
        split=draw(st.sampled_from(["if-needed", "if-needed", "auto"])),
    )


@pytest.mark.slow  # 60 searches (~5.5 min on 2 busy cores)
@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(requests())
def test_every_answer_is_exact_and_within_budget(req):
    try:
        result = search(req)
    except NoPlanFits as exc:
        event("no plan fits")
        assert exc.exit_code == 3
        for miss in exc.misses:
            est = estimate_memory(req.model, miss.plan, req.hardware)
            assert (est.nvidia_smi_peak_bytes > req.budget_bytes
                    or est.nvidia_smi_peak_upper_bytes > req.hardware.gpu.memory_bytes
                    or est.host_bytes_per_node > req.hardware.host_ram_bytes_per_node)
        return
    except MemkitError as exc:
        # The only bad input these requests can contain: a global batch no layout divides, or pins
        # (--zero, --max-micro-batch, --tp, --no-offload, --lora-rank) no plan shape honours with that
        # batch; the refusal names every pin (#28: a pinned choice is never silently overridden).
        assert exc.exit_code == 2
        if "cannot be met exactly" in str(exc):
            event("batch cannot be met")
            return
        event("pins cannot be met")
        assert "no plan shape honours the pins" in str(exc), str(exc)
        for flag, _, _ in pins(req):
            assert flag in str(exc), (flag, str(exc))
        return
    event(f"chosen ({result.chosen.tier} tier)")
    for cand in (result.chosen, *result.alternatives):
        plan = cand.plan
        assert plan.micro_batch_size * plan.grad_accum * plan.dp == req.global_batch_size
        assert plan.dp * plan.tp * plan.pp == req.hardware.num_gpus
        est = estimate_memory(req.model, plan, req.hardware)
        assert est.nvidia_smi_peak_bytes <= req.budget_bytes
        assert (est.nvidia_smi_peak_upper_bytes <= req.hardware.gpu.memory_bytes
                or UPPER_BOUND_FALLBACK_NOTE in result.notes)
        assert est.host_bytes_per_node <= req.hardware.host_ram_bytes_per_node
        if req.zero_stage is not None:
            assert plan.zero_stage == req.zero_stage
        if not req.allow_offload:
            assert plan.offload_optimizer == plan.offload_params == "none"
        if req.max_micro_batch:
            assert plan.micro_batch_size <= req.max_micro_batch
        assert plan.lora_rank == req.lora_rank
        for flag, field_name, value in pins(req):  # the chosen plan and every alternative honour each pin
            got = getattr(plan, field_name)
            assert got <= value if field_name == "micro_batch_size" else got == value, (flag, got)
        assert plan.precision != "bf16" or req.hardware.gpu.bf16
        assert not (plan.tp > 1 and plan.pp > 1)
        if plan.tp > 1 or plan.pp > 1:
            validate_parallel(req.model, plan, req.hardware)  # the runner can run what is offered
        if plan.pp > 1:  # torch.distributed.pipelining: no DeepSpeed file, >= pp micro-batches
            assert plan.engine == "torch" and plan.zero_stage == 0 and plan.grad_accum >= plan.pp
            continue
        if plan.is_quantized:  # a 4-bit base: plain PyTorch / DDP, no DeepSpeed file (memkit/plan/quantize.py)
            assert plan.engine == "torch" and plan.zero_stage == 0 and plan.lora_rank > 0
            assert plan.offload_optimizer == plan.offload_params == "none"
            continue
        ds = deepspeed_config(plan)
        # DeepSpeed counts every process in its batch check (AutoTP: dp x tp of them).
        assert ds["train_batch_size"] == req.global_batch_size * plan.tp
        per_rank = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"]
        assert per_rank * plan.dp == req.global_batch_size
