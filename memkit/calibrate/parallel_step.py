"""Train a model built from its config under a plan's tensor/pipeline/data parallel degrees, with
fixed seed and fixed synthetic data, and log per-step loss and per-rank peak live-tensor bytes.

The split-training harness behind launch/parallel_train.py (its entry point, run under torchrun):

    torchrun --nproc_per_node 2 launch/parallel_train.py --model-config tiny.json --tp 2 --steps 3 \
        --out run.jsonl
    torchrun --nproc_per_node 2 launch/parallel_train.py --model llama-3.2-1b --plan runs/x/plan.json ...

Tensor parallel runs through DeepSpeed AutoTP, pipeline parallel through
torch.distributed.pipelining, tp x pp through the pipeline with torch tensor parallel inside
each stage (memkit.train.parallel). tp=1 pp=1 is the plain single-model
reference the parallel runs are compared with; the estimator's prediction for the plan is logged
beside the measured peaks, so this is a calibration harness (memkit/ARCHITECTURE.md, "Layers").
Bad input: one line on stderr, exit 2.

The JSONL (written by rank 0): a "start" record (world size, degrees, engines, plan, every
rank's place), one "step" record per step (loss, every rank's peak live-tensor bytes during that
step), and an "end" record (peaks of the last step per rank, the estimator's prediction).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan, add_knob_flags, knob_values


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="catalog name, config.json path, or folder holding one")
    src.add_argument("--model-config", help="a config.json (or a JSON object string) with model_type")
    p.add_argument("--plan", help="plan.json (memkit suggest's bundle or a bare TrainingPlan dict)")
    add_knob_flags(p, "launch")  # the plan knobs this harness takes (memkit/plan/plan.py declares them)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--distinct-batches", type=int, default=0,
                   help="cycle this many fixed batches (0: a new batch every step)")
    p.add_argument("--gpu", default="a100-80gb", help="catalog GPU the estimate is priced for (CPU rules)")
    p.add_argument("--breakdown", action="store_true",
                   help="also log what was live at each rank's last-step peak (param/grad/optimizer/other)")
    p.add_argument("--out", required=True, help="JSONL log (rank 0 writes it)")
    return p.parse_args(argv)


def load_model_config(args) -> tuple[str, dict]:
    """(name, config dict) from --model-config (a file or an inline JSON object) or --model; files
    are read through memkit.fileio (one-line errors)."""
    from memkit.fileio import read_json_object

    if args.model_config:
        text = args.model_config
        path = Path(text)
        if path.is_file():
            return str(path), read_json_object(path, what="--model-config", noun="config object")
        try:
            return "inline", json.loads(text)
        except json.JSONDecodeError:
            raise MemkitError(f"--model-config {text!r} is neither a file nor a JSON object") from None
    from memkit.spec.hf import load_model_spec

    spec = load_model_spec(args.model)
    return spec.name, read_json_object(spec.config_path, what="config file", noun="config object")


def make_plan(args, world_size: int) -> TrainingPlan:
    base: dict = {}
    if args.plan:
        from memkit.emit.plan_doc import read_plan_fields

        base = read_plan_fields(args.plan)
    flags = {k: v for k, v in knob_values(args, "launch").items() if v is not None}
    base.update(flags)
    base.setdefault("precision", "fp32")
    base.setdefault("micro_batch_size", 2)
    base.setdefault("seq_len", 32)
    tp, pp = base.get("tp", 1), base.get("pp", 1)
    if "dp" not in flags and (not args.plan or "dp" not in base):
        base["dp"] = max(1, world_size // (tp * pp))
    if pp > 1:
        base.setdefault("grad_accum", pp)
    # Engines (memkit.plan.parallel, RUN_TP / RUN_PP / RUN_TP_PP): AutoTP runs inside DeepSpeed; the
    # pipeline (with torch tensor parallel inside its stages under tp x pp) and the reference in plain
    # torch. The schedule stays the flag's (this harness runs GPipe too).
    if "engine" not in base or not args.plan:
        from memkit.plan.parallel import RUN_PP, RUN_TP, RUN_TP_PP

        base["engine"] = RUN_TP["engine"] if tp > 1 and pp == 1 else RUN_PP["engine"] if pp > 1 else "torch"
        if tp > 1 and pp > 1:
            base["tp_engine"] = RUN_TP_PP["tp_engine"]
    if "gradient_clipping" not in base:
        base["gradient_clipping"] = 1.0
    return TrainingPlan.from_dict(base).validate()


def batches(vocab_size: int, plan: TrainingPlan, *, seed: int, steps: int, distinct: int, dp_rank: int):
    """Per step, this dp shard's micro x accum sequences; every rank draws the whole global batch
    from the same generator, so the data do not depend on the layout."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    per_rank = plan.micro_batch_size * plan.grad_accum
    pool = []
    for step in range(steps):
        if distinct and step >= distinct:
            ids = pool[step % distinct]
        else:
            ids = torch.randint(0, vocab_size, (plan.dp * per_rank, plan.seq_len), generator=gen)
            pool.append(ids)
        yield ids[dp_rank * per_rank:(dp_rank + 1) * per_rank]


