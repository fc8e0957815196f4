"""What a run is told: the TrainingPlan (from plan.json or flags, reconciled with the DeepSpeed
file that actually runs) and the RunConfig (everything that is not a memory knob).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from memkit.errors import MemkitError
from memkit.plan.plan import DEFAULT_LR, TrainingPlan, knob_fields

PLAN_FLAGS = tuple(f.name for f in knob_fields("run"))
"""Plan knobs the runner also takes as flags (runs without a plan.json): memkit/plan/plan.py declares them."""
SCALE_LR = ("none", "linear", "sqrt")
LR_DECAYS = ("cosine", "linear", "constant")
REPORT_TO = ("tensorboard", "wandb", "mlflow", "none")
"""--report-to choices (memkit.train.loggers opens each)."""


DEFAULT_PREEMPT_GRACE_S = 25.0
"""--preempt-grace: under Slurm's default KillWait of 30 s (slurm.conf man page, KillWait: the
seconds between SIGTERM and SIGKILL at a job's end) and torchrun's 30 s shutdown timeout
(torch/distributed/launcher/api.py, LaunchConfig: TORCH_ELASTIC_SHUTDOWN_TIMEOUT)."""
DEFAULT_SAVE_EVERY_MINUTES = 30.0
"""--save-every-minutes: an unannounced kill (SIGKILL, a node lost) costs at most this much work."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RunConfig:
    """Everything about a run that is not a memory knob."""

    model: str
    data: str
    init: str = "pretrained"
    """'pretrained' (the weights --model points at) or 'random' (fresh seeded weights; memkit.train.model.choose_init)."""
    output_dir: Path
    max_steps: int
    lr: float = DEFAULT_LR
    """Peak learning rate for the plan's global batch (after --scale-lr)."""
    base_lr: float = DEFAULT_LR
    """The LR the user asked for, before scaling."""
    lr_scaling_note: str = ""
    warmup_steps: int = 0
    lr_decay: str = "cosine"
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.0
    adam_betas: tuple[float, float] = (0.9, 0.999)
    adam_eps: float = 1e-8
    seed: int = 0
    shuffle: bool = True
    save_every: int = 0
    """Checkpoint every N optimizer steps (0: only on a signal or by time)."""
    save_every_minutes: float = DEFAULT_SAVE_EVERY_MINUTES
    """Also checkpoint when this many minutes have passed since the last one (0: never by time)."""
    preempt_grace_s: float = DEFAULT_PREEMPT_GRACE_S
    """After a stop signal: repeats are ignored this long (memkit.train.loop.StopFlag)."""
    keep_checkpoints: int = 2
    resume: str | None = None
    """None, 'latest' (newest complete checkpoint under output_dir/checkpoints) or a path."""
    save_final: bool = True
    measure: str = "auto"
    """'auto': CUDA counters on GPU, live-tensor tracking on CPU; 'off'."""
    progress: bool = True
    dist_timeout_s: int = 1800
    report_json: Path | None = None
    debug_signal_at_step: int | None = None
    """Testing aid: after this step rank 0 sends SIGTERM to the launcher (its parent process), which
    forwards it to every rank, as a scheduler's preemption does."""
    debug_crash_in_save_at_step: int | None = None
    debug_signal_in_save_at_step: int | None = None
    """Testing aid: rank 0 sends SIGTERM to the launcher and every rank as the checkpoint of this step starts."""
    debug_offload_copy_on_cpu: bool = False
    """Tests: --offload-activations copies saved tensors even on CPU (train/backward_techniques.py)."""
    """Testing aid: every rank dies (os._exit) mid-checkpoint at this step, before it is published."""
    debug_oom_at_step: int | None = None
    """Testing aid (env MEMKIT_DEBUG_OOM_AT_STEP): rank 0 raises torch.OutOfMemoryError at this step."""
    num_epochs: float | None = None
    """--num-epochs: max_steps becomes ceil(num_epochs x sequences / global batch) once the plan is known."""
    eval_every: int = 0
    """Eval loss every N optimizer steps (0: only at the end) when the data have an eval set."""
    report_to: str = "tensorboard"
    """'tensorboard' (event files in output_dir/tensorboard) or 'none'."""
    overwrite: bool = False
    """Replace a run already in output_dir (memkit.train.output_dir)."""

    def validate(self) -> "RunConfig":
        if self.max_steps < 1:
            raise MemkitError(f"--max-steps {self.max_steps} must be >= 1")
        if not self.lr > 0:
            raise MemkitError(f"--lr {self.lr} must be > 0")
        if self.warmup_steps < 0 or self.save_every < 0:
            raise MemkitError("--warmup-steps and --save-every must be >= 0")
        if self.lr_decay not in LR_DECAYS:
            raise MemkitError(f"--lr-decay {self.lr_decay!r} is not one of {', '.join(LR_DECAYS)}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise MemkitError(f"--min-lr-ratio {self.min_lr_ratio} must be in [0, 1]")
        if not self.save_every_minutes >= 0:
            raise MemkitError(f"--save-every-minutes {self.save_every_minutes:g} must be >= 0 (0: never by time)")
        if not self.preempt_grace_s > 0:
            raise MemkitError(f"--preempt-grace {self.preempt_grace_s:g} must be > 0 seconds")
        if self.keep_checkpoints < 1:
            raise MemkitError(f"--keep-checkpoints {self.keep_checkpoints} must be >= 1")
        if self.num_epochs is not None and not self.num_epochs > 0:
            raise MemkitError(f"--num-epochs {self.num_epochs} must be > 0")
        if self.eval_every < 0:
            raise MemkitError(f"--eval-every {self.eval_every} must be >= 0")
        if self.report_to not in REPORT_TO:
            raise MemkitError(f"--report-to {self.report_to!r} is not one of {', '.join(REPORT_TO)}")
        return self


FULL_FT_LR = DEFAULT_LR
"""Peak LR for full fine-tuning with AdamW (memkit.plan.DEFAULT_LR says why)."""
LORA_LR = 2e-4
"""Peak LR for LoRA / QLoRA adapters: 2e-4, what QLoRA used for 7B and 13B models (Dettmers et al.
2023, "QLoRA", Appendix B.2 and Table 9; 1e-4 for 33B and 65B); adapters start at zero
(LoRA's B = 0, Hu et al. 2021, Sec. 4.1) and need a ~10x larger step than full fine-tuning."""


def default_lr(lora_rank: int) -> tuple[float, str]:
    """(lr, the line the run prints) when --lr is not given."""
    if lora_rank:
        return LORA_LR, (f"lr {LORA_LR:g} (LoRA default: QLoRA, Dettmers et al. 2023, App. B.2 - 2e-4 for "
                         "7-13B, 1e-4 for 33-65B models; pass --lr to change it)")
    return FULL_FT_LR, f"lr {FULL_FT_LR:g} (full fine-tuning default, Alpaca recipe; pass --lr to change it)"


def steps_for_epochs(num_epochs: float, *, num_sequences: int, global_batch_size: int) -> int:
    """--num-epochs as optimizer steps: enough to pass over the data that often (at least one)."""
    return max(1, math.ceil(num_epochs * num_sequences / global_batch_size))


def scaled_lr(lr: float, *, rule: str, global_batch_size: int, ref_batch_size: int | None) -> tuple[float, str]:
    """(lr, note) with the LR scaled from the reference batch to the plan's global batch.

    linear: Goyal et al. 2017, "Accurate, Large Minibatch SGD", Sec. 2.1 (lr x k for k x batch).
    sqrt: Malladi et al. 2022, "On the SDEs and Scaling Rules for Adaptive Gradient Algorithms"
    (Adam: lr x sqrt(k)); Krizhevsky 2014, "One weird trick", Sec. 5.
    """
    if rule not in SCALE_LR:
        raise MemkitError(f"--scale-lr {rule!r} is not one of {', '.join(SCALE_LR)}")
    if rule == "none":
        return lr, ""
    if not ref_batch_size or ref_batch_size < 1:
        raise MemkitError(f"--scale-lr {rule} needs --ref-batch-size (the global batch, in sequences, "
                          f"that --lr {lr:g} was tuned for)")
    ratio = global_batch_size / ref_batch_size
    factor = ratio if rule == "linear" else math.sqrt(ratio)
    new_lr = lr * factor
    shown = f"{global_batch_size} / {ref_batch_size}" if rule == "linear" else f"sqrt({global_batch_size} / {ref_batch_size})"
    return new_lr, f"LR scaled {rule}: {lr:g} x {shown} = {new_lr:.6g}"


def lr_at(step: int, *, peak_lr: float, warmup_steps: int, max_steps: int, decay: str,
          min_lr_ratio: float) -> float:
    """LR for optimizer step `step` (0-based): linear warm-up (Goyal et al. 2017, Sec. 2.2), then
    cosine (Loshchilov & Hutter 2017, SGDR, Eq. 5, one cycle without restart) or linear decay
    to min_lr_ratio * peak at the last step."""
    if warmup_steps and step < warmup_steps:
        return peak_lr * (step + 1) / warmup_steps
    if decay == "constant":
        return peak_lr
    span = max(1, max_steps - 1 - warmup_steps)
    progress = min(1.0, max(0.0, (step - warmup_steps) / span))
    floor = min_lr_ratio * peak_lr
    if decay == "linear":
        return peak_lr - (peak_lr - floor) * progress
    return floor + (peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


# ---- the plan -----------------------------------------------------------------------------------

def read_plan_file(path: str | Path) -> tuple[TrainingPlan, dict]:
    """(plan, whole document) from a plan.json written by `memkit suggest --out` (memkit.emit.plan_doc.read)."""
    from memkit.emit import plan_doc

    doc = plan_doc.read(path)
    return doc.plan, doc.data


def plan_model_name(doc: dict) -> str | None:
    from memkit.emit.plan_doc import PlanDocument

    return PlanDocument(doc).model


def knobs_from_deepspeed(ds_config: dict) -> dict:
    """The plan knobs a DeepSpeed config decides ('auto' values left out: the plan fills them)."""
    zero = ds_config.get("zero_optimization") or {}
    out: dict = {"zero_stage": int(zero.get("stage", 0)),
                 "offload_optimizer": (zero.get("offload_optimizer") or {}).get("device", "none") or "none",
                 "offload_params": (zero.get("offload_param") or {}).get("device", "none") or "none"}
    if (ds_config.get("fp16") or {}).get("enabled") is True:
        out["precision"] = "fp16"
    elif (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled") is True:
        bf16 = ds_config.get("bf16") or ds_config.get("bfloat16")
        out["precision"] = "bf16-pure" if bf16.get("bf16_master_weights_and_grads") else "bf16"
    else:
        out["precision"] = "fp32"
    optimizer_type = str((ds_config.get("optimizer") or {}).get("type", "")).lower()
    if optimizer_type:
        out["optimizer"] = {"adamw": "adamw", "adam": "adamw", "sgd": "sgd"}.get(optimizer_type, optimizer_type)
    autotp = (ds_config.get("tensor_parallel") or {}).get("autotp_size", 1)
    out["tp"] = max(1, autotp) if isinstance(autotp, int) and not isinstance(autotp, bool) else 1
    for key, knob in (("train_micro_batch_size_per_gpu", "micro_batch_size"),
                      ("gradient_accumulation_steps", "grad_accum"), ("gradient_clipping", "gradient_clipping")):
        value = ds_config.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[knob] = value
    return out


def _same(knob: str, plan_value, file_value) -> bool:
    if knob == "precision":
        return plan_value == file_value
    if knob == "gradient_clipping":
        return float(plan_value) == float(file_value)
    return plan_value == file_value


def check_flags(plan: TrainingPlan, flags: dict) -> None:
    """MemkitError (one line) for the first plan flag given that contradicts plan.json: the plan
    is what was estimated. None values are flags not given."""
    for knob, value in flags.items():
        if value is None:
            continue
        if knob not in PLAN_FLAGS:
            raise ValueError(f"not a plan flag: {knob}")
        if knob == "lora_targets":
            value = tuple(value)
        if not _same(knob, getattr(plan, knob), value):
            shown = ",".join(value) if knob == "lora_targets" else value
            raise MemkitError(f"--{knob.replace('_', '-')} {shown} contradicts plan.json "
                              f"({knob}={getattr(plan, knob)}); drop the flag or make a new plan")


def resolve_plan(*, plan: TrainingPlan | None, flags: dict, ds_config: dict | None, world_size: int,
                 distributed_type: str, config_file_hint: str = "the DeepSpeed file") -> TrainingPlan:
    """The plan this run executes, with every source agreeing.

    plan.json and flags: a flag that contradicts the plan is an error (the plan is what was
    estimated). The DeepSpeed file is what DeepSpeed runs, so its knobs must match the plan; without
    a plan.json they are taken from it. Without a split the data-parallel degree is the launched
    world size; with tp/pp (plan.json only) dp * tp * pp must be the world size.
    """
    flags = {k: v for k, v in flags.items() if v is not None}
    unknown = set(flags) - set(PLAN_FLAGS)
    if unknown:
        raise ValueError(f"not plan flags: {sorted(unknown)}")
    if "lora_targets" in flags:
        flags["lora_targets"] = tuple(flags["lora_targets"])
    if plan is not None:
        check_flags(plan, flags)
        result = plan
    else:
        result = TrainingPlan(**flags)
    if ds_config is not None:
        file_knobs = knobs_from_deepspeed(ds_config)
        mismatched = [k for k, v in file_knobs.items() if not _same(k, getattr(result, k), v)]
        if plan is None:
            pinned = [k for k in mismatched if k in flags]
            if pinned:
                k = pinned[0]
                raise MemkitError(f"--{k.replace('_', '-')} {flags[k]} contradicts {config_file_hint} "
                                  f"({k}={file_knobs[k]}); drop the flag or edit the file")
            result = result.with_(**{k: file_knobs[k] for k in mismatched}, engine="deepspeed")
        elif mismatched:
            detail = ", ".join(f"{k}: plan {getattr(result, k)} vs file {file_knobs[k]}" for k in mismatched)
            raise MemkitError(f"plan.json and {config_file_hint} disagree ({detail}); launch with the "
                              "accelerate.yaml written beside plan.json or regenerate both")
    else:
        if distributed_type == "FSDP":
            raise MemkitError("the runner drives DeepSpeed or plain DDP/single-process accelerate configs, "
                              "not FSDP; use a DeepSpeed config (memkit suggest writes one)")
        if result.zero_stage or result.offload_optimizer != "none" or result.offload_params != "none":
            raise MemkitError(f"the plan uses ZeRO-{result.zero_stage} (offload {result.offload_optimizer}/"
                              f"{result.offload_params}) but this run is not under DeepSpeed "
                              f"({distributed_type}); launch with `accelerate launch --config_file "
                              "accelerate.yaml` (the DeepSpeed one written beside plan.json)")
        if plan is None:
            result = result.with_(engine="torch")
        if result.tp > 1 and result.tp_engine == "autotp":
            raise MemkitError(f"the plan has tp={result.tp} (DeepSpeed AutoTP) but this run is not under "
                              f"DeepSpeed ({distributed_type}); launch with the accelerate.yaml written "
                              "beside plan.json")
    if ds_config is not None and result.pp > 1:
        raise MemkitError(f"the plan has pp={result.pp}, which runs through torch.distributed.pipelining, "
                          "but this run is under DeepSpeed; launch with the accelerate.yaml written "
                          "beside plan.json (no DeepSpeed file)")
    if result.tp > 1 or result.pp > 1:
        if plan is None and world_size % (result.tp * result.pp) == 0:
            result = result.with_(dp=world_size // (result.tp * result.pp))
        if result.num_gpus != world_size:
            raise MemkitError(f"plan.json splits the model over dp*tp*pp = {result.dp}*{result.tp}*{result.pp} = "
                              f"{result.num_gpus} processes but {world_size} were launched; use num_processes: "
                              f"{result.num_gpus} or make a plan for {world_size} GPUs")
        return result.validate()
    if plan is not None and plan.dp != world_size:
        raise MemkitError(f"plan.json expects {plan.dp} data-parallel processes but {world_size} were "
                          f"launched; use num_processes: {plan.dp} (accelerate launch --num_processes "
                          f"{plan.dp}) or make a plan for {world_size} GPUs")
    return result.with_(dp=world_size).validate()


def fill_deepspeed_autos(ds_config: dict, plan: TrainingPlan) -> list[str]:
    """Replace 'auto' batch/clipping values in a user's DeepSpeed config with the plan's; return keys."""
    from memkit.emit.deepspeed import batch_fields

    values = {**batch_fields(plan), "gradient_clipping": plan.gradient_clipping}
    filled = [key for key in ds_config if key in values and ds_config[key] == "auto"]  # in file order
    for key in filled:
        ds_config[key] = values[key]
    return filled


# ---- model splits ---------------------------------------------------------------------------------

def check_split(plan: TrainingPlan, plan_doc: dict | None, *, config_path: Path, model_name: str,
                env: dict | None) -> None:
    """Before any process group exists: MemkitError (one line, exit 2) unless the runner can run
    `plan`'s tensor/pipeline split on this model and this launch (memkit.plan.parallel
    .validate_parallel, rank_layout).
    env: the launched process's environment (WORLD_SIZE, RANK, LOCAL_WORLD_SIZE); None before
    the launch, when only the plan and the model can be checked."""
    from memkit.emit.plan_doc import PlanDocument
    from memkit.plan.parallel import rank_layout, validate_parallel
    from memkit.spec.hf import spec_from_config

    # --resume / --save-every: split runs checkpoint (memkit.train.split_checkpoint); a resume the
    # checkpoint's layout cannot serve is split_checkpoint.check_resume_layout's one line.
    from memkit.fileio import read_json_object

    spec = spec_from_config(read_json_object(config_path), name=model_name,
                            config_path=str(config_path))
    hardware = PlanDocument({**(plan_doc or {}), "plan": plan.to_dict()}).hardware()
    validate_parallel(spec, plan, hardware)  # the model and the machines the plan was made for
    if env is None:
        return
    world = int(env.get("WORLD_SIZE", "1"))
    rank_layout(plan, rank=int(env.get("RANK", "0")), world_size=world)  # the launched world
    launched_per_node = int(env.get("LOCAL_WORLD_SIZE", world))
    from memkit.plan.parallel import tp_spans_nodes

    if tp_spans_nodes(plan.tp, launched_per_node):
        raise MemkitError(f"tp={plan.tp} but {launched_per_node} processes per node were launched, so a "
                          f"TP group would span nodes; launch a multiple of {plan.tp} processes per node")
