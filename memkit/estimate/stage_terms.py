"""What each technique adds to one pipeline stage's memory, through one small interface.

The phase walk (estimate/memory.py) prices a stage from a `Terms`: per-block saved bytes and
autocast copies, which blocks are checkpointed, what the loss saves, where gradients land, what
stays on the GPU. Each technique is a `Technique` that fills in its own terms -- `states` (model
states, before anything else), `terms` (everything the walk reads) and `note` (the line the
estimate prints when the technique shapes it) -- and `stage_terms` runs them in TECHNIQUES'
order, each reading what the earlier ones set. The walk itself asks no plan which techniques it
uses. Where each byte count comes from is cited in the module that computes it (techniques.py,
backward_techniques.py, quantized.py, pipeline.py, states.py); memkit/ARCHITECTURE.md,
"Techniques own their terms".
"""
from __future__ import annotations

from dataclasses import dataclass, field

from memkit.estimate.activations import BlockActivations, HeadActivations, Numerics, head_weight_elements
from memkit.estimate.backward_techniques import (autocast_copy_bytes, largest_autocast_copy_bytes,
                                                 offloaded_activation_bytes, offloaded_loss_backward_saved,
                                                 offloads_activations, one_gradient_states)
from memkit.estimate.pipeline import StageBuffers, stage_buffers, stage_logits_bytes
from memkit.estimate.quantized import base_bytes, dequantized_weight_bytes
from memkit.estimate.states import RankParams, States
from memkit.estimate.techniques import loss_activations, loss_component, selective_kept_bytes
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware
from memkit.spec.model import ModelSpec
from memkit.spec.stack import StackBehaviour
from memkit.plan.techniques import checkpointed_blocks
from memkit.units import GIB


@dataclass(frozen=True, slots=True, kw_only=True)
class StageContext:
    """What one stage is, before any technique: the model, plan and hardware, the rank's
    parameters, the numerics, and the mean block's activations."""

    model: ModelSpec
    plan: TrainingPlan
    hardware: Hardware
    stage: int
    device: str
    habits: StackBehaviour
    rp: RankParams
    num: Numerics
    first: bool
    last: bool
    n_layers: int
    blk: BlockActivations


@dataclass(slots=True)
class Terms:
    """The terms the phase walk adds up; the techniques set them (the defaults are a plan that
    uses none). Bytes per micro-batch unless said otherwise."""

    st: States
    quantized: dict[str, int] = field(default_factory=dict)
    """Components of a quantized base beside the weights (weights_4bit, quant_state)."""
    autocast_copy: int = 0
    """Per block: autocast's low-precision weight copies the block's matmuls save for backward."""
    cached_copy: int = 0
    """Per block: what autocast's weight cache holds from the forward on (only leaves that require grad)."""
    head_copy: int = 0
    """The LM head weight's autocast copy the standard loss saves."""
    in_flight: int = 1
    """Micro-batches whose activations the stage holds at once."""
    accum_full: bool = False
    """Every gradient is held from the forward on (accumulation, or zero_grad keeping them)."""
    pipe: StageBuffers | None = None
    """torch.distributed.pipelining's buffers (estimate/pipeline.py)."""
    logits_bytes: int = 0
    """One micro-batch's logits as a pipeline stage sends them."""
    k_ckpt: int = 0
    """Blocks (the first k) that keep only their inputs and recompute in backward."""
    ckpt_kept: int = 0
    """What a checkpointed block keeps."""
    amp_cache: int = 0
    """Autocast's cached copies live at the end of the forward (all blocks)."""
    fwd_grads: int = 0
    """Gradients live in the forward of a steady-state micro-batch."""
    first_fwd_grads: int = 0
    """... of the run's first micro-batch, which holds none yet."""
    landing: int = 0
    """A block's fresh gradients before the engine files them away."""
    dequant: int = 0
    """One linear's dequantised weight, live in its backward."""
    loss_key: str = "logits_and_loss"
    """The component the loss's bytes are reported under (estimate/techniques.py loss_component)."""
    head: HeadActivations | None = None
    """The final norm, LM head and loss of one micro-batch."""
    head_saved: int = 0
    """What the loss saves for backward, every in-flight micro-batch (last stage)."""
    loss_bwd_saved: int = 0
    """... of it still saved when the loss backward runs."""
    shift_copy: int = 0
    """transformers < 4.46's shifted fp32 logits copy."""
    embed_saved: int = 0
    """What the embedding saves, every in-flight micro-batch (first stage)."""
    loss_work: bool = False
    """The loss's work tensors are allocated apart from what it saves (the standard loss)."""
    kept_on_gpu: bool = True
    """Saved activations stay on the GPU (not offloaded to the host)."""
    offloaded_block: int | None = None
    """Under activation offload, a non-checkpointed block's backward temporaries (its widest node's
    saved tensors back on the GPU, with one weight copy) in place of the block's saved bytes."""


