"""The user's stack: version parsing, and the two transformers causal-LM loss paths priced with the
bytes each one allocates, measured on CPU (the pre-4.46 path reproduced here as its models wrote it)."""
from __future__ import annotations

import pytest

from memkit.errors import MemkitError
from memkit.spec.stack import Stack, behaviour, installed, parse_stack

torch = pytest.importorskip("torch")


def test_parse_and_installed():
    here = installed()
    assert here.torch and here.transformers  # both are installed in this environment
    s = parse_stack("transformers=4.40, deepspeed=0.14")
    assert (s.transformers, s.deepspeed, s.torch) == ("4.40", "0.14", here.torch)
    assert s.key().startswith("torch=")
    with pytest.raises(MemkitError, match="NAME=VERSION"):
        parse_stack("transformers")
    with pytest.raises(MemkitError, match="NAME=VERSION"):
        parse_stack("jax=0.4")


def test_behaviour_by_version():
    assert behaviour(Stack(transformers="4.45.2")).shifted_logits_copy
    assert not behaviour(Stack(transformers="4.46.0")).shifted_logits_copy
    assert behaviour(Stack(torch="1.12.1")).eager_module_loading
    assert not behaviour(Stack(torch="2.1.0+cu121")).eager_module_loading
    unknown = behaviour(Stack(transformers="main"))
    assert not unknown.shifted_logits_copy and any("not understood" in n for n in unknown.notes)


def _loss_peak(path: str, b: int, s: int, vocab: int) -> int:
    """Peak live bytes above the bf16 logits while the loss's forward runs (memkit's forward
    phase; the backward's peak is priced by the head's backward term, the same for both paths)."""
    import torch.nn.functional as F

    from memkit.measure.live_tensors import LiveTensorTracker
    from transformers.loss.loss_utils import ForCausalLMLoss

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(b, s, vocab, generator=g).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, vocab, (b, s), generator=g)
    with LiveTensorTracker() as tracker:
        base = tracker.live_bytes
        if path == "new":  # transformers >= 4.46 (installed): model.loss_function
            loss = ForCausalLMLoss(logits, labels, vocab_size=vocab)
        else:  # transformers 4.40 LlamaForCausalLM.forward
            logits32 = logits.float()
            shift_logits = logits32[..., :-1, :].contiguous()
            shift_labels = labels[..., 1:].contiguous()
            loss = F.cross_entropy(shift_logits.view(-1, vocab), shift_labels.view(-1))
            del logits32, shift_logits
        peak = tracker.peak_bytes - base
        loss.backward()
        return peak


def test_two_loss_paths_priced_as_measured():
    from memkit.estimate.memory import estimate_memory
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    b, s, vocab = 2, 64, 4096
    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 1,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": vocab,
           "max_position_embeddings": 256, "tie_word_embeddings": False}
    spec = spec_from_config(cfg, name="tiny")
    plan = TrainingPlan(precision="bf16-pure", engine="torch", micro_batch_size=b, seq_len=s, attention="sdpa")
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    new = estimate_memory(spec, plan, hw, device="cpu", stack=Stack(transformers="4.46"))
    old = estimate_memory(spec, plan, hw, device="cpu", stack=Stack(transformers="4.40"))
    priced = old.phases["forward"] - new.phases["forward"]
    measured = _loss_peak("old", b, s, vocab) - _loss_peak("new", b, s, vocab)
    assert priced == b * (s - 1) * vocab * 4  # the shifted fp32 copy
    assert abs(priced - measured) <= 0.05 * measured, (priced, measured)
    assert any("4.46" in n for n in old.notes)


