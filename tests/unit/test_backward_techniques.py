"""Activation offload and the optimizer in backward (memkit/plan/backward_techniques.py): the rules,
the estimator's formulas on hand-worked figures, and the runner's hooks against the plain run
(memkit/train/backward_techniques.py) on tiny models built from configs.

Measured here: the bytes OffloadSavedTensors' pack hook copies out are the estimator's offloaded
bytes within 5 % (llama 0.998, llama+full checkpointing 0.999, gpt2 1.022 on the benchmark configs);
gradients with the hook equal the plain run's exactly; the optimizer in backward gives the plain
run's parameters after 3 steps (SGD and AdamW; measured: identical)."""
from __future__ import annotations

import pytest
import torch

from memkit.errors import MemkitError
from memkit.estimate.backward_techniques import (IN_BACKWARD_OPS_PER_TENSOR, activation_offload_transfer_s,
                                                 largest_block_tensor, offloaded_activation_bytes)
from memkit.estimate.memory import estimate_memory
from memkit.estimate.throughput import OP_DISPATCH_S, _param_tensors, estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec, spec_from_config

LLAMA = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "vocab_size": 320}
TORCH = dict(engine="torch", precision="fp32", micro_batch_size=2, seq_len=64, gradient_clipping=0.0)
A100 = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=1)


# ---- rules -----------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, message", [
    ({"grad_accum": 2}, "cannot accumulate; use --grad-accum 1"),
    ({"gradient_clipping": 1.0}, "global norm needs every gradient"),
    ({"precision": "fp16"}, "loss scaler"),
    ({"engine": "deepspeed"}, "DeepSpeed/FSDP own the optimizer step"),
    ({"zero_stage": 3}, "DeepSpeed/FSDP own the optimizer step"),
    ({"dp": 2}, "DDP reduces gradients after"),
])
def test_optimizer_in_backward_refusals(changes, message):
    with pytest.raises(MemkitError, match=message):
        TrainingPlan(**{**TORCH, "optimizer_in_backward": True, **changes}).validate()


def test_activation_offload_refusals():
    with pytest.raises(MemkitError, match="is not one of none, cpu"):
        TrainingPlan(offload_activations="nvme").validate()
    with pytest.raises(MemkitError, match="split runs save their activations"):
        TrainingPlan(offload_activations="cpu", pp=2).validate()


# ---- estimator formulas ----------------------------------------------------------------------

def test_offload_moves_activations_to_host_ram_and_costs_pcie_twice():
    spec = load_model_spec("llama-3.2-1b")
    plan = TrainingPlan(precision="bf16", micro_batch_size=4, seq_len=2048, checkpointing="full", zero_stage=1, dp=2)
    hw = Hardware(gpu=find_gpu("a100-80gb"), num_gpus_per_node=2)
    off = plan.with_(offload_activations="cpu")
    moved = offloaded_activation_bytes(spec, off)
    # DeepSpeed bf16 runs the module in bf16 (no autocast copies). Full checkpointing keeps 16 block
    # inputs (4 x 2048 x 2048 x 2 B = 32 MiB each), the head's fp32 log-probs (8192 x 128256 x 4 B)
    # and the int64 ids (8192 x 8 B); the final norm and the head save a few more 8192 x 2048 tensors.
    tokens = 4 * 2048
    floor = 16 * tokens * 2048 * 2 + tokens * 128256 * 4 + tokens * 8
    assert floor < moved < floor + 5 * tokens * 2048 * 2
    base, est = estimate_memory(spec, plan, hw), estimate_memory(spec, off, hw)
    assert est.host_bytes_per_node - base.host_bytes_per_node == 2 * moved  # two local ranks
    assert est.components.get("activations", 0) < base.components["activations"]
    # PCIe: out in forward, back in backward, at the GPU's host link (A100: pcie_gbps), not overlapped.
    pcie = hw.gpu.pcie_gbps
    assert activation_offload_transfer_s(spec, off, pcie) == pytest.approx(2 * moved / (pcie * 1e9))
    t0, t1 = estimate_step_time(spec, plan, hw), estimate_step_time(spec, off, hw)
    assert t1.components_s["offload_transfer"] - t0.components_s["offload_transfer"] == pytest.approx(
        2 * moved / (pcie * 1e9))
    assert offloaded_activation_bytes(spec, plan) == 0


