"""Published training-throughput measurements as memkit cases: map each record of
../shared/calibration/published_throughput.jsonl (sources in SOURCES_THROUGHPUT.md next to it) to a
ModelSpec, TrainingPlan(s) and a Hardware, and score the step-time model against it.

The memory mapping (memkit/calibrate/published_memory.py) reads a different record schema; the helpers that apply
to both (model configs outside the catalog, LoRA target names, sequence-classification heads) are
reused from there. No printing, no file reading: benchmarks/throughput_accuracy.py renders this.

Scoring rules (SOURCES_THROUGHPUT.md, "Fields"):
- every measured figure is turned into tokens/s per GPU (`measured_tps_per_gpu`);
- `length_varies` records and epochs of unstated size are ranked only (`absolute=False`): their
  true tokens per sample are unknown, so only their order within a group means something;
- rank agreement is judged within groups of the same source, model and GPU (and seq_len where the
  length varies, and the software stack where the record states one): every pair with different measured figures is concordant when the predicted
  figures order it the same way.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from pathlib import Path

from memkit.calibrate.published_memory import _CONFIG_DIRS, _lora_targets, _stack, as_sequence_classifier
from memkit.errors import MemkitError
from memkit.estimate.throughput import StepTimeEstimate, estimate_step_time
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec, spec_from_config
from memkit.spec.model import ModelSpec
from memkit.spec.stack import Stack

_PRECISIONS = {"fp32": "fp32", "fp16": "fp16", "bf16": "bf16", "bf16-pure": "bf16-pure"}
# record engine -> (memkit engine, ZeRO stage when the record gives none)
_ENGINES = {"fsdp": "torch", "ddp": "torch", "single": "torch", "deepspeed": "deepspeed",
            "fairscale_sharded_ddp": "torch"}


# Versions of the holdout sources (benchmarks/data/SOURCES_holdout.md): VectorLM's
# docs/reference_throughput.md prints its pip freeze (torch==2.2.1); torchtune's README tables of
# 2024-09 / 2024-11 ran on the nightlies of then (torchtune pins no torch; 2.5 is the release
# between them).
_HOLDOUT_STACKS = {
    "vectorlm_reference_throughput": Stack(torch="2.2.1"),
    "torchtune_readme": Stack(torch="2.5"),
}


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputCase:
    case_id: str
    source_id: str
    group: str
    """Records ranked against each other: source | model | GPU (| seq_len when the length varies)."""
    measured_tps_per_gpu: float
    """Measured tokens/s per GPU (for ranked-only rows: a figure proportional to it)."""
    absolute: bool
    """Whether the measured figure is comparable in absolute terms (see the module docstring)."""
    summary: str
    model: ModelSpec | None = None
    plans: tuple[TrainingPlan, ...] = ()
    """The plan, or the two ends of a bracket whose step times are averaged (selective AC: every
    second block checkpointed, priced as the mean of no AC and full AC)."""
    hardware: Hardware | None = None
    stack: Stack | None = None
    """The source's software versions, as far as it states them (memkit/calibrate/published_memory.py _SOURCE_STACKS)."""
    reduce_itemsize: int | None = None
    """Bytes per gradient element as the source's framework reduces it, where that is not the
    gradient's dtype (_reduce_itemsize)."""
    backward_prefetch: str = "pre"
    """torch FSDP's BackwardPrefetch as the source's framework sets it (_backward_prefetch)."""
    compiled: bool = False
    """The run wraps the model in torch.compile (the record's `compile`)."""
    lora_adapter_dtype: str | None = None
    """The LoRA adapters' dtype where the source states it (the record's lora.adapter_dtype)."""
    offload_streams: bool = False
    """Activation offload on a side stream (the record's offload_activations_streams)."""
    hf_checkpointing: bool = False
    """The run checkpoints through the HF Trainer's gradient_checkpointing_enable() defaults."""
    fused_optimizer: bool = False
    """The run builds torch.optim.AdamW(fused=True) (the record's optimizer_raw says so)."""
    chunked_loss_saves_logits: bool = False
    """The record's chunked loss keeps the chunks' logits (_chunked_loss_saves_logits)."""
    eager_fp32_rope: bool = False
    """The run's rotary embedding is torchtune's fp32 eager one (_eager_fp32_rope)."""
    no_sync_step: bool = False
    """Each timed step is one no_sync() micro-batch and nothing more (_vectorlm_no_sync)."""
    approx: tuple[str, ...] = ()
    skip_reason: str = ""
    mfu_reported: float | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ThroughputOutcome:
    case: ThroughputCase
    predicted_tps_per_gpu: float | None = None
    error_pct: float | None = None
    estimate: StepTimeEstimate | None = None
    error: str = ""


