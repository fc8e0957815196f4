"""Real DeepSpeed training steps on CPU (gloo), with the peak bytes of live tensors per rank.

Run as the worker of a multi-process launch, one process per rank:

    OMP_NUM_THREADS=1 python -m torch.distributed.run --nproc_per_node 2 \\
        -m memkit.calibrate.deepspeed_step --model-config cfg.json --plan plan.json --out DIR

Each rank writes DIR/rank<r>.json. The tracker is active from before the model is built and
before deepspeed.initialize, so DeepSpeed's flat fp32 partitions, gradient buckets and
partitioned optimizer states are all counted. Besides phase peaks, each rank reports the bytes
of every tensor reachable from the DeepSpeed optimizer object, by attribute name
(e.g. 'single_partition_of_fp32_groups'), and the bytes live at each phase peak by allocation
site, which is what an estimator calibrates against.
"""
from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan

PHASES = ("forward", "backward", "optimizer_step")


def measure_deepspeed(model_config: dict, plan: TrainingPlan, *, num_steps: int = 2, seed: int = 0,
                      lr: float = 1e-4, checkpoint_reentrant: bool = False) -> dict:
    """One rank's measurement; call in every rank of a torch.distributed launch."""
    import deepspeed
    import torch
    import torch.distributed as dist

    from memkit.emit.deepspeed import deepspeed_config
    from memkit.calibrate.cpu_step import build_model, random_batch
    from memkit.measure.live_tensors import LiveTensorTracker

    plan.validate()
    if plan.precision not in ("fp32", "bf16"):
        raise MemkitError(f"--precision {plan.precision!r} under DeepSpeed on CPU: use fp32 or bf16")
    if plan.is_lora:
        raise MemkitError("LoRA under DeepSpeed is not measured here; use measure_training")
    deepspeed.init_distributed(dist_backend="gloo")
    world_size = dist.get_world_size()
    rank = dist.get_rank()
    if world_size != plan.dp:
        raise MemkitError(f"plan.dp={plan.dp} but the launch has {world_size} processes; "
                          f"launch with --nproc_per_node {plan.dp}")
    config = deepspeed_config(plan, lr=lr)
    generator = torch.Generator().manual_seed(seed + 1 + rank)
    hf_ds_config = None
    with LiveTensorTracker(record_sites=True) as tracker:
        with tracker.phase("init"):
            if plan.zero_stage == 3:
                # Builds the model under deepspeed.zero.Init, as HF Trainer does
                # (transformers/integrations/deepspeed.py, is_deepspeed_zero3_enabled).
                from transformers.integrations import HfDeepSpeedConfig

                hf_ds_config = HfDeepSpeedConfig(config)
            model = build_model(model_config, plan.with_(precision="fp32"), seed=seed,
                                checkpoint_reentrant=checkpoint_reentrant)
            optimizer = _optimizer(model, plan, lr)
            engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        vocab_size = model.config.vocab_size
        params = list(engine.module.parameters())
        boundary: dict[str, dict] = {"after_init": _components(tracker, engine, params)}
        for step in range(num_steps):
            for micro in range(plan.grad_accum):
                batch = random_batch(vocab_size, plan, generator)
                with tracker.phase(f"forward#{step}"):
                    loss = engine(**batch).loss
                with tracker.phase(f"backward#{step}"):
                    engine.backward(loss)
                del loss, batch
                last_micro = micro == plan.grad_accum - 1
                if last_micro:
                    boundary["after_backward"] = _components(tracker, engine, params)
                with tracker.phase(f"{'optimizer_step' if last_micro else 'accum_step'}#{step}"):
                    engine.step()
            boundary["after_step"] = _components(tracker, engine, params)
        dist.barrier()
        result = _summarise(tracker, num_steps, boundary)
        result.update(world_size=world_size, rank=rank, deepspeed_config=config,
                      optimizer_class=type(ds_optimizer).__name__,
                      basic_optimizer_class=type(engine.basic_optimizer).__name__,
                      num_params=sum(_numel(p) for p in params))
        engine.destroy() if hasattr(engine, "destroy") else None
        del engine, ds_optimizer, optimizer, model, params, hf_ds_config
    return result


def _optimizer(model, plan: TrainingPlan, lr: float):
    import torch

    if plan.optimizer != "adamw":
        raise MemkitError(f"--optimizer {plan.optimizer!r} under DeepSpeed: only adamw is measured")
    if plan.offload_optimizer == "cpu":
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(model.parameters(), lr=lr, weight_decay=0.0, adamw_mode=True)
    # foreach=True: torch's CUDA default (torch/optim/optimizer.py, _default_to_fused_or_foreach).
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0, foreach=True)