def main(argv=None) -> int:
    """The harness's process; the garbage collector is paused through set-up as the runner's is
    (memkit/train/collector.py; run() resumes it before step 1)."""
    from memkit.train import collector

    collector.pause()
    try:
        return _main(argv)
    finally:
        collector.restore()


def _main(argv) -> int:
    args = parse_args(argv)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        name, model_config = load_model_config(args)
        plan = make_plan(args, world_size)
        layout, spec, hardware = check(name, model_config, plan, rank, world_size, args.gpu)
    except MemkitError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    return run(args, name, model_config, plan, layout, spec, hardware)


def check(name, model_config, plan, rank, world_size, gpu_name):
    from memkit.spec.hardware import Hardware, find_gpu
    from memkit.spec.hf import spec_from_config
    from memkit.plan.parallel import rank_layout, validate_parallel

    layout = rank_layout(plan, rank=rank, world_size=world_size)
    spec = spec_from_config(model_config, name=name)
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world_size)))
    hardware = Hardware(gpu=find_gpu(gpu_name), num_gpus_per_node=local, num_nodes=max(1, world_size // local))
    validate_parallel(spec, plan, hardware)
    return layout, spec, hardware


def run(args, name, model_config, plan, layout, spec, hardware) -> int:
    import torch
    import torch.distributed as dist

    from memkit.calibrate.cpu_step import build_config
    from memkit.measure.live_tensors import LiveTensorTracker

    cuda = torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if cuda else "cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = "nccl" if cuda else "gloo"
    if layout.world_size > 1 or plan.tp > 1:
        if plan.tp > 1 and plan.pp == 1:
            import deepspeed

            deepspeed.init_distributed(dist_backend=backend)
        else:
            dist.init_process_group(backend)

    config = build_config(model_config)
    config.use_cache = False
    dtype = torch.bfloat16 if plan.precision == "bf16-pure" else torch.float32
    step_peaks: list[int] = []
    losses: list[float] = []
    breakdown: dict = {}
    with LiveTensorTracker(keep_history=args.breakdown) as tracker:
        from transformers import AutoModelForCausalLM

        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation=plan.attention, dtype=dtype)
        model.train()
        if plan.checkpointing == "full":
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        step_fn, cleanup = _engine(model, plan, layout, device, args.lr, tracker)
        data = batches(config.vocab_size, plan, seed=args.seed, steps=args.steps,
                       distinct=args.distinct_batches, dp_rank=layout.dp_rank)
        from memkit.train import collector

        collector.resume()  # set-up's cycles freed before the measured steps
        for step, ids in enumerate(data):
            tracker.reset_peak()
            loss = step_fn(ids.to(device))
            step_peaks.append(int(tracker.peak_bytes))
            losses.append(loss)
            if args.breakdown:
                breakdown = tracker.live_at(tracker.peak_seq)
            if layout.rank == 0:
                print(f"step {step} loss {loss:.6f} peak {step_peaks[-1]} B", flush=True)
        cleanup()
        del model, step_fn, cleanup

    gathered = [None] * layout.world_size
    if dist.is_initialized():
        dist.all_gather_object(gathered, {"layout": layout.to_dict(), "step_peaks": step_peaks,
                                          "breakdown": breakdown})
    else:
        gathered = [{"layout": layout.to_dict(), "step_peaks": step_peaks, "breakdown": breakdown}]
    if layout.rank == 0:
        _write_log(Path(args.out), name, plan, layout, spec, hardware, losses, gathered)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    return 0


def _engine(model, plan: TrainingPlan, layout, device, lr: float, tracker):
    """(step_fn(ids) -> loss, cleanup) for the plan's split. Parameters, gradients and optimizer
    states are tagged on `tracker` as they appear (for --breakdown)."""
    import torch
    import torch.distributed as dist

    from memkit.train import parallel

    if plan.tp > 1 and plan.pp == 1:
        from memkit.emit.deepspeed import deepspeed_config

        # The emitter's file as written, with the optimizer passed in (torch AdamW, as in the reference).
        ds = deepspeed_config(plan, lr=lr, optimizer_block=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        engine, _ = parallel.apply_tensor_parallel(model.to(device), plan, ds, optimizer=optimizer)
        dp_group = _deepspeed_dp_group()
        _settle_head_gather(tracker, engine.module.lm_head, device, plan)

        def step_fn(ids):
            total = 0.0
            for micro in ids.split(plan.micro_batch_size):
                loss = engine(input_ids=micro, labels=micro).loss
                engine.backward(loss)  # DeepSpeed divides by gradient_accumulation_steps
                _tag_states(tracker, engine.module, optimizer)
                engine.step()  # steps the optimizer at the accumulation boundary only
                total += float(loss.detach()) / plan.grad_accum
            return _mean_over(total, dp_group, layout.dp, device)

        def cleanup():
            engine.destroy()  # frees DeepSpeed's hooks and groups' references before exit

        return step_fn, cleanup

    if plan.pp > 1:
        pipe = parallel.apply_pipeline_parallel(model, plan, layout, device=device)
        if plan.tp > 1 and layout.is_last_stage:
            _settle_head_gather(tracker, pipe.module.lm.lm_head, device, plan)
        optimizer = torch.optim.AdamW(pipe.parameters(), lr=lr, weight_decay=0.0)

        def step_fn(ids):
            loss = pipe.step(ids, ids)
            _tag_states(tracker, pipe.module, optimizer)
            pipe.clip_grad_norm_(plan.gradient_clipping)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss

        return step_fn, lambda: None

    # Reference: one whole model per rank, gradients averaged over data-parallel ranks.
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    autocast = (lambda: torch.autocast(device.type, dtype=torch.bfloat16)) if plan.precision == "bf16" \
        else contextlib.nullcontext

    def step_fn(ids):
        num_tokens = parallel.count_target_tokens(ids)
        total = 0.0
        for micro in ids.split(plan.micro_batch_size):
            with autocast():
                logits = model(input_ids=micro).logits
            loss = parallel.causal_lm_loss(logits, micro, num_tokens)
            del logits
            loss.backward()
            total += float(loss.detach())
        if layout.dp > 1:
            parallel._all_reduce_coalesced([p.grad for p in model.parameters() if p.grad is not None],
                                           group=None, average_by=layout.dp)
        _tag_states(tracker, model, optimizer)
        if plan.gradient_clipping > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), plan.gradient_clipping)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return _mean_over(total, None, layout.dp, device) if dist.is_initialized() else total

    return step_fn, lambda: None