def map_record(record: dict, *, configs_dir: Path) -> ThroughputCase:
    rid, source = record["id"], record["source_id"]
    approx: list[str] = []
    measured, absolute = _measured_tps_per_gpu(record, approx)
    group = f"{source}|{record['model']['name']}|{record.get('memkit_gpu') or record['gpu']}"
    if record.get("length_varies"):
        group += f"|s{record['seq_len']}"
    if record.get("stack"):
        # one group per stated stack: runs of one commit share data order and versions; a pair across
        # torch releases is no choice between plans (peft_method_comparison, SOURCES_holdout.md)
        group += "|" + ",".join(f"{k}={v}" for k, v in sorted(record["stack"].items()))
    base = dict(case_id=rid, source_id=source, group=group, measured_tps_per_gpu=measured,
                absolute=absolute and not record.get("length_varies"),
                mfu_reported=record["measured"].get("mfu_reported"))
    skip = _skip_reason(record)
    if skip:
        return ThroughputCase(summary="-", skip_reason=skip, **base)
    model = _model(record, configs_dir, approx)
    plans, hardware = _plans(record, model, approx)
    no_sync = _vectorlm_no_sync(record)
    if no_sync:   # the timed unit is one micro-batch: a plan of one
        plans = tuple(replace(p, grad_accum=1) for p in plans)
    stack = _HOLDOUT_STACKS.get(source) or _stack(record, approx)
    return ThroughputCase(summary=_summary(plans[0], record), model=model, plans=plans, hardware=hardware,
                          stack=stack, reduce_itemsize=_reduce_itemsize(record),
                          backward_prefetch=_backward_prefetch(record), compiled=bool(record.get("compile")),
                          lora_adapter_dtype=_lora_adapter_dtype(record),
                          offload_streams=bool(record.get("offload_activations_streams")),
                          hf_checkpointing=_hf_trainer(record),
                          fused_optimizer="fused=true" in (record.get("optimizer_raw") or "").lower().replace(" ", ""),
                          chunked_loss_saves_logits=_chunked_loss_saves_logits(record),
                          eager_fp32_rope=_eager_fp32_rope(record), no_sync_step=no_sync, approx=tuple(approx), **base)


def _vectorlm_no_sync(record: dict) -> bool:
    """VectorLM's profiling/benchmark.py times `trainer.train_step(batch, epoch)` alone and never
    calls Trainer.step(), the only place tr_step advances (vectorlm/trainer.py @ 9045f08), so
    tr_step stays 0 and train_step's test `(self.tr_step + 1) % self.gas != self.gas - 1` (1 != 3
    at gradient_accumulation_steps 4) holds at every step: each timed step is a forward and
    backward inside `self.model.no_sync()` plus `clip_grad_norm_(1)`, with no gradient reduction and
    no optimizer step (estimate_step_time no_sync_step)."""
    return record["source_id"] == "vectorlm_reference_throughput"


def _backward_prefetch(record: dict) -> str:
    """Composer's FSDP defaults backward_prefetch to BACKWARD_POST (composer/trainer/dist_strategy.py
    set_fsdp_default, v0.13 through 2024), and llm-foundry's benchmark sweep leaves it unset
    (scripts/train/benchmarking/sweep.sh; submit_benchmarks.py sets it only when asked). Every other
    FSDP source runs torch's / Accelerate's BACKWARD_PRE or FSDP2, which always prefetches."""
    if record["source_id"] == "llm_foundry_benchmarks" and record["engine"] == "fsdp":
        return "post"
    return "pre"


