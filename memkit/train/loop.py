"""The training loop: Accelerate (+ DeepSpeed when the accelerate config says so) running a plan.

No planning here: the plan arrives decided (config.resolve_plan) and the loop honours it.

Loss normalisation. The loss of an optimizer step is the mean over every target token of the
whole accumulation window on every data-parallel rank: sum(token losses) / T_window. Each
micro-batch's backward gets sum(its token losses) * (accum * dp) / T_window, because both
DeepSpeed (engine._scale_loss_by_gas) and Accelerate divide each micro-batch's loss by `accum`
and the data-parallel all-reduce averages over `dp` ranks; what reaches the weights is then
exactly sum / T_window, so micro 1 x accum 4 and micro 4 x accum 1 give the same update
(the fix Hugging Face describes in "Fixing Gradient Accumulation", huggingface.co/blog/
gradient_accumulation, 2024). T_window is known on every rank without communication because
every rank holds the packed data set and the sampling order (data.Sharding).

Model splits (plan.json with tp or pp > 1; memkit.train.parallel). Tensor parallel runs inside
the DeepSpeed engine (AutoTP: the ds_config's tensor_parallel block), so the loop above holds
with `dp` the plan's data-parallel degree: the data are sharded by RankLayout.dp_rank (every
rank of a TP group reads the same batch, as AutoTP requires) and DeepSpeed averages gradients
over the dp group only. Pipeline parallel replaces the engine: every rank builds the seeded
model, keeps its stage (apply_pipeline_parallel), and each step runs the schedule over the
grad_accum micro-batches (PipelineParallel.step, which normalises by the window's target tokens
the same way), clips by the global norm over all stages and steps a plain torch optimizer;
under tp x pp each stage is also tensor-split (torch DTensor, memkit.train.parallel).
Checkpoints, resume and the final model folder of split runs: memkit.train.split_checkpoint.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from memkit.train.supervise import EXIT_SIGNAL, descendants
from memkit.errors import MemkitError
from memkit.plan.plan import TrainingPlan
from memkit.train.checkpoint import CheckpointManager, CheckpointWriteError, resolve_resume, save_final_model
from memkit.train.config import (DEFAULT_PREEMPT_GRACE_S, RunConfig, fill_deepspeed_autos, lr_at,
                                 resolve_plan, steps_for_epochs)
from memkit.train.data import IGNORE_INDEX, PackedData, Sharding
from memkit.train.parallel import apply_pipeline_parallel, autotp_deepspeed_config, rank_layout
from memkit.train import collector, split_checkpoint
from memkit.train.chunked_loss import find_head
from memkit.train.backward_techniques import activation_context
from memkit.train.techniques import mask_kwargs, micro_loss_sum

EXIT_OOM = 3
STOP_SIGNALS = tuple(EXIT_SIGNAL)
"""SIGTERM, SIGINT, SIGUSR1; exit codes 143, 130, 138. SIGUSR1 is checkpoint-and-exit:
`#SBATCH --signal=B:USR1@T` warns T seconds before the time limit, the job checkpoints, exits
and requeues itself (memkit.cli.launch_script.slurm_script)."""


class OutOfMemory(Exception):
    """A rank ran out of device memory; carries what to report."""

    def __init__(self, where: str, message: str):
        super().__init__(message)
        self.where = where


# ---- small pieces ---------------------------------------------------------------------------

def causal_lm_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over target tokens, in fp32.

    Shift the labels, not the logits, so no copy of the logits is made beyond the fp32 upcast
    (transformers: loss/loss_utils.py, ForCausalLMLoss does the same).
    """
    shifted = torch.nn.functional.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    return torch.nn.functional.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1).to(logits.device),
        ignore_index=IGNORE_INDEX, reduction="sum")


def micro_loss_scale(*, grad_accum: int, dp: int, window_tokens: int) -> float:
    """Factor on each micro-batch's summed token loss so that, after the framework divides by
    grad_accum and the all-reduce averages over dp ranks, the update is sum / window_tokens."""
    return grad_accum * dp / max(1, window_tokens)


def make_accelerator(plan: TrainingPlan, run: RunConfig):
    """Accelerator for this launch. On CPU the process group must be gloo: Accelerate picks no
    backend when no accelerator device is found (accelerate/state.py, _prepare_backend), so a
    DeepSpeed run would otherwise initialise only one rank's view of the world."""
    from datetime import timedelta

    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    handlers = []
    launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
    use_deepspeed = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if launched and not use_deepspeed and not torch.cuda.is_available() \
            and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        # A multi-GPU (torchrun) config on a machine without GPUs, as in a CPU rehearsal: run the
        # processes as Accelerate's MULTI_CPU (gloo) would, which `--cpu` would ask for.
        os.environ["ACCELERATE_USE_CPU"] = "true"
    if launched:
        kwargs = {"timeout": timedelta(seconds=run.dist_timeout_s)}
        if not torch.cuda.is_available():
            kwargs["backend"] = "gloo"
        handlers.append(InitProcessGroupKwargs(**kwargs))
    mixed = None
    if not use_deepspeed:
        mixed = {"fp32": "no", "bf16-pure": "no", "bf16": "bf16", "fp16": "fp16"}[plan.precision]
    return Accelerator(kwargs_handlers=handlers, gradient_accumulation_steps=plan.grad_accum,
                       mixed_precision=mixed)