def _numel(param) -> int:
    return int(getattr(param, "ds_numel", param.numel()))


def _components(tracker, engine, params) -> dict:
    """Bytes at a boundary, measured from the objects: params, grads, optimizer states, and
    every tensor the DeepSpeed optimizer holds, by attribute name. Also tags them."""
    import torch

    ds_opt = engine.optimizer
    held = _tensors_by_attribute(ds_opt, depth=2) if ds_opt is not None else {}
    for name, tensors in held.items():
        tracker.tag(tensors, f"ds.{name}", adopt=False)
    basic = getattr(engine, "basic_optimizer", None)
    states = [v for s in (basic.state.values() if basic is not None else ()) for v in s.values()
              if isinstance(v, torch.Tensor) and v.dim() > 0]
    partitions = [p.ds_tensor for p in params if getattr(p, "ds_tensor", None) is not None]
    grads = [p.grad for p in params if p.grad is not None]
    tracker.tag(partitions, "param_partition", adopt=False)
    tracker.tag(params, "param", adopt=False)
    tracker.tag(grads, "grad", adopt=False)
    tracker.tag(states, "optimizer_state", adopt=False)
    return {
        "live_bytes": tracker.live_bytes,
        "params_bytes": tracker.bytes_of(params),
        "param_partitions_bytes": tracker.bytes_of(partitions),
        "grads_bytes": tracker.bytes_of(grads),
        "optimizer_state_bytes": tracker.bytes_of(states),
        "ds_optimizer_attributes_bytes": {name: tracker.bytes_of(t) for name, t in sorted(held.items())},
        "live_by_tag": tracker.live_by_tag(),
    }


def _tensors_by_attribute(obj, *, depth: int) -> dict[str, list]:
    """Tensors reachable from `obj`'s attributes (through lists, tuples, dicts, and plain objects
    up to `depth` levels), grouped by dotted attribute path. Modules and process groups skipped."""
    import torch

    out: dict[str, list] = {}
    seen: set[int] = set()

    def walk(value, path: str, level: int) -> None:
        if id(value) in seen:
            return
        if isinstance(value, torch.Tensor):
            seen.add(id(value))
            out.setdefault(path, []).append(value)
            if value.grad is not None:
                out.setdefault(path + ".grad", []).append(value.grad)
            return
        if isinstance(value, (torch.nn.Module, str, bytes, int, float, bool)) or value is None:
            return
        seen.add(id(value))
        if isinstance(value, (list, tuple, set)):
            for item in value:
                walk(item, path, level)
        elif isinstance(value, dict):
            for item in value.values():
                walk(item, path, level)
        elif level > 0 and hasattr(value, "__dict__") and type(value).__module__.startswith("deepspeed"):
            for key, item in vars(value).items():
                walk(item, f"{path}.{key}" if path else key, level - 1)

    for key, item in vars(obj).items():
        walk(item, key, depth)
    return out


def _summarise(tracker, num_steps: int, boundary: dict) -> dict:
    last = num_steps - 1
    phases = {"init": _phase(tracker, tracker.records("init"))}
    for name in PHASES + ("accum_step",):
        records = tracker.records(f"{name}#{last}")
        if records:
            phases[name] = _phase(tracker, records)
    return {"peak_bytes": tracker.peak_bytes, "peak_breakdown": tracker.peak_breakdown(),
            "peak_by_site": _top_sites(tracker, tracker.peak_seq), "phases": phases,
            "boundary": boundary, "num_steps": num_steps}


def _phase(tracker, records) -> dict:
    top = max(records, key=lambda r: r.peak_bytes)
    return {"peak_bytes": top.peak_bytes, "start_live_bytes": records[0].start_live_bytes,
            "end_live_bytes": records[-1].end_live_bytes, "num_intervals": len(records),
            "peak_breakdown": tracker.live_at(top.peak_seq),
            "peak_by_site": _top_sites(tracker, top.peak_seq)}


def _top_sites(tracker, seq: int, limit: int = 12) -> dict[str, int]:
    by_site = tracker.live_at(seq, by="site")
    return dict(sorted(by_site.items(), key=lambda kv: -kv[1])[:limit])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-config", required=True, help="HF config JSON file (with model_type)")
    parser.add_argument("--plan", required=True, help="TrainingPlan JSON file (TrainingPlan.to_dict)")
    parser.add_argument("--out", required=True, help="directory for rank<r>.json")
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args(argv)
    model_config = json.loads(Path(args.model_config).read_text())
    plan = TrainingPlan.from_dict(json.loads(Path(args.plan).read_text()))
    result = measure_deepspeed(model_config, plan, num_steps=args.steps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{result['rank']}.json").write_text(json.dumps(result, indent=1, default=str))
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    raise SystemExit(main())