def _chunked_loss_saves_logits(record: dict) -> bool:
    """torchtune's chunked loss is CEWithChunkedOutputLoss (the README's 'chunked-ce' row; the
    recipes' loss component): the model returns num_output_chunks chunks of logits, each the head's
    output kept by autograd (torchtune/modules/transformer.py TransformerDecoder.forward @ 1814feb17),
    and the loss upcasts and reduces each chunk (torchtune/modules/loss/ce_chunked_output_loss.py):
    nothing is recomputed."""
    return record["source_id"] == "torchtune_readme" and record.get("loss") == "chunked"


def _eager_fp32_rope(record: dict) -> bool:
    """torchtune's Llama 3.1 / 3.2 builders give every attention layer Llama3ScaledRoPE
    (torchtune/models/llama3_1/_component_builders.py, llama3_2/_component_builders.py @ 1814feb17
    and @ 30b8519e8 for the 2024-09 table), which casts x.float() and runs the rotation op by op like
    RotaryPositionalEmbeddings (torchtune/models/llama3_1/_position_embeddings.py forward)."""
    return record["source_id"] == "torchtune_readme"


def _flex_document_mask(record: dict) -> bool:
    """torchtune's packed rows attend through FlexAttention with a block-causal BlockMask per
    document: padded_collate_packed builds packed_block_causal_mask (torchtune/data/_collate.py),
    a BlockMask when _SUPPORTS_FLEX_ATTENTION (torch >= 2.5 on sm75+, torchtune/utils/_import_guard.py
    @ 30b8519e8 and 1814feb17), and MultiHeadAttention then calls the compiled flex_attention
    whatever the recipe's `compile` (torchtune/modules/attention_utils.py _sdpa_or_flex_attention:
    flex_attention_compiled = torch.compile(flex_attention)). FlexAttention skips the 128 x 128
    blocks the mask leaves empty, so its cost follows the documents' lengths, which the README
    does not give; memkit prices full causal attention over the pack (an upper bound). Packed =
    every torchtune row of fixed length (the records' notes: the 3B baseline and the 8B rows,
    recorded unpacked, vary in length)."""
    return record["source_id"] == "torchtune_readme" and not record.get("length_varies")


def _hf_trainer(record: dict) -> bool:
    """HF Trainer runs turn checkpointing on with model.gradient_checkpointing_enable() and the
    Trainer's default gradient_checkpointing_kwargs (transformers/trainer.py); the accelerate
    *_no_trainer examples and other frameworks wrap blocks themselves."""
    text = (record.get("framework") or "").lower()
    return "trainer" in text and "no_trainer" not in text


def _lora_adapter_dtype(record: dict) -> str | None:
    """The record's lora.adapter_dtype; lit-gpt's LoRA is its own (lit_gpt/lora.py LoRALinear, not
    peft) and Fabric's "bf16-true" precision converts the whole model, adapters included, to bf16
    (lightning/fabric/plugins/precision/half.py HalfPrecision.convert_module)."""
    if record.get("finetune_type") not in ("lora", "qlora"):
        return None
    if record["source_id"] == "litgpt_resource_tables":
        return "bf16"
    return (record.get("lora") or {}).get("adapter_dtype")


def _reduce_itemsize(record: dict) -> int | None:
    """FSDP runs that reduce gradients in fp32 under 16-bit params: Composer's mixed_precision
    'DEFAULT' sets reduce_dtype=torch.float32 ('PURE' reduces in the 16-bit dtype;
    composer/distributed/mosaic_parallelism.py get_mixed_precision), and torchtitan's FSDP2 policy is
    MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (torchtitan
    parallelisms/parallelize_llama.py at eb6aa6389, later --training.mixed_precision_reduce, default
    float32). None: the gradient's own dtype."""
    if record["engine"] != "fsdp" or record["precision"] not in ("bf16", "fp16"):
        return None
    raw = record.get("precision_raw") or ""
    if record["source_id"] == "torchtitan_benchmarks" or (
            record["source_id"] == "llm_foundry_benchmarks" and "mixed_precision DEFAULT" in raw):
        return 4
    return None


