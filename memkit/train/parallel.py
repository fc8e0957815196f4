"""Apply a plan's model parallelism to an HF decoder-only causal LM (torchtitan style: the model
never decides its parallelism; these functions apply the plan they are handed).

Tensor parallel (plan.tp_engine == "autotp"): DeepSpeed AutoTP training. `deepspeed.initialize`
shards the model when the config has `"tensor_parallel": {"autotp_size": tp}` (DeepSpeed 0.19:
deepspeed/runtime/engine.py, _configure_tensor_parallel): q/k/v/gate/up become column-parallel
`LinearLayer`s, o/down row-parallel `LinearAllreduce`s, and in training mode the LM head is
column-parallel with its logits gathered (deepspeed/module_inject/auto_tp.py,
training_column_lm_head). ZeRO 0-2 only. Every rank of a TP group must see the same batch
(DeepSpeed checks it on the first forward): shard data by `RankLayout.dp_rank`, never by rank.

Pipeline parallel (plan.pp_engine == "torch"): torch.distributed.pipelining with one stage per
rank. Each stage is the HF model cut down to its decoder layers (memkit.plan.parallel
.stage_layers, so estimate and run split alike), the embedding on the first stage and the final
norm + LM head on the last; the plan's grad_accum micro-batches are the pipeline micro-batches
(ScheduleGPipe, Huang et al. 2019; Schedule1F1B, Narayanan et al. 2021, Sec. 2.2). A tied
embedding lives on the first and the last stage and their gradients are summed (Megatron-LM's
embedding group, Shoeybi et al. 2019). Data parallel replicas of the pipeline average gradients
over the dp group.

Tensor x pipeline parallel (tp > 1 and pp > 1, memkit.plan.parallel.RUN_TP_PP): the pipeline above,
and inside each stage torch's own tensor parallel (DTensor, parallelize_module with the
Megatron column/row split of STAGE_TP_PLAN, the LM head column-parallel with gathered logits),
as torchtitan combines them (torchtitan/models/llama3/infra/parallelize.py). AutoTP is not used
here because it lives inside the DeepSpeed engine, which the pipeline schedule replaces. The
pipeline, data-parallel and tied-embedding groups are formed per TP rank.

Which splits run with which engine and ZeRO stage, the checks, the rank layout and the stage
split are stated in memkit/plan/parallel.py; this module only applies them (it needs torch).
"""
from __future__ import annotations

import contextlib
import copy
from functools import lru_cache
from typing import Any

from memkit.emit.deepspeed import batch_fields
from memkit.errors import MemkitError
from memkit.plan.parallel import RankLayout, rank_layout, stage_layers  # noqa: F401 (rank_layout: loop.py imports it here)
from memkit.plan.plan import TrainingPlan

# torch is imported inside the functions that need it, so validation stays instant (memkit/ARCHITECTURE.md).

IGNORE_INDEX = -100

# ---- tensor parallel (DeepSpeed AutoTP) ----------------------------------------------------------

def autotp_deepspeed_config(ds_config: dict, plan: TrainingPlan) -> dict:
    """A copy of `ds_config` that runs AutoTP: the tensor_parallel block, and the batch fields as
    DeepSpeed checks them (memkit.plan.parallel.deepspeed_data_ranks: every rank of a TP group counts)."""
    out = copy.deepcopy(ds_config)
    stage = out.get("zero_optimization", {}).get("stage", 0)
    if stage > 2:
        raise MemkitError(f"DeepSpeed config has ZeRO stage {stage}; AutoTP training supports 0-2")
    out["tensor_parallel"] = {"autotp_size": plan.tp}
    out.update(batch_fields(plan))  # the one writer of the batch fields (memkit.emit.deepspeed)
    return out


def apply_tensor_parallel(model, plan: TrainingPlan, ds_config: dict, *, optimizer=None):
    """deepspeed.initialize with AutoTP: returns (engine, optimizer). The process group must exist
    (deepspeed.init_distributed). Parameters are sharded in place by DeepSpeed; pass the client
    optimizer built on model.parameters() (DeepSpeed remaps it to the shards)."""
    import deepspeed

    config = autotp_deepspeed_config(ds_config, plan)
    engine, opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                             model_parameters=None if optimizer else model.parameters())
    return engine, opt


# ---- pipeline parallel (torch.distributed.pipelining) --------------------------------------------

