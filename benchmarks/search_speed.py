"""How long `memkit suggest`'s search takes (DeepSpeed's autotuner needs tens of minutes of real
runs for the same question). Prints a table; asserts nothing (tests never time things).

    python benchmarks/search_speed.py [--repeat 5]

Per row: the request, plan shapes in the space, memory estimates the branch-and-bound search
actually made, step-time estimates it made (plans priced; the machine-independent half of the cost
beside the memory estimates), median process CPU seconds and wall time of the whole search (CPU is what the
search costs; wall also counts whatever else the machine runs), and the plan it picked. Imports
are paid before the table (one untimed search), so CPU is the search alone; each timed search
starts with the step-time kernel cache empty (estimate/kernels.py gemm_time_s), as `memkit suggest` does.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

from memkit.estimate.kernels import _GEMM_CACHE
from memkit.planner import NoPlanFits, Request, search
from memkit.spec.hardware import Hardware, find_gpu
from memkit.spec.hf import load_model_spec
from memkit.units import GIB

# (model, gpu, GPUs per node, nodes, global batch, seq len, layout, host RAM GiB per node); layout:
# "dp" pins tp=pp=1, "if-needed" searches splits only when nothing fits without them, "auto"
# lets tp/pp compete on speed: `memkit suggest` without --tp/--pp (cli/suggest.py, split="auto").
CASES = [
    ("llama-3.1-8b", "rtx-4090", 2, 1, 64, 2048, "dp", 256),
    ("llama-3.1-8b", "rtx-4090", 2, 1, 64, 2048, "if-needed", 256),
    ("llama-3.1-8b", "a100-80gb", 8, 1, 128, 4096, "if-needed", 1024),
    ("qwen2.5-32b", "a100-40gb", 8, 1, 64, 4096, "if-needed", 1024),
    ("llama-3.1-70b", "h100-80gb", 8, 1, 64, 4096, "if-needed", 2048),
    ("llama-3.1-70b", "a100-80gb", 8, 8, 512, 4096, "dp", 1024),
    ("llama-3.1-70b", "a100-80gb", 8, 8, 512, 4096, "auto", 1024),
    ("llama-3.1-70b", "h100-80gb", 8, 8, 1024, 8192, "auto", 2048),
    ("llama-3.1-70b", "rtx-4090", 1, 1, 8, 4096, "if-needed", 256),
    ("llama-3.1-70b", "rtx-4090", 8, 1, 64, 4096, "if-needed", 256),
    # micro-batch options come from factorising the per-rank batch (planner/space.py
    # divisors_up_to), so a 10^9-sequence batch costs what a 64-sequence one does
    ("llama-3.1-8b", "a100-80gb", 8, 1, 1_000_000_000, 2048, "dp", 1024),
    # issue 22's rows as `memkit suggest` runs them, no pins (the README main job; 70B on 8 x 8;
    # a 10^9-sequence batch with the splits searched too)
    ("llama-3.1-8b", "rtx-4090", 2, 1, 64, 2048, "auto", 256),
    ("llama-3.1-70b", "h100-80gb", 8, 8, 512, 4096, "auto", 2048),
    ("llama-3.1-8b", "a100-80gb", 8, 1, 1_000_000_000, 2048, "auto", 1024),
]


def run_case(case, repeat: int) -> list[str]:
    model_name, gpu, per_node, nodes, batch, seq, layout, host_gib = case
    pinned = 1 if layout == "dp" else None
    request = Request(model=load_model_spec(model_name), global_batch_size=batch, seq_len=seq, tp=pinned,
                      pp=pinned, split="auto" if layout == "auto" else "if-needed",
                      hardware=Hardware(gpu=find_gpu(gpu), num_gpus_per_node=per_node, num_nodes=nodes,
                                        host_ram_bytes_per_node=host_gib * GIB))
    times, cpu = [], []
    outcome = ""
    shapes = estimates = step_times = 0
    for _ in range(repeat):
        _GEMM_CACHE.clear()
        start, start_cpu = time.perf_counter(), time.process_time()
        try:
            result = search(request)
            outcome = (f"{result.chosen.label} ({result.chosen.memory.nvidia_smi_peak_bytes / GIB:.1f} GiB, "
                       f"{result.chosen.speed.tokens_per_s:,.0f} tok/s)")
            shapes, estimates, step_times = result.num_structures, result.num_memory_estimates, result.num_step_times
        except NoPlanFits as exc:
            outcome = f"no plan fits ({len(exc.misses)} nearest misses)"
        times.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    layout = "tp=1 pp=1" if layout == "dp" else layout
    return [f"{model_name} {nodes}x{per_node} {gpu}", f"{batch}x{seq}", layout, str(shapes or "-"),
            str(estimates or "-"), str(step_times or "-"), f"{statistics.median(cpu):.2f} s",
            f"{statistics.median(times):.2f} s", outcome]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    from memkit.cli.render import format_table

    run_case(("llama-3.2-1b", "rtx-4090", 1, 1, 8, 1024, "dp", 64), 1)  # the lazy imports, untimed
    rows = [run_case(case, args.repeat) for case in CASES]
    print(format_table(["request (nodes x GPUs)", "batch x seq", "layout", "shapes", "estimates", "step times",
                        "CPU", "wall", "chosen"], rows, right={3, 4, 5, 6, 7}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