def _skip_reason(record: dict) -> str:
    if record["precision"] not in _PRECISIONS:
        return f"precision {record['precision']}: memkit has no fp8 plan"
    if record.get("finetune_type") == "qlora":
        # memkit prices 4-bit bases (estimate/quantized.py dequant_traffic_bytes); the only measured
        # 4-bit step times, litgpt's (bitsandbytes 0.41.1, bf16-true), have not been matched to it.
        return ("QLoRA step time is uncalibrated: litgpt's 4-bit rows take 1.09-2.05x its LoRA rows' time "
                "(phi-1.5 to Llama-2-13B), memkit's dequantisation roofline is not validated against them")
    if (record.get("cp") or 1) > 1:
        return "context parallel: memkit has no CP plan"
    if record.get("micro_batch_size") is None:
        return "micro batch unstated"
    return ""


def _measured_tps_per_gpu(record: dict, approx: list[str]) -> tuple[float, bool]:
    """(tokens/s per GPU, comparable in absolute terms) from the record's metric."""
    meas, seq, n = record["measured"], record["seq_len"], record["num_gpus"]
    metric, value = meas["metric"], float(meas["value"])
    if metric == "tokens_per_s_per_gpu":
        return value, True
    if metric == "tokens_per_s_total":
        return value / n, True
    if metric == "samples_per_s_total":
        return value * seq / n, True
    if metric == "s_per_step":
        return record["global_batch_size"] * seq / value / n, True
    if metric == "s_per_micro_step":
        return record["micro_batch_size"] * seq / value, True
    if metric == "minutes_per_1000_micro_iters":
        # one iteration = one micro-batch on every GPU (litgpt tutorials/resource-tables.md)
        return record["micro_batch_size"] * 1000 * seq / (value * 60.0), True
    if metric == "s_per_epoch":
        samples = meas.get("samples_per_epoch")
        if samples:
            return samples * seq / value / n, True
        approx.append("epoch size unstated: ranked only (1/s per epoch)")
        return 1.0 / value, False
    raise MemkitError(f"throughput record {record['id']}: metric {metric!r} has no mapping")


def _model(record: dict, configs_dir: Path, approx: list[str]) -> ModelSpec:
    m = record["model"]
    name = m["name"]
    if m.get("memkit_model"):
        spec = load_model_spec(m["memkit_model"])
    elif m.get("hf_config"):
        cfg = dict(m["hf_config"])
        if "n_positions" in cfg:  # MPT's learned positions grow with the sequence (SOURCES_THROUGHPUT.md)
            cfg["n_positions"] = max(cfg["n_positions"], record["seq_len"])
            # MPT trains without dropout (llm-foundry llmfoundry/models/mpt/configuration_mpt.py:
            # resid_pdrop = emb_pdrop = attn_pdrop = 0.0, which the pretraining yamls keep); the
            # GPT-2 config it is written as would default each to 0.1.
            for key in ("resid_pdrop", "embd_pdrop", "attn_pdrop"):
                cfg.setdefault(key, 0.0)
            # MPT's MLP activation is exact GELU, one kernel (llmfoundry/models/layers/ffn.py
            # resolve_ffn_act_fn: nn.GELU(approximate='none')), not GPT-2's default gelu_new.
            cfg.setdefault("activation_function", "gelu")
        spec = spec_from_config(cfg, name=name)
    elif name in _CONFIG_DIRS:
        spec = load_model_spec(str(Path(configs_dir) / _CONFIG_DIRS[name]))
        approx.append(f"{name} modelled by the nearest memkit family")
    else:
        raise MemkitError(f"throughput record {record['id']}: model {name!r} has no config")
    if record.get("task") == "seq_cls":
        spec = as_sequence_classifier(spec, num_labels=2)
    return spec