def _settle_head_gather(tracker, head, device, plan: TrainingPlan, timeout_s: float = 1.0) -> None:
    """CPU (gloo) runs: after the tensor-parallel LM head's forward, wait until the temporaries of
    its logits all-gather (the local logits shard and the gather buffer) are freed, so that the
    measured peak does not depend on thread scheduling. Nothing in Python refers to them once the
    head returns, but ProcessGroupGloo's worker thread keeps a finished collective's tensors until
    it re-takes its queue lock and drops the work, after wait() has returned to the caller
    (pytorch/pytorch torch/csrc/distributed/c10d/ProcessGroupGloo.cpp, ProcessGroupGloo::runLoop),
    and the tracker's storages (Python objects) are released under the GIL. Measured on the
    tp=2 x pp=2 last stage without this wait: +0, +132 KB (alive through log_softmax) or +393 KB
    (alive into the loss backward) on the same step, by run and rank. Not under autocast, whose
    cached bf16 weight copy is born in the head and stays."""
    if device.type != "cpu" or head is None or plan.precision == "bf16":
        return
    born = {}

    def before(module, args):
        born["seq"] = tracker.now_seq

    def after(module, args, output):
        deadline = time.monotonic() + timeout_s
        while tracker.live_born_after(born["seq"], exclude=[output]) and time.monotonic() < deadline:
            time.sleep(0.001)  # releases the GIL for the gloo worker

    head.register_forward_pre_hook(before)
    head.register_forward_hook(after)


def _tag_states(tracker, module, optimizer) -> None:
    params = list(module.parameters())
    tracker.tag(params, "param", adopt=False)
    tracker.tag([p.grad for p in params if p.grad is not None], "grad", adopt=False)
    states = [v for st in optimizer.state.values() for v in st.values() if hasattr(v, "untyped_storage")]
    tracker.tag(states, "optimizer", adopt=False)


def _deepspeed_dp_group():
    from deepspeed.utils import groups

    return groups._get_data_parallel_group()


def _mean_over(value: float, group, size: int, device) -> float:
    import torch
    import torch.distributed as dist

    if size == 1:
        return value
    t = torch.tensor(value, dtype=torch.float64, device=device)
    dist.all_reduce(t, group=group)
    return float(t) / size


def _write_log(path: Path, name, plan, layout, spec, hardware, losses, gathered) -> None:
    from memkit.estimate.memory import estimate_memory

    est = estimate_memory(spec, plan, hardware, device="cpu")
    path.parent.mkdir(parents=True, exist_ok=True)
    records = [{"event": "start", "model": name, "model_type": spec.model_type, "num_params": spec.num_params,
                "world_size": layout.world_size, "ranks": [g["layout"]["rank"] for g in gathered],
                "degrees": {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp},
                "tp_engine": plan.tp_engine if plan.tp > 1 else None,
                "pp_engine": plan.pp_engine if plan.pp > 1 else None,
                "pp_schedule": plan.pp_schedule if plan.pp > 1 else None,
                "layout": [g["layout"] for g in gathered], "plan": plan.to_dict()}]
    for step, loss in enumerate(losses):
        records.append({"event": "step", "step": step, "loss": loss,
                        "peak_bytes_by_rank": [g["step_peaks"][step] for g in gathered]})
    records.append({"event": "end", "measured_peak_bytes_by_rank": [g["step_peaks"][-1] for g in gathered],
                    "measured_breakdown_by_rank": [g["breakdown"] for g in gathered],
                    "predicted_worst_rank_bytes": est.allocated_peak_bytes,
                    "predicted_components": est.components, "predicted_peak_phase": est.peak_phase})
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
