"""Real training steps of a small HF model on CPU, with the peak bytes of live tensors measured.

The measurement the memory estimator is tested against (issue #2): build the model from its
config inside a LiveTensorTracker, run `num_steps` optimizer steps of `plan.grad_accum`
micro-batches of random token ids, and record per phase (init, forward, backward,
optimizer_step, zero_grad) the peak live bytes of the LAST step (steady state: optimizer states
exist), what was live at that peak split into params / grads / optimizer / other (activations,
temporaries), and the bytes of params, grads and optimizer states measured from the objects.

Single process, plain PyTorch (TrainingPlan.engine == "torch", zero_stage 0). DeepSpeed runs
are in memkit.calibrate.deepspeed_step.
"""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan

PHASES = ("forward", "backward", "optimizer_step", "zero_grad")


def load_model_config(source) -> dict:
    """A model config dict from a dict or the path of an HF config.json (with 'model_type')."""
    if isinstance(source, dict):
        return dict(source)
    import json
    from pathlib import Path

    path = Path(source)
    if not path.is_file():
        raise MemkitError(f"model config {str(source)!r} is not a file; pass an HF config.json path")
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise MemkitError(f"model config {str(source)!r} is not valid JSON ({exc}); fix the file") from None


def build_config(model_config):
    """An HF PretrainedConfig from a dict (or config.json path) with 'model_type' and the config keys."""
    from memkit.spec.hf_config import build_hf_config

    return build_hf_config(load_model_config(model_config),
                           missing_type="model config has no 'model_type'; add e.g. \"model_type\": \"llama\"")


def build_model(model_config, plan: TrainingPlan, *, seed: int = 0,
                checkpoint_reentrant: bool = False, quantized_from=None):
    """Model as `plan` trains it: dtype, attention kernel, 4-bit base, checkpointing, LoRA. Seeded.
    `quantized_from`: a folder holding this model's fp32 checkpoint (fresh_checkpoint), loaded
    as the 4-bit base when the plan has one (memkit/train/quantize.py, the runner's code)."""
    import torch
    import transformers

    from memkit.estimate.traced import from_config
    from memkit.spec.hf_config import TASK_CLASSES, auto_class_for

    torch.manual_seed(seed)
    config = build_config(model_config)
    config.use_cache = False
    if plan.task != "causal-lm":
        config.num_labels = plan.num_labels
    dtype = torch.bfloat16 if plan.precision == "bf16-pure" else torch.float32
    # causal LM, else seq2seq (T5), else masked LM; or the plan's classification head
    auto_name = TASK_CLASSES.get(plan.task) or auto_class_for(config)
    auto = getattr(transformers, auto_name)
    if plan.is_quantized:
        from memkit.train.quantize import load_quantized, quantize_fresh

        model = (load_quantized(quantized_from, plan, config=config) if quantized_from is not None else
                 quantize_fresh(from_config(auto, config, plan.attention, dtype)[0], plan))
    else:
        model = from_config(auto, config, plan.attention, dtype)[0]  # eager where there is no SDPA path
    model.train()
    # The runner's code for checkpointing (all or the first K blocks) and the chunked loss (as the
    # bundle's Trainer recipe wraps the model: model(**batch).loss) -- memkit/train/techniques.py.
    from memkit.train.techniques import apply_checkpointing

    apply_checkpointing(model, plan.checkpointing, reentrant=checkpoint_reentrant)
    if plan.loss != "standard":
        from memkit.train.chunked_loss import chunked_causal_lm
        from memkit.train.techniques import refuse_on_cpu

        refuse_on_cpu(plan)
        model = chunked_causal_lm(model)
    if plan.is_lora:
        from peft import LoraConfig, get_peft_model

        from memkit.emit.trainer import lora_config

        # the runner's config (memkit/train/model.py apply_plan): a classifier's head is trained too
        model = get_peft_model(model, LoraConfig(**lora_config(plan, model_class=auto_name)))
    return model


def build_optimizer(params, plan: TrainingPlan, *, lr: float = 1e-4, foreach: bool = True):
    """The torch optimizer for plan.optimizer and the kwargs it was built with."""
    import torch

    if plan.optimizer == "adamw":
        # foreach=True: torch's default on CUDA (torch/optim/optimizer.py, _default_to_fused_or_foreach);
        # on CPU the default is the per-tensor loop, whose temporaries are one parameter at a time.
        kwargs = {"lr": lr, "weight_decay": 0.0, "foreach": foreach}
        return torch.optim.AdamW(params, **kwargs), {"name": "torch.optim.AdamW", **kwargs}
    if plan.optimizer == "sgd":
        kwargs = {"lr": lr, "momentum": 0.9, "foreach": foreach}
        return torch.optim.SGD(params, **kwargs), {"name": "torch.optim.SGD", **kwargs}
    if plan.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        kwargs = {"lr": lr, "scale_parameter": False, "relative_step": False, "warmup_init": False}
        return Adafactor(params, **kwargs), {"name": "transformers.optimization.Adafactor", **kwargs}
    if plan.optimizer == "adamw-8bit":  # bitsandbytes 0.50 runs its blockwise 8-bit AdamW on CPU
        import bitsandbytes as bnb

        kwargs = {"lr": lr, "weight_decay": 0.0}
        return bnb.optim.AdamW8bit(params, **kwargs), {"name": "bitsandbytes.optim.AdamW8bit", **kwargs}
    raise MemkitError(f"--optimizer {plan.optimizer!r} is not measurable on CPU; use adamw, adamw-8bit, "
                      "sgd or adafactor")