def split_stage_module(model, *, stage: int, num_stages: int, layer_counts: list[int] | None = None):
    """Cut an HF causal LM down to pipeline stage `stage` (in place) and wrap it as a module that
    maps input_ids (first stage) or hidden states to hidden states, or to logits (last stage)."""
    import torch.nn as nn

    base = getattr(model, model.base_model_prefix)
    layers = list(base.layers)
    counts = layer_counts or stage_layers(len(layers), num_stages)
    if len(counts) != num_stages or sum(counts) != len(layers) or min(counts) < 1:
        raise MemkitError(f"stage layer counts {counts} do not split {len(layers)} layers into "
                          f"{num_stages} non-empty stages")
    start = sum(counts[:stage])
    stop = start + counts[stage]
    first, last = stage == 0, stage == num_stages - 1
    base.layers = nn.ModuleList(layers[start:stop])
    # The base model's forward picks each layer's mask by config.layer_types[i] with i the local
    # index, and iterates layers[:num_hidden_layers]: give it a config of this stage's slice.
    # The layers keep the whole config (their sliding windows are set from global indices).
    stage_config = copy.copy(base.config)
    if getattr(stage_config, "layer_types", None) is not None:
        stage_config.layer_types = list(base.config.layer_types[start:stop])
    stage_config.num_hidden_layers = stop - start
    base.config = stage_config
    if not first:
        base.embed_tokens = None
    if not last:
        base.norm = nn.Identity()
        model.lm_head = None
    return _stage_module_class()(model, first=first, last=last)


@lru_cache(maxsize=1)
def _stage_module_class():
    import torch.nn as nn

    class _DecoderStage(nn.Module):
        """One pipeline stage of an HF causal LM (see split_stage_module)."""

        def __init__(self, lm, *, first: bool, last: bool):
            super().__init__()
            self.lm = lm
            self.first, self.last = first, last

        def forward(self, x):
            inputs = {"input_ids": x} if self.first else {"inputs_embeds": x}
            if self.last:  # the ForCausalLM forward: head plus family extras (Gemma-2 softcapping)
                return self.lm(**inputs, use_cache=False).logits
            base = getattr(self.lm, self.lm.base_model_prefix)
            return base(**inputs, use_cache=False).last_hidden_state

    return _DecoderStage


def causal_lm_loss(logits, labels, num_target_tokens):
    """Sum of next-token cross-entropy over target tokens / the window's target tokens, in fp32:
    so the micro-batch losses of one optimizer step add up to the mean over every target token
    of the step (the runner's normalisation, memkit/train/loop.py). Labels are shifted, not
    logits (transformers loss/loss_utils.py, ForCausalLMLoss)."""
    import torch.nn.functional as F

    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), shifted.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    return loss / num_target_tokens


def count_target_tokens(labels) -> int:
    """Target tokens of a batch after the shift (what causal_lm_loss divides by)."""
    return int((labels[:, 1:] != IGNORE_INDEX).sum())