def _plans(record: dict, model: ModelSpec, approx: list[str]) -> tuple[tuple[TrainingPlan, ...], Hardware]:
    engine = _ENGINES[record["engine"]]
    zero = record.get("zero_stage") or 0
    if record["engine"] == "fairscale_sharded_ddp":
        # ShardedDDP reduces each gradient to the rank owning its optimizer shard, OSS broadcasts
        # the updated params after the step, params stay replicated and fp32 under torch AMP
        # (fairscale/nn/data_parallel/sharded_ddp.py, fairscale/optim/oss.py): the torch engine's
        # stage 1 (reduce at the boundary + gather after the step), not FSDP.
        zero = 1
        approx.append("fairscale ShardedDDP + OSS priced as torch-engine ZeRO-1")
    tp, pp = record.get("tp") or 1, record.get("pp") or 1
    n = record["num_gpus"]
    ac = (record.get("activation_checkpointing") or "none").lower()
    attention = _attention(record)
    if record.get("compile"):
        approx.append("torch.compile: fused norms priced, Inductor's other fusions priced as eager kernels")
    if _flex_document_mask(record):
        approx.append("packed: FlexAttention over a per-document block-causal BlockMask priced as full causal "
                      "SDPA (the packs' document lengths are unpublished)")
    if any("async tp" in e.lower() for e in record.get("extras", [])):
        approx.append("async TP priced as synchronous TP")
    lora_kw = {}
    if record.get("finetune_type") == "lora":
        lora = record.get("lora") or {}
        lora_kw = dict(lora_rank=int(lora.get("rank", 8)), lora_targets=_lora_role_targets(model, lora.get("targets")),
                       lora_alpha=int(lora.get("alpha", 16)), lora_dropout=float(lora.get("dropout", 0.05)))
    plan = TrainingPlan(
        precision=_PRECISIONS[record["precision"]], optimizer=_optimizer(record), zero_stage=int(zero),
        engine=engine, offload_optimizer="cpu" if record.get("offload_optimizer") not in (None, "none") else "none",
        offload_params="cpu" if record.get("offload_params") not in (None, "none") else "none",
        checkpointing="full" if ac == "full" else "none", attention=attention,
        loss=record.get("loss") or "standard", offload_activations=record.get("offload_activations") or "none",
        optimizer_in_backward=bool(record.get("optimizer_in_backward")),
        micro_batch_size=int(record["micro_batch_size"]), grad_accum=int(record["grad_accum"] or 1),
        seq_len=int(record["seq_len"]), dp=n // (tp * pp), tp=tp, pp=pp,
        # the record's max gradient norm where it states one (0: the framework clips none), else memkit's default
        **({"gradient_clipping": float(record["gradient_clipping"])} if record.get("gradient_clipping") is not None else {}),
        tp_engine="tp_plan" if engine == "torch" else "autotp", sequence_parallel=tp > 1 and engine == "torch",
        **lora_kw)
    plans: tuple[TrainingPlan, ...] = (plan,)
    if ac.startswith("selective"):
        approx.append(f"{ac} AC priced as the mean of no AC and full AC")
        plans = (plan, replace(plan, checkpointing="full"))
    per_node = record.get("gpus_per_node") or min(n, 8)
    gpu = find_gpu(record.get("memkit_gpu") or record["gpu"])
    hw_kw = {}
    if record.get("inter_node_gbps_per_gpu"):
        hw_kw["inter_node_gbps"] = float(record["inter_node_gbps_per_gpu"])
    elif gpu.arch == "hopper" and n > per_node:
        # Unstated H100 network: the DGX H100 reference design, one 400 Gb/s ConnectX-7 per GPU
        # (NVIDIA DGX H100 User Guide, "Hardware Overview") = 50 GB/s per GPU.
        hw_kw["inter_node_gbps"] = 50.0
        approx.append("inter-node bandwidth unstated: DGX H100 400 Gb/s per GPU assumed")
    hardware = Hardware(gpu=gpu, num_gpus_per_node=min(per_node, n), num_nodes=max(1, n // per_node), **hw_kw)
    return plans, hardware


def _lora_role_targets(model: ModelSpec, targets) -> tuple[str, ...]:
    """A list of linear roles (q, k, v, o, gate, up, down: the holdout records state torchtune's
    lora_attn_modules / apply_lora_to_mlp that way) as the spec's linear names; any other form goes
    through memkit/calibrate/published_memory.py _lora_targets."""
    by_role = {lin.role: lin.name for lin in model.layer_linears}
    if isinstance(targets, list) and targets and all(t in by_role for t in targets):
        return tuple(by_role[t] for t in targets)
    return _lora_targets(model, targets)


def _attention(record: dict) -> str:
    text = (record.get("attention") or "eager").lower()
    if text.startswith("flash") or "(flash" in text:
        return "flash"
    if "sdpa" in text:
        return "sdpa"
    return "eager"


def _optimizer(record: dict) -> str:
    """The record's optimizer; bitsandbytes' Paged* classes (the record's optimizer_raw, e.g.
    torchtune's bitsandbytes.optim.PagedAdamW8bit) are the paged variant (is_paged=True,
    bitsandbytes/optim/adamw.py PagedAdamW8bit)."""
    text = (record.get("optimizer") or "adamw").lower()
    raw = (record.get("optimizer_raw") or "").lower()
    if "paged" in raw and "8bit" in raw:
        return "paged-adamw-8bit"
    for name in ("adamw-8bit", "adafactor", "sgd"):
        if name in text:
            return name
    if "8bit" in text:
        return "adamw-8bit"
    return "adamw"


def _summary(plan: TrainingPlan, record: dict) -> str:
    ac = record.get("activation_checkpointing") or "none"
    par = f"{record['engine']}" + (f"-z{plan.zero_stage}" if plan.zero_stage else "")
    if plan.offload_optimizer != "none":
        par += "+off"
    dims = f"dp{plan.dp}" + (f"xtp{plan.tp}" if plan.tp > 1 else "") + (f"xpp{plan.pp}" if plan.pp > 1 else "")
    lora = f" lora{plan.lora_rank}" if plan.is_lora else ""
    return (f"mb{plan.micro_batch_size}x{plan.seq_len} ga{plan.grad_accum} {plan.precision} "
            f"{plan.attention} AC={ac}{lora} {par} {dims}")


def score(case: ThroughputCase) -> ThroughputOutcome:
    if case.skip_reason:
        return ThroughputOutcome(case=case)
    try:
        ests = [estimate_step_time(case.model, p, case.hardware, stack=case.stack,
                                   reduce_itemsize=case.reduce_itemsize,
                                   backward_prefetch=case.backward_prefetch,
                                   compiled=case.compiled, lora_adapter_dtype=case.lora_adapter_dtype,
                                   offload_streams=case.offload_streams, hf_checkpointing=case.hf_checkpointing,
                                   fused_optimizer=case.fused_optimizer,
                                   chunked_loss_saves_logits=case.chunked_loss_saves_logits,
                                   eager_fp32_rope=case.eager_fp32_rope,
                                   no_sync_step=case.no_sync_step)
                for p in case.plans]
    except MemkitError as exc:
        return ThroughputOutcome(case=case, error=str(exc))
    plan = case.plans[0]
    step_s = sum(e.step_time_s for e in ests) / len(ests)
    predicted = plan.tokens_per_step / step_s / plan.num_gpus
    err = (predicted - case.measured_tps_per_gpu) / case.measured_tps_per_gpu * 100 if case.absolute else None
    return ThroughputOutcome(case=case, predicted_tps_per_gpu=predicted, error_pct=err, estimate=ests[0])


def ranked_pairs(outcomes: list[ThroughputOutcome]):
    """Yield (a, b, kind) for every pair within a group with different measured figures; kind is
    "concordant", "discordant" or "tied" (the prediction cannot tell them apart)."""
    groups: dict[str, list[ThroughputOutcome]] = {}
    for o in outcomes:
        if o.predicted_tps_per_gpu is not None:
            groups.setdefault(o.case.group, []).append(o)
    for rows in groups.values():
        for i, a in enumerate(rows):
            for b in rows[i + 1:]:
                dm = a.case.measured_tps_per_gpu - b.case.measured_tps_per_gpu
                dp = a.predicted_tps_per_gpu - b.predicted_tps_per_gpu
                if dm == 0:
                    continue
                if abs(dp) <= 1e-9 * max(a.predicted_tps_per_gpu, b.predicted_tps_per_gpu):
                    yield a, b, "tied"
                else:
                    yield a, b, "concordant" if dm * dp > 0 else "discordant"


def pair_ratio_errors(outcomes: list[ThroughputOutcome]) -> list[float]:
    """|predicted ratio / measured ratio - 1| of every ranked pair (ranked_pairs) whose two rows are
    both scored in absolute terms: how far off the model is on how much faster one plan is than
    another of the same source, model and GPU -- the figure a choice between two plans rests on.
    With a = (1 + e_a) and b = (1 + e_b) the two rows' predicted/measured ratios, it is |a / b - 1|:
    an error both rows share (the GPU's clock, a framework's fixed overhead) cancels."""
    errs = []
    for a, b, _ in ranked_pairs(outcomes):
        if a.case.absolute and b.case.absolute:
            predicted = a.predicted_tps_per_gpu / b.predicted_tps_per_gpu
            measured = a.case.measured_tps_per_gpu / b.case.measured_tps_per_gpu
            errs.append(abs(predicted / measured - 1.0))
    return errs


def rank_agreement(outcomes: list[ThroughputOutcome]) -> tuple[int, int, int]:
    """(concordant, discordant, tied-in-prediction) pairs within each group; pairs with equal
    measured figures are not counted."""
    kinds = [kind for _, _, kind in ranked_pairs(outcomes)]
    return kinds.count("concordant"), kinds.count("discordant"), kinds.count("tied")


def summarize(outcomes: list[ThroughputOutcome], *, key=None) -> dict[str, dict[str, float]]:
    """Per source (or per `key(case)`) and overall: n, median |err| %, signed mean %, share within
    +-20 %, p75 |err| %, Kendall tau-a (pooled over the groups' pairs), share of concordant pairs
    (pairs the prediction ties count in the denominator) and the p75 of pair_ratio_errors."""
    by: dict[str, list[ThroughputOutcome]] = {}
    for o in outcomes:
        by.setdefault(key(o.case) if key else o.case.source_id, []).append(o)
        by.setdefault("ALL", []).append(o)
    out = {}
    for name, rows in by.items():
        errs = [o.error_pct for o in rows if o.error_pct is not None and math.isfinite(o.error_pct)]
        absd = sorted(abs(e) for e in errs)
        conc, disc, ties = rank_agreement(rows)
        pairs = conc + disc + ties
        ratio_errs = sorted(pair_ratio_errors(rows))
        out[name] = {
            "n_records": len(rows), "n_scored": len(errs),
            "n_ranked": sum(o.predicted_tps_per_gpu is not None for o in rows),
            "skipped": sum(bool(o.case.skip_reason) for o in rows), "errors": sum(bool(o.error) for o in rows),
            "median_abs_pct": _quantile(absd, 0.5), "p75_abs_pct": _quantile(absd, 0.75),
            "mean_signed_pct": sum(errs) / len(errs) if errs else float("nan"),
            "within_20_pct": sum(a <= 20 for a in absd) / len(absd) if absd else float("nan"),
            # a pair the model cannot tell apart (e.g. torch.compile on/off) is not concordant
            "pairs": pairs, "tied": ties, "concordant": conc / pairs if pairs else float("nan"),
            "kendall_tau": (conc - disc) / pairs if pairs else float("nan"),   # tau-a
            "n_ratio_pairs": len(ratio_errs),
            "p75_pair_ratio_pct": 100 * _quantile(ratio_errs, 0.75),
        }
    return out


def _quantile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated quantile of an ascending list (numpy's default 'linear' method)."""
    if not sorted_values:
        return float("nan")
    pos = q * (len(sorted_values) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