def build_optimizer(params, plan: TrainingPlan, run: RunConfig, *, cpu_offload: bool):
    """The plan's optimizer. With DeepSpeed optimizer offload: DeepSpeedCPUAdam (AdamW mode), the
    optimizer ZeRO-Offload steps on the CPU (Ren et al. 2021, Sec. 4.2)."""
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    # Weight decay on matrices only, not biases/norms (nanoGPT: model.py, configure_optimizers).
    groups = [{"params": decay, "weight_decay": run.weight_decay},
              {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    if plan.optimizer == "adamw":
        if cpu_offload:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, lr=run.lr, betas=run.adam_betas, eps=run.adam_eps,
                                    adamw_mode=True)
        return torch.optim.AdamW(groups, lr=run.lr, betas=run.adam_betas, eps=run.adam_eps)
    if cpu_offload:
        raise MemkitError(f"--optimizer {plan.optimizer} cannot run with optimizer offload; use adamw")
    if plan.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=run.lr, momentum=0.9)
    if plan.optimizer == "adafactor":
        from transformers.optimization import Adafactor

        return Adafactor(groups, lr=run.lr, scale_parameter=False, relative_step=False, warmup_init=False)
    if plan.optimizer == "adamw-8bit":
        try:
            import bitsandbytes as bnb
        except ImportError:
            raise MemkitError("--optimizer adamw-8bit needs bitsandbytes; pip install bitsandbytes "
                              "or use adamw") from None
        return bnb.optim.AdamW8bit(groups, lr=run.lr, betas=run.adam_betas, eps=run.adam_eps)
    if plan.optimizer == "paged-adamw-8bit":  # CUDA unified memory; refused on CPU (memkit/plan/techniques.py)
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(groups, lr=run.lr, betas=run.adam_betas, eps=run.adam_eps)
    raise MemkitError(f"unknown optimizer {plan.optimizer!r}")


class StopFlag:
    """SIGTERM / SIGINT / SIGUSR1 set a flag; the ranks agree at the next step boundary to write
    one checkpoint and exit (EXIT_SIGNAL: 143 / 130 / 138).

    Idempotent: a scheduler signals every process at once (Slurm's scancel and preemption, a
    Kubernetes pod kill) and the launcher relays the signal it got to each rank again (torchrun:
    torch/distributed/elastic/agent/server/api.py, SimpleElasticAgent.run -> _shutdown(e.sigval)
    -> torch/distributed/elastic/multiprocessing/api.py, SubprocessContext._close sends it to every
    worker, waits TORCH_ELASTIC_SHUTDOWN_TIMEOUT, 30 s by default, then SIGKILL; a second signal to
    the launcher raises SignalException inside that wait and its `finally` calls _shutdown
    again, a third copy). So every repeat only re-sets the flag, through the save and the exit.
    A repeat more than `grace_s` after the first (a save that hangs past --preempt-grace) gets
    the default action: the process dies now; the last published checkpoint stays whole
    (memkit.train.checkpoint publishes by rename)."""

    SIGNALS = STOP_SIGNALS

    def __init__(self, grace_s: float = DEFAULT_PREEMPT_GRACE_S) -> None:
        self.signum: int | None = None
        self.first_at: float | None = None
        self.grace_s = grace_s
        self.received: set[int] = set()
        self._old = {}

    def install(self) -> "StopFlag":
        global _ACTIVE
        for sig in self.SIGNALS:
            self._old[sig] = signal.signal(sig, self._handle)
        _ACTIVE = self
        return self

    def _handle(self, signum, frame) -> None:
        now = time.monotonic()
        if self.signum is None:
            self.signum, self.first_at = signum, now
        elif now - self.first_at > self.grace_s:  # past the grace: die as the default action would
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
        self.received.add(signum)

    def flags(self) -> list[float]:
        """One 0/1 per signal of SIGNALS, for the step-boundary all-reduce: 1 for the first signal this
        rank got only. A later one within the grace is a copy of the same stop: torchrun relays a
        SIGUSR1, and when its own second copy arrives inside that wait, its `finally` shuts the workers
        down with the default SIGTERM (torch/distributed/elastic/agent/server/api.py, SimpleElasticAgent
        .run; local_elastic_agent.py, _shutdown(death_sig=SIGTERM)); counted, it turned a SIGUSR1 stop
        into a SIGTERM one (exit 143, measured by benchmarks/preempt_trials.py)."""
        return [1.0 if sig == self.signum else 0.0 for sig in self.SIGNALS]

    def restore(self) -> None:
        global _ACTIVE
        for sig, old in self._old.items():
            signal.signal(sig, old)
        if _ACTIVE is self:
            _ACTIVE = None


_ACTIVE: StopFlag | None = None
"""The installed StopFlag: memkit.train.main installs it before anything slow, so a signal during
setup is kept too and acted on at the first step boundary."""


def restore_stop_flag() -> None:
    """The installed StopFlag's handlers replaced by those it found (an in-process run is over)."""
    if _ACTIVE is not None:
        _ACTIVE.restore()


def stop_flag(grace_s: float) -> StopFlag:
    """The installed StopFlag (with this grace), or a newly installed one."""
    if _ACTIVE is not None:
        _ACTIVE.grace_s = grace_s
        return _ACTIVE
    return StopFlag(grace_s).install()


def _loss_scale(accelerator, optimizer, engine) -> float | None:
    if engine is not None:
        inner = getattr(engine, "optimizer", None)
        for obj in (inner, getattr(inner, "loss_scaler", None)):
            value = getattr(obj, "cur_scale", None)
            if value is not None:
                return float(value)
        return None
    scaler = getattr(accelerator, "scaler", None)
    return float(scaler.get_scale()) if scaler is not None else None


class JsonlLog:
    def __init__(self, path: Path | None) -> None:
        self.path = path
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)

    def write(self, record: dict) -> None:
        if self.path is None:
            return
        with open(self.path, "a") as handle:
            handle.write(json.dumps({"time": round(time.time(), 3), **record}, sort_keys=True) + "\n")


def _versions() -> dict:
    import accelerate
    import transformers

    import memkit

    out = {"memkit": getattr(memkit, "__version__", "?"), "torch": torch.__version__,
           "transformers": transformers.__version__, "accelerate": accelerate.__version__}
    if "deepspeed" in sys.modules:  # a DeepSpeed run imported it already
        out["deepspeed"] = sys.modules["deepspeed"].__version__
    else:  # a run without DeepSpeed need not import it (~0.6 CPU s a rank, measured) to name its version:
        # deepspeed/__init__.py's __version__ is git_version_info_installed.version, the version_str
        # microsoft/DeepSpeed setup.py writes there and installs the package as (setup(version=...)).
        from importlib.metadata import PackageNotFoundError, version
        try:
            out["deepspeed"] = version("deepspeed")
        except PackageNotFoundError:
            pass
    return out


# ---- the run ------------------------------------------------------------------------------------

