"""Techniques own their memory terms (estimate/stage_terms.py): each sets what the phase walk
(estimate/memory.py) adds up. Figures are checked against the functions that price them."""
from __future__ import annotations

import pytest

from memkit.estimate.activations import block_activations, numerics
from memkit.estimate.backward_techniques import autocast_copy_bytes
from memkit.estimate.memory import estimate_memory, rank_params
from memkit.estimate.quantized import dequantized_weight_bytes
from memkit.estimate.stage_terms import TECHNIQUES, StageContext, stage_terms
from memkit.estimate.states import model_states
from memkit.estimate.techniques import selective_kept_bytes
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.spec.stack import behaviour

SPEC = load_model_spec("llama-3.2-1b")
HW = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1)
BASE = dict(engine="torch", micro_batch_size=2, seq_len=512, gradient_clipping=0.0)


def terms(**knobs):
    plan = TrainingPlan(**{**BASE, **knobs}).validate()
    rp = rank_params(SPEC, plan)
    c = StageContext(model=SPEC, plan=plan, hardware=HW, stage=0, device="cuda", habits=behaviour(None), rp=rp,
                     num=numerics(plan), first=True, last=True, n_layers=SPEC.total_layers,
                     blk=block_activations(SPEC, plan, device="cuda"))
    return (c, *stage_terms(c, model_states(plan, rp, device="cuda")))


def test_a_plan_without_techniques_keeps_everything_on_the_gpu():
    c, t, notes = terms(precision="fp32")
    assert (t.k_ckpt, t.amp_cache, t.autocast_copy, t.dequant, t.in_flight) == (0, 0, 0, 0, 1)
    assert t.kept_on_gpu and t.offloaded_block is None and t.loss_work
    assert notes == []


@pytest.mark.parametrize("checkpointing, blocks", [("full", SPEC.total_layers), ("3", 3)])
def test_checkpointing_keeps_the_inputs_of_its_blocks(checkpointing, blocks):
    c, t, _ = terms(precision="bf16", checkpointing=checkpointing)
    assert (t.k_ckpt, t.ckpt_kept) == (blocks, c.blk.input_bytes)
    assert t.amp_cache == autocast_copy_bytes(SPEC, c.plan) * blocks  # autocast's cache of those blocks


def test_selective_checkpointing_keeps_its_matmul_outputs_too():
    c, t, _ = terms(checkpointing="selective")
    assert t.ckpt_kept == c.blk.input_bytes + selective_kept_bytes(SPEC, c.plan) > c.blk.input_bytes


def test_activation_offload_and_the_optimizer_in_backward_set_their_terms_and_notes():
    c, t, notes = terms(precision="fp32", offload_activations="cpu", optimizer_in_backward=True)
    assert not t.kept_on_gpu and t.offloaded_block == c.blk.offloaded_backward_bytes
    assert (t.fwd_grads, t.landing) == (0, t.st.step_transient)
    assert [n.split(":")[0] for n in notes] == ["activation offload", "optimizer in backward"]


def test_qlora_casts_nothing_but_its_adapters():
    c, t, notes = terms(precision="bf16", lora_rank=8, quantize_base="nf4")
    adapters = c.num.autocast * SPEC.lora_params(8, c.plan.lora_targets) // SPEC.total_layers
    assert (t.autocast_copy, t.cached_copy) == (adapters, adapters)
    assert t.dequant == dequantized_weight_bytes(SPEC, c.plan) > 0
    assert set(t.quantized) and t.st.weights == 0 or t.st.weights < SPEC.num_params  # the 4-bit base is apart
    assert notes[0].startswith("nf4 base (bitsandbytes 4-bit")


def test_the_estimate_prices_the_terms():
    # the walk's forward holds every block's saved activations when nothing is checkpointed,
    # only the inputs under full checkpointing
    plan = TrainingPlan(**BASE, precision="fp32")
    plain = estimate_memory(SPEC, plan, HW)
    ckpt = estimate_memory(SPEC, plan.with_(checkpointing="full"), HW)
    c, t, _ = terms(precision="fp32")
    assert plain.phases["forward"] - ckpt.phases["forward"] == \
        SPEC.total_layers * (c.blk.saved_bytes - c.blk.input_bytes)
    assert len({type(tech) for tech in TECHNIQUES}) == len(TECHNIQUES) == 10
