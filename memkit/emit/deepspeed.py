"""The DeepSpeed JSON for a TrainingPlan: a pure dict builder with explicit values (no "auto").

Keys and defaults: deepspeed/runtime/config.py, deepspeed/runtime/zero/config.py,
deepspeed/runtime/zero/offload_config.py, deepspeed/runtime/precision_config.py (DeepSpeed 0.19).
Every setting lives here and only here: the Accelerate YAML (accelerate.py) points at this file
and sets nothing DeepSpeed reads (accelerate rejects a YAML that sets both), and Accelerate
derives its mixed precision from the fp16/bf16 blocks below (accelerate/state.py,
AcceleratorState.mixed_precision).

HF Trainer's --deepspeed takes the same file when TrainingArguments agree with it
(transformers integrations/deepspeed.py, HfTrainerDeepSpeedConfig.trainer_config_process):
per_device_train_batch_size, gradient_accumulation_steps, max_grad_norm, learning_rate,
adam_beta1/2, adam_epsilon, weight_decay and --bf16/--fp16; memkit.emit.trainer lists them.
"""
from __future__ import annotations

from memkit.errors import MemkitError
from memkit.plan.parallel import deepspeed_data_ranks
from memkit.plan.plan import DEFAULT_LR, TrainingPlan

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8
SGD_MOMENTUM = 0.9
"""Matches the optimizer memkit measures and prices (memkit/calibrate/cpu_step.py)."""
NVME_PARAM_BUFFER_ELEMENTS = 100_000_000
"""DeepSpeed's offload_param.buffer_size default; it must hold the largest parameter."""