def random_batch(vocab_size: int, plan: TrainingPlan, generator, *, seq2seq: bool = False) -> dict:
    """Random ids and labels: the ids themselves for a language model (a seq2seq model's decoder takes
    plan.target_len of them where given), a class per sequence or per token for a classifier."""
    import torch

    from memkit.spec.hf_config import TASK_CLASSES, label_shape

    ids = torch.randint(0, vocab_size, (plan.micro_batch_size, plan.seq_len), generator=generator)
    if plan.task == "causal-lm" and not (seq2seq and plan.target_len):
        return {"input_ids": ids, "labels": ids}
    auto = TASK_CLASSES.get(plan.task) or "AutoModelForSeq2SeqLM"
    shape = label_shape(auto, plan.micro_batch_size, plan.seq_len, plan.target_len)
    high = plan.num_labels if plan.task != "causal-lm" else vocab_size
    return {"input_ids": ids, "labels": torch.randint(0, high, shape, generator=generator)}


def measure_training(model_config, plan: TrainingPlan, *, num_steps: int = 2, seed: int = 0,
                     lr: float = 1e-4, foreach: bool = True, checkpoint_reentrant: bool = False,
                     set_to_none: bool = True, seq_lens: list[int] | None = None) -> dict:
    """Run `num_steps` real optimizer steps under a LiveTensorTracker; return the measured figures.
    `seq_lens`: one sequence length per step (variable-length data; num_steps = len(seq_lens)).

    Precision: fp32; bf16 = autocast(bfloat16) with fp32 params (mixed); bf16-pure = params,
    grads and optimizer states in bfloat16. `set_to_none=False` zero-fills the gradients between
    steps, as torch < 2.0's default zero_grad() did (spec/stack.py).
    """
    import torch

    from memkit.measure.live_tensors import LiveTensorTracker
    from memkit.train.loss_paths import user_loss

    plan.validate()
    if plan.precision == "fp16":
        raise MemkitError("--precision fp16 is not measurable on CPU (no fp16 autocast); use bf16")
    if plan.zero_stage != 0 or plan.dp * plan.tp * plan.pp != 1:
        raise MemkitError("measure_training runs one process without ZeRO; use "
                          "memkit.calibrate.deepspeed_step for ZeRO / data parallel plans")
    if num_steps < 2:
        raise MemkitError(f"--steps {num_steps}: need >= 2 so the last step has optimizer states")

    if seq_lens:
        num_steps = len(seq_lens)
    generator = torch.Generator().manual_seed(seed + 1)
    folder = contextlib.ExitStack()
    quantized_from = fresh_checkpoint(model_config, plan, seed, folder) if plan.is_quantized else None
    moved_bytes = None
    autocast = (lambda: torch.autocast("cpu", dtype=torch.bfloat16)) if plan.precision == "bf16" \
        else contextlib.nullcontext
    boundary: dict[str, dict] = {}
    with LiveTensorTracker() as tracker:
        with tracker.phase("init"):
            model = build_model(model_config, plan, seed=seed, checkpoint_reentrant=checkpoint_reentrant,
                                quantized_from=quantized_from)
            params = [p for p in model.parameters()]
            trainable = [p for p in params if p.requires_grad]
            if plan.optimizer_in_backward:  # one optimizer per parameter, stepped in its grad hook
                from memkit.train.backward_techniques import OptimizerInBackward

                kwargs_box: list = []
                optimizer = OptimizerInBackward(trainable, lambda ps: _remember(
                    build_optimizer(ps, plan, lr=lr, foreach=foreach), kwargs_box))
                opt_kwargs = {**kwargs_box[0], "in_backward": True}
            else:
                optimizer, opt_kwargs = build_optimizer(trainable, plan, lr=lr, foreach=foreach)
        vocab_size = model.config.vocab_size
        tracker.tag(model.buffers(), "buffer")
        tracker.tag(params, "param")
        for step in range(num_steps):
            for _micro in range(plan.grad_accum):
                batch = random_batch(vocab_size, dataclasses.replace(plan, seq_len=seq_lens[step]) if seq_lens
                                     else plan, generator, seq2seq=bool(model.config.is_encoder_decoder))
                with tracker.phase(f"forward#{step}"):
                    # --offload-activations: saved tensors to a store the tracker does not see, as a
                    # GPU's counters would not see pinned host copies (train/backward_techniques.py).
                    with autocast(), _offload_context(model, plan) as offload:
                        loss, held = user_loss(model, batch, plan.loss_path)  # memkit/train/loss_paths.py
                        loss = loss / plan.grad_accum
                    if offload is not None:
                        moved_bytes = offload.moved_bytes
                with tracker.phase(f"backward#{step}"):
                    loss.backward()
                del loss, batch, held
                tracker.tag([p.grad for p in trainable if p.grad is not None], "grad")
            boundary["after_backward"] = _components(tracker, model, optimizer)
            with tracker.phase(f"optimizer_step#{step}"):
                optimizer.step()
            tracker.tag(list(_optimizer_tensors(optimizer)), "optimizer")
            boundary["after_step"] = _components(tracker, model, optimizer)
            with tracker.phase(f"zero_grad#{step}"):
                optimizer.zero_grad(set_to_none=set_to_none)
            boundary["after_zero_grad"] = _components(tracker, model, optimizer)
        del optimizer, model, params, trainable
    folder.close()

    last = num_steps - 1
    phases = {"init": _phase_summary(tracker, tracker.records("init"))}
    for name in PHASES:
        phases[name] = _phase_summary(tracker, tracker.records(f"{name}#{last}"))
    return {
        "peak_bytes": tracker.peak_bytes,
        "peak_breakdown": tracker.peak_breakdown(),
        "phases": phases,
        "boundary": boundary,
        "optimizer": opt_kwargs,
        "num_steps": num_steps,
        "checkpoint_reentrant": checkpoint_reentrant,
        **({"offloaded_bytes_per_micro_batch": moved_bytes} if moved_bytes is not None else {}),
    }