@dataclass(slots=True, kw_only=True)
class _Run:
    """One run's live state: built by _setup, advanced by _steps, reported by _finish."""

    run: RunConfig
    plan: TrainingPlan
    plan_doc: dict | None
    data: PackedData
    tokenizer: object
    accelerator: object
    ds_config: dict | None
    layout: object
    model: object
    optimizer: object
    engine: object
    pipe: object
    meter: object
    sharding: Sharding
    manager: CheckpointManager
    log: JsonlLog
    board: object
    """The --report-to logger on the main process (memkit.train.loggers.open_board), else None."""
    start_record: dict
    flops_per_token: float
    peak_tflops: float | None
    start_step: int
    tokens_seen: int
    step: int = 0
    losses: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    eval_losses: dict = field(default_factory=dict)
    """step -> eval loss (mean over the eval set's target tokens)."""
    model_config: object = None
    """The transformers config (the pipeline's final save rebuilds the HF folder from it)."""
    interrupted_by: int | None = None

    @property
    def main(self) -> bool:
        return self.accelerator.is_main_process

    @property
    def world(self) -> int:
        return self.accelerator.num_processes

    @property
    def tokens_per_step(self) -> int:
        return self.plan.micro_batch_size * self.plan.grad_accum * self.plan.dp * self.data.seq_len


def train(*, plan_in: TrainingPlan | None, flags: dict, run: RunConfig, data: PackedData, tokenizer,
          model_source, model_config, plan_doc: dict | None, tracker=None) -> dict:
    """Run the training; return the report dict (the same on every rank)."""
    state = _setup(plan_in=plan_in, flags=flags, run=run, data=data, tokenizer=tokenizer,
                   model_source=model_source, model_config=model_config, plan_doc=plan_doc, tracker=tracker)
    collector.resume()  # set-up's cycles freed, its survivors frozen (memkit/train/collector.py)
    _steps(state)
    return _finish(state)


def _setup(*, plan_in, flags, run: RunConfig, data: PackedData, tokenizer, model_source, model_config,
           plan_doc, tracker) -> _Run:
    """Accelerator, the resolved plan, model + optimizer (engine), checkpoint restore, the start
    record and the console lines a user reads before step 1."""
    from accelerate.utils import DistributedType

    from memkit.measure.runtime import MemoryMeter, gpu_peak_tflops, train_flops_per_token
    from memkit.train.output_dir import clear_run_outputs

    # A provisional plan decides grad accumulation / mixed precision for the Accelerator; the
    # DeepSpeed file is only readable once Accelerate has parsed it.
    provisional = plan_in or TrainingPlan(**{k: (tuple(v) if k == "lora_targets" else v)
                                             for k, v in flags.items() if v is not None})
    _ops_before_process_group(provisional)
    accelerator = make_accelerator(provisional, run)
    is_ds = accelerator.distributed_type == DistributedType.DEEPSPEED
    ds_config = accelerator.state.deepspeed_plugin.deepspeed_config if is_ds else None
    plan = resolve_plan(plan=plan_in, flags=flags, ds_config=ds_config,
                        world_size=accelerator.num_processes,
                        distributed_type=str(accelerator.distributed_type).split(".")[-1])
    if plan.grad_accum != accelerator.gradient_accumulation_steps:
        accelerator.gradient_accumulation_steps = plan.grad_accum
    if is_ds:
        fill_deepspeed_autos(ds_config, plan)
    world = accelerator.num_processes
    layout = rank_layout(plan, rank=accelerator.process_index, world_size=world)
    if is_ds and plan.tp > 1:  # AutoTP: the tensor_parallel block and DeepSpeed's batch arithmetic
        ds_config.update(autotp_deepspeed_config(ds_config, plan))
    main = accelerator.is_main_process
    out_dir = run.output_dir
    sharding = Sharding(num_sequences=data.num_sequences, micro_batch_size=plan.micro_batch_size,
                        grad_accum=plan.grad_accum, dp=plan.dp, seed=run.seed, shuffle=run.shuffle)
    if run.num_epochs is not None:  # --num-epochs: enough steps to pass over the data that often
        run = dataclasses.replace(run, max_steps=steps_for_epochs(
            run.num_epochs, num_sequences=data.num_sequences, global_batch_size=sharding.global_batch_size))
    if run.overwrite and main:
        removed = clear_run_outputs(out_dir)
        if removed:
            print(f"memkit: --overwrite: removed {', '.join(p.name for p in removed)} from {out_dir}",
                  file=sys.stderr)
    accelerator.wait_for_everyone()
    log = JsonlLog(out_dir / "log.jsonl" if main else None)
    device = accelerator.device

    if plan.pp > 1:
        pipe, optimizer, num_params, num_trainable = _pipeline_and_optimizer(
            plan, run, layout, model_source, model_config, device=device)
        model = pipe.module
    else:
        pipe = None
        model, optimizer, num_params, num_trainable = _model_and_optimizer(
            accelerator, plan, run, model_source, model_config, ds_config=ds_config, task=data.task,
            pad_token_id=tokenizer.pad_token_id)
    meter = MemoryMeter(device, tracker=tracker)

    manager = CheckpointManager(out_dir / "checkpoints", accelerator, keep=run.keep_checkpoints)
    start_step, tokens_seen, resumed_from = 0, 0, None
    resume_path = resolve_resume(run.resume, manager)
    manager = split_checkpoint.manager_for(plan, manager.root, accelerator, keep=run.keep_checkpoints,
                                           resume_path=resume_path, pipe=pipe, model=model, optimizer=optimizer,
                                           model_config=model_config)
    if resume_path is not None:
        state = manager.load(resume_path)
        if state.get("data_fingerprint") != data.fingerprint():
            raise MemkitError(f"--resume {resume_path}: the data differ from the checkpoint's "
                              f"(fingerprint {data.fingerprint()} vs {state.get('data_fingerprint')}); "
                              "resume with the same --data, --seq-len and tokenizer")
        start_step, tokens_seen, resumed_from = state["step"], state["tokens_seen"], str(resume_path)

    flops_per_token = train_flops_per_token(
        num_params=num_params, num_trainable_params=num_trainable,
        num_layers=getattr(model_config, "num_hidden_layers", 0) or 0,
        hidden_size=getattr(model_config, "hidden_size", 0) or 0, seq_len=data.seq_len,
        embedding_params=min(_lookup_params(model_source), num_params))
    peak_tflops = gpu_peak_tflops(device, plan.precision)
    evaluation = data.eval
    start_record = {
        "event": "start", "world_size": world, "distributed_type": str(accelerator.distributed_type).split(".")[-1],
        "degrees": {"dp": plan.dp, "tp": plan.tp, "pp": plan.pp}, "layout": layout.to_dict(),
        "split_engines": {"tp": "deepspeed-autotp" if plan.tp > 1 else None,
                          "pp": f"torch.distributed.pipelining-{plan.pp_schedule}" if plan.pp > 1 else None},
        "backend": accelerator.state.backend, "device": str(device), "plan": plan.to_dict(),
        "deepspeed_config": ds_config, "num_params": num_params, "num_trainable_params": num_trainable,
        "data": {"source": data.source, "kind": data.kind, "num_sequences": data.num_sequences,
                 "seq_len": data.seq_len, "num_documents": data.num_documents, "task": data.task,
                 "target_len": data.target_len,
                 "fingerprint": data.fingerprint(),
                 "eval": None if evaluation is None else {"source": evaluation.source,
                                                          "num_sequences": evaluation.num_sequences}},
        "lr": run.lr, "lr_scaling": run.lr_scaling_note, "max_steps": run.max_steps,
        "num_epochs": run.num_epochs, "eval_every": run.eval_every,
        "start_step": start_step, "resumed_from": resumed_from, "versions": _versions(),
        "memory_kind": meter.kind, "peak_tflops": peak_tflops}
    log.write(start_record)
    from memkit.train.loggers import open_board

    board = open_board(run.report_to, out_dir, config={"lr": run.lr, "max_steps": run.max_steps,
                                                      **plan.to_dict()}) if main else None
    if main:
        _say_start(run, plan, world, data, resumed_from=resumed_from, start_step=start_step)
    if meter.kind == "live-tensors" and plan_doc and plan_doc.get("hardware"):
        from memkit.train.report import cpu_priced

        plan_doc = cpu_priced(plan_doc, plan, model_source.config_path)  # what a live-tensor peak is compared with
    return _Run(run=run, plan=plan, plan_doc=plan_doc, data=data, tokenizer=tokenizer, accelerator=accelerator,
                ds_config=ds_config, layout=layout, model=model, optimizer=optimizer,
                engine=model if is_ds else None, pipe=pipe, meter=meter, sharding=sharding, manager=manager,
                log=log, board=board, start_record=start_record, flops_per_token=flops_per_token,
                peak_tflops=peak_tflops, start_step=start_step, tokens_seen=tokens_seen, step=start_step,
                model_config=model_config)