def test_optimizer_in_backward_keeps_one_block_tensor_and_the_tied_head_gradient():
    spec = load_model_spec("llama-3.2-1b")  # tied embeddings; MLP gate/up 2048 x 8192 the largest block tensor
    plan = TrainingPlan(**{**TORCH, "seq_len": 2048, "micro_batch_size": 1}, checkpointing="full", loss="chunked")
    inbwd = plan.with_(optimizer_in_backward=True)
    assert largest_block_tensor(spec, inbwd) == 2048 * 8192
    base, est = estimate_memory(spec, plan, A100), estimate_memory(spec, inbwd, A100)
    assert base.components["gradients"] == spec.num_params * 4
    # backward peak: one 2048 x 8192 fp32 gradient (its AdamW sqrt temporary is in the temporaries)
    # + the tied 128256 x 2048 head gradient held until the embedding's backward.
    assert est.components["gradients"] == 2048 * 8192 * 4 + 128256 * 2048 * 4
    assert est.components["optimizer_states"] == base.components["optimizer_states"]
    assert est.allocated_peak_bytes < base.allocated_peak_bytes
    # LoRA: the largest adapter matrix (r x max(in, out) of the targeted q/v projections).
    lora = inbwd.with_(lora_rank=8, lora_targets=("q_proj", "v_proj"))
    assert largest_block_tensor(spec, lora) == 8 * 2048


def test_optimizer_in_backward_step_time_is_one_step_call_per_tensor():
    spec = load_model_spec("llama-3.2-1b")
    plan = TrainingPlan(**{**TORCH, "seq_len": 2048, "micro_batch_size": 1})
    t0 = estimate_step_time(spec, plan, A100)
    t1 = estimate_step_time(spec, plan.with_(optimizer_in_backward=True), A100)
    dispatch = _param_tensors(spec, plan) * IN_BACKWARD_OPS_PER_TENSOR["adamw"] * OP_DISPATCH_S
    assert t1.components_s["optimizer_step"] == pytest.approx(max(t0.components_s["optimizer_step"], dispatch))
    assert t1.step_time_s - t0.step_time_s < 0.05 * t0.step_time_s  # ~free next to the step


# ---- the runner's hooks on tiny models ---------------------------------------------------------

def _model(config, plan, seed=0):
    from memkit.calibrate.cpu_step import build_model

    return build_model(config, plan, seed=seed)


def _batch(plan):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 320, (plan.micro_batch_size, plan.seq_len), generator=g)
    return {"input_ids": ids, "labels": ids}


@pytest.mark.parametrize("config, changes", [(LLAMA, {}), (LLAMA, {"checkpointing": "full"}), (GPT2, {})],
                         ids=["llama", "llama-ckpt", "gpt2"])
