"""The Accelerate config for a TrainingPlan: a pure dict builder, written as YAML by bundle.py.

Keys: accelerate/commands/config/config_args.py (ClusterConfig; unknown keys are rejected).
The YAML names the DeepSpeed JSON and sets nothing DeepSpeed reads: with a
`deepspeed_config_file`, `accelerate launch` refuses gradient accumulation, clipping, ZeRO stage,
offload devices and mixed_precision set in the YAML as well (accelerate/utils/dataclasses.py,
DeepSpeedPlugin._deepspeed_config_checks; commands/launch.py marks a YAML mixed_precision as such
a field). So `mixed_precision` is left out on purpose: Accelerate reads it from the JSON's
fp16/bf16 blocks (accelerate/state.py, AcceleratorState.mixed_precision).
"""
from __future__ import annotations

from memkit.plan import TrainingPlan

DEFAULT_MAIN_PROCESS_PORT = 29500


def accelerate_config(plan: TrainingPlan, *, deepspeed_config_file: str, num_gpus_per_node: int,
                      num_nodes: int = 1, main_process_ip: str | None = None,
                      main_process_port: int = DEFAULT_MAIN_PROCESS_PORT) -> dict:
    """ClusterConfig dict for `accelerate launch --config_file`. One process per GPU."""
    num_processes = num_gpus_per_node * num_nodes
    if plan.num_gpus != num_processes:
        raise ValueError(f"plan uses dp*tp*pp={plan.num_gpus} GPUs but the hardware has {num_processes}")
    ds: dict = {
        "deepspeed_config_file": deepspeed_config_file,
        # Build the model directly into ZeRO-3 partitions (deepspeed.zero.Init via transformers),
        # so no rank ever holds the whole model: the estimate assumes it.
        "zero3_init_flag": plan.zero_stage == 3,
    }
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "DEEPSPEED",
        "deepspeed_config": ds,
        "num_processes": num_processes,
        "num_machines": num_nodes,
        "machine_rank": 0,
        "rdzv_backend": "static",
        "same_network": True,
        "main_training_function": "main",
        "use_cpu": False,
        "debug": False,
        "downcast_bf16": "no",
    }
    if num_nodes > 1:
        # torchrun on every node (`--machine_rank i` on node i); no pdsh/ssh needed.
        ds["deepspeed_multinode_launcher"] = "standard"
        config["main_process_ip"] = main_process_ip or "127.0.0.1"
        config["main_process_port"] = main_process_port
    return config
