"""Published GPU measurements as memkit cases: map each record of
../shared/calibration/published_gpu_measurements.jsonl (sources in SOURCES.md next to it) to a
ModelSpec, a TrainingPlan and a Hardware, and score memkit's estimate against the measurement.

No printing, no reading of the calibration file (the caller passes parsed records); model configs
are read through memkit.spec.hf (the catalog, or `configs_dir` for models outside it).
benchmarks/memory_accuracy.py renders the outcomes.

Record kinds:
- regression: a measured peak, compared like with like: max_memory_allocated ->
  allocated_peak_bytes, memory_stats reserved peak -> reserved_peak_bytes, nvidia-smi / NVML
  used -> nvidia_smi_peak_bytes;
- oom: the run ran out of memory; passes when the predicted nvidia-smi peak exceeds the device;
- max_fit_batch: the largest micro-batch that fit; passes when the prediction at that batch fits
  (the next batch the authors tried is not published, so the upper side is reported, not judged);
- activation_probe (S8): bytes one decoder layer's forward keeps (saved tensors + its output),
  compared with block_activations().

Anything memkit cannot represent is either mapped to the closest plan and listed in `approx`, or
skipped with `skip_reason`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path

from memkit.errors import MemkitError
from memkit.estimate.activations import block_activations, numerics
from memkit.estimate.memory import estimate_memory
from memkit.estimate.result import MemoryEstimate
from memkit.plan.plan import TrainingPlan
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import find_catalog_model, load_model_spec, spec_from_config
from memkit.spec.model import ModelSpec
from memkit.spec.stack import Stack
from memkit.units import GIB

METRIC_FIELDS = {"allocated": "allocated_peak_bytes", "reserved": "reserved_peak_bytes",
                 "nvidia_smi": "nvidia_smi_peak_bytes"}

# Record model name -> catalog name, where the catalog holds the same architecture.
_CATALOG_ALIASES = {
    "bloomz-7b1": "bloom-7b1",          # BLOOMZ is BLOOM fine-tuned: same config
    "gemma-1.1-2b": "gemma-2b",         # Gemma 1.1 re-trained Gemma 1 weights: same config
}
# Record model name -> folder under configs_dir (benchmarks/calibration_configs/).
_CONFIG_DIRS = {
    "t0_3b": "t0-3b",
    "mt0-xxl": "mt0-xxl",
    "deberta-v2-xlarge-mnli": "deberta-v2-xlarge-mnli",
    "blenderbot-400M-distill": "blenderbot-400m-distill",
    # Qwen-1 chat checkpoints (holdout H4, H5): config.json as published on the Hub (model_type 'qwen',
    # remote code; memkit maps it structurally, spec/hf.py _qwen1)
    "qwen-1_8b": "qwen-1_8b",
    "qwen-7b": "qwen-7b",
    "qwen-14b": "qwen-14b",
}
_APPROX_CONFIGS = {
    "deberta-v2-xlarge-mnli": "DeBERTa-v2 modelled as a BERT encoder of the same sizes (no disentangled attention)",
    "blenderbot-400M-distill": "Blenderbot modelled as a T5 encoder-decoder of the same sizes",
}

# Record GPU string (prefix, lower case) -> memkit catalog GPU.
_GPUS = (
    ("tesla v100-sxm2 16gb", "v100-16gb"),
    ("a100-sxm4-40gb", "a100-40gb"),
    ("a100 40gb", "a100-40gb"),
    ("a100 80gb", "a100-80gb"),
    ("h100 96gb", "h100-96gb"),
    ("h100 80gb", "h100-80gb"),
    ("h200", "h200"),
    ("titan rtx", "titan-rtx"),
    ("nvidia l40s", "l40s"),
    ("rtx 4090", "rtx-4090"),
    ("rtx a6000", "rtx-a6000"),
)

# Facts a record states only in prose (seq_len_note / config_notes / source docs).
# torchtitan PP rows: local batch per DP rank; torchtitan splits it into as many microbatches as
# pipeline stages when pipeline_parallel_microbatches is unset (torchtitan/parallelisms/pipeline_llama.py).
_TITAN_LOCAL_BATCH = {"titan-t5-1": 32, "titan-t5-2": 32, "titan-t6-1": 8, "titan-t6-2": 8,
                      "titan-t6-3": 8, "titan-t6-4": 8}
# PEFT README runs (ought/raft twitter_complaints): tweets padded to the longest of each batch of 8
# (<= 280 characters, roughly <= 100 T5 tokens), labels padded to the longest class name (a few
# tokens). memkit has one seq_len for encoder and decoder; 64 is our assumption.
_PEFT_TWEET_SEQ_LEN = 64


@dataclass(frozen=True, slots=True, kw_only=True)
class Case:
    """One record (or a check derived from one) mapped to memkit objects."""

    case_id: str
    source_id: str
    model_name: str
    kind: str
    """regression | oom | max_fit_batch | activation_probe | skip"""
    metric: str
    """allocated | reserved | nvidia_smi | block_saved"""
    measured_bytes: int
    summary: str
    confidence: str = ""
    model: ModelSpec | None = None
    plan: TrainingPlan | None = None
    hardware: Hardware | None = None
    approx: tuple[str, ...] = ()
    skip_reason: str = ""
    max_fit_batch: int = 0
    alternatives: tuple[tuple[str, TrainingPlan], ...] = ()
    """Other plans worth pricing next to the main one (e.g. the two ends of a selective-AC bracket)."""
    stack: Stack | None = None
    """The source's software versions, as far as it states them (_SOURCE_STACKS)."""
    sample_lengths: tuple[int, ...] = ()
    """Token lengths of the run's samples where the source states its data's length statistics
    (lengths_from_stats): the case is then priced as estimate --lengths prices a user's data, by the
    variable-length replay (estimate/varlen.py), not by one max-shape step."""
    extra_bytes: int = 0
    """Bytes a mechanism outside memkit's plans adds to the peak (torchtitan selective AC, lit-gpt's
    per-chunk lm_head casts)."""

    @property
    def is_exact(self) -> bool:
        return not self.approx


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    case: Case
    predicted_bytes: int | None = None
    error_pct: float | None = None
    """(predicted - measured) / measured x 100, for regression and probe rows."""
    passed: bool | None = None
    """For oom / max_fit_batch rows."""
    estimate: MemoryEstimate | None = None
    detail: str = ""
    alternatives: dict[str, int] = field(default_factory=dict)
    error: str = ""
    """A MemkitError the estimator raised for this case (the mapping is then wrong or unsupported)."""


