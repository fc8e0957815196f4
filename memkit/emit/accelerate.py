"""The Accelerate config for a TrainingPlan: a pure dict builder, written as YAML by bundle.py.

Keys: accelerate/commands/config/config_args.py (ClusterConfig; unknown keys are rejected).
The YAML names the DeepSpeed JSON and sets nothing DeepSpeed reads: with a
`deepspeed_config_file`, `accelerate launch` refuses gradient accumulation, clipping, ZeRO stage,
offload devices and mixed_precision set in the YAML as well (accelerate/utils/dataclasses.py,
DeepSpeedPlugin._deepspeed_config_checks; commands/launch.py marks a YAML mixed_precision as such
a field). So `mixed_precision` is left out on purpose: Accelerate reads it from the JSON's
fp16/bf16 blocks (accelerate/state.py, AcceleratorState.mixed_precision).

Plans that do not run under DeepSpeed (pipeline parallel: torch.distributed.pipelining, one stage
per process) get a plain multi-process config instead: distributed_type MULTI_GPU, which
`accelerate launch` starts through torchrun (accelerate/commands/launch.py, multi_gpu_launcher),
and mixed_precision from the plan, the one place it is set. On a machine without GPUs the runner
turns that into Accelerate's MULTI_CPU with gloo (memkit/train/loop.py, make_accelerator).
"""
from __future__ import annotations

from memkit.plan.plan import TrainingPlan

DEFAULT_MAIN_PROCESS_PORT = 29500
_LAUNCH_DEFAULTS = {"rdzv_backend": "static", "same_network": True, "main_training_function": "main",
                    "use_cpu": False, "debug": False, "downcast_bf16": "no"}
"""Launcher keys every memkit YAML writes with the same values (ClusterConfig fields)."""


def accelerate_config(plan: TrainingPlan, *, deepspeed_config_file: str | None, num_gpus_per_node: int,
                      num_nodes: int = 1, main_process_ip: str | None = None,
                      main_process_port: int = DEFAULT_MAIN_PROCESS_PORT) -> dict:
    """ClusterConfig dict for `accelerate launch --config_file`. One process per GPU.
    deepspeed_config_file: the DeepSpeed JSON's path for engine 'deepspeed' plans, None otherwise."""
    num_processes = num_gpus_per_node * num_nodes
    if plan.num_gpus != num_processes:
        raise ValueError(f"plan uses dp*tp*pp={plan.num_gpus} GPUs but the hardware has {num_processes}")
    if plan.engine != "deepspeed":
        if deepspeed_config_file is not None:
            raise ValueError(f"engine {plan.engine!r} plans run without DeepSpeed; pass deepspeed_config_file=None")
        return _torch_config(plan, num_processes=num_processes, num_nodes=num_nodes,
                             main_process_ip=main_process_ip, main_process_port=main_process_port)
    if deepspeed_config_file is None:
        raise ValueError("engine 'deepspeed' plans need deepspeed_config_file")
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
        **_LAUNCH_DEFAULTS,
    }
    if num_nodes > 1:
        # torchrun on every node (`--machine_rank i` on node i); no pdsh/ssh needed.
        ds["deepspeed_multinode_launcher"] = "standard"
    return _with_rendezvous(config, num_nodes, main_process_ip, main_process_port)


MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "bf16-pure": "no", "fp16": "fp16"}
"""The plan's precision as Accelerate's mixed_precision (bf16-pure casts the model itself)."""


def _torch_config(plan: TrainingPlan, *, num_processes: int, num_nodes: int, main_process_ip: str | None,
                  main_process_port: int) -> dict:
    """Plain multi-process launch (torchrun): the runner splits the model itself (pipeline)."""
    config: dict = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU" if num_processes > 1 else "NO",
        "mixed_precision": MIXED_PRECISION[plan.precision],
        "num_processes": num_processes,
        "num_machines": num_nodes,
        "machine_rank": 0,
        "gpu_ids": "all",
        **_LAUNCH_DEFAULTS,
    }
    return _with_rendezvous(config, num_nodes, main_process_ip, main_process_port)


def _with_rendezvous(config: dict, num_nodes: int, main_process_ip: str | None, main_process_port: int) -> dict:
    """Multi-node runs name node 0's address and port; single-node runs need neither."""
    if num_nodes > 1:
        config["main_process_ip"] = main_process_ip or "127.0.0.1"
        config["main_process_port"] = main_process_port
    return config
