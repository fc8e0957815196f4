"""Build (or find in the torch-extensions cache) the DeepSpeed CPU ops the e2e runs load, so no
timed launch pays for a JIT compile (cpu_adam alone takes minutes on a busy 2-core machine).

    python tests/prebuild_ops.py        # what .ci/run does before pytest

tests/conftest.py calls `prebuild()` once per session when e2e tests are collected. The ops:
cpu_adam (ZeRO optimizer offload, DeepSpeedCPUAdam), fused_adam (the CPU FusedAdam DeepSpeed picks
for "AdamW" without offload) and deepspeed_shm_comm (the CPU accelerator's shared-memory
collectives); deepspeed/ops/op_builder/cpu/*.py, created through get_accelerator() as
DeepSpeed itself does (deepspeed/accelerator/cpu_accelerator.py, create_op_builder). They are
built into the folder the runs use: memkit.train.ops.use_install_extensions_dir (this install's
root unless TORCH_EXTENSIONS_DIR is set; it is set here, so every launch of the session inherits it).
"""
from __future__ import annotations

import sys
import time

OPS = ("CPUAdamBuilder", "FusedAdamBuilder", "ShareMemCommBuilder")


def prebuild(ops=OPS) -> dict[str, float]:
    """op name -> seconds it took to build or load; an op this machine cannot build is skipped
    (DeepSpeed then falls back or fails exactly as it would in the run)."""
    from deepspeed.accelerator import get_accelerator

    from memkit.train.ops import probe_cpu_once, use_install_extensions_dir

    # py-cpuinfo asked once per machine, as every memkit launch asks it (memkit/train/ops.py
    # probe_cpu_once): each builder load below asks it twice, 1.2 s a time otherwise
    probe_cpu_once(use_install_extensions_dir())
    took = {}
    for name in ops:
        builder = get_accelerator().create_op_builder(name)
        if builder is None or not builder.is_compatible(verbose=False):
            continue
        start = time.perf_counter()
        builder.load(verbose=False)
        took[builder.name] = time.perf_counter() - start
    return took


if __name__ == "__main__":
    for op, seconds in prebuild().items():
        print(f"deepspeed op {op}: ready in {seconds:.1f} s", file=sys.stderr)