def fresh_checkpoint(model_config, plan: TrainingPlan, seed: int, stack: contextlib.ExitStack) -> str:
    """Save the seeded fp32 model to a temporary folder (removed when `stack` closes), before any
    tracker starts, so the measured run only loads it as a 4-bit base (bitsandbytes quantises
    while transformers loads a checkpoint)."""
    import tempfile

    folder = stack.enter_context(tempfile.TemporaryDirectory(prefix="memkit-qlora-"))
    build_model(model_config, plan.with_(quantize_base="none", lora_rank=0, checkpointing="none",
                                         loss="standard"), seed=seed).save_pretrained(folder)
    return folder


def _remember(built, box: list):
    box.append(built[1])
    return built[0]


@contextlib.contextmanager
def _offload_context(model, plan: TrainingPlan):
    """OffloadSavedTensors into a NumpyStore for --offload-activations cpu, else nothing."""
    if plan.offload_activations == "none":
        yield None
        return
    from memkit.train.backward_techniques import NumpyStore, OffloadSavedTensors

    with OffloadSavedTensors(list(model.parameters()), store=NumpyStore()) as hooks:
        yield hooks


def count_params(model_config, plan: TrainingPlan) -> dict:
    """Distinct parameter and trainable-parameter counts of the model `plan` trains (ties counted once)."""
    model = build_model(model_config, plan)
    seen: dict[int, Any] = {}
    for p in model.parameters():
        seen[id(p)] = p
    def numel(p):  # a 4-bit weight holds two elements per byte (bitsandbytes Params4bit)
        state = getattr(p, "quant_state", None) if type(p).__name__ == "Params4bit" else None
        return state.shape.numel() if state is not None else p.numel()

    return {"num_params": sum(numel(p) for p in seen.values()),
            "num_trainable_params": sum(p.numel() for p in seen.values() if p.requires_grad)}


def _optimizer_tensors(optimizer):
    import torch

    states = optimizer.state.values() if hasattr(optimizer, "state") else ()
    for state in states:
        for value in state.values():
            if isinstance(value, torch.Tensor):
                yield value


def _components(tracker, model, optimizer) -> dict:
    """Bytes of params, grads, optimizer states and buffers measured from the objects, and live bytes."""
    params = list(model.parameters())
    grads = [p.grad for p in params if p.grad is not None]
    params_bytes = tracker.bytes_of(params)
    grads_bytes = tracker.bytes_of(grads)
    states = list(_optimizer_tensors(optimizer))
    # 0-dim tensors are per-parameter step counters (torch.optim AdamW keeps `step` as a tensor).
    optimizer_bytes = tracker.bytes_of([t for t in states if t.dim() > 0])
    optimizer_scalar_bytes = tracker.bytes_of([t for t in states if t.dim() == 0])
    buffers_bytes = tracker.bytes_of(list(model.buffers()))
    live = tracker.live_bytes
    return {"live_bytes": live, "params_bytes": params_bytes, "grads_bytes": grads_bytes,
            "optimizer_bytes": optimizer_bytes, "optimizer_scalar_bytes": optimizer_scalar_bytes,
            "buffers_bytes": buffers_bytes,
            "other_bytes": live - params_bytes - grads_bytes - optimizer_bytes - optimizer_scalar_bytes
            - buffers_bytes}


def _phase_summary(tracker, records) -> dict:
    """Highest peak among `records` (e.g. the forwards of every micro-batch of one step)."""
    if not records:
        return {}
    top = max(records, key=lambda r: r.peak_bytes)
    return {"peak_bytes": top.peak_bytes, "start_live_bytes": records[0].start_live_bytes,
            "end_live_bytes": records[-1].end_live_bytes, "num_intervals": len(records),
            "peak_breakdown": tracker.live_at(top.peak_seq)}