def deepspeed_config(plan: TrainingPlan, *, lr: float = DEFAULT_LR, weight_decay: float = 0.0,
                     nvme_path: str = "/local_nvme", optimizer_block: bool = True,
                     largest_param_numel: int = 0) -> dict:
    """DeepSpeed config dict that runs `plan` as written (HF Trainer's --deepspeed accepts it too).

    optimizer_block: write the optimizer into the config (DeepSpeed builds it: FusedAdam on GPU,
    DeepSpeedCPUAdam under CPU offload). False when the caller passes its own optimizer object to
    deepspeed.initialize. 8-bit AdamW and Adafactor are never built by DeepSpeed: the training
    script passes them, and the config allows that under ZeRO.
    largest_param_numel: the model's largest single tensor (the embedding, usually); NVMe
    parameter offload needs a swap buffer at least that large.
    """
    plan.validate()
    if plan.pp > 1 or plan.engine != "deepspeed":
        raise MemkitError(
            f"plan with engine {plan.engine!r} (tp={plan.tp}, pp={plan.pp}) does not run under DeepSpeed, "
            "so it has no DeepSpeed config; memkit's pipeline runs through torch.distributed.pipelining "
            "(use the accelerate.yaml written beside plan.json)")
    config: dict = {
        **batch_fields(plan),
        "gradient_clipping": plan.gradient_clipping,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if plan.precision == "fp16":
        # Dynamic loss scaling (Micikevicius et al. 2018, Sec. 3.2): loss_scale 0 = dynamic,
        # starting at 2**16, halving on overflow, doubling after 1000 clean steps.
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    elif plan.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif plan.precision == "bf16-pure":
        # ZeRO 1-3 only: plan.validate() above refuses bf16-pure at ZeRO 0 (memkit/plan/plan.py, bf16_pure_needs_zero)
        # Master weights, gradients and optimizer states all in bf16 (precision_config.py).
        config["bf16"] = {"enabled": True, "bf16_master_weights_and_grads": True,
                          "bf16_optimizer_states": True}
    config["zero_optimization"] = _zero_block(plan, nvme_path, largest_param_numel)
    opt = _optimizer_block(plan, lr=lr, weight_decay=weight_decay) if optimizer_block else None
    if opt is not None:
        config["optimizer"] = opt
    if plan.zero_stage >= 1 and (opt is None or opt["type"] not in ("AdamW", "Adam")):
        # A client optimizer (8-bit AdamW, Adafactor) or torch SGD under ZeRO: DeepSpeed refuses
        # optimizers it has not tested unless told (runtime/engine.py, zero_allow_untested_optimizer).
        config["zero_allow_untested_optimizer"] = True
    # No "scheduler" block: DeepSpeed's decaying schedules need total_num_steps, which depends on
    # the dataset; the training script (or HF Trainer) owns the schedule.
    if plan.tp > 1 and plan.tp_engine == "autotp":
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    return config


def batch_fields(plan: TrainingPlan) -> dict:
    """The three DeepSpeed batch fields; the only writer of them (deepspeed_config, the runner's
    AutoTP config and its 'auto' filling all take them from here). train_batch_size is
    micro x accum x every rank DeepSpeed counts as a data rank (memkit.plan.parallel.deepspeed_data_ranks)."""
    return {"train_batch_size": plan.micro_batch_size * plan.grad_accum * deepspeed_data_ranks(plan),
            "train_micro_batch_size_per_gpu": plan.micro_batch_size,
            "gradient_accumulation_steps": plan.grad_accum}


def largest_param_numel(model) -> int:
    """The model's largest single tensor (the token embedding, or an untied LM head, in practice):
    what the NVMe parameter-offload swap buffer must hold (offload_param.buffer_size)."""
    biggest = model.vocab_size * model.hidden_size
    for lin in model.layer_linears + model.encoder_layer_linears:
        biggest = max(biggest, lin.in_features * lin.out_features)
    return biggest


def _zero_block(plan: TrainingPlan, nvme_path: str, largest_param_numel: int) -> dict:
    zero: dict = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:
        zero.update({
            "reduce_bucket_size": int(plan.reduce_bucket_size),
            "overlap_comm": plan.overlap_comm,
            "contiguous_gradients": plan.contiguous_gradients,
        })
    if plan.zero_stage in (1, 2):
        zero.update({"allgather_bucket_size": int(plan.allgather_bucket_size),
                     "reduce_scatter": True, "allgather_partitions": True})
    if plan.zero_stage == 3:
        # Integers, never floats or "auto": a float stage3_prefetch_bucket_size fails DeepSpeed's
        # pydantic validation (DeepSpeed >= 0.15).
        zero.update({
            "stage3_prefetch_bucket_size": int(plan.stage3_prefetch_bucket_size),
            "stage3_max_live_parameters": int(plan.stage3_max_live_parameters),
            "stage3_max_reuse_distance": int(plan.stage3_max_reuse_distance),
            "stage3_param_persistence_threshold": int(plan.stage3_param_persistence_threshold),
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(plan.offload_optimizer, nvme_path)
    if plan.offload_params != "none":
        block = _offload(plan.offload_params, nvme_path)
        if plan.offload_params == "nvme":
            block["buffer_size"] = int(max(NVME_PARAM_BUFFER_ELEMENTS, largest_param_numel))
        zero["offload_param"] = block
    return zero


def _optimizer_block(plan: TrainingPlan, *, lr: float, weight_decay: float) -> dict | None:
    if plan.optimizer == "adamw":
        # DeepSpeed picks the implementation: FusedAdam on the GPU, DeepSpeedCPUAdam when the
        # optimizer is offloaded (runtime/engine.py, get_optimizer_configuration).
        return {"type": "AdamW", "params": {"lr": lr, "betas": list(ADAM_BETAS), "eps": ADAM_EPS,
                                            "weight_decay": weight_decay}}
    if plan.optimizer == "sgd":
        # Unknown names fall through to torch.optim (runtime/engine.py, _configure_basic_optimizer).
        return {"type": "SGD", "params": {"lr": lr, "momentum": SGD_MOMENTUM, "weight_decay": weight_decay}}
    return None  # adamw-8bit, paged-adamw-8bit, adafactor: the script passes the optimizer object


def _offload(device: str, nvme_path: str) -> dict:
    block = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = nvme_path
    return block
