"""Every command-line number's sane range, in one table: memkit.validate applies it to the flags,
memkit.plan_schema to the same fields of plan.json. Pure (no I/O, no train/cli imports)."""
from __future__ import annotations

from memkit.plan import MAX_MICRO_BATCH  # one bound for the flag and the planner's search

MAX_GLOBAL_BATCH = 2**20
"""Sequences per optimizer step: 2^20 is 16 x the largest published batch (LAMB's 65,536 sequences
for BERT; You et al. 2020, "Large Batch Optimization for Deep Learning", Sec. 4) and 670 x
GPT-3's 1,563 (Brown et al. 2020, Table 2.1); beyond it is a typo. (It was 10^12, which the
planner could not answer in minutes.)"""
MAX_SEQ_LEN = 2**24
"""16M tokens: longer than any released model's context window."""
MAX_SYNTHETIC_TOKENS = 2**28
"""synthetic:N materialises N x seq_len int64 ids, labels and mask (24 bytes/token): 6 GiB."""

# flag dest -> (lowest, highest, what it is). Each limit stated once; `check_args` applies it to
# whichever command has the flag.
LIMITS: dict[str, tuple[float, float, str]] = {
    "micro_batch_size": (1, MAX_MICRO_BATCH, "sequences per GPU per step"),
    "max_micro_batch": (1, MAX_MICRO_BATCH, "sequences per GPU per step"),
    "grad_accum": (1, 2**20, "micro-batches per optimizer step"),
    "global_batch_size": (1, MAX_GLOBAL_BATCH, "sequences per optimizer step"),
    "ref_batch_size": (1, MAX_GLOBAL_BATCH, "sequences per optimizer step"),
    "seq_len": (1, MAX_SEQ_LEN, "tokens per sequence"),
    "target_len": (0, MAX_SEQ_LEN, "decoder tokens per sequence (0 = --seq-len)"),
    "num_labels": (1, 2**20, "classification labels"),
    "num_gpus": (1, 1024, "GPUs per node"),
    "gpus_per_node": (1, 1024, "processes per node"),
    "num_nodes": (1, 100_000, "nodes"),
    "num_machines": (1, 100_000, "nodes"),
    "tp": (1, 1024, "tensor-parallel degree"),
    "pp": (1, 1024, "pipeline-parallel degree"),
    "lora_rank": (0, 65_536, "LoRA rank (0 = full fine-tuning)"),
    "lora_alpha": (1, 2**20, "LoRA alpha"),
    "lora_dropout": (0.0, 0.99, "dropout probability"),
    "num_alternatives": (0, 100, "alternatives to list"),
    "port": (1, 65_535, "TCP port"),  # RFC 6335 Sec. 6: ports are 16-bit, 0 is reserved
    "main_process_port": (1, 65_535, "TCP port"),
    "lr": (1e-12, 100.0, "learning rate"),
    "weight_decay": (0.0, 10.0, "weight decay"),
    "min_lr_ratio": (0.0, 1.0, "fraction of the peak LR"),
    "gradient_clipping": (0.0, 1e6, "max gradient norm (0 = off)"),
    "steps": (1, 10**7, "optimizer steps"),
    "max_steps": (1, 10**9, "optimizer steps"),
    "warmup_steps": (0, 10**9, "optimizer steps"),
    "save_every": (0, 10**9, "optimizer steps (0 = only on a signal)"),
    "save_every_minutes": (0.0, 10**7, "minutes (0 = never by time)"),
    "preempt_grace": (0.1, 86_400.0, "seconds repeats of a stop signal are ignored"),
    "signal_lead": (1, 10**7, "seconds before the time limit"),
    "keep_checkpoints": (1, 10_000, "checkpoints kept"),
    "seed": (0, 2**32 - 1, "random seed"),  # numpy/torch generators take 32-bit seeds portably
    "timeout_s": (1, 10**7, "seconds"),
    "dist_timeout_s": (1, 10**7, "seconds"),
    "num_epochs": (1e-6, 10_000.0, "passes over the data"),  # a sanity cap: beyond it is a typo (1e30)
    "eval_every": (0, 10**9, "optimizer steps (0 = at the end)"),
    # Linux's largest NR_CPUS (arch/x86/Kconfig, MAXSMP); 0 passes here: launch_script says "at least 1 per process"
    "cpus_per_node": (0, 8192, "CPUs per node"),
}