# ----------------------------------------------------------------------------- mapping

def cases_for_record(record: dict, *, configs_dir: Path) -> list[Case]:
    """The case for one record, plus checks the record implies (e.g. 'DDP OOMs at bs=1')."""
    case = map_record(record, configs_dir=configs_dir)
    out = [case]
    metric_text = record["measured"].get("metric", "")
    if "DDP OOMs at bs=1" in metric_text and case.kind != "skip":
        # HF blog: plain DDP (torch AMP fp16, no ZeRO) could not fit one sample of GPT-2 XL.
        ddp = replace(case.plan, engine="torch", zero_stage=0, offload_optimizer="none",
                      offload_params="none", micro_batch_size=1)
        out.append(replace(case, case_id=case.case_id + ":ddp-bs1", kind="oom", plan=ddp,
                           measured_bytes=case.hardware.gpu.memory_bytes, max_fit_batch=0,
                           summary=_summary(ddp)))
    return out


def map_record(record: dict, *, configs_dir: Path) -> Case:
    rid, source = record["id"], record["source_id"]
    meas = record["measured"]
    scope = meas["scope"]
    measured = int(round(meas["value_gib"] * GIB))
    base = dict(case_id=rid, source_id=source, model_name=record["model"]["name"],
                measured_bytes=measured, confidence=record.get("confidence", ""))

    skip = _skip_reason(record)
    if skip:
        return Case(kind="skip", metric="-", summary=_record_summary(record), skip_reason=skip, **base)

    approx: list[str] = []
    model = _model(record, configs_dir, approx)
    if scope == "activations_per_layer":
        plan = TrainingPlan(precision="bf16-pure", engine="torch", micro_batch_size=record["micro_batch_size"],
                            seq_len=record["seq_len"], attention="sdpa")
        return Case(kind="activation_probe", metric="block_saved", model=model, plan=plan,
                    hardware=Hardware(gpu=find_gpu("h100-80gb")), approx=tuple(approx),
                    summary=f"1 layer fwd bs{plan.micro_batch_size}x{plan.seq_len} bf16 sdpa", **base)

    plan, hardware, alternatives = _plan(record, model, approx)
    stack = _stack(record, approx)
    extra = _selective_ac_bytes(model, plan) if "selective" in record["activation_checkpointing"].lower() else 0
    if any("lm_head computed in 128-token chunks" in e for e in record.get("extras", [])):
        extra += _litgpt_head_cast_bytes(model, plan)
    if scope == "oom":
        kind, metric = "oom", "nvidia_smi"
        measured = hardware.gpu.memory_bytes
    elif scope == "max_fit_batch":
        kind, metric = "max_fit_batch", "nvidia_smi"
        measured = hardware.gpu.memory_bytes
    else:
        kind, metric = "regression", _metric(meas, approx)
    base["measured_bytes"] = measured
    lengths: tuple[int, ...] = ()
    if record.get("length_stats"):
        lengths = lengths_from_stats(record["length_stats"], max_length=plan.seq_len)
        approx.append("variable-length data priced by the variable-length replay (estimate/varlen.py, default "
                      "segments) over a lognormal with the source's stated length mean/sd/min/max (the family "
                      "is memkit's assumption; the source publishes no histogram)")
    return Case(kind=kind, metric=metric, model=model, plan=plan, hardware=hardware, approx=tuple(approx),
                max_fit_batch=meas.get("max_batch_fits", 0), alternatives=tuple(alternatives),
                stack=stack, extra_bytes=extra, summary=_summary(plan), sample_lengths=lengths, **base)


def lengths_from_stats(stats: dict, *, max_length: int) -> tuple[int, ...]:
    """Sample lengths from a source's stated length statistics (`length_stats`: mean, sd, min, max,
    samples, over_max_length): `samples` draws (seeded) from the lognormal whose mean and standard
    deviation are the stated ones (sigma^2 = ln(1 + sd^2/mean^2), mu = ln(mean) - sigma^2/2), clipped
    to [min, max]; then samples longer than max_length are dropped ('delete': ms-swift 1.5
    swift/llm/utils/template.py _encode returns None) or cut to it ('truncate'). A lognormal because
    document lengths are right-skewed and positive; the source states only the moments."""
    import random

    mean, sd = float(stats["mean"]), float(stats["sd"])
    lo, hi = int(stats.get("min", 1)), int(stats.get("max", 10 ** 9))
    if mean <= 0 or sd < 0 or lo > hi:
        raise MemkitError(f"length_stats {stats!r}: needs mean > 0, sd >= 0, min <= max")
    sigma2 = math.log(1 + (sd / mean) ** 2)
    mu = math.log(mean) - sigma2 / 2
    rng = random.Random(0)
    drawn = [min(hi, max(lo, int(rng.lognormvariate(mu, math.sqrt(sigma2)))))
             for _ in range(int(stats.get("samples", 4000)))]
    if stats.get("over_max_length", "truncate") == "delete":
        kept = tuple(n for n in drawn if n <= max_length)
    else:
        kept = tuple(min(n, max_length) for n in drawn)
    if not kept:
        raise MemkitError(f"length_stats {stats!r}: no sample is at most max_length {max_length}")
    return kept


# Versions per source, from SOURCES.md next to the data: S1 "transformers about 4.16" (Jan 2022;
# torch of that time 1.10), S3 "PyTorch 2.1.0+cu121", S4 torch nightly 1963fc8 (Dec 2024, 2.6 dev),
# S7 README table (early 2023: transformers 4.26, torch 1.13) and the Llama-2-70B docs (2024:
# transformers 4.38), S10 (2021: transformers 4.10, torch 1.9). Unstated ones are approximations.
_SOURCE_STACKS = {
    "hf_transformers_perf_train_gpu_one": (Stack(transformers="4.16", torch="1.10"), "torch 1.10"),
    "litgpt_resource_tables": (Stack(torch="2.1.0"), ""),
    "torchtitan_benchmarks": (Stack(torch="2.6"), ""),
    "hf_peft": (Stack(transformers="4.26", torch="1.13"), "transformers 4.26, torch 1.13"),
    "hf_blog_accelerate_deepspeed": (Stack(transformers="4.10", torch="1.9"), "transformers 4.10, torch 1.9"),
}
_PEFT_DOC_STACK = Stack(transformers="4.38", torch="2.2")


