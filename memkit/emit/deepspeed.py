"""The DeepSpeed JSON for a TrainingPlan: a pure dict builder with explicit values (no "auto").

Keys and defaults: deepspeed/runtime/config.py, deepspeed/runtime/zero/config.py,
deepspeed/runtime/zero/offload_config.py (DeepSpeed 0.19).
"""
from __future__ import annotations

from memkit.plan import TrainingPlan


def deepspeed_config(plan: TrainingPlan, *, lr: float = 2e-5, weight_decay: float = 0.0,
                     nvme_path: str = "/local_nvme") -> dict:
    """DeepSpeed config dict that runs `plan` as written (HF Trainer's --deepspeed accepts it too)."""
    config: dict = {
        "train_batch_size": plan.global_batch_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch_size,
        "gradient_accumulation_steps": plan.grad_accum,
        "gradient_clipping": plan.gradient_clipping,
        "steps_per_print": 1_000_000,
        "wall_clock_breakdown": False,
    }
    if plan.precision == "fp16":
        # Dynamic loss scaling (Micikevicius et al. 2018, Sec. 3.2): loss_scale 0 = dynamic.
        config["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16,
                          "loss_scale_window": 1000, "hysteresis": 2, "min_loss_scale": 1}
    elif plan.precision in ("bf16", "bf16-pure"):
        config["bf16"] = {"enabled": True}
    zero: dict = {"stage": plan.zero_stage}
    if plan.zero_stage >= 1:
        zero.update({
            "reduce_bucket_size": plan.reduce_bucket_size,
            "overlap_comm": plan.overlap_comm,
            "contiguous_gradients": plan.contiguous_gradients,
        })
    if plan.zero_stage in (1, 2):
        zero.update({"allgather_bucket_size": plan.allgather_bucket_size,
                     "reduce_scatter": True, "allgather_partitions": True})
    if plan.zero_stage == 3:
        zero.update({
            "stage3_prefetch_bucket_size": plan.stage3_prefetch_bucket_size,
            "stage3_max_live_parameters": plan.stage3_max_live_parameters,
            "stage3_max_reuse_distance": plan.stage3_max_reuse_distance,
            "stage3_param_persistence_threshold": plan.stage3_param_persistence_threshold,
            "stage3_gather_16bit_weights_on_model_save": True,
        })
    if plan.offload_optimizer != "none":
        zero["offload_optimizer"] = _offload(plan.offload_optimizer, nvme_path)
    if plan.offload_params != "none":
        zero["offload_param"] = _offload(plan.offload_params, nvme_path)
    config["zero_optimization"] = zero
    if plan.tp > 1 and plan.tp_engine == "autotp":
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    return config


def _offload(device: str, nvme_path: str) -> dict:
    block = {"device": device, "pin_memory": True}
    if device == "nvme":
        block["nvme_path"] = nvme_path
    return block
