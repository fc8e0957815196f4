"""`memkit gpus`: the GPU catalog (presets/gpus.json) the estimator and planner price plans on."""
from __future__ import annotations

import json

from memkit.cli.render import format_table
from memkit.spec.hardware import gpu_catalog
from memkit.units import GIB, MIB

HELP = "list the GPU catalog (names accepted by --gpu)"

_HEADERS = ["name", "memory (GiB)", "bf16", "bf16/fp16 TFLOPS", "HBM GB/s", "intra-node GB/s", "aliases"]


def add_arguments(p) -> None:
    p.add_argument("--json", action="store_true", help="print a JSON list")


def run(args) -> int:
    gpus = list(gpu_catalog().values())
    if args.json:
        print(json.dumps([{"name": g.name, "memory_mib": g.memory_bytes // MIB, "bf16": g.bf16,
                           "fp32_tflops": g.fp32_tflops, "tf32_tflops": g.tf32_tflops,
                           "fp16_tflops": g.fp16_tflops, "bf16_tflops": g.bf16_tflops, "hbm_gbps": g.hbm_gbps,
                           "intra_node_gbps": g.intra_node_gbps, "pcie_gbps": g.pcie_gbps,
                           "cuda_context_mib": g.cuda_context_bytes // MIB, "aliases": list(g.aliases)}
                          for g in gpus], indent=1))
        return 0
    rows = [[g.name, f"{g.memory_bytes / GIB:.1f}", "yes" if g.bf16 else "no",
             f"{g.bf16_tflops:g}/{g.fp16_tflops:g}" if g.bf16 else f"-/{g.fp16_tflops:g}",
             f"{g.hbm_gbps:g}", f"{g.intra_node_gbps:g}", ", ".join(g.aliases)] for g in gpus]
    print(format_table(_HEADERS, rows, right={1, 3, 4, 5}))
    return 0