# Source -> the framework whose code ran it (SOURCES.md next to each data file), for leaving one
# framework out at a time (bounds.fold_coverage): sources run by the same code fail the same way, so
# a margin judged on a left-out source whose framework stays in the fit looks better than it is.
SOURCE_FRAMEWORK = {
    "hf_transformers_perf_train_gpu_one": "hf_trainer",   # S1: transformers Trainer
    "hf_peft": "hf_trainer",                              # S7: peft + accelerate / transformers Trainer (examples/sft)
    "hf_blog_accelerate_deepspeed": "hf_trainer",         # S10: transformers Trainer + accelerate / DeepSpeed
    "litgpt_resource_tables": "litgpt",                   # S3: lit-gpt finetune/lora.py on Lightning Fabric
    "torchtitan_benchmarks": "torchtitan",                # S4
    "ml_engineering_activation_per_layer": "hf_layer_probe",  # S8: one HF decoder layer's forward
    "bigcode_megatron_issue_20": "megatron",              # S11
    "peft_method_comparison": "peft_custom_loop",         # holdout H1: method_comparison/MetaMathQA/run.py
    "torchtune_readme_2024_04": "torchtune",              # holdout H2
    "torchtune_readme_2024_11": "torchtune",              # holdout H3
    "ms_swift_benchmark_2024_01": "ms_swift",             # holdout H4: modelscope/ms-swift `swift sft`
    "qwen_finetune_profiling": "qwen_finetune",           # holdout H5: QwenLM/Qwen finetune.py
}


def framework_of(source_id: str) -> str:
    """The framework a source's runs used (SOURCE_FRAMEWORK; a source not listed is its own)."""
    return SOURCE_FRAMEWORK.get(source_id, source_id)


def _stack(record: dict, approx: list[str]) -> Stack | None:
    if record.get("stack"):  # versions the record states itself (benchmarks/data/holdout_memory.jsonl)
        stack = Stack(**record["stack"])
        if record["source_id"] == "qwen_finetune_profiling" and stack.peft is None:
            # QwenLM/Qwen finetune.py imports peft unpinned; the releases current at the profiling dates
            # (7B/14B rows 2023-10-07/11: peft 0.5.0, 2023-08-22; 1.8B rows with its 2023-11-30 release:
            # 0.6.2, 2023-11-13) both leave LoRA adapters fp32 over the bf16 base (spec/stack.py
            # PEFT_ADAPTERS_IN_BASE_DTYPE)
            approx.append("peft unstated; 0.6 (< 0.7: fp32 adapters) assumed from the profiling dates")
            stack = replace(stack, peft="0.6.2")
        return stack
    if record["id"].startswith("peftdoc-"):
        approx.append("stack unstated; transformers 4.38, torch 2.2 (early 2024) assumed")
        return _PEFT_DOC_STACK
    stack, guessed = _SOURCE_STACKS.get(record["source_id"], (None, ""))
    if guessed:
        approx.append(f"stack partly unstated; {guessed} assumed from the source's date")
    return stack