class Technique:
    """One technique's contribution. Each method may read what earlier techniques set."""

    def states(self, c: StageContext, t: Terms) -> None:
        """Adjust the model states (t.st, t.quantized)."""

    def terms(self, c: StageContext, t: Terms) -> None:
        """Set the walk's terms this technique owns."""

    def note(self, c: StageContext, t: Terms) -> str | None:
        """The estimate's note about this technique, or None."""
        return None


def in_flight(plan: TrainingPlan, stage: int) -> int:
    """Micro-batches whose activations a stage holds at once: 1F1B stage k holds pp-k, GPipe
    all of them (Narayanan et al. 2021, Sec. 2.2; Huang et al. 2019, Sec. 2.3)."""
    if plan.pp == 1:
        return 1
    if plan.pp_schedule == "gpipe":
        return plan.grad_accum
    return min(plan.pp - stage, plan.grad_accum)


class Pipeline(Technique):
    def terms(self, c, t):
        plan = c.plan
        t.in_flight = in_flight(plan, c.stage)
        # From the 2nd micro-batch on, all gradients are held -- except in a pipeline, where GPipe
        # runs every forward before any backward and 1F1B does so while m <= pp.
        if plan.pp > 1:
            t.accum_full = plan.pp_schedule == "1f1b" and plan.grad_accum > plan.pp
        else:
            t.accum_full = plan.grad_accum > 1
        # Receive buffers, stage outputs and pending sends of torch.distributed.pipelining (pipeline.py).
        t.logits_bytes = stage_logits_bytes(plan, vocab_size=c.model.vocab_size,
                                            itemsize=c.num.autocast or c.num.weight_itemsize)
        t.pipe = stage_buffers(plan, c.stage, in_flight=t.in_flight, boundary_bytes=c.blk.input_bytes,
                               logits_bytes=t.logits_bytes)


class ZeroInit(Technique):
    def note(self, c, t):
        if c.plan.zero_stage == 3 and c.plan.engine == "deepspeed":
            return "ZeRO-3 init assumes zero.Init (accelerate zero3_init_flag: true)"
        return None


class MixedPrecision(Technique):
    def terms(self, c, t):
        if c.num.autocast:
            t.autocast_copy = autocast_copy_bytes(c.model, c.plan)  # the cached 16-bit weight copies
            t.head_copy = (c.num.autocast * head_weight_elements(c.model, c.plan)
                           if c.last and c.plan.loss == "standard" else 0)
        t.cached_copy = t.autocast_copy

    def note(self, c, t):
        if c.num.autocast and not c.plan.is_quantized:
            return "torch autocast: fp32 weights, bf16 weight copies cached for the forward"
        return None


class Gradients(Technique):
    """How the engine holds gradients between micro-batches and where a block's fresh ones land."""

    def terms(self, c, t):
        plan, st = c.plan, t.st
        if c.habits.grads_kept_between_steps and plan.engine == "torch":
            # zero_grad() zero-fills instead of freeing (spec/stack.py): the previous step's gradients
            # are live from the forward on. DeepSpeed's optimizers free theirs (deepspeed/runtime/fp16/
            # fused_optimizer.py, unfused_optimizer.py, zero/stage_1_and_2.py: zero_grad(set_to_none=True)).
            t.accum_full = True
        # ZeRO-2 allocates its gradient partition at the first reduction and frees it after the step.
        grads_outside_backward = st.gradients if not st.backward_buffers else 0
        t.first_fwd_grads = 0 if st.gradients_grow else grads_outside_backward  # a micro-batch with none held
        t.fwd_grads = st.gradients if t.accum_full else t.first_fwd_grads
        t.landing = landing_bytes(c.rp, st, plan, c.model)

    def note(self, c, t):
        plan = c.plan
        if plan.engine == "torch" and plan.zero_stage == 3 and plan.pp == 1 and plan.grad_accum > 1:
            return ("FSDP with accumulation: gradients held unsharded between syncs (FSDP.no_sync, as "
                    "Accelerate and Lightning run it)")
        return None


