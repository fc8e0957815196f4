"""Every command-line number's sane range, in one table: memkit.validate applies it to the flags,
memkit.plan.plan_schema to the same fields of plan.json. Pure (no I/O, no train/cli imports)."""
from __future__ import annotations

from memkit.plan.plan import MAX_MICRO_BATCH, MAX_SEQ_LEN, knob_ranges  # noqa: F401 (one bound for flag and search)

MAX_GLOBAL_BATCH = 2**20
"""Sequences per optimizer step: 2^20 is 16 x the largest published batch (LAMB's 65,536 sequences
for BERT; You et al. 2020, "Large Batch Optimization for Deep Learning", Sec. 4) and 670 x
GPT-3's 1,563 (Brown et al. 2020, Table 2.1); beyond it is a typo. (It was 10^12, which the
planner could not answer in minutes.)"""
MAX_SYNTHETIC_TOKENS = 2**28
"""synthetic:N materialises N x seq_len int64 ids, labels and mask (24 bytes/token): 6 GiB."""

# flag dest -> (lowest, highest, what it is). Each limit stated once; `check_args` applies it to
# whichever command has the flag. The plan knobs' ranges are declared with the knobs (memkit/plan/plan.py).
LIMITS: dict[str, tuple[float, float, str]] = {
    **knob_ranges(),
    "max_micro_batch": (1, MAX_MICRO_BATCH, "sequences per GPU per step"),
    "global_batch_size": (1, MAX_GLOBAL_BATCH, "sequences per optimizer step"),
    "ref_batch_size": (1, MAX_GLOBAL_BATCH, "sequences per optimizer step"),
    "num_gpus": (1, 1024, "GPUs per node"),
    "gpus_per_node": (1, 1024, "processes per node"),
    "num_nodes": (1, 100_000, "nodes"),
    "num_machines": (1, 100_000, "nodes"),
    "num_alternatives": (0, 100, "alternatives to list"),
    "port": (1, 65_535, "TCP port"),  # RFC 6335 Sec. 6: ports are 16-bit, 0 is reserved
    "main_process_port": (1, 65_535, "TCP port"),
    "lr": (1e-12, 100.0, "learning rate"),
    "weight_decay": (0.0, 10.0, "weight decay"),
    "min_lr_ratio": (0.0, 1.0, "fraction of the peak LR"),
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