class PipelineParallel:
    """One rank's pipeline stage, its schedule, and the gradient reductions around it.

    Usage per optimizer step (whole local batch = micro x grad_accum sequences):
        loss = pipe.step(input_ids, labels)   # forward+backward of every micro-batch; loss on all ranks
        pipe.clip_grad_norm_(max_norm); optimizer.step(); optimizer.zero_grad()
    """

    def __init__(self, model, plan: TrainingPlan, layout: RankLayout, *, device, layer_counts=None):
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

        self.plan, self.layout, self.device = plan, layout, device
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        self.groups = _pipeline_groups(layout, tied=tied)
        self.tp_mesh = _tp_mesh(layout, device) if layout.tp > 1 else None
        counts = layer_counts or stage_layers(len(getattr(model, model.base_model_prefix).layers), plan.pp)
        self.first_layer = sum(counts[:layout.pp_stage])
        """The unsplit model's index of this stage's first decoder layer (checkpoint FQNs)."""
        self.module = split_stage_module(model, stage=layout.pp_stage, num_stages=plan.pp,
                                         layer_counts=counts).to(device)
        if self.tp_mesh is not None:
            shard_stage_tensor_parallel(self.module, self.tp_mesh)
        self.tied_weight = None
        if tied and plan.pp > 1:
            lm = self.module.lm
            base = getattr(lm, lm.base_model_prefix)
            self.tied_weight = base.embed_tokens.weight if layout.is_first_stage else \
                (lm.lm_head.weight if layout.is_last_stage else None)
        self.stage = PipelineStage(self.module, layout.pp_stage, plan.pp, device, group=self.groups["pp"])
        self._num_tokens = 1
        schedule = ScheduleGPipe if plan.pp_schedule == "gpipe" else Schedule1F1B
        # scale_grads=False: each micro-batch loss is already divided by the step's target tokens.
        self.schedule = schedule(self.stage, n_microbatches=plan.grad_accum, loss_fn=self._loss,
                                 scale_grads=False)

    def _loss(self, logits, labels):
        return causal_lm_loss(logits, labels, self._num_tokens)

    def parameters(self):
        return self.module.parameters()

    def step(self, input_ids, labels) -> float:
        """Forward and backward of the local batch's grad_accum micro-batches, then the gradient
        all-reduces (data parallel, tied embedding). Returns the step's loss (mean over target
        tokens of every dp shard), the same on every rank."""
        import torch
        import torch.distributed as dist

        self._num_tokens = count_target_tokens(labels)
        losses: list = []
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.plan.precision == "bf16" \
            else contextlib.nullcontext()
        with autocast:
            if self.layout.is_first_stage:
                self.schedule.step(input_ids.to(self.device), target=labels.to(self.device),
                                   losses=losses, return_outputs=False)
            else:
                self.schedule.step(target=labels.to(self.device), losses=losses, return_outputs=False)
        self._reduce_gradients()
        local = torch.stack([l.detach().float() for l in losses]).sum() if losses and not self.layout.tp_rank \
            else torch.zeros(())
        total = local.to(self.device).clone()
        dist.all_reduce(total)  # only last stages' tp rank 0 contribute: sum over dp replicas
        return float(total) / self.layout.dp

    def eval_sums(self, input_ids, labels) -> tuple[float, int]:
        """Forward only (the schedule's eval: torch/distributed/pipelining/schedules.py, no backward)
        of one local batch of grad_accum micro-batches. Returns (sum of next-token losses, target
        tokens) over every dp shard, the same on every rank (only the last stage's tp rank 0 adds)."""
        import torch
        import torch.distributed as dist

        self._num_tokens = 1  # sums, not means: the eval divides by all its target tokens at the end
        losses: list = []
        autocast = torch.autocast(self.device.type, dtype=torch.bfloat16) if self.plan.precision == "bf16" \
            else contextlib.nullcontext()
        self.module.eval()
        try:
            with torch.no_grad(), autocast:
                if self.layout.is_first_stage:
                    self.schedule.eval(input_ids.to(self.device), target=labels.to(self.device), losses=losses)
                else:
                    self.schedule.eval(target=labels.to(self.device), losses=losses)
        finally:
            self.module.train()
        adds = bool(losses) and not self.layout.tp_rank
        totals = torch.tensor([float(sum(float(l) for l in losses)) if adds else 0.0,
                               float(count_target_tokens(labels)) if adds else 0.0],
                              dtype=torch.float64, device=self.device)
        dist.all_reduce(totals)
        return float(totals[0]), int(totals[1])

    def _reduce_gradients(self) -> None:
        import torch.distributed as dist

        if self.layout.dp > 1:
            grads = [_local(p.grad) for p in self.module.parameters() if p.grad is not None]
            _all_reduce_coalesced(grads, group=self.groups["dp"], average_by=self.layout.dp)
        if self.tied_weight is not None and self.tied_weight.grad is not None:
            dist.all_reduce(self.tied_weight.grad, group=self.groups["tied"])

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip by the global gradient norm over all stages (each parameter counted once: the tied
        weight only on the first stage; a tensor-parallel shard's squares summed over the TP
        group, a replicated parameter's counted once). Returns the norm before clipping."""
        import torch
        import torch.distributed as dist

        sq = torch.zeros((), dtype=torch.float32, device=self.device)
        sharded = torch.zeros((), dtype=torch.float32, device=self.device)
        counted = [p for p in self.module.parameters() if p.grad is not None
                   and not (p is self.tied_weight and self.layout.is_last_stage and self.layout.pp > 1)]
        for p in counted:
            if _is_dtensor(p.grad):
                sharded += p.grad.to_local().detach().float().pow(2).sum()
            else:
                sq += p.grad.detach().float().pow(2).sum()
        if self.tp_mesh is not None:
            dist.all_reduce(sharded, group=self.tp_mesh.get_group())
        sq += sharded
        dist.all_reduce(sq, group=self.groups["pp"])
        norm = float(sq.sqrt())
        if max_norm > 0:
            coef = max_norm / (norm + 1e-6)  # torch.nn.utils.clip_grad_norm_'s epsilon
            if coef < 1:
                for p in self.module.parameters():
                    if p.grad is not None:
                        p.grad.mul_(coef)
        return norm


def apply_pipeline_parallel(model, plan: TrainingPlan, layout: RankLayout, *, device) -> PipelineParallel:
    """Split `model` for this rank's stage and build its schedule (the process group must exist)."""
    return PipelineParallel(model, plan, layout, device=device)


def _pipeline_groups(layout: RankLayout, *, tied: bool) -> dict[str, Any]:
    """Process groups: this rank's pipeline (pp), its data-parallel peers (dp), and the
    first/last stage pair that shares a tied embedding, each among the ranks of one TP rank.
    Every rank creates every group in the same order (torch.distributed.new_group's contract)."""
    import torch.distributed as dist

    out: dict[str, Any] = {}
    mine = (layout.dp_rank, layout.pp_stage, layout.tp_rank)
    for t in range(layout.tp):
        for d in range(layout.dp):
            group = dist.new_group([layout.rank_of(dp_rank=d, pp_stage=s, tp_rank=t) for s in range(layout.pp)])
            if (d, t) == (mine[0], mine[2]):
                out["pp"] = group
        for s in range(layout.pp):
            group = dist.new_group([layout.rank_of(dp_rank=d, pp_stage=s, tp_rank=t) for d in range(layout.dp)])
            if (s, t) == (mine[1], mine[2]):
                out["dp"] = group
        if tied and layout.pp > 1:
            for d in range(layout.dp):
                group = dist.new_group([layout.rank_of(dp_rank=d, pp_stage=0, tp_rank=t),
                                        layout.rank_of(dp_rank=d, pp_stage=layout.pp - 1, tp_rank=t)])
                if (d, t) == (mine[0], mine[2]):
                    out["tied"] = group
    return out


# ---- tensor parallel inside pipeline stages (torch DTensor) ---------------------------------------

STAGE_TP_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                 "self_attn.o_proj": "rowwise", "mlp.gate_proj": "colwise", "mlp.up_proj": "colwise",
                 "mlp.down_proj": "rowwise"}