def test_offload_hook_moves_the_estimated_bytes_and_keeps_gradients(config, changes):
    from memkit.train.backward_techniques import NumpyStore, OffloadSavedTensors

    plan = TrainingPlan(**TORCH, offload_activations="cpu", **changes)
    grads = []
    for offload in (False, True):
        model = _model(config, plan)
        hooks = OffloadSavedTensors(list(model.parameters()), store=NumpyStore())
        with hooks if offload else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            loss = model(**_batch(plan)).loss
        loss.backward()
        grads.append([p.grad for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    spec = spec_from_config(dict(config), name=config["model_type"])
    assert hooks.moved_bytes == pytest.approx(offloaded_activation_bytes(spec, plan, device="cpu"), rel=0.05)


def test_offload_on_cpu_without_a_store_moves_nothing():
    """As save_on_cpu: a CPU tensor's .cpu() is itself; the runner's hook keeps CPU tensors."""
    from memkit.train.backward_techniques import OffloadSavedTensors

    plan = TrainingPlan(**TORCH, offload_activations="cpu")
    model = _model(LLAMA, plan)
    with OffloadSavedTensors(list(model.parameters())) as hooks:
        model(**_batch(plan)).loss.backward()
    assert hooks.num_saved > 0 and hooks.moved_bytes == 0


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_optimizer_in_backward_equals_the_plain_step(optimizer):
    from memkit.calibrate.cpu_step import build_optimizer
    from memkit.train.backward_techniques import OptimizerInBackward

    plan = TrainingPlan(**TORCH, optimizer=optimizer)
    finals = []
    for in_backward in (False, True):
        model = _model(LLAMA, plan)
        params = [p for p in model.parameters() if p.requires_grad]
        if in_backward:
            opt = OptimizerInBackward(params, lambda ps: build_optimizer(ps, plan, lr=1e-2)[0])
        else:
            opt = build_optimizer(params, plan, lr=1e-2)[0]
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            ids = torch.randint(0, 320, (2, 64), generator=g)
            model(input_ids=ids, labels=ids).loss.backward()
            if in_backward:
                assert all(p.grad is None for p in params)  # every gradient freed by its hook
            opt.step()
            opt.zero_grad(set_to_none=True)
        finals.append([p.detach().clone() for p in params])
        if in_backward:
            assert len(opt.param_groups) == len(params)
            state = opt.state_dict()
            opt.load_state_dict(state)
    for a, b in zip(*finals):
        assert torch.allclose(a, b, rtol=1e-6, atol=0)


# ---- the emitted paths -------------------------------------------------------------------------

def test_trainer_model_code_offloads_and_keeps_the_loss_and_gradients():
    """The bundle's Trainer model code for --offload-activations cpu, run as printed (with copies
    forced through a store, as a GPU would copy): same loss and gradients as the plain model."""
    from memkit.emit.trainer import model_code
    from memkit.train import backward_techniques

    plan = TrainingPlan(**TORCH, offload_activations="cpu", loss="chunked")
    code = model_code(plan)
    assert code[-1].startswith("model = offload_activations(model)")
    results = []
    for offload in (False, True):
        model = _model(LLAMA, plan)
        from memkit.train.chunked_loss import chunked_causal_lm

        model = chunked_causal_lm(model)
        if offload:
            hooks = []
            original = backward_techniques.OffloadSavedTensors

            def counting(params, store=None):
                hooks.append(original(params, store=backward_techniques.NumpyStore()))
                return hooks[-1]
            backward_techniques.OffloadSavedTensors = counting
            try:
                scope = {"model": model}
                exec("\n".join(code[-2:]), scope)
                model = scope["model"]
                loss = model(**_batch(plan)).loss
            finally:
                backward_techniques.OffloadSavedTensors = original
            assert hooks and hooks[0].moved_bytes > 0
        else:
            loss = model(**_batch(plan)).loss
        loss.backward()
        results.append((loss.detach(), [p.grad for p in model.parameters()]))
    (l0, g0), (l1, g1) = results
    assert torch.equal(l0, l1)
    assert all(torch.equal(a, b) for a, b in zip(g0, g1))


def test_trainer_path_refuses_the_optimizer_in_backward(tmp_path):
    from memkit import api
    from memkit.emit.bundle import backward_paragraphs

    plan = TrainingPlan(**TORCH, optimizer_in_backward=True)
    with pytest.raises(MemkitError, match="HF Trainer cannot run"):
        api.training_arguments(plan, output_dir=str(tmp_path))
    text = " ".join(backward_paragraphs(plan.to_dict()))
    assert "Trainer has no flag for it" in text and "register_post_accumulate_grad_hook" in text