def _ops_before_process_group(plan: TrainingPlan) -> None:
    """The DeepSpeed ops this launch loads, built or loaded before the Accelerator starts the
    process group (memkit.train.ops.prepare_ops: stale locks removed, builds announced by local
    rank 0, this install's extensions root). The DeepSpeed file is the one `accelerate launch`
    hands every rank (accelerate/utils/launch.py: ACCELERATE_DEEPSPEED_CONFIG_FILE)."""
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() != "true":
        return
    from memkit.train.ops import prepare_ops

    try:
        ds_config = json.loads(Path(os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"]).read_text())
    except (KeyError, OSError, ValueError):
        return  # Accelerate reports a missing or broken DeepSpeed file itself
    if not isinstance(ds_config, dict):
        return
    with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed logs to stdout on import
        prepare_ops(plan, ds_config, say=int(os.environ.get("LOCAL_RANK", "0")) == 0)


def _lookup_params(model_source) -> int:
    """Parameters no matmul uses (the embedding lookups; a tied LM head still multiplies; inactive
    experts of an MoE): the same N the predicted MFU counts (estimate/throughput.py matmul_params on
    the model's ModelSpec), so measured and predicted MFU compare like with like."""
    from memkit.estimate.throughput import matmul_params
    from memkit.spec.hf import load_model_spec

    try:
        spec = load_model_spec(str(model_source.config_path))
    except MemkitError:  # a config memkit cannot price: count every parameter (the PaLM N as measured)
        return 0
    return max(0, spec.num_params - matmul_params(spec))


def _say_start(run: RunConfig, plan: TrainingPlan, world: int, data: PackedData, *, resumed_from, start_step) -> None:
    if run.lr_scaling_note:
        print(f"memkit: {run.lr_scaling_note}", file=sys.stderr)
    if run.num_epochs is not None:
        print(f"memkit: --num-epochs {run.num_epochs:g} = {run.max_steps} steps ({data.num_sequences} "
              f"sequences, {plan.micro_batch_size * plan.grad_accum * plan.dp} per step)", file=sys.stderr)
    if resumed_from is not None:
        print(f"memkit: resumed from step {start_step} ({resumed_from}); continuing to step {run.max_steps}",
              file=sys.stderr)
    elif run.resume is not None:
        print("memkit: --resume: no checkpoint yet, starting at step 0", file=sys.stderr)
    if data.eval is not None and plan.pp > 1:
        print("memkit: eval loss is not computed for pipeline-split runs yet", file=sys.stderr)
    if plan.tp > 1 or plan.pp > 1:
        print(f"memkit: {world} processes = dp {plan.dp} x tp {plan.tp} x pp {plan.pp}", file=sys.stderr)


def _steps(st: _Run) -> None:
    """Optimizer steps from st.step to max_steps; a signal stops at the next step boundary after a
    checkpoint (st.interrupted_by)."""
    from memkit.measure.runtime import mfu

    run, plan, data, accelerator = st.run, st.plan, st.data, st.accelerator
    rank, dp, data_rank, device = accelerator.process_index, plan.dp, st.layout.dp_rank, accelerator.device
    is_ds = st.engine is not None
    stop = stop_flag(run.preempt_grace_s)
    last_save_at = time.monotonic()  # the time cadence counts from the start (or the resume)
    slow_warned = False
    progress = None
    if st.main and run.progress:
        from tqdm.auto import tqdm

        progress = tqdm(total=run.max_steps, initial=st.step, unit="step", dynamic_ncols=True, file=sys.stderr)
    st.model.train()
    try:
        while st.step < run.max_steps:
            t0 = time.perf_counter()
            lr = lr_at(st.step, peak_lr=run.lr, warmup_steps=run.warmup_steps, max_steps=run.max_steps,
                       decay=run.lr_decay, min_lr_ratio=run.min_lr_ratio)
            for group in st.optimizer.param_groups:
                group["lr"] = lr
            window = st.sharding.step_indices(st.step)
            window_tokens = int(data.loss_tokens[torch.as_tensor(window.reshape(-1))].sum())
            scale = micro_loss_scale(grad_accum=plan.grad_accum, dp=dp, window_tokens=window_tokens)
            if run.debug_oom_at_step == st.step + 1 and rank == 0:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB "
                                             "(simulated: MEMKIT_DEBUG_OOM_AT_STEP)")
            micro_batches = st.sharding.rank_micro_batches(st.step, data_rank)
            if st.pipe is not None:
                loss, grad_norm = _pipeline_step(st.pipe, st.optimizer, data, micro_batches, plan)
                # Every rank holds the step's mean loss: rank 0 alone carries it into the sum below.
                local_loss = loss * window_tokens if rank == 0 else 0.0
                skipped = False
            else:
                local_loss, grad_norm = _accumulate_window(
                    accelerator, st.model, st.optimizer, data, micro_batches,
                    device=device, scale=scale, clip=plan.gradient_clipping, is_ds=is_ds,
                    forward_context=lambda: activation_context(
                        st.model, plan, copy_on_cpu=run.debug_offload_copy_on_cpu))
                if st.layout.tp_rank:  # the ranks of a TP group saw one batch: count it once
                    local_loss = local_loss * 0
            if is_ds:
                grad_norm = st.engine.get_global_grad_norm()
                skipped = not st.engine.was_step_applied()
            elif st.pipe is None:
                skipped = bool(accelerator.optimizer_step_was_skipped)
            if run.debug_signal_at_step == st.step + 1 and rank == 0:
                # As a scheduler would: SIGTERM to the launcher, which forwards it to every rank.
                launched = int(os.environ.get("LOCAL_RANK", -1)) != -1
                os.kill(os.getppid() if launched else os.getpid(), signal.SIGTERM)
            # One collective per step: the window's loss sum, which stop signals any rank has had,
            # and rank 0's "the time cadence is due". The flags are 0/1, so their sum is > 0 exactly
            # when their max is 1: every rank reads the same answer and they all save at this step.
            timed = rank == 0 and run.save_every_minutes > 0 and \
                time.monotonic() - last_save_at >= run.save_every_minutes * 60
            stats = torch.tensor([float(local_loss), *stop.flags(), 1.0 if timed else 0.0],
                                 dtype=torch.float64, device=device)
            if st.world > 1:
                torch.distributed.all_reduce(stats)
            stats = stats.cpu()
            stop_by = next((sig for sig, n in zip(StopFlag.SIGNALS, stats[1:-1].tolist()) if n > 0), None)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            step_time = time.perf_counter() - t0
            st.step += 1
            st.tokens_seen += st.tokens_per_step
            st.step_times.append(step_time)
            last_loss = float(stats[0]) / max(1, window_tokens)
            st.losses.append(last_loss)
            mem = st.meter.sample()
            tokens_per_s = st.tokens_per_step / step_time
            record = {"event": "step", "step": st.step, "loss": last_loss, "lr": lr,
                      "tokens": st.tokens_per_step, "target_tokens": window_tokens, "tokens_seen": st.tokens_seen,
                      "step_time_s": step_time, "tokens_per_s": tokens_per_s,
                      "grad_norm": None if grad_norm is None else float(grad_norm), "skipped": skipped,
                      "loss_scale": _loss_scale(accelerator, st.optimizer, st.engine),
                      "epoch": st.sharding.epoch_of(st.step),
                      "mfu": mfu(tokens_per_s, st.flops_per_token, st.peak_tflops), **mem.to_dict()}
            st.log.write(record)
            _board_step(st.board, record)
            want_stop = stop_by is not None
            if not want_stop and run.eval_every and st.step % run.eval_every == 0:
                _evaluate(st)
            if progress is not None:
                progress.set_postfix(_postfix(record, mem, st), refresh=False)
                progress.update(1)
            periodic = (run.save_every and st.step % run.save_every == 0
                        or float(stats[-1]) > 0) and st.step < run.max_steps
            if want_stop and st.main:
                print(f"memkit: {signal.Signals(stop_by).name}: checkpoint at step {st.step}, then exit "
                      f"{EXIT_SIGNAL[stop_by]}; repeated signals are ignored for {run.preempt_grace_s:g} s "
                      "(--preempt-grace)", file=sys.stderr)
            if periodic or want_stop:
                crash = run.debug_crash_in_save_at_step == st.step
                t_save = time.monotonic()
                if run.debug_signal_in_save_at_step == st.step and rank == 0:
                    _signal_launcher_and_ranks(signal.SIGTERM)  # lands while the save below runs
                path = _save_checkpoint(st, crash_before_publish=crash)
                last_save_at = time.monotonic()
                save_s = last_save_at - t_save
                st.log.write({"event": "checkpoint", "step": st.step, "path": str(path), "save_s": round(save_s, 3),
                              "reason": signal.Signals(stop_by).name if want_stop else
                              "save-every" if run.save_every and st.step % run.save_every == 0 else "save-every-minutes"})
                if st.main and not slow_warned and step_time + save_s > run.preempt_grace_s:
                    slow_warned = True  # a stop waits for the step in flight, then saves
                    print(f"memkit: warning: a step ({step_time:.1f} s) plus a checkpoint ({save_s:.1f} s) take "
                          f"longer than --preempt-grace {run.preempt_grace_s:g} s: a scheduler's SIGKILL may come "
                          "before a signal's checkpoint is written; raise the scheduler's grace (Slurm KillWait, "
                          "--signal lead time) and --preempt-grace", file=sys.stderr)
            if want_stop:
                st.interrupted_by = stop_by
                break
    except torch.OutOfMemoryError as exc:
        raise OutOfMemory(f"step {st.step + 1}", str(exc).splitlines()[0]) from None
    finally:
        if st.interrupted_by is None:
            stop.restore()  # a stopping run keeps ignoring repeats through _finish and the exit
        if progress is not None:
            progress.close()


def _save_checkpoint(st: _Run, *, crash_before_publish: bool) -> Path:
    """Collective: the checkpoint of st.step. A write fault on any rank (disk full, read-only,
    permission, quota; checkpoint.CheckpointWriteError) is said once by rank 0 and every rank
    exits with its code at once (as main does for a MemkitError: peers would wait in teardown)."""
    state = {**_trainer_state(st.step, st.tokens_seen, st.data, st.plan, st.run, st.world),
             **split_checkpoint.trainer_state_extra(st.manager)}
    try:
        return st.manager.save(st.step, state, crash_before_publish=crash_before_publish)
    except CheckpointWriteError as exc:
        if st.main:
            print(f"memkit: {exc}", file=sys.stderr, flush=True)
        with contextlib.suppress(OSError):  # log.jsonl may sit on the same full file system
            st.log.write({"event": "checkpoint_failed", "step": st.step, "error": str(exc)})
        sys.stderr.flush()
        os._exit(exc.exit_code)


def _signal_launcher_and_ranks(sig: int) -> None:
    """Testing aid: `sig` to the launcher and to every rank at once, as Slurm's scancel or a
    Kubernetes pod kill does (the ranks are the launcher's children)."""
    launcher = os.getppid()
    for pid in [launcher, *descendants(launcher)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def _postfix(record: dict, mem, st: _Run) -> dict:
    postfix = {"loss": f"{record['loss']:.4f}", "lr": f"{record['lr']:.2e}", "tok/s": f"{record['tokens_per_s']:,.0f}"}
    if st.eval_losses:
        postfix["eval"] = f"{st.eval_losses[max(st.eval_losses)]:.4f}"
    if mem.allocated_peak_bytes is not None:
        postfix["peak"] = f"{mem.allocated_peak_bytes / 2**30:.2f}GiB"
    if record["mfu"] is not None:
        postfix["mfu"] = f"{record['mfu']:.1%}"
    return postfix


BOARD_SCALARS = {"loss": "train/loss", "lr": "train/lr", "grad_norm": "train/grad_norm",
                 "tokens_per_s": "train/tokens_per_s", "step_time_s": "train/step_time_s",
                 "mfu": "train/mfu", "allocated_peak_bytes": "memory/allocated_peak_bytes",
                 "reserved_peak_bytes": "memory/reserved_peak_bytes"}
"""log.jsonl step field -> TensorBoard tag."""


def _board_step(board, record: dict) -> None:
    if board is None:
        return
    for key, tag in BOARD_SCALARS.items():
        if record.get(key) is not None:
            board.add_scalar(tag, record[key], global_step=record["step"])


def _evaluate(st: _Run) -> float | None:
    """Mean next-token loss over the eval set's target tokens (collective: every rank calls it).

    The eval sequences are split over the data-parallel ranks in rounds of micro_batch_size
    each; every rank runs the same number of forward passes (ZeRO-3 gathers parameters in each
    one), a rank past the end re-reads sequence 0 with every label masked."""
    evaluation = st.data.eval
    if evaluation is None:
        return None
    if st.pipe is not None:
        return _record_eval(st, *_evaluate_pipeline(st))
    micro, dp = st.plan.micro_batch_size, st.plan.dp
    device = st.accelerator.device
    totals = torch.zeros(2, dtype=torch.float64)
    st.model.eval()
    with torch.no_grad():
        for start in range(0, evaluation.num_sequences, micro * dp):
            positions = start + st.layout.dp_rank * micro + np.arange(micro)
            valid = torch.as_tensor(positions < evaluation.num_sequences)
            batch = evaluation.batch(np.where(positions < evaluation.num_sequences, positions, 0))
            labels = batch["labels"].masked_fill(~valid.view(-1, *[1] * (batch["labels"].dim() - 1)), IGNORE_INDEX)
            if evaluation.task != "causal-lm":  # seq2seq / classifier rows (memkit/train/task_data.py)
                from memkit.train.model import task_loss_sum

                loss_sum = task_loss_sum(st.model, {**{k: v.to(device) for k, v in batch.items()}, "labels": labels},
                                         evaluation.task)
                totals += torch.tensor([float(loss_sum), float((labels != IGNORE_INDEX).sum())], dtype=torch.float64)
                continue
            logits = st.model(input_ids=batch["input_ids"].to(device),  # masked as the training steps are
                              **{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                 for k, v in mask_kwargs(batch).items()}).logits
            if not st.layout.tp_rank:  # a TP group saw one batch: count it once
                totals[0] += float(causal_lm_loss_sum(logits, labels))
                totals[1] += float((labels[:, 1:] != IGNORE_INDEX).sum())
            del logits
    st.model.train()
    if st.world > 1:
        totals = totals.to(device)
        torch.distributed.all_reduce(totals)
        totals = totals.cpu()
    return _record_eval(st, float(totals[0]), int(totals[1]))


def _evaluate_pipeline(st: _Run) -> tuple[float, int]:
    """(loss sum, target tokens) of the eval set through the pipeline: rounds of micro x accum
    sequences per dp shard (the schedule's micro-batch count is fixed), a shard past the end
    re-reads sequence 0 with every label masked; every rank runs every round."""
    evaluation = st.data.eval
    local = st.plan.micro_batch_size * st.plan.grad_accum
    loss_sum, tokens = 0.0, 0
    for start in range(0, evaluation.num_sequences, local * st.plan.dp):
        positions = start + st.layout.dp_rank * local + np.arange(local)
        valid = torch.as_tensor(positions < evaluation.num_sequences)
        batch = evaluation.batch(np.where(positions < evaluation.num_sequences, positions, 0))
        labels = batch["labels"].masked_fill(~valid[:, None], IGNORE_INDEX)
        round_sum, round_tokens = st.pipe.eval_sums(batch["input_ids"], labels)
        loss_sum, tokens = loss_sum + round_sum, tokens + round_tokens
    return loss_sum, tokens


def _record_eval(st: _Run, loss_sum: float, num_tokens: int) -> float:
    """Log one eval loss (mean over the eval set's target tokens) to log.jsonl and TensorBoard."""
    evaluation = st.data.eval
    loss = loss_sum / max(1, num_tokens)
    st.eval_losses[st.step] = loss
    st.log.write({"event": "eval", "step": st.step, "eval_loss": loss, "eval_tokens": num_tokens,
                  "eval_sequences": evaluation.num_sequences})
    if st.board is not None:
        st.board.add_scalar("eval/loss", loss, global_step=st.step)
    return loss


def _finish(st: _Run) -> dict:
    """Final eval, the final model folder (+ LoRA adapter), the end report; frees the engine."""
    from memkit.measure.runtime import mfu, steady_median
    from memkit.train.report import build_report

    run, plan, accelerator, device = st.run, st.plan, st.accelerator, st.accelerator.device
    out_dir = run.output_dir
    mem = st.meter.sample()  # the training peak, before the eval / final gather / save add their copies
    if st.interrupted_by is None and st.data.eval is not None and st.step not in st.eval_losses:
        _evaluate(st)
    final_dir = None
    if st.interrupted_by is None and run.save_final and plan.tp * plan.pp == 1:
        final_dir = out_dir / "final" if not plan.is_quantized else None  # 4-bit base: the adapter only
        lora_scaling = plan.lora_alpha / plan.lora_rank if plan.is_lora else None
        save_final_model(accelerator, st.model, st.tokenizer, final_dir, lora_scaling=lora_scaling,
                         adapter_dir=out_dir / "adapter" if plan.is_lora else None,
                         base_model=_base_model_path(run))
        _save_probe(accelerator, st.model, st.data, out_dir / "probe_logits.pt", device)
    elif st.interrupted_by is None and run.save_final:  # split runs: memkit.train.split_checkpoint
        final_dir = out_dir / "final"
        if st.pipe is not None:
            split_checkpoint.save_final_pp(st.pipe, st.tokenizer, final_dir, model_config=st.model_config)
            split_checkpoint.save_probe_pp(st.pipe, st.data, out_dir / "probe_logits.pt")
        else:
            split_checkpoint.save_final_tp(st.engine, accelerator.unwrap_model(st.model), st.tokenizer, final_dir,
                                           is_main=st.main)
            _save_probe(accelerator, st.model, st.data, out_dir / "probe_logits.pt", device)
    peaks = torch.tensor([mem.allocated_peak_bytes or 0, mem.reserved_peak_bytes or 0,
                          mem.device_used_peak_bytes or 0, mem.host_rss_peak_bytes or 0],
                         dtype=torch.float64, device=device)
    if st.world > 1:
        torch.distributed.all_reduce(peaks, op=torch.distributed.ReduceOp.MAX)
    peaks = [int(v) for v in peaks.cpu().tolist()]
    tokens_per_s = steady_median([st.tokens_per_step / t for t in st.step_times])
    report = build_report(
        status="interrupted" if st.interrupted_by else "ok", plan=plan, plan_doc=st.plan_doc,
        steps_done=st.step, start_step=st.start_step, losses=st.losses,
        measured={"memory_kind": st.meter.kind,
                  "allocated_peak_bytes": peaks[0] if mem.allocated_peak_bytes is not None else None,
                  "reserved_peak_bytes": peaks[1] if mem.reserved_peak_bytes is not None else None,
                  "device_used_peak_bytes": peaks[2] if mem.device_used_peak_bytes is not None else None,
                  "host_rss_peak_bytes": peaks[3], "tokens_per_s": tokens_per_s,
                  "step_time_s": steady_median(st.step_times),
                  "mfu": mfu(tokens_per_s or 0.0, st.flops_per_token, st.peak_tflops)},
        world_size=st.world, distributed_type=st.start_record["distributed_type"],
        final_dir=str(final_dir) if final_dir else None)
    if st.eval_losses:
        last = max(st.eval_losses)
        report["eval_loss"], report["eval_step"] = st.eval_losses[last], last
    st.log.write({"event": "end", **report})
    if st.board is not None:
        st.board.close()
    if st.main:
        from memkit.train.report import render_report

        print(render_report(report), file=sys.stderr)
        if "eval_loss" in report:
            print(f"eval loss {report['eval_loss']:.4f} at step {report['eval_step']} "
                  f"({st.data.eval.num_sequences} sequences of {st.data.eval.source})", file=sys.stderr)
        if final_dir is not None and plan.is_lora:
            print(f"LoRA adapter saved to {out_dir / 'adapter'} (PeftModel.from_pretrained)", file=sys.stderr)
        if run.report_json is not None:  # a full disk is one line and a non-zero exit (memkit.fileio)
            from memkit.fileio import write_text_atomic

            write_text_atomic(run.report_json, json.dumps(report, indent=1, sort_keys=True), what="--report-json")
    # Free DeepSpeed/DDP state before the process group goes (gloo can hang at exit otherwise).
    st.model = st.optimizer = st.engine = st.pipe = None
    accelerator.free_memory()
    if st.interrupted_by is not None:
        report["exit_code"] = EXIT_SIGNAL[st.interrupted_by]
    return report


def _base_model_path(run: RunConfig) -> str | None:
    """What adapter_config.json names as the base model: the --model folder (absolute) when it
    is a local folder, else the name as given."""
    path = Path(run.model).expanduser()
    return str(path.resolve()) if path.is_dir() else run.model


def _accumulate_window(accelerator, model, optimizer, data: PackedData, micro_batches, *, device,
                       scale: float, clip: float, is_ds: bool, forward_context=contextlib.nullcontext):
    """Forward/backward over one rank's micro-batches of an optimizer step; the optimizer steps at
    the last one (DeepSpeed: inside accelerator.backward). Returns (this rank's loss sum, grad norm)."""
    local_loss = torch.zeros((), dtype=torch.float64)
    grad_norm = None
    for micro in micro_batches:
        batch = {k: v.to(device) for k, v in data.batch(micro).items()}
        with accelerator.accumulate(model):
            # The plan's loss: HF logits + causal_lm_loss_sum, or the chunked head (train/techniques.py).
            with forward_context():  # --offload-activations (train/backward_techniques.py)
                if data.task != "causal-lm":  # seq2seq / classifier rows (memkit/train/task_data.py)
                    from memkit.train.model import task_loss_sum

                    loss_sum = task_loss_sum(model, batch, data.task)
                else:
                    loss_sum = micro_loss_sum(model, find_head(model), batch, causal_lm_loss_sum)
            accelerator.backward(loss_sum * scale)
            if not is_ds:
                if accelerator.sync_gradients and clip > 0:
                    grad_norm = accelerator.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
        local_loss += loss_sum.detach().double().cpu()
    return local_loss, grad_norm


def _pipeline_step(pipe, optimizer, data: PackedData, micro_batches, plan: TrainingPlan):
    """One optimizer step of a pipeline stage: the schedule over this dp shard's micro-batches
    (they become the pipeline's micro-batches, in order), the global-norm clip, the step.
    Returns (the step's mean loss, the same on every rank; the gradient norm before clipping)."""
    batch = data.batch(np.concatenate(micro_batches))
    loss = pipe.step(batch["input_ids"], batch["labels"])
    grad_norm = pipe.clip_grad_norm_(plan.gradient_clipping)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss, grad_norm


def _pipeline_and_optimizer(plan: TrainingPlan, run: RunConfig, layout, model_source, model_config, *, device):
    """The seeded whole model built on every rank, cut to this rank's stage, and a plain torch
    optimizer over the stage's parameters. Returns (pipe, optimizer, num_params, num_trainable)."""
    from memkit.train.model import apply_plan, build_model, count_params

    model = build_model(model_source, model_config, attention=plan.attention, seed=run.seed,
                        pretrained=run.init == "pretrained")
    if plan.precision == "bf16-pure":
        model = model.to(torch.bfloat16)
    model = apply_plan(model, plan)
    num_params, num_trainable = count_params(model)  # the whole model, as the data-parallel path logs
    pipe = apply_pipeline_parallel(model, plan, layout, device=device)
    params = [p for p in pipe.parameters() if p.requires_grad]
    return pipe, build_optimizer(params, plan, run, cpu_offload=False), num_params, num_trainable


def _model_and_optimizer(accelerator, plan: TrainingPlan, run: RunConfig, model_source, model_config, *,
                         ds_config: dict | None, task: str = "causal-lm", pad_token_id: int | None = None):
    """Build the model with the plan's knobs and its optimizer; prepare both (DeepSpeed engine
    under a DeepSpeed config). Returns (model, optimizer, num_params, num_trainable_params)."""
    from memkit.train.model import apply_plan, build_model, count_params, has_batchnorm

    is_ds = ds_config is not None
    if plan.is_quantized:  # the base loaded in 4 bits (memkit/train/quantize.py)
        from memkit.train.model import build_quantized

        model = build_quantized(model_source, model_config, plan, seed=run.seed, device=accelerator.device,
                                pretrained=run.init == "pretrained")
    else:
        model = build_model(model_source, model_config, attention=plan.attention, seed=run.seed,
                            pretrained=run.init == "pretrained", task=task, num_labels=plan.num_labels,
                            pad_token_id=pad_token_id)
    if has_batchnorm(model):
        warnings.warn("the model has BatchNorm layers: gradient accumulation changes their batch "
                      "statistics (each micro-batch is normalised alone), so micro x accum is not "
                      "equivalent to one large batch for them", stacklevel=1)
    if plan.precision == "bf16-pure" and not is_ds:
        model = model.to(torch.bfloat16)
    model = apply_plan(model, plan, task)
    num_params, num_trainable = count_params(model)
    params = [p for p in model.parameters() if p.requires_grad]
    cpu_offload = is_ds and plan.offload_optimizer != "none"
    if is_ds and "optimizer" in ds_config:
        # The DeepSpeed file names the optimizer (FusedAdam on GPU, DeepSpeedCPUAdam under
        # offload): DeepSpeed builds it; Accelerate wants a placeholder (accelerate/utils/deepspeed.py).
        from accelerate.utils import DummyOptim

        optimizer = DummyOptim(params, lr=run.lr)
    elif plan.optimizer_in_backward:  # one optimizer per parameter, stepped in its gradient hook
        from memkit.train.backward_techniques import OptimizerInBackward

        optimizer = OptimizerInBackward(params, lambda ps: build_optimizer(ps, plan, run, cpu_offload=False))
        accelerator.register_for_checkpointing(optimizer)  # saved and restored with the run's state
        return accelerator.prepare(model), optimizer, num_params, num_trainable
    else:
        optimizer = build_optimizer(params, plan, run, cpu_offload=cpu_offload)
        if cpu_offload:
            # We pass DeepSpeedCPUAdam ourselves (with our betas/eps); stop Accelerate from rebuilding
            # it with lr/weight_decay only (accelerate/utils/deepspeed.py, map_pytorch_optim_to_deepspeed).
            ds_config["zero_force_ds_cpu_optimizer"] = False
    model, optimizer = accelerator.prepare(model, optimizer)
    return model, optimizer, num_params, num_trainable


def _trainer_state(step: int, tokens_seen: int, data: PackedData, plan: TrainingPlan, run: RunConfig,
                   world_size: int) -> dict:
    return {"step": step, "tokens_seen": tokens_seen, "world_size": world_size,
            "data_fingerprint": data.fingerprint(), "data_source": data.source, "seed": run.seed,
            "plan": plan.to_dict(), "max_steps": run.max_steps, "saved_at": time.time()}


def _save_probe(accelerator, model, data: PackedData, path: Path, device) -> None:
    """Logits of the trained model on sequence 0, for checking the saved folder (collective)."""
    from memkit.train.model import task_logits

    probe = data.batch([0])
    model.eval()
    with torch.no_grad():
        logits = task_logits(model, {k: v.to(device) for k, v in probe.items()})  # ids, mask (+ decoder ids)
    if accelerator.is_main_process:
        torch.save({"input_ids": probe["input_ids"], "attention_mask": probe["attention_mask"],
                    "logits": logits.float().cpu(), "dtype": str(logits.dtype)}, path)
    accelerator.wait_for_everyone()
    model.train()


def cleanup_distributed() -> None:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        try:
            torch.distributed.barrier()
        finally:
            torch.distributed.destroy_process_group()

