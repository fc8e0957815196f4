"""`memkit.estimate(...)`, the Python API's estimate (memkit/api.py re-exports it), and the two
helpers every API function uses to take a model and a GPU in any form. Here, in the estimate
layer, so that calling the estimate package (estimate/__init__.py) needs nothing above it.
Imports are lazy: `import memkit` stays instant."""
from __future__ import annotations

from memkit.errors import MemkitError


def model_spec(model):
    """A ModelSpec from anything `estimate`/`suggest` take as `model`."""
    from memkit.spec.hf import load_model_spec, spec_from_config
    from memkit.spec.model import ModelSpec

    if isinstance(model, ModelSpec):
        return model
    if isinstance(model, dict):
        return spec_from_config(dict(model), name=str(model.get("_name_or_path") or model.get("model_type")))
    if hasattr(model, "to_dict") and hasattr(model, "model_type"):  # a transformers PretrainedConfig
        config = model.to_dict()
        return spec_from_config(config, name=str(config.get("_name_or_path") or config["model_type"]))
    if hasattr(model, "config") and hasattr(model.config, "to_dict"):  # a model: its config
        return model_spec(model.config)
    return load_model_spec(str(model))


def hardware(*, gpu: str | None = None, gpu_memory: int | str | None = None, num_gpus: int = 1,
             num_nodes: int = 1, host_ram: int | str | None = None):
    """A Hardware from a catalog GPU name (`memkit gpus`) or a memory size (bytes or '24GiB')."""
    from memkit.spec.hardware import Hardware, custom_gpu, find_gpu
    from memkit.units import parse_bytes

    if (gpu is None) == (gpu_memory is None):
        raise MemkitError("give gpu='a100-80gb' (see `memkit gpus`) or gpu_memory='24GiB', exactly one")
    if gpu is not None:
        chip = find_gpu(gpu)
    else:
        chip = custom_gpu(gpu_memory if isinstance(gpu_memory, int) else parse_bytes(str(gpu_memory),
                                                                                     what="gpu_memory"))
    kwargs = {}
    if host_ram is not None:
        kwargs["host_ram_bytes_per_node"] = host_ram if isinstance(host_ram, int) else parse_bytes(host_ram)
    return Hardware(gpu=chip, num_gpus_per_node=num_gpus, num_nodes=num_nodes, **kwargs).validate()


def estimate(model, *, gpu: str | None = None, gpu_memory: int | str | None = None, num_gpus: int = 1,
             num_nodes: int = 1, plan=None, device: str = "cuda", **knobs):
    """Per-GPU peak memory of one plan (`memkit estimate`): a MemoryEstimate.

    plan: a TrainingPlan, or its knobs as keywords (precision, optimizer, zero_stage,
    offload_optimizer, offload_params, checkpointing, attention, micro_batch_size, grad_accum,
    seq_len, tp, pp, lora_rank, lora_targets, ...); dp defaults to the GPUs / (tp x pp).
    device='cpu' prices a CPU run (what memkit's CPU tests and the runner's live-tensor peaks use).
    """
    from memkit.estimate.memory import estimate_memory
    from memkit.plan.plan import TrainingPlan

    spec = model_spec(model)
    hw = hardware(gpu=gpu, gpu_memory=gpu_memory, num_gpus=num_gpus, num_nodes=num_nodes)
    if plan is None:
        if "lora_targets" in knobs:
            knobs["lora_targets"] = tuple(knobs["lora_targets"])
        split = knobs.get("tp", 1) * knobs.get("pp", 1)
        knobs.setdefault("dp", max(1, hw.num_gpus // split))
        plan = TrainingPlan(**knobs)
    elif knobs:
        raise MemkitError(f"give a plan or plan knobs, not both (got plan and {sorted(knobs)})")
    return estimate_memory(spec, plan.validate(), hw, device=device)