"""Megatron-LM's decoder-block split (Shoeybi et al. 2019, Sec. 3: column-parallel q/k/v and the
MLP's first linears, row-parallel attention output and MLP down projection); the same plan as
transformers' base_model_tp_plan for Llama (models/llama/configuration_llama.py) and
torchtitan's (torchtitan/models/llama3/infra/parallelize.py, apply_tp). Embedding, norms and
LM head stay replicated."""


def _tp_mesh(layout: RankLayout, device):
    """This rank's TP group as a 1-D DeviceMesh: the tp consecutive ranks of its (dp, stage)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (layout.dp, layout.pp, layout.tp), mesh_dim_names=("dp", "pp", "tp"))
    return mesh["tp"]


def shard_stage_tensor_parallel(stage_module, tp_mesh) -> None:
    """Shard every decoder block of a pipeline stage over `tp_mesh` with torch's tensor parallel
    (torch.distributed.tensor.parallel.parallelize_module; ColwiseParallel / RowwiseParallel with
    local outputs, so attention reshapes with the local head count, the residual stream stays a
    plain replicated tensor and the stages pass plain tensors). DTensor's backward all-reduces
    the input gradient of the column-parallel linears, so the replicated parameters' gradients
    are equal on every TP rank."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from torch.distributed.tensor import Replicate

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    lm = stage_module.lm
    base = getattr(lm, lm.base_model_prefix)
    for block in base.layers:
        parallelize_module(block, tp_mesh, {name: styles[kind]() for name, kind in STAGE_TP_PLAN.items()})
    if stage_module.last and not getattr(lm.config, "tie_word_embeddings", False):
        # Column-parallel LM head with the logits gathered, as AutoTP trains it (deepspeed/
        # module_inject/auto_tp.py, training_column_lm_head) and the estimator prices it. A tied
        # head stays replicated: its gradient is summed with the first stage's embedding.
        parallelize_module(lm, tp_mesh, {"lm_head": ColwiseParallel(output_layouts=Replicate())})


def _is_dtensor(t) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(t, DTensor)


def _local(t):
    return t.to_local() if _is_dtensor(t) else t


def _all_reduce_coalesced(tensors: list, *, group, average_by: int) -> None:
    """Average `tensors` over `group` with one flat all-reduce (DDP's bucketing, in one bucket)."""
    import torch.distributed as dist
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    if not tensors:
        return
    flat = _flatten_dense_tensors(tensors)
    dist.all_reduce(flat, group=group)
    flat.div_(average_by)
    for t, reduced in zip(tensors, _unflatten_dense_tensors(flat, tensors)):
        t.copy_(reduced)
    del flat