def _selective_ac_bytes(model: ModelSpec, plan: TrainingPlan) -> int:
    """torchtitan's per-op selective AC keeps, per block, the outputs of the ops in its _save_list
    (aten.mm except every second one, the SDPA kernels; torchtitan/models/llama3/infra/
    parallelize.py, _custom_policy) on top of the block input full AC keeps. Its Llama block runs
    its mms as wq, wk, wv, wo, w1, w3, w2, so wq, wv, w1 (gate) and w2 (down) are kept, plus the
    attention output and its fp32 logsumexp."""
    by_role = {lin.role: lin for lin in model.layer_linears}
    kept = [by_role[r].out_features for r in ("q", "v", "gate", "down") if r in by_role]
    tokens = plan.micro_batch_size * plan.seq_len
    heads = model.num_attention_heads
    per_layer = tokens * (sum(kept) + model.num_attention_heads * model.head_dim) * 2 + tokens * heads * 4
    per_layer //= max(1, plan.tp)
    layers = -(-model.total_layers // plan.pp)
    return per_layer * layers


# lit-gpt finetune/lora.py (0cc02af, Oct 2023: the resource tables' script) calls
# model(input_ids, lm_head_chunk_size=128).
_LITGPT_LM_HEAD_CHUNK = 128


def litgpt_head_cast_bytes(*, seq_len: int, vocab_size: int, hidden_size: int, autocast_itemsize: int,
                           chunk: int = _LITGPT_LM_HEAD_CHUNK) -> int:
    """The 16-bit copies of a frozen fp32 lm_head weight that lit-gpt's chunked head keeps beyond
    the one memkit's standard head prices. lit_gpt/lora.py GPT.forward runs
    `[self.lm_head(x_i) for x_i in x.split(lm_head_chunk_size, dim=1)]`; under torch.autocast
    (--precision bf16-mixed) each call casts the weight anew, since autocast caches only casts of
    leaves that require grad (aten/src/ATen/autocast_mode.cpp, cached_cast), and each chunk's mm
    saves its copy for the input's gradient until the loss backward reaches it. Measured on CPU
    autocast (same cached_cast): tests/unit/test_calibration_mapping.py."""
    chunks = -(-seq_len // chunk)
    return (chunks - 1) * vocab_size * hidden_size * autocast_itemsize


def _litgpt_head_cast_bytes(model: ModelSpec, plan: TrainingPlan) -> int:
    """litgpt_head_cast_bytes for a mapped plan: only under autocast with the head frozen (LoRA).
    Not with a 4-bit base: litgpt's QLoRA runs bf16-true (no autocast) with a 4-bit lm_head, whose
    MatMul4Bit dequantises the weight per chunk and frees it after the matmul (_quantized_base)."""
    num = numerics(plan)
    if not (num.autocast and plan.is_lora) or plan.is_quantized:
        return 0
    return litgpt_head_cast_bytes(seq_len=plan.seq_len, vocab_size=model.vocab_size,
                                  hidden_size=model.hidden_size, autocast_itemsize=num.autocast)


def _is_qlora(record: dict) -> bool:
    return record.get("finetune_type") == "qlora" or bool((record.get("lora") or {}).get("base_quant"))


def _skip_reason(record: dict) -> str:
    if _is_qlora(record) and (record.get("zero_stage") is not None or record.get("fsdp")):
        # The PEFT docs' runs pack the 4-bit weights into bf16 tensors (bnb_4bit_quant_storage,
        # bitsandbytes >= 0.43.0, PR #970) so ZeRO-3 / FSDP can partition them like bf16 params;
        # memkit/plan/quantize.py prices a 4-bit base only whole on every rank (plain PyTorch / DDP).
        how = f"DeepSpeed ZeRO-{record['zero_stage']}" if record.get("zero_stage") is not None else record["fsdp"]
        return (f"QLoRA with 4-bit weights in bf16 storage (bnb_4bit_quant_storage) sharded by {how}: memkit "
                "prices 4-bit bases only unsharded, on plain PyTorch / DDP (memkit/plan/quantize.py)")
    return ""


def _quantized_base(record: dict, approx: list[str]) -> dict:
    """TrainingPlan knobs of an unsharded QLoRA record (memkit/plan/quantize.py) and what its mapping
    approximates. The mapped ones are litgpt's (S3): `--quantize bnb.nf4 | bnb.nf4-dq` names a
    Lightning Fabric BitsandbytesPrecision mode (litgpt finetune/lora.py at 8641822:
    `BitsandbytesPrecision(quantize[4:], dtype)`), '-dq' = compress_statistics=True
    (lightning/fabric/plugins/precision/bitsandbytes.py at 71aed751, _NF4DQLinear / _FP4DQLinear)."""
    mode = ((record.get("lora") or {}).get("base_quant") or "").lower().removeprefix("bnb.")
    if record["source_id"] != "litgpt_resource_tables" or mode not in ("nf4", "nf4-dq", "fp4", "fp4-dq"):
        raise MemkitError(f"calibration record {record['id']}: 4-bit base {mode!r} of "
                          f"{record['source_id']} has no mapping")
    # BitsandbytesPrecision sets the default dtype to bf16 while the model is built and swaps every
    # torch.nn.Linear for bnb Linear4bit (init_context, _ClassReplacementContextManager), with no
    # autocast: the rest, the adapters and the activations are bf16, lm_head is 4-bit too.
    # memkit's 4-bit plans are peft's (prepare_model_for_kbit_training: the rest fp32, bf16
    # autocast), and bf16-pure has none.
    approx.append("litgpt bf16-true 4-bit base (Lightning BitsandbytesPrecision: rest, adapters and activations "
                  "bf16, no autocast) priced as memkit's peft QLoRA: bf16 autocast over an fp32 rest and adapters")
    approx.append("lm_head 4-bit in litgpt (Lightning swaps every torch.nn.Linear; dequantised per chunk), "
                  "fp32 in memkit (transformers keeps lm_head unquantized)")
    # S3 ran bitsandbytes 0.41.1 (SOURCES.md). bitsandbytes < 0.43.2 MatMul4Bit.forward kept
    # `ctx.tensors = (A, B)`, the input of every 4-bit linear, until backward; 0.43.2 keeps (None, B)
    # (bitsandbytes commit 9e75374, PR #1270).
    approx.append("bitsandbytes 0.41.1 keeps each 4-bit linear's input until backward (dropped in 0.43.2, "
                  "PR #1270); memkit prices the newer MatMul4Bit, which keeps none")
    return {"quantize_base": mode.split("-")[0], "double_quant": mode.endswith("-dq")}


def _metric(meas: dict, approx: list[str]) -> str:
    text = meas["metric"].lower()
    if "reserved" in text:
        return "reserved"
    if "max_memory_allocated" in text or "tracemalloc" in text:
        return "allocated"
    if "unstated" in text and "nvidia-smi presumed" in text:
        approx.append("metric unstated by the source; nvidia-smi used presumed")
        return "nvidia_smi"
    if "nvml" in text or "nvidia-smi" in text or meas["scope"] in ("device_used", "whole_device_used_after_training"):
        return "nvidia_smi"
    approx.append(f"metric unstated ({meas['metric']}); compared with allocated")
    return "allocated"


def _model(record: dict, configs_dir: Path, approx: list[str]) -> ModelSpec:
    name = record["model"]["name"]
    if name in _CONFIG_DIRS:
        spec = load_model_spec(str(Path(configs_dir) / _CONFIG_DIRS[name]))
        if name in _APPROX_CONFIGS:
            approx.append(_APPROX_CONFIGS[name])
    elif name.startswith("gpt-") and record["source_id"] == "bigcode_megatron_issue_20":
        spec = spec_from_config(_bigcode_gpt_config(record["model"]), name=name)
        approx.append("Megatron GPT modelled as HF GPT-2 of the same sizes")
    else:
        catalog = _CATALOG_ALIASES.get(name, name)
        if find_catalog_model(catalog) is None:
            raise MemkitError(f"calibration record {record['id']}: model {name!r} is neither in the catalog "
                              f"nor in {configs_dir}; add its config.json there")
        spec = load_model_spec(catalog)
    if record["source_id"] == "litgpt_resource_tables" and spec.hidden_act in ("gelu_new", "gelu_fast", "gelu_accurate"):
        # litgpt's own MLP calls torch.nn.functional.gelu(x, approximate="tanh") (litgpt/model.py,
        # GptNeoxMLP), one aten op that saves its input -- HF's name for it is gelu_pytorch_tanh.
        spec = replace(spec, hidden_act="gelu_pytorch_tanh")
    if record.get("task") == "seq_cls":
        spec = as_sequence_classifier(spec, num_labels=2)
        approx.append("seq-cls head (pooler + 2-way classifier) in place of the MLM head: "
                      "vocab_size set to 2 for the logits term")
    return spec


def _bigcode_gpt_config(m: dict) -> dict:
    """A GPT-2 config.json from a bigcode issue-20 row: learned positions 2048, tied head, dropout
    0.1 (Megatron-LM arguments.py defaults for hidden_dropout and attention_dropout)."""
    return {"model_type": "gpt2", "n_embd": m["hidden_size"], "n_layer": m["num_layers"], "n_head": m["num_heads"],
            "n_inner": m["intermediate_size"], "vocab_size": m["vocab_size"], "n_positions": 2048,
            "activation_function": "gelu", "attn_pdrop": 0.1, "resid_pdrop": 0.1, "embd_pdrop": 0.1,
            "tie_word_embeddings": True}


def as_sequence_classifier(spec: ModelSpec, *, num_labels: int) -> ModelSpec:
    """`spec` with an AutoModelForSequenceClassification head: BertPooler (dense H x H + tanh on the
    first token) and a num_labels classifier (transformers/models/bert/modeling_bert.py,
    BertForSequenceClassification) in place of the MLM head. vocab_size becomes num_labels, since
    the estimator uses it only for the logits / loss term; the word embeddings keep their size in
    embedding_params."""
    h = spec.hidden_size
    head = h * h + h + h * num_labels + num_labels
    num_params = spec.num_params - spec.head_params + head
    return replace(spec, architecture=spec.architecture.replace("ForMaskedLM", "ForSequenceClassification"),
                   vocab_size=num_labels, head_params=head, num_params=num_params, tie_word_embeddings=False)


def _gpu(record: dict) -> str:
    text = record["gpu"].lower()
    for prefix, name in _GPUS:
        if text.startswith(prefix):
            return name
    return ""


def _precision(record: dict, approx: list[str]) -> tuple[str, str]:
    """(memkit precision, engine hint) from the record's precision text."""
    text = record["precision"].lower()
    if text.startswith("fp32"):
        if "presumed" in text:
            approx.append("precision not stated by the source; fp32 presumed")
        return "fp32", ""
    if text.startswith("fp16_mixed"):
        return "fp16", ""
    if text.startswith("bf16_mixed"):
        return "bf16", ""
    if text.startswith("bf16_pure") or text.startswith("bf16 weights"):
        if "trainer bf16=true autocast" in text:
            # HF Trainer bf16=True over a bf16-loaded model: every weight and activation is already bf16,
            # autocast changes only its fp32-listed ops (softmax, log_softmax: aten/src/ATen/autocast_mode.cpp)
            approx.append("Trainer bf16 autocast over bf16 weights priced as bf16-pure (autocast's fp32 ops "
                          "not priced apart)")
        return "bf16-pure", ""
    if text.startswith("bf16 compute"):  # a 4-bit base's compute dtype: its mapping in _quantized_base
        return "bf16", ""
    if text.startswith("unspecified"):
        # bigcode issue 20 states no precision. Its rows differ in heads at fixed layers/width, so
        # they measure the bytes saved per s^2 attention score: 9.0-9.3 B per score per layer
        # (measured differences / (heads x layers x 2048^2); 9.4-9.7 if its MB were MiB). Eager fp32
        # attention saves 9: the softmax output 4 (torch softmax saves its result), the dropout
        # mask 1 (native_dropout, bool on CUDA) and the dropout output 4 (saved by the bmm with V).
        # Megatron fp16 saves 5 (fused scaled-masked softmax: fp16 probs 2 + mask 1 + dropout out 2;
        # megatron/model/fused_softmax.py) or 7 (unfused, softmax in fp32 under query-key layer
        # scaling: 4 + 1 + 2), so fp32 is what the rows show. Engine 'deepspeed' at ZeRO 0 stands
        # for Megatron's apex FusedAdam step (in place: no foreach temporaries).
        approx.append("precision unstated; fp32 inferred from the rows' 9 B per attention score "
                      "(fp16 would save 5-7 B)")
        return "fp32", "deepspeed"
    raise MemkitError(f"calibration record {record['id']}: precision {record['precision']!r} has no mapping")


def _optimizer(record: dict, approx: list[str]) -> str:
    text = (record.get("optimizer") or "").lower()
    if "8bit" in text:
        # PagedAdamW8bit: the states of tensors >= 1e5 elements in CUDA managed memory, outside torch's
        # caching allocator (estimate/states.py BNB_PAGED_MIN_NUMEL)
        return "paged-adamw-8bit" if "paged" in text else "adamw-8bit"
    if "adafactor" in text:
        return "adafactor"
    if "adam" in text:
        if "pagedadamw" in text and "8bit" not in text:
            # bitsandbytes optim/optimizer.py get_state_buffer: a tensor under 1e5 elements gets
            # ordinary torch.zeros_like states, larger ones managed (paged) memory outside torch's allocator.
            if record.get("finetune_type") == "full":
                # torchtune 7B_full_low_memory: every large state is managed memory either way, so the
                # allocator holds the same tensors as under PagedAdamW8bit (estimate/states.py BNB_PAGED_MIN_NUMEL)
                approx.append("bnb PagedAdamW (32-bit) priced as paged-adamw-8bit: states of tensors >= 1e5 elements "
                              "in CUDA managed memory (outside allocated/reserved) either way; the norms' states "
                              "at 8-bit size, nvidia-smi's resident paged states at a quarter")
                return "paged-adamw-8bit"
            else:
                approx.append("bnb PagedAdamW (32-bit) priced as torch AdamW: states of tensors < 1e5 elements "
                              "(every LoRA tensor here) are ordinary CUDA tensors; fused update, no foreach temporary")
        if "adamw_hf" in text:
            approx.append("HF AdamW loops per tensor (no foreach temporary the size of all params)")
        return "adamw"
    raise MemkitError(f"calibration record {record['id']}: optimizer {record.get('optimizer')!r} has no mapping")


def _checkpointing(record: dict, approx: list[str]) -> tuple[str, bool]:
    """(checkpointing, selective): selective AC maps to 'full' with a bracket up to 'none'."""
    text = record["activation_checkpointing"].lower()
    if text.startswith("full"):
        return "full", False
    if text.startswith("selective"):
        approx.append("selective (per-op) AC: full AC plus the outputs torchtitan's policy keeps, added to the "
                      "peak (not replayed); 'none' shown as upper bound")
        return "full", True
    if text.startswith("unspecified"):
        approx.append("activation checkpointing unstated; none assumed")
    return "none", False


def _attention(record: dict) -> str:
    text = record["attention_impl"].lower()
    if "flash_attention_2" in text:
        return "flash"
    if "sdpa" in text:
        return "sdpa"
    return "eager"  # eager, or unstated with s^2 scores evident (bigcode)


def _lora_targets(spec: ModelSpec, targets) -> tuple[str, ...]:
    """The record's LoRA targets as names of spec's linears."""
    by_role: dict[str, str] = {}
    for lin in spec.layer_linears + spec.encoder_layer_linears:
        by_role.setdefault(lin.role, lin.name)
    if isinstance(targets, list) and targets and set(targets) <= set(spec.linear_names()):
        return tuple(targets)  # the spec's own linear names (peft target_modules as written)
    text = " ".join(targets) if isinstance(targets, list) else str(targets)
    text = text.lower()
    if "all-linear" in text:
        return spec.linear_names()
    if "query_key_value" in text:
        return (by_role["qkv"],)
    # query/value (litgpt) or T5 default q, v: the q and v projections, or the fused qkv one
    if "q" in by_role and "v" in by_role:
        return (by_role["q"], by_role["v"])
    return (by_role["qkv"],)


def _plan(record: dict, model: ModelSpec, approx: list[str]
          ) -> tuple[TrainingPlan, Hardware, list[tuple[str, TrainingPlan]]]:
    rid, extras = record["id"], [e.lower() for e in record.get("extras", [])]
    precision, engine_hint = _precision(record, approx)
    optimizer = _optimizer(record, approx)
    checkpointing, selective = _checkpointing(record, approx)
    attention = _attention(record)

    fsdp = (record.get("fsdp") or "").lower()
    zero = record.get("zero_stage")
    if zero is not None:
        engine, zero_stage = "deepspeed", int(zero)
    elif fsdp:
        engine, zero_stage = "torch", 3  # FSDP full shard == ZeRO-3 with engine torch
    else:
        engine, zero_stage = engine_hint or "torch", 0
    offload_opt = "cpu" if record.get("offload_optimizer") else "none"
    offload_par = "cpu" if record.get("offload_params") else "none"

    num_gpus, tp, pp, cp = record["num_gpus"], record.get("tp", 1), record.get("pp", 1), record.get("cp", 1)
    dp = num_gpus // (tp * pp)  # FSDP shards over dp_shard x cp; CP is folded into dp below
    micro, accum, seq = record["micro_batch_size"], record["grad_accum"], record["seq_len"]
    if seq is None:
        seq = _PEFT_TWEET_SEQ_LEN
        approx.append(f"seq_len unpublished (tweets padded per batch); {seq} assumed for encoder and decoder")
    elif model.kind == "encoder-decoder" and "target 64" in (record.get("seq_len_note") or ""):
        approx.append("decoder length 64 priced at the encoder's 128 (memkit has one seq_len)")
    if cp > 1:
        seq //= cp
        approx.append(f"context parallel {cp}: priced as seq_len/cp = {seq} per rank, FSDP over dp_shard x cp")
    if micro is None:
        local = _TITAN_LOCAL_BATCH[rid]
        micro, accum = max(1, local // pp), pp
        approx.append(f"PP microbatches unstated: local batch {local} split into {pp} (torchtitan default)")

    pp_schedule, zero_for_pp = "1f1b", zero_stage
    if pp > 1:
        if any("interleaved" in e for e in extras):
            approx.append("interleaved 1F1B priced as 1F1B")
        if engine == "torch" and zero_stage > 1:
            # torchtitan runs FSDP2 inside each stage; memkit's plan refuses ZeRO>1 with PP, but its torch
            # engine shards states for any stage > 0, so stage 1 prices the same sharded states.
            zero_for_pp = 1
            approx.append("FSDP inside PP stages priced as torch engine zero_stage=1 (states sharded)")
    # torchtitan's TP plan is sequence parallel with loss parallel (torchtitan/parallelisms/
    # parallelize_llama.py apply_tp): priced with plan.sequence_parallel.
    sequence_parallel = tp > 1 and "torchtitan" in record.get("framework", "").lower()
    if any("compile" in e for e in extras):
        approx.append("torch.compile (fused kernels save fewer intermediates)")
    if any("float8" in e for e in extras):
        approx.append("float8 linears (fp8 copies of inputs/weights saved for backward)")
    if any("lm_head computed in 128-token chunks" in e for e in extras):
        approx.append("litgpt chunked lm_head + chunked CE: logits stay bf16, no fp32 upcast")
    loss, loss_path = "standard", "hf"
    if any("chunked output + cross-entropy" in e for e in extras):
        # torchtune CEWithChunkedOutputLoss (torchtune/modules/loss/ce_chunked_output_loss.py): every chunk's
        # 16-bit logits exist at once (TransformerDecoder.forward returns the list; the recipe's _loss_step
        # drops it before backward), each chunk upcast to fp32 for its F.cross_entropy, whose log_softmax saves
        # its fp32 output: the saved bytes of HF's loss path (--loss-path hf), with one chunk's fp32 copy at
        # a time instead of the whole one. memkit's chunked loss saves no log-probs (it recomputes them).
        approx.append("torchtune chunked output + CE (8 chunks, fp32 log-probs of every chunk saved) priced as "
                      "--loss-path hf: the whole fp32 copy and backward gradients instead of one chunk's")
    if ".float()" in record.get("framework", ""):
        # the stated stack upcasts the logits itself and the loop holds them (e.g. torchtune 0.1
        # TransformerDecoder `self.output(h).float()`, the recipe's `logits` alive through backward)
        loss_path = "upcast"
    if engine == "torch" and zero_stage == 3 and precision in ("fp16", "bf16"):
        approx.append("FSDP mixed precision casts params per unit (not torch.autocast)")

    lora = dict(record.get("lora") or {})
    if record["source_id"] == "torchtune_readme_2024_11" and lora:
        # The table's figures are unchanged since it was added (README at 30b8519e8, 2024-09-24, "Readme
        # Updates #1664"), when recipes/configs/llama3_1/8B_lora_single_device.yaml had
        # lora_attn_modules ['q_proj', 'v_proj'] and apply_lora_to_mlp False; the MLP/output_proj
        # targets the record copies came later. The run is priced with the targets of its date.
        lora["targets"] = ["q_proj", "v_proj"]
        approx.append("LoRA targets of the table's date (q_proj, v_proj at 30b8519e8), not of the later config")
    if record["source_id"] == "torchtune_readme_2024_04" and record.get("finetune_type") == "lora" \
            and record["num_gpus"] == 1:
        # The 17.18 GB figure entered the README on 2024-03-21 (a95c6b931, then "estimated ... on A100 GPUs
        # with GPU memory artificially limited ... as reported by torch.cuda.max_memory_allocated()"), before
        # InstructDataset gained max_seq_len (73647e26e, 2024-03-30): alpaca-cleaned untruncated then, so
        # the longest batch (unpublished) may exceed the 512 priced here.
        approx.append("figure carried from the 2024-03-21 table (untruncated alpaca-cleaned, max_memory_allocated "
                      "stated then); priced at max_seq_len 512, a lower bound of that run's longest batch")
    lora_kw = {}
    if _is_qlora(record):
        lora_kw.update(_quantized_base(record, approx))
    if record.get("finetune_type") in ("lora", "qlora"):
        targets = _lora_targets(model, lora.get("targets"))
        lora_kw.update(lora_rank=int(lora.get("rank", 8)), lora_targets=targets,
                       lora_alpha=int(lora.get("alpha", 16)), lora_dropout=float(lora.get("dropout", 0.0)))
        want = lora.get("trainable_params")
        have = model.lora_params(lora_kw["lora_rank"], targets)
        if want and abs(have - want) > 0.01 * want:
            approx.append(f"LoRA trainable params {have:,} vs published {want:,}")

    clip = {"gradient_clipping": float(record["gradient_clipping"])} if "gradient_clipping" in record else {}
    alloc_conf = _alloc_conf(record)
    gpu = _gpu(record)
    if not gpu:
        gpu = "a100-80gb"
        approx.append(f"GPU {record['gpu']!r} unstated; a100-80gb assumed")
    per_node = min(num_gpus, 8)
    hardware = Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node, num_nodes=max(1, num_gpus // per_node))
    plan = TrainingPlan(
        precision=precision, optimizer=optimizer, zero_stage=zero_for_pp, engine=engine,
        offload_optimizer=offload_opt, offload_params=offload_par, checkpointing=checkpointing,
        attention=attention, micro_batch_size=int(micro), grad_accum=int(accum), seq_len=int(seq),
        dp=dp, tp=tp, pp=pp, tp_engine="tp_plan" if engine == "torch" else "autotp",
        sequence_parallel=sequence_parallel,
        pp_schedule=pp_schedule, fsdp_use_orig_params=_use_orig_params(fsdp), loss=loss, loss_path=loss_path,
        optimizer_in_backward=bool(record.get("optimizer_in_backward")), alloc_conf=alloc_conf, **clip, **lora_kw)
    alternatives = [("no-AC", replace(plan, checkpointing="none"))] if selective else []
    if model.kind == "encoder-decoder" and "target 64" in (record.get("seq_len_note") or ""):
        alternatives.append(("all at 64", replace(plan, seq_len=64)))
    return plan, hardware, alternatives


def _alloc_conf(record: dict) -> str:
    """The CUDA allocator a published run used (TrainingPlan.alloc_conf): the record's own
    "alloc_conf" when it states one; torchtitan's rows 'expandable' (they ran torchtitan 9dec370,
    whose documented launcher run_llama_train.sh exports PYTORCH_CUDA_ALLOC_CONF=
    "expandable_segments:True", added in pytorch/torchtitan a5e57e4, 2024-10-22); else torch's
    default segments: no other source states a PYTORCH_CUDA_ALLOC_CONF with its figures (SOURCES.md,
    SOURCES_holdout_memory.md) and most predate expandable_segments (torch 2.1,
    c10/cuda/CUDACachingAllocator.cpp Note [Expandable Segments]). How an expandable run is priced:
    memkit/estimate/memory.py EXPANDABLE_REPLAY_IN_ESTIMATES."""
    if "alloc_conf" in record:
        return record["alloc_conf"]
    return "expandable" if framework_of(record["source_id"]) == "torchtitan" else "default"


def _use_orig_params(fsdp: str) -> bool:
    """FSDP1's use_orig_params as the record's FSDP text gives it: stated, or Lightning Fabric's
    FSDPStrategy, which sets it True with torch >= 2.0 (lightning/fabric/strategies/fsdp.py at
    2.1.0, `self._fsdp_kwargs.setdefault("use_orig_params", True)`); otherwise torch's False."""
    if "use_orig_params=true" in fsdp:
        return True
    return "lightning fsdpstrategy" in fsdp and "use_orig_params=false" not in fsdp


def _summary(plan: TrainingPlan) -> str:
    parts = [f"bs{plan.micro_batch_size}x{plan.seq_len}"]
    if plan.grad_accum > 1:
        parts.append(f"ga{plan.grad_accum}")
    parts.append(plan.precision)
    parts.append(plan.optimizer)
    if plan.is_lora:
        parts.append(f"lora{plan.lora_rank}:{'+'.join(plan.lora_targets) if len(plan.lora_targets) < 4 else 'all'}")
    if plan.checkpointing != "none":
        parts.append("AC")
    parts.append(plan.attention)
    par = f"{plan.engine[:2]}" + (f"-z{plan.zero_stage}" if plan.zero_stage else "")
    if plan.offload_optimizer != "none" or plan.offload_params != "none":
        par += "+off"
    dims = [f"dp{plan.dp}"] + [f"{n}{v}" for n, v in (("tp", plan.tp), ("pp", plan.pp)) if v > 1]
    parts.append(par + " " + "x".join(dims))
    return " ".join(parts)


def _record_summary(record: dict) -> str:
    return (f"bs{record['micro_batch_size']}x{record['seq_len']} {record['precision'].split(' ')[0]} "
            f"{record['finetune_type']} x{record['num_gpus']}")


# ----------------------------------------------------------------------------- scoring

def score(case: Case) -> Outcome:
    """Price `case` with memkit and compare with the measurement."""
    if case.kind == "skip":
        return Outcome(case=case)
    try:
        if case.kind == "activation_probe":
            return _score_probe(case)
        est = estimate_memory(case.model, case.plan, case.hardware, stack=case.stack)
        predicted = getattr(est, METRIC_FIELDS[case.metric]) + case.extra_bytes
        one_shape = {}
        if case.sample_lengths:
            one_shape = {"one shape": predicted}
            predicted = getattr(_varlen(case), METRIC_FIELDS[case.metric]) + case.extra_bytes
    except MemkitError as exc:
        return Outcome(case=case, error=str(exc))
    alts = dict(one_shape)
    for label, plan in case.alternatives:
        try:
            alts[label] = getattr(estimate_memory(case.model, plan, case.hardware, stack=case.stack),
                                  METRIC_FIELDS[case.metric])
        except MemkitError:
            alts[label] = -1
    if case.kind == "regression":
        err = (predicted - case.measured_bytes) / case.measured_bytes * 100
        return Outcome(case=case, predicted_bytes=predicted, error_pct=err, estimate=est, alternatives=alts)
    capacity = case.hardware.gpu.memory_bytes
    if case.kind == "oom":
        return Outcome(case=case, predicted_bytes=predicted, passed=predicted > capacity, estimate=est,
                       detail=f"pred {predicted / capacity:.2f}x device", alternatives=alts)
    # max_fit_batch
    fits = predicted <= capacity
    best = max_fitting_batch(case, limit=max(64, 8 * case.max_fit_batch))
    return Outcome(case=case, predicted_bytes=predicted, passed=fits, estimate=est, alternatives=alts,
                   detail=f"pred max bs {best if best is not None else '>limit'} vs published {case.max_fit_batch}")


def _varlen(case: Case):
    """The case's run through the variable-length replay, its batches padded to their longest sample
    (the Trainer's collators; ms-swift data_collate_fn pads to the batch's longest), on the
    allocator its plan states: the median of varlen.ORDERS seeded epoch orders (step_orders), the
    sources' runs being one random order each (transformers Trainer RandomSampler; ms-swift 1.5
    SwiftMixin._get_train_sampler returns it when train_sampler_random, which SftArguments sets to
    `not test_oom_error`, True by default)."""
    from memkit.estimate.varlen import estimate_varlen, step_orders

    orders = step_orders(list(case.sample_lengths), micro_batch=case.plan.micro_batch_size,
                         seq_len=case.plan.seq_len)
    return estimate_varlen(case.model, case.plan, case.hardware, orders[0], orders=tuple(orders[1:]),
                           expandable_segments=case.plan.alloc_conf == "expandable", stack=case.stack)


def _score_probe(case: Case) -> Outcome:
    """The probe's delta holds what the layer saved plus its output, which has the input's shape and
    dtype (stas00/ml-engineering benchmarks/activation-memory-per-layer.py)."""
    blk = block_activations(case.model, case.plan)
    predicted = blk.saved_bytes + blk.input_bytes
    err = (predicted - case.measured_bytes) / case.measured_bytes * 100
    unit = case.plan.micro_batch_size * case.plan.seq_len * case.model.hidden_size * 2
    return Outcome(case=case, predicted_bytes=predicted, error_pct=err,
                   detail=f"coef {predicted / unit:.1f} vs {case.measured_bytes / unit:.1f}",
                   alternatives={k: v for k, v in blk.by_label.items()})


def max_fitting_batch(case: Case, *, limit: int) -> int | None:
    """Largest micro-batch whose predicted nvidia-smi peak fits the device (0 if none; None if > limit)."""
    capacity = case.hardware.gpu.memory_bytes

    def fits(b: int) -> bool:
        est = estimate_memory(case.model, replace(case.plan, micro_batch_size=b), case.hardware, stack=case.stack)
        return est.nvidia_smi_peak_bytes <= capacity

    if not fits(1):
        return 0
    if fits(limit):
        return None
    lo, hi = 1, limit  # fits(lo), not fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def summarize(outcomes: list[Outcome], *, exact_only: bool = False) -> dict[str, dict[str, float]]:
    """Per source and overall: count, median and mean absolute % error of regression rows (and probe
    rows, reported under their own source), pass / fail counts of bound rows."""
    groups: dict[str, list[Outcome]] = {}
    for o in outcomes:
        if exact_only and not o.case.is_exact:
            continue
        groups.setdefault(o.case.source_id, []).append(o)
        groups.setdefault("ALL", []).append(o)
    out = {}
    for name, rows in groups.items():
        errs = sorted(abs(o.error_pct) for o in rows if o.error_pct is not None
                      and o.case.kind == "regression" and math.isfinite(o.error_pct))
        probe = sorted(abs(o.error_pct) for o in rows if o.error_pct is not None and o.case.kind == "activation_probe")
        signed = [o.error_pct for o in rows if o.error_pct is not None and o.case.kind == "regression"]
        bounds = [o for o in rows if o.passed is not None]
        reg = [o for o in rows if o.error_pct is not None and o.case.kind == "regression"]
        # A plan sized to the 10% headroom holds the measured run when measured <= predicted / 0.9.
        beyond = sum(o.case.measured_bytes > o.predicted_bytes / (1 - HEADROOM) for o in reg)
        covered = sum(o.case.measured_bytes <= upper_bound(o) for o in reg)
        out[name] = {
            "beyond_headroom_pct": 100 * beyond / len(reg) if reg else float("nan"),
            "upper_coverage_pct": 100 * covered / len(reg) if reg else float("nan"),
            "n_regression": len(errs),
            "median_abs_pct": _median(errs),
            "mean_abs_pct": sum(errs) / len(errs) if errs else float("nan"),
            "mean_signed_pct": sum(signed) / len(signed) if signed else float("nan"),
            "n_probe": len(probe),
            "probe_median_abs_pct": _median(probe),
            "bounds_pass": sum(o.passed for o in bounds),
            "bounds_fail": sum(not o.passed for o in bounds),
            "skipped": sum(o.case.kind == "skip" for o in rows),
            "errors": sum(bool(o.error) for o in rows),
        }
    return out


HEADROOM = 0.10
"""memkit suggest's default headroom (planner/space.py DEFAULT_HEADROOM)."""


def upper_bound(o: Outcome) -> int:
    """The row's upper bound with the margin computed WITHOUT its own framework (leave one
    framework out, estimate/residuals_table.py), so coverage is judged as on a framework memkit
    has not seen; a row of a framework outside the calibration (the holdout file) gets the
    published margin, which never saw it either."""
    from memkit.estimate.bounds import margin, uncovered_kinds
    from memkit.estimate.residuals_table import LEAVE_ONE_FRAMEWORK_OUT, RESIDUAL_MARGIN

    table = LEAVE_ONE_FRAMEWORK_OUT.get(framework_of(o.case.source_id), RESIDUAL_MARGIN)
    # a kind of plan no calibration framework covers gets the wider margin, as estimate's bound does
    uncovered = uncovered_kinds(o.case.model, o.case.plan, variable_length=bool(o.case.sample_lengths))
    return int(o.predicted_bytes * (1 + margin(o.case.plan, table, figure=o.case.metric, uncovered=uncovered)))


def framework_coverage(outcomes: list[Outcome]) -> dict[str, tuple[int, int]]:
    """Per framework: (regression rows at or under upper_bound, regression rows)."""
    out: dict[str, tuple[int, int]] = {}
    for o in outcomes:
        if o.case.kind != "regression" or o.error_pct is None:
            continue
        c, n = out.get(framework_of(o.case.source_id), (0, 0))
        out[framework_of(o.case.source_id)] = (c + (o.case.measured_bytes <= upper_bound(o)), n + 1)
    return out


def _median(values: list[float]) -> float:
    if not values:
        return float("nan")
    n = len(values)
    return values[n // 2] if n % 2 else (values[n // 2 - 1] + values[n // 2]) / 2