class QuantizedBase(Technique):
    """QLoRA's 4-bit base (estimate/quantized.py)."""

    def states(self, c, t):
        if c.plan.is_quantized:
            t.quantized = base_bytes(c.model, c.plan, c.rp.num_params)
            if t.quantized:
                t.st.weights = t.quantized.pop("weights")

    def terms(self, c, t):
        if c.plan.is_quantized:
            # 4-bit bases run bitsandbytes' matmul, which autocast does not cast (tape.py)
            t.autocast_copy = t.cached_copy = 0
            t.dequant = dequantized_weight_bytes(c.model, c.plan)  # one linear's, in backward

    def note(self, c, t):
        plan = c.plan
        if plan.is_quantized:
            return (f"{plan.quantize_base} base (bitsandbytes 4-bit, double quant "
                    f"{'on' if plan.double_quant else 'off'}): "
                    "each linear dequantised into the compute dtype per matmul; the rest fp32")
        return None


class Lora(Technique):
    def terms(self, c, t):
        plan = c.plan
        # LoRA adapters are fp32 leaves that require grad (peft autocast_adapter_dtype=True), so autocast
        # caches their low-dtype copies (aten/src/ATen/autocast_mode.cpp, cached_cast: leaf with
        # requires_grad) and the adapter matmuls save them for the input's grad, like the bases' copies.
        adapter_copy = (c.num.autocast * c.model.lora_params(plan.lora_rank, plan.lora_targets)
                        // c.model.total_layers if c.num.autocast and plan.is_lora else 0)
        t.autocast_copy += adapter_copy
        if plan.is_lora:  # autocast caches only leaves that require grad: frozen bases are cast per call
            t.cached_copy = adapter_copy


class Checkpointing(Technique):
    """Full, partial and selective activation checkpointing (memkit/plan/techniques.py: which blocks and
    why; estimate/techniques.py: what selective keeps)."""

    def terms(self, c, t):
        plan = c.plan
        t.k_ckpt = checkpointed_blocks(plan.checkpointing, c.n_layers)
        t.ckpt_kept = c.blk.input_bytes + (selective_kept_bytes(c.model, plan)
                                           if plan.checkpointing == "selective" else 0)
        t.amp_cache = t.cached_copy * t.k_ckpt if (c.num.autocast and t.k_ckpt > 0) else 0


class Loss(Technique):
    """The plan's loss: standard, chunked or fused (estimate/techniques.py)."""

    def terms(self, c, t):
        plan, model = c.plan, c.model
        t.head = loss_activations(model, plan, device=c.device)
        t.loss_key = loss_component(plan)
        # A pipeline's last stage computes each in-flight micro-batch's loss in its forward.
        t.head_saved = (t.head.saved_bytes + t.head_copy) * t.in_flight if c.last else 0
        t.loss_bwd_saved = t.head_saved
        t.embed_saved = t.head.embedding_bytes * t.in_flight if c.first else 0
        # transformers < 4.46: logits[..., :-1, :].contiguous() before the loss (spec/stack.py); the
        # model's own loss only (--loss-path hf; the user's paths shift the labels, memkit/plan/techniques.py).
        t.shift_copy = (plan.micro_batch_size * (plan.seq_len - 1) * model.vocab_size * 4 // plan.tp
                        if (c.habits.shifted_logits_copy and c.last and model.kind == "decoder"
                            and plan.loss == "standard" and plan.loss_path == "hf") else 0)
        t.loss_work = bool(c.last and plan.loss == "standard" and t.head.backward_peak_bytes)

    def note(self, c, t):
        plan = c.plan
        if plan.loss_path == "hf" or plan.loss != "standard" or not c.last:
            return None
        what = {"ce-16bit": "your cross-entropy on the 16-bit logits",
                "upcast": "your fp32 upcast of the logits, held until backward ends"}[plan.loss_path]
        return f"loss path {plan.loss_path}: {what} (estimate/activations.py loss_path_bytes)"


class ActivationOffload(Technique):
    """--offload-activations cpu (estimate/backward_techniques.py): saved activations live on the
    host; the GPU holds the block being run (forward) or differentiated (backward) only."""

    def terms(self, c, t):
        plan, model = c.plan, c.model
        offloaded_loss = offloaded_loss_backward_saved(model, plan)  # log-probs only, under offload
        if offloaded_loss is not None:
            t.loss_bwd_saved = offloaded_loss * t.in_flight if c.last else 0
        if not offloads_activations(plan):
            return
        t.kept_on_gpu = False
        if c.num.autocast and not plan.is_lora:  # the cache stays on the GPU for the forward
            t.amp_cache = t.autocast_copy * c.n_layers
        if c.blk.offloaded_backward_bytes is not None:
            # each node's saved tensors come back when it runs and go when it returns: the widest
            # node's, with the gradients in flight (estimate/activations.py), and one weight copy
            t.offloaded_block = c.blk.offloaded_backward_bytes + largest_autocast_copy_bytes(model, plan)

    def note(self, c, t):
        if not t.kept_on_gpu:
            return (f"activation offload: {offloaded_activation_bytes(c.model, c.plan, device=c.device) / GIB:.2f} "
                    "GiB of saved activations per micro-batch in pinned host RAM per GPU "
                    "(estimate/backward_techniques.py)")
        return None


class OptimizerInBackward(Technique):
    """--optimizer-in-backward (estimate/backward_techniques.py): the hook steps and frees each
    gradient as it lands."""

    def states(self, c, t):
        t.st = one_gradient_states(t.st, c.model, c.plan)

    def terms(self, c, t):
        if c.plan.optimizer_in_backward:
            t.fwd_grads, t.landing = 0, t.st.step_transient  # + one parameter's step temporaries

    def note(self, c, t):
        if c.plan.optimizer_in_backward:
            return "optimizer in backward: each parameter steps in its gradient hook; one gradient alive at a time"
        return None


TECHNIQUES: tuple[Technique, ...] = (Pipeline(), ZeroInit(), MixedPrecision(), Gradients(), QuantizedBase(),
                                     Lora(), Checkpointing(), Loss(), ActivationOffload(), OptimizerInBackward())
"""In the order they run: a later one reads (and may override) what an earlier one set."""


def stage_terms(c: StageContext, st: States) -> tuple[Terms, list[str]]:
    """The walk's terms for stage `c` from its model states `st`, and the techniques' notes."""
    t = Terms(st=st)
    for technique in TECHNIQUES:
        technique.states(c, t)
    plan = c.plan
    if not c.habits.foreach_optimizer and plan.engine == "torch" and plan.optimizer == "adamw":
        # torch < 2.0 loops over parameters: one parameter's sqrt temporary at a time (spec/stack.py)
        t.st.step_transient = min(t.st.step_transient,
                                  c.rp.largest_tensor * (2 if plan.precision == "bf16-pure" else 4))
    for technique in TECHNIQUES:
        technique.terms(c, t)
    notes = [n for n in (technique.note(c, t) for technique in TECHNIQUES) if n]
    return t, notes


def landing_bytes(rp: RankParams, st: States, plan: TrainingPlan, model: ModelSpec) -> int:
    """A block's fresh gradients before the engine files them away (AccumulateGrad output, or
    param.grad awaiting the ZeRO bucket copy)."""
    if st.gradients_grow and plan.grad_accum == 1:
        return 0  # they are the stored gradients themselves
    wb = 2 if (plan.engine == "deepspeed" and plan.precision != "fp32") or plan.precision == "bf16-pure" else 4
    if plan.engine == "torch" and plan.zero_stage == 0 and not plan.is_lora:
        # AccumulateGrad adds each fresh gradient into the existing .grad as soon as it is made
        # (its nodes run first: sequence_nr UINT64_MAX, torch/csrc/autograd/node.h; in-place
        # `variable_grad += new_grad`, torch/csrc/autograd/functions/accumulate_grad.h), so one
        # weight's gradient lands at a time -- measured on a CPU pipeline stage (tests/e2e/
        # test_parallel_equivalence.py), whose peak is a block's backward.
        return max(lin.in_features * lin.out_features // (plan.tp if lin.tp_style != "replicate" else 1)
                   for lin in model.layer_linears) * wb
    return rp.layer_trainable * wb