def test_torch1_adamw_loop_priced_as_measured_with_foreach_off():
    """torch < 2.0 AdamW loops over parameters: the step peak holds one parameter's temporary,
    not the foreach one as large as all of them (measured here with foreach=False)."""
    from memkit.estimate.memory import estimate_memory
    from memkit.calibrate.cpu_step import measure_training
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
           "max_position_embeddings": 256, "tie_word_embeddings": False}
    plan = TrainingPlan(precision="fp32", engine="torch", micro_batch_size=1, seq_len=16, attention="sdpa")
    spec = spec_from_config(cfg, name="tiny")
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    loop = measure_training(cfg, plan, num_steps=2, foreach=False)["phases"]["optimizer_step"]["peak_bytes"]
    fused = measure_training(cfg, plan, num_steps=2, foreach=True)["phases"]["optimizer_step"]["peak_bytes"]
    old = estimate_memory(spec, plan, hw, device="cpu", stack=Stack(torch="1.13")).phases["optimizer_step"]
    new = estimate_memory(spec, plan, hw, device="cpu", stack=Stack(torch="2.4")).phases["optimizer_step"]
    assert fused > 1.1 * loop  # the foreach temporary is visible at this size
    assert abs(old - loop) <= 0.05 * loop, (old, loop)
    assert abs(new - fused) <= 0.05 * fused, (new, fused)
    assert not behaviour(Stack(torch="1.13.1")).foreach_optimizer and behaviour(Stack(torch="2.0")).foreach_optimizer


def test_suggest_prices_and_records_the_stack(tmp_path):
    """`suggest --stack torch=1.12` plans with that stack's behaviours (eager CUDA kernel loading:
    the context grows by EAGER_KERNEL_IMAGES_BYTES) and writes the stack into plan.json."""
    import json

    from memkit.cli.main import main
    from memkit.spec.stack import EAGER_KERNEL_IMAGES_BYTES

    docs = {}
    for name, extra in (("now", []), ("old", ["--stack", "torch=1.12"])):
        out = tmp_path / name
        args = ["suggest", "--model", "llama-3.2-1b", "--gpu", "a100-80gb", "--num-gpus", "1",
                "--global-batch-size", "8", "--seq-len", "512", "--precision", "bf16", "--zero", "0",
                "--checkpointing", "none", "--loss", "standard", "--max-micro-batch", "8", "--out", str(out)]
        assert main(args + extra) == 0
        docs[name] = json.loads((out / "plan.json").read_text())
    assert "stack" not in docs["now"]
    assert docs["old"]["stack"]["torch"] == "1.12"
    assert docs["old"]["plan"] == docs["now"]["plan"]
    grow = docs["old"]["estimate"]["nvidia_smi_peak_bytes"] - docs["now"]["estimate"]["nvidia_smi_peak_bytes"]
    assert grow == EAGER_KERNEL_IMAGES_BYTES


def test_torch1_zero_grad_keeps_gradients_priced_as_measured():
    """torch < 2.0 zero_grad() zero-fills: the next forward runs with every gradient live. Measured
    on CPU with set_to_none False and True, against the estimate for torch 1.13 and 2.4."""
    from memkit.estimate.memory import estimate_memory
    from memkit.calibrate.cpu_step import measure_training
    from memkit.plan.plan import TrainingPlan
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config

    cfg = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256,
           "max_position_embeddings": 256, "tie_word_embeddings": False}
    plan = TrainingPlan(precision="fp32", engine="torch", micro_batch_size=2, seq_len=32, attention="sdpa")
    spec = spec_from_config(cfg, name="tiny")
    hw = Hardware(gpu=find_gpu("a100-80gb"))
    kept = measure_training(cfg, plan, num_steps=2, set_to_none=False)["phases"]["forward"]["peak_bytes"]
    freed = measure_training(cfg, plan, num_steps=2, set_to_none=True)["phases"]["forward"]["peak_bytes"]
    old = estimate_memory(spec, plan, hw, device="cpu", stack=Stack(torch="1.13")).phases["forward"]
    new = estimate_memory(spec, plan, hw, device="cpu", stack=Stack(torch="2.4")).phases["forward"]
    grads = spec.num_params * 4
    assert abs((kept - freed) - grads) <= 0.02 * grads  # the measurement shows the whole gradient set
    assert abs(old - kept) <= 0.05 * kept, (old, kept)
    assert abs(new - freed) <= 0.05 * freed, (new, freed)
    # the Trainer of transformers >= 4.27 passes set_to_none=True on any torch
    assert not behaviour(Stack(torch="1.13", transformers="4.30")).grads_kept_between_steps
    assert behaviour(Stack(torch="1.13", transformers="4.26")).grads_kept_between_steps
